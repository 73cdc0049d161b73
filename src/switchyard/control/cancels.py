"""Agent task cancels: the task store marks the task cancelled (and, with Redis, tells
every other gateway process, which stops its own calls: lifecycle.py listens), the
task's calls in flight here are stopped, and the model gates here forget its plan."""

from __future__ import annotations

import logging
import time
from typing import Any

from switchyard.control.components import Components
from switchyard.errors import NotFound

log = logging.getLogger("switchyard")


class Cancels(Components):
    async def cancel_task(self, tenant: str, task_id: str) -> dict[str, Any]:
        """Cancel a tenant's task: its later calls get 409 task_cancelled, its calls in
        flight here are stopped (their upstream connections closed). What was running,
        what was stopped and which side-effecting tool calls were emitted without a
        result yet."""
        key = (tenant, task_id)
        running = self.running.running(key)
        state = await self.tasks.cancel(key, time.time())
        if state is None and not running:
            raise NotFound(f"no task '{task_id}' is known for this tenant")
        stopped = self.stop_task(key)
        log.info("task %s of %s cancelled; stopped %d call(s)", task_id, tenant, len(stopped))
        calls = state["tool_calls"] if state is not None else []
        return {
            "object": "task.cancelled",
            "task_id": task_id,
            "tenant": tenant,
            "cancelled": True,
            "cancelled_at": state["cancelled_at"] if state is not None else time.time(),
            "running": running,
            "stopped": stopped,
            "unconfirmed_side_effects": [
                c for c in calls if c["class"] == "side_effect" and c["results"] == 0
            ],
            "budget": state["budget"] if state is not None else {},
            "used": state["used"] if state is not None else {},
        }

    async def describe_task(self, tenant: str, task_id: str) -> dict[str, Any]:
        """The live state of a tenant's task (budget, use, deadline, tool calls)."""
        state = await self.tasks.describe((tenant, task_id))
        running = self.running.running((tenant, task_id))
        if state is None and not running:
            raise NotFound(f"no task '{task_id}' is known for this tenant")
        return {
            "object": "task",
            **(state or {"tenant": tenant, "task_id": task_id}),
            "running": running,
        }
