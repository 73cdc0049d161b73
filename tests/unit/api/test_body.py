"""Reading a request body straight from the ASGI channel: one message or many, the
size limit, a client that leaves."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from starlette.requests import Request

from switchyard.api.body import header_map, read_body
from switchyard.errors import ClientDisconnected, PayloadTooLarge


def _request(*messages: dict[str, Any]) -> Request:
    queue = list(messages)

    async def receive() -> dict[str, Any]:
        return queue.pop(0)

    return Request({"type": "http", "method": "POST", "headers": []}, receive)


def _part(body: bytes, more: bool) -> dict[str, Any]:
    return {"type": "http.request", "body": body, "more_body": more}


def test_a_body_in_one_message_or_many_reads_whole() -> None:
    one = _request(_part(b'{"a": 1}', False))
    assert asyncio.run(read_body(one, 100, "8")) == b'{"a": 1}'
    parts = _request(_part(b'{"a"', True), _part(b"", True), _part(b": 1}", False))
    assert asyncio.run(read_body(parts, 100)) == b'{"a": 1}'
    empty = _request({"type": "http.request"})
    assert asyncio.run(read_body(empty, 100)) == b""


def test_the_limit_holds_however_the_body_arrives() -> None:
    with pytest.raises(PayloadTooLarge, match="101 bytes"):  # declared: before reading
        asyncio.run(read_body(_request(), 100, "101"))
    many = _request(_part(b"x" * 60, True), _part(b"x" * 60, False))
    with pytest.raises(PayloadTooLarge, match="exceeds the limit of 100"):
        asyncio.run(read_body(many, 100))
    understated = _request(_part(b"x" * 150, False))  # a length that lies
    with pytest.raises(PayloadTooLarge):
        asyncio.run(read_body(understated, 100, "10"))


def test_a_client_that_leaves_mid_body_is_a_disconnect() -> None:
    gone = _request(_part(b'{"a"', True), {"type": "http.disconnect"})
    with pytest.raises(ClientDisconnected):
        asyncio.run(read_body(gone, 100))


def test_repeated_cache_control_lines_are_one_list_other_headers_keep_the_first() -> None:
    """`Cache-Control` lines join into one comma-separated value (RFC 9110 5.3), so a
    `no-store` on a second line is heard; any other repeated header keeps its first
    line (two credentials are never merged)."""
    raw = [
        (b"cache-control", b"max-age=0"),
        (b"authorization", b"Bearer first"),
        (b"cache-control", b"no-store"),
        (b"authorization", b"Bearer second"),
    ]
    got = header_map({"type": "http", "method": "POST", "headers": raw})
    assert got == {"cache-control": "max-age=0, no-store", "authorization": "Bearer first"}
