"""One deployment gate for every worker process (`switchyard serve --workers N`).

A gate (policy/admission.py) is a queue with an order, a service-time model and the
tasks it admitted: state that is only exact in one place. So with several workers the
real `DeploymentGate`s run in the control plane, and each worker's `RemoteGate` asks
there for a slot over the control plane's internal HTTP server (api/internal.py): one
queue, one order, one model for N workers as for one process.

- `RemoteGate` (in a worker) has the gate's interface as the queue stage uses it
  (policy/stages_queue.py): `try_acquire` never grants (a slot is the control plane's
  to give), `acquire` is one HTTP call that returns when the slot is granted or
  refused, `release` sends the slot back without waiting. A request cancelled while it
  waits closes its call; the control plane's wait is cancelled with it, and the real
  gate's cancel path gives back a slot granted in that instant.
- `Leases` (in the control plane) runs the real gates and counts the slots each worker
  holds per gate, so a worker that dies (the supervisor sees it) has its slots given
  back (`release_worker`): its requests died with it.
- `host_gates` (in a worker) reads every gate's counts from the control plane
  (`Leases.view`), so a worker's /admin/live shows the host's queues, not its slice.

Only gates with a `max_concurrency` are remote: an unlimited gate grants at once and
its count only feeds estimates, so each worker keeps its own.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Mapping
from typing import Any

import aiohttp
import orjson

from switchyard.engines.bounded import read_bounded
from switchyard.errors import (
    DeadlineExceeded,
    DeadlineUnreachable,
    Overloaded,
    QueueFull,
    SwitchyardError,
)
from switchyard.policy.admission import STANDARD, Admission, DeploymentGate, Priority, SlotAsk

log = logging.getLogger("switchyard.workers")

# The gate's refusals, by code: rebuilt in the worker as the real gate raised them.
_REFUSALS: dict[str, type[SwitchyardError]] = {
    c.code: c for c in (QueueFull, DeadlineExceeded, DeadlineUnreachable, Overloaded)
}
_MAX_TASK_PART = 256  # a task key's parts, as the task store bounds them
VIEW_TIMEOUT_S = 1.0  # a live view waits this long for the control plane's counts
MAX_VIEW = 1 << 20  # bytes of the control plane's counts: ~60 per gate, a gate per model


def ask_json(ask: SlotAsk) -> dict[str, Any]:
    """A slot ask on the wire: the task key is (tenant, task id)."""
    task = list(ask.task) if isinstance(ask.task, tuple) else None
    return {"priority": int(ask.priority), "task": task, "step": ask.step, "planned": ask.planned}


def ask_from(data: Any) -> SlotAsk:
    """The slot ask a worker sent; anything malformed is a standard single call (the
    sender is our own worker, so this only bounds what a bug could send)."""
    if not isinstance(data, dict):
        return STANDARD
    p = data.get("priority")
    priority = Priority(p) if isinstance(p, int) and 0 <= p < len(Priority) else Priority.STANDARD
    raw = data.get("task")
    task = None
    if isinstance(raw, list) and len(raw) == 2 and all(isinstance(x, str) for x in raw):
        task = (raw[0][:_MAX_TASK_PART], raw[1][:_MAX_TASK_PART])
    step, planned = data.get("step"), data.get("planned")
    return SlotAsk(
        priority,
        task,
        step if isinstance(step, int) else None,
        planned if isinstance(planned, int) else None,
    )


class Leases:
    """The control plane's side: the real gates, and each worker's slots in them, by the
    id the worker gave its ask."""

    MAX_ABANDONED = 4096

    def __init__(self, gates: Mapping[str, DeploymentGate]) -> None:
        self.gates = gates
        self._held: dict[str, dict[str, DeploymentGate]] = {}  # worker -> slot id -> gate
        self._waiting: dict[tuple[str, str], asyncio.Task[Any]] = {}
        # Asks given up on while waiting or before they arrived here (the abandon can
        # overtake the ask on another connection): their grant is given back at once.
        self._abandoned: dict[tuple[str, str], None] = {}
        # Workers declared dead: a grant that races their end (asyncio's wait_for may
        # return a result it was cancelled with) is given back, never held for them.
        self._dead: dict[str, None] = {}

    def gate(self, alias: str) -> DeploymentGate | None:
        gate = self.gates.get(alias)
        return gate if gate is not None and gate.max_concurrency is not None else None

    async def acquire(
        self,
        worker: str,
        slot: str,
        gate: DeploymentGate,
        remaining_s: float | None,
        ask: SlotAsk,
    ) -> Admission:
        """Wait at `gate` for the worker's ask; cancelled by `abandon` or
        `release_worker` (the real gate gives back a slot granted in that instant)."""
        key = (worker, slot)
        if self._gone(key):
            raise asyncio.CancelledError
        deadline = math.inf if remaining_s is None else time.perf_counter() + remaining_s
        task = asyncio.current_task()
        assert task is not None
        self._waiting[key] = task
        try:
            adm = await gate.acquire(deadline, ask)
        finally:
            self._waiting.pop(key, None)
        if self._gone(key):
            gate.release()
            raise asyncio.CancelledError
        self._held.setdefault(worker, {})[slot] = gate
        return adm

    def _gone(self, key: tuple[str, str]) -> bool:
        """Whether the ask `key` was abandoned or its worker died (forgotten then)."""
        if key in self._abandoned:
            del self._abandoned[key]
            return True
        return key[0] in self._dead

    def release(
        self, worker: str, slot: str, held_s: float | None, tokens: int | None, ask: SlotAsk
    ) -> bool:
        """Give back `worker`'s slot `slot`; False if it holds no such slot (already
        given back, or the worker was declared dead)."""
        gate = (self._held.get(worker) or {}).pop(slot, None)
        if gate is None:
            return False
        gate.release(held_s, tokens, ask)
        return True

    def abandon(self, worker: str, slot: str) -> None:
        """The worker's request gave up on the ask `slot` (it was cancelled): its wait
        ends, and its slot, if granted, is given back."""
        key = (worker, slot)
        if self.release(worker, slot, None, None, STANDARD):
            return
        # Still waiting, or not arrived yet: either way its grant must not be kept.
        self._abandoned[key] = None
        while len(self._abandoned) > self.MAX_ABANDONED:
            del self._abandoned[next(iter(self._abandoned))]
        waiting = self._waiting.get(key)
        if waiting is not None:
            waiting.cancel()

    def release_worker(self, worker: str) -> int:
        """Give back every slot a dead worker held and end its waits; how many slots."""
        self._dead[worker] = None
        while len(self._dead) > self.MAX_ABANDONED:
            del self._dead[next(iter(self._dead))]
        for (w, _), task in list(self._waiting.items()):
            if w == worker:
                task.cancel()
        held = self._held.pop(worker, None) or {}
        for gate in held.values():
            gate.release()
        return len(held)

    def held(self, worker: str) -> int:
        return len(self._held.get(worker) or {})

    def view(self) -> dict[str, dict[str, int | None]]:
        """Each remote gate's slots in use, its waiters and its limit, over every worker."""
        return {
            alias: {"in_flight": g.in_flight, "queued": g.queued, "limit": g.max_concurrency}
            for alias, g in self.gates.items()
            if g.max_concurrency is not None
        }


async def host_gates(
    control_url: str, token: str, timeout_s: float = VIEW_TIMEOUT_S
) -> dict[str, dict[str, int]] | None:
    """Every remote gate's `in_flight` and `queued` as the control plane counts them
    (`Leases.view`), or None when it does not answer in `timeout_s` or answers more
    than MAX_VIEW bytes: a live view is shown without them rather than late, and a
    broken control plane cannot make a worker hold an unbounded reply. A gate whose
    counts are not two counts (integers, not booleans, not negative) is left out."""
    data = await control_json(control_url, "/gates", token, MAX_VIEW, timeout_s, "gate counts")
    if not isinstance(data, dict):
        return None
    return {
        alias: {"in_flight": v["in_flight"], "queued": v["queued"]}
        for alias, v in data.items()
        if isinstance(v, dict) and _count(v.get("in_flight")) and _count(v.get("queued"))
    }


async def control_json(
    control_url: str, path: str, token: str, limit: int, timeout_s: float, what: str
) -> Any:
    """A worker's GET of `path` from its control plane: the JSON it answers, or None
    (logged as `what`) when it does not answer 200 within `timeout_s`, answers more than
    `limit` bytes (engines/bounded.py) or answers what is not JSON."""
    try:
        async with (
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as session,
            session.get(
                f"{control_url.rstrip('/')}{path}", headers={"authorization": f"Bearer {token}"}
            ) as r,
        ):
            if r.status != 200:
                return None
            raw = await read_bounded(r, limit)
        if raw is None:
            log.warning("the control plane's %s are over %d bytes", what, limit)
            return None
        return orjson.loads(raw)
    except (aiohttp.ClientError, OSError, TimeoutError, orjson.JSONDecodeError) as exc:
        log.warning("the control plane's %s are unavailable: %s", what, exc)
        return None


def _count(value: object) -> bool:
    return type(value) is int and value >= 0


class RemoteGate:
    """A worker's view of a gate that runs in the control plane (see the module doc)."""

    def __init__(
        self,
        gate: DeploymentGate,
        url: str,
        token: str,
        worker: str,
        timeout_s: float = 5.0,
    ) -> None:
        # The configured gate this one stands for: its name, limits and policy.
        self.name = gate.name
        self.max_concurrency = gate.max_concurrency
        self.queue_size = gate.queue_size
        self.policy = gate.policy
        self.others = None
        self.in_flight = 0  # as of the control plane's last answer (evidence only)
        self.queued = 0
        self.waiting = 0  # this worker's asks not answered yet (its own live view)
        self._url = f"{url.rstrip('/')}/gates/{gate.name}"
        self._headers = {"authorization": f"Bearer {token}", "content-type": "application/json"}
        self._worker = worker
        self._timeout_s = timeout_s
        self._session: aiohttp.ClientSession | None = None
        self._sending: set[asyncio.Task[None]] = set()
        self._next = 0
        self._slots: list[str] = []  # the slots this worker holds here (fungible)

    @property
    def task_aware(self) -> bool:
        return self.policy == "task_aware"

    @property
    def held(self) -> int:
        """The slots this worker holds at the gate now (its own live view)."""
        return len(self._slots)

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=self._timeout_s)
            )
        return self._session

    def try_acquire(self, ask: SlotAsk = STANDARD, deadline: float = math.inf) -> None:
        """Never grants here: every slot is the control plane's to give."""
        return None

    async def acquire(self, deadline: float, ask: SlotAsk = STANDARD) -> Admission:
        start = time.perf_counter()
        remaining = None if math.isinf(deadline) else max(0.0, deadline - start)
        self._next += 1
        slot = str(self._next)
        body = orjson.dumps(
            {"worker": self._worker, "slot": slot, "remaining_s": remaining, "ask": ask_json(ask)}
        )
        self.waiting += 1
        try:
            async with self._client().post(
                self._url + "/acquire", data=body, headers=self._headers
            ) as r:
                data = orjson.loads(await r.read())
                status = r.status
        except asyncio.CancelledError:
            # The request is gone: the slot, if granted meanwhile, goes back.
            self._send("/abandon", {"worker": self._worker, "slot": slot})
            raise
        except (aiohttp.ClientError, OSError, orjson.JSONDecodeError) as exc:
            log.error("the control plane's gate '%s' did not answer: %s", self.name, exc)
            self._send("/abandon", {"worker": self._worker, "slot": slot})
            raise Overloaded(
                f"model '{self.name}' cannot take a slot now (the gateway's control plane "
                "is not answering); retry shortly"
            ) from None
        finally:
            self.waiting -= 1
        if status != 200:
            raise _refusal(data, status)
        self._slots.append(slot)
        self.in_flight, self.queued = int(data["in_flight"]), int(data["queued"])
        evidence = data.get("evidence")
        return Admission(
            float(data["waited_s"]),
            self.in_flight,
            self.queued,
            evidence if isinstance(evidence, dict) else None,
        )

    def release(
        self, held_s: float | None = None, tokens: int | None = None, ask: SlotAsk = STANDARD
    ) -> None:
        if not self._slots:
            return
        body = {
            "worker": self._worker,
            "slot": self._slots.pop(),
            "held_s": held_s,
            "tokens": tokens,
            "ask": ask_json(ask),
        }
        self._send("/release", body)

    def _send(self, path: str, body: dict[str, Any]) -> None:
        task = asyncio.get_running_loop().create_task(self._send_release(path, orjson.dumps(body)))
        self._sending.add(task)
        task.add_done_callback(self._sending.discard)

    async def _send_release(self, path: str, body: bytes) -> None:
        for pause in (0.0, 0.1, 0.5, 2.0):
            await asyncio.sleep(pause)
            try:
                async with self._client().post(
                    self._url + path, data=body, headers=self._headers
                ) as r:
                    await r.read()
                    return
            except (aiohttp.ClientError, OSError) as exc:
                log.warning("releasing a slot at gate '%s' failed (%s); retrying", self.name, exc)
        # The supervisor gives back a dead worker's slots; a live worker whose control
        # plane stayed away this long has lost it too (the supervisor stops then).
        log.error("a slot at gate '%s' could not be given back", self.name)

    async def close(self) -> None:
        if self._sending:
            await asyncio.gather(*self._sending, return_exceptions=True)
        if self._session is not None:
            await self._session.close()


def _refusal(data: Any, status: int) -> SwitchyardError:
    """The real gate's refusal, rebuilt from its body."""
    err = data.get("error") if isinstance(data, dict) else None
    code = err.get("code") if isinstance(err, dict) else None
    message = err.get("message") if isinstance(err, dict) else None
    cls = _REFUSALS.get(code) if isinstance(code, str) else None
    if cls is None or not isinstance(message, str):
        return Overloaded("the gateway's control plane refused a slot; retry shortly")
    exc = cls(message)
    retry = data.get("retry_after")
    if isinstance(retry, str):
        exc.headers["Retry-After"] = retry[:16]
    evidence = data.get("evidence")
    if isinstance(evidence, dict):
        exc.evidence = evidence  # type: ignore[attr-defined]
    return exc
