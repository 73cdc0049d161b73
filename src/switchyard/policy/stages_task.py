"""The task stage: a request's agent task (`x-task-id`) admitted against the task's
budget and deadline and settled on release; and the task's refusals in a decision's
and a client's words, shared with tool calls (mcp_service).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable
from typing import Any

from switchyard import outcomes
from switchyard.config import Settings
from switchyard.errors import (
    InvalidRequest,
    SwitchyardError,
    TaskBudgetExceeded,
    TaskCancelled,
    TaskDeadlineExceeded,
    TaskStateUnavailable,
)
from switchyard.identity import TaskBudget
from switchyard.pipeline import RequestContext, Stage, Verdict, View
from switchyard.policy import headers as request_headers
from switchyard.policy.admit import cost_usd
from switchyard.policy.stages_admission import Estimate, minimal_answer
from switchyard.policy.tasks import Running, TaskHold
from switchyard.state.limits import LimiterUnavailable
from switchyard.state.tasks import TaskAdmission, TaskFirst, TaskStore

log = logging.getLogger("switchyard")


class Task(Stage):
    """The request's agent task (`x-task-id`): refused once the task is cancelled or
    past its deadline, or when its estimate does not fit what the task's budget has
    left; otherwise reserved against that budget, its deadline cut to the task's, and
    counted among the task's calls in flight (so a cancel can stop it)."""

    name = "task"
    NO_TASK = Verdict(outcomes.Task.SKIP, "no x-task-id")

    def __init__(
        self, settings: Settings, store: TaskStore, running: Running, estimate: Estimate
    ) -> None:
        self._default = TaskBudget.of(settings.tasks.budget)
        self._fail_open = settings.policy.on_limiter_failure == "fail_open"
        self._min_output = settings.policy.min_output_tokens
        self._asked: dict[str, TaskBudget] = {}  # x-task-budget values, parsed
        self._store = store
        self._running = running
        self._estimate = estimate

    def static(self, view: View) -> Verdict | None:
        return None if view.in_task else self.NO_TASK

    def work(self, ctx: RequestContext) -> Awaitable[None]:
        return self._admit(ctx)

    def release(self, ctx: RequestContext) -> Awaitable[None] | None:
        """No longer among the task's calls in flight; the task is charged what the
        request used (and keeps the reply's tool calls)."""
        hold = ctx.task
        if hold is None:
            return None
        self._running.remove(hold.key, hold.request_id)
        return self._settle(ctx, hold)

    async def _settle(self, ctx: RequestContext, hold: TaskHold) -> None:
        run = ctx.run
        try:
            if ctx.tool_notes:
                await self._store.note_tool_calls(hold.key, ctx.tool_notes)
            called = run.attempts > 0 or ctx.cache is not None
            await self._store.settle(
                hold.key, hold.request_id, run.tokens_in + run.tokens_out, run.cost_usd, called
            )
        except Exception as exc:  # shared task state unreachable: logged, not lost
            log.warning("could not settle task of %s: %s", ctx.input.request_id, exc)

    def _first(self, ctx: RequestContext) -> TaskFirst:
        """What this request would set if it were the task's first (its headers are
        validated whether or not they take effect)."""
        h = ctx.input.headers
        budget = self._default
        p = ctx.principal
        if p is not None and p.task_budget is not None:
            budget = budget.lower(p.task_budget)
        raw = h.get("x-task-budget")
        if raw is not None:
            asked = self._asked.get(raw)
            if asked is None:  # agents send the same few values: parsed once each
                asked = TaskBudget.of(request_headers.task_budget(raw))
                if len(self._asked) >= 1024:
                    self._asked.clear()
                self._asked[raw] = asked
            budget = budget.lower(asked)
        timeout = h.get("x-task-timeout")
        deadline = h.get("x-task-deadline")
        return TaskFirst(
            budget,
            request_headers.task_timeout(timeout) if timeout is not None else None,
            request_headers.task_deadline(deadline, ctx.input.received_at)
            if deadline is not None
            else None,
        )

    async def _admit(self, ctx: RequestContext) -> None:
        t = time.perf_counter()
        task_id = ctx.input.task_id
        assert task_id is not None
        try:
            first = self._first(ctx)
        except InvalidRequest as exc:
            ctx.record(self.name, outcomes.Task.REJECT_INVALID_HEADER, exc.message, t)
            raise
        key = (ctx.principal.tenant_id, task_id)
        prompt, out, price = self._estimate(ctx)
        cost = cost_usd(price, prompt, out) if price else 0.0
        now = time.time()
        rid = ctx.input.request_id
        shrunk: dict[str, Any] | None = None
        tokens = prompt + out
        try:
            adm = await self._store.admit(key, first, rid, tokens, cost, now)
            shape = ctx.cost
            # Less left in the task's budget than the cap: the cap shrinks to what fits.
            for _ in range(3):
                if adm.refused not in ("tokens", "cost_usd") or shape is None:
                    break
                left = adm.remaining()
                cap = shape.fit(left.get("tokens"), left.get("cost_usd"), price)
                if cap < minimal_answer(shape, self._min_output):
                    break
                if shrunk is None:
                    shrunk = {"from": shape.cap}
                shrunk.update({"to": cap, "by": f"task:{adm.refused}"})
                shape.shrink(cap, "task")
                ctx.max_tokens = shape.cap
                cost = shape.usd(price)
                tokens = shape.tokens
                adm = await self._store.admit(key, first, rid, tokens, cost, now)
        except LimiterUnavailable as exc:
            if self._fail_open:
                log.warning("task state unavailable, admitting (fail_open): %s", exc)
                ctx.record(self.name, outcomes.Task.FAIL_OPEN, f"task state unavailable: {exc}", t)
                return
            ctx.record(
                self.name, outcomes.Task.REJECT_UNAVAILABLE, f"task state unavailable: {exc}", t
            )
            raise TaskStateUnavailable("task state unavailable; refusing (fail_closed)") from None
        evidence = adm.evidence(now)
        refused = adm.refused
        if refused is not None:
            ctx.record(
                self.name, outcomes.reject(refused), task_refusal_reason(refused), t, evidence
            )
            raise task_error(task_id, refused, adm)
        ctx.task = TaskHold(
            key, rid, int(adm.used["calls"]), ctx.input.planned_steps, self._store, tokens, cost
        )
        if shrunk is not None:
            evidence["cap_shrunk"] = shrunk
        if adm.deployments:
            ctx.task_deployments = adm.deployments
        self._running.add(key, ctx)
        if adm.deadline_at is not None:
            cut = ctx.timings.received + (adm.deadline_at - ctx.input.received_at)
            if cut < ctx.deadline:
                ctx.deadline = cut
                evidence["deadline_cut"] = True
        ctx.record(
            self.name, outcomes.Task.ADMITTED, "within the task's budget and deadline", t, evidence
        )


def task_refusal_reason(refused: str) -> str:
    """A task's refusal in a decision's words (model and tool calls alike)."""
    if refused == "cancelled":
        return "the task was cancelled"
    if refused == "deadline":
        return "the task's deadline has passed"
    return f"the task's {refused} budget is spent"


def task_error(task_id: str, refused: str, adm: TaskAdmission) -> SwitchyardError:
    """The client's error for a task's refusal (model and tool calls alike)."""
    if refused == "cancelled":
        return TaskCancelled(f"the task '{task_id}' was cancelled; it takes no more calls")
    if refused == "deadline":
        return TaskDeadlineExceeded(
            f"the deadline of the task '{task_id}' has passed; the call was not sent upstream"
        )
    left = adm.remaining()
    if refused == "wall_s":
        what = f"its wall time of {adm.budget['wall_s']:g}s has passed"
    else:
        what = (
            f"its {refused} budget of {adm.budget[refused]:g} has {left.get(refused, 0.0):g} "
            "left, less than this call needs"
        )
    return TaskBudgetExceeded(
        f"task budget exceeded for the task '{task_id}': {what}",
        param=refused,
    )
