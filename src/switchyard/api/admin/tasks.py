"""/admin/tasks: agent tasks from the ledger, one task's report (critical path,
observe/tasks.py) and its cancel (the control plane's fan-out, control/cancels.py)."""

from __future__ import annotations

from typing import Any, Protocol

from starlette.requests import Request
from starlette.responses import Response

from switchyard.api.admin.guard import Guard
from switchyard.api.admin.params import (
    as_json,
    query_limit,
    query_number,
    query_text,
    read_off_loop,
)
from switchyard.errors import InvalidRequest, NotFound
from switchyard.observe.tasks import analyze_task
from switchyard.policy.headers import ID_PATTERN
from switchyard.service import RequestService
from switchyard.state.ledger_reads import task_rows
from switchyard.state.store import Store
from switchyard.state.traces import AmbiguousRequestId, get_task


class TaskServices(Protocol):
    store: Store
    ledger: Any  # UsageLedger or MemoryLedger (state/store.py: Ledger)
    service: RequestService  # settled(): what was answered before is recorded

    async def cancel_task(self, tenant: str, task_id: str) -> dict[str, Any]: ...


class Tasks:
    """The tasks' list, one task's report, its cancel."""

    def __init__(self, services: TaskServices, guard: Guard) -> None:
        self.s = services
        self.guard = guard

    async def task_list(self, request: Request) -> Response:
        """Tasks, most recently active first: ?tenant=&before=&limit=."""
        self.guard(request)
        await self.s.service.settler.settled()
        q = request.query_params
        ledger = self.s.ledger
        data = await read_off_loop(
            "the tasks",
            ledger,
            ledger.read,
            task_rows,
            query_text(q, "tenant"),
            query_limit(q),
            query_number(q, "before"),
        )
        return as_json({"object": "list", "data": data})

    async def task_trace(self, request: Request) -> Response:
        """GET: the task report (?tenant= names the tenant whose task it is: needed when
        several tenants used the id); DELETE ?tenant=: cancel the tenant's task."""
        self.guard(request)
        task_id = request.path_params["task_id"]
        if not ID_PATTERN.fullmatch(task_id):  # as /v1/tasks/{id} reads it
            raise InvalidRequest(
                "a task id is 1 to 128 characters of A-Z a-z 0-9 . _ : -", param="task_id"
            )
        tenant = query_text(request.query_params, "tenant")
        if request.method == "DELETE":
            if not tenant:
                raise InvalidRequest("cancelling a task needs ?tenant=", param="tenant")
            return as_json(await self.s.cancel_task(tenant, task_id))
        await self.s.service.settler.settled()  # what was answered before this call is visible
        try:  # task ids are the clients': one tenant's task of that id
            records = await read_off_loop("the task", self.s.store, self._task, task_id, tenant)
        except AmbiguousRequestId as exc:
            raise InvalidRequest(f"{exc} with ?tenant=", param="tenant") from None
        if not records:
            raise NotFound(f"no requests recorded for task '{task_id}'")
        return as_json({"task": analyze_task(records), "requests": records})

    def _task(self, task_id: str, tenant: str | None) -> list[dict[str, Any]]:
        with self.s.store.connection() as conn:
            return get_task(conn, task_id, tenant)
