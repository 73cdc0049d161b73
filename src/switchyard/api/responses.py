"""The OpenAI Responses routes: `POST /v1/responses`, `GET` and `DELETE
/v1/responses/{id}`, `POST /v1/responses/{id}/cancel`, `GET
/v1/responses/{id}/input_items`.

A Responses request is checked by its codec (api/responses_codec.py), continued from
the stored response it names (`previous_response_id`: that response's conversation,
decrypted, goes first, and selection keeps it on the deployment that served that turn
while it is eligible), decoded into the internal chat request and run through the same
driver as a chat completion — keys, limits, budgets, PII, cache, routing, selection,
placement, retries, fallbacks, idempotency keys, tool governance, traces and usage rows
under the endpoint `responses`. The reply becomes a response object or the Responses
event stream (api/responses_reply.py) and, unless `store` is false, is stored for the
tenant, encrypted (state/responses.py).

Background responses (`background: true`) answer `queued` at once and run in this
process, which holds their lease (state/responses.py); `GET` polls them, `cancel` stops
the upstream call. A tenant runs at most `responses.max_background_per_tenant` at once
(429 beyond). This gateway's stop cuts them: failed with the restart reason, their
request recorded cancelled, not an upstream's error.

Reading, deleting and cancelling a stored response, and listing its input items, are
requests of the key's (service.called): held to its and its tenant's rpm before the
store is read, with a decision trace and a usage row (endpoint `responses.retrieve`,
`responses.delete`, `responses.cancel`, `responses.input_items`; no tokens, cost 0).
A continuation's request rate is asked before its stored conversation is read
(`_admit_call`), its tokens, budget and concurrency once it is (the generation's
admit, over the whole conversation). A stored stream whose client leaves before its
end is stored `incomplete`, with the output it had (`_kept`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
from collections.abc import Awaitable, Callable
from dataclasses import replace
from functools import partial
from typing import Any

import orjson
from starlette.datastructures import QueryParams
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from switchyard.api.body import header_map
from switchyard.api.codecs import CHAT_TYPED
from switchyard.api.openai import CTX_KEY, OpenAIRoutes, json_response, stream_response, watched
from switchyard.api.responses_codec import (
    RESPONSE_ID,
    IdPool,
    ResponsesRequest,
    check,
    to_chat,
)
from switchyard.api.responses_reply import (
    ResponseEvents,
    Shell,
    chat_message,
    response_error,
    response_json,
    to_response,
)
from switchyard.api.sse import replayed, translated
from switchyard.errors import (
    BackgroundLimitReached,
    ContextLengthExceeded,
    InternalError,
    InvalidRequest,
    NotFound,
    StoredResponseUnreadable,
    SwitchyardError,
)
from switchyard.gateway import Gateway
from switchyard.identity import Limits, Principal
from switchyard.pipeline import CALL, RequestContext
from switchyard.policy.admit import principal_scopes
from switchyard.policy.stages import Reserver
from switchyard.policy.validate import validate_chat
from switchyard.reply import (
    JsonReply,
    StreamReply,
    relay,
    served_headers,
    stream_chunks,
    translated_reply,
)
from switchyard.request import Generation, from_object
from switchyard.service import ReadBody
from switchyard.settle import CLIENT_CANCEL, mark_failed
from switchyard.state.responses import ORPHAN_REASON, STOPPING, ResponseStore, StoredResponse
from switchyard.state.sealing import SealError

log = logging.getLogger("switchyard.api")
DONE = ("completed", "failed", "incomplete", "cancelled")
# How long an id not found is looked for again: another gateway on the database commits
# a response within milliseconds of its reply (state/responses.py, written behind).
SETTLE_S = 0.25
# Only an id made this recently is waited for (its time: IdPool.timed): any other is in
# the database if it exists at all, so a miss on a made-up or old id costs one read.
RECENT_MS = 10_000


def settle_s(rid: str, now_ms: int) -> float:
    """How long a lookup of the response `rid` waits for another gateway's commit:
    SETTLE_S if the id's first 12 hex digits are a time within RECENT_MS of `now_ms`
    (clocks of gateways may differ by a second), else none."""
    try:
        made = int(rid[5:17], 16)
    except ValueError:
        return 0.0
    return SETTLE_S if now_ms - RECENT_MS <= made <= now_ms + 1000 else 0.0


# How often a background response looks whether another gateway cancelled it.
CANCEL_POLL_S = 1.0
# The decoded chat request and the chat body's bytes (None: not exactly it).
Wire = tuple[Generation, bytes | None]
# The stage a continuation's call is admitted under, before its stored conversation is
# read (the generation's `admit` reserves its tokens and budget afterwards).
ADMIT_CALL = "admit_call"
# Why a stored stream whose client left before its end is `incomplete`.
CLIENT_LEFT = "client_disconnected"


def _rate(p: Principal) -> tuple[Principal, Principal]:
    """`p`'s two views for the limits (its other members shared): (its key's and
    tenant's rpm alone: what a call that generates nothing is held to, a stored
    response's read or a continuation's before its conversation is read; its limits
    less the rpm: what a continuation generates as once its call was counted, so it is
    counted once)."""
    key, tenant = p.key_limits, p.tenant_limits
    return (
        replace(p, key_limits=Limits(rpm=key.rpm), tenant_limits=Limits(rpm=tenant.rpm)),
        replace(p, key_limits=replace(key, rpm=None), tenant_limits=replace(tenant, rpm=None)),
    )


def _names_input(exc: ContextLengthExceeded) -> None:
    """A refusal of the prompt's length names the Responses request's `input`: the
    window check and the engine's refusal (engines/upstream.py) name the member of the
    chat body the request was sent as, `messages`."""
    if exc.param == "messages":
        exc.param = "input"
        exc.message = exc.message.replace("shorten the messages", "shorten the input")


def _not_found(rid: str) -> NotFound:
    """The 404 of an id not found; the id is repeated only when it is made of an id's
    characters (a path may carry control characters, line breaks, bidi overrides)."""
    if _ID_CHARS.fullmatch(rid[:80]):
        return NotFound(f"no response with id '{rid[:80]}'", param="response_id")
    return NotFound("no response with that id", param="response_id")


# The characters of an id, repeated in a 404 (anything else is not).
_ID_CHARS = re.compile(r"[A-Za-z0-9_.:\-]*")
# `include` values the read routes honour: the input items' image URLs, which a stored
# response's input items always hold. Any other is refused, as on `POST` (codec).
INCLUDABLE = frozenset({"message.input_image.image_url"})
# A `limit` as written in a query: digits alone (not Python's `int`: `+5`, `1_0`, ` 5`).
_LIMIT = re.compile(r"[0-9]{1,4}")


def _include(q: QueryParams) -> None:
    """A 400 naming `include` for a value the routes cannot honour (the SDK sends the
    list as `include[]`; `include` repeated is read the same)."""
    for name in ("include", "include[]"):
        for value in q.getlist(name):
            if value and value not in INCLUDABLE:
                raise InvalidRequest(
                    "'include' may only name message.input_image.image_url here",
                    param="include",
                )


def _retrieve_query(q: QueryParams) -> None:
    """`GET /v1/responses/{id}`'s query: `stream` (a background response's events
    replayed) is not served here, so it is refused rather than answered as JSON a
    streaming client reads as an empty stream."""
    stream = q.get("stream")
    if stream is not None and stream.lower() not in ("", "false", "0"):
        raise InvalidRequest(
            "'stream' is not supported when retrieving a response: poll it without 'stream'",
            param="stream",
        )
    _include(q)


class ResponsesRoutes:
    """The Responses routes, beside the OpenAI chat routes (whose reader they share)."""

    def __init__(self, openai: OpenAIRoutes) -> None:
        self.openai = openai
        self.service = openai.service
        self.gw = openai.gw
        self.store: ResponseStore = openai.gw.responses
        self.cap = openai.gw.settings.responses.max_background_per_tenant
        self.running: dict[str, asyncio.Task[None]] = {}  # background responses here
        self.ids = IdPool()  # response and item ids
        # Background responses of each tenant between the cap's check and their commit:
        # counted with the stored ones, so requests racing in together cannot all pass.
        self.starting: dict[str, int] = {}
        # A continuation's call is admitted through the limiter the stages share (the
        # gateway's; None: no limiter to ask, as for a gateway of another kind).
        gw = openai.gw
        self.reserver = (
            Reserver(gw.limiter, gw.settings, gw.store.spent_since, gw.counters, gw.full)
            if isinstance(gw, Gateway)
            else None
        )
        # Each principal seen lately and its views for the limits (`_rate`): the same
        # objects for each of its requests, so the stages' caches by principal hold.
        self._views_of: dict[int, tuple[Principal, tuple[Principal, Principal]]] = {}

    def routes(self) -> list[Route]:
        return [
            Route("/v1/responses", self.create, methods=["POST"]),
            Route("/v1/responses/{response_id}", self.retrieve, methods=["GET", "DELETE"]),
            Route("/v1/responses/{response_id}/cancel", self.cancel, methods=["POST"]),
            Route("/v1/responses/{response_id}/input_items", self.input_items, methods=["GET"]),
        ]

    async def _principal(self, headers: dict[str, str]) -> Principal:
        principal = self.service.auth.authenticate(headers)  # before any costly work
        if not isinstance(principal, Principal):
            principal = await principal
        return principal

    async def _fetch(self, tenant_id: str, rid: str) -> StoredResponse | None:
        """A stored response of the tenant (one another gateway just wrote is waited for
        briefly: `settle_s`); one that does not open is the operator's problem (logged),
        told to the client in a stable message."""
        try:
            return await self.store.get(tenant_id, rid, settle_s(rid, int(time.time() * 1000)))
        except SealError as exc:
            log.error("%s", exc)
            raise StoredResponseUnreadable(
                f"the stored response '{rid}' cannot be read with this gateway's key; "
                "see the gateway log"
            ) from None

    # -- create -------------------------------------------------------------------------
    async def _decode(
        self, request: Request, headers: dict[str, str], ctx: RequestContext
    ) -> tuple[ResponsesRequest, Wire, list[dict[str, Any]]]:
        """The body read (bounded as every model route's), checked, continued from the
        response it names, and decoded: (the Responses request, the chat request with
        the chat body's bytes, the conversation it ends with, before this turn's
        output). The bytes stand for the chat request as a client's own bytes do on
        the chat route (service.py's `ctx.wire`): the stages and the upstream call use
        them as they are, rather than serialising the request again (twice)."""
        parsed, _ = await self.openai.reader(request, headers, None)(ctx.remaining_s())
        req = check(parsed, self.ids)
        if req.store:  # before any model call: a store that cannot take it refuses now
            self.store.check_room()
        history: list[dict[str, Any]] = []
        if req.previous_response_id is not None:
            await self._admit_call(ctx)  # before the store is read
            prev = await self._fetch(ctx.principal.tenant_id, req.previous_response_id)
            if prev is None:
                raise NotFound(
                    f"no stored response '{req.previous_response_id}' to continue",
                    param="previous_response_id",
                )
            if prev.status not in ("completed", "incomplete"):
                raise InvalidRequest(
                    f"the response '{prev.id}' is {prev.status}: only a finished response "
                    "can be continued",
                    param="previous_response_id",
                )
            history = list(prev.body.get("conversation") or [])
            ctx.previous = (prev.id, prev.deployment)
        chat = to_chat(req, history)
        validate_chat(chat)  # the internal model's own invariants
        gen: Generation
        gen, exact = from_object(Generation, chat, CHAT_TYPED)
        return req, (gen, orjson.dumps(chat) if exact else None), history + req.messages

    def _views(self, p: Principal) -> tuple[Principal, Principal]:
        """`_rate(p)`, made once per principal."""
        held = self._views_of.get(id(p))
        if held is None or held[0] is not p:
            if len(self._views_of) >= 4096:
                self._views_of.clear()
            held = self._views_of[id(p)] = (p, _rate(p))
        return held[1]

    async def _admit_call(self, ctx: RequestContext) -> None:
        """A continuation's call, admitted before its stored conversation is read: the
        key's and tenant's rpm asked for one request (a 429 with Retry-After past it,
        recorded under ADMIT_CALL), and counted. It then generates as its principal
        less its rpm, so the generation's admit reserves the whole conversation's
        tokens, cost and a concurrency slot and does not count the request again."""
        p = ctx.principal
        if self.reserver is None or (p.key_limits.rpm is None and p.tenant_limits.rpm is None):
            return
        rate, rest = self._views(p)
        await self.reserver.reserve(ctx, principal_scopes(rate), ADMIT_CALL, (0, 0, None))
        pending = self.reserver.settle(ctx, ADMIT_CALL)  # an rpm holds nothing to give back
        if pending is not None:
            await pending
        ctx.principal = rest

    async def create(self, request: Request) -> Response:
        """Create a model response (OpenAI Responses API): stored, continued, streamed
        or in the background."""
        received = time.perf_counter()
        headers = header_map(request.scope)
        principal = await self._principal(headers)
        service = self.service
        ctx = service.open("chat.completions", headers, received, principal, api="responses")
        request.scope[CTX_KEY] = ctx  # for the error mapping (app.py)
        try:
            service.begin(ctx)
            req, wire, conversation = await self._decode(request, headers, ctx)
            shell = Shell(self.ids.timed("resp"), req, req.model, ids=self.ids)
            if req.background:
                return await self._background(ctx, req, wire, conversation, shell)
        except BaseException as exc:
            mark_failed(ctx, exc)
            await service.settle(ctx)
            raise

        async def decoded(_: float) -> Wire:
            return wire

        ctx.receive = request.receive  # a wait in the queue ends if the client hangs up
        try:
            reply = await service.generate(ctx, decoded)
        except ContextLengthExceeded as exc:
            _names_input(exc)
            raise
        if isinstance(reply, StreamReply):
            return self._stream(reply, ctx, req, conversation, shell)
        return await self._whole(reply, ctx, req, conversation, shell)

    def _stored(
        self,
        ctx: RequestContext,
        req: ResponsesRequest,
        shell: Shell,
        status: str,
        response: dict[str, Any] | bytes,
        conversation: list[dict[str, Any]],
    ) -> StoredResponse:
        """`response`: the response object in `status`, or its JSON as the client got
        it, kept as those bytes (serialised once for the reply and the store)."""
        dep = ctx.deployment
        return StoredResponse(
            id=shell.rid,
            tenant_id=ctx.principal.tenant_id,
            created_at=shell.created_at,
            status=status,
            model=ctx.alias or req.model,  # the alias routing resolved: checked, bounded
            deployment=dep.name if dep is not None else None,
            previous_response_id=req.previous_response_id,
            background=req.background,
            owner=self.store.owner if req.background else None,
            body={
                "response": orjson.Fragment(response) if isinstance(response, bytes) else response,
                "input_items": req.items,
                "conversation": conversation,
            },
        )

    async def _whole(
        self,
        reply: JsonReply,
        ctx: RequestContext,
        req: ResponsesRequest,
        conversation: list[dict[str, Any]],
        shell: Shell,
    ) -> Response:
        try:
            chat = translated_reply(ctx, reply.body)
            shell.model = _served(ctx, req)
            msg = chat_message(chat)
            status, encoded = response_json(chat, shell, msg)
            if req.store:
                turn = [*conversation, msg]
                await self.store.create(self._stored(ctx, req, shell, status, encoded, turn))
        except BaseException:
            if reply.settle is not None:  # answered upstream: it is still settled
                pending = reply.settle()
                if pending is not None:
                    await pending
            raise
        return json_response(reply, encoded)

    def _stream(
        self,
        reply: StreamReply,
        ctx: RequestContext,
        req: ResponsesRequest,
        conversation: list[dict[str, Any]],
        shell: Shell,
    ) -> Response:
        shell.model = _served(ctx, req)

        async def ended(ev: ResponseEvents) -> None:
            status, final = ev.status, ev.final_json
            if not req.store or status is None or final is None:
                return
            # The output as the chat message the conversation continues from: its
            # messages' text, then its function calls (one pass over the items).
            texts: list[str] = []
            calls: list[dict[str, Any]] = []
            for i in ev.output:
                if i["type"] == "message":  # (a refusal's part has no text: none)
                    texts.append(i["content"][0].get("text", ""))
                elif i["type"] == "function_call" and i["status"] != "incomplete":
                    # (one cut short by its client leaving is not a call to answer)
                    calls.append(
                        {
                            "id": i["call_id"],
                            "type": "function",
                            "function": {"name": i["name"], "arguments": i["arguments"]},
                        }
                    )
            msg: dict[str, Any] = {"role": "assistant", "content": "".join(texts)}
            if calls:
                msg["tool_calls"] = calls
            turn = [*conversation, msg]
            # The client already has its answer: a refusal to store is not its error. A
            # `try` (free until it raises) rather than `contextlib.suppress`, whose context
            # manager is made and entered for every stream (~0.3 us).
            try:
                await self.store.create(self._stored(ctx, req, shell, status, final, turn))
            except SwitchyardError:
                return

        events = ResponseEvents(shell, ended)
        source = reply.source
        if source is not None:
            data = watched(ctx, source).data()  # a worker's death is `engine_crashed`
            content = translated(ctx, relay(ctx, data, reply.side, source.close), events)
        else:
            content = replayed(stream_chunks(reply.cached or {}), events)
        if req.store:  # (the reply is this request's own: set in place, no copy)
            reply.on_close = partial(_kept, events, reply.on_close)
        return stream_response(reply, content, events.error_event)

    # -- background ---------------------------------------------------------------------
    async def _background(
        self,
        ctx: RequestContext,
        req: ResponsesRequest,
        wire: Wire,
        conversation: list[dict[str, Any]],
        shell: Shell,
    ) -> Response:
        """Run the response in the background once it is admitted: every check a
        foreground request passes (key, model, limits, budget, task) comes first, and
        answers as it would there; only an admitted response is stored and answered
        `in_progress` at once."""
        tenant = ctx.principal.tenant_id
        starting = self.starting.get(tenant, 0)
        self.starting[tenant] = starting + 1  # before the first await: no race here
        try:
            if await self.store.active_background(tenant) + starting >= self.cap:
                raise BackgroundLimitReached(
                    f"this tenant already runs {self.cap} background responses "
                    "(responses.max_background_per_tenant); retry when one has finished",
                    headers={"Retry-After": "1"},
                )
            admitted: asyncio.Future[StoredResponse] = asyncio.get_running_loop().create_future()
            task = asyncio.create_task(self._run(ctx, req, wire, conversation, shell, admitted))
            waiting: set[asyncio.Future[Any]] = {task, admitted}
            await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
        finally:
            left = self.starting[tenant] - 1
            if left:
                self.starting[tenant] = left
            else:
                del self.starting[tenant]
        if not admitted.done():  # refused (settled by the driver): answered as it was
            task.result()
            raise InternalError("the background response ended before it was admitted")
        self.running[shell.rid] = task
        task.add_done_callback(lambda _: self.running.pop(shell.rid, None))
        stored = admitted.result()
        self.store.hold(stored, task)  # its lease renewed while it runs; a stop cuts it
        return Response(
            orjson.dumps(stored.body["response"]),
            media_type="application/json",
            headers={"x-request-id": ctx.input.request_id},
        )

    async def _run(
        self,
        ctx: RequestContext,
        req: ResponsesRequest,
        wire: Wire,
        conversation: list[dict[str, Any]],
        shell: Shell,
        admitted: asyncio.Future[StoredResponse],
    ) -> None:
        """A background response: admitted (stored, `in_progress`, and the client
        answered), then run to its end, its state in the store. A refusal before it
        was admitted is raised to the route, which answers it; nothing is stored."""
        holder: list[StoredResponse] = []

        async def decoded(_: float) -> Wire:
            return wire

        async def on_admitted() -> None:
            obj = shell.object("in_progress", [])
            stored = self._stored(ctx, req, shell, "in_progress", obj, conversation)
            await self.store.create(stored)
            await self.store.drain()  # committed: every gateway counts it, answers its GET
            holder.append(stored)
            admitted.set_result(stored)

        read: ReadBody = decoded
        try:
            reply = await self._cancellable(
                self.service.generate(ctx, read, on_admitted), lambda: holder
            )
            if not holder:  # answered without admission (an idempotent replay)
                await on_admitted()
            stored = holder[0]
            if reply is None:
                return  # cancelled or deleted through another gateway: left so
            assert isinstance(reply, JsonReply)
            if reply.settle is not None:
                pending = reply.settle()
                if pending is not None:
                    await pending
            chat = orjson.loads(reply.body)
            chat = chat if isinstance(chat, dict) else {}
            shell.model = _served(ctx, req)
            obj = to_response(chat, shell)
            now = await self.store.get(stored.tenant_id, stored.id)
            if now is None or now.status in DONE:
                return  # cancelled, deleted or failed meanwhile (elsewhere): left so
            stored.status = obj["status"]
            stored.deployment = ctx.deployment.name if ctx.deployment is not None else None
            stored.body = {
                "response": obj,
                "input_items": req.items,
                "conversation": [*conversation, chat_message(chat)],
            }
            await self.store.update(stored)
        except asyncio.CancelledError as exc:
            if not holder:
                raise
            stored = holder[0]
            if exc.args and exc.args[0] == STOPPING:  # this gateway's stop: not the client's
                stored.status = "failed"
                error = {"code": "server_error", "message": ORPHAN_REASON}
                stored.body["response"] = shell.object("failed", [], error=error)
            else:
                stored.status = "cancelled"
                stored.body["response"] = shell.object("cancelled", [])
            with contextlib.suppress(Exception):
                await self.store.update(stored)
        except Exception as exc:
            if isinstance(exc, ContextLengthExceeded):
                _names_input(exc)
            if not holder:
                raise  # refused before it was admitted: the route answers it
            stored = holder[0]
            err = exc if isinstance(exc, SwitchyardError) else None
            if err is None:
                log.exception("background response %s failed", stored.id)
            error = response_error(err)  # OpenAI's codes for a response's error
            stored.status = "failed"
            stored.body["response"] = shell.object("failed", [], error=error)
            with contextlib.suppress(Exception):
                await self.store.update(stored)

    async def _cancellable(self, work: Any, stored: Any) -> Any:
        """`work`'s result, or None once another gateway on the store cancelled, deleted
        or failed the response (its lease lapsed: looked for every CANCEL_POLL_S once it
        is stored, `stored()` lists it): the work is cancelled then, so its upstream call
        stops wherever the cancel was asked."""
        task = asyncio.ensure_future(work)
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=CANCEL_POLL_S)
                if done:
                    return task.result()
                held = stored()
                if not held:
                    continue
                now = await self.store.get(held[0].tenant_id, held[0].id)
                if now is None or now.status in DONE:
                    break
        except BaseException:
            task.cancel(CLIENT_CANCEL)  # this gateway's cancel (or its stop)
            with contextlib.suppress(BaseException):
                await task
            raise
        task.cancel(CLIENT_CANCEL)
        with contextlib.suppress(BaseException):
            await task
        return None

    # -- reading, deleting, cancelling ------------------------------------------------------
    async def _on_stored(
        self,
        request: Request,
        api: str,
        work: Callable[[StoredResponse], Awaitable[bytes]],
        query: Callable[[QueryParams], None] | None = None,
    ) -> Response:
        """`work` on the stored response the path names, in a request of the key's
        (`api`: the endpoint its trace and usage row name) admitted as one call before
        the store is read (service.called); its JSON answered with the request's id
        and rate headers."""
        received = time.perf_counter()
        headers = header_map(request.scope)
        principal = await self._principal(headers)
        service = self.service
        ctx = service.open(CALL, headers, received, principal, api=api)
        request.scope[CTX_KEY] = ctx  # for the error mapping (app.py)
        # Held to its rpm alone: not to a concurrency its background responses may
        # hold (their poll and cancel would wait on themselves), nor a spent budget.
        ctx.principal = self._views(principal)[0]
        async with service.called(ctx):
            if query is not None:  # before the store is read
                query(request.query_params)
            rid = request.path_params["response_id"]
            if not RESPONSE_ID.fullmatch(rid):
                raise _not_found(rid)
            stored = await self._fetch(principal.tenant_id, rid)
            if stored is None:
                raise _not_found(rid)
            body = await work(stored)
        return Response(body, media_type="application/json", headers=served_headers(ctx))

    async def retrieve(self, request: Request) -> Response:
        """GET: a stored response of the key's tenant (poll a background one here);
        DELETE: delete it (a background one still running is cancelled first)."""
        if request.method == "DELETE":
            return await self._on_stored(request, "responses.delete", self._delete)
        return await self._on_stored(request, "responses.retrieve", _response_json, _retrieve_query)

    async def _delete(self, stored: StoredResponse) -> bytes:
        task = self.running.get(stored.id)
        if task is not None:
            task.cancel()
        await self.store.delete(stored.tenant_id, stored.id)
        return orjson.dumps({"id": stored.id, "object": "response.deleted", "deleted": True})

    async def cancel(self, request: Request) -> Response:
        """Cancel a background response: its upstream call stops; it ends `cancelled`."""
        return await self._on_stored(request, "responses.cancel", self._cancel)

    async def _cancel(self, stored: StoredResponse) -> bytes:
        if not stored.background:
            raise InvalidRequest("only a background response can be cancelled", param="response_id")
        if stored.status not in DONE:
            task = self.running.get(stored.id)
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await asyncio.wait_for(asyncio.shield(task), 5)
            now = await self._fetch(stored.tenant_id, stored.id)
            stored = now if now is not None else stored
            if stored.status not in DONE:  # run by another process: marked, it stops there
                stored.status = "cancelled"
                obj = dict(stored.body.get("response") or {})
                obj["status"] = "cancelled"
                stored.body["response"] = obj
                await self.store.update(stored)
        return orjson.dumps(stored.body["response"])

    async def input_items(self, request: Request) -> Response:
        """The input items of a stored response (`limit` 1-100, `order` asc|desc;
        `after`, `before`: an item id, the page starting after it or ending before it;
        each id is one item's, as `check` refuses repeats; `include`: `INCLUDABLE`)."""
        q = request.query_params

        async def page_of(stored: StoredResponse) -> bytes:
            raw = q.get("limit", "20")
            limit = int(raw) if _LIMIT.fullmatch(raw) else 0
            if not 1 <= limit <= 100:
                raise InvalidRequest("'limit' must be an integer from 1 to 100", param="limit")
            order = q.get("order", "desc")
            if order not in ("asc", "desc"):
                raise InvalidRequest("'order' must be asc or desc", param="order")
            items = list(stored.body.get("input_items") or [])
            if order == "desc":
                items.reverse()
            after, before = q.get("after"), q.get("before")
            if after is not None:
                items = items[_position(items, after, "after") + 1 :]
            if before is not None:
                items = items[: _position(items, before, "before")]
            # `before`: the page nearest the item it names, still in the order asked
            page = items[-limit:] if before is not None else items[:limit]
            out = {
                "object": "list",
                "data": page,
                "first_id": page[0]["id"] if page else None,
                "last_id": page[-1]["id"] if page else None,
                "has_more": len(items) > limit,
            }
            return orjson.dumps(out)

        return await self._on_stored(request, "responses.input_items", page_of, _include)


async def _response_json(stored: StoredResponse) -> bytes:
    return orjson.dumps(stored.body["response"])


async def _kept(events: ResponseEvents, close: Callable[[], Awaitable[None]]) -> None:
    """A stored stream's end, however it ended (its `on_close`, before the request's
    own `close`): one that did not reach its end nor a failure (its client left, the
    relay cancelled or closed between events) is stored as it stands, `incomplete` with
    the output so far (ResponseEvents.interrupted), so a GET finds what the client was
    sent and a continuation can go on from it."""
    try:
        if not events.closed:
            if events.status is None:
                events.interrupted(CLIENT_LEFT)
            await events.ended()
    except Exception:  # no one to tell: the operator's log
        log.exception("could not store response %s", events.shell.rid)
    finally:
        await close()


def _position(items: list[dict[str, Any]], cursor: str, param: str) -> int:
    """Where the item a cursor (`after`, `before`) names is among `items`."""
    for k, item in enumerate(items):
        if item.get("id") == cursor:
            return k
    raise InvalidRequest(f"'{param}' names no item of this response", param=param)


def _served(ctx: RequestContext, req: ResponsesRequest) -> str:
    dep = ctx.deployment
    return dep.alias if dep is not None else (ctx.alias or req.model)
