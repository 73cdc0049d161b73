"""The HTTP limits under the app (issue #41, findings 7 and 8), against the real
gateway over raw sockets: how many header bytes one request may send, that the
memory of a header flood goes back, and that the header timeout answers on time.
"""

from __future__ import annotations

import concurrent.futures
import re
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import orjson
import pydantic
import pytest

from support.gateways import Gateway, start_gateway
from support.upstreams import Scripted
from switchyard.api.server import GatewayProtocol
from switchyard.config import ServerConfig

LIMIT = 65_536  # server.max_header_bytes by default
HEADER_TIMEOUT_S = 1.0
CHAT = orjson.dumps(
    {"model": "cheap", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}
)


def _config(scripted: Scripted, **server: Any) -> dict[str, Any]:
    return {
        "server": server,
        "models": [
            {"alias": "cheap", "engine": {"kind": "openai", "base_url": scripted.url + "/v1"}}
        ],
        "embeddings": {"enabled": False},
    }


@pytest.fixture(scope="module")
def gw(scripted: Scripted) -> Iterator[Gateway]:
    g = start_gateway(_config(scripted, header_timeout_s=HEADER_TIMEOUT_S))
    yield g
    g.proc.stop()


# -- requests and replies on raw sockets ------------------------------------------------


def _filler(n: int) -> bytes:
    """Header lines of exactly `n` bytes (CRLFs included), ~1 KiB each."""
    lines, i = [], 0
    while n > 0:
        size = 1024 if n >= 1024 + 17 else n
        name = b"x-fill-%05d: " % i
        lines.append(name + b"a" * (size - len(name) - 2) + b"\r\n")
        n, i = n - size, i + 1
    return b"".join(lines)


def _request(
    block: int,
    method: bytes = b"GET",
    path: bytes = b"/healthz",
    headers: bytes = b"",
    body: bytes = b"",
    one_header: bool = False,
) -> bytes:
    """A request whose line and header block (through the blank line) is `block` bytes."""
    if body:
        headers += b"content-type: application/json\r\ncontent-length: %d\r\n" % len(body)
    start = b"%s %s HTTP/1.1\r\nhost: x\r\n%s" % (method, path, headers)
    fill = block - len(start) - 2
    filler = b"x-big: " + b"a" * (fill - 9) + b"\r\n" if one_header else _filler(fill)
    head = start + filler + b"\r\n"
    assert len(head) == block
    return head + body


class _Conn:
    """One client connection that reads whole HTTP/1.1 responses."""

    def __init__(self, port: int, timeout: float = 10.0) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.buf = b""

    def _more(self) -> None:
        got = self.sock.recv(65536)
        if not got:
            raise AssertionError(f"closed before a whole response: {self.buf[:300]!r}")
        self.buf += got

    def response(self) -> tuple[int, bytes, bytes]:
        """(status, head, body) of the next response."""
        while b"\r\n\r\n" not in self.buf:
            self._more()
        head, _, self.buf = self.buf.partition(b"\r\n\r\n")
        length = re.search(rb"(?im)^content-length:\s*(\d+)\r?$", head)
        assert length is not None, head
        while len(self.buf) < int(length.group(1)):
            self._more()
        body, self.buf = self.buf[: int(length.group(1))], self.buf[int(length.group(1)) :]
        return int(head.split(b" ", 2)[1]), head, body

    def closed(self) -> bool:
        """Whether the gateway closed the connection (EOF, nothing more sent)."""
        try:
            return self.buf == b"" and self.sock.recv(1) == b""
        except ConnectionResetError:
            return True

    def close(self) -> None:
        self.sock.close()


def _exchange(gw: Gateway, data: bytes) -> tuple[int, bytes, bytes]:
    conn = _Conn(gw.port)
    try:
        conn.sock.sendall(data)
        return conn.response()
    finally:
        conn.close()


def _assert_431(status: int, head: bytes, body: bytes) -> None:
    assert status == 431, (status, body[:300])
    assert b"Request Header Fields Too Large" in head.split(b"\r\n", 1)[0]
    assert b"application/json" in head
    error = orjson.loads(body)["error"]
    assert error["code"] == "request_header_fields_too_large"
    assert error["type"] == "invalid_request_error"
    assert str(LIMIT) in error["message"]


def _still_serves(gw: Gateway) -> None:
    status, _, _ = _exchange(gw, b"GET /healthz HTTP/1.1\r\nhost: x\r\n\r\n")
    assert status == 200


# -- the header size limit ----------------------------------------------------------------


def test_the_limit_is_configured_and_bounded_below() -> None:
    protocol = GatewayProtocol.configured(ServerConfig(max_header_bytes=4096))
    assert protocol.max_header_bytes == 4096
    assert ServerConfig().max_header_bytes == LIMIT
    with pytest.raises(pydantic.ValidationError, match="max_header_bytes"):
        ServerConfig(max_header_bytes=100)


def test_a_header_block_of_exactly_the_limit_is_served(gw: Gateway) -> None:
    status, _, body = _exchange(gw, _request(LIMIT))
    assert status == 200, body[:300]
    # The body is not counted, though it arrives in the same write as the headers.
    auth = b"authorization: Bearer %s\r\n" % gw.key.encode()
    chat = _request(LIMIT, b"POST", b"/v1/chat/completions", headers=auth, body=CHAT)
    status, _, body = _exchange(gw, chat)
    assert status == 200, body[:300]
    assert orjson.loads(body)["object"] == "chat.completion"


@pytest.mark.parametrize("one_header", [False, True], ids=["many-headers", "one-header"])
def test_one_byte_over_the_limit_is_431_and_closes(gw: Gateway, one_header: bool) -> None:
    conn = _Conn(gw.port)
    try:
        conn.sock.sendall(_request(LIMIT + 1, one_header=one_header))
        _assert_431(*conn.response())
        assert conn.closed()
    finally:
        conn.close()
    _still_serves(gw)


@pytest.mark.parametrize("piece", [None, 1024], ids=["one-write", "1KiB-writes"])
def test_a_100_KiB_header_block_is_431(gw: Gateway, piece: int | None) -> None:
    data = _request(100 * 1024)
    conn = _Conn(gw.port)
    try:
        for at in range(0, len(data), piece or len(data)):
            conn.sock.sendall(data[at : at + (piece or len(data))])
        _assert_431(*conn.response())
        assert conn.closed()
    finally:
        conn.close()
    _still_serves(gw)


def test_each_request_on_a_keep_alive_connection_has_the_whole_limit(gw: Gateway) -> None:
    """Two requests of 48 KiB each (96 KiB together) on one connection: one after the
    other, then both in one write (pipelined)."""
    one = _request(48 * 1024)
    conn = _Conn(gw.port)
    try:
        for _ in range(2):
            conn.sock.sendall(one)
            assert conn.response()[0] == 200
        conn.sock.sendall(one + one)
        assert [conn.response()[0], conn.response()[0]] == [200, 200]
        # ...and the limit still holds on this connection.
        conn.sock.sendall(_request(LIMIT + 1))
        _assert_431(*conn.response())
    finally:
        conn.close()


# -- the header timeout ---------------------------------------------------------------------


def _trickle_until_answered(port: int) -> tuple[float, bytes]:
    """Headers that never finish, one byte every 0.1 s: (seconds from the first byte
    to the answer's first byte, the answer)."""
    with socket.create_connection(("127.0.0.1", port), timeout=0.1) as s:
        s.sendall(b"GET /healthz HTTP/1.1\r\nhost: x\r\nx-slow: a")
        started = time.monotonic()
        while time.monotonic() - started < 5:
            try:
                got = s.recv(65536)
            except TimeoutError:
                s.sendall(b"a")
                continue
            took = time.monotonic() - started
            s.settimeout(5)
            reply = got
            while got:
                got = s.recv(65536)
                reply += got
            return took, reply
    raise AssertionError("no answer within 5 s")


def test_late_headers_get_408_within_a_fifth_of_a_second_of_the_timeout(gw: Gateway) -> None:
    """Three trickling clients, started 0.35 s apart: a periodic sweep of period p can
    answer at most one of them within 0.2 s of its deadline unless p is small."""
    results: list[tuple[float, bytes]] = []
    lock = threading.Lock()

    def client(delay: float) -> None:
        time.sleep(delay)
        got = _trickle_until_answered(gw.port)
        with lock:
            results.append(got)

    threads = [threading.Thread(target=client, args=(d,)) for d in (0.0, 0.35, 0.7)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(15)
    assert len(results) == 3
    for took, reply in results:
        assert reply.startswith(b"HTTP/1.1 408"), reply[:200]
        assert b'"code":"request_timeout"' in reply
        assert HEADER_TIMEOUT_S - 0.01 <= took <= HEADER_TIMEOUT_S + 0.2, took
    _still_serves(gw)


# -- memory after a flood ---------------------------------------------------------------------


def _rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        found = re.search(r"^VmRSS:\s+(\d+) kB$", f.read(), re.M)
    assert found is not None
    return int(found.group(1))


def _flood_one(port: int, data: bytes) -> tuple[socket.socket, bytes]:
    """Sends `data` (headers that never end) and reads what comes back within 3 s; the
    socket stays open on this side."""
    s = socket.create_connection(("127.0.0.1", port), timeout=3)
    reply = b""
    try:
        s.sendall(data)
        while got := s.recv(65536):
            reply += got
    except (TimeoutError, ConnectionResetError, BrokenPipeError):
        pass
    return s, reply


def test_a_header_flood_leaves_the_gateways_memory_where_it_was(scripted: Scripted) -> None:
    """100 connections each send 1 MiB of header lines and never end them. Without a
    limit the gateway holds all of it (over 100 MB) while they stay open."""
    flood = _request(2 * 1024 * 1024)[: 1024 * 1024]  # 1 MiB, no blank line
    g = start_gateway(_config(scripted))  # its own process: a clean baseline
    try:
        pid = g.proc.popen.pid
        for _ in range(3):  # warm every path the flood takes
            _still_serves(g)
            _flood_one(g.port, flood)[0].close()
        time.sleep(0.5)
        before = _rss_kib(pid)
        with concurrent.futures.ThreadPoolExecutor(10) as pool:
            done = list(pool.map(lambda _: _flood_one(g.port, flood), range(100)))
        during = _rss_kib(pid)  # every client socket still open
        for s, _ in done:
            s.close()
        time.sleep(1.0)
        after = _rss_kib(pid)
        assert during <= before * 1.1, (before, during)
        assert after <= before * 1.1, (before, after)
        assert all(reply.startswith(b"HTTP/1.1 431") for _, reply in done)
        _still_serves(g)
    finally:
        g.proc.stop()
