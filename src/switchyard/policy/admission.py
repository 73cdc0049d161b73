"""Admission control per deployment: a concurrency cap with a bounded wait queue, ordered
by the scheduling policy (`scheduling.policy`).

A deep queue looks like success until deadlines pass, so the queue is bounded: when it
is full a request is refused at once (429 `queue_full` + Retry-After) instead of waiting
forever, and a request whose deadline passes while queued is answered 504 and never sent
upstream.

`fcfs`: waiters are served first in, first out; nothing else.

`task_aware` (the default) serves the waiter with the smallest key

    (class after aging, is a new task's first step, effective deadline, arrival)

* class: interactive < standard < batch (`Priority`, the request's own, a parameter of
  the gate). No starvation: each `aging_s` a waiter has waited lifts it one class, so a
  batch waiter competes with interactive ones after two of them, and from there on by
  deadline; and every waiter has a deadline, by which it is served or refused.
* later steps of admitted tasks (and single calls) before the first steps of new tasks,
  so admitted tasks keep the capacity they need to finish;
* earliest effective deadline first (the request's, already cut to its task's).

and refuses what cannot succeed, before anything is sent:

* a waiter that can no longer finish in time (now + its service-time estimate past its
  deadline) is refused with 504 `deadline_unreachable`: at the queue, when handed a slot,
  and by a timer at its deadline minus the estimate;
* while the model is saturated, a new task's first step is refused with 503
  `overloaded` (+ Retry-After) when the task would not end within `admit_headroom` of
  its time left: the work ahead of it over the capacity left to tasks, plus its own
  planned steps. The work ahead is what ranks before its steps: the queued waiters of
  a higher class, those of its class that are later steps or single calls, and the
  rest due no later than it; and the remaining planned steps of the admitted tasks of
  a higher class, or due no later than it (those of its class due later run after
  its steps: earliest deadline first). The capacity left to tasks is the concurrency
  less what the work the gate does not plan for takes: single calls of the task's
  class or higher keep arriving (the rate at which they are given slots, decayed over
  `SINGLES_WINDOW_S`, times their service time: the slots they hold on average; a call
  counts once, when it gets its slot, so one that waits is not counted twice and one
  the gate refuses, which holds no slot, not at all), and other clients of the same
  engines hold slots too (the engines' own running and waiting counts, when fresh,
  beyond this gate's own requests; engines/load.py);
* when the queue is full, a later step (or single call) takes the place of the
  lowest-ranked queued first step of a new task, which gets 503 `overloaded`, when that
  first step ranks below it (a lower class, or the same: later steps go first); else
  the arriving request is refused 429 `queue_full`, its Retry-After the expected wait
  for a place (the estimate times the queued over the concurrency).

An admitted task's remaining planned steps count as work ahead of new tasks while the
task is being worked: a call of it queued, or one seen (queued, granted or answered)
within `PLAN_IDLE_S`. A task idle longer, or cancelled (`forget_task`), or whose first
step never got its slot (refused, cancelled, timed out), is no longer counted; its next
call, if one comes, counts its plan again.

The service-time estimate is learned per model (`ServiceModel`): slot seconds as a
linear function of the output tokens (weighted least squares, recent requests weigh
more), and the expected output tokens per model and per task step (the call's number
in a task with that many planned steps; a single call is step 1 of 1). It never uses
the `max_tokens` cap, which is a worst case. Until a model has `MIN_SAMPLES` answers there is no estimate, and no
refusal rests on one.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from enum import IntEnum
from typing import Any, Literal

from switchyard.errors import DeadlineExceeded, DeadlineUnreachable, Overloaded, QueueFull

Policy = Literal["task_aware", "fcfs"]
MAX_OTHERS = 1_000_000  # other clients' requests: more is no engine's real figure
StepKey = tuple[int, int]  # (planned steps, this call's number in the task)


class Priority(IntEnum):
    """Priority classes, highest first."""

    INTERACTIVE = 0
    STANDARD = 1
    BATCH = 2


PRIORITIES = {p.name.lower(): p for p in Priority}


@dataclass(frozen=True, slots=True)
class SlotAsk:
    """What the gate knows of a request: its class and its place in its task."""

    priority: Priority = Priority.STANDARD
    task: Hashable | None = None  # the task's key, when the request is one of a task's
    step: int | None = None  # its number among the task's calls (1: the first)
    planned: int | None = None  # the task's planned steps (x-task-planned-steps)

    @property
    def new_task(self) -> bool:
        """The first call of a task of more than one step: a new task to admit."""
        return self.task is not None and self.step == 1 and self.planned != 1

    @property
    def single(self) -> bool:
        """A call that is not one of several steps: no task, or a task of one step."""
        return self.task is None or self.planned == 1

    @property
    def step_key(self) -> StepKey | None:
        if self.task is None:
            return SINGLE_STEP
        if self.step is None or self.planned is None:
            return None
        return (self.planned, self.step)


STANDARD = SlotAsk()
SINGLE_STEP: StepKey = (1, 1)  # a single call's expected length is learned as a task's of one step


@dataclass(frozen=True, slots=True)
class Estimate:
    service_s: float
    tokens: float
    source: str  # "step" | "model": where the expected output length came from

    def evidence(self) -> dict[str, Any]:
        return {
            "service_s": round(self.service_s, 4),
            "tokens": round(self.tokens, 1),
            "tokens_from": self.source,
        }


class ServiceModel:
    """Slot seconds as a + b x output tokens, and the expected output tokens, learned
    from the answers of one model (exponentially weighted: `ALPHA` per answer)."""

    ALPHA = 0.05
    MIN_SAMPLES = 5
    MAX_STEPS = 4096

    def __init__(self) -> None:
        self.samples = 0
        self._sums = [0.0, 0.0, 0.0, 0.0, 0.0]  # weight, x, xx, y, xy
        self.tokens: float | None = None
        self.steps: dict[StepKey, float] = {}

    def observe(self, held_s: float, tokens: int, step: StepKey | None = None) -> None:
        keep = 1.0 - self.ALPHA
        x, y = float(tokens), max(0.0, held_s)
        s = self._sums
        for i, v in enumerate((1.0, x, x * x, y, x * y)):
            s[i] = s[i] * keep + v
        self.samples += 1
        self.tokens = x if self.tokens is None else self.tokens * keep + x * self.ALPHA
        if step is not None:
            old = self.steps.get(step)
            if old is None and len(self.steps) >= self.MAX_STEPS:
                self.steps.clear()
            self.steps[step] = x if old is None else old * keep + x * self.ALPHA

    def service_s(self, tokens: float) -> float | None:
        """Predicted slot seconds for an answer of `tokens` tokens; None until learned."""
        if self.samples < self.MIN_SAMPLES:
            return None
        w, sx, sxx, sy, sxy = self._sums
        mx, my = sx / w, sy / w
        var = sxx / w - mx * mx
        if var <= 1e-9 * max(1.0, mx * mx):  # one length seen: its mean time
            return my
        b = (sxy / w - mx * my) / var
        return max(0.0, my + b * (tokens - mx))

    def estimate(self, ask: SlotAsk) -> Estimate | None:
        key = ask.step_key
        tokens, source = (self.steps.get(key), "step") if key is not None else (None, "")
        if tokens is None:
            tokens, source = self.tokens, "model"
        if tokens is None:
            return None
        s = self.service_s(tokens)
        return None if s is None else Estimate(s, tokens, source)

    def step_s(self, planned: int, step: int) -> float | None:
        """The estimate for call `step` of a task of `planned` steps."""
        tokens = self.steps.get((planned, step), self.tokens)
        return None if tokens is None else self.service_s(tokens)


@dataclass(slots=True)
class Admission:
    waited_s: float
    in_flight: int
    queued: int
    evidence: dict[str, Any] | None = None  # task_aware: class, position, estimate, task


def _expire(fut: asyncio.Future[None]) -> None:
    """A waiter's time to be handed a slot is over (unless it was handed one)."""
    if not fut.done():
        fut.set_exception(TimeoutError())


@dataclass(slots=True)
class _Waiter:
    fut: asyncio.Future[None]
    ask: SlotAsk
    deadline: float
    seq: int
    since: float
    estimate: Estimate | None


@dataclass(slots=True)
class _Progress:
    """A task the gate has admitted: its planned steps, the highest call seen, and its
    class (the highest its calls asked for)."""

    planned: int
    seen: int
    deadline: float
    priority: Priority = Priority.STANDARD
    last: float = 0.0  # when a call of it was last seen: queued, granted or answered


class DeploymentGate:
    MAX_TASKS = 10_000
    SINGLES_WINDOW_S = 30.0  # single calls' rate: the slots given them, decayed over this
    # A task none of whose calls was seen (queued, granted, answered) for this long, and
    # none queued, is idle: its remaining planned steps no longer count as admitted work.
    PLAN_IDLE_S = 60.0

    def __init__(
        self,
        name: str,
        max_concurrency: int | None,
        queue: int,
        policy: Policy = "task_aware",
        aging_s: float = 2.0,
        admit_headroom: float = 0.8,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.name = name
        self.max_concurrency = max_concurrency
        self.queue_size = queue
        self.policy = policy
        self.aging_s = aging_s
        self.admit_headroom = admit_headroom
        self.clock = clock
        self.in_flight = 0
        self.model = ServiceModel()
        self._waiters: list[_Waiter] = []
        self._seq = 0
        self._tasks: dict[Hashable, _Progress] = {}
        # Each tenant's keys of `_tasks`, least recently seen first (`_note`'s bound).
        self._owned: dict[Hashable, dict[Hashable, None]] = {}
        # Other clients' requests at this model's engines, beyond this gate's own (set by
        # the gateway from the engines' readings; None or 0 when not known).
        self.others: Callable[[], int] | None = None
        # Single calls given a slot, per class, decayed over SINGLES_WINDOW_S, as of
        # _singles_at (their rate: `_granted`).
        self._singles = [0.0] * len(Priority)
        self._singles_at = clock()

    @property
    def queued(self) -> int:
        return len(self._waiters)

    @property
    def task_aware(self) -> bool:
        return self.policy == "task_aware"

    def try_acquire(self, ask: SlotAsk = STANDARD, deadline: float = math.inf) -> Admission | None:
        """Take a free slot without waiting; None when the caller would have to queue."""
        if self.max_concurrency is None or (
            self.in_flight < self.max_concurrency and not self._waiters
        ):
            self.in_flight += 1
            if self.task_aware and ask.task is not None:
                self._note(ask, deadline, self.clock())
            self._granted(ask)
            return Admission(0.0, self.in_flight, len(self._waiters))
        return None

    async def acquire(self, deadline: float, ask: SlotAsk = STANDARD) -> Admission:
        """Take a slot, waiting in the queue until `deadline` (perf_counter seconds)."""
        start = self.clock()
        free = self.try_acquire(ask, deadline)
        if free is not None:
            return free
        est = self.model.estimate(ask) if self.task_aware else None
        evidence: dict[str, Any] | None = None
        if self.task_aware:
            evidence = self._evidence(ask, deadline, est, start)
            self._refuse_unreachable(ask, deadline, est, start, evidence)
            if ask.new_task:
                self._admit_task(ask, deadline, est, start, evidence)
        if len(self._waiters) >= self.queue_size and not self._make_room(ask, deadline, start):
            raise QueueFull(
                f"model '{self.name}' is at capacity ({self.in_flight} running, "
                f"{len(self._waiters)} queued); retry shortly",
                headers={"Retry-After": str(self._place_free_s(ask, est))},
            )
        self._seq += 1
        w = _Waiter(
            asyncio.get_running_loop().create_future(), ask, deadline, self._seq, start, est
        )
        if evidence is not None:
            evidence["position"] = self._position(w, start)
            if ask.task is not None:
                self._note(ask, deadline, start)
        self._waiters.append(w)
        limit = deadline - (est.service_s if est is not None else 0.0)
        # The timer ends the wait on the future itself, not `asyncio.wait_for`: on Python
        # 3.11 a wait_for whose future was handed a slot just before the waiting task was
        # cancelled (a task's cancel, the client gone) returns the slot and swallows the
        # cancellation, so a cancelled call was served, or (under `until_gone`) its slot
        # was never given back.
        timer: asyncio.TimerHandle | None = None
        left = limit - self.clock()
        if left > 0 and math.isfinite(left):
            timer = asyncio.get_running_loop().call_later(left, _expire, w.fut)
        elif left <= 0:
            _expire(w.fut)
        try:
            await w.fut
        except TimeoutError:
            waited = self.clock() - start
            if est is not None:
                raise self._unreachable(w, waited, evidence) from None
            self._forget(ask)
            raise DeadlineExceeded(
                f"the request deadline passed after {waited:.2f}s "
                f"in the queue for '{self.name}'; it was not sent upstream"
            ) from None
        except asyncio.CancelledError:
            # Cancelled after being handed a slot: give it to the next waiter.
            if w.fut.done() and not w.fut.cancelled() and w.fut.exception() is None:
                self.release()
            self._forget(ask)  # a new task whose first step never ran is not admitted
            raise
        finally:
            if timer is not None:
                timer.cancel()
            with contextlib.suppress(ValueError):
                self._waiters.remove(w)
        now = self.clock()
        waited = now - start
        self._granted(ask)
        if evidence is not None:
            self._touch(ask, now)
            evidence["waited_s"] = round(waited, 4)
        return Admission(waited, self.in_flight, len(self._waiters), evidence)

    def release(
        self, held_s: float | None = None, tokens: int | None = None, ask: SlotAsk = STANDARD
    ) -> None:
        """Give a slot back; with how long it was held and the answer's output tokens,
        the service model learns from it. The slot goes straight to the next waiter
        (in_flight stays the same) that can still finish in time."""
        if held_s is not None and tokens is not None:
            self.model.observe(held_s, tokens, ask.step_key)
        now = self.clock()
        if ask.task is not None:
            self._touch(ask, now)  # its task is being worked: an answer came
        while self._waiters:
            w = self._next(now)
            self._waiters.remove(w)
            if w.fut.done():
                continue
            if (
                self.task_aware
                and w.estimate is not None
                and now + w.estimate.service_s > w.deadline
            ):
                w.fut.set_exception(self._unreachable(w, now - w.since, None))
                continue
            w.fut.set_result(None)
            return
        if self.in_flight > 0:
            self.in_flight -= 1

    # --- task_aware -------------------------------------------------------------------

    def _key(self, w: _Waiter, now: float) -> tuple[int, int, float, int]:
        lifted = int((now - w.since) / self.aging_s)
        return (max(0, int(w.ask.priority) - lifted), int(w.ask.new_task), w.deadline, w.seq)

    def _next(self, now: float) -> _Waiter:
        if not self.task_aware:
            return self._waiters[0]
        return min(self._waiters, key=lambda w: self._key(w, now))

    def _position(self, new: _Waiter, now: float) -> int:
        """How many queued waiters rank ahead of `new` now."""
        key = self._key(new, now)
        return sum(1 for w in self._waiters if self._key(w, now) < key)

    def _evidence(
        self, ask: SlotAsk, deadline: float, est: Estimate | None, now: float
    ) -> dict[str, Any]:
        out: dict[str, Any] = {
            "policy": self.policy,
            "class": ask.priority.name.lower(),
            "deadline_in_s": round(deadline - now, 4),
            "estimate": est.evidence() if est is not None else None,
        }
        if ask.task is not None:
            out["task"] = {"step": ask.step, "planned": ask.planned, "new": ask.new_task}
        return out

    def _refuse_unreachable(
        self,
        ask: SlotAsk,
        deadline: float,
        est: Estimate | None,
        now: float,
        evidence: dict[str, Any],
    ) -> None:
        if est is not None and now + est.service_s > deadline:
            raise DeadlineUnreachable(
                f"the request cannot finish before its deadline: {deadline - now:.2f}s left, "
                f"'{self.name}' takes about {est.service_s:.2f}s; it was not sent upstream",
                evidence=evidence,
            )

    def _unreachable(
        self, w: _Waiter, waited: float, evidence: dict[str, Any] | None
    ) -> DeadlineUnreachable:
        assert w.estimate is not None
        self._forget(w.ask)
        ev = dict(evidence or {}) | {"waited_s": round(waited, 4)}
        return DeadlineUnreachable(
            f"the request could no longer finish before its deadline after {waited:.2f}s in the "
            f"queue for '{self.name}' (about {w.estimate.service_s:.2f}s of service left to "
            "run); it was not sent upstream",
            evidence=ev,
        )

    def _backlog_s(self, now: float, priority: Priority, deadline: float) -> float | None:
        """Slot seconds of the work ahead of a new task of class `priority` due at
        `deadline`: the estimates of the queued waiters and the remaining planned steps
        of the admitted tasks not yet queued that rank ahead of it in the queue's order
        (`_key`). Its first step waits behind the waiters queued now whose key is smaller
        than its own would be: those of a higher class after aging, those of its class
        but a later step or a single call (whatever their deadline), and first steps of
        its class due no later than it. From then on its steps rank by deadline against
        its class's, so an admitted task's remaining steps count when of a higher class,
        or due no later than it; those of its class due later never run before its
        steps (beyond the one step queued now, counted above), and counting them would
        let one client's far-off tasks refuse another's urgent one. Lower-class work
        (queued or planned) counts only when due no later than it: it rises a class
        each `aging_s` and then competes by deadline, so work due later never runs
        before the task's steps, and a batch client declaring long tasks cannot have an
        interactive task refused. A task counts only while it is being worked (a call
        of it queued, or one seen within `PLAN_IDLE_S`): a plan declared and left idle
        is dropped, so declared steps that are not coming cannot refuse others' tasks.
        Linear in the admitted tasks: the steps of a task not learned apart all take
        the model's estimate, so a task's remaining steps cost one multiplication, not
        one estimate each."""

        def ahead(cls: int, due: float) -> bool:
            return cls < priority or due <= deadline

        total = 0.0
        working: set[Hashable] = set()  # the tasks with a call queued
        for w in self._waiters:
            if w.ask.task is not None:
                working.add(w.ask.task)
            cls = self._key(w, now)[0]
            if not (ahead(cls, w.deadline) or (cls == priority and not w.ask.new_task)):
                continue
            if w.estimate is None:
                return None
            total += w.estimate.service_s
        if not self._tasks:
            return total
        tokens = self.model.tokens  # a step not learned apart: the model's estimate
        base = self.model.service_s(tokens) if tokens is not None else None
        learned: dict[int, list[tuple[int, float]]] = {}  # planned -> (step, its estimate)
        for (planned, step), step_tokens in self.model.steps.items():
            s = self.model.service_s(step_tokens)
            if s is None:
                return None
            learned.setdefault(planned, []).append((step, s))
        idle_since = now - self.PLAN_IDLE_S
        for key, p in list(self._tasks.items()):
            if (
                p.deadline <= now
                or p.seen >= p.planned
                or (p.last < idle_since and key not in working)
            ):
                self._drop(key)
                continue
            if not ahead(p.priority, p.deadline):
                continue
            first, last = p.seen + 1, min(p.planned, p.seen + 64)
            known = [s for step, s in learned.get(p.planned, ()) if first <= step <= last]
            rest = last - first + 1 - len(known)
            if rest and base is None:
                return None
            total += sum(known) + rest * (base or 0.0)
        return total

    def _admit_task(
        self,
        ask: SlotAsk,
        deadline: float,
        est: Estimate | None,
        now: float,
        evidence: dict[str, Any],
    ) -> None:
        """While saturated, refuse a new task that would not end in time behind the work
        already admitted (503 overloaded)."""
        if est is None or not self.max_concurrency:
            return
        backlog = self._backlog_s(now, ask.priority, deadline)
        planned = max(1, min(ask.planned or 1, 64))
        own = [self.model.step_s(planned, k) for k in range(1, planned + 1)]
        if backlog is None or any(s is None for s in own):
            return
        slots, singles, others = self._capacity(ask.priority, now)
        wait = backlog / slots
        path = sum(s for s in own if s is not None)
        left = deadline - now
        evidence["admission"] = {
            "backlog_s": round(backlog, 3),
            "capacity": {
                "slots": round(slots, 3),
                "single_calls": round(singles, 3),
                "other_clients": others,
            },
            "wait_s": round(wait, 3),
            "task_work_s": round(path, 3),
            "time_left_s": round(left, 3),
            "headroom": self.admit_headroom,
        }
        if wait + path > self.admit_headroom * left:
            raise Overloaded(
                f"model '{self.name}' is saturated: a new task would wait about {wait:.1f}s behind "
                f"the tasks already admitted and need about {path:.1f}s more, past "
                f"{self.admit_headroom:.0%} of its {left:.1f}s; retry later",
                retry_after_s=math.ceil(wait),
                evidence=evidence,
            )

    def _granted(self, ask: SlotAsk) -> None:
        """A single call got its slot: one more in its class's decayed count. Counted
        here, not on arrival: a call that waits passes try_acquire twice, and one the
        gate refuses (queue full, deadline unreachable) holds no slot, so a flood of
        refused calls cannot shrink the capacity left to everyone's tasks."""
        if not (self.max_concurrency and ask.single and self.task_aware):
            return  # max_concurrency first: most models have none, and it is no property
        now = self.clock()
        self._decay(now)
        self._singles[ask.priority] += 1.0

    def _decay(self, now: float) -> None:
        dt = now - self._singles_at
        if dt > 0:
            keep = math.exp(-dt / self.SINGLES_WINDOW_S)
            self._singles = [n * keep for n in self._singles]
            self._singles_at = now

    def _capacity(self, priority: Priority, now: float) -> tuple[float, float, int]:
        """The slots a new task of class `priority` can count on: the concurrency less
        the slots single calls of its class or higher hold on average (the rate they
        are given slots times their service time) and those other clients' requests
        hold at the engines. At least one: the estimate is only made while the model is
        saturated."""
        assert self.max_concurrency
        self._decay(now)
        rate = sum(self._singles[: priority + 1]) / self.SINGLES_WINDOW_S
        single_s = self.model.step_s(*SINGLE_STEP) or 0.0
        singles = rate * single_s
        others = 0
        if self.others is not None:
            others = max(0, min(int(self.others()), MAX_OTHERS))
        return max(1.0, self.max_concurrency - singles - others), singles, others

    def _make_room(self, ask: SlotAsk, deadline: float, now: float) -> bool:
        """A full queue: a step of an admitted task (or a single call) takes the place of
        the lowest-ranked first step of a new task, refused 503 overloaded, when that
        first step ranks below it in the queue's own order (its class after aging no
        higher than the arriving request's: within a class later steps go first). A
        batch call never pushes out a higher class's queued task: it is refused."""
        if not self.task_aware or ask.new_task:
            return False
        firsts = [w for w in self._waiters if w.ask.new_task and not w.fut.done()]
        if not firsts:
            return False
        victim = max(firsts, key=lambda w: self._key(w, now))
        arriving = (int(ask.priority), 0, deadline, self._seq + 1)  # its key, queued now
        if self._key(victim, now) < arriving:
            return False
        self._waiters.remove(victim)
        self._forget(victim.ask)
        # Its Retry-After, as a full queue's: when a place should free, the queue being
        # as full as before (the arriving request takes the place it gave up).
        retry = self._place_free_s(victim.ask, victim.estimate, len(self._waiters) + 1)
        victim.fut.set_exception(
            Overloaded(
                f"model '{self.name}' is saturated: the queue's place of this new task went to "
                "a step of a task already admitted; retry later",
                retry_after_s=retry,
                evidence={"policy": self.policy, "displaced_after_s": round(now - victim.since, 4)},
            )
        )
        return True

    def _place_free_s(self, ask: SlotAsk, est: Estimate | None, queued: int | None = None) -> int:
        """A full queue's Retry-After: about when a place frees, the queued waiters'
        service over the concurrency (the estimate for this request times the queued, as
        the 503's expected wait is worked out), at least 1 s; 1 s without an estimate."""
        if est is None:
            est = self.model.estimate(ask)
        if est is None or not self.max_concurrency:
            return 1
        n = len(self._waiters) if queued is None else queued
        wait = est.service_s * n / self.max_concurrency
        return max(1, math.ceil(wait)) if math.isfinite(wait) else 1

    def forget_task(self, task: Hashable) -> None:
        """The task was cancelled: its remaining planned steps are no longer admitted
        work (its calls still queued are stopped by their own cancel)."""
        self._drop(task)

    def _forget(self, ask: SlotAsk) -> None:
        """A new task whose first step did not get its slot (refused, cancelled, timed
        out) is not admitted after all."""
        if ask.new_task and ask.task is not None:
            self._drop(ask.task)

    def _touch(self, ask: SlotAsk, now: float) -> None:
        """A call of the task was granted or answered: the task is being worked."""
        p = self._tasks.get(ask.task) if ask.task is not None else None
        if p is not None:
            p.last = now

    @staticmethod
    def _tenant(task: Hashable) -> Hashable:
        """A task key's tenant: (tenant, task id) as the queue stage makes it."""
        return task[0] if type(task) is tuple and task else task

    def _drop(self, task: Hashable) -> None:
        if self._tasks.pop(task, None) is None:
            return
        tenant = self._tenant(task)
        own = self._owned.get(tenant)
        if own is not None:
            own.pop(task, None)
            if not own:
                del self._owned[tenant]

    def _victim(self, tenant: Hashable) -> Hashable:
        """The record `_note` gives up past MAX_TASKS: the least recently seen of the
        tenant holding the most (the admitting `tenant` on a tie), so one tenant's flood
        of new task ids costs its own records, never another tenant's; when every
        tenant holds one, the least recently seen of all. Linear in the tenants, and
        only when the bound is reached."""
        owned = self._owned
        mine = owned.get(tenant)
        most = max(owned, key=lambda t: len(owned[t]))
        if mine is not None and len(mine) == len(owned[most]):
            most = tenant
        if len(owned[most]) < 2:
            return next(iter(self._tasks))
        return next(iter(owned[most]))

    def _note(self, ask: SlotAsk, deadline: float, now: float) -> None:
        """Count the task as admitted, with the highest of its calls seen. At most
        MAX_TASKS are kept (`_victim`: past it the tenant holding the most records
        gives up its least recently seen)."""
        task = ask.task
        if task is None or ask.step is None:
            return
        tenant = self._tenant(task)
        p = self._tasks.pop(task, None)
        own = self._owned.get(tenant)
        if p is None:
            if ask.planned is None or ask.planned <= 1:
                return
            if len(self._tasks) >= self.MAX_TASKS:
                self._drop(self._victim(tenant))
                own = self._owned.get(tenant)
            p = _Progress(ask.planned, 0, deadline, ask.priority)
        elif own is not None:
            own.pop(task, None)
        if own is None:
            own = self._owned[tenant] = {}
        self._tasks[task] = p  # the most recently seen last
        own[task] = None
        p.seen = max(p.seen, ask.step)
        p.deadline = min(p.deadline, deadline)
        p.priority = min(p.priority, ask.priority)
        p.last = now
