"""The app factory: builds the gateway, its routes and the one error mapping."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import orjson
from fastapi import FastAPI, Request
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import RedirectResponse
from starlette.routing import Match, Route
from starlette.types import Receive, Scope, Send

from switchyard.api.admin import build_admin_routes, is_admin, require_admin
from switchyard.api.anthropic import PREFIX as MESSAGES_PREFIX
from switchyard.api.anthropic import AnthropicRoutes
from switchyard.api.console import Sessions, build_console_routes
from switchyard.api.mcp import PATH as MCP_PATH
from switchyard.api.mcp import McpEndpoint
from switchyard.api.mcp_relay import McpRelay
from switchyard.api.openai import CTX_KEY, OpenAIRoutes
from switchyard.api.openapi import describe
from switchyard.api.responses import ResponsesRoutes
from switchyard.config import SINGLE, ProcessRole, Settings
from switchyard.errors import (
    InternalError,
    MethodNotAllowed,
    RouteNotFound,
    SwitchyardError,
)
from switchyard.gateway import Gateway
from switchyard.pipeline import new_request_id
from switchyard.reply import served_headers

log = logging.getLogger("switchyard.api")


def error_response(request: Request, exc: SwitchyardError) -> Response:
    """The error in its protocol's shape: Anthropic's on the Messages routes, else
    OpenAI's (the admin API's too)."""
    ctx = request.scope.get(CTX_KEY)
    headers = served_headers(ctx) if ctx is not None else {"x-request-id": new_request_id()}
    headers.update(exc.headers)
    anthropic = request.scope["path"].startswith(MESSAGES_PREFIX)
    return Response(
        orjson.dumps(exc.anthropic_body() if anthropic else exc.body()),
        status_code=exc.status,
        media_type="application/json",
        headers=headers,
    )


Endpoint = Callable[[Request], Awaitable[Response]]

# What /readyz shows the admin only: where models run (upstream URLs, loopback ports),
# their processes, and error text (file paths, exception messages, stderr lines).
# Everyone else sees the states: kind, state, ready, restarts, breaker, revision, ...
ADMIN_ONLY_READINESS = frozenset(
    {
        "upstream",
        "pid",
        "stderr_tail",
        "system_info",
        "last_error",
        "reason",
        "error",
        "model_file",
        "unknown_prices",  # configuration detail: tool names priced but not listed
    }
)


def public_readiness(value: Any) -> Any:
    """`value` (the readiness report, or a part of it) without ADMIN_ONLY_READINESS
    fields at any depth: deployments and adapters nest the same descriptions."""
    if isinstance(value, dict):
        return {k: public_readiness(v) for k, v in value.items() if k not in ADMIN_ONLY_READINESS}
    if isinstance(value, list):
        return [public_readiness(v) for v in value]
    return value


class GatewayApp(FastAPI):
    """FastAPI, with the OpenAI POST routes served straight from the ASGI call.

    Every other request goes through FastAPI's stack: error middleware, telemetry,
    body limit, exception handlers, an exit stack, route matching: about ten awaited
    layers. The model routes need none of it (they take no dependencies, check their
    own body limit and map their own errors, once, as below), and at one request at a
    time those layers were a measurable part of what the gateway adds."""

    fast: dict[str, Endpoint]
    mcp: Any = None  # the MCP endpoint (api/mcp.py), served straight too

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and self.mcp is not None and scope["path"] == MCP_PATH:
            await self.mcp(scope, receive, send)
            return
        if scope["type"] == "http" and scope["method"] == "POST":
            endpoint = self.fast.get(scope["path"])
            if endpoint is not None:
                scope["app"] = self
                request = Request(scope, receive, send)
                try:
                    response = await endpoint(request)
                except SwitchyardError as exc:
                    response = error_response(request, exc)
                except Exception:
                    log.exception("unhandled error on POST %s", scope["path"])
                    response = error_response(
                        request, InternalError("internal error; see the gateway log")
                    )
                await response(scope, receive, send)
                return
        await super().__call__(scope, receive, send)


def _shown_path(path: str) -> str:
    """A request's path as an error repeats it: at most 128 characters, and none that
    is not printable (a `%0A` in the path is decoded: never a forged line)."""
    shown = "".join(c if c.isprintable() else "?" for c in path[:128])
    return shown + "..." if len(path) > 128 else shown


def _slash_flipped(app: FastAPI, scope: Scope) -> str | None:
    """The path, as sent, with its trailing slash added or taken away, when a route
    answers that one (what Starlette's `redirect_slashes` did): a relative `Location`,
    never built from the Host header, never one starting `//` (another host), and none
    for a path whose last character was sent encoded."""
    raw: bytes = scope.get("raw_path") or scope["path"].encode()
    raw = raw.split(b"?", 1)[0]
    if raw == b"/" or len(raw) > 2048:
        return None
    path = scope["path"]
    if raw.endswith(b"/") != path.endswith("/"):
        # The last character sent as `%2F`: the route was asked of the decoded path,
        # whose slash the raw one does not end with, so flipping the raw one's would
        # send the client to a path no route answers (`/v1/models%2F` to
        # `/v1/models%2F/`, read `/v1/models//`).
        return None
    flipped = raw[:-1] if raw.endswith(b"/") else raw + b"/"
    other = path[:-1] if path.endswith("/") else path + "/"
    if flipped.startswith(b"//") or not flipped.startswith(b"/"):
        return None
    moved = {**scope, "path": other}
    if not any(r.matches(moved)[0] is not Match.NONE for r in app.router.routes):
        return None
    query = scope.get("query_string") or b""
    return (flipped + (b"?" + query if query else b"")).decode("latin-1")


def create_app(
    settings: Settings,
    on_ready: Callable[[Gateway], None] | None = None,
    role: ProcessRole = SINGLE,
) -> GatewayApp:
    gw = Gateway(settings, role)

    async def announce_ready() -> None:
        # Once every model is ready or has failed for good: a failed model must not
        # keep the first-run key (and how to call what does work) from the user.
        while not (gw.readiness()[0] or gw.startup_settled()):
            await asyncio.sleep(0.2)
        if on_ready is not None:
            on_ready(gw)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        gw.start()
        # Startup objects never die; keeping them out of the collector's scans makes
        # every per-request collection cheaper.
        gc.collect()
        gc.freeze()
        # A request allocates a few hundred short-lived containers; at the default
        # threshold (700) the young generation is collected every couple of requests.
        # Ten times that keeps the same garbage bounded with far fewer collections.
        gen0, gen1, gen2 = gc.get_threshold()
        gc.set_threshold(max(gen0, 7000), gen1, gen2)
        watcher = asyncio.create_task(announce_ready())
        try:
            mcp = getattr(app, "mcp", None)
            if isinstance(mcp, McpEndpoint):  # its SDK session manager runs with the app
                async with mcp.running():
                    yield
            else:
                yield
                if isinstance(mcp, McpRelay):
                    await mcp.close()
        finally:
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watcher
            await gw.stop()

    app = GatewayApp(
        title="Switchyard", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None
    )
    app.state.gateway = gw
    # Starlette's own trailing-slash redirect writes an absolute `Location` from the
    # request's Host header (a forged Host, a redirect to it): `_slash_flipped` answers
    # the same requests with the path alone.
    app.router.redirect_slashes = False
    # The model routes: OpenAI's (chat, completions, embeddings, Responses) and
    # Anthropic's Messages, sharing one body reader.
    openai_routes = OpenAIRoutes(gw)
    routes = (
        openai_routes.routes()
        + ResponsesRoutes(openai_routes).routes()
        + AnthropicRoutes(openai_routes).routes()
    )
    app.router.routes.extend(routes)  # still routed there: other methods get 405
    app.fast = {
        r.path: r.endpoint for r in routes if isinstance(r, Route) and r.methods == {"POST"}
    }
    if role.worker and settings.mcp.servers:
        # Of several workers, MCP sessions and tool servers are the control plane's.
        app.mcp = McpRelay(
            role.control_url + MCP_PATH,
            settings.server.max_body_bytes,
            gw.auth,
            settings.auth.mode == "disabled",
        )
    elif gw.mcp is not None:
        app.mcp = McpEndpoint(
            gw.mcp, gw.auth, settings.server.max_body_bytes, settings.auth.mode == "disabled"
        )
    sessions = Sessions(settings.auth.admin_key_env)
    admin = build_admin_routes(gw, sessions)
    app.router.routes.extend(admin)
    app.router.routes.extend(build_console_routes(sessions))

    @app.get("/openapi.json", include_in_schema=False)
    async def openapi() -> Response:
        """The API's description, the model routes included (api/openapi.py)."""
        if app.openapi_schema is None:
            embedding = [settings.embeddings.alias] if gw.embedder is not None else []
            app.openapi_schema = describe(
                app.openapi(), [m.alias for m in settings.models], embedding, admin
            )
        return Response(orjson.dumps(app.openapi_schema), media_type="application/json")

    @app.get("/healthz")
    async def healthz() -> Response:
        """Liveness: the gateway process answers. Says nothing about models."""
        return Response(b'{"status":"ok"}', media_type="application/json")

    admin_env = settings.auth.admin_key_env

    @app.get("/readyz")
    async def readyz(request: Request) -> Response:
        """Readiness: every model needed at start can serve. Its states are for anyone
        (load balancers, probes); where things run and why they failed, for the admin."""
        ready, models = gw.readiness()
        if not is_admin(request, admin_env, sessions):
            models = public_readiness(models)
        body = {"status": "ready" if ready else "not_ready", "models": models}
        headers = {} if ready else {"Retry-After": "2"}
        return Response(
            orjson.dumps(body),
            status_code=200 if ready else 503,
            media_type="application/json",
            headers=headers,
        )

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        """Prometheus text. It names every tenant (or its hash) and what it spent, so
        only the admin key reads it, unless observe.metrics_public (Prometheus sends
        the key with `authorization: {credentials: ...}` in its scrape config)."""
        if not settings.observe.metrics_public:
            require_admin(request, admin_env, sessions)
        if gw.metrics is None:
            raise RouteNotFound("metrics are disabled (observe.metrics: false)")
        now = time.monotonic()
        gw.metrics.set_breakers(
            {a: b.describe(now)["state"] for a, b in gw.executor.breakers.items()}
        )
        gw.metrics.set_ledger(gw.ledger.dropped, gw.ledger.repaired, gw.ledger.queued_bytes)
        return Response(
            gw.metrics.exposition(), media_type="text/plain; version=0.0.4; charset=utf-8"
        )

    @app.exception_handler(SwitchyardError)
    async def _switchyard_error(request: Request, exc: SwitchyardError) -> Response:
        return error_response(request, exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> Response:
        if exc.status_code == 405:
            err: SwitchyardError = MethodNotAllowed(f"method {request.method} is not allowed here")
        elif exc.status_code == 404:
            moved = _slash_flipped(app, request.scope)
            if moved is not None:
                return RedirectResponse(moved, status_code=307)
            err = RouteNotFound(f"no route {request.method} {_shown_path(request.url.path)}")
        else:
            err = SwitchyardError(str(exc.detail))
            err.status = exc.status_code
        return error_response(request, err)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> Response:
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return error_response(request, InternalError("internal error; see the gateway log"))

    return app
