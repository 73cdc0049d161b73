"""Agent tasks (`x-task-id`) as a unit of policy, and how each model's queue orders and refuses
its waiters."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from switchyard.config.base import Strict


class TaskBudgetConfig(Strict):
    """A task's limits over its whole life (None = unlimited)."""

    calls: int | None = Field(None, ge=1)
    """Model calls admitted over the task's life; null = unlimited."""
    tool_calls: int | None = Field(None, ge=1)
    """Tool calls (`tools/call` through `/mcp`) admitted over the task's life; null = unlimited."""
    tokens: int | None = Field(None, ge=1)
    """Input plus output tokens over the task's life; null = unlimited."""
    cost_usd: float | None = Field(None, gt=0)
    """Spend over the task's life, in USD (each call's estimate is reserved at admission); null =
    unlimited."""
    wall_s: float | None = Field(None, gt=0)
    """Seconds from the task's first request after which its calls are refused (504
    `task_deadline_exceeded`); null = no limit."""


class TasksConfig(Strict):
    """Agent tasks (`x-task-id`) as a unit of policy: budgets, deadlines, cancel."""

    budget: TaskBudgetConfig = TaskBudgetConfig()
    """Every tenant's default task budget; a tenant's or key's `task_budget` and a task's
    `x-task-budget` header may lower it, never raise it."""
    max_tasks: int = Field(100_000, ge=1)
    """Task states kept per gateway (or in Redis, with `storage.redis_url`); past it the
    tenant holding the most loses its own least recently admitted one (idle ones past
    `idle_ttl_s` go first)."""
    idle_ttl_s: float = Field(3600.0, gt=0)
    """Seconds a task's state is kept after its last request."""
    max_tool_calls: int = Field(1000, ge=1)
    """Tool calls remembered per task (side-effect keys, results seen)."""


class SchedulingConfig(Strict):
    """How each model's queue (`models[].limits`) orders and refuses its waiters."""

    policy: Literal["task_aware", "fcfs"] = "task_aware"
    """`task_aware`: waiters by priority class, then later steps of admitted tasks before new
    tasks' first steps, then effective deadline (the request's or its task's, the earlier); a
    waiter that can no longer finish in time is refused at once (504 `deadline_unreachable`), and
    while the model is saturated a new task that would not finish in time behind the work already
    admitted is refused (503 `overloaded`). `fcfs`: first come, first served, refused only when
    the queue is full or the deadline passes."""
    aging_s: float = Field(2.0, gt=0)
    """No starvation: each `aging_s` seconds a waiter has waited raises its class by one
    (batch to standard to interactive), so a lower class waits at most two of these behind
    higher ones before it competes with them by deadline."""
    admit_headroom: float = Field(0.8, gt=0, le=1)
    """A new task is admitted into a saturated model only when its predicted end (the
    admitted work ahead of it over the concurrency, plus its planned steps' service time)
    falls within this share of the time its deadline leaves."""
