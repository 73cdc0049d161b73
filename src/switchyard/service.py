"""The request driver, for every endpoint: open → validate → idempotency → the
pipeline's stages → execute → the reply side → settle.

`api/` reads the body within the HTTP boundary's limits, decodes it with its protocol's
codec (api/codecs.py) into the typed request (request.py) and turns the `Reply`
(reply.py) into a response. The decisions, and what each does on the reply's way out
and on release, are the pipeline's stages; settling (settle.py) runs exactly once.
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

from switchyard import outcomes
from switchyard.config import Settings
from switchyard.decide.cache import Entry
from switchyard.decide.stages_select import admit_model, admit_pin
from switchyard.engines.token_ids import attached
from switchyard.errors import ModelNotFound
from switchyard.execute.embeddings import Embeddings
from switchyard.execute.executor import Executor
from switchyard.execute.idempotent import Idempotent
from switchyard.identity import Principal
from switchyard.outcomes import Validate
from switchyard.pipeline import Pipeline, Pipelines, RequestContext, RequestIds, Status
from switchyard.policy import headers as request_headers
from switchyard.policy.admit import FullWindows
from switchyard.policy.auth import Authenticator
from switchyard.policy.validate import model_refusal, split_pin
from switchyard.reply import (
    JsonReply,
    Reply,
    StreamReply,
    answered_headers,
    served_headers,
    served_raw_headers,
    through,
)
from switchyard.request import Embedding, Generation
from switchyard.settle import Settler, mark_failed, raise_cancelled

if TYPE_CHECKING:
    from switchyard.observe.otel import Tracing

VALIDATED, _OK = Validate.OK, Status.OK  # read once: via its class costs a lookup

# Reads and decodes the body within seconds: (the typed request, its exact bytes or None).
ReadBody = Callable[[float], Awaitable[tuple[Any, bytes | None]]]


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
    # RL-managed aliases' revision managers: a pin on one is checked against its lease.
    rl_aliases: Mapping[str, Any] = field(default_factory=dict)
    on_open: Callable[[RequestContext], None] | None = None  # a worker's in-flight journal
    # The rpm windows the reservers found full (policy/admit.py): `begin` refuses a
    # request of such a key or tenant before its body is read.
    full: FullWindows = field(default_factory=FullWindows)

    def __post_init__(self) -> None:
        s = self.settings
        self._deadline_s = s.server.default_deadline_s  # read per request: a plain attribute
        self._models = {m.alias: m for m in s.models}  # for `alias@revision` pins
        self._countable = set(self._models) | {a.name for a in s.adapters}

    # -- opening a request (its caller is authenticated first: `auth.authenticate`) --
    def open(
        self,
        endpoint: str,
        headers: Mapping[str, str],
        received: float,
        principal: Principal,
        api: str | None = None,
    ) -> RequestContext:
        """The request's context, once its caller is known (headers read, bounded, by
        policy/headers.py). `api`: the endpoint as called, decoded into `endpoint`'s."""
        deadline = received + self._deadline_s
        ids = self.request_ids()
        ctx = request_headers.opened(ids, endpoint, headers, received, deadline, principal, api)
        if self.tracing is not None:  # its wall-clock start
            wall = time.time_ns() - int((time.perf_counter() - received) * 1e9)
            self.tracing.start_request(ctx, headers, wall)
        (outcome, reason), evidence = self.auth.verdict(principal)
        ctx.record("authenticate", outcome, reason, received, evidence)
        self.active += 1
        if self.on_open is not None:
            self.on_open(ctx)
        return ctx

    def begin(self, ctx: RequestContext) -> None:
        """Its headers' and its own deadline's checks (policy/headers.py), then, before
        its body is read, whether its key's or tenant's rpm window is known full (a
        refusal the limiter gave another request of theirs: policy/admit.py
        `FullWindows`): 429 as admission would answer, recorded as its decision."""
        request_headers.begin(ctx, self._deadline_s)
        if self.full.until and ctx.principal is not None:  # nearly always empty
            now = time.time()
            refused = self.full.refused(ctx.principal, now)
            if refused is not None:
                exc, scope, left = refused
                ctx.record(
                    "admit",
                    outcomes.reject("rpm"),
                    f"rpm limit of {scope}: its window is full for {left:.3f}s more "
                    "(refused before the body is read)",
                    time.perf_counter(),
                    {"scope": scope, "retry_after_s": round(left, 3)},
                )
                raise exc

    def _alias(self, ctx: RequestContext, model: str) -> str:
        """The alias a request's `model` names; `alias@revision` pins a revision."""
        if "@" not in model:
            return model
        alias, ctx.pin = split_pin(model, self._models, self.rl_aliases)
        ctx.alias = alias  # a refusal's row names it
        admit_pin(ctx, time.perf_counter())  # may the key pin: before any costly work
        return alias

    @staticmethod
    async def _decided(ctx: RequestContext, pipeline: Pipeline) -> None:
        pending = pipeline.decide(ctx)
        if pending is not None:
            await pending

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
        """Settled exactly once: here on a refusal or error, after the reply once it is
        handed over. `admitted` is awaited once every check has passed, before the
        upstream call or a cache hit's reply (a background response is stored then)."""
        handed_off = False
        try:
            self.begin(ctx)
            req, raw = await read(ctx.remaining_s())  # decoded and shape-checked
            ctx.alias = self._alias(ctx, req.model)
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
            if ctx.response is None and (refused := model_refusal(ctx)) is not None:
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
        ctx.succeeded()
        if reply.obj is not None:  # parsed by the upstream client: settling reads this
            usage = reply.obj.get("usage")
            ctx.run.usage = usage if isinstance(usage, dict) else None
        ids = ctx.generation.return_token_ids  # an engine's token ids, asked for
        body = await attached(
            reply.body, ctx.deployment, ids, ctx.input.endpoint, ctx.remaining_s()
        )
        sent = through(ctx, self.pipelines.generation.reply_side(ctx), body)
        body = sent if isinstance(sent, bytes) else await sent
        raw_headers = served_raw_headers(ctx)
        if ctx.idempotency_key is not None:
            await self.idempotent.complete(ctx, raw_headers, body)
        self.settler.pending += 1  # settled after the response, counted until done
        after = partial(self.settler.after_response, self.settle_now, ctx)
        return JsonReply(body, raw_headers, after)

    async def _cached(self, ctx: RequestContext, entry: Entry) -> Reply:
        """A cache hit, through the reply side, as JSON or replayed as a stream."""
        ctx.status = _OK
        ctx.timings.ended = ctx.timings.client_first_byte = time.perf_counter()
        obj = orjson.loads(entry.body)
        side = self.pipelines.generation.reply_side(ctx)
        if side is not None:
            obj = await side.whole(obj)
        keys = entry.keys  # what answered it (a routed alias's route model), and its revision
        answered = answered_headers(keys.answered_model or ctx.alias or "", keys.answered_revision)
        raw = served_raw_headers(ctx) + answered
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
            req, raw = await read(ctx.remaining_s())  # decoded and shape-checked
            texts = self.embeddings_run.validate(ctx, req)
            self._validated(ctx, req, raw)
            await self._decided(ctx, self.pipelines.embeddings)
            out = await self.embeddings_run.run(ctx, texts)
            ctx.succeeded()
            return JsonReply(orjson.dumps(out), served_raw_headers(ctx))

    # -- counting a request's tokens -----------------------------------------------------
    async def counted(
        self, ctx: RequestContext, read: ReadBody, count: Callable[[Generation], int]
    ) -> int:
        """`count` of the request (its input tokens), once its model passes a generation's
        rules (the key's, and Select's for its pin and regions) and its limits admit it as
        one request (rpm, concurrency; no tokens, no cost). Nothing goes upstream."""
        async with self._settled(ctx):
            req, raw = await read(ctx.remaining_s())  # decoded and shape-checked
            ctx.alias = alias = self._alias(ctx, req.model)
            if alias not in self._countable:
                raise ModelNotFound(f"the model '{alias[:128]}' does not exist", param="model")
            self._validated(ctx, req, raw)
            await self._decided(ctx, self.pipelines.counting)
            ex = self.executor  # Select's rules, which this pipeline has no stage for
            admit_model(
                ctx,
                ex.balancers.get(alias),
                ex.registry.get(alias),
                time.perf_counter(),
                self.rl_aliases.get(alias),  # an RL-managed model's pin: its active revision
            )
            n = count(req)
            ctx.succeeded()
            return n

    # -- a call that names no model --------------------------------------------------------
    @asynccontextmanager
    async def called(self, ctx: RequestContext) -> AsyncIterator[None]:
        """The work of a request opened as CALL (a stored response read, deleted,
        cancelled), once its limits admit it as one call (no tokens, no cost)."""
        async with self._settled(ctx):
            await self._decided(ctx, self.pipelines.calls)
            yield
            ctx.succeeded()

    @asynccontextmanager
    async def _settled(self, ctx: RequestContext) -> AsyncIterator[None]:
        """Its headers' checks, then its work, settled once however it ends (`generate`
        writes it out: its reply may settle after the response; this costs a generator)."""
        try:
            self.begin(ctx)
            yield
        except asyncio.CancelledError as exc:
            raise_cancelled(ctx, exc)
        except BaseException as exc:
            mark_failed(ctx, exc)
            raise
        finally:
            await self.settle(ctx)

    def settle_now(self, ctx: RequestContext) -> Awaitable[None] | None:
        """Settle the request (settle.py) unless it was: synchronously unless a stage's
        release must wait (then the rest is in the returned awaitable)."""
        if ctx.finished:
            return None
        ctx.finished = True
        self.active -= 1
        return self.settler.settle(ctx, self.pipelines.of(ctx.input.endpoint))

    async def settle(self, ctx: RequestContext) -> None:
        """Release, charge and record the request, exactly once however it ended."""
        pending = self.settle_now(ctx)
        if pending is not None:
            await pending
