"""The request driver's idempotency step (state/idempotency.py is the store).

It runs before any stage, so a replay costs no limit: it claims the key, replays a
stored reply through the request's reply side (its placeholders take this request's
values), keeps a finished reply masked, and gives the key back when the request did
not succeed. A key is the API key's own and the endpoint's (`scoped`): a replay hands
over a model's output without the stages that check what the caller may use, so it
goes only to the API key that made the request, never to another key of its tenant
(whose `allowed_models`, budget or limits may be narrower); and only to the protocol
that made it, so a chat request's reply is never replayed, translated, to a Messages or
Responses request that decodes to the same internal request. Kept apart from the store, which the schema code imports in every
process (the ledger writer's too), so that import stays small.
"""

from __future__ import annotations

import time

import orjson

from switchyard import outcomes
from switchyard.errors import InvalidRequest
from switchyard.pipeline import CacheOutcome, Pipeline, RequestContext, Status
from switchyard.policy import headers as request_headers
from switchyard.policy.pii import PiiMasker
from switchyard.policy.pii_reply import at_rest, request_session
from switchyard.reply import JsonReply, reply_object, switchyard_headers, through
from switchyard.state.idempotency import IdempotencyStore, StoredReply, body_hash


def scoped(ctx: RequestContext, key: str) -> str:
    """The stored key of a request's `Idempotency-Key`: its API key's id, the endpoint
    the client called and the value, apart by spaces (which neither the endpoint's name
    nor the header's value holds: request_headers.idempotency_key)."""
    return f"{ctx.principal.key_id} {ctx.input.called} {key}"


class Idempotent:
    """The request driver's idempotency step (before any stage, so a replay costs no
    limit): claim the key, replay a stored reply through the reply side, keep a
    finished one (masked), or give the key back when the request did not succeed."""

    def __init__(self, store: IdempotencyStore, masker: PiiMasker, pipeline: Pipeline) -> None:
        self.store = store
        self._masker = masker
        self._pipeline = pipeline  # its reply side restores a replay's placeholders

    async def claim(self, ctx: RequestContext, key: str) -> JsonReply | None:
        """A stored reply for a repeated request, or None once this request owns the key."""
        t = time.perf_counter()
        key = scoped(ctx, request_headers.idempotency_key(key))
        if ctx.stream:
            raise InvalidRequest(
                "Idempotency-Key is supported for non-streaming requests only",
                param="Idempotency-Key",
            )
        stored = await self.store.begin(
            ctx.principal.tenant_id, key, body_hash(ctx.request), ctx.deadline
        )
        if stored is None:
            ctx.idempotency_key = key
            ctx.record(
                "idempotency", outcomes.Idempotency.OWNER, "first request with this key runs", t
            )
            return None
        ctx.status, ctx.cache = Status.OK, CacheOutcome.REPLAY
        ctx.record(
            "idempotency",
            outcomes.Idempotency.REPLAY,
            "returning the stored reply; no upstream call",
            t,
        )
        headers = {
            **stored.headers,
            "x-request-id": ctx.input.request_id,
            "x-switchyard-idempotent-replay": "true",
        }
        sent = through(ctx, self._pipeline.reply_side(ctx), stored.body)
        body = sent if isinstance(sent, bytes) else await sent
        raw = [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in headers.items()]
        return JsonReply(body, raw, status=stored.status)

    async def complete(
        self, ctx: RequestContext, raw_headers: list[tuple[bytes, bytes]], body: bytes
    ) -> None:
        """Keep the reply for repeats of the key: masked (restored from the replaying
        request on replay); never raw values at rest."""
        assert ctx.idempotency_key is not None
        obj = reply_object(body)
        if obj is not None:
            body = orjson.dumps(at_rest(request_session(self._masker, ctx), obj))
        await self.store.complete(
            ctx.principal.tenant_id,
            ctx.idempotency_key,
            StoredReply(200, switchyard_headers(raw_headers), body),
        )
        ctx.idempotency_key = None

    async def release(self, ctx: RequestContext) -> None:
        """Give back a key this request owned and did not complete."""
        if ctx.idempotency_key is not None:
            key, ctx.idempotency_key = ctx.idempotency_key, None
            await self.store.release(ctx.principal.tenant_id, key)
