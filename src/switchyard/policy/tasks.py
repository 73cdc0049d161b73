"""Agent tasks as a unit of policy: budgets, deadlines and cancel.

A task is every request of one tenant that carries the same `x-task-id`. Task ids are
chosen by clients, so a task's state is keyed by (tenant, task id): another tenant
can never drain, read or cancel it. Its state is set by its first request and kept
until `tasks.idle_ttl_s` after its last one (at most `tasks.max_tasks` states; past it the
tenant holding the most loses its own least recently admitted one):

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
A request that makes a further upstream call after one that may have been billed (a
retry or fallback after a timeout) first holds one more call's tokens and cost in its
task, with the limiter's extension, all or nothing (`TaskStore.extend`, through
`Reserver.extend`); a task that cannot hold it refuses the call (`retry`
`denied:budget`), and the request's settle replaces its whole hold by what was used.
A tool call (`admit(..., tool=True)`, mcp_service/) reserves one of `tool_calls`
instead of `calls`, no tokens, and its tool's price against `cost_usd`.

`MemoryTaskStore` (state/tasks_memory.py) holds the state for one gateway process;
`RedisTaskStore` (state/tasks_redis.py) shares it between processes. The calls in flight are always
this process's own (`Running`): a cancel stops those here at once, and every process
refuses the task's next calls.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from switchyard.state.tasks import TaskKey, TaskStore


@dataclass(slots=True)
class TaskHold:
    """What a request of a task holds until it is settled."""

    key: TaskKey
    request_id: str
    call: int = 0  # its number among the task's calls (1: the task's first), at admission
    planned: int | None = None  # the task's planned steps (x-task-planned-steps)
    # Where it is held, and one upstream call's worth as it was admitted (tokens, cost):
    # what each extension holds again (policy/stages_admission.py `Reserver.extend`).
    store: TaskStore | None = None
    tokens: int = 0
    cost_usd: float = 0.0
    extended: int = 0  # the extensions it holds (`TaskStore.extend`)


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
