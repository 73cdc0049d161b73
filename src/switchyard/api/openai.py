"""The OpenAI-compatible routes: chat, completions, models, embeddings."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Awaitable, Callable
from functools import partial
from typing import TYPE_CHECKING, Any, Protocol

import orjson
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from switchyard.api.body import header_map, parse_json, read_body
from switchyard.api.codecs import Codec, Embeddings, chat_completions, completions
from switchyard.api.sse import RelayResponse, frame, replay
from switchyard.api.sse import error_event as sse_error_event
from switchyard.decide.stages import refuses_legacy
from switchyard.errors import InvalidRequest, RouteNotFound, SwitchyardError
from switchyard.identity import Principal
from switchyard.policy.headers import ID_PATTERN
from switchyard.reply import JsonReply, Reply, StreamReply, relay, served_headers
from switchyard.service import ReadBody
from switchyard.settle import mark_failed

if TYPE_CHECKING:
    from switchyard.config import ModelConfig, Settings
    from switchyard.embed import EmbeddingService
    from switchyard.engines.upstream import UpstreamStream
    from switchyard.pipeline import RequestContext
    from switchyard.service import RequestService
    from switchyard.state.responses import ResponseStore

__all__ = [
    "CTX_KEY",
    "OpenAIRoutes",
    "build_routes",
    "served_headers",
    "to_response",
    "watched",
]

CTX_KEY = "switchyard.ctx"  # where a request's context sits in the ASGI scope


class SettleAfterResponse(Response):
    """A JSON reply whose request is settled once the bytes are sent (what Starlette's
    BackgroundTask does, without its per-call introspection). Takes its headers
    already encoded (`served_raw_headers`): Starlette would lower-case and encode each
    name and value again, and these are lower-case ASCII already."""

    media_type = "application/json"

    def __init__(
        self,
        body: bytes,
        raw_headers: list[tuple[bytes, bytes]],
        settle: Callable[[], Awaitable[None] | None],
    ) -> None:
        self.status_code = 200
        self.background = None
        self.body = body
        self.raw_headers = [
            (b"content-length", b"%d" % len(body)),
            (b"content-type", b"application/json"),
            *raw_headers,
        ]
        self._settle = settle

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
            await send({"type": "http.response.body", "body": self.body})
        finally:
            pending = self._settle()
            if pending is not None:
                await pending


def stream_response(
    reply: StreamReply,
    content: AsyncIterator[bytes],
    error_event: Callable[[SwitchyardError], bytes] = sse_error_event,
) -> Response:
    """A stream reply's HTTP response, `content` being its events in the protocol's
    framing (and `error_event` its error event): every protocol's streams alike."""
    return RelayResponse(
        content,
        media_type="text/event-stream",
        headers=reply.headers,
        on_close=reply.on_close,
        ctx=reply.ctx,
        error_event=error_event,
    )


def json_response(reply: JsonReply, body: bytes) -> Response:
    """A whole reply's HTTP response with `body` (the reply's own bytes, or the
    protocol's translation of them), settled once sent."""
    if reply.settle is not None:
        return SettleAfterResponse(body, reply.headers, reply.settle)
    response = Response(body, status_code=reply.status, media_type="application/json")
    response.raw_headers.extend(reply.headers)
    return response


def watched(ctx: RequestContext, source: UpstreamStream) -> UpstreamStream:
    """`source`, told which managed engine's worker it streams from (the deployment that
    answered), so a worker that dies mid-stream ends the stream as `engine_crashed`
    naming the model, in every protocol's stream, as a whole reply's crash is named."""
    dep = ctx.deployment
    engine = dep.engine if dep is not None else None
    if dep is not None and engine is not None:
        source.watch(engine, engine.generation, dep.alias)
    return source


def to_response(reply: Reply) -> Response:
    """The HTTP response of the service's reply."""
    if isinstance(reply, JsonReply):
        return json_response(reply, reply.body)
    ctx = reply.ctx
    source: UpstreamStream | None = reply.source
    if source is None:  # a cached completion, replayed
        return stream_response(reply, replay(reply.cached or {}, ctx.include_usage))
    data = watched(ctx, source).data()
    return stream_response(reply, frame(ctx, relay(ctx, data, reply.side, source.close)))


class ModelServices(Protocol):
    """What the model routes (and the Responses and Messages routes built over them)
    read off the gateway: the request service, the settings, and the few services the
    non-generation routes answer from. gateway.Gateway is one."""

    settings: Settings
    service: RequestService
    started_at: float
    embedder: EmbeddingService | None
    rollouts: Any  # rollouts.RolloutService, or None when no model is RL-managed
    responses: ResponseStore

    async def cancel_task(self, tenant: str, task_id: str) -> dict[str, Any]: ...

    async def describe_task(self, tenant: str, task_id: str) -> dict[str, Any]: ...


def _revisions(m: ModelConfig, principal: Principal, manager: Any) -> list[str]:
    """The revisions of `m` a request of `principal` can be served by, so each may be
    pinned (`alias@revision`): an RL-managed model's active one; else its deployments'
    inside the caller's regions, the one most traffic goes to first (the highest
    configured weight that is not a canary's); without deployments, its own."""
    if manager is not None:
        active = manager.active
        return [active.revision if active is not None else m.revision]
    if not m.deployments:
        return [m.revision]
    allowed = principal.boundary(m.data_boundary)
    deps = [d for d in m.deployments if allowed is None or (d.region or m.region) in allowed]
    ranked = sorted(deps or m.deployments, key=lambda d: (d.canary, -d.weight))
    return list(dict.fromkeys(d.revision or m.revision for d in ranked))


class OpenAIRoutes:
    """The OpenAI-compatible routes, as plain Starlette endpoints (the hot path skips
    FastAPI's dependency solving). Each maps HTTP to the request driver (service.py)
    and its reply back."""

    def __init__(self, gw: ModelServices) -> None:
        self.gw = gw
        self.service = gw.service
        server = gw.settings.server
        self._max_body = server.max_body_bytes
        self._body_timeout_s = server.body_timeout_s
        self._max_depth = server.max_json_depth
        s = gw.settings
        unknown = s.validation.unknown_fields
        self._codecs: dict[str, Codec] = {
            "chat.completions": chat_completions(unknown, refuses_legacy(s, "chat.completions")),
            "completions": completions(unknown, refuses_legacy(s, "completions")),
            "embeddings": Embeddings(gw.settings.embeddings.max_inputs, unknown),
        }

    def routes(self) -> list[Route]:
        return [
            Route("/v1/rollouts", self.rollouts, methods=["POST"]),
            Route("/v1/tasks/{task_id}", self.task, methods=["GET", "DELETE"]),
            Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/v1/embeddings", self.embeddings, methods=["POST"]),
        ]

    def reader(self, request: Request, headers: dict[str, str], codec: Codec | None) -> ReadBody:
        """The request's body reader: bounded in size, depth and time, and decoded by
        its protocol's codec into the typed request, with the bytes it came from when
        they are exactly that request (else None); without a codec, the parsed JSON.
        Every protocol's routes read bodies with this one."""

        async def read(remaining_s: float) -> tuple[Any, bytes | None]:
            raw = await read_body(
                request,
                self._max_body,
                headers.get("content-length"),
                min(self._body_timeout_s, remaining_s),
                headers.get("content-encoding"),
            )
            parsed = parse_json(raw, self._max_depth)
            if codec is None:
                return parsed, raw
            req, exact = codec.decode(parsed)
            return req, raw if exact else None

        return read

    async def _principal(self, headers: Any) -> Principal:
        principal = self.service.auth.authenticate(headers)  # before any costly work
        if not isinstance(principal, Principal):
            principal = await principal
        return principal

    async def _opened(self, request: Request, endpoint: str) -> tuple[RequestContext, ReadBody]:
        """The request's context, opened once its key is known, and its body's reader."""
        received = time.perf_counter()
        headers = header_map(request.scope)
        principal = self.service.auth.authenticate(headers)  # before any costly work
        if not isinstance(principal, Principal):
            principal = await principal
        read = self.reader(request, headers, self._codecs[endpoint])
        service: RequestService = self.service
        ctx = service.open(endpoint, headers, received, principal)
        request.scope[CTX_KEY] = ctx  # for the error mapping (app.py)
        ctx.receive = request.receive  # a wait in the queue ends if the client hangs up
        return ctx, read

    async def _generate(self, request: Request, endpoint: str) -> Response:
        ctx, read = await self._opened(request, endpoint)
        service: RequestService = self.service
        return to_response(await service.generate(ctx, read))

    async def chat_completions(self, request: Request) -> Response:
        return await self._generate(request, "chat.completions")

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, "completions")

    async def embeddings(self, request: Request) -> Response:
        ctx, read = await self._opened(request, "embeddings")
        service: RequestService = self.service
        return to_response(await service.embeddings(ctx, read))

    async def models(self, request: Request) -> Response:
        """The models, adapters and embedding model this key may use."""
        gw = self.gw
        principal = await self._principal(header_map(request.scope))  # 2 credentials: 401
        created = int(gw.started_at)
        # Only models a request of the key's may reach: within the model's data boundary
        # and the tenant's regions (the executor's rule); an adapter, on its base's.
        reached = {
            m.alias for m in gw.settings.models if principal.reaches(m.data_boundary, m.regions())
        }
        rl = self.service.rl_aliases  # RL-managed models: their active revision
        data: list[dict[str, Any]] = []
        for m in gw.settings.models:
            if m.alias in reached and principal.may_use(m.alias):
                revisions = _revisions(m, principal, rl.get(m.alias))
                data.append(
                    {
                        "id": m.alias,
                        "object": "model",
                        "created": created,
                        "owned_by": "switchyard",
                        "revision": revisions[0],
                        # what this key may pin: nothing without `may_pin_revisions`
                        "revisions": revisions if principal.may_pin_revisions else [],
                    }
                )
        for a in gw.settings.adapters:  # only the adapters this key and tenant may use
            if (
                a.base in reached
                and principal.may_use(a.name)
                and principal.adapter_refusal(a.name, a.allowed_tenants) is None
            ):
                data.append(
                    {
                        "id": a.name,
                        "object": "model",
                        "created": created,
                        "owned_by": "switchyard",
                        "revision": a.revision,
                        "parent": a.base,
                        "root": a.base,
                    }
                )
        if gw.embedder is not None and principal.may_use(gw.settings.embeddings.alias):
            data.append(
                {
                    "id": gw.settings.embeddings.alias,
                    "object": "model",
                    "created": created,
                    "owned_by": "switchyard",
                }
            )
        return Response(
            orjson.dumps({"object": "list", "data": data}), media_type="application/json"
        )

    async def task(self, request: Request) -> Response:
        """GET: the task's live state; DELETE: cancel it. A key sees and cancels only
        its own tenant's tasks (task ids are the client's, so state is per tenant)."""
        principal = await self._principal(header_map(request.scope))
        task_id = request.path_params["task_id"]
        if not ID_PATTERN.fullmatch(task_id):
            raise InvalidRequest(
                "a task id is 1 to 128 characters of A-Z a-z 0-9 . _ : -", param="task_id"
            )
        if request.method == "DELETE":
            out = await self.gw.cancel_task(principal.tenant_id, task_id)
        else:
            out = await self.gw.describe_task(principal.tenant_id, task_id)
        return Response(orjson.dumps(out), media_type="application/json")

    async def rollouts(self, request: Request) -> Response:
        """RL rollouts (rollouts.py): NDJSON records as samples finish."""
        received = time.perf_counter()
        headers = header_map(request.scope)
        principal = await self._principal(headers)
        gw, service = self.gw, self.service
        ctx = service.open("rollouts", headers, received, principal)
        request.scope[CTX_KEY] = ctx
        try:
            if gw.rollouts is None:
                raise RouteNotFound("rollouts are off: no model is listed under rl.models")
            service.begin(ctx)
            body, _ = await self.reader(request, headers, None)(ctx.remaining_s())
            plan = await gw.rollouts.admit(ctx, body)
        except BaseException as exc:
            mark_failed(ctx, exc)
            await service.settle(ctx)
            raise
        out = served_headers(ctx)
        out["x-switchyard-model"] = plan.alias
        out["x-switchyard-revision"] = plan.lease.rev.revision if plan.lease else ""
        # Stops when the client leaves, and releases the lease and settles even when
        # the stream never started (the generator's own `finally` then never runs).
        return RelayResponse(
            gw.rollouts.stream(ctx, plan),
            media_type="application/x-ndjson",
            headers=out,
            on_close=partial(gw.rollouts.abandon, ctx, plan),
        )


def build_routes(gw: ModelServices) -> list[Route]:
    """The OpenAI-compatible routes of `gw` (OpenAIRoutes)."""
    return OpenAIRoutes(gw).routes()
