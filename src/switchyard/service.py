"""One request's lifecycle, for every endpoint: validate, idempotency, decide,
execute, post-process, settle.

`api/` maps HTTP to this and back: it reads the body (size and time limits are the
HTTP boundary's), hands the parsed JSON over and turns the `Reply` into a response.
Everything in between, and the settling that runs exactly once whatever way a request
ended, is here; the decisions themselves are the pipeline's stages.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import random
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any, NoReturn

import orjson

from switchyard.config import Price, Settings
from switchyard.decide.cache import Entry, ResponseCache
from switchyard.decide.cacheability import assemble, storable_reply
from switchyard.embed import EmbeddingService
from switchyard.engines.pool import EnginePool
from switchyard.engines.registry import Deployment
from switchyard.engines.token_ids import attach as attach_token_ids
from switchyard.engines.token_ids import refusal as token_ids_refusal
from switchyard.errors import (
    ClientDisconnected,
    InvalidRequest,
    ModelNotFound,
    SwitchyardError,
    TaskCancelled,
)
from switchyard.execute.executor import Executor
from switchyard.execute.idempotency import IdempotencyStore, StoredReply, body_hash
from switchyard.observe.ledger import Finished, UsageLedger
from switchyard.observe.metrics import Metrics
from switchyard.pipeline import (
    CacheOutcome,
    Pipeline,
    RequestContext,
    RequestIds,
    RequestInput,
    Status,
    Timings,
)
from switchyard.policy import headers as request_headers
from switchyard.policy.admit import cost_usd
from switchyard.policy.auth import ANONYMOUS, Authenticator
from switchyard.policy.cost import PromptOverhead
from switchyard.policy.keys import Principal
from switchyard.policy.limits import Limiter, LimiterUnavailable
from switchyard.policy.pii import PiiMasker, mask_body
from switchyard.policy.tasks import Running, TaskStore
from switchyard.policy.tool_calls import ToolGovernor, ToolOutcome, ToolPolicy
from switchyard.policy.validate import (
    image_parts,
    validate_chat,
    validate_completion,
    validate_embeddings,
)

if TYPE_CHECKING:
    from switchyard.decide.balance import Balancer
    from switchyard.observe.otel import Tracing

log = logging.getLogger("switchyard")

# Reads the request's JSON body within a number of seconds: (parsed, raw bytes).
ReadBody = Callable[[float], Awaitable[tuple[Any, bytes]]]


@dataclass(slots=True)
class JsonReply:
    """A JSON answer. `settle` (when set) is called once its bytes are sent: the
    client does not wait for the ledger, metrics and trace of its own request."""

    body: bytes
    headers: list[tuple[bytes, bytes]]  # lower-case names, encoded
    settle: Callable[[], Awaitable[None] | None] | None = None
    status: int = 200


@dataclass(slots=True)
class StreamReply:
    """A server-sent event stream: the upstream's (`source`) or a cached completion
    replayed (`cached`). `on_close` runs once the stream ends, however it ends."""

    ctx: RequestContext
    headers: dict[str, str]
    on_close: Callable[[], Awaitable[None]]
    source: Any = None  # the executor's UpstreamStream
    cached: dict[str, Any] | None = None
    tools: Any = None  # a ToolGovernor factory for the stream's tool calls


Reply = JsonReply | StreamReply


def reply_object(body: bytes) -> dict[str, Any] | None:
    """A JSON reply as an object, or None if it is not one."""
    try:
        obj = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    return obj if isinstance(obj, dict) else None


def reply_usage(body: bytes) -> dict[str, Any] | None:
    """The `usage` object of a JSON reply, or None."""
    obj = reply_object(body)
    usage = obj.get("usage") if obj is not None else None
    return usage if isinstance(usage, dict) else None


def reply_text(obj: dict[str, Any]) -> str:
    c = (obj.get("choices") or [{}])[0]
    return str((c.get("message") or {}).get("content") or c.get("text") or "")


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


def _deployment_headers(dep: Deployment) -> list[tuple[bytes, bytes]]:
    """`x-switchyard-model`, `-revision` and `-upstream` of a deployment, encoded once.
    `-upstream` is the deployment's configured name (Deployment.served_by), never its
    URL: clients learn which deployment answered, not the operator's addresses."""
    label = dep.served_by
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
        if dep.adapter is not None:  # the adapter and its revision, beside the base's
            cached[1].append((b"x-switchyard-adapter", dep.adapter.name.encode("latin-1")))
            cached[1].append(
                (b"x-switchyard-adapter-revision", dep.adapter.revision.encode("latin-1"))
            )
    return cached[1]


def served_raw_headers(ctx: RequestContext) -> list[tuple[bytes, bytes]]:
    """What served the request, as response headers (lower-case names, encoded)."""
    h = [(b"x-request-id", ctx.input.request_id.encode("latin-1"))]
    if ctx.input.client_request_id is not None:  # validated: ASCII
        h.append((b"x-client-request-id", ctx.input.client_request_id.encode("latin-1")))
    if ctx.cache is not None:
        h.append((b"x-switchyard-cache", ctx.cache.encode("latin-1")))
        cs = ctx.cache_state
        sim = cs.similarity if cs is not None else None
        if sim is not None and ctx.cache != CacheOutcome.HIT_EXACT:
            h.append((b"x-switchyard-cache-similarity", b"%.4f" % sim))
    if ctx.admission.rate_headers:
        h.extend(
            (k.encode("latin-1"), v.encode("latin-1"))
            for k, v in ctx.admission.rate_headers.items()
        )
    if ctx.route is not None:
        h.append((b"x-switchyard-route", ctx.route.encode("latin-1")))
        if ctx.route_score is not None:
            h.append((b"x-switchyard-route-score", b"%.4f" % ctx.route_score))
    if ctx.tools_blocked:
        h.append((b"x-switchyard-tools-blocked", b"%d" % ctx.tools_blocked))
    cost = ctx.cost
    if cost is not None and cost.reason is not None and ctx.run.attempts:
        # The output cap the gateway sent, and why: the client's was absent or too big.
        h.append((b"x-switchyard-max-tokens", b"%d; reason=%s" % (cost.cap, cost.reason.encode())))
    placed = ctx.placement
    if placed is not None:
        h.append((b"x-switchyard-placement", f"{placed.mode}; reason={placed.reason}".encode()))
    dep = ctx.deployment
    if dep is not None:
        h.extend(_deployment_headers(dep))
        h.append((b"x-switchyard-attempts", b"%d" % ctx.run.attempts))
        if ctx.run.fallback_from is not None:
            h.append(
                (
                    b"x-switchyard-fallback",
                    f"{ctx.run.fallback_from} -> {dep.alias}".encode("latin-1"),
                )
            )
    t = ctx.timings
    if t.upstream_sent is not None and t.upstream_first_byte is not None:
        now = time.perf_counter()
        gw = (t.upstream_sent - t.received) * 1000
        up = (t.upstream_first_byte - t.upstream_sent) * 1000
        total = (now - t.received) * 1000
        timing = b"gateway;dur=%.2f, upstream;dur=%.2f, total;dur=%.2f" % (gw, up, total)
        if ctx.admission.queue_ms:
            timing = b"queue;dur=%.2f, " % ctx.admission.queue_ms + timing
        if ctx.media_ms:
            media = ", ".join(f"media_{k};dur={v:.2f}" for k, v in ctx.media_ms.items())
            timing = media.encode("ascii") + b", " + timing
        h.append((b"server-timing", timing))
    return h


def served_headers(ctx: RequestContext) -> dict[str, str]:
    """`served_raw_headers` as a dict, for responses built from one."""
    return {k.decode("latin-1"): v.decode("latin-1") for k, v in served_raw_headers(ctx)}


def _switchyard_headers(raw: list[tuple[bytes, bytes]]) -> dict[str, str]:
    return {
        k.decode("latin-1"): v.decode("latin-1") for k, v in raw if k.startswith(b"x-switchyard")
    }


def _stopped_by_cancel(ctx: RequestContext) -> TaskCancelled | None:
    """A request its task's cancel stopped (policy/tasks.Running.stop): the asyncio
    cancellation is taken back and the request ends as 409 task_cancelled, recorded.
    None for any other cancellation (the client left, shutdown): that one goes on."""
    if not ctx.cancelled:
        return None
    task = asyncio.current_task()
    if task is not None:
        task.uncancel()
    ctx.record("task", "stopped", "the task was cancelled while this call ran", time.perf_counter())
    return TaskCancelled(f"the task '{ctx.input.task_id}' was cancelled while this call ran")


def record_tool_calls(ctx: RequestContext, result: ToolOutcome, t: float) -> None:
    """The tool_calls decision of a reply, and what the task keeps of its calls."""
    ctx.tools_blocked = result.blocked
    ctx.tool_notes = result.notes
    ctx.record("tool_calls", result.outcome, result.reason(), t, {"calls": result.calls})


def _raise_cancelled(ctx: RequestContext, exc: asyncio.CancelledError) -> NoReturn:
    """A cancelled request ends as 409 task_cancelled when its task's cancel stopped it
    (recorded, the cancellation taken back); any other cancellation goes on."""
    stopped = _stopped_by_cancel(ctx)
    mark_failed(ctx, stopped or exc)
    if stopped is None:
        raise exc
    raise stopped from None


def mark_failed(ctx: RequestContext, exc: BaseException) -> None:
    """Mark a request that ended by an exception: its code, or internal_error. A
    client that hung up mid-body is cancelled, not an error (logged at INFO, no
    traceback): anyone with a key could otherwise fill the error log and rate."""
    if isinstance(exc, ClientDisconnected):
        ctx.status, ctx.error_code = Status.CANCELLED, exc.code
        log.info("request %s (%s): %s", ctx.input.request_id, ctx.input.endpoint, exc.message)
        return
    code = exc.code if isinstance(exc, SwitchyardError) else "internal_error"
    ctx.status, ctx.error_code = Status.ERROR, code


def client_left(ctx: RequestContext) -> bool:
    """Whether the request ended because its client went away (mid-body, mid-stream,
    mid-rollout), not because its task was cancelled."""
    return ctx.status == Status.CANCELLED and ctx.error_code != TaskCancelled.code


def embedding_estimate(price: Price) -> Callable[[RequestContext], tuple[int, int, Price]]:
    """(input tokens, 0, price) of an embeddings request, leaning high as the chat
    estimate does: ≈3 characters per token of text, one per token of a token array."""

    def estimate(ctx: RequestContext) -> tuple[int, int, Price]:
        inp = ctx.body.get("input")
        items = [inp] if isinstance(inp, str) else inp if isinstance(inp, list) else []
        if items and all(isinstance(x, int) for x in items):  # one token array
            return len(items), 0, price
        tokens = sum(len(x) // 3 + 1 if isinstance(x, str) else len(x) for x in items)
        return tokens, 0, price

    return estimate


@dataclass(slots=True)
class Pipelines:
    """The stage sequences, per endpoint kind."""

    generation: Pipeline  # chat.completions and completions
    embeddings: Pipeline


@dataclass
class RequestService:
    """Runs requests from the moment their headers are read until they are settled."""

    settings: Settings
    auth: Authenticator
    pipelines: Pipelines
    executor: Executor
    limiter: Limiter
    ledger: UsageLedger
    idempotency: IdempotencyStore
    masker: PiiMasker
    cache: ResponseCache | None
    embedder: EmbeddingService | None
    metrics: Metrics | None
    tracing: Tracing | None
    request_ids: RequestIds = field(default_factory=RequestIds)
    pending_settles: int = 0  # answered requests whose settle runs after the response
    active: int = 0  # requests between open and settle
    # (alias, deployment, why) when the canary guard cut a deployment (gateway.py
    # stores the weight, logs and counts it)
    on_canary_cut: Callable[[str, Any, str], None] | None = None
    tasks: TaskStore | None = None  # agent tasks' budgets (policy/tasks.py)
    running: Running | None = None  # the tasks' calls in flight here
    tools: ToolPolicy | None = None  # tool calls in replies (policy/tool_calls.py)
    # Prompt tokens beyond the estimate, per model (shared with the estimates).
    overhead: PromptOverhead = field(default_factory=PromptOverhead)

    def __post_init__(self) -> None:
        s = self.settings
        # Config values read on every request, as plain attributes (an attribute of a
        # pydantic model costs ~4x one of a plain object).
        self._deadline_s = s.server.default_deadline_s
        self._unknown_fields = s.validation.unknown_fields
        self._traces = s.observe.traces
        self._sample_ok = s.observe.traces_sample_ok
        self._slow_ms = s.observe.traces_slow_ms
        self._sampler = random.Random()
        self._embed_price = Price(input=s.embeddings.price, output=0.0)
        self._embed_alias = s.embeddings.alias
        self._models = {m.alias: m for m in s.models}  # for `alias@revision` pins
        # RL-managed aliases (their revision managers; the gateway sets it): a pin on
        # one is checked against the revision the request leases (decide/stages.py).
        self.rl_aliases: Mapping[str, Any] = {}
        # The authenticate verdict and evidence per (tenant, key, anonymous).
        self._authenticated: dict[tuple[str, str, bool], tuple[tuple[str, str], Any]] = {}

    # -- opening a request ----------------------------------------------------------
    def authenticate(self, headers: Mapping[str, str]) -> Principal | Awaitable[Principal]:
        """The caller, before any costly work: at once when its key is cached, else an
        awaitable (the key store is read off the event loop)."""
        if self.settings.auth.mode == "disabled":
            return ANONYMOUS
        return self.auth.authenticate(headers)

    def open(
        self, endpoint: str, headers: Mapping[str, str], received: float, principal: Principal
    ) -> RequestContext:
        """The request's context, once its caller is known. Every header read here is
        bounded here; a bad one is kept as the request's header_error and refused
        once its handling starts (so it is settled like any refusal)."""
        parents: tuple[str, ...]
        if request_headers.READ.isdisjoint(headers):  # nearly every request: none of them
            task, parents, client_id, planned, bad = None, (), None, None, None
        else:
            task, parents, client_id, planned, bad = request_headers.read(headers)
        # Positional, in field order: a dataclass this wide matches keywords slowly.
        ctx = RequestContext(
            RequestInput(
                self.request_ids(),
                endpoint,
                time.time() - (time.perf_counter() - received),
                headers,
                task,
                parents,
                client_id,
                planned,
            ),
            {},
            Timings(received),
            received + self._deadline_s,
            principal,
        )
        ctx.header_error = bad
        if self.tracing is not None:
            self.tracing.start_request(
                ctx, headers, time.time_ns() - int((time.perf_counter() - received) * 1e9)
            )
        who = (principal.tenant_id, principal.key_id, principal is ANONYMOUS)
        authenticated = self._authenticated.get(who)
        if authenticated is None:
            authenticated = (
                ("skip", "auth.mode is disabled")
                if principal is ANONYMOUS
                else ("ok", "valid API key"),
                {"tenant": principal.tenant_id, "key": principal.key_id},
            )
            if len(self._authenticated) >= 4096:  # principals are re-read as keys change
                self._authenticated.clear()
            self._authenticated[who] = authenticated
        (outcome, reason), evidence = authenticated
        ctx.decisions.append(
            ("authenticate", outcome, reason, evidence, received, time.perf_counter())
        )
        self.active += 1
        return ctx

    def begin(self, ctx: RequestContext) -> None:
        """What every request checks first: its headers, then its own deadline
        (`x-request-timeout`, which can only shorten the gateway's)."""
        if ctx.header_error is not None:
            raise ctx.header_error
        headers = ctx.input.headers
        timeout = headers.get("x-request-timeout") if headers is not None else None
        if timeout is not None:
            asked = request_headers.request_timeout(timeout)
            ctx.deadline = ctx.timings.received + min(self._deadline_s, asked)

    # -- chat and completions ---------------------------------------------------------
    async def generate(self, ctx: RequestContext, read: ReadBody) -> Reply:
        """validate → idempotency → decide → execute → post-process; settled exactly
        once, here on a refusal or error, after the reply once it is handed over."""
        handed_off = False
        try:
            self.begin(ctx)
            body, raw = await read(ctx.remaining_s())
            if ctx.input.endpoint == "chat.completions":
                alias = validate_chat(body, self._unknown_fields)
            else:
                alias = validate_completion(body, self._unknown_fields)
            ctx.body = body
            ctx.wire = (body, raw)
            if "@" in alias:  # `alias@revision` pins a revision
                alias, pin = self._pin(alias)
                ctx.pin = pin
            ctx.alias = alias
            ctx.stream = bool(body.get("stream"))
            options = body.get("stream_options")  # an object when present (validated)
            ctx.include_usage = bool(options.get("include_usage")) if options else False
            received = ctx.timings.received
            ctx.decisions.append(
                ("validate", "ok", "request shape is valid", None, received, time.perf_counter())
            )
            idem = ctx.input.headers.get("idempotency-key")
            if idem is not None:
                replayed = await self._claim_idempotency(ctx, idem)
                if replayed is not None:
                    return replayed
            pending = self.pipelines.generation.decide(ctx)
            if pending is not None:
                await pending
            if ctx.response is not None:  # a cache hit
                reply = await self._cached(ctx, ctx.response)
                handed_off = isinstance(reply, StreamReply)
                return reply
            reply = await self._execute(ctx)
            handed_off = True
            return reply
        except asyncio.CancelledError as exc:
            _raise_cancelled(ctx, exc)
        except BaseException as exc:
            mark_failed(ctx, exc)
            raise
        finally:
            if ctx.idempotency_key is not None:  # we owned the key and did not succeed
                await self.idempotency.release(ctx.principal.tenant_id, ctx.idempotency_key)
            if not handed_off:
                await self.settle(ctx)

    async def _execute(self, ctx: RequestContext) -> Reply:
        model = ctx.model
        assert model is not None
        if not model.capabilities.supports_vision and ctx.input.endpoint == "chat.completions":
            part = image_parts(ctx.body)
            if part is not None:
                raise InvalidRequest(
                    f"the model '{model.alias}' does not accept images "
                    "(capabilities.supports_vision is false)",
                    param=part,
                )
        if ctx.body.get("return_token_ids") is True:
            why = token_ids_refusal(model, ctx.stream, ctx.body.get("n"))
            if why is not None:
                raise InvalidRequest(f"the model '{model.alias}' {why}", param="return_token_ids")
        if ctx.stream:
            if not model.capabilities.supports_streaming:
                raise InvalidRequest(
                    f"the model '{ctx.alias}' does not support streaming", param="stream"
                )
            stream = await self.executor.execute_stream(ctx)
            cs = ctx.cache_state
            if cs is not None and cs.wants_reply:
                cs.collected = []

            async def close() -> None:
                stream.close(complete=ctx.status == Status.OK)
                if ctx.status == Status.OK and cs is not None and cs.collected is not None:
                    obj = assemble(cs.collected)
                    if obj is not None:
                        await self._remember(ctx, obj)
                await self.settle(ctx)

            return StreamReply(
                ctx, served_headers(ctx), close, source=stream, tools=self._governor(ctx)
            )
        reply = await self.executor.execute(ctx)
        ctx.status = Status.OK
        ctx.timings.ended = time.perf_counter()
        body = reply.body
        served = ctx.deployment
        if (
            served is not None
            and served.token_ids == "llamacpp"
            and ctx.body.get("return_token_ids") is True
        ):
            body = await attach_token_ids(
                body, ctx.input.endpoint, served.upstream, max(0.5, ctx.remaining_s())
            )
        if b'"tool_calls"' in body and self.tools is not None:
            body = self._govern_tools(ctx, body)
        cs = ctx.cache_state
        remember = cs is not None and cs.wants_reply
        if remember or (ctx.pii is not None and ctx.pii.restore):
            obj = reply_object(body)
            ctx.run.usage = obj.get("usage") if obj is not None else None
            if obj is not None:
                if remember:
                    await self._remember(ctx, obj)
                if ctx.pii is not None and ctx.pii.restore:
                    body = orjson.dumps(map_texts(obj, ctx.pii.session.restore))
        else:
            # Nothing here needs the reply's content: its usage is read when the
            # request is settled, after the bytes are on their way.
            ctx.run.reply_body = body
        raw_headers = served_raw_headers(ctx)
        if ctx.idempotency_key is not None:
            await self._complete_idempotency(ctx, raw_headers, body)
        self.pending_settles += 1
        return JsonReply(body, raw_headers, partial(self.settle_after_response, ctx))

    def _governor(self, ctx: RequestContext) -> ToolGovernor | None:
        if self.tools is None or ctx.input.endpoint != "chat.completions":
            return None
        return ToolGovernor(
            self.tools,
            ctx.principal.tenant_id,
            ctx.input.task_id,
            ctx.input.request_id,
            ctx.input.parent_request_ids,
            ctx.wire[0] if ctx.wire is not None else ctx.body,
        )

    def _govern_tools(self, ctx: RequestContext, body: bytes) -> bytes:
        """A non-streamed reply with its tool calls governed (policy/tool_calls.py)."""
        obj = reply_object(body)
        governor = self._governor(ctx)
        if obj is None or governor is None:
            return body
        t = time.perf_counter()
        governed = governor.govern_reply(obj)
        usage = obj.get("usage")
        if isinstance(usage, dict):
            ctx.run.usage = usage  # parsed here: settle need not read the reply again
        result = governor.result
        if not result.calls:
            return body
        record_tool_calls(ctx, result, t)
        return orjson.dumps(governed)

    async def _cached(self, ctx: RequestContext, entry: Entry) -> Reply:
        ctx.status = Status.OK
        ctx.timings.ended = ctx.timings.client_first_byte = time.perf_counter()
        obj = orjson.loads(entry.body)
        if ctx.pii is not None:  # placeholders take this request's values
            obj = map_texts(obj, ctx.pii.session.restore)
        raw = served_raw_headers(ctx)
        raw.append((b"x-switchyard-model", (ctx.alias or "").encode("latin-1")))
        if ctx.stream:
            headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in raw}
            return StreamReply(ctx, headers, partial(self.settle, ctx), cached=obj)
        body = orjson.dumps(obj)
        if ctx.idempotency_key is not None:  # a repeat replays this answer
            await self._complete_idempotency(ctx, raw, body)
        return JsonReply(body, raw)

    async def _remember(self, ctx: RequestContext, obj: dict[str, Any]) -> None:
        """Store a good reply (masked) and, in shadow mode, compare it with the would-be hit."""
        t = time.perf_counter()
        cs = ctx.cache_state
        assert cs is not None  # only called when the cache stages wanted the reply
        masked = map_texts(obj, ctx.pii.session.mask) if ctx.pii is not None else obj
        embedder = self.embedder
        if cs.shadow_entry is not None and embedder is not None and embedder.ready:
            cached = reply_text(orjson.loads(cs.shadow_entry.body))
            vecs, _ = await embedder.embed([cached, reply_text(masked)])
            agreement = float(vecs[0] @ vecs[1])
            evidence: dict[str, Any] = {
                "answer_similarity": round(agreement, 4),
                "prompt_similarity": cs.similarity,
            }
            thresholds = self.cache.thresholds if self.cache is not None else None
            if cs.shadow_semantic and thresholds is not None and cs.similarity is not None:
                # Live evidence moves the partition's threshold (decide/shadow_threshold.py).
                verdict, keys = cs.plan
                evidence["partition_threshold"] = thresholds.observe(
                    keys.partition, verdict.threshold, cs.similarity, agreement
                )
            ctx.record(
                "cache_shadow",
                "compared",
                f"cached vs fresh answer similarity {agreement:.3f}",
                t,
                evidence,
            )
        if cs.store_keys is None or self.cache is None:
            return
        why = storable_reply(masked)
        if why is not None:
            ctx.record("cache_store", "skip", why, t)
            return
        entry = self.cache.store(
            cs.store_keys, orjson.dumps(masked), ctx.vector, self.settings.cache.ttl_s
        )
        stored: dict[str, Any] = {"partition": cs.store_keys.partition[:12]}
        if self.cache.share is not None:  # every gateway process learns it
            stored["shared"] = await self.cache.share.put(entry, ctx.vector)
        ctx.record("cache_store", "stored", "reply stored for later requests", t, stored)

    # -- idempotency ------------------------------------------------------------------
    async def _claim_idempotency(self, ctx: RequestContext, key: str) -> JsonReply | None:
        """A stored reply for a repeated request, or None once this request owns the key."""
        t = time.perf_counter()
        key = request_headers.idempotency_key(key)
        if ctx.stream:
            raise InvalidRequest(
                "Idempotency-Key is supported for non-streaming requests only",
                param="Idempotency-Key",
            )
        stored = await self.idempotency.begin(
            ctx.principal.tenant_id, key, body_hash(ctx.body), ctx.deadline
        )
        if stored is None:
            ctx.idempotency_key = key
            ctx.record("idempotency", "owner", "first request with this key runs", t)
            return None
        ctx.status, ctx.cache = Status.OK, CacheOutcome.REPLAY
        ctx.record("idempotency", "replay", "returning the stored reply; no upstream call", t)
        headers = {
            **stored.headers,
            "x-request-id": ctx.input.request_id,
            "x-switchyard-idempotent-replay": "true",
        }
        body = stored.body
        obj = reply_object(body) if b"<" in body else None
        if obj is not None:  # placeholders take this request's values, as the cache does
            body = orjson.dumps(map_texts(obj, self._pii_session(ctx).restore))
        raw = [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in headers.items()]
        return JsonReply(body, raw, status=stored.status)

    async def _complete_idempotency(
        self, ctx: RequestContext, raw_headers: list[tuple[bytes, bytes]], body: bytes
    ) -> None:
        assert ctx.idempotency_key is not None
        await self.idempotency.complete(
            ctx.principal.tenant_id,
            ctx.idempotency_key,
            StoredReply(200, _switchyard_headers(raw_headers), self._stored_body(ctx, body)),
        )
        ctx.idempotency_key = None

    def _pii_session(self, ctx: RequestContext) -> Any:
        """The request's PII session: the PII stage's, or one that has masked the
        request's own texts (same body, same placeholders)."""
        if ctx.pii is not None:
            return ctx.pii.session
        session = self.masker.session()
        mask_body(session, ctx.wire[0] if ctx.wire is not None else ctx.body)
        return session

    def _stored_body(self, ctx: RequestContext, body: bytes) -> bytes:
        """What the idempotency store keeps: the reply with PII masked (restored from
        the replaying request on replay); never raw values at rest."""
        obj = reply_object(body)
        if obj is None:
            return body
        return orjson.dumps(map_texts(obj, self._pii_session(ctx).mask))

    # -- embeddings ---------------------------------------------------------------------
    async def embeddings(self, ctx: RequestContext, read: ReadBody) -> JsonReply:
        """validate → authorize → admit (rpm, tpm by input tokens, concurrency,
        budget at embeddings.price) → embed → settle, like any request."""
        try:
            self.begin(ctx)
            body, raw = await read(ctx.remaining_s())
            cfg = self.settings.embeddings
            model, texts = validate_embeddings(body, cfg.max_inputs)
            ctx.body = body
            ctx.wire = (body, raw)
            embedder = self.embedder
            if embedder is None or model != cfg.alias:
                if self.settings.model(model) is not None:
                    raise InvalidRequest(
                        f"the model '{model}' does not serve embeddings", param="model"
                    )
                raise ModelNotFound(f"the embedding model '{model}' does not exist", param="model")
            ctx.alias = model
            dims = body.get("dimensions")
            if dims is not None and embedder.dimensions is not None and dims != embedder.dimensions:
                raise InvalidRequest(
                    f"'dimensions' must be {embedder.dimensions} for {model}", param="dimensions"
                )
            received = ctx.timings.received
            ctx.decisions.append(
                ("validate", "ok", "request shape is valid", None, received, time.perf_counter())
            )
            pending = self.pipelines.embeddings.decide(ctx)
            if pending is not None:
                await pending
            t = time.perf_counter()
            ctx.run.attempts = 1
            vecs, counts = await embedder.embed(texts)
            if dims is not None and dims != vecs.shape[1]:  # the model loaded meanwhile
                raise InvalidRequest(
                    f"'dimensions' must be {vecs.shape[1]} for {model}", param="dimensions"
                )
            tokens = sum(counts)
            ctx.record(
                "embed",
                "ok",
                f"embedded {len(texts)} input(s)",
                t,
                {"inputs": len(texts), "tokens": tokens, "dimensions": int(vecs.shape[1])},
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
            ctx.run.usage = {"prompt_tokens": tokens, "total_tokens": tokens}
            out = {"object": "list", "data": data, "model": model, "usage": ctx.run.usage}
            ctx.status = Status.OK
            ctx.timings.ended = time.perf_counter()
            return JsonReply(orjson.dumps(out), served_raw_headers(ctx))
        except asyncio.CancelledError as exc:
            _raise_cancelled(ctx, exc)
        except BaseException as exc:
            mark_failed(ctx, exc)
            raise
        finally:
            await self.settle(ctx)

    # -- settle ---------------------------------------------------------------------
    def settle_after_response(self, ctx: RequestContext) -> Awaitable[None] | None:
        """Settle a request whose reply has been sent; counted in `pending_settles`
        until done. None when it was settled without waiting."""
        try:
            pending = self.settle_now(ctx)
        except BaseException:
            self.pending_settles -= 1
            raise
        if pending is None:
            self.pending_settles -= 1
            return None
        return self._settling(pending)

    async def _settling(self, pending: Awaitable[None]) -> None:
        try:
            await pending
        finally:
            self.pending_settles -= 1

    async def settled(self, timeout_s: float = 5.0) -> None:
        """Wait until every answered request has been settled (admin reads use this, so
        what a client has seen answered is visible in the ledger and traces)."""
        deadline = time.monotonic() + timeout_s
        while self.pending_settles > 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.005)
        await self.ledger.flush_async()

    async def settle(self, ctx: RequestContext) -> None:
        """Release what the request held, charge what it used, write its usage row.
        Runs exactly once per request, whatever way it ended."""
        pending = self.settle_now(ctx)
        if pending is not None:
            await pending

    def _pin(self, name: str) -> tuple[str, str | None]:
        """(the alias, the pinned revision) of `alias@revision`. A pin needs an alias
        with several deployments; on one with a single deployment only its own
        revision may be named (a no-op)."""
        alias, _, pin = name.partition("@")
        model = self._models.get(alias)
        if not pin or model is None:
            raise ModelNotFound(
                f"the model '{name[:128]}' does not exist; GET /v1/models lists the "
                "available ones (a revision is pinned as alias@revision)",
                param="model",
            )
        if model.deployments or alias in self.rl_aliases:
            return alias, pin
        if pin == model.revision:
            return alias, None
        raise ModelNotFound(
            f"the model '{alias}' has no revision '{pin[:64]}' (it is revision {model.revision!r})",
            param="model",
        )

    def _guard(self, ctx: RequestContext, balancer: Balancer, dep: Deployment, ok: bool) -> None:
        """The request's outcome at `dep`, for its alias's canary guard."""
        t = time.perf_counter()
        e2e_ms = (t - ctx.timings.received) * 1000.0
        cut = balancer.guard_check(dep, ok, e2e_ms, time.monotonic())
        if cut is not None:
            ctx.record("canary", "cut", cut, t, {"deployment": dep.name, "weight": 0.0})
            if self.on_canary_cut is not None:
                self.on_canary_cut(balancer.alias, dep, cut)

    def settle_now(self, ctx: RequestContext) -> Awaitable[None] | None:
        """`settle`, synchronously unless limiter reservations are to be settled (then
        the rest is in the returned awaitable)."""
        if ctx.finished:
            return None
        ctx.finished = True
        self.active -= 1
        if ctx.admission.gate is not None:
            ctx.admission.gate.release()
        if ctx.admission.resident is not None:
            EnginePool.release(*ctx.admission.resident)
        if ctx.admission.lease is not None:
            ctx.admission.lease.release()
        if ctx.admission.balanced is not None:
            balancer, dep = ctx.admission.balanced
            tm = ctx.timings
            ttft = tpot = None
            if tm.upstream_sent is not None and tm.upstream_first_byte is not None:
                ttft = tm.upstream_first_byte - tm.upstream_sent
                n = ctx.run.chunks
                if n > 1:
                    tpot = ((tm.ended or time.perf_counter()) - tm.upstream_first_byte) / (n - 1)
            balancer.settled(dep, ttft, tpot)
            placed = ctx.placement
            if (
                placed is not None
                and placed.estimate_ms is not None
                and self.metrics is not None
                and ctx.error_code is None
            ):  # how far placement's estimate was from what the request took
                observed = (tm.ended or time.perf_counter()) - tm.received
                self.metrics.placement_error.labels(balancer.alias, placed.location).observe(
                    observed - placed.estimate_ms / 1000.0
                )
            if balancer.guard is not None:
                self._guard(ctx, balancer, dep, ctx.error_code is None)
        for balancer, dep, attempted in ctx.admission.left:  # failed over from these
            balancer.settled(dep, None, None)
            if attempted and balancer.guard is not None:
                self._guard(ctx, balancer, dep, False)
        if ctx.run.usage is None and ctx.run.reply_body is not None:
            ctx.run.usage = reply_usage(ctx.run.reply_body)
        usage = ctx.run.usage or {}
        if usage:
            inp = int(usage.get("prompt_tokens") or 0)
            out = int(usage.get("completion_tokens") or 0)
            if inp and ctx.alias is not None and ctx.cost is not None:
                self.overhead.observe(ctx.alias, ctx.cost.base, inp)  # reservations lean high
        elif ctx.run.attempts and ctx.input.endpoint != "embeddings":
            # Best effort for a broken stream: the prompt as it was estimated.
            inp = ctx.cost.prompt if ctx.cost is not None else ctx.prompt_estimate
            out = ctx.run.chunks
        else:
            inp = out = 0
        if ctx.model is not None:
            cost = cost_usd(ctx.model.price, inp, out)
        elif ctx.input.endpoint == "embeddings" and ctx.alias == self._embed_alias:
            cost = cost_usd(self._embed_price, inp, 0)
        else:
            cost = 0.0
        if ctx.admission.reservations or ctx.task is not None:
            return self._settle_reservations(ctx, inp, out, cost)
        self._finished(ctx, inp, out, cost)
        return None

    async def _settle_reservations(
        self, ctx: RequestContext, inp: int, out: int, cost: float
    ) -> None:
        hold = ctx.task
        if hold is not None:
            if self.running is not None:
                self.running.remove(hold.key, hold.request_id)
            if self.tasks is not None:
                try:
                    if ctx.tool_notes:
                        await self.tasks.note_tool_calls(hold.key, ctx.tool_notes)
                    called = ctx.run.attempts > 0 or ctx.cache is not None
                    await self.tasks.settle(hold.key, hold.request_id, inp + out, cost, called)
                except Exception as exc:  # shared task state unreachable: logged, not lost
                    log.warning("could not settle task of %s: %s", ctx.input.request_id, exc)
        for scopes, ask in ctx.admission.reservations:
            try:
                await self.limiter.settle(scopes, ask, inp + out, cost)
            except LimiterUnavailable as exc:
                log.warning("could not settle %s: %s", ctx.input.request_id, exc)
        self._finished(ctx, inp, out, cost)

    def _finished(self, ctx: RequestContext, inp: int, out: int, cost: float) -> None:
        """Metrics, span and ledger row of a settled request."""
        t = ctx.timings
        if t.ended is None:
            t.ended = time.perf_counter()
        end = t.ended
        # A plain str from here on: metrics labels and the ledger take the value.
        status = str(
            ctx.status if ctx.status not in (Status.PENDING, Status.STREAMING) else Status.ERROR
        )
        if self.metrics is not None:
            self.metrics.observe(ctx, status, inp, out, cost)
            if client_left(ctx):
                self.metrics.client_disconnected(ctx.input.endpoint)
        if self.tracing is not None:
            self.tracing.finish(
                ctx, status, inp, out, time.time_ns() - int((time.perf_counter() - end) * 1e9)
            )
        # Usage row and trace are built per batch, off this request's path.
        self.ledger.record(Finished(ctx, status, inp, out, cost, self._keep_trace(ctx, status)))

    def _keep_trace(self, ctx: RequestContext, status: str) -> bool:
        """The trace policy (observe.traces_sample_ok): what explains something is
        always kept; a plain success only as a sample."""
        if not self._traces:
            return False
        if self._sample_ok >= 1.0:
            return True
        t = ctx.timings
        plain = (
            status == "ok"
            and ctx.run.attempts <= 1
            and ctx.run.fallback_from is None
            and ctx.cache in (None, CacheOutcome.MISS, CacheOutcome.BYPASS)
            and ctx.input.task_id is None
            and t.ended is not None
            and (t.ended - t.received) * 1000.0 < self._slow_ms
        )
        return not plain or self._sampler.random() < self._sample_ok
