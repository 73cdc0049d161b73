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
  it as before, errors reworded without exception text (a body that is no request
  object at all is JSON-RPC's Invalid Request, -32600); but the requests the SDK would
  misanswer are answered here (mcp_wire `_framing_refusal`), on every protocol version
  (the body of any JSON POST is read for it, the 2026-07-28 one's too): an `id` that is
  null, a boolean, an object or an array (MCP's ids are strings or integers), 400 with
  Invalid Request (-32600, id null): the SDK takes it for a notification and answers
  nothing; a `method` that is no string, Invalid Request for the request's own id; and
  `params` that is not an object, Invalid params (-32602) for the request's own id
  (the SDK refuses both before it reads the id, with id null);
* a call's `arguments` (on either path) nest at most 128 levels (mcp_wire) and hold
  no integer past 64 bits (api/checks.py `past_int64`), else Invalid params;
* `notifications/cancelled` for a call this path serves cancels it (the SDK's answer to
  a cancelled request, `REQUEST_CANCELLED`, goes back on the call's POST); for any other
  request it goes to the SDK, whose request it is;
* the session stays the SDK's: it is opened, negotiated, listed, closed and expired by
  the SDK, and a call here holds it open while it runs, as the SDK's own requests do.
  Its owner is remembered when the SDK answers its `initialize` with a result (one
  answered with an error is ended at once, its id not given out); it is forgotten when
  the SDK answers a DELETE with 2xx (a refused DELETE changes nothing), or once the SDK
  no longer has it. A 2026-07-28 request (a version header that is no handshake one)
  opens none and is not counted against the key's sessions. The protocol version its
  `initialize` negotiated binds the session: a request in it naming another
  MCP-Protocol-Version (a handshake one, 2026-07-28's or any other) is 400 Invalid
  Request (-32600) before the SDK sees it, and a second `initialize` in it is 400
  Invalid Request for its own id. A request that names no session and opens none (a
  GET, a DELETE) is answered naming none (the SDK names the session it made for the
  refusal and discarded).

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
from collections.abc import AsyncIterator, Callable
from typing import Any

import orjson
from starlette.types import Message, Receive, Scope, Send

from switchyard.api.mcp_wire import (
    _caller,
    _check_arguments,
    _fast_headers,
    _FastCall,
    _framing_refusal,
    _headers,
    _holding,
    _initialized_already,
    _json_body,
    _mcp_error,
    _meta,
    _plain_id,
    _read_body,
    _replay,
    _send_error,
    _send_json,
    _without_exception_text,
    authenticate,
)
from switchyard.errors import (
    InternalError,
    InvalidRequest,
    PayloadTooLarge,
    SessionNotFound,
    SwitchyardError,
    TooManySessions,
    VersionNotNegotiated,
)
from switchyard.identity import Principal
from switchyard.mcp_service import Caller, McpToolService
from switchyard.policy import headers as hdr
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
        self._agreed: dict[str, str] = {}  # session id -> the protocol version it negotiated
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
        method = scope["method"]
        try:
            principal, h = await self._authenticate(scope)
            twice = hdr.repeated(h)  # which session or version counts is no guess
            if twice is not None:
                raise twice
            session = h.get("mcp-session-id")
            version = h.get("mcp-protocol-version")
            if session is not None:
                owner = self._owners.get(session) if len(session) <= MAX_SESSION_ID else None
                if owner != principal.key_id:
                    raise SessionNotFound("no such MCP session")
                agreed = self._agreed.get(session)
                if version is not None and agreed is not None and version != agreed:
                    raise VersionNotNegotiated(
                        f"Bad Request: this session negotiated MCP protocol version {agreed}; "
                        "send it in MCP-Protocol-Version (or open a new session)",
                        param="mcp-protocol-version",
                    )
            scope[CALLER_KEY] = _caller(principal, h)
            # A POST without a session opens one only on the handshake era's transport;
            # a 2026-07-28 request (another version header) is served without one.
            handshake = version is None or version in self._versions
            opening = session is None and method == "POST" and handshake
            if opening:
                self._check_room(principal.key_id)
        except SwitchyardError as exc:
            await _send_error(send, exc)
            return
        key_id = principal.key_id
        if not opening:
            await self._serve(scope, receive, send, h, session, key_id, False)
            return
        # Its place is taken with the check, no await between: concurrent openings each
        # count the ones before them (the body is read below, and that may wait).
        self._opening[key_id] = self._opening.get(key_id, 0) + 1
        try:
            await self._serve(scope, receive, send, h, session, key_id, True)
        finally:
            left = self._opening.pop(key_id) - 1
            if left:
                self._opening[key_id] = left

    async def _serve(
        self,
        scope: Scope,
        receive: Receive,
        send: Send,
        h: dict[str, str],
        session: str | None,
        key_id: str,
        opening: bool,
    ) -> None:
        method = scope["method"]
        transport = self._live(session) if session is not None else None
        if method == "POST" and (session is None or transport is not None) and _json_body(h):
            body = await _read_body(receive, self.max_body_bytes)
            if body is False:  # the client went away: no one to answer
                return
            if body is True:
                too_large = PayloadTooLarge("the request body is larger than the gateway accepts")
                await _send_error(send, too_large)
                return
            fast = _fast_headers(h, self._versions)
            if await self._serve_fast(send, body, session, transport, scope[CALLER_KEY], fast):
                return
            receive = _replay(body, receive)
        remember = (lambda sid, agreed: self._remember(sid, key_id, agreed)) if opening else None
        reply = _SdkReply(send, remember, sessionless=session is None)
        if not opening:
            await self.manager.handle_request(scope, receive, reply.send)
            if method == "DELETE" and session is not None and 200 <= reply.status < 300:
                # The SDK ended the session (only then): its calls end with it.
                self._forget(session)
                for key in [k for k in self._calls if k[0] == session]:
                    self._calls[key].cancel()
            return
        try:
            await self.manager.handle_request(scope, receive, reply.send)
        finally:
            if reply.failed is not None:
                await self._end(reply.failed)

    def _remember(self, session: str, key_id: str, agreed: str | None) -> None:
        """`session` is the key's: opened by its initialize, which the SDK answered
        with the protocol version `agreed` (its later requests name no other)."""
        if len(self._owners) >= MAX_OWNERS:
            self._prune()
            while len(self._owners) >= MAX_OWNERS:
                self._forget(next(iter(self._owners)))
        self._owners[session] = key_id
        if agreed is not None:
            self._agreed[session] = agreed
        self._held.setdefault(key_id, set()).add(session)

    def _prune(self) -> None:
        """Forget the owners of the sessions the SDK no longer has (ended or expired)."""
        live = getattr(self.manager, "_server_instances", None)
        if isinstance(live, dict):
            for sid in [s for s in self._owners if s not in live]:
                self._forget(sid)

    async def _end(self, session: str) -> None:
        """End a session the SDK kept for an `initialize` it answered with an error:
        nothing was negotiated, and its id was never given to the client."""
        live = getattr(self.manager, "_server_instances", None)
        transport = live.get(session) if isinstance(live, dict) else None
        if transport is None:
            return
        discard = getattr(self.manager, "_discard_session", None)
        if discard is not None:
            await discard(session, transport)
        elif not transport.is_terminated:
            await transport.terminate()

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
        self,
        send: Send,
        body: bytes,
        session: str | None,
        transport: Any,
        caller: Caller,
        fast: bool = True,
    ) -> bool:
        """Answer a request the SDK would misanswer (mcp_wire._framing_refusal, on
        every protocol version), serve a well-formed `tools/call` on an open session (or
        the cancel of one served here) when the headers allow (`fast`), and say True;
        False leaves the request to the SDK (see the module docstring)."""
        from mcp_types import CallToolRequestParams
        from pydantic import ValidationError

        try:
            message = orjson.loads(body)
        except orjson.JSONDecodeError:
            return False
        refusal = _framing_refusal(message)
        if refusal is None and session is not None:
            refusal = _initialized_already(message)
        if refusal is not None:
            await _send_json(send, refusal[0], refusal[1], session)
            return True
        if not fast or session is None or transport is None:
            return False
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
        name, arguments = params.name, params.arguments
        if not isinstance(name, str):  # never: the SDK's model takes a string
            raise InvalidRequest("'name' must be 1 to 200 characters", param="name")

        def check() -> None:
            """Run by the service where the call is recorded: a refused call has its
            usage row and trace too."""
            if not 0 < len(name) <= 200:
                raise InvalidRequest("'name' must be 1 to 200 characters", param="name")
            _check_arguments(arguments)

        try:
            return await self.service.call(caller, name, arguments, _meta(params), check)
        except SwitchyardError:
            raise
        except Exception:
            log.exception("tools/call failed")
            raise InternalError("internal error; see the gateway log") from None

    def _forget(self, session: str) -> None:
        self._agreed.pop(session, None)
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
        return await authenticate(self.auth, self.auth_disabled, h), h

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


class _SdkReply:
    """The SDK's reply on its way to the client: a refusal (400, 405, 413) reworded
    without exception text (mcp_wire._without_exception_text); an opening request's
    reply held until its body says whether the `initialize` succeeded: then `opened`
    has the session and its negotiated protocol version before the client learns its
    id, else `failed` names the session the SDK kept anyway, whose id the client does
    not get. `sessionless`: a request that named no session and opens none (a GET, a
    DELETE, another method, a 2026-07-28 POST): the SDK's reply names no session either
    (it answers a GET or a DELETE with the id of a session it made for the request and
    discarded at once). `status`: the HTTP status."""

    __slots__ = ("_chunks", "_held", "_opened", "_send", "_sessionless", "failed", "status")

    def __init__(
        self,
        send: Send,
        opened: Callable[[str, str | None], None] | None,
        sessionless: bool = False,
    ) -> None:
        self._send = send
        self._opened = opened  # None: not an opening request
        self._sessionless = sessionless and opened is None
        self._held: Message | None = None
        self._chunks: list[bytes] = []
        self.status = 0
        self.failed: str | None = None

    async def send(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            self.status = status = message["status"]
            if self._sessionless:
                headers = [(k, v) for k, v in message["headers"] if k.lower() != b"mcp-session-id"]
                message = {**message, "headers": headers}
            if status in (400, 405, 413) or (self._opened is not None and status < 400):
                self._held = message
                return
        elif self._held is not None and message["type"] == "http.response.body":
            self._chunks.append(message.get("body", b""))
            if message.get("more_body"):
                return
            start, self._held = self._held, None
            body = b"".join(self._chunks)
            headers = [
                (k, v)
                for k, v in start["headers"]
                if k.lower() not in (b"content-length", b"content-type", b"mcp-session-id")
            ]
            sid = next(
                (
                    v.decode("latin-1")
                    for k, v in start["headers"]
                    if k.lower() == b"mcp-session-id"
                ),
                None,
            )
            if self.status >= 400:
                body = _without_exception_text(self.status, body)
                if self._opened is not None:
                    sid = None  # the SDK closed the session it opened for this refusal
            elif self._opened is not None:
                ok, agreed = _initialized(body)
                if sid is not None and ok:
                    self._opened(sid, agreed)
                else:
                    self.failed, sid = sid, None
            if sid is not None:
                headers.append((b"mcp-session-id", sid.encode("latin-1")))
            headers.append((b"content-type", b"application/json"))
            headers.append((b"content-length", str(len(body)).encode()))
            await self._send({**start, "headers": headers})
            await self._send({"type": "http.response.body", "body": body})
            return
        await self._send(message)


def _initialized(body: bytes) -> tuple[bool, str | None]:
    """Whether the SDK's reply to an `initialize` is its result (not a JSON-RPC error),
    and the protocol version it negotiated (None: the result names none)."""
    try:
        reply = orjson.loads(body)
    except orjson.JSONDecodeError:
        return False, None
    if not (isinstance(reply, dict) and "result" in reply and "error" not in reply):
        return False, None
    result = reply["result"]
    version = result.get("protocolVersion") if isinstance(result, dict) else None
    return True, version if isinstance(version, str) else None
