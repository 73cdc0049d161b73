"""The HTTP protocol under the ASGI app: uvicorn's httptools protocol, with the
gateway's error contract and limits where uvicorn has none.

- Framing errors (a bad Content-Length, both Content-Length and Transfer-Encoding,
  control bytes in a header, garbage) get the OpenAI error body, not uvicorn's
  plain-text "Invalid HTTP request received.".
- Headers must be complete within `header_timeout_s` of a request's first byte (or of
  the connection opening): a client that trickles or never finishes them gets 408 and
  the connection closes, instead of holding it forever.
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

from switchyard.config import ServerConfig
from switchyard.errors import error_body

log = logging.getLogger("switchyard.api")

_REASONS = {400: b"Bad Request", 408: b"Request Timeout", 503: b"Service Unavailable"}


def error_bytes(status: int, message: str, type_: str, code: str) -> bytes:
    """A complete HTTP/1.1 error response that closes the connection."""
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


class GatewayProtocol(HttpToolsProtocol):
    header_timeout_s = 10.0
    max_connections = 2048
    sweep_s = 1.0  # how often open connections are checked for late headers

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # loop.time() when the current request's first byte (or the connection)
        # arrived, until its headers are complete; None otherwise. Checked by one
        # sweep for all connections: a timer per request cost ~1.6 us.
        self.headers_since: float | None = None

    @classmethod
    def configured(cls, server: ServerConfig) -> type[GatewayProtocol]:
        """This protocol with the limits of `server` (uvicorn takes a class)."""
        return type(
            "GatewayProtocol",
            (cls,),
            {
                "header_timeout_s": server.header_timeout_s,
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
        self.headers_since = self.loop.time()
        state = self.server_state
        if not getattr(state, "switchyard_sweeping", False):
            state.switchyard_sweeping = True  # type: ignore[attr-defined]
            self.loop.call_later(self.sweep_s, self._sweep)

    def _sweep(self) -> None:
        """408 and close every connection whose headers are late; again in sweep_s
        while connections are open."""
        now = self.loop.time()
        for conn in list(self.connections):
            since = getattr(conn, "headers_since", None)
            if since is not None and now - since > self.header_timeout_s:
                assert isinstance(conn, GatewayProtocol)
                conn.headers_late()
        state = self.server_state
        if self.connections:
            self.loop.call_later(self.sweep_s, self._sweep)
        else:
            state.switchyard_sweeping = False  # type: ignore[attr-defined]

    def headers_late(self) -> None:
        self.headers_since = None
        if self.transport.is_closing():
            return
        self.transport.write(
            error_bytes(
                408,
                f"the request headers did not arrive within {self.header_timeout_s:.0f}s",
                "invalid_request_error",
                "request_timeout",
            )
        )
        self.transport.close()

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self.headers_since = self.loop.time()  # a keep-alive connection's next request

    def on_headers_complete(self) -> None:
        self.headers_since = None
        super().on_headers_complete()

    def on_response_complete(self) -> None:
        # An idle keep-alive connection is uvicorn's (timeout_keep_alive); headers are
        # timed again from the next request's first byte.
        self.headers_since = None
        super().on_response_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        self.headers_since = None
        super().connection_lost(exc)

    # -- framing errors ------------------------------------------------------------
    def send_400_response(self, msg: str) -> None:
        self.headers_since = None
        self.transport.write(
            error_bytes(
                400,
                "the request is not valid HTTP/1.1 (framing, Content-Length or header bytes)",
                "invalid_request_error",
                "invalid_http",
            )
        )
        self.transport.close()
