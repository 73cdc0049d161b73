"""Agent tasks' state: the `TaskStore` interface, what a task's first request sets and
the store answers, and the budget check both implementations apply.

`MemoryTaskStore` (state/tasks_memory.py) holds the state for one gateway process;
`RedisTaskStore` (state/tasks_redis.py) shares it between processes. The rules are
told in policy/tasks.py, which keeps the calls in flight (`Running`, `TaskHold`).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
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


def check_more(budget: TaskBudget, used: dict[str, float], tokens: int, cost: float) -> str | None:
    """Why holding (tokens, cost) more for a call the task holds already (a further
    upstream call of its request: `TaskStore.extend`) is refused, or None: its tokens,
    then its cost. Not a call more (the request is counted once among the task's calls),
    nor the deadline (the request's own is cut to it). The same rule in both stores."""
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
    # rid → what it reserved: tokens, cost (its extensions included), whether it is a
    # tool call, and how many extensions it holds (`TaskStore.extend`)
    held: dict[str, tuple[float, float, bool, int]] = field(default_factory=dict)
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

    async def extend(
        self, key: TaskKey, rid: str, n: int, tokens: int, cost: float, now: float
    ) -> TaskAdmission | None:
        """Hold `tokens` and `cost` more for the call `rid` holds (one more upstream
        call of its request, after one that may have been billed:
        policy/stages_admission.py `Reserver.extend`), as its `n`th extension, or refuse
        it (`check_more`: "tokens" or "cost_usd"; nothing held). An `n` the call
        holds already (the same extension sent again) is answered held and not applied
        again. What is extended joins the call's reservation, so its `settle` replaces
        it all by what was used. None when the task or the call's hold is gone (settled,
        expired): nothing is held."""
        ...

    async def settle(
        self, key: TaskKey, rid: str, tokens: int, cost: float, called: bool = True
    ) -> None:
        """Replace the call's reservation (its extensions included) by what it used; a
        call that never reached a model (refused after admission) gives its call back."""
        ...

    async def cancel(self, key: TaskKey, now: float) -> dict[str, Any] | None: ...

    async def note_tool_calls(self, key: TaskKey, calls: list[ToolCallNote]) -> None: ...

    async def note_results(self, key: TaskKey, call_ids: list[str]) -> dict[str, ToolCallNote]:
        """Count a result for each call id; returns the known calls among them, with
        their count after this one (results > 1: a duplicate)."""
        ...

    async def unnote_results(self, key: TaskKey, call_ids: list[str]) -> None:
        """Take back one counted result of each call id (`note_results`'s): the request
        that brought them went nowhere (refused before it went upstream)."""
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
