"""The OpenAI-compatible routes: chat, completions, models, embeddings."""

from __future__ import annotations

import base64
import time
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from switchyard.api.body import header_map, parse_json, read_body, read_json
from switchyard.api.sse import RelayResponse, assemble, relay, replay
from switchyard.decide.cache import Entry
from switchyard.decide.cacheability import storable_reply
from switchyard.engines.registry import Deployment
from switchyard.errors import InvalidRequest, ModelNotFound, SwitchyardError
from switchyard.execute.idempotency import StoredReply, body_hash
from switchyard.gateway import Gateway
from switchyard.pipeline import RequestContext
from switchyard.policy import headers as request_headers
from switchyard.policy.auth import authorize_model
from switchyard.policy.pii import mask_body
from switchyard.policy.validate import (
    image_parts,
    validate_chat,
    validate_completion,
    validate_embeddings,
)

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


def _deployment_headers(dep: Deployment) -> list[tuple[bytes, bytes]]:
    """`x-switchyard-model`, `-revision` and `-upstream` of a deployment, encoded once
    per label (a managed engine's label changes when its worker restarts)."""
    label = dep.label
    cached = dep.encoded_headers
    if cached is None or cached[0] != label:
        cached = dep.encoded_headers = (
            label,
            [
                (b"x-switchyard-model", dep.alias.encode("latin-1")),
                (b"x-switchyard-revision", dep.model.revision.encode("latin-1")),
                (b"x-switchyard-upstream", label.encode("latin-1")),
            ],
        )
    return cached[1]


def served_raw_headers(ctx: RequestContext) -> list[tuple[bytes, bytes]]:
    """What served the request, as response headers (lower-case names, encoded)."""
    h = [(b"x-request-id", ctx.request_id.encode("latin-1"))]
    if ctx.client_request_id is not None:  # validated: ASCII
        h.append((b"x-client-request-id", ctx.client_request_id.encode("latin-1")))
    if ctx.cache is not None:
        h.append((b"x-switchyard-cache", ctx.cache.encode("latin-1")))
        if ctx.cache_similarity is not None and ctx.cache != "hit-exact":
            h.append((b"x-switchyard-cache-similarity", b"%.4f" % ctx.cache_similarity))
    if ctx.rate_headers:
        h.extend((k.encode("latin-1"), v.encode("latin-1")) for k, v in ctx.rate_headers.items())
    if ctx.route is not None:
        h.append((b"x-switchyard-route", ctx.route.encode("latin-1")))
        if ctx.route_score is not None:
            h.append((b"x-switchyard-route-score", b"%.4f" % ctx.route_score))
    dep = ctx.deployment
    if dep is not None:
        h.extend(_deployment_headers(dep))
        h.append((b"x-switchyard-attempts", b"%d" % ctx.attempts))
        if ctx.fallback_from is not None:
            h.append(
                (b"x-switchyard-fallback", f"{ctx.fallback_from} -> {dep.alias}".encode("latin-1"))
            )
    t = ctx.timings
    if t.upstream_sent is not None and t.upstream_first_byte is not None:
        now = time.perf_counter()
        gw = (t.upstream_sent - t.received) * 1000
        up = (t.upstream_first_byte - t.upstream_sent) * 1000
        total = (now - t.received) * 1000
        timing = b"gateway;dur=%.2f, upstream;dur=%.2f, total;dur=%.2f" % (gw, up, total)
        if ctx.queue_ms:
            timing = b"queue;dur=%.2f, " % ctx.queue_ms + timing
        h.append((b"server-timing", timing))
    return h


def served_headers(ctx: RequestContext) -> dict[str, str]:
    """`served_raw_headers` as a dict, for responses built from one."""
    return {k.decode("latin-1"): v.decode("latin-1") for k, v in served_raw_headers(ctx)}


def map_texts(obj: dict[str, Any], fn: Callable[[str], str]) -> dict[str, Any]:
    """A copy of a completion with `fn` applied to every generated text."""
    out = dict(obj)
    choices = []
    for c in obj.get("choices") or []:
        c = dict(c)
        message = c.get("message")
        if isinstance(message, dict):
            message = dict(message)
            if isinstance(message.get("content"), str):
                message["content"] = fn(message["content"])
            if isinstance(message.get("tool_calls"), list):
                message["tool_calls"] = [_map_call(call, fn) for call in message["tool_calls"]]
            c["message"] = message
        if isinstance(c.get("text"), str):
            c["text"] = fn(c["text"])
        choices.append(c)
    out["choices"] = choices
    return out


def _map_call(call: Any, fn: Callable[[str], str]) -> Any:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("arguments"), str):
        return call
    return {**call, "function": {**function, "arguments": fn(function["arguments"])}}


def reply_object(body: bytes) -> dict[str, Any] | None:
    """The upstream's JSON reply as an object, or None if it is not one."""
    try:
        obj = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    return obj if isinstance(obj, dict) else None


def reply_text(obj: dict[str, Any]) -> str:
    c = (obj.get("choices") or [{}])[0]
    return str((c.get("message") or {}).get("content") or c.get("text") or "")


def build_routes(gw: Gateway) -> list[Route]:
    """Plain Starlette routes: the hot path skips FastAPI's dependency solving."""
    max_body = gw.settings.server.max_body_bytes
    body_timeout_s = gw.settings.server.body_timeout_s
    max_depth = gw.settings.server.max_json_depth
    unknown_fields = gw.settings.validation.unknown_fields

    async def generate(request: Request, endpoint: str) -> Response:
        received = time.perf_counter()
        headers = header_map(request)
        principal = gw.authenticate(headers)  # before any costly work
        ctx = gw.new_context(endpoint, headers, received, principal)
        request.scope[CTX_KEY] = ctx  # for the error mapping (app.py)
        handed_off = False
        try:
            if ctx.header_error is not None:
                raise ctx.header_error
            if "x-request-timeout" in headers:
                gw.apply_request_timeout(ctx)
            raw = await read_body(
                request,
                max_body,
                headers.get("content-length"),
                min(body_timeout_s, ctx.remaining_s()),
            )
            body = parse_json(raw, max_depth)
            if endpoint == "chat.completions":
                alias = validate_chat(body, unknown_fields)
            else:
                alias = validate_completion(body, unknown_fields)
            ctx.body = body
            ctx.wire = (body, raw)
            ctx.alias = alias
            ctx.stream = bool(body.get("stream"))
            options = body.get("stream_options")  # an object when present (validated)
            ctx.include_usage = bool(options.get("include_usage")) if options else False
            ctx.decisions.append(
                ("validate", "ok", "request shape is valid", None, received, time.perf_counter())
            )
            idem = headers.get("idempotency-key")
            if idem is not None:
                replay = await claim_idempotency(ctx, idem)
                if replay is not None:
                    return replay
            pending = gw.decide(ctx)
            if pending is not None:
                await pending
            if ctx.response is not None:  # a cache hit
                response = cached_response(ctx, ctx.response)
                if isinstance(response, RelayResponse):
                    handed_off = True
                elif ctx.idempotency_key is not None:  # a repeat replays this answer
                    gw.idempotency.complete(
                        ctx.principal.tenant_id,
                        ctx.idempotency_key,
                        StoredReply(
                            200,
                            {
                                k: v
                                for k, v in response.headers.items()
                                if k.startswith("x-switchyard")
                            },
                            stored_reply_body(ctx, bytes(response.body)),
                        ),
                    )
                    ctx.idempotency_key = None
                return response
            assert ctx.model is not None
            if not ctx.model.capabilities.supports_vision and endpoint == "chat.completions":
                part = image_parts(ctx.body)
                if part is not None:
                    raise InvalidRequest(
                        f"the model '{ctx.model.alias}' does not accept images "
                        "(capabilities.supports_vision is false)",
                        param=part,
                    )
            if ctx.stream:
                if not ctx.model.capabilities.supports_streaming:
                    raise InvalidRequest(
                        f"the model '{alias}' does not support streaming", param="stream"
                    )
                stream = await gw.executor.execute_stream(ctx)
                if ctx.cache_keys is not None or ctx.shadow_entry is not None:
                    ctx.collected = []

                async def close() -> None:
                    stream.close(complete=ctx.status == "ok")
                    if ctx.status == "ok" and ctx.collected is not None:
                        obj = assemble(ctx.collected)
                        if obj is not None:
                            await remember(ctx, obj)
                    await gw.finish(ctx)

                response = RelayResponse(
                    relay(ctx, stream),
                    media_type="text/event-stream",
                    headers=served_headers(ctx),
                    on_close=close,
                )
                handed_off = True
                return response
            reply = await gw.executor.execute(ctx)
            ctx.status = "ok"
            ctx.timings.ended = time.perf_counter()
            body = reply.body
            if (
                ctx.cache_keys is not None
                or ctx.shadow_entry is not None
                or (ctx.restore_pii and ctx.pii is not None)
            ):
                obj = reply_object(body)
                ctx.usage = obj.get("usage") if obj is not None else None
                if obj is not None:
                    if ctx.cache_keys is not None or ctx.shadow_entry is not None:
                        await remember(ctx, obj)
                    if ctx.restore_pii and ctx.pii is not None:
                        body = orjson.dumps(map_texts(obj, ctx.pii.restore))
            else:
                # Nothing here needs the reply's content: its usage is read when the
                # request is settled, after the bytes are on their way.
                ctx.reply_body = body
            raw_headers = served_raw_headers(ctx)
            if ctx.idempotency_key is not None:
                gw.idempotency.complete(
                    ctx.principal.tenant_id,
                    ctx.idempotency_key,
                    StoredReply(
                        200,
                        {
                            k.decode("latin-1"): v.decode("latin-1")
                            for k, v in raw_headers
                            if k.startswith(b"x-switchyard")
                        },
                        stored_reply_body(ctx, body),
                    ),
                )
                ctx.idempotency_key = None
            # Settle after the bytes are sent: the client does not wait for the ledger,
            # metrics and trace of its own request.
            gw.pending_settles += 1
            handed_off = True
            return SettleAfterResponse(body, raw_headers, partial(gw.finish_after_response, ctx))
        except SwitchyardError as exc:
            ctx.status, ctx.error_code = "error", exc.code
            raise
        except BaseException:
            ctx.status, ctx.error_code = "error", "internal_error"
            raise
        finally:
            if ctx.idempotency_key is not None:  # we owned the key and did not succeed
                gw.idempotency.release(ctx.principal.tenant_id, ctx.idempotency_key)
            if not handed_off:
                await gw.finish(ctx)

    def cached_response(ctx: RequestContext, entry: Entry) -> Response:
        ctx.status = "ok"
        ctx.timings.ended = ctx.timings.client_first_byte = time.perf_counter()
        obj = orjson.loads(entry.body)
        if ctx.pii is not None:  # placeholders take this request's values
            obj = map_texts(obj, ctx.pii.restore)
        headers = served_headers(ctx)
        headers["x-switchyard-model"] = ctx.alias or ""
        if ctx.stream:
            return RelayResponse(
                replay(obj, ctx.include_usage),
                media_type="text/event-stream",
                headers=headers,
                on_close=lambda: gw.finish(ctx),
            )
        return Response(orjson.dumps(obj), media_type="application/json", headers=headers)

    async def remember(ctx: RequestContext, obj: dict[str, Any]) -> None:
        """Store a good reply (masked) and, in shadow mode, compare it with the would-be hit."""
        t = time.perf_counter()
        masked = map_texts(obj, ctx.pii.mask) if ctx.pii is not None else obj
        if ctx.shadow_entry is not None and gw.embedder is not None and gw.embedder.ready:
            cached = reply_text(orjson.loads(ctx.shadow_entry.body))
            vecs, _ = await gw.embedder.embed([cached, reply_text(masked)])
            agreement = float(vecs[0] @ vecs[1])
            ctx.record(
                "cache_shadow",
                "compared",
                f"cached vs fresh answer similarity {agreement:.3f}",
                t,
                {
                    "answer_similarity": round(agreement, 4),
                    "prompt_similarity": ctx.cache_similarity,
                },
            )
        if ctx.cache_keys is None or gw.cache is None:
            return
        why = storable_reply(masked)
        if why is not None:
            ctx.record("cache_store", "skip", why, t)
            return
        gw.cache.store(ctx.cache_keys, orjson.dumps(masked), ctx.vector, gw.settings.cache.ttl_s)
        ctx.record(
            "cache_store",
            "stored",
            "reply stored for later requests",
            t,
            {"partition": ctx.cache_keys.partition[:12]},
        )

    async def claim_idempotency(ctx: RequestContext, key: str) -> Response | None:
        """A stored reply for a repeated request, or None once this request owns the key."""
        t = time.perf_counter()
        key = request_headers.idempotency_key(key)
        if ctx.stream:
            raise InvalidRequest(
                "Idempotency-Key is supported for non-streaming requests only",
                param="Idempotency-Key",
            )
        stored = await gw.idempotency.begin(
            ctx.principal.tenant_id, key, body_hash(ctx.body), ctx.deadline
        )
        if stored is None:
            ctx.idempotency_key = key
            ctx.record("idempotency", "owner", "first request with this key runs", t)
            return None
        ctx.status, ctx.cache = "ok", "idempotent_replay"
        ctx.record("idempotency", "replay", "returning the stored reply; no upstream call", t)
        headers = {
            **stored.headers,
            "x-request-id": ctx.request_id,
            "x-switchyard-idempotent-replay": "true",
        }
        body = stored.body
        obj = reply_object(body) if b"<" in body else None
        if obj is not None:  # placeholders take this request's values, as the cache does
            body = orjson.dumps(map_texts(obj, pii_session(ctx).restore))
        return Response(
            body, status_code=stored.status, media_type="application/json", headers=headers
        )

    def pii_session(ctx: RequestContext) -> Any:
        """The request's PII session: the PII stage's, or one that has masked the
        request's own texts (same body, same placeholders)."""
        if ctx.pii is not None:
            return ctx.pii
        session = gw.pii.session()
        mask_body(session, ctx.wire[0] if ctx.wire is not None else ctx.body)
        return session

    def stored_reply_body(ctx: RequestContext, body: bytes) -> bytes:
        """What the idempotency store keeps: the reply with PII masked (restored from
        the replaying request on replay); never raw values at rest."""
        obj = reply_object(body)
        if obj is None:
            return body
        return orjson.dumps(map_texts(obj, pii_session(ctx).mask))

    async def chat_completions(request: Request) -> Response:
        return await generate(request, "chat.completions")

    async def completions(request: Request) -> Response:
        return await generate(request, "completions")

    async def models(request: Request) -> Response:
        principal = gw.authenticate(request.headers)
        data: list[dict[str, Any]] = [
            {
                "id": m.alias,
                "object": "model",
                "created": int(gw.started_at),
                "owned_by": "switchyard",
                "revision": m.revision,
            }
            for m in gw.settings.models
            if principal.may_use(m.alias)
        ]
        if gw.embedder is not None and principal.may_use(gw.settings.embeddings.alias):
            data.append(
                {
                    "id": gw.settings.embeddings.alias,
                    "object": "model",
                    "created": int(gw.started_at),
                    "owned_by": "switchyard",
                }
            )
        return Response(
            orjson.dumps({"object": "list", "data": data}), media_type="application/json"
        )

    async def embeddings(request: Request) -> Response:
        principal = gw.authenticate(request.headers)
        body = await read_json(request, max_body, body_timeout_s, max_depth)
        cfg = gw.settings.embeddings
        model, texts = validate_embeddings(body, cfg.max_inputs)
        if gw.embedder is None or model != cfg.alias:
            if gw.settings.model(model) is not None:
                raise InvalidRequest(
                    f"the model '{model}' does not serve embeddings", param="model"
                )
            raise ModelNotFound(f"the embedding model '{model}' does not exist", param="model")
        authorize_model(principal, model)
        dims = body.get("dimensions")
        vecs, counts = await gw.embedder.embed(texts)
        if dims is not None and dims != vecs.shape[1]:
            raise InvalidRequest(
                f"'dimensions' must be {vecs.shape[1]} for {model}", param="dimensions"
            )
        b64 = body.get("encoding_format") == "base64"
        data = [
            {
                "object": "embedding",
                "index": i,
                "embedding": base64.b64encode(v.tobytes()).decode() if b64 else v.tolist(),
            }
            for i, v in enumerate(vecs)
        ]
        tokens = sum(counts)
        out = {
            "object": "list",
            "data": data,
            "model": model,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        }
        return Response(orjson.dumps(out), media_type="application/json")

    return [
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/embeddings", embeddings, methods=["POST"]),
    ]
