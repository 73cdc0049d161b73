"""The control plane's internal HTTP server (`switchyard serve --workers N`): what the
worker processes ask of the one control plane.

- `/gates/{alias}/acquire|release|abandon`: slots at the deployment gates
  (policy/admission_remote.py); `/gates`: their counts, which each worker's
  /admin/live shows;
- `/engines/{alias}/v1/...`: the local engines, behind their residency pool
  (engines/front.py);
- `/mcp`: the MCP endpoint, its sessions and tool servers (api/mcp_relay.py);
- `/state/readiness`: the control plane's readiness report (its engines, tool servers
  and revisions) and its residency pool, which each worker's /readyz and
  /admin/engines show (control/follow.py).
- `/state/live/{worker}` (POST): a worker's own counts (its requests in flight, its
  unlimited gates); `/state/live` (GET): every worker's last counts and the tool
  servers' breakers, which each worker's /admin/live adds to its own
  (control/worker_live.py).

It listens on loopback only. The gates and the engines answer only the bearer token
the supervisor gave the workers (compared in constant time); /mcp answers the callers'
API keys, as on the public port. Bodies come from our own workers; they are still
bounded and checked, and errors are OpenAI-shaped bodies without exception text.
"""

from __future__ import annotations

import asyncio
import hmac
from collections.abc import Callable
from typing import Any

import orjson
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Mount, Route
from starlette.types import ASGIApp

from switchyard.api.mcp import PATH as MCP_PATH
from switchyard.control.worker_live import (
    MAX_REPORT,
    MAX_WORKERS,
    BadReport,
    WorkerReports,
    report_of,
)
from switchyard.errors import (
    AuthenticationError,
    InvalidRequest,
    MethodNotAllowed,
    RouteNotFound,
    SwitchyardError,
)
from switchyard.policy.admission_remote import Leases, ask_from

_MAX_BODY = 4096
_MAX_ID = 64


async def _json_within(request: Request, limit: int) -> Any:
    """The request's body parsed as JSON; refused once it passes `limit` bytes (by its
    declared length before any is read, else as it arrives), or when it is not JSON."""
    declared = request.headers.get("content-length", "")
    if declared.isascii() and declared.isdigit() and int(declared[:20]) > limit:
        raise InvalidRequest("body too large")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise InvalidRequest("body too large")
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError:
        raise InvalidRequest("the body is not JSON") from None


def _json(body: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(orjson.dumps(body), status, headers, media_type="application/json")


class GateRoutes:
    """The gate routes over the control plane's leases, and its readiness report."""

    def __init__(
        self,
        leases: Leases,
        token: str,
        readiness: Callable[[], tuple[bool, dict[str, Any]]] | None = None,
        engines: Callable[[], dict[str, Any]] | None = None,
        breakers: Callable[[], dict[str, str]] | None = None,
    ) -> None:
        self.leases = leases
        self._token = token.encode()
        self._readiness = readiness
        self._engines = engines
        self._breakers = breakers  # the tool servers' (they run here)
        self.reports = WorkerReports()

    def routes(self) -> list[BaseRoute]:
        return [
            Route("/gates/{alias}/acquire", self.acquire, methods=["POST"]),
            Route("/gates/{alias}/release", self.release, methods=["POST"]),
            Route("/gates/{alias}/abandon", self.abandon, methods=["POST"]),
            Route("/gates", self.gates, methods=["GET"]),
            Route("/state/readiness", self.readiness, methods=["GET"]),
            Route("/state/live", self.live, methods=["GET"]),
            Route("/state/live/{worker}", self.report, methods=["POST"]),
        ]

    def _check(self, request: Request) -> None:
        given = request.headers.get("authorization", "")[:256].removeprefix("Bearer ")
        if not hmac.compare_digest(given.encode(), self._token):
            raise AuthenticationError("the control plane answers the gateway's workers only")

    async def readiness(self, request: Request) -> Response:
        try:
            self._check(request)
        except SwitchyardError as exc:
            return _json(exc.body(), exc.status)
        ready, models = self._readiness() if self._readiness is not None else (True, {})
        engines = self._engines() if self._engines is not None else None
        return _json({"ready": ready, "models": models, "engines": engines})

    async def live(self, request: Request) -> Response:
        """Every worker's last counts (heard within STALE_S) and the tool servers'
        breakers: what a worker's /admin/live adds to its own."""
        try:
            self._check(request)
        except SwitchyardError as exc:
            return _json(exc.body(), exc.status)
        breakers = self._breakers() if self._breakers is not None else {}
        return _json({"workers": self.reports.fresh(), "breakers": breakers})

    async def report(self, request: Request) -> Response:
        """A worker's own counts, kept as its last until the next (or until stale)."""
        try:
            self._check(request)
            worker = str(request.path_params["worker"])
            if not (worker.isascii() and worker.isdigit() and int(worker) < MAX_WORKERS):
                raise InvalidRequest(f"worker: a number below {MAX_WORKERS}")
            data = await _json_within(request, MAX_REPORT)
            try:
                report = report_of(data)
            except BadReport as exc:
                raise InvalidRequest(str(exc)) from None
        except SwitchyardError as exc:
            return _json(exc.body(), exc.status)
        self.reports.put(int(worker), report)
        return _json({"kept": True})

    async def gates(self, request: Request) -> Response:
        try:
            self._check(request)
        except SwitchyardError as exc:
            return _json(exc.body(), exc.status)
        return _json(self.leases.view())

    async def _read(self, request: Request) -> tuple[Any, dict[str, Any]]:
        self._check(request)
        gate = self.leases.gate(str(request.path_params["alias"])[:256])
        if gate is None:
            raise RouteNotFound("no such gate")
        data = await _json_within(request, _MAX_BODY)
        worker, slot = (data.get("worker"), data.get("slot")) if isinstance(data, dict) else (0, 0)
        if not (isinstance(worker, str) and isinstance(slot, str)):
            raise InvalidRequest("worker and slot are required")
        if len(worker) > _MAX_ID or len(slot) > _MAX_ID:
            raise InvalidRequest("worker or slot too long")
        return gate, data

    async def acquire(self, request: Request) -> Response:
        try:
            gate, data = await self._read(request)
            remaining = data.get("remaining_s")
            if remaining is not None and not isinstance(remaining, int | float):
                raise InvalidRequest("remaining_s: a number or null")
            adm = await self.leases.acquire(
                data["worker"], data["slot"], gate, remaining, ask_from(data.get("ask"))
            )
        except asyncio.CancelledError:
            # Abandoned by its worker (or the worker died): nothing is held.
            return _json(
                {"error": {"message": "abandoned", "type": "server_error", "code": "abandoned"}},
                409,
            )
        except SwitchyardError as exc:
            body = exc.body()
            evidence = getattr(exc, "evidence", None)
            if isinstance(evidence, dict):
                body["evidence"] = evidence
            retry = exc.headers.get("Retry-After")
            if retry is not None:
                body["retry_after"] = retry
            return _json(body, exc.status)
        return _json(
            {
                "waited_s": adm.waited_s,
                "in_flight": adm.in_flight,
                "queued": adm.queued,
                "evidence": adm.evidence,
            }
        )

    async def release(self, request: Request) -> Response:
        try:
            _gate, data = await self._read(request)
        except SwitchyardError as exc:
            return _json(exc.body(), exc.status)
        held_s, tokens = data.get("held_s"), data.get("tokens")
        done = self.leases.release(
            data["worker"],
            data["slot"],
            float(held_s) if isinstance(held_s, int | float) else None,
            tokens if isinstance(tokens, int) else None,
            ask_from(data.get("ask")),
        )
        return _json({"released": done})

    async def abandon(self, request: Request) -> Response:
        try:
            _, data = await self._read(request)
        except SwitchyardError as exc:
            return _json(exc.body(), exc.status)
        self.leases.abandon(data["worker"], data["slot"])
        return _json({"abandoned": True})


async def _no_route(_request: Request, exc: Exception) -> Response:
    """A path or a method the server does not have, in its routes' error shape (not
    Starlette's plain text, which a worker would read as no answer)."""
    err: SwitchyardError = (
        MethodNotAllowed("no such method on this route")
        if isinstance(exc, HTTPException) and exc.status_code == 405
        else RouteNotFound("no such route")
    )
    return _json(err.body(), err.status)


def internal_app(
    gates: GateRoutes, engines: ASGIApp | None, mcp: ASGIApp | None = None
) -> Starlette:
    """The control plane's internal server: the gates, the engine front at /engines
    when there are local engines, and the MCP endpoint at /mcp (api/mcp_relay.py) when
    there are tool servers (it authenticates the callers' own keys)."""
    routes = gates.routes()
    if engines is not None:
        routes.append(Mount("/engines", app=engines))
    if mcp is not None:
        routes.append(Route(MCP_PATH, mcp))
    return Starlette(routes=routes, exception_handlers={HTTPException: _no_route})
