"""/admin/requests: requests' decision traces (state/traces.py)."""

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
from switchyard.service import RequestService
from switchyard.state.store import Store
from switchyard.state.traces import AmbiguousRequestId, get_request, list_requests


class TraceServices(Protocol):
    store: Store
    service: RequestService  # settled(): what was answered before is recorded


class Traces:
    """One request's trace, and the list of them."""

    def __init__(self, services: TraceServices, guard: Guard) -> None:
        self.s = services
        self.guard = guard

    async def request_trace(self, request: Request) -> Response:
        """One request's decision trace (?tenant= when the id is ambiguous)."""
        self.guard(request)
        rid = request.path_params["request_id"]
        tenant = request.query_params.get("tenant")
        await self.s.service.settler.settled()  # what was answered before this call is visible
        try:
            rec = await read_off_loop("the trace", self.s.store, self._request, rid, tenant)
        except AmbiguousRequestId as exc:
            raise InvalidRequest(f"{exc} with ?tenant=", param="tenant") from None
        if rec is None:  # named within a bound: a hostile id is never echoed whole
            raise NotFound(f"no trace for request '{rid[:128]}'")
        return as_json(rec)

    async def request_list(self, request: Request) -> Response:
        """?tenant=&since=(unix s)&status=&limit="""
        self.guard(request)
        q = request.query_params
        since, limit = query_number(q, "since"), query_limit(q)  # finite; 1 to 10,000
        tenant, status = query_text(q, "tenant"), query_text(q, "status")
        await self.s.service.settler.settled()
        data = await read_off_loop(
            "the traces", self.s.store, self._requests, tenant, since, status, limit
        )
        return as_json({"object": "list", "data": data})

    def _request(self, rid: str, tenant: str | None) -> dict[str, Any] | None:
        with self.s.store.connection() as conn:
            return get_request(conn, rid, tenant)

    def _requests(
        self, tenant: str | None, since: float | None, status: str | None, limit: int
    ) -> list[dict[str, Any]]:
        with self.s.store.connection() as conn:
            return list_requests(conn, tenant, since, status, limit)
