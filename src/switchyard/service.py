"""The request driver, for every endpoint: open → validate → idempotency → the
pipeline's stages → execute → the reply side → settle.

`api/` maps HTTP to this and back: it reads the body (size and time limits are the
HTTP boundary's), decodes it with its protocol's codec (api/codecs.py) into the typed
request (request.py) and turns the `Reply` (reply.py) into a response. The decisions
are the pipeline's stages, and so is what each does on the reply's way out and on
release; settling (settle.py) runs exactly once per request, whatever way it ended.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any

import orjson

from switchyard.config import Settings
from switchyard.decide.cache import Entry
from switchyard.engines.token_ids import attached
from switchyard.errors import ModelNotFound
from switchyard.execute.embeddings import Embeddings
from switchyard.execute.executor import Executor
from switchyard.execute.idempotent import Idempotent
from switchyard.identity import Principal
from switchyard.outcomes import Validate
from switchyard.pipeline import (
    Pipeline,
    RequestContext,
    RequestIds,
    Status,
)
from switchyard.policy import headers as request_headers
from switchyard.policy.auth import ANONYMOUS, Authenticator
from switchyard.policy.validate import model_refusal, split_pin
from switchyard.reply import (
    JsonReply,
    Reply,
    StreamReply,
    served_headers,
    served_raw_headers,
    through,
)
from switchyard.request import Embedding, Generation
from switchyard.settle import Settler, mark_failed, raise_cancelled

if TYPE_CHECKING:
    from switchyard.observe.otel import Tracing

VALIDATED = Validate.OK  # read once: an enum member read through its class costs more
_OK = Status.OK

# Reads and decodes the request's body within a number of seconds: (the typed
# request, the bytes it was decoded from when they are exactly it, else None).
ReadBody = Callable[[float], Awaitable[tuple[Any, bytes | None]]]


COUNT = "messages.count_tokens"  # the endpoint of a request whose tokens are counted
# The endpoint of a request that names no model and generates nothing (a stored
# response read, deleted or cancelled): admitted as one call of the key's (`called`).
CALL = "call"


@dataclass(slots=True)
class Pipelines:
    """The stage sequences, per endpoint kind."""

    generation: Pipeline  # chat.completions and completions
    embeddings: Pipeline
    counting: Pipeline  # messages.count_tokens: authorize and admit, nothing upstream
    calls: Pipeline  # CALL: admit only (no model to authorize), nothing upstream


@dataclass
class RequestService:
    """Runs requests from the moment their headers are read until they are settled."""

    settings: Settings
    auth: Authenticator
    pipelines: Pipelines
    executor: Executor
    settler: Settler
    idempotent: Idempotent
    embeddings_run: Embeddings
    tracing: Tracing | None = None
    request_ids: RequestIds = field(default_factory=RequestIds)
    active: int = 0  # requests between open and settle
    # RL-managed aliases (their revision managers; the gateway sets it): a pin on one
    # is checked against the revision the request leases (decide/stages.py).
    rl_aliases: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        s = self.settings
        self._deadline_s = s.server.default_deadline_s  # read per request: a plain attribute
        self._models = {m.alias: m for m in s.models}  # for `alias@revision` pins
        self._countable = set(self._models) | {a.name for a in s.adapters}

    # -- opening a request ----------------------------------------------------------
    def authenticate(
        self, headers: Mapping[str, str], x_api_key: bool = False
    ) -> Principal | Awaitable[Principal]:
        """The caller, before any costly work: at once when its key is cached, else an
        awaitable (the key store is read off the event loop). `x_api_key`: the
        protocol also takes the key as `x-api-key` (Anthropic's)."""
        if self.settings.auth.mode == "disabled":
            return ANONYMOUS
        return self.auth.authenticate(headers, x_api_key)

    def open(
        self,
        endpoint: str,
        headers: Mapping[str, str],
        received: float,
        principal: Principal,
        api: str | None = None,
    ) -> RequestContext:
        """The request's context, once its caller is known. Every header read here is
        bounded here; a bad one is kept as the request's header_error and refused
        once its handling starts (so it is settled like any refusal). `api`: the
        endpoint as called, when its protocol decodes into `endpoint`'s request."""
        ctx = request_headers.opened(
            self.request_ids(),
            endpoint,
            headers,
            received,
            received + self._deadline_s,
            principal,
            api,
        )
        if self.tracing is not None:
            self.tracing.start_request(
                ctx, headers, time.time_ns() - int((time.perf_counter() - received) * 1e9)
            )
        (outcome, reason), evidence = self.auth.verdict(principal)
        ctx.record("authenticate", outcome, reason, received, evidence)
        self.active += 1
        return ctx

    def begin(self, ctx: RequestContext) -> None:
        """Its headers' and its own deadline's checks (policy/headers.py)."""
        request_headers.begin(ctx, self._deadline_s)

    @staticmethod
    def _validated(ctx: RequestContext, req: Generation | Embedding, raw: bytes | None) -> None:
        ctx.request = req
        ctx.wire = (req, raw)
        ctx.record("validate", VALIDATED, "request shape is valid", ctx.timings.received)

    # -- chat and completions ---------------------------------------------------------
    async def generate(
        self,
        ctx: RequestContext,
        read: ReadBody,
        admitted: Callable[[], Awaitable[None]] | None = None,
    ) -> Reply:
        """Settled exactly once: here on a refusal or error, after the reply once it
        is handed over. `admitted` is awaited once every check has passed, before the
        upstream call or the cache hit's reply (a background response is stored then:
        a refused one never is)."""
        handed_off = False
        try:
            self.begin(ctx)
            req, raw = await read(ctx.remaining_s())  # decoded and shape-checked
            alias = req.model
            if "@" in alias:  # `alias@revision` pins a revision
                alias, ctx.pin = split_pin(alias, self._models, self.rl_aliases)
            ctx.alias = alias
            ctx.stream = req.stream
            ctx.include_usage = req.include_usage
            self._validated(ctx, req, raw)
            idem = ctx.input.headers.get("idempotency-key")
            if idem is not None:
                replayed = await self.idempotent.claim(ctx, idem)
                if replayed is not None:
                    return replayed
            pending = self.pipelines.generation.decide(ctx)
            if pending is not None:
                await pending
            if ctx.response is None:
                refused = model_refusal(ctx)
                if refused is not None:
                    raise refused
            if admitted is not None:
                await admitted()
            if ctx.response is not None:  # a cache hit
                reply = await self._cached(ctx, ctx.response)
                handed_off = isinstance(reply, StreamReply)
                return reply
            reply = await self._execute(ctx)
            handed_off = True
            return reply
        except asyncio.CancelledError as exc:
            raise_cancelled(ctx, exc)
        except BaseException as exc:
            mark_failed(ctx, exc)
            raise
        finally:
            if ctx.idempotency_key is not None:  # we owned the key and did not succeed
                await self.idempotent.release(ctx)
            if not handed_off:
                await self.settle(ctx)

    async def _execute(self, ctx: RequestContext) -> Reply:
        if ctx.stream:
            stream = await self.executor.execute_stream(ctx)
            side = self.pipelines.generation.reply_side(ctx)

            async def close() -> None:
                ok = ctx.status is _OK
                stream.close(complete=ok)
                try:
                    if side is not None:
                        await side.after(ok)
                finally:
                    await self.settle(ctx)

            return StreamReply(ctx, served_headers(ctx), close, source=stream, side=side)
        reply = await self.executor.execute(ctx)
        ctx.status = _OK
        ctx.timings.ended = time.perf_counter()
        if reply.obj is not None:  # parsed by the upstream client: settling reads this
            usage = reply.obj.get("usage")
            ctx.run.usage = usage if isinstance(usage, dict) else None
        body = await attached(
            reply.body,
            ctx.deployment,
            ctx.generation.return_token_ids,
            ctx.input.endpoint,
            ctx.remaining_s(),
        )
        sent = through(ctx, self.pipelines.generation.reply_side(ctx), body)
        body = sent if isinstance(sent, bytes) else await sent
        raw_headers = served_raw_headers(ctx)
        if ctx.idempotency_key is not None:
            await self.idempotent.complete(ctx, raw_headers, body)
        self.settler.pending += 1
        return JsonReply(body, raw_headers, partial(self.settle_after_response, ctx))

    async def _cached(self, ctx: RequestContext, entry: Entry) -> Reply:
        """A cache hit, through the reply side (its placeholders take this request's
        values), as JSON or replayed as a stream."""
        ctx.status = _OK
        ctx.timings.ended = ctx.timings.client_first_byte = time.perf_counter()
        obj = orjson.loads(entry.body)
        side = self.pipelines.generation.reply_side(ctx)
        if side is not None:
            obj = await side.whole(obj)
        raw = served_raw_headers(ctx)
        raw.append((b"x-switchyard-model", (ctx.alias or "").encode("latin-1")))
        if ctx.stream:
            headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in raw}
            return StreamReply(ctx, headers, partial(self.settle, ctx), cached=obj)
        body = orjson.dumps(obj)
        if ctx.idempotency_key is not None:  # a repeat replays this answer
            await self.idempotent.complete(ctx, raw, body)
        return JsonReply(body, raw)

    # -- embeddings ---------------------------------------------------------------------
    async def embeddings(self, ctx: RequestContext, read: ReadBody) -> JsonReply:
        """validate → authorize → admit (rpm, tpm by input tokens, concurrency,
        budget at embeddings.price) → embed → settle, like any request."""
        async with self._settled(ctx):
            self.begin(ctx)
            req, raw = await read(ctx.remaining_s())  # decoded and shape-checked
            texts = self.embeddings_run.validate(ctx, req)
            self._validated(ctx, req, raw)
            pending = self.pipelines.embeddings.decide(ctx)
            if pending is not None:
                await pending
            out = await self.embeddings_run.run(ctx, texts)
            ctx.status = _OK
            ctx.timings.ended = time.perf_counter()
            return JsonReply(orjson.dumps(out), served_raw_headers(ctx))

    # -- counting a request's tokens -----------------------------------------------------
    async def counted(
        self, ctx: RequestContext, read: ReadBody, count: Callable[[Generation], int]
    ) -> int:
        """`count` of the request (its input tokens), once the key may use its model
        (the same pin and authorize rules as a generation) and its limits admit it as
        a request: it is one (rpm, concurrency), that reserves no tokens and costs
        nothing. Recorded and settled like any request; nothing goes upstream."""
        async with self._settled(ctx):
            self.begin(ctx)
            req, raw = await read(ctx.remaining_s())  # decoded and shape-checked
            alias = req.model
            if "@" in alias:
                alias, ctx.pin = split_pin(alias, self._models, self.rl_aliases)
            if alias not in self._countable:
                raise ModelNotFound(f"the model '{alias[:128]}' does not exist", param="model")
            ctx.alias = alias
            self._validated(ctx, req, raw)
            pending = self.pipelines.counting.decide(ctx)
            if pending is not None:
                await pending
            n = count(req)
            ctx.status = _OK
            ctx.timings.ended = time.perf_counter()
            return n

    # -- a call that names no model --------------------------------------------------------
    @asynccontextmanager
    async def called(self, ctx: RequestContext) -> AsyncIterator[None]:
        """The work of a request opened as CALL (its `api` names it: a stored response
        read, deleted, cancelled), once its headers pass and its principal's limits
        admit it as one call (no tokens, no cost): recorded and settled like any
        request, however it ends."""
        async with self._settled(ctx):
            self.begin(ctx)
            pending = self.pipelines.calls.decide(ctx)
            if pending is not None:
                await pending
            yield
            ctx.status = _OK
            ctx.timings.ended = time.perf_counter()

    @asynccontextmanager
    async def _settled(self, ctx: RequestContext) -> AsyncIterator[None]:
        """The request's work, settled once however it ends: an exception marks it
        failed (or cancelled) first. `generate` writes this out itself: its reply may
        be settled later, after the response (and an async context manager costs a
        generator per request on its hot path)."""
        try:
            yield
        except asyncio.CancelledError as exc:
            raise_cancelled(ctx, exc)
        except BaseException as exc:
            mark_failed(ctx, exc)
            raise
        finally:
            await self.settle(ctx)

    # -- settle ---------------------------------------------------------------------
    def settle_now(self, ctx: RequestContext) -> Awaitable[None] | None:
        """Settle the request (settle.py) unless it was: synchronously unless a stage's
        release must wait (then the rest is in the returned awaitable)."""
        if ctx.finished:
            return None
        ctx.finished = True
        self.active -= 1
        p = self.pipelines
        endpoint = ctx.input.endpoint
        if endpoint == "embeddings":
            return self.settler.settle(ctx, p.embeddings)
        if endpoint == CALL:
            return self.settler.settle(ctx, p.calls)
        return self.settler.settle(ctx, p.counting if endpoint == COUNT else p.generation)

    async def settle(self, ctx: RequestContext) -> None:
        """Release what the request held, charge what it used, write its usage row.
        Runs exactly once per request, whatever way it ended."""
        pending = self.settle_now(ctx)
        if pending is not None:
            await pending

    def settle_after_response(self, ctx: RequestContext) -> Awaitable[None] | None:
        """Settle a request whose reply has been sent (counted until done)."""
        return self.settler.after_response(self.settle_now, ctx)

    async def settled(self, timeout_s: float = 5.0) -> None:
        """Wait until every answered request has been settled (admin reads use this, so
        what a client has seen answered is visible in the ledger and traces)."""
        await self.settler.settled(timeout_s)
