"""Tasks and scheduling under overload, as a hostile client sees them: what a slot handed
to a waiter becomes when the waiter is cancelled in the same moment, and what a refused
new task is told to wait. The model gate (policy/admission.py) and the queue stage's
hang-up wrapper (aio.py `until_gone`) are driven directly, on the event loop, so the
moment a cancel lands is exact rather than a race on sockets.

Defects these tests found (each failed before its fix):
- a waiter handed a slot (`DeploymentGate.release`) and cancelled before it resumed (a
  task's `DELETE /v1/tasks/{id}` stops its queued call: policy/tasks.py `Running.stop`)
  was served anyway: Python 3.11's `asyncio.wait_for` returns a done future's result and
  swallows the cancellation, so the cancelled task's call went upstream;
- under the queue stage's hang-up watch (`until_gone`), the same cancel dropped the
  granted slot on the floor: the gate's `in_flight` stayed one higher for good, so a
  model of `max_concurrency` 1 served nothing more;
- a new task's first step pushed out of a full queue by a later step (503 `overloaded`)
  was told `Retry-After: 1` whatever the queue ahead, where a 429 `queue_full` at the
  same moment says the expected wait for a place.
"""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace
from typing import Any

from switchyard.errors import Overloaded, QueueFull
from switchyard.pipeline import RequestContext, RequestInput, Timings
from switchyard.policy.admission import DeploymentGate, Priority, ServiceModel, SlotAsk
from switchyard.policy.stages_queue import Queue
from switchyard.request import Generation


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def trained(g: DeploymentGate, service_s: float = 1.0, tokens: int = 100) -> DeploymentGate:
    for _ in range(ServiceModel.MIN_SAMPLES):
        g.model.observe(service_s, tokens)
    return g


def task(name: str, step: int, planned: int = 5) -> SlotAsk:
    return SlotAsk(Priority.STANDARD, ("tenant", name), step, planned)


def test_a_waiter_cancelled_as_it_is_handed_a_slot_is_not_served_and_gives_it_back() -> None:
    async def probe() -> tuple[str, int, str]:
        g = DeploymentGate("m", 1, 4)
        assert g.try_acquire() is not None  # the one slot is held
        cancelled = asyncio.create_task(g.acquire(1e9))
        other = asyncio.create_task(g.acquire(1e9))
        for _ in range(3):
            await asyncio.sleep(0)
        assert g.queued == 2
        g.release()  # the slot goes to the first waiter...
        cancelled.cancel()  # ...whose task is cancelled before it resumes
        got = (await asyncio.gather(cancelled, return_exceptions=True))[0]
        for _ in range(3):
            await asyncio.sleep(0)
        served_next = "other served" if other.done() and not other.exception() else "stuck"
        held = g.in_flight  # the other waiter's slot, handed on
        if other.done():
            g.release()
        else:
            other.cancel()
        await asyncio.gather(other, return_exceptions=True)
        return type(got).__name__, held, served_next

    assert run(probe()) == ("CancelledError", 1, "other served")


def _queued_request(gate: DeploymentGate) -> tuple[Queue, RequestContext]:
    """A request of model `m` at the queue stage, its client connected (an ASGI
    `receive` that never says the client left)."""
    now = time.perf_counter()
    inp = RequestInput(f"req_{time.monotonic_ns()}", "chat.completions", time.time())
    ctx = RequestContext(inp, Generation(model="m", messages=[]), Timings(now), now + 1e6)
    ctx.model = SimpleNamespace(alias="m")  # type: ignore[assignment]
    never: asyncio.Future[dict[str, object]] = asyncio.get_running_loop().create_future()
    ctx.receive = lambda: never
    return Queue({"m": gate}), ctx


def test_a_slot_granted_as_the_queue_stage_is_cancelled_is_given_back() -> None:
    async def probe(turns: int) -> tuple[str, int, int, bool]:
        """The request's slot is handed over, then its task is cancelled `turns` loop
        turns later (0: before the gate's wait resumes; 2: once it has ended, before the
        stage resumes)."""
        g = DeploymentGate("m", 1, 4)
        assert g.try_acquire() is not None  # the one slot is held
        stage, ctx = _queued_request(g)
        pending = stage.work(ctx)
        assert pending is not None
        waiting = asyncio.ensure_future(pending)
        for _ in range(3):
            await asyncio.sleep(0)
        assert g.queued == 1
        g.release()  # handed to the queued request: in_flight stays 1, now its
        for _ in range(turns):
            await asyncio.sleep(0)
        waiting.cancel()  # its task's cancel (DELETE /v1/tasks/{id}) stops it now
        got = (await asyncio.gather(waiting, return_exceptions=True))[0]
        stage.release(ctx)  # the pipeline's unwinding
        return type(got).__name__, g.in_flight, g.queued, ctx.admission.gate is None

    # The cancel goes on, and nothing holds the slot: the model is free again.
    assert run(probe(0)) == ("CancelledError", 0, 0, True)
    assert run(probe(2)) == ("CancelledError", 0, 0, True)


def test_a_new_task_pushed_out_of_a_full_queue_is_told_the_wait_for_a_place() -> None:
    async def probe() -> tuple[str, str, str]:
        # 1 s a request, one slot, three places; a still clock at 0
        g = trained(DeploymentGate("m", 1, 3, "task_aware", 2.0, 0.8, lambda: 0.0))
        assert g.try_acquire() is not None
        jobs = [
            asyncio.create_task(g.acquire(100.0, task("new-a", 1))),
            asyncio.create_task(g.acquire(100.0, task("new-b", 1))),
            asyncio.create_task(g.acquire(100.0)),  # a single call
        ]
        for _ in range(3):
            await asyncio.sleep(0)
        assert g.queued == 3
        # A full queue refuses a new task 429 with the wait for a place: 3 queued x 1 s.
        try:
            await g.acquire(100.0, task("new-c", 1))
            full = "admitted"
        except QueueFull as exc:
            full = exc.headers["Retry-After"]
        # A later step of an admitted task takes the place of the last new task queued.
        jobs.append(asyncio.create_task(g.acquire(100.0, task("old", 3))))
        for _ in range(3):
            await asyncio.sleep(0)
        pushed = jobs[1].exception() if jobs[1].done() else None
        assert isinstance(pushed, Overloaded), pushed
        assert g.queued == 3
        for j in jobs:
            j.cancel()
        await asyncio.gather(*jobs, return_exceptions=True)
        return full, pushed.headers["Retry-After"], str(pushed.status)

    assert run(probe()) == ("3", "3", "503")
