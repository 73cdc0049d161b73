"""The HTTP protocol under the ASGI app: uvicorn's httptools protocol, with the
gateway's error contract and limits where uvicorn has none.

- Framing errors (a bad Content-Length, both Content-Length and Transfer-Encoding,
  control bytes in a header, garbage) get the OpenAI error body, not uvicorn's
  plain-text "Invalid HTTP request received.".
- Headers must be complete within `header_timeout_s` of a request's first byte (or of
  the connection opening): a client that trickles or never finishes them gets 408 and
  the connection closes, instead of holding it forever. One timer serves every
  connection (`HeaderDeadlines`), so the 408 comes on time without a timer per request.
- A request line and header block may hold at most `max_header_bytes`, counted as the
  bytes arrive: one more is answered 431 and the connection closes. uvicorn and
  httptools buffer headers without a bound, so without this one connection could make
  the process hold any amount of memory.
- At most `max_connections` client connections are open; one more is answered 503
  and closed before anything is read.

A subclass rather than a proxy in front: the request path stays one hop, and what is
changed is only what uvicorn answers by itself.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import orjson
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from switchyard.api.anthropic import PREFIX as MESSAGES_PREFIX
from switchyard.api.body import BAD_FRAMING
from switchyard.config import ServerConfig
from switchyard.errors import anthropic_type, error_body

log = logging.getLogger("switchyard.api")

_MESSAGES = MESSAGES_PREFIX.encode()
_REASONS = {
    400: b"Bad Request",
    408: b"Request Timeout",
    431: b"Request Header Fields Too Large",
    503: b"Service Unavailable",
}


def error_bytes(status: int, message: str, type_: str, code: str, url: bytes = b"") -> bytes:
    """A complete HTTP/1.1 error response that closes the connection, in the error
    shape of the route of `url` (the request line's target, when it was read): the
    Anthropic shape under the Messages routes, as api/app.py answers them."""
    if url.startswith(_MESSAGES):
        err: dict[str, Any] = {"type": anthropic_type(status), "message": message, "code": code}
        body = orjson.dumps({"type": "error", "error": err})
    else:
        body = orjson.dumps(error_body(message, type_, code))
    return b"".join(
        [
            b"HTTP/1.1 %d %s\r\n" % (status, _REASONS[status]),
            b"content-type: application/json\r\n",
            b"content-length: %d\r\n" % len(body),
            b"connection: close\r\n\r\n",
            body,
        ]
    )


class HeaderDeadlines:
    """One timer for the header deadlines of every connection of a server, armed at
    the earliest one.

    A timer per request cost ~1.6 us on the hot path; this costs one attribute test
    per request. Every deadline is its start plus the same timeout and starts only
    grow, so a timer already armed is never later than a new request's deadline: only
    a firing has to look for the next one. Deadlines within `coalesce_s` of a firing
    wait for the next one, so a crowd of trickling clients costs at most 1/coalesce_s
    sweeps a second, and a 408 is at most that late.
    """

    coalesce_s = 0.05
    early_s = 0.002  # timers may fire a little early (uvloop rounds to milliseconds)

    def __init__(
        self, loop: asyncio.AbstractEventLoop, connections: set[Any], timeout_s: float
    ) -> None:
        self.loop = loop
        self.connections = connections  # uvicorn's set of open protocols (shared)
        self.timeout_s = timeout_s
        self.armed = False

    def arm(self, since: float) -> None:
        """Headers started arriving at `since`; make sure a timer will see them due."""
        if not self.armed:
            self.armed = True
            self.loop.call_at(since + self.timeout_s, self.fire)

    def fire(self) -> None:
        """408 every connection whose headers are due; re-arm at the next deadline."""
        now = self.loop.time()
        due = now + self.early_s - self.timeout_s  # headers started by then are late
        next_since: float | None = None
        for conn in list(self.connections):
            since = getattr(conn, "headers_since", None)  # a WebSocket protocol has none
            if since is None:
                continue
            if since <= due:
                assert isinstance(conn, GatewayProtocol)
                conn.headers_late()
            elif next_since is None or since < next_since:
                next_since = since
        if next_since is None:
            self.armed = False
        else:
            at = max(next_since + self.timeout_s, now + self.coalesce_s)
            self.loop.call_at(at, self.fire)


class GatewayProtocol(HttpToolsProtocol):
    header_timeout_s = 10.0
    max_header_bytes = 65_536
    max_connections = 2048
    # After a 431, what the client still sends is read and dropped this long, so that
    # it reads the answer instead of a reset (closing with unread bytes sends RST).
    linger_s = 1.0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # loop.time() when the current request's first byte (or the connection)
        # arrived, until its headers are complete; None otherwise.
        self.headers_since: float | None = None
        # Bytes of the header block being read (from the connection's start or the
        # previous request's end); None while a body is read.
        self.header_bytes: int | None = 0
        self.refused = False  # answered 431: whatever arrives now is dropped
        state = self.server_state
        deadlines = getattr(state, "switchyard_header_deadlines", None)
        if deadlines is None:
            deadlines = HeaderDeadlines(self.loop, self.connections, self.header_timeout_s)
            state.switchyard_header_deadlines = deadlines  # type: ignore[attr-defined]
        self.deadlines: HeaderDeadlines = deadlines

    @classmethod
    def configured(cls, server: ServerConfig) -> type[GatewayProtocol]:
        """This protocol with the limits of `server` (uvicorn takes a class)."""
        return type(
            "GatewayProtocol",
            (cls,),
            {
                "header_timeout_s": server.header_timeout_s,
                "max_header_bytes": server.max_header_bytes,
                "max_connections": server.max_connections,
            },
        )

    # -- the connection cap and the header timeout ---------------------------------
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self.max_connections:
            log.warning("connection refused: %d open connections", len(self.connections) - 1)
            transport.write(
                error_bytes(
                    503,
                    "the gateway has too many open connections; retry shortly",
                    "server_error",
                    "too_many_connections",
                )
            )
            transport.close()
            return
        self.headers_since = since = self.loop.time()
        self.deadlines.arm(since)

    def headers_late(self) -> None:
        self.headers_since = None
        if self.transport.is_closing():
            return
        self.transport.write(
            error_bytes(
                408,
                f"the request headers did not arrive within {self.header_timeout_s:g}s",
                "invalid_request_error",
                "request_timeout",
                self.url,
            )
        )
        self.transport.close()

    def on_message_begin(self) -> None:
        super().on_message_begin()
        # A keep-alive connection's next request.
        self.headers_since = since = self.loop.time()
        if not self.deadlines.armed:
            self.deadlines.arm(since)

    def on_headers_complete(self) -> None:
        self.headers_since = None
        self.header_bytes = None
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        self.header_bytes = 0  # what follows is the next request's header block
        super().on_message_complete()

    def on_response_complete(self) -> None:
        # An idle keep-alive connection is uvicorn's (timeout_keep_alive); headers are
        # timed again from the next request's first byte.
        self.headers_since = None
        super().on_response_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        self.headers_since = None
        super().connection_lost(exc)

    # -- the header size limit -----------------------------------------------------
    def data_received(self, data: bytes) -> None:
        """Feeds the parser at most what is left of `max_header_bytes` while a header
        block is read, so that no more than that is ever buffered for one.

        A block counts from the previous request's end: bytes that follow it in the
        same read are not counted (a pipelining client may get up to one read more).
        """
        if self.refused:
            return
        while self.header_bytes is not None:
            room = self.max_header_bytes - self.header_bytes
            if len(data) <= room:
                self.header_bytes += len(data)
                super().data_received(data)
                return
            self.header_bytes = self.max_header_bytes
            if room:
                super().data_received(data[:room])
            if self.transport.is_closing() or self.transport.get_protocol() is not self:
                return  # answered 400, or upgraded to a WebSocket
            if self.header_bytes == self.max_header_bytes:  # the same block, still open
                self.headers_too_large()
                return
            data = data[room:]
        super().data_received(data)

    def headers_too_large(self) -> None:
        """431, and nothing of the request kept: the parser and what it buffered go.

        The write side closes at once; reading goes on (dropping what comes) until the
        client closes or `linger_s`, so that the client sees the 431 rather than a reset.
        While an earlier request's response is being written, a 431 would land inside
        it, so the connection just closes.
        """
        self.refused = True
        self.headers_since = None
        self.header_bytes = None
        url, self.url = self.url[: len(_MESSAGES)], b""
        if self.headers is not None:
            self.headers.clear()
        self.parser = None  # type: ignore[assignment]
        transport = self.transport
        if self.cycle is not None and not self.cycle.response_complete:
            transport.close()
            return
        transport.write(
            error_bytes(
                431,
                f"the request line and headers exceed {self.max_header_bytes} bytes",
                "invalid_request_error",
                "request_header_fields_too_large",
                url,
            )
        )
        if transport.can_write_eof():
            transport.write_eof()
        self.loop.call_later(self.linger_s, transport.close)

    # -- framing errors ------------------------------------------------------------
    def send_400_response(self, msg: str) -> None:
        self.headers_since = None
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete:
            # A body whose framing broke mid-read: the app sees only a hang-up, and
            # this note lets it record the 400 the client got (api/body.py).
            scope: dict[str, Any] = cycle.scope  # type: ignore[assignment]
            scope[BAD_FRAMING] = True
        self.transport.write(
            error_bytes(
                400,
                "the request is not valid HTTP/1.1 (framing, Content-Length or header bytes)",
                "invalid_request_error",
                "invalid_http",
                self.url,
            )
        )
        self.transport.close()


def uvicorn_options(server: ServerConfig) -> dict[str, Any]:
    """How every gateway process runs uvicorn: one process, or each worker of several
    (a worker's `max_connections` is its own)."""
    return {
        "log_level": "warning",
        "access_log": False,
        # Nothing here reads the client's address, so uvicorn need not rewrite it from
        # X-Forwarded-* on every request (a per-request header scan: ~2 % of the loop).
        "proxy_headers": False,
        "server_header": False,
        "timeout_graceful_shutdown": 5,
        # The error contract and the limits uvicorn does not have: framing errors as
        # OpenAI error bodies, a header timeout, a cap on open connections.
        "http": GatewayProtocol.configured(server),
    }
