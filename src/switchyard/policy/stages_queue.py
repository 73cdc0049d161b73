"""The queue stage: a slot at the deployment's gate (policy/admission.py), taken on
the way in and given back on release.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from switchyard import outcomes
from switchyard.aio import hung_up, until_gone
from switchyard.errors import InvalidHeader, InvalidRequest, SwitchyardError
from switchyard.pipeline import RequestContext, Stage, Status
from switchyard.policy.admission import (
    PRIORITIES,
    STANDARD,
    Admission,
    DeploymentGate,
    Priority,
    SlotAsk,
)

NO_WAIT = "waited 0.0 ms for a slot"
QUEUED_CLIENT_LEFT = "the client hung up while its request was queued"
# The outcomes every admitted request records, bound once: reading an enum member
# through its class costs a metaclass lookup each time, on the request's path.
_QUEUE_ADMITTED = outcomes.Queue.ADMITTED
_STANDARD_CLASS = Priority.STANDARD
# Each class's name as the evidence gives it: an enum member's `name` is a descriptor
# worked out on each read.
_CLASS_NAMES = {p: name for name, p in PRIORITIES.items()}


class Queue(Stage):
    """A slot at the deployment's gate (models[].limits.max_concurrency and queue), in
    the order `scheduling.policy` sets (policy/admission.py). Most requests find a free
    slot: that path decides without a coroutine. The request's class is its principal's
    (the lower of its tenant's and its key's), or lower when `x-switchyard-priority` asks
    for it (a request never raises its own)."""

    name = "queue"
    CLASSES = tuple(Priority)

    def __init__(self, gates: Mapping[str, DeploymentGate]) -> None:
        self._gates = gates
        # request id -> (when its slot was granted, its ask): what the gate learns from
        self._held: dict[str, tuple[float, SlotAsk]] = {}

    def _ask(self, ctx: RequestContext) -> SlotAsk:
        raw = ctx.input.headers.get("x-switchyard-priority")
        given = ctx.principal.priority
        priority = self.CLASSES[given] if 0 <= given < len(self.CLASSES) else Priority.STANDARD
        if raw is not None:
            asked = PRIORITIES.get(raw.strip().lower())
            if asked is None:
                raise InvalidHeader(
                    "header x-switchyard-priority: one of interactive, standard, batch",
                    param="x-switchyard-priority",
                )
            priority = max(priority, asked)  # lower only: a larger value is a lower class
        hold = ctx.task
        if hold is None:
            return STANDARD if priority is _STANDARD_CLASS else SlotAsk(priority)
        return SlotAsk(priority, hold.key, hold.call, hold.planned)

    def work(self, ctx: RequestContext) -> Awaitable[None] | None:
        assert ctx.model is not None
        t = time.perf_counter()
        gate = self._gates[ctx.model.alias]
        try:
            ask = self._ask(ctx)
        except InvalidRequest as exc:
            ctx.record("queue", outcomes.Queue.REJECT_INVALID_HEADER, exc.message, t)
            raise
        adm = gate.try_acquire(ask, ctx.deadline)
        if adm is None:
            return self._wait_for_slot(ctx, gate, ask, t)
        self._admitted(ctx, gate, adm, ask, t)
        return None

    async def _wait_for_slot(
        self, ctx: RequestContext, gate: DeploymentGate, ask: SlotAsk, t: float
    ) -> None:
        try:
            waiting = gate.acquire(ctx.deadline, ask)
            if ctx.receive is not None:  # a client that hangs up gives its place back
                # A slot granted as this request is cancelled (its task's cancel) goes
                # back to the gate: the request never holds it.
                waiting = until_gone(
                    waiting, hung_up(ctx.receive), QUEUED_CLIENT_LEFT, _give_back(gate)
                )
            adm = await waiting
        except Exception as exc:
            evidence = {"in_flight": gate.in_flight, "queued": gate.queued}
            more = getattr(exc, "evidence", None)
            if isinstance(more, dict):
                evidence |= more
            code = exc.code if isinstance(exc, SwitchyardError) else "error"
            ctx.record("queue", outcomes.reject(code), str(exc), t, evidence)
            raise
        self._admitted(ctx, gate, adm, ask, t)

    def release(self, ctx: RequestContext) -> None:
        """Give the slot back; the gate learns the service time of an answered request."""
        gate = ctx.admission.gate
        if gate is None:  # kept on the request: its record names what it held
            return
        held = self._held.pop(ctx.input.request_id, None)
        run = ctx.run
        if held is not None and ctx.status == Status.OK and run.attempts > 0:
            gate.release(time.perf_counter() - held[0], run.tokens_out, held[1])
        else:
            gate.release()

    def _admitted(
        self, ctx: RequestContext, gate: DeploymentGate, adm: Admission, ask: SlotAsk, t: float
    ) -> None:
        ctx.admission.gate = gate
        ctx.admission.queue_ms = adm.waited_s * 1000
        ctx.admission.priority = ask.priority
        if gate.max_concurrency is not None:  # a model that can queue learns its service
            self._held[ctx.input.request_id] = (time.perf_counter(), ask)
        waited = adm.waited_s != 0
        evidence: dict[str, Any] = {
            "in_flight": adm.in_flight,
            "queued": adm.queued,
            "max_concurrency": gate.max_concurrency,
        }
        if adm.evidence is not None:
            evidence |= adm.evidence
        elif gate.task_aware:
            evidence["class"] = _CLASS_NAMES[ask.priority]
        ctx.record(
            "queue",
            outcomes.Queue.WAITED if waited else _QUEUE_ADMITTED,
            f"waited {adm.waited_s * 1000:.1f} ms for a slot" if waited else NO_WAIT,
            t,
            evidence,
        )


def _give_back(gate: DeploymentGate) -> Callable[[Admission], None]:
    """What a slot granted to a request already cancelled does: it goes back to `gate`."""

    def undo(adm: Admission) -> None:
        gate.release()

    return undo
