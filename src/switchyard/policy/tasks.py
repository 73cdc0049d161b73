"""Agent tasks as a unit of policy: budgets, deadlines and cancel.

A task is every request of one tenant that carries the same `x-task-id`. Task ids are
chosen by clients, so a task's state is keyed by (tenant, task id): another tenant
can never drain, read or cancel it. Its state is set by its first request and kept
until `tasks.idle_ttl_s` after its last one (at most `tasks.max_tasks` states; the
least recently active go first):

* the budget: model calls, tool calls (`tools/call` through `/mcp`), tokens, cost and
  wall time over the task's whole life. The
  tenant's default (config `tasks.budget`, the tenant's and the key's `task_budget`)
  may be lowered by the first request's `x-task-budget`, never raised;
* the deadline: the earliest of `x-task-deadline`, the first request plus
  `x-task-timeout` and the first request plus the budget's `wall_s`. Every call's own
  deadline is cut to it, so queued, retried and fallback attempts all count;
* whether it was cancelled.

Calls, tokens and cost are reserved at admission, as the per-request budget is: a
call is admitted only if its estimate fits what is left, so concurrent steps of one
task cannot overshoot together; at settle the estimate is replaced by what was used.
A tool call (`admit(..., tool=True)`, mcp_service/) reserves one of `tool_calls`
instead of `calls`, no tokens, and its tool's price against `cost_usd`.

`MemoryTaskStore` holds the state for one gateway process; `RedisTaskStore`
(policy/redis_tasks.py) shares it between processes. The calls in flight are always
this process's own (`Running`): a cancel stops those here at once, and every process
refuses the task's next calls.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from switchyard.identity import TaskBudget

# The budget fields, in the order they are checked and reported.

TaskKey = tuple[str, str]  # (tenant id, task id)


@dataclass(frozen=True, slots=True)
class TaskFirst:
    """What a task's first request sets (later requests' values are ignored)."""

    budget: TaskBudget
    timeout_s: float | None = None  # x-task-timeout
    deadline_at: float | None = None  # x-task-deadline, unix seconds


@dataclass(slots=True)
class TaskAdmission:
    """The store's answer for one call of a task."""

    allowed: bool
    # When refused: "cancelled", "deadline", or the budget field that ran out.
    refused: str | None
    budget: dict[str, Any]
    used: dict[str, float]  # calls, tokens, cost_usd, tool_calls (reservations included)
    started_at: float
    deadline_at: float | None
    deadline_by: str | None  # what set the deadline: wall_s, x-task-timeout, x-task-deadline
    cancelled_at: float | None = None
    # The deployment serving this task, per alias with several (decide/balance.py):
    # one record for every gateway process, so the task's steps stay on it.
    deployments: dict[str, str] = field(default_factory=dict)

    def remaining(self) -> dict[str, float]:
        budget, used = self.budget, self.used
        out: dict[str, float] = {}
        for f in ("calls", "tokens", "cost_usd", "tool_calls"):
            limit = budget.get(f)
            if limit is not None:
                out[f] = max(0.0, round(float(limit) - used.get(f, 0.0), 9))
        return out

    def evidence(self, now: float) -> dict[str, Any]:
        used = self.used
        out: dict[str, Any] = {
            "budget": self.budget,  # the task's own dict: fixed once the task began
            "used": {
                "calls": used["calls"],
                "tokens": used["tokens"],
                "cost_usd": round(used["cost_usd"], 9),
                "tool_calls": used.get("tool_calls", 0.0),
            },
            "remaining": self.remaining(),
            "age_s": round(now - self.started_at, 3),
        }
        if self.deadline_at is not None:
            out["deadline_at"] = self.deadline_at
            out["deadline_in_s"] = round(self.deadline_at - now, 3)
            out["deadline_by"] = self.deadline_by
        if self.cancelled_at is not None:
            out["cancelled_at"] = self.cancelled_at
        return out


def first_deadline(first: TaskFirst, started_at: float) -> tuple[float | None, str | None]:
    """The task's deadline (unix seconds) and what set it, from its first request."""
    options = []
    if first.deadline_at is not None:
        options.append((first.deadline_at, "x-task-deadline"))
    if first.timeout_s is not None:
        options.append((started_at + first.timeout_s, "x-task-timeout"))
    if first.budget.wall_s is not None:
        options.append((started_at + first.budget.wall_s, "wall_s"))
    if not options:
        return None, None
    return min(options)


def check(
    budget: TaskBudget,
    used: dict[str, float],
    tokens: int,
    cost: float,
    deadline_at: float | None,
    deadline_by: str | None,
    now: float,
    tool: bool = False,
) -> str | None:
    """Why one more call of (tokens, cost) is refused, or None: the deadline first,
    then the calls of its kind (`calls`, or `tool_calls` for a tool call), tokens and
    cost. The same rule in both stores."""
    if deadline_at is not None and now >= deadline_at:
        return "wall_s" if deadline_by == "wall_s" else "deadline"
    if tool:
        if budget.tool_calls is not None and used["tool_calls"] + 1 > budget.tool_calls:
            return "tool_calls"
    elif budget.calls is not None and used["calls"] + 1 > budget.calls:
        return "calls"
    if budget.tokens is not None and used["tokens"] + tokens > budget.tokens:
        return "tokens"
    if budget.cost_usd is not None and used["cost_usd"] + cost > budget.cost_usd + 1e-12:
        return "cost_usd"
    return None


@dataclass(slots=True)
class ToolCallNote:
    """One tool call a model returned in this task, as the gateway relayed it."""

    call_id: str
    tool: str
    tool_class: str
    request_id: str
    key: str | None  # the idempotency key of a side-effecting call
    results: int = 0  # results of it that later requests carried
    # A keyed call's (tool, canonical arguments) digest: how /mcp finds the call id of a
    # call whose client sends none (mcp_service/).
    args: str | None = None


@dataclass(slots=True)
class _State:
    budget: TaskBudget
    started_at: float
    deadline_at: float | None
    deadline_by: str | None
    last_at: float
    used: dict[str, float] = field(
        default_factory=lambda: {"calls": 0.0, "tokens": 0.0, "cost_usd": 0.0, "tool_calls": 0.0}
    )
    # rid → what it reserved: tokens, cost, and whether it is a tool call
    held: dict[str, tuple[int, float, bool]] = field(default_factory=dict)
    refused: dict[str, int] = field(default_factory=dict)  # by budget/cause
    cancelled_at: float | None = None
    tool_calls: OrderedDict[str, ToolCallNote] = field(default_factory=OrderedDict)
    deployments: dict[str, str] = field(default_factory=dict)  # alias → deployment
    budget_dict: dict[str, Any] | None = None  # budget.as_dict(), made once


class TaskStore(Protocol):
    async def admit(
        self,
        key: TaskKey,
        first: TaskFirst,
        rid: str,
        tokens: int,
        cost: float,
        now: float,
        tool: bool = False,
    ) -> TaskAdmission:
        """Reserve one call (a model call, or with `tool` a tool call) of `tokens` and
        `cost`, or refuse it."""
        ...

    async def settle(
        self, key: TaskKey, rid: str, tokens: int, cost: float, called: bool = True
    ) -> None:
        """Replace the call's reservation by what it used; a call that never reached
        a model (refused after admission) gives its call back."""
        ...

    async def cancel(self, key: TaskKey, now: float) -> dict[str, Any] | None: ...

    async def note_tool_calls(self, key: TaskKey, calls: list[ToolCallNote]) -> None: ...

    async def note_results(self, key: TaskKey, call_ids: list[str]) -> dict[str, ToolCallNote]:
        """Count a result for each call id; returns the known calls among them, with
        their count after this one (results > 1: a duplicate)."""
        ...

    async def tool_call(self, key: TaskKey, call_id: str) -> ToolCallNote | None: ...

    async def set_deployment(self, key: TaskKey, alias: str, deployment: str) -> None:
        """The deployment that serves the task's calls to `alias` from now on."""
        ...

    async def describe(self, key: TaskKey, now: float | None = None) -> dict[str, Any] | None: ...

    async def close(self) -> None: ...


def describe_state(key: TaskKey, st: Any) -> dict[str, Any]:
    return {
        "tenant": key[0],
        "task_id": key[1],
        "budget": st.budget.as_dict(),
        "used": {k: round(v, 9) for k, v in st.used.items()},
        "started_at": st.started_at,
        "deadline_at": st.deadline_at,
        "deadline_by": st.deadline_by,
        "refused": dict(st.refused),
        "cancelled_at": st.cancelled_at,
        "tool_calls": [note_dict(n) for n in st.tool_calls.values()],
        "deployments": dict(st.deployments),
    }


def note_dict(n: ToolCallNote) -> dict[str, Any]:
    return {
        "call_id": n.call_id,
        "tool": n.tool,
        "class": n.tool_class,
        "request_id": n.request_id,
        "idempotency_key": n.key,
        "results": n.results,
        "args_digest": n.args,
    }


class MemoryTaskStore:
    """Task state in this process (see the module docstring)."""

    def __init__(self, max_tasks: int = 100_000, idle_ttl_s: float = 3600.0, max_calls: int = 1000):
        self.max_tasks = max_tasks
        self.idle_ttl_s = idle_ttl_s
        self.max_calls = max_calls
        self._tasks: OrderedDict[TaskKey, _State] = OrderedDict()

    def _expire(self, now: float) -> None:
        tasks = self._tasks
        while tasks:
            key, st = next(iter(tasks.items()))
            if now - st.last_at < self.idle_ttl_s and len(tasks) <= self.max_tasks:
                break
            del tasks[key]

    def _get(self, key: TaskKey, now: float) -> _State | None:
        st = self._tasks.get(key)
        if st is not None and now - st.last_at >= self.idle_ttl_s:
            del self._tasks[key]
            return None
        return st

    async def admit(
        self,
        key: TaskKey,
        first: TaskFirst,
        rid: str,
        tokens: int,
        cost: float,
        now: float,
        tool: bool = False,
    ) -> TaskAdmission:
        st = self._get(key, now)
        if st is None:
            deadline_at, by = first_deadline(first, now)
            st = self._tasks[key] = _State(first.budget, now, deadline_at, by, now)
        st.last_at = now
        self._tasks.move_to_end(key)
        self._expire(now)
        refused = (
            "cancelled"
            if st.cancelled_at is not None
            else check(st.budget, st.used, tokens, cost, st.deadline_at, st.deadline_by, now, tool)
        )
        if refused is None:
            st.used["tool_calls" if tool else "calls"] += 1
            st.used["tokens"] += tokens
            st.used["cost_usd"] += cost
            st.held[rid] = (tokens, cost, tool)
        else:
            st.refused[refused] = st.refused.get(refused, 0) + 1
        if st.budget_dict is None:
            st.budget_dict = st.budget.as_dict()
        return TaskAdmission(
            refused is None,
            refused,
            st.budget_dict,
            dict(st.used),
            st.started_at,
            st.deadline_at,
            st.deadline_by,
            st.cancelled_at,
            dict(st.deployments),
        )

    async def settle(
        self, key: TaskKey, rid: str, tokens: int, cost: float, called: bool = True
    ) -> None:
        st = self._tasks.get(key)
        held = st.held.pop(rid, None) if st is not None else None
        if st is None or held is None:
            return
        if not called:
            kind = "tool_calls" if held[2] else "calls"
            st.used[kind] = max(0.0, st.used[kind] - 1)
        st.used["tokens"] = max(0.0, st.used["tokens"] - held[0] + tokens)
        st.used["cost_usd"] = max(0.0, st.used["cost_usd"] - held[1] + cost)

    async def cancel(self, key: TaskKey, now: float) -> dict[str, Any] | None:
        st = self._get(key, now)
        if st is None:
            return None
        if st.cancelled_at is None:
            st.cancelled_at = now
        st.last_at = now
        return describe_state(key, st)

    async def note_tool_calls(self, key: TaskKey, calls: list[ToolCallNote]) -> None:
        st = self._tasks.get(key)
        if st is None:
            return
        for note in calls:
            st.tool_calls[note.call_id] = note
            st.tool_calls.move_to_end(note.call_id)
        while len(st.tool_calls) > self.max_calls:
            st.tool_calls.popitem(last=False)

    async def note_results(self, key: TaskKey, call_ids: list[str]) -> dict[str, ToolCallNote]:
        st = self._tasks.get(key)
        out: dict[str, ToolCallNote] = {}
        if st is None:
            return out
        for cid in call_ids:
            note = st.tool_calls.get(cid)
            if note is not None:
                note.results += 1
                out[cid] = replace(note)
        return out

    async def tool_call(self, key: TaskKey, call_id: str) -> ToolCallNote | None:
        st = self._tasks.get(key)
        return st.tool_calls.get(call_id) if st is not None else None

    async def set_deployment(self, key: TaskKey, alias: str, deployment: str) -> None:
        st = self._tasks.get(key)
        if st is not None:
            st.deployments[alias] = deployment

    async def describe(self, key: TaskKey, now: float | None = None) -> dict[str, Any] | None:
        st = self._get(key, time.time() if now is None else now)
        return describe_state(key, st) if st is not None else None

    async def close(self) -> None:
        return None


@dataclass(slots=True)
class TaskHold:
    """What a request of a task holds until it is settled."""

    key: TaskKey
    request_id: str
    call: int = 0  # its number among the task's calls (1: the task's first), at admission
    planned: int | None = None  # the task's planned steps (x-task-planned-steps)


class Running:
    """The calls of each task in flight in this process: (request context, the
    asyncio task serving it), so a cancel can stop them."""

    def __init__(self) -> None:
        self._by_task: dict[TaskKey, dict[str, tuple[Any, asyncio.Task[Any] | None]]] = {}

    def add(self, key: TaskKey, ctx: Any) -> None:
        try:
            task = asyncio.current_task()
        except RuntimeError:
            task = None
        self._by_task.setdefault(key, {})[ctx.input.request_id] = (ctx, task)

    def remove(self, key: TaskKey, rid: str) -> None:
        calls = self._by_task.get(key)
        if calls is not None:
            calls.pop(rid, None)
            if not calls:
                del self._by_task[key]

    def running(self, key: TaskKey) -> list[str]:
        return list(self._by_task.get(key, {}))

    def stop(self, key: TaskKey) -> list[str]:
        """Stop every call of the task in flight here; their ids. Each stopped call
        ends with 409 task_cancelled (or, mid-stream, an SSE error event with that
        code), and its upstream connection is closed, so the engine stops generating."""
        stopped = []
        for rid, (ctx, task) in list(self._by_task.get(key, {}).items()):
            # Only while it runs: an answered request is being settled, and a settle
            # is never interrupted (its usage row would be lost).
            if ctx.finished or ctx.cancelled or ctx.status not in ("pending", "streaming"):
                continue
            ctx.cancelled = True
            if task is not None and not task.done():
                task.cancel()
            stopped.append(rid)
        return stopped
