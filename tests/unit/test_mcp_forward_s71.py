"""engines/mcp_forward.py `_read_sse` over a real aiohttp tool server that writes its SSE
reply in pieces the test chooses (a line split anywhere, CR LF split between two
writes, a long `data:` line in many writes): the reader's answer is the same however
the stream is cut, max_bytes still ends the read, and a server's own requests are
answered at most MAX_ANSWERED_PER_CALL times. (These pass before and after the reader
was made linear in the number of lines: they pin what the rewrite had to keep.)"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable
from typing import Any

import orjson
import pytest
from aiohttp import web

from support.aiohttp_server import serving
from switchyard.engines.mcp_forward import MAX_ANSWERED_PER_CALL, HttpForwarder

Pieces = Callable[[str], list[bytes]]  # the call's id -> what the server writes, in order


def ok(rid: str, text: str) -> bytes:
    result = {"content": [{"type": "text", "text": text}]}
    return orjson.dumps({"jsonrpc": "2.0", "id": rid, "result": result})


async def _call(pieces: Pieces, max_bytes: int) -> tuple[Any, list[Any]]:
    """One `tools/call` against a server writing `pieces` (a pause after each); the
    forwarder's (result, error, how) and every message the server got."""
    seen: list[Any] = []

    async def handle(request: web.Request) -> web.StreamResponse:
        body = orjson.loads(await request.read())
        seen.append(body)
        if body.get("method") != "tools/call":
            return web.Response(status=202)
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await resp.prepare(request)
        for piece in pieces(body["id"]):
            await resp.write(piece)
            await asyncio.sleep(0.002)  # each piece its own read, as far as TCP allows
        await resp.write_eof()
        return resp

    app = web.Application()
    app.router.add_post("/mcp", handle)
    async with serving(app) as url:
        fwd = HttpForwarder(url + "/mcp", {}, "sid-1", "2025-11-25", max_bytes)
        try:
            got = await fwd.call("echo", {}, None, 10)
            await asyncio.sleep(0.1)  # the answers to the server's requests land
        finally:
            await fwd.close()
    return got, seen


def _cut(stream: bytes, at: list[int]) -> list[bytes]:
    bounds = [0, *at, len(stream)]
    return [stream[a:b] for a, b in itertools.pairwise(bounds) if b > a]


def _event(rid: str, text: str, crlf: bool) -> bytes:
    """An event answering `rid` whose JSON is split over two `data:` lines."""
    eol = b"\r\n" if crlf else b"\n"
    raw = ok(rid, text)
    head, tail = raw[: raw.index(b',"result"') + 1], raw[raw.index(b'"result"') :]
    return b"event: message" + eol + b"data: " + head + eol + b"data:" + tail + eol + eol


@pytest.mark.parametrize(
    "cut",
    [
        "whole",  # one write
        "bytewise",  # every byte its own write
        "cr-lf",  # each CR LF split between two writes
    ],
)
def test_the_answer_is_the_same_however_the_stream_is_cut(cut: str) -> None:
    def pieces(rid: str) -> list[bytes]:
        stream = b": hello\r\n\r\n" * 3 + b"\r\n" + _event(rid, "cut " + cut, crlf=True)
        if cut == "whole":
            return [stream]
        if cut == "bytewise":
            return _cut(stream, list(range(1, len(stream))))
        return _cut(stream, [i + 1 for i in range(len(stream)) if stream[i : i + 2] == b"\r\n"])

    (result, error, how), _ = asyncio.run(_call(pieces, 4096))
    assert (how, error) == ("ok", None)
    assert result["content"] == [{"type": "text", "text": "cut " + cut}]


def test_a_long_data_line_in_many_writes_is_read_whole() -> None:
    text = "y" * 3000

    def pieces(rid: str) -> list[bytes]:
        stream = _event(rid, text, crlf=False)
        return _cut(stream, list(range(7, len(stream), 7)))

    (result, error, how), _ = asyncio.run(_call(pieces, 4096))
    assert (how, error) == ("ok", None) and result["content"][0]["text"] == text


def test_max_bytes_ends_a_stream_of_short_lines_before_its_answer() -> None:
    def pieces(rid: str) -> list[bytes]:
        return [b":\n" * 1000 for _ in range(5)] + [_event(rid, "late", crlf=False)]

    (result, error, how), _ = asyncio.run(_call(pieces, 4096))
    assert (result, error, how) == (None, (-32603, "result too large"), "too_large")


def test_the_servers_requests_are_answered_up_to_the_cap() -> None:
    def pieces(rid: str) -> list[bytes]:
        pings = [
            b"data: " + orjson.dumps({"jsonrpc": "2.0", "id": i, "method": "ping"}) + b"\n\n"
            for i in range(MAX_ANSWERED_PER_CALL + 5)
        ]
        note = b'data: {"jsonrpc": "2.0", "method": "notifications/progress"}\n\n'
        other = b"data: " + ok("sy-999", "not yours") + b"\n\n"
        return [*pings, note, other, b"data: [1, 2]\n\n", _event(rid, "mine", crlf=False)]

    (result, error, how), seen = asyncio.run(_call(pieces, 65536))
    assert (how, error) == ("ok", None) and result["content"][0]["text"] == "mine"
    answers = [m for m in seen if "method" not in m]
    assert sorted(m["id"] for m in answers) == list(range(MAX_ANSWERED_PER_CALL))
    assert all(m["result"] == {} for m in answers)


def test_a_stream_that_ends_without_the_answer_is_malformed() -> None:
    def pieces(rid: str) -> list[bytes]:
        # the answer's data is never ended by a blank line
        return [b"data: " + ok(rid, "unfinished") + b"\n"]

    (result, error, how), _ = asyncio.run(_call(pieces, 4096))
    assert (result, error, how) == (None, (-32603, "malformed reply"), "malformed")
