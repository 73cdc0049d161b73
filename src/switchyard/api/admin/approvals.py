"""/admin/approvals and /admin/tool-calls: tool-call governance an operator acts on
(policy/tool_calls.py, mcp_service/): approvals for one call's result, and the MCP
tool calls in doubt."""

from __future__ import annotations

import logging
from typing import Protocol

from starlette.requests import Request
from starlette.responses import Response

from switchyard.api.admin.guard import Guard
from switchyard.api.admin.params import as_json, off_loop, query_text, read_fields
from switchyard.config import Settings
from switchyard.errors import InvalidRequest, NotFound
from switchyard.state.store import Store

log = logging.getLogger("switchyard")


class ApprovalServices(Protocol):
    settings: Settings
    store: Store  # its approvals and tool-call records


class Approvals:
    """Approvals issued, tool calls in doubt resolved."""

    def __init__(self, services: ApprovalServices, guard: Guard) -> None:
        self.s = services
        self.guard = guard

    async def approvals(self, request: Request) -> Response:
        """{"tenant", "task_id", "call_id", "approver", "ttl_s"}: a single-use approval
        for one tool call's result (policy/tool_calls.py); the token is shown once."""
        self.guard(request)
        body = await read_fields(request, ("tenant", "task_id", "call_id", "approver", "ttl_s"))
        out = await off_loop(
            "the approval",
            self.s.store.approvals.issue,
            body.get("tenant"),
            body.get("task_id"),
            body.get("call_id"),
            body.get("approver"),
            body.get("ttl_s", self.s.settings.tools.approval_ttl_s),
        )
        log.info(
            "approval issued by %s for call %s of task %s (tenant %s)",
            out["approver"],
            out["call_id"],
            out["task_id"],
            out["tenant"],
        )
        return as_json(out, 201)

    async def tool_calls(self, request: Request) -> Response:
        """GET ?tenant=: the MCP tool calls in doubt (mcp_service/), for an operator
        to resolve; POST {"tenant", "call_id", "ran"}: resolve one (ran: repeats are
        refused as done; not ran: the record is dropped and a repeat runs it)."""
        self.guard(request)
        records = self.s.store.tool_calls
        if request.method == "GET":
            return as_json(
                {
                    "object": "list",
                    "data": await off_loop(
                        "the tool calls",
                        records.in_doubt,
                        query_text(request.query_params, "tenant"),
                    ),
                }
            )
        body = await read_fields(request, ("tenant", "call_id", "ran"))
        tenant, call_id, ran = body.get("tenant"), body.get("call_id"), body.get("ran")
        if (
            not isinstance(tenant, str)
            or not isinstance(call_id, str)
            or not isinstance(ran, bool)
            or not 0 < len(tenant) <= 64  # refused, never cut: a cut id names another call
            or not 0 < len(call_id) <= 128
        ):
            raise InvalidRequest(
                "'tenant' (1 to 64 characters), 'call_id' (1 to 128) and 'ran' (boolean) "
                "are required"
            )
        if not await off_loop("the tool call", records.resolve, tenant, call_id, ran):
            raise NotFound(f"no tool call '{call_id}' in doubt for this tenant")
        log.warning("tool call %s of tenant %s resolved: ran=%s", call_id, tenant, ran)
        return as_json(
            {"object": "tool_call.resolved", "tenant": tenant, "call_id": call_id, "ran": ran}
        )
