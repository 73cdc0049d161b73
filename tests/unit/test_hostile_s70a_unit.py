"""Hostile load against the model queue's scheduling rules (policy/admission.py), on a
controlled clock: what a low-priority client can do to higher classes' waiters.

Defects these tests find (each fails on today's code):
- a full queue's make-room rule (`DeploymentGate._make_room`) gives the place of the
  lowest-ranked queued first step of a new task to any arriving single call or later
  step, whatever their classes: a batch client's single calls push an interactive
  task's queued first step out (503 `overloaded`), where the queue's own order (class
  first) and the admission rule ("a batch client ... cannot get an interactive task
  refused", docs/guides/tasks-and-tools.md) say the batch call is the one to refuse
  (429 `queue_full`);
- a new task whose first step is cancelled while queued (its task's cancel, or its
  caller cancelled) stays in the gate's admitted tasks (`DeploymentGate.acquire` forgets
  a task only on `deadline_unreachable` or a lost place, not on a cancellation or a
  plain `deadline_exceeded`): its declared planned steps refuse later new tasks 503
  `overloaded` until its deadline;
- a full queue always says `Retry-After: 1` (`DeploymentGate.acquire`, QueueFull),
  whatever the gate's own estimate says of when a place frees, where 503 `overloaded`
  gives the expected wait;
- per-tenant fairness: a tenant's declared plans (`x-task-planned-steps`) count as
  admitted work until each task's deadline, however long the task has been idle
  (`DeploymentGate._backlog_s` drops a task only past its deadline or its last step):
  three one-call tasks declaring 64 steps and a day refuse every other tenant's new
  tasks of their class 503 `overloaded` while the model is busy, for a day.
"""

from __future__ import annotations

import asyncio

from switchyard.errors import SwitchyardError
from switchyard.policy.admission import DeploymentGate, Priority, ServiceModel, SlotAsk


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_a_batch_single_call_never_pushes_an_interactive_tasks_first_step_out() -> None:
    async def probe() -> tuple[str, str]:
        g = DeploymentGate("m", 1, 1, "task_aware", 2.0, 0.8, Clock())
        assert g.try_acquire() is not None  # the only slot is held
        first = SlotAsk(Priority.INTERACTIVE, ("tenant-a", "trip"), 1, 3)
        queued = asyncio.create_task(g.acquire(100.0, first))  # the queue's one place
        await asyncio.sleep(0)
        batch = asyncio.create_task(g.acquire(100.0, SlotAsk(Priority.BATCH)))
        for _ in range(3):
            await asyncio.sleep(0)
        verdicts = []
        for job in (queued, batch):
            if not job.done():
                verdicts.append("queued")
            else:
                exc = job.exception()
                verdicts.append(exc.code if isinstance(exc, SwitchyardError) else repr(exc))
        for job in (queued, batch):
            job.cancel()
        await asyncio.gather(queued, batch, return_exceptions=True)
        return verdicts[0], verdicts[1]

    # The interactive task keeps its place; the batch call, ranked below it, is refused.
    assert asyncio.run(probe()) == ("queued", "queue_full")


def _trained(g: DeploymentGate) -> DeploymentGate:
    for _ in range(ServiceModel.MIN_SAMPLES):  # every call: 1 s
        g.model.observe(1.0, 100)
    return g


def test_a_new_task_cancelled_while_queued_leaves_no_phantom_work_behind() -> None:
    async def probe() -> str:
        g = _trained(DeploymentGate("m", 1, 16, "task_aware", 2.0, 0.8, Clock()))
        assert g.try_acquire() is not None  # the only slot is held
        # A task declaring 40 steps and an hour queues its first step, then is
        # cancelled (its client's DELETE /v1/tasks/{id}, or the client left).
        phantom = asyncio.create_task(
            g.acquire(3600.0, SlotAsk(Priority.STANDARD, ("t", "big"), 1, 40))
        )
        await asyncio.sleep(0)
        assert not phantom.done()
        phantom.cancel()
        await asyncio.gather(phantom, return_exceptions=True)
        assert g.queued == 0
        # Nothing is queued now: a new 2-step task with 10 s waits for the one slot
        # held (no estimate of its rest needed) and needs 2 s: well within 8 s.
        job = asyncio.create_task(g.acquire(10.0, SlotAsk(Priority.STANDARD, ("t", "small"), 1, 2)))
        for _ in range(3):
            await asyncio.sleep(0)
        verdict = "queued"
        if job.done():
            exc = job.exception()
            verdict = exc.code if isinstance(exc, SwitchyardError) else repr(exc)
        job.cancel()
        await asyncio.gather(job, return_exceptions=True)
        return verdict

    assert asyncio.run(probe()) == "queued"


def test_a_full_queues_retry_after_is_the_expected_wait_not_one_second() -> None:
    async def probe() -> str:
        g = DeploymentGate("m", 1, 1, "task_aware", 2.0, 0.8, Clock())
        for _ in range(ServiceModel.MIN_SAMPLES):  # every call: 10 s
            g.model.observe(10.0, 100)
        assert g.try_acquire() is not None  # taken now: free in about 10 s
        queued = asyncio.create_task(g.acquire(100.0))  # then 10 s more for this one
        await asyncio.sleep(0)
        try:
            await g.acquire(100.0)
            refused = "admitted"
        except SwitchyardError as exc:
            assert exc.code == "queue_full"
            refused = exc.headers["Retry-After"]
        queued.cancel()
        await asyncio.gather(queued, return_exceptions=True)
        return refused

    # No place frees before the running call ends (about 10 s): a client told to come
    # back in 1 s is refused again nine times over (a retry storm the gate invites).
    assert int(asyncio.run(probe())) >= 10


def test_one_tenants_idle_declared_plans_do_not_refuse_another_tenants_tasks() -> None:
    async def probe() -> str:
        clock = Clock()
        g = _trained(DeploymentGate("m", 1, 16, "task_aware", 2.0, 0.8, clock))
        # A tenant opens three tasks while the model is idle (no admission check then),
        # each declaring 64 steps and a day, makes one call each, and is never heard of
        # again.
        for name in ("x1", "x2", "x3"):
            ask = SlotAsk(Priority.STANDARD, ("tenant-x", name), 1, 64)
            assert g.try_acquire(ask, 86_400.0) is not None
            g.release(1.0, 100, ask)
        clock.t = 600.0  # ten minutes without a call of theirs
        assert g.try_acquire() is not None  # the model is busy now
        # Another tenant's task of 2 steps with 30 s: nothing is queued, nothing of the
        # idle tasks has come for ten minutes; it waits for one call and runs 2 s.
        ask = SlotAsk(Priority.STANDARD, ("tenant-y", "trip"), 1, 2)
        job = asyncio.create_task(g.acquire(clock.t + 30.0, ask))
        for _ in range(3):
            await asyncio.sleep(0)
        verdict = "queued"
        if job.done():
            exc = job.exception()
            verdict = exc.code if isinstance(exc, SwitchyardError) else repr(exc)
        job.cancel()
        await asyncio.gather(job, return_exceptions=True)
        return verdict

    assert asyncio.run(probe()) == "queued"
