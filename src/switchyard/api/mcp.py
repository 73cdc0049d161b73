"""`/mcp`: the MCP tool gateway's endpoint (Streamable HTTP, with sessions).

The transport is the official `mcp` SDK's (`StreamableHTTPSessionManager` over a
low-level `Server`): sessions, protocol-version negotiation (the handshake revisions
and 2026-07-28's per-request envelope), SSE or JSON replies and JSON-RPC framing are the
SDK's, so they follow the specification as the SDK does. In front of it, this module
does what the SDK does not:

* authentication with the gateway's API keys (`Authorization: Bearer`), before the
  SDK reads the body: a refused key is a 401 with a JSON-RPC error body;
* a session belongs to the key that opened it: another key naming its
  `Mcp-Session-Id` gets 404, as for a session that does not exist;
* the request's headers (`x-task-id`, `x-switchyard-call-id`, `x-switchyard-approval`,
  `x-request-timeout`, `x-parent-request-id`, and `x-task-budget`, `x-task-timeout`,
  `x-task-deadline` for a task whose first step is a tool call) are read and bounded
  once, into a `Caller` the handlers get;
* every error a handler meets is a JSON-RPC error with the code and data of
  errors.py's table: never exception text.

`tools/list` and `tools/call` go to the tool service (mcp_service/).

**The hot call is served here, not by the SDK.** A `tools/call` on an open session
(its `Mcp-Session-Id` owned by the caller, a handshake protocol version, a JSON body) is
answered in this request's own task: parse the body, validate the params with the SDK's
own model (`CallToolRequestParams`), call the tool service, write the JSON-RPC reply. The
service hands the result to the reply (`Caller.answer`) before it records the call (its
trace, usage row and metrics, with the PII masking of their excerpts), so that work is
off the client's wait.
Through the SDK the same call crosses memory streams into the session's dispatcher, a
handler task and back, which cost more per call than the governance itself (measured:
docs/benchmarks/2026-12-05-mcp-tools.md). The framing written by hand is one JSON-RPC
response object, `{"jsonrpc", "id", "result" | "error"}`; what is read is bounded:

* the body, at `server.max_body_bytes` (413 with a JSON-RPC error, as the SDK's);
* only a request whose every field is as the specification has it takes this path: a
  `jsonrpc` of "2.0", an `id` that is an integer within ±2^53 or a string of at most
  MAX_ID characters, `method` "tools/call", `params` an object the SDK's model accepts,
  and no other member. Anything else (malformed JSON, a batch, another method, a
  notification, a wrong type, an oversized id) goes to the SDK unchanged, which answers
  it as before, errors reworded without exception text; but a request whose `id` is
  null, a boolean, an object or an array (MCP's ids are strings or integers) is
  answered here, 400 with JSON-RPC's Invalid Request (-32600, id null): the SDK takes it
  for a notification and answers nothing;
* `notifications/cancelled` for a call this path serves cancels it (the SDK's answer to
  a cancelled request, `REQUEST_CANCELLED`, goes back on the call's POST); for any other
  request it goes to the SDK, whose request it is;
* the session stays the SDK's: it is opened, negotiated, listed, closed and expired by
  the SDK, and a call here holds it open while it runs, as the SDK's own requests do.

The SDK's transport internals this path reads (the session table, a transport's idle
bookkeeping) are checked once per request; where they are missing (another SDK
release), every request takes the SDK's path.

The fast path's wire (headers into a `Caller`, the bounded body, the JSON-RPC reply and
error bodies, the SDK's refusals reworded) is api/mcp_wire.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import AsyncIterator, Awaitable
from typing import Any

import orjson
from starlette.types import Message, Receive, Scope, Send

from switchyard.api.mcp_wire import (
    INVALID_ID,
    _caller,
    _fast_headers,
    _FastCall,
    _headers,
    _holding,
    _id_or_none,
    _mcp_error,
    _meta,
    _plain_id,
    _read_body,
    _replay,
    _send_error,
    _send_json,
    _without_exception_text,
)
from switchyard.errors import (
    InternalError,
    InvalidRequest,
    PayloadTooLarge,
    SessionNotFound,
    SwitchyardError,
    TooManySessions,
)
from switchyard.identity import ANONYMOUS, Principal
from switchyard.mcp_service import Caller, McpToolService
from switchyard.policy.auth import Authenticator

log = logging.getLogger("switchyard.mcp")
PATH = "/mcp"
CALLER_KEY = "switchyard.caller"
MAX_SESSION_ID = 128
MAX_OWNERS = 100_000  # sessions remembered (the SDK closes idle ones after 30 min)
# Sessions one key may hold open: the SDK's limit (10 000) is for all keys together, so
# one key alone must not fill it and leave every other tenant refused.
MAX_SESSIONS_PER_KEY = 100
REQUEST_CANCELLED = -32800  # the SDK's answer on a cancelled request's own stream (2025 era)
FAST_MEMBERS = frozenset({"jsonrpc", "id", "method", "params"})


class McpEndpoint:
    """The ASGI app at `/mcp` (see the module docstring)."""

    def __init__(
        self,
        service: McpToolService,
        auth: Authenticator,
        max_body_bytes: int,
        auth_disabled: bool = False,
    ) -> None:
        from mcp.server.lowlevel import Server
        from mcp.server.streamable_http_manager import StreamableHTTPSessionManager
        from mcp.server.transport_security import TransportSecuritySettings

        self.service = service
        self.auth = auth
        self.auth_disabled = auth_disabled  # auth.mode: disabled (local experiments only)
        self.server: Any = Server(
            "switchyard",
            version="1",
            instructions="Tools of the MCP servers behind this Switchyard gateway, as <server>__<tool>.",
            on_list_tools=self._list_tools,
            on_call_tool=self._call_tool,
        )
        # Callers authenticate with a bearer key (never a cookie), so a page a DNS
        # rebinding attack loads cannot use a session: the gateway may serve any host name.
        self.manager = StreamableHTTPSessionManager(
            app=self.server,
            json_response=True,
            security_settings=TransportSecuritySettings(enable_dns_rebinding_protection=False),
            max_request_body_size=max_body_bytes,
        )
        self._owners: dict[str, str] = {}  # session id -> the key id that opened it
        self._held: dict[str, set[str]] = {}  # key id -> the sessions it opened
        self._opening: dict[str, int] = {}  # key id -> its requests that may open one now
        self.max_body_bytes = max_body_bytes
        from mcp_types.version import HANDSHAKE_PROTOCOL_VERSIONS

        self._versions: tuple[str, ...] = tuple(HANDSHAKE_PROTOCOL_VERSIONS)
        # The fast path's calls in flight: (session, JSON-RPC id) -> the call.
        self._calls: dict[tuple[str, Any], _FastCall] = {}

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[None]:
        async with self.manager.run():
            yield

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        try:
            principal, h = await self._authenticate(scope)
            session = h.get("mcp-session-id")
            if session is not None:
                owner = self._owners.get(session) if len(session) <= MAX_SESSION_ID else None
                if owner != principal.key_id:
                    raise SessionNotFound("no such MCP session")
            scope[CALLER_KEY] = _caller(principal, h)
            opening = session is None and scope["method"] == "POST"  # may open a session
            if opening:
                self._check_room(principal.key_id)
        except SwitchyardError as exc:
            await _send_error(send, exc)
            return
        key_id = principal.key_id
        refused: Message | None = None  # the SDK's 400 or 413, held to reword its body

        async def remember_session(message: Message) -> None:
            nonlocal refused
            if message["type"] == "http.response.start":
                # A refusal names the session it opened and closed at once: not kept,
                # so refusals cannot push the owners of open sessions out.
                kept = message["status"] < 400
                for k, v in message.get("headers", []) if kept else ():
                    if k.lower() == b"mcp-session-id":
                        if len(self._owners) >= MAX_OWNERS:
                            self._forget(next(iter(self._owners)))
                        sid = v.decode("latin-1")
                        self._owners[sid] = key_id
                        self._held.setdefault(key_id, set()).add(sid)
                if message["status"] in (400, 413):
                    refused = message
                    return
            elif refused is not None and message["type"] == "http.response.body":
                start, refused = refused, None
                if not message.get("more_body"):
                    body = _without_exception_text(start["status"], message.get("body", b""))
                    headers = [
                        (k, v)
                        for k, v in start["headers"]
                        if k.lower() not in (b"content-length", b"content-type")
                    ]
                    headers.append((b"content-type", b"application/json"))
                    headers.append((b"content-length", str(len(body)).encode()))
                    await send({**start, "headers": headers})
                    await send({**message, "body": body})
                    return
                await send(start)
            await send(message)

        if scope["method"] == "DELETE" and session is not None:
            self._forget(session)
            for key in [k for k in self._calls if k[0] == session]:
                self._calls[key].cancel()  # the session ends: its calls with it
        if session is not None and scope["method"] == "POST":
            transport = self._live(session)
            if transport is not None and _fast_headers(h, self._versions):
                body = await _read_body(receive, self.max_body_bytes)
                if body is False:  # the client went away: no one to answer
                    return
                if body is True:
                    too_large = PayloadTooLarge(
                        "the request body is larger than the gateway accepts"
                    )
                    await _send_error(send, too_large)
                    return
                if await self._serve_fast(send, body, session, transport, scope[CALLER_KEY]):
                    return
                receive = _replay(body, receive)
        if not opening:
            await self.manager.handle_request(scope, receive, remember_session)
            return
        self._opening[key_id] = self._opening.get(key_id, 0) + 1
        try:
            await self.manager.handle_request(scope, receive, remember_session)
        finally:
            left = self._opening.pop(key_id) - 1
            if left:
                self._opening[key_id] = left

    def _live(self, session: str) -> Any:
        """The SDK's transport of an open session the fast path may serve, else None."""
        live = getattr(self.manager, "_server_instances", None)
        transport = live.get(session) if isinstance(live, dict) else None
        if transport is None or transport.is_terminated:
            return None
        if not all(
            hasattr(transport, a)
            for a in (
                "idle_scope",
                "_idle_timeout",
                "_requests_in_flight",
                "is_json_response_enabled",
            )
        ):
            return None
        idle = transport.idle_scope
        if idle is not None and idle.cancel_called:  # expiring: the SDK answers
            return None
        return transport

    async def _serve_fast(
        self, send: Send, body: bytes, session: str, transport: Any, caller: Caller
    ) -> bool:
        """Serve a well-formed `tools/call` (or the cancel of one served here) and say
        True; False leaves the request to the SDK (see the module docstring)."""
        from mcp_types import CallToolRequestParams
        from pydantic import ValidationError

        try:
            message = orjson.loads(body)
        except orjson.JSONDecodeError:
            return False
        if isinstance(message, dict) and "method" in message and not _id_or_none(message):
            # The SDK would take it for a notification (202, no body): the client
            # would wait for an answer that never comes.
            await _send_json(send, 400, INVALID_ID, session)
            return True
        if not isinstance(message, dict) or message.keys() - FAST_MEMBERS:
            return False
        if message.get("jsonrpc") != "2.0":
            return False
        method = message.get("method")
        if method == "notifications/cancelled" and "id" not in message:
            params = message.get("params")
            target = params.get("requestId") if isinstance(params, dict) else None
            call = self._calls.get((session, target)) if _plain_id(target) else None
            if call is None:
                return False  # not a call served here: the SDK's to cancel
            call.cancel()
            await _send_json(send, 202, b"", session)
            return True
        rid = message.get("id")
        if method != "tools/call" or not _plain_id(rid) or (session, rid) in self._calls:
            return False
        raw = message.get("params")
        if not isinstance(raw, dict):
            return False
        try:
            params = CallToolRequestParams.model_validate(raw)
        except ValidationError:
            return False  # the SDK answers INVALID_PARAMS, as for any client
        key = (session, rid)
        me = asyncio.current_task()
        assert me is not None
        call = _FastCall(me)
        self._calls[key] = call
        sent = False

        async def answer(result: dict[str, Any]) -> None:
            """The reply, written before the call's records (the tool service's)."""
            nonlocal sent
            self._calls.pop(key, None)  # answered: no longer to cancel
            sent = True
            reply = {"jsonrpc": "2.0", "id": rid, "result": result}
            await _send_json(send, 200, orjson.dumps(reply), session)

        try:
            with _holding(transport):
                result = await self._call(dataclasses.replace(caller, answer=answer), params)
                if not sent:  # a service that leaves the answer to its caller
                    await answer(result)
            return True
        except SwitchyardError as exc:
            if sent:  # never: nothing after the answer refuses
                log.error("tools/call failed after its answer (%s)", exc.code)
                return True
            error = exc.jsonrpc_error()
        except asyncio.CancelledError:
            # Cancelled by the client's notification (or its session's end): answered
            # as the SDK answers; anything else stopping this request goes on stopping it.
            if not call.cancelled or me.uncancel() > 0:
                raise
            if sent:  # the cancel came after the answer: nothing left to stop
                return True
            error = {"code": REQUEST_CANCELLED, "message": "Request cancelled"}
        finally:
            self._calls.pop(key, None)
        reply = {"jsonrpc": "2.0", "id": rid, "error": error}
        await _send_json(send, 200, orjson.dumps(reply), session)
        return True

    async def _call(self, caller: Caller, params: Any) -> dict[str, Any]:
        """A governed call's result (as JSON); a SwitchyardError for a refusal or a
        failure, never exception text."""
        name = params.name
        if not isinstance(name, str) or not 0 < len(name) <= 200:
            raise InvalidRequest("'name' must be 1 to 200 characters", param="name")
        try:
            return await self.service.call(caller, name, params.arguments, _meta(params))
        except SwitchyardError:
            raise
        except Exception:
            log.exception("tools/call failed")
            raise InternalError("internal error; see the gateway log") from None

    def _forget(self, session: str) -> None:
        key_id = self._owners.pop(session, None)
        if key_id is None:
            return
        held = self._held.get(key_id, set())
        held.discard(session)
        if not held:
            self._held.pop(key_id, None)

    def _check_room(self, key_id: str) -> None:
        """Refuse a new session to a key that holds MAX_SESSIONS_PER_KEY open ones (the
        SDK's sessions: those it closed when idle no longer count)."""
        held = self._held.get(key_id, set())
        opening = self._opening.get(key_id, 0)
        if len(held) + opening < MAX_SESSIONS_PER_KEY:
            return
        live = getattr(self.manager, "_server_instances", None)
        if live is not None:
            for sid in [s for s in held if s not in live]:
                self._forget(sid)
        if len(self._held.get(key_id, ())) + opening >= MAX_SESSIONS_PER_KEY:
            raise TooManySessions(
                f"this key holds {MAX_SESSIONS_PER_KEY} open MCP sessions: end one "
                "(DELETE /mcp with its Mcp-Session-Id) before opening another"
            )

    async def _authenticate(self, scope: Scope) -> tuple[Principal, dict[str, str]]:
        h = _headers(scope)
        if self.auth_disabled:
            return ANONYMOUS, h
        got = self.auth.authenticate(h)
        principal = await got if isinstance(got, Awaitable) else got
        return principal, h

    # -- handlers (called by the SDK) -----------------------------------------
    def _caller_of(self, ctx: Any) -> Caller:
        request = ctx.request
        caller = request.scope.get(CALLER_KEY) if request is not None else None
        if not isinstance(caller, Caller):  # never: every request passes __call__
            raise InternalError("the MCP request lost its caller")
        return caller

    async def _list_tools(self, ctx: Any, params: Any) -> Any:
        from mcp_types import ListToolsResult, Tool

        try:
            caller = self._caller_of(ctx)
            tools = self.service.list_tools(caller.principal)
            return ListToolsResult(tools=[Tool.model_validate(t) for t in tools])
        except SwitchyardError as exc:
            raise _mcp_error(exc) from None
        except Exception:
            log.exception("tools/list failed")
            raise _mcp_error(InternalError("internal error; see the gateway log")) from None

    async def _call_tool(self, ctx: Any, params: Any) -> Any:
        from mcp_types import CallToolResult

        try:
            result = await self._call(self._caller_of(ctx), params)
            return CallToolResult.model_validate(result)
        except SwitchyardError as exc:
            raise _mcp_error(exc) from None
        except Exception:
            log.exception("tools/call failed")
            raise _mcp_error(InternalError("internal error; see the gateway log")) from None
