"""The model queue's admitted work and refusals (policy/admission.py), on a controlled
clock: which declared plans count against new tasks (worked, idle, cancelled, never
started), which queued first step a full queue gives up, what a full queue's
Retry-After says; and the client's own engine `priority` never going upstream
(execute/executor.py)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Coroutine
from typing import Any

import orjson
import pytest

from support.deployments import REGISTRY
from switchyard.api.codecs import chat_completions
from switchyard.errors import SwitchyardError
from switchyard.execute.executor import upstream_payload
from switchyard.pipeline import RequestContext, RequestInput, Timings
from switchyard.policy.admission import DeploymentGate, Priority, ServiceModel, SlotAsk


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def _gate(clock: Clock, queue: int = 16, trained: bool = True) -> DeploymentGate:
    g = DeploymentGate("m", 1, queue, "task_aware", 2.0, 0.8, clock)
    if trained:
        for _ in range(ServiceModel.MIN_SAMPLES):  # every call: 1 s
            g.model.observe(1.0, 100)
    return g


def _big(step: int = 1) -> SlotAsk:
    return SlotAsk(Priority.INTERACTIVE, ("t", "big"), step, 64)  # 64 steps, 1 s each


async def _verdict(job: Coroutine[Any, Any, Any]) -> str:
    """'queued' while `job` waits after a few loop turns, else its refusal's code."""
    task = asyncio.ensure_future(job)
    for _ in range(3):
        await asyncio.sleep(0)
    verdict = "queued"
    if task.done():
        exc = task.exception()
        verdict = exc.code if isinstance(exc, SwitchyardError) else repr(exc)
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    return verdict


def _new_task(g: DeploymentGate, name: str, within_s: float) -> Coroutine[Any, Any, Any]:
    """A new 2-step task (2 s of work) with `within_s` left: admitted unless more
    than about 17 s of admitted work is ahead of it."""
    return g.acquire(g.clock() + within_s, SlotAsk(Priority.STANDARD, ("u", name), 1, 2))


def test_a_worked_plan_counts_until_it_has_been_idle_past_the_bound() -> None:
    async def probe() -> list[str]:
        clock = Clock()
        g = _gate(clock)
        assert g.try_acquire(_big(), 86_400.0) is not None
        g.release(1.0, 100, _big())  # answered at t=0; 63 steps of 1 s declared to come
        out = []
        clock.t = DeploymentGate.PLAN_IDLE_S - 1  # a tool call between steps
        held = g.try_acquire()
        assert held is not None  # saturated: admission checks run
        out.append(await _verdict(_new_task(g, "a", 30.0)))
        clock.t = DeploymentGate.PLAN_IDLE_S + 1  # nothing of it past the bound
        out.append(await _verdict(_new_task(g, "b", 30.0)))
        # It comes back: its next step ranks as admitted work and its plan counts again.
        g.release()
        assert g.try_acquire(_big(2), 86_400.0) is not None
        clock.t += 1.0
        g.release(1.0, 100, _big(2))
        assert g.try_acquire() is not None
        out.append(await _verdict(_new_task(g, "c", 30.0)))
        return out

    assert asyncio.run(probe()) == ["overloaded", "queued", "overloaded"]


def test_a_task_whose_step_is_queued_keeps_its_plan_however_long_it_waits() -> None:
    async def probe() -> str:
        clock = Clock()
        g = _gate(clock)
        assert g.try_acquire(_big(), 86_400.0) is not None
        g.release(1.0, 100, _big())
        assert g.try_acquire() is not None  # the slot is held
        clock.t = 10.0
        step = asyncio.ensure_future(g.acquire(86_400.0, _big(2)))  # waits in the queue
        await asyncio.sleep(0)
        assert g.queued == 1
        clock.t = 10.0 + 2 * DeploymentGate.PLAN_IDLE_S  # still queued: being worked
        verdict = await _verdict(_new_task(g, "late", 30.0))
        step.cancel()
        await asyncio.gather(step, return_exceptions=True)
        return verdict

    assert asyncio.run(probe()) == "overloaded"


def test_a_cancelled_task_is_forgotten_by_the_gate() -> None:
    async def probe() -> tuple[str, str]:
        clock = Clock()
        g = _gate(clock)
        assert g.try_acquire(_big(), 86_400.0) is not None
        g.release(1.0, 100, _big())
        assert g.try_acquire() is not None
        before = await _verdict(_new_task(g, "a", 30.0))
        g.forget_task(("t", "big"))  # DELETE /v1/tasks/big (control/cancels.py)
        after = await _verdict(_new_task(g, "b", 30.0))
        return before, after

    assert asyncio.run(probe()) == ("overloaded", "queued")


def test_a_new_task_whose_deadline_passes_in_the_queue_is_forgotten() -> None:
    async def probe() -> tuple[str, str]:
        clock = Clock()
        g = _gate(clock, trained=False)  # no estimate: the plain deadline path
        assert g.try_acquire() is not None
        phantom = asyncio.ensure_future(
            g.acquire(0.05, SlotAsk(Priority.STANDARD, ("t", "x"), 1, 40))
        )
        done = await asyncio.gather(phantom, return_exceptions=True)
        exc = done[0]
        code = exc.code if isinstance(exc, SwitchyardError) else repr(exc)
        for _ in range(ServiceModel.MIN_SAMPLES):  # the model learns now: 1 s a call
            g.model.observe(1.0, 100)
        # Its 39 declared steps (39 s, due at 0.05 s of a clock that stays at 0) are gone.
        return code, await _verdict(_new_task(g, "next", 10.0))

    assert asyncio.run(probe()) == ("deadline_exceeded", "queued")


def _full_queue_verdicts(first: Priority, arriving: Priority, wait_s: float) -> tuple[str, str]:
    """A full queue of one holding a new task's first step of class `first` for
    `wait_s`; then a single call of class `arriving` comes: (the first step's fate,
    the single call's)."""

    async def probe() -> tuple[str, str]:
        clock = Clock()
        g = _gate(clock, queue=1)
        assert g.try_acquire() is not None
        queued = asyncio.ensure_future(g.acquire(1000.0, SlotAsk(first, ("t", "trip"), 1, 3)))
        await asyncio.sleep(0)
        clock.t = wait_s
        single = asyncio.ensure_future(g.acquire(1000.0, SlotAsk(arriving)))
        for _ in range(3):
            await asyncio.sleep(0)
        verdicts = []
        for job in (queued, single):
            verdict = "queued"
            if job.done():
                exc = job.exception()
                verdict = exc.code if isinstance(exc, SwitchyardError) else repr(exc)
            verdicts.append(verdict)
            job.cancel()
        await asyncio.gather(queued, single, return_exceptions=True)
        return verdicts[0], verdicts[1]

    return asyncio.run(probe())


@pytest.mark.parametrize(
    ("first", "arriving", "wait_s", "expected"),
    [
        # Within a class, admitted work goes first: the new task's step gives way.
        (Priority.STANDARD, Priority.STANDARD, 0.0, ("overloaded", "queued")),
        # A lower class's new task gives way to a higher class's call.
        (Priority.BATCH, Priority.INTERACTIVE, 0.0, ("overloaded", "queued")),
        # A higher class's first step keeps its place: the lower call is refused.
        (Priority.STANDARD, Priority.BATCH, 0.0, ("queued", "queue_full")),
        # Aged two classes up (2 x aging_s), a batch task's step outranks a standard call.
        (Priority.BATCH, Priority.STANDARD, 4.5, ("queued", "queue_full")),
    ],
)
def test_a_full_queue_gives_up_only_a_first_step_ranked_below_the_arriving_call(
    first: Priority, arriving: Priority, wait_s: float, expected: tuple[str, str]
) -> None:
    assert _full_queue_verdicts(first, arriving, wait_s) == expected


@pytest.mark.parametrize(("trained", "expected"), [(True, "6"), (False, "1")])
def test_a_full_fcfs_queue_says_when_a_place_should_free(trained: bool, expected: str) -> None:
    async def probe() -> str:
        g = DeploymentGate("m", 2, 3, "fcfs", 2.0, 0.8, Clock())
        if trained:
            for _ in range(ServiceModel.MIN_SAMPLES):  # every call: 4 s
                g.model.observe(4.0, 100)
        assert g.try_acquire() is not None and g.try_acquire() is not None
        queued = [asyncio.ensure_future(g.acquire(100.0)) for _ in range(3)]
        await asyncio.sleep(0)
        assert g.queued == 3
        try:
            await g.acquire(100.0)
            refused = "admitted"
        except SwitchyardError as exc:
            refused = f"{exc.code}:{exc.headers['Retry-After']}"
        for job in queued:
            job.cancel()
        await asyncio.gather(*queued, return_exceptions=True)
        return refused

    # 3 queued of 4 s each over 2 slots: a place frees in about 6 s.
    assert asyncio.run(probe()) == f"queue_full:{expected}"


def _ctx(raw: bytes) -> RequestContext:
    req, exact = chat_completions().decode(orjson.loads(raw))
    now = time.perf_counter()
    ctx = RequestContext(
        RequestInput("r", "chat.completions", time.time()), req, Timings(now), now + 5
    )
    ctx.wire = (req, raw if exact else None)
    ctx.stream = req.stream
    ctx.include_usage = req.include_usage
    return ctx


@pytest.mark.parametrize(
    "raw",
    [
        # The client's own bytes would go out as they came (nothing else to change).
        b'{"model": "a", "priority": -1000, "messages": [{"role": "user", "content": "hi"}]}',
        # Rebuilt (stream_options rewritten to ask for usage).
        b'{"model": "a", "messages": [{"role": "user", "content": "hi"}], "priority": -1000,'
        b' "stream": true, "stream_options": {"include_usage": false}}',
    ],
)
def test_a_clients_own_priority_is_dropped_for_an_engine_without_the_policy(raw: bytes) -> None:
    sent = upstream_payload(_ctx(raw), REGISTRY.deployments["a"])
    out = orjson.loads(sent)
    assert b'"priority"' not in sent
    assert out["model"] == "a" and out["messages"] == [{"role": "user", "content": "hi"}]


def test_another_tenants_flood_of_task_ids_keeps_a_tenants_plan() -> None:
    """The gate keeps at most MAX_TASKS task records; past it the tenant holding the
    most gives up its own least recently seen. Before, the oldest went whoever held it:
    tenant b's flood of new 3-step tasks dropped tenant t's 64-step plan, so a new task
    was admitted as if t's remaining 63 s of work were not coming (review s73d)."""

    async def probe() -> str:
        clock = Clock()
        g = _gate(clock)
        g.MAX_TASKS = 8
        assert g.try_acquire(_big(), 86_400.0) is not None
        g.release(1.0, 100, _big())  # t's task: 63 steps of 1 s still to come
        for i in range(20):
            ask = SlotAsk(Priority.STANDARD, ("b", f"x{i}"), 1, 3)
            assert g.try_acquire(ask, 86_400.0) is not None
            g.release(1.0, 100, ask)
        assert len(g._tasks) == 8
        assert g.try_acquire() is not None  # saturated: admission checks run
        return await _verdict(_new_task(g, "a", 30.0))

    assert asyncio.run(probe()) == "overloaded"
