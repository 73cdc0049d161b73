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

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._header_timer: asyncio.TimerHandle | None = None

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
        self._arm()

    def _arm(self) -> None:
        if self._header_timer is None:
            self._header_timer = self.loop.call_later(self.header_timeout_s, self._headers_late)

    def _disarm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_late(self) -> None:
        self._header_timer = None
        if self.transport.is_closing():
            return
        if self.cycle is not None and not self.cycle.response_complete:
            return  # a request is being answered; its own deadline governs it
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
        self._arm()  # a keep-alive connection's next request: its headers are timed too

    def on_headers_complete(self) -> None:
        self._disarm()
        super().on_headers_complete()

    def on_response_complete(self) -> None:
        # Idle keep-alive connections are uvicorn's (timeout_keep_alive); the header
        # timer starts again with the next request's first byte.
        self._disarm()
        super().on_response_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    # -- framing errors ------------------------------------------------------------
    def send_400_response(self, msg: str) -> None:
        self._disarm()
        self.transport.write(
            error_bytes(
                400,
                "the request is not valid HTTP/1.1 (framing, Content-Length or header bytes)",
                "invalid_request_error",
                "invalid_http",
            )
        )
        self.transport.close()
