"""A worker's `/mcp` (`switchyard serve --workers N`): relayed to the control plane's.

An MCP session lives in the process that opened it (the SDK's session manager holds
its transport), and a client's requests reach whichever worker the kernel gives their
connection. So with several workers `/mcp` is served once, in the control plane
(api/internal.py mounts the real endpoint, api/mcp.py), with the tool servers, the
sessions and their owners; each worker relays the request there as it came and the
reply back as it goes (a JSON reply or an SSE stream), over loopback.

The relay adds no rule of its own: the control plane's endpoint authenticates the key,
bounds the body and answers every error. The relay checks the key first too (given the
worker's authenticator), so a request without a valid one is answered 401 at once,
before its body is read; then it bounds what it reads before it sends
(`server.max_body_bytes`, as the endpoint would), forwards only the headers the MCP
transport uses (the 2026-07-28 revision's `Mcp-Method`, `Mcp-Name` and `Mcp-Param-*`
among them) and the client's trace context (`traceparent`, `tracestate`), and answers a
control plane it cannot reach with a JSON-RPC error. A client that goes away closes the
relayed request.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import aiohttp
from starlette.types import Receive, Scope, Send

from switchyard.aio import hung_up
from switchyard.api.mcp_wire import _headers, _read_body, _send_error, authenticate
from switchyard.errors import PayloadTooLarge, SwitchyardError, UpstreamUnreachable
from switchyard.policy.auth import Authenticator

log = logging.getLogger("switchyard.mcp")

# What goes to the control plane's endpoint: the transport's and the gateway's headers.
_FORWARDED = frozenset(
    {
        b"authorization",
        b"content-type",
        b"accept",
        b"mcp-session-id",
        b"mcp-protocol-version",
        b"mcp-method",
        b"mcp-name",
        b"last-event-id",
        b"traceparent",
        b"tracestate",
        b"x-task-id",
        b"x-switchyard-call-id",
        b"x-switchyard-approval",
        b"x-request-timeout",
        b"x-parent-request-id",
        b"x-task-budget",
        b"x-task-timeout",
        b"x-task-deadline",
        b"x-request-id",
    }
)
_PARAM_HEADERS = b"mcp-param-"  # 2026-07-28: a tool's arguments named in headers
# What comes back: everything but the connection's own framing.
_HOP = frozenset({"connection", "keep-alive", "transfer-encoding", "content-length", "server"})


class McpRelay:
    def __init__(
        self,
        url: str,
        max_body_bytes: int,
        auth: Authenticator | None = None,
        auth_disabled: bool = False,
    ) -> None:
        """`auth`: the worker's authenticator, to refuse a bad key before the body is
        read (None: the control plane's endpoint alone refuses it, after)."""
        self.url = url
        self.max_body_bytes = max_body_bytes
        self.auth = auth
        self.auth_disabled = auth_disabled
        self._session: aiohttp.ClientSession | None = None

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=5),
                auto_decompress=False,
            )
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        if self.auth is not None:
            try:
                await authenticate(self.auth, self.auth_disabled, _headers(scope))
            except SwitchyardError as exc:
                await _send_error(send, exc)
                return
        body = await _read_body(receive, self.max_body_bytes)
        if body is False:  # the client went away
            return
        if body is True:
            await _send_error(
                send, PayloadTooLarge("the request body is larger than the gateway accepts")
            )
            return
        headers = [
            (k.decode("latin-1"), v.decode("latin-1"))
            for k, v in scope["headers"]
            if k in _FORWARDED or k.startswith(_PARAM_HEADERS)
        ]
        query = scope.get("query_string", b"").decode("latin-1")
        url = self.url + (f"?{query}" if query else "")
        relay = asyncio.ensure_future(self._relay(scope["method"], url, headers, body, send))
        gone = asyncio.ensure_future(hung_up(receive))
        try:
            await asyncio.wait({relay, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not relay.done():  # the client left: the relayed request closes too
                relay.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await relay

    async def _relay(
        self, method: str, url: str, headers: list[tuple[str, str]], body: bytes, send: Send
    ) -> None:
        started = False
        try:
            async with self._client().request(method, url, headers=headers, data=body or None) as r:
                out = [
                    (k.lower().encode("latin-1"), v.encode("latin-1"))
                    for k, v in r.headers.items()
                    if k.lower() not in _HOP
                ]
                await send({"type": "http.response.start", "status": r.status, "headers": out})
                started = True
                async for chunk in r.content.iter_any():
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
                await send({"type": "http.response.body", "body": b""})
        except (aiohttp.ClientError, OSError) as exc:
            log.error("the control plane's /mcp did not answer: %s", exc)
            if not started:
                await _send_error(
                    send,
                    UpstreamUnreachable(
                        "the gateway's MCP endpoint is not answering; retry shortly"
                    ),
                )
