"""The residency pool: which local models are loaded, under a memory budget and a cap.

Engines load at start unless they are `lazy`; a lazy (or evicted, or idle-unloaded)
engine is cold and loads on its first request. Loading makes room first: the least
recently used loaded engine that is not pinned, not serving a request and loaded for at
least `min_residency_s` is evicted, until the new one fits both `max_loaded` and
`memory_budget_mb`. Requests for a loading model wait for that one load (bounded by
`load_queue` and by their deadline). An engine unused for its idle TTL is unloaded.

Each request's residency decision says `hot`, or `cold-load` with the load's time and
what was evicted and why; refusals are 503 `model_loading` with Retry-After.

Adapters have residency of their own inside their engine: at most `max_adapters`
loaded (warm, or hot while a request uses one) and at most `max_active_adapters` hot
at once. A request for a warm adapter with a free active slot promotes it; one for a
cold adapter loads it, in place of the least recently used idle loaded one (vLLM at
run time; llama-server, which loads adapters only at start, by draining its requests
and restarting with the new set). A request that cannot be served at once waits in
its engine's queue, in arrival order, until its deadline (then 503 `adapter_busy`).
Where base requests must not share a batch with adapter requests (vLLM on CPU), the
base is one more member of that queue and takes turns with the adapters.

What a model costs in memory, measured or estimated, is engines/pool_memory.py's.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from switchyard.config import EnginesConfig
from switchyard.engines.llamacpp import AdapterFile, EngineState, ManagedLlamaCpp
from switchyard.engines.pool_memory import estimate_gguf_mb, estimate_mb, kv_bytes_per_token
from switchyard.errors import AdapterBusy, EngineFailed, EngineNotReady, ModelLoading
from switchyard.outcomes import Residency as Outcome

__all__ = [
    "BASE",
    "EnginePool",
    "Residency",
    "estimate_gguf_mb",
    "estimate_mb",
    "kv_bytes_per_token",
]

log = logging.getLogger("switchyard.engine")
_HOT = Outcome.HOT  # bound once: every request to a loaded engine records it

# The cold start a model never loaded before is expected to take.
_FIRST_LOAD_S = 10.0


@dataclass(slots=True)
class Residency:
    """One request's residency decision."""

    outcome: Outcome  # HOT | COLD_LOAD
    reason: str
    evidence: dict[str, Any] = field(default_factory=dict)


class EnginePool:
    def __init__(
        self,
        engines: dict[str, ManagedLlamaCpp],
        cfg: EnginesConfig,
        on_event: Callable[[str, str, float | None], None] | None = None,
        on_memory: Callable[[str, float | None], None] | None = None,
        on_adapter: Callable[[str, str, str, float | None], None] | None = None,
    ) -> None:
        self.engines = engines
        self.cfg = cfg
        self.on_event = on_event  # (event, alias, seconds): "load", "evict", "unload"
        self.on_memory = on_memory  # (alias, MiB) as measured
        # (event, engine alias, adapter, seconds): "load", "evict", "promote"
        self.on_adapter = on_adapter
        self._lock = asyncio.Lock()  # one load (and its evictions) decided at a time
        self._waiting: dict[str, int] = {}
        self._reaper: asyncio.Task[None] | None = None
        self._reports: set[asyncio.Task[None]] = set()
        self.evictions = 0

    # -- state ------------------------------------------------------------------
    def loaded(self) -> list[ManagedLlamaCpp]:
        return [e for e in self.engines.values() if not e.cold and not e.failed]

    def used_mb(self, without: ManagedLlamaCpp | None = None) -> float:
        return sum(estimate_mb(e) for e in self.loaded() if e is not without)

    def ttl(self, e: ManagedLlamaCpp) -> float:
        return self.cfg.idle_ttl_s if e.spec.idle_ttl_s is None else e.spec.idle_ttl_s

    def describe(self) -> dict[str, Any]:
        return {
            "memory_budget_mb": self.cfg.memory_budget_mb,
            "max_loaded": self.cfg.max_loaded,
            "idle_ttl_s": self.cfg.idle_ttl_s,
            "min_residency_s": self.cfg.min_residency_s,
            "loaded": sorted(e.alias for e in self.loaded()),
            "memory_used_mb": round(self.used_mb(), 1),
            "evictions": self.evictions,
            "models": {
                a: {
                    "state": e.state.value,
                    "memory_mb": round(estimate_mb(e), 1),
                    "measured": e.memory_mb is not None,
                    "idle_s": None if e.cold else round(time.monotonic() - e.last_used, 1),
                    "pinned": e.spec.pinned,
                    "loads": e.loads,
                }
                for a, e in sorted(self.engines.items())
            },
        }

    # -- lifecycle --------------------------------------------------------------
    def start(self) -> None:
        """Load what is not lazy (pinned first), as far as the budget allows."""
        order = sorted(self.engines.values(), key=lambda e: (not e.spec.pinned, e.alias))
        budget, cap = self.cfg.memory_budget_mb, self.cfg.max_loaded
        used, n = 0.0, 0
        for e in order:
            if e.spec.lazy and not e.spec.pinned:
                continue
            cost = estimate_mb(e)
            if (cap is not None and n + 1 > cap) or (
                budget is not None and used + cost > budget and n > 0
            ):
                log.warning("engine %s stays cold at start: the pool is full", e.alias)
                continue
            used, n = used + cost, n + 1
            e.start()
            self._reports.add(asyncio.create_task(self._report_load(e)))
        if self._reaper is None:
            self._reaper = asyncio.create_task(self._reap(), name="engine-pool-reaper")

    async def _report_load(self, e: ManagedLlamaCpp) -> None:
        """A load at start is a load too (metrics), once it has an outcome."""
        while not (e.ready or e.failed or e.cold):
            await e.wait_ready(1.0)
        if e.ready and self.on_event is not None:
            self.on_event("load", e.alias, e.cold_start_s)

    async def stop(self) -> None:
        for t in self._reports:
            t.cancel()
        if self._reaper is not None:
            self._reaper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reaper
            self._reaper = None

    async def _reap(self) -> None:
        """Unload engines idle past their TTL (never a pinned or busy one); measure the
        memory of the loaded ones."""
        while True:
            await asyncio.sleep(1.0)
            now = time.monotonic()
            for e in list(self.engines.values()):
                ttl = self.ttl(e)
                if (
                    ttl > 0
                    and e.ready
                    and not e.spec.pinned
                    and e.in_flight == 0
                    and now - e.last_used >= ttl
                ):
                    log.info("engine %s idle %.0fs: unloading", e.alias, now - e.last_used)
                    await e.unload()
                    if self.on_event is not None:
                        self.on_event("unload", e.alias, None)
            for e in self.loaded():
                if e.ready:
                    mb = e.measure()
                    if self.on_memory is not None:
                        self.on_memory(e.alias, mb)

    # -- a request's residency ---------------------------------------------------
    def hold(self, e: ManagedLlamaCpp) -> None:
        e.in_flight += 1
        e.last_used = time.monotonic()
        if e.busy_since is None:
            e.busy_since = e.last_used

    @staticmethod
    def release(e: ManagedLlamaCpp, adapter: str | None = None) -> None:
        e.in_flight -= 1
        e.last_used = time.monotonic()
        if e.in_flight <= 0 and e.busy_since is not None:
            e.busy_s += e.last_used - e.busy_since
            e.busy_since = None
        if adapter is not None:
            e.adapter_in_flight[adapter] -= 1
            e.adapter_last_used[adapter] = e.last_used
            if e.adapter_in_flight[adapter] == 0:
                _kick(e)  # an active slot is free, or this adapter may be evicted

    def expected_load_s(self, e: ManagedLlamaCpp) -> float:
        return e.cold_start_s if e.cold_start_s is not None else _FIRST_LOAD_S

    def hot(self, e: ManagedLlamaCpp) -> Residency | None:
        """The engine is loaded: hold it for this request (release() at settle)."""
        if not e.ready or e.draining is not None:
            return None
        self.hold(e)
        return Residency(_HOT, "the model is loaded", {"memory_mb": _r(estimate_mb(e))})

    async def acquire(self, e: ManagedLlamaCpp, remaining_s: float) -> Residency:
        """Make `e` serve this request: at once when loaded, else after one load (made
        room for first). Holds the engine (release() at settle)."""
        t_drain = time.perf_counter()
        while e.draining is not None:  # it restarts to change its adapters: wait for it
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(e.draining.wait(), remaining_s)
            remaining_s -= time.perf_counter() - t_drain
            if remaining_s <= 0:
                raise ModelLoading(
                    f"the model '{e.alias}' is restarting to change its adapters; retry shortly",
                    retry_after=max(1, round(self.expected_load_s(e))),
                )
        now = self.hot(e)
        if now is not None:
            if time.perf_counter() - t_drain > 0.001:
                now.reason = "the model is loaded (after it restarted to change its adapters)"
                now.evidence["waited_ms"] = _r((time.perf_counter() - t_drain) * 1000.0)
            return now
        if e.failed:
            raise EngineFailed(
                f"the model '{e.alias}' failed to start and is not served: {e.reason}"
            )
        if e.state is EngineState.RESTARTING:
            # It crashed and waits out its backoff: refuse now rather than hold
            # requests on an engine that may crash again.
            raise EngineNotReady(
                f"the model '{e.alias}' is not ready yet (engine state: restarting); retry shortly"
            )
        expected = self.expected_load_s(e)
        if remaining_s < expected:
            raise ModelLoading(
                f"the model '{e.alias}' is not loaded and its load (~{expected:.1f}s) "
                f"would not fit this request's deadline ({remaining_s:.1f}s left)",
                retry_after=max(1, round(expected)),
            )
        waiting = self._waiting.get(e.alias, 0)
        if waiting >= self.cfg.load_queue:
            raise ModelLoading(
                f"the model '{e.alias}' is loading and {waiting} requests already wait "
                f"for it (engines.load_queue)",
                retry_after=max(1, round(expected)),
            )
        self._waiting[e.alias] = waiting + 1
        t0 = time.perf_counter()
        evicted: list[dict[str, Any]] = []
        started_here = False
        try:
            async with self._lock:
                if e.cold and not e.failed:
                    evicted = await self._make_room(e)
                    e.start()
                    started_here = True
            ok = await _wait_ready(e, remaining_s - (time.perf_counter() - t0))
        finally:
            self._waiting[e.alias] -= 1
        load_s = time.perf_counter() - t0
        if not ok:
            if e.failed:
                raise EngineFailed(
                    f"the model '{e.alias}' failed to load and is not served: {e.reason}"
                )
            raise ModelLoading(
                f"the model '{e.alias}' is still loading; retry shortly",
                retry_after=max(1, round(expected)),
            )
        if started_here and self.on_event is not None:
            self.on_event("load", e.alias, e.cold_start_s)
        self.hold(e)
        evidence: dict[str, Any] = {
            "load_ms": round(load_s * 1000.0, 1),
            "joined_load": not started_here,
            "evicted": evicted,
            "memory_mb": _r(estimate_mb(e)),
            "memory_used_mb": _r(self.used_mb()),
            "memory_budget_mb": self.cfg.memory_budget_mb,
        }
        why = "loaded on demand" if started_here else "waited for its load in progress"
        if evicted:
            why += f", evicting {', '.join(v['alias'] for v in evicted)}"
        return Residency(Outcome.COLD_LOAD, why, evidence)

    # -- a request's adapter ------------------------------------------------------
    def adapter_now(self, e: ManagedLlamaCpp, name: str) -> dict[str, Any] | None:
        """Make the adapter active for this request at once if nobody waits before it:
        it is hot (join), or warm with an active slot free (promote). Else None: the
        request waits in `adapter()`. The engine is held by this request."""
        if e.adapter_waiters or e.draining is not None:
            return None
        return self._admit(e, name, 0.0)

    def _admit(self, e: ManagedLlamaCpp, name: str, waited_s: float) -> dict[str, Any] | None:
        if name == BASE:  # kept apart: only while no adapter request runs
            if not e.ready or _active(e) > 0:
                return None
            n = e.adapter_in_flight.get(BASE, 0)
            e.adapter_in_flight[BASE] = n + 1
            turn: dict[str, Any] = {"base_apart": "joined base requests" if n else "took its turn"}
            if waited_s > 0:
                turn["adapter_waited_ms"] = _r(waited_s * 1000.0)
            return turn
        if name not in e.adapter_ids or name in e.adapter_loading or not e.ready:
            return None
        if e.adapter_in_flight.get(BASE, 0) > 0:  # base requests kept apart run now
            return None
        n = e.adapter_in_flight.get(name, 0)
        cap = e.spec.active_adapters
        active = _active(e)
        if n == 0 and active >= cap:
            return None
        e.adapter_in_flight[name] = n + 1
        e.adapter_last_used[name] = time.monotonic()
        out: dict[str, Any] = {
            "adapter_state": "hot" if n else "warm",  # before this request
            "adapter_action": "joined" if n else "promoted",
            "adapter_active": active + (0 if n else 1),
            "max_active_adapters": cap,
        }
        if waited_s > 0:
            out["adapter_waited_ms"] = _r(waited_s * 1000.0)
        if not n and self.on_adapter is not None:
            self.on_adapter("promote", e.alias, name, None)
        return out

    async def adapter(self, e: ManagedLlamaCpp, name: str, remaining_s: float) -> dict[str, Any]:
        """Wait, in arrival order, until the adapter can be active for this request:
        joined, promoted, or loaded (cold) in place of the least recently used idle
        one. Refuses with 503 adapter_busy at the deadline."""
        a = e.adapter_file(name)
        assert a is not None or name == BASE
        t0 = time.perf_counter()
        deadline = t0 + remaining_s
        me = asyncio.Event()
        e.adapter_waiters.append(me)
        e.adapter_pending += 1
        state = e.adapter_state(name)
        try:
            while True:
                why = e.adapter_errors.get(name)
                if why is not None:
                    raise EngineFailed(f"the adapter '{name}' is not served: {why}")
                if e.adapter_waiters[0] is me:
                    got = self._admit(e, name, time.perf_counter() - t0)
                    if got is not None:
                        return got
                    if (
                        a is not None
                        and e.ready
                        and name not in e.adapter_ids
                        and self._can_load(e)
                    ):
                        loaded = await self._load_adapter(e, a, deadline)
                        got = self._admit(e, name, time.perf_counter() - t0)
                        if got is not None:
                            return {**got, **loaded, "adapter_state": state}
                left = deadline - time.perf_counter()
                if left <= 0:
                    raise AdapterBusy(self._busy(e, name))
                me.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(me.wait(), min(left, 1.0))
        finally:
            e.adapter_waiters.remove(me)
            e.adapter_pending -= 1
            _kick(e)

    def _busy(self, e: ManagedLlamaCpp, name: str) -> str:
        hot = sorted(n for n, k in e.adapter_in_flight.items() if k > 0 and n != BASE)
        if name == BASE:
            return (
                f"the model '{e.alias}' is kept apart from its adapters' requests "
                f"(engine.base_beside_adapters is false) and they ran ({', '.join(hot)}) "
                "until this request's deadline"
            )
        if e.adapter_in_flight.get(BASE, 0) > 0:
            hot.append(f"base requests of {e.alias}, kept apart")
        if name in e.adapter_ids or name in e.adapter_loading:
            return (
                f"the adapter '{name}' could not be made active before this request's "
                f"deadline: its engine's {e.spec.active_adapters} active-adapter slot(s) "
                f"were in use ({', '.join(hot)})"
            )
        return (
            f"the adapter '{name}' could not be loaded before this request's deadline: "
            f"its engine's {e.spec.max_adapters} loaded adapter(s) were in use or loaded "
            f"less than engines.min_residency_s ago, or the engine could not drain"
        )

    def _victim(self, e: ManagedLlamaCpp) -> str | None:
        """The loaded adapter to evict: idle, loaded long enough, least recently used."""
        now = time.monotonic()
        idle = [
            n
            for n in e.adapter_ids
            if e.adapter_in_flight.get(n, 0) == 0
            and now - e.adapter_loaded_at.get(n, 0.0) >= self.cfg.min_residency_s
        ]
        return min(idle, key=lambda n: e.adapter_last_used.get(n, 0.0), default=None)

    def _can_load(self, e: ManagedLlamaCpp) -> bool:
        if _active(e) >= e.spec.active_adapters:
            return False
        return len(e.adapter_ids) < e.spec.max_adapters or self._victim(e) is not None

    async def _load_adapter(
        self, e: ManagedLlamaCpp, a: AdapterFile, deadline: float
    ) -> dict[str, Any]:
        """Load the cold adapter `a` (its checksum first), evicting the least recently
        used idle one if the engine has max_adapters loaded."""
        why = await asyncio.to_thread(e.adapter_refusal, a)
        if why is not None:
            e.adapter_errors[a.name] = why
            log.error("engine %s: adapter %s refused: %s", e.alias, a.name, why)
            raise EngineFailed(f"the adapter '{a.name}' is not served: {why}")
        victim = self._victim(e) if len(e.adapter_ids) >= e.spec.max_adapters else None
        evicted: list[dict[str, Any]] = []
        if victim is not None:
            now = time.monotonic()
            evicted.append(
                {
                    "adapter": victim,
                    "reason": "least recently used (max_adapters)",
                    "idle_s": _r(now - e.adapter_last_used.get(victim, now)),
                }
            )
        t = time.perf_counter()
        e.adapter_loading.add(a.name)
        try:
            async with e.adapter_lock:
                try:
                    at_run_time = await e.swap_adapter(victim, a)
                except RuntimeError as exc:
                    raise EngineNotReady(
                        f"the adapter '{a.name}' could not be loaded: {exc}"
                    ) from exc
                if not at_run_time:
                    await self._restart_with(e, victim, a, deadline)
        finally:
            e.adapter_loading.discard(a.name)
        e.adapter_loaded_at[a.name] = time.monotonic()
        load_s = time.perf_counter() - t
        log.info(
            "engine %s: adapter %s loaded in %.0f ms%s",
            e.alias,
            a.name,
            load_s * 1000,
            f", evicting {victim}" if victim else "",
        )
        if self.on_adapter is not None:
            if victim is not None:
                self.on_adapter("evict", e.alias, victim, None)
            self.on_adapter("load", e.alias, a.name, load_s)
        return {
            "adapter_action": "loaded",
            "adapter_load_ms": _r(load_s * 1000.0),
            "adapter_load": "at run time" if at_run_time else "drained restart",
            "adapter_evicted": evicted,
        }

    async def _restart_with(
        self, e: ManagedLlamaCpp, victim: str | None, a: AdapterFile, deadline: float
    ) -> None:
        """Drain the engine (the requests running on it finish; new ones wait), then
        restart it with its adapters less `victim`, plus `a`."""
        e.draining = asyncio.Event()
        try:
            while e.in_flight > e.adapter_pending:  # requests still running on it
                if time.perf_counter() >= deadline:
                    raise AdapterBusy(
                        f"the adapter '{a.name}' could not be loaded before this request's "
                        f"deadline: {e.alias} could not drain ({e.in_flight - e.adapter_pending} "
                        "requests still running) to restart with it"
                    )
                await asyncio.sleep(0.02)
            keep = [n for n in e.adapter_set if n in e.adapter_ids and n != victim]
            e.adapter_set = [*keep, a.name]
            await e.unload()
            e.start()
            ok = await _wait_ready(e, deadline - time.perf_counter())
        finally:
            e.draining.set()
            e.draining = None
        if not ok:
            if e.failed:
                raise EngineFailed(
                    f"the model '{e.alias}' failed to restart with the adapter '{a.name}': "
                    f"{e.reason}"
                )
            raise AdapterBusy(
                f"the model '{e.alias}' is still restarting with the adapter '{a.name}'; "
                "retry shortly",
                retry_after=max(1, round(self.expected_load_s(e))),
            )

    async def _make_room(self, e: ManagedLlamaCpp) -> list[dict[str, Any]]:
        budget, cap = self.cfg.memory_budget_mb, self.cfg.max_loaded
        need = estimate_mb(e)
        evicted: list[dict[str, Any]] = []
        now = time.monotonic()
        while True:
            loaded = [x for x in self.loaded() if x is not e]
            over_cap = cap is not None and len(loaded) + 1 > cap
            over_mem = budget is not None and self.used_mb(without=e) + need > budget
            if not (over_cap or over_mem):
                return evicted
            candidates = [
                x
                for x in loaded
                if not x.spec.pinned
                and x.in_flight == 0
                and x.ready
                and x.loaded_at is not None
                and now - x.loaded_at >= self.cfg.min_residency_s
            ]
            if not candidates:
                why = "max_loaded" if over_cap else "memory_budget_mb"
                raise ModelLoading(
                    f"no room to load '{e.alias}' ({why}): every loaded model is pinned, "
                    f"busy or loaded less than engines.min_residency_s "
                    f"({self.cfg.min_residency_s:g}s) ago",
                    retry_after=max(1, round(self.cfg.min_residency_s)),
                )
            victim = min(candidates, key=lambda x: x.last_used)
            entry = {
                "alias": victim.alias,
                "reason": "least recently used" + (" (max_loaded)" if over_cap else " (memory)"),
                "idle_s": _r(now - victim.last_used),
                "memory_mb": _r(estimate_mb(victim)),
            }
            log.info("engine %s evicted to load %s: %s", victim.alias, e.alias, entry["reason"])
            await victim.unload()
            self.evictions += 1
            evicted.append(entry)
            if self.on_event is not None:
                self.on_event("evict", victim.alias, None)


async def _wait_ready(e: ManagedLlamaCpp, timeout_s: float) -> bool:
    """Wait until `e` is ready (True), failed or out of time (False)."""
    deadline = time.perf_counter() + max(0.0, timeout_s)
    while True:
        if e.ready:
            return True
        if e.failed or e.cold:
            return False
        left = deadline - time.perf_counter()
        if left <= 0:
            return False
        await e.wait_ready(min(0.25, left))


# The base model as a member of its engine's active set, where base requests must not
# share a batch with adapter requests (ManagedLlamaCpp.isolate_base).
BASE = ""


def _active(e: ManagedLlamaCpp) -> int:
    """Adapters in use by requests (hot) or being loaded for one."""
    hot = sum(1 for n, k in e.adapter_in_flight.items() if k > 0 and n != BASE)
    return hot + len(e.adapter_loading)


def _kick(e: ManagedLlamaCpp) -> None:
    """Wake the first request waiting for an adapter of `e` to look again."""
    if e.adapter_waiters:
        e.adapter_waiters[0].set()


def _r(x: float) -> float:
    return round(x, 1)
