"""A hostile OpenAI-compatible upstream for a test: each reply is scripted by the first
segment of the request's path (`/<reply>/v1/chat/completions`), so one gateway config
names one model per reply (`base_url: <url>/<reply>/v1`). It answers what a broken or
hostile engine could: bodies far larger than any reply, streams that never end or never
finish, malformed SSE, odd headers. Served by a thread of the test process (the stdlib's
threading server), so a reply can write raw bytes and hold its connection.

`replies` maps a name to a function that writes the whole answer on the handler's
socket; `Hostile` counts, by name, the floods written whole and the connections the
gateway closed before the reply ended.
"""

from __future__ import annotations

import contextlib
import http.server
import json
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

Reply = Callable[["Handler"], None]

HOLD_S = 30.0  # the longest a reply holds an open connection; a test ends well before


def json_reply(body: bytes, status: int = 200, headers: dict[str, str] | None = None) -> Reply:
    """A whole reply of `body` with its length declared."""

    def write(h: Handler) -> None:
        h.send_response(status)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(body)))
        for k, v in (headers or {}).items():
            h.send_header(k, v)
        h.end_headers()
        h.wfile.write(body)

    return write


def sse_reply(*events: bytes, hold: bool = False) -> Reply:
    """A stream of raw bytes, written as they are (the test frames them, or breaks the
    framing on purpose), then the connection closed, or held open when `hold`."""

    def write(h: Handler) -> None:
        h.send_response(200)
        h.send_header("Content-Type", "text/event-stream")
        h.send_header("Connection", "close")
        h.end_headers()
        for e in events:
            h.wfile.write(e)
            h.wfile.flush()
        if hold:
            h.hold()

    return write


def sse_event(data: bytes | dict[str, Any], compact: bool = False) -> bytes:
    """One SSE `data:` event of `data` (bytes as they are, an object as JSON, spaced as
    Python writes it or `compact`)."""
    if isinstance(data, dict):
        data = json.dumps(data, separators=(",", ":") if compact else None).encode()
    return b"data: " + data + b"\n\n"


def chunk_event(
    delta: dict[str, Any], finish: str | None = None, index: int = 0, compact: bool = False
) -> bytes:
    """A chat completion chunk's event: one choice of `index` with `delta` and `finish`."""
    choice = {"index": index, "delta": delta, "finish_reason": finish}
    body = {"id": "c1", "object": "chat.completion.chunk", "created": 1, "model": "m",
            "choices": [choice]}  # fmt: skip
    return sse_event(body, compact)


def call_event(index: Any, args: str, head: str | None = None) -> bytes:
    """A chunk of one tool call's piece: its arguments, and with `head` its id
    (`call_<head>`) and name (`lookup`), as a call's first piece carries them."""
    piece: dict[str, Any] = {"index": index, "function": {"arguments": args}}
    if head is not None:
        piece.update(id=f"call_{head}", type="function")
        piece["function"]["name"] = "lookup"
    return chunk_event({"tool_calls": [piece]})


DONE_EVENT = sse_event(b"[DONE]")
USAGE_EVENT = sse_event({"id": "c1", "object": "chat.completion.chunk", "choices": [],
                         "usage": {"prompt_tokens": 5, "completion_tokens": 7,
                                   "total_tokens": 12}})  # fmt: skip


def flood(prefix: bytes, piece: bytes, total: int, content_type: str) -> Reply:
    """A 200 whose body is `prefix`, then `piece` again and again up to `total` bytes,
    then nothing more on a connection held open: a reply that never ends. Once all of
    it was written (the gateway read it, bar the sockets' buffers) `Hostile.written`
    counts it; a gateway that stops reading earlier and closes is counted `gone`."""

    def write(h: Handler) -> None:
        h.send_response(200)
        h.send_header("Content-Type", content_type)
        h.send_header("Connection", "close")
        h.end_headers()
        h.wfile.write(prefix)
        sent = len(prefix)
        while sent < total:
            h.wfile.write(piece)
            sent += len(piece)
        h.wfile.flush()
        h.server.state.count("written", h.reply_name)
        h.hold()

    return write


class Handler(http.server.BaseHTTPRequestHandler):
    """One connection: reads the request, writes the reply its path names, and counts a
    connection the gateway closed while the reply was under way."""

    protocol_version = "HTTP/1.1"
    server: _Server
    reply_name = ""

    def log_message(self, format: str, *args: object) -> None:
        """Quiet: the test reads counts, not a log."""

    def hold(self) -> None:
        """Keep the connection open, sending nothing, until the peer closes it (then
        raise, as a failed write would) or HOLD_S pass."""
        deadline = time.monotonic() + HOLD_S
        self.connection.settimeout(0.2)
        while time.monotonic() < deadline:
            try:
                if self.connection.recv(1) == b"":
                    raise ConnectionResetError("the peer closed")
            except TimeoutError:
                continue

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self.reply_name = self.path.strip("/").split("/", 1)[0]
        state = self.server.state
        reply = state.replies.get(self.reply_name)
        self.close_connection = True
        if reply is None:
            json_reply(b'{"error": {"message": "no such reply"}}', 404)(self)
            return
        try:
            reply(self)
        except OSError:  # the gateway closed the connection (or reset it)
            state.count("gone", self.reply_name)


@dataclass
class _State:
    replies: dict[str, Reply]
    counts: Counter[tuple[str, str]] = field(default_factory=Counter)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def count(self, what: str, name: str) -> None:
        with self.lock:
            self.counts[what, name] += 1

    def get(self, what: str, name: str) -> int:
        with self.lock:
            return self.counts[what, name]


class _Server(http.server.ThreadingHTTPServer):
    daemon_threads = True
    state: _State


class Hostile:
    """The running upstream: its base `url` and what it saw, by reply name: floods
    written whole (`written`), connections the gateway closed before the reply ended
    (`gone`)."""

    def __init__(self, server: _Server) -> None:
        self._state = server.state
        self.url = f"http://127.0.0.1:{server.server_address[1]}"

    def base_url(self, name: str) -> str:
        """The OpenAI base URL whose requests get the reply `name`."""
        return f"{self.url}/{name}/v1"

    def models(
        self, names: Iterable[str], price: dict[str, float], kind: str = "openai", **engine: Any
    ) -> list[dict[str, Any]]:
        """One model per reply name, named for it (`kind` and `engine`: its engine's,
        e.g. an Anthropic upstream's `model`), no retries: a gateway config's `models`."""
        return [
            {
                "alias": name,
                "engine": {"kind": kind, "base_url": self.base_url(name), **engine},
                "price": price,
                "resilience": {"retries": 0},
            }
            for name in names
        ]

    def written(self, name: str) -> int:
        return self._state.get("written", name)

    def gone(self, name: str) -> int:
        return self._state.get("gone", name)


@contextlib.contextmanager
def hostile_upstream(replies: dict[str, Reply]) -> Iterator[Hostile]:
    """`replies` served on a free loopback port for the length of the block."""
    server = _Server(("127.0.0.1", 0), Handler)
    server.state = _State(dict(replies))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield Hostile(server)
    finally:
        server.shutdown()
        server.server_close()
