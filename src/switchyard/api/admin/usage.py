"""/admin/usage and /admin/cost: the usage ledger's rows and the build-vs-buy report
over them (observe/cost.py)."""

from __future__ import annotations

import time
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
from switchyard.config import Settings
from switchyard.errors import InvalidRequest
from switchyard.observe.cost import cost_report, parse_since
from switchyard.service import RequestService


class LedgerServices(Protocol):
    settings: Settings
    service: RequestService  # settled(): what was answered before is in the ledger
    ledger: Any  # UsageLedger or MemoryLedger (state/store.py: Ledger)


class Usage:
    """The ledger's rows and the cost report."""

    def __init__(self, services: LedgerServices, guard: Guard) -> None:
        self.s = services
        self.guard = guard

    async def usage(self, request: Request) -> Response:
        """Ledger rows, newest first: ?tenant=&key=&task=&model=&status=&since=&before=
        &limit= (since/before: unix seconds; the next page is ?before= the last row's
        received_at)."""
        self.guard(request)
        await self.s.service.settler.settled()
        q = request.query_params
        limit = query_limit(q)
        ledger = self.s.ledger
        data = await read_off_loop(
            "the usage rows",
            ledger,
            ledger.rows,
            tenant_id=query_text(q, "tenant"),
            key_id=query_text(q, "key"),
            task_id=query_text(q, "task"),
            limit=limit,
            model=query_text(q, "model"),
            status=query_text(q, "status"),
            since=query_number(q, "since"),
            before=query_number(q, "before"),
        )
        return as_json({"object": "list", "data": data})

    async def cost(self, request: Request) -> Response:
        """The build-vs-buy report (observe/cost.py): ?since=30d (or a date, or unix s)."""
        self.guard(request)
        await self.s.service.settler.settled()
        now = time.time()
        try:  # its own message: what the parameter must be, never Python's text
            since = parse_since(request.query_params.get("since", "30d"), now)
        except ValueError as exc:
            raise InvalidRequest(str(exc), param="since") from None
        ledger = self.s.ledger
        report = await read_off_loop(
            "the cost report", ledger, ledger.read, cost_report, self.s.settings.cost, since, now
        )
        return as_json(report)
