"""A client that hangs up mid-body is the client's doing, not a gateway bug (issue #41).

Real gateway over real sockets (scripted instant upstream): a raw client declares a
1000-byte body, sends 10 bytes and closes. The usage row must say `cancelled` with
`client_disconnected` (never `internal_error`), the log must carry one INFO line and
no ERROR or traceback, and /metrics must count it under its endpoint. A body whose
chunked framing breaks is a 400 on the wire and `invalid_http` in the ledger.
"""

from __future__ import annotations

import asyncio
import os
import re
import socket
import time
from typing import Any

import httpx
import pytest
from starlette.requests import Request

from support.gateways import Gateway
from switchyard.api.body import BAD_FRAMING, read_body
from switchyard.errors import ClientDisconnected, InvalidRequest

# What a hang-up must never leave in the gateway's log.
NOISE = re.compile(r"Traceback|ClientDisconnect\b| ERROR |unhandled error")


def _key(gw: Gateway) -> tuple[str, str]:
    tid = "cd" + os.urandom(4).hex()
    gw.create_tenant(tid)
    return tid, str(gw.create_key(tid)["key"])


def _send_and_close(gw: Gateway, data: bytes, pause_s: float = 0.2) -> None:
    """Send `data` (headers and part of a body) and hang up without reading."""
    with socket.create_connection(("127.0.0.1", gw.port), timeout=10) as s:
        s.sendall(data)
        time.sleep(pause_s)  # the gateway is reading the body when the client leaves


def _exchange(gw: Gateway, first: bytes, then: bytes) -> bytes:
    """Send `first`, then `then` a moment later; everything the gateway answers."""
    with socket.create_connection(("127.0.0.1", gw.port), timeout=10) as s:
        s.sendall(first)
        time.sleep(0.2)
        s.sendall(then)
        chunks = []
        try:
            while got := s.recv(65536):
                chunks.append(got)
        except (TimeoutError, ConnectionResetError):
            pass
        return b"".join(chunks)


def _rows(gw: Gateway, tenant: str, timeout_s: float = 15.0) -> list[dict[str, Any]]:
    """The tenant's usage rows, once there is one (the hang-up is noticed and settled
    a moment after the client left)."""
    deadline = time.monotonic() + timeout_s
    while True:
        rows = gw.usage(tenant=tenant, limit=10)
        if rows or time.monotonic() > deadline:
            return rows
        time.sleep(0.1)


def _disconnects(gw: Gateway, endpoint: str) -> float:
    r = httpx.get(gw.url + "/metrics", headers=gw.admin, timeout=10)
    assert r.status_code == 200, r.text
    text = r.text
    found = re.search(
        rf'^switchyard_client_disconnects_total\{{endpoint="{re.escape(endpoint)}"\}} (\S+)$',
        text,
        re.M,
    )
    return float(found.group(1)) if found else 0.0


def _head(path: str, key: str, extra: str = "Content-Length: 1000\r\n") -> bytes:
    return (
        f"POST {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key}\r\n"
        f"Content-Type: application/json\r\n{extra}\r\n"
    ).encode()


def _still_serves(gw: Gateway, key: str) -> None:
    r = httpx.post(
        gw.url + "/v1/chat/completions",
        json={"model": "cheap", "messages": [{"role": "user", "content": "hi"}]},
        headers={"Authorization": f"Bearer {key}"},
        timeout=30,
    )
    assert r.status_code == 200, r.text


@pytest.mark.parametrize(
    ("path", "endpoint"),
    [
        ("/v1/chat/completions", "chat.completions"),
        ("/v1/completions", "completions"),
        ("/v1/embeddings", "embeddings"),
    ],
)
def test_a_client_that_leaves_mid_body_is_cancelled_not_an_error(
    gw: Gateway, path: str, endpoint: str
) -> None:
    tid, key = _key(gw)
    before = _disconnects(gw, endpoint)
    log_before = len(gw.proc.output())
    _send_and_close(gw, _head(path, key) + b'{"model":"')  # 10 of 1000 bytes

    rows = _rows(gw, tid)
    assert len(rows) == 1, rows
    row = rows[0]
    assert (row["status"], row["error_code"]) == ("cancelled", "client_disconnected"), row
    assert row["endpoint"] == endpoint

    log = gw.proc.output()[log_before:]
    assert not NOISE.search(log), log
    # One INFO line names the request, so an operator can still find it.
    line = [ln for ln in log.splitlines() if row["request_id"] in ln]
    assert len(line) == 1 and " INFO " in line[0], log
    # 10 bytes, or none if the gateway first read after the client had gone.
    assert re.search(r"the client left after (10|0) of 1000 body bytes", line[0]), line

    assert _disconnects(gw, endpoint) == before + 1
    _still_serves(gw, key)


def test_a_broken_chunked_body_is_400_invalid_http_not_a_disconnect(gw: Gateway) -> None:
    tid, key = _key(gw)
    before = _disconnects(gw, "chat.completions")
    log_before = len(gw.proc.output())
    head = _head("/v1/chat/completions", key, "Transfer-Encoding: chunked\r\n")
    reply = _exchange(gw, head + b'5\r\n{"mod\r\n', b"zz-not-a-chunk-size\r\n\r\n")

    assert reply.startswith(b"HTTP/1.1 400"), reply[:300]
    assert b'"code":"invalid_http"' in reply
    rows = _rows(gw, tid)
    assert len(rows) == 1, rows
    assert (rows[0]["status"], rows[0]["error_code"]) == ("error", "invalid_http"), rows[0]
    assert not NOISE.search(gw.proc.output()[log_before:])
    assert _disconnects(gw, "chat.completions") == before
    _still_serves(gw, key)


@pytest.mark.parametrize(
    ("path", "auth"),
    [
        ("/admin/tenants", True),  # read_json, behind the admin key
        ("/console/login", False),  # a form anyone can post to
    ],
)
def test_a_hang_up_on_the_admin_and_console_bodies_logs_no_error(
    gw: Gateway, path: str, auth: bool
) -> None:
    log_before = len(gw.proc.output())
    key = gw.admin["Authorization"].removeprefix("Bearer ") if auth else "none"
    _send_and_close(gw, _head(path, key) + b'{"id":"ab"', pause_s=0.5)
    # The same connection's fate is settled well within this; a request after it
    # proves the gateway noticed and moved on.
    r = httpx.get(gw.url + "/admin/tenants", headers=gw.admin, timeout=10)
    assert r.status_code == 200
    time.sleep(0.3)
    log = gw.proc.output()[log_before:]
    assert not NOISE.search(log), log


# -- the reader alone --------------------------------------------------------------


def _gone(scope_extra: dict[str, Any]) -> Request:
    """A request whose client sends 4 bytes of a 1000-byte body, then is gone."""
    messages: list[dict[str, Any]] = [
        {"type": "http.request", "body": b'{"a"', "more_body": True},
        {"type": "http.disconnect"},
    ]

    async def receive() -> dict[str, Any]:
        return messages.pop(0)

    scope = {"type": "http", "method": "POST", "headers": [], **scope_extra}
    return Request(scope, receive)


def test_the_reader_tells_a_hang_up_from_broken_framing() -> None:
    with pytest.raises(ClientDisconnected) as gone:
        asyncio.run(read_body(_gone({}), 10_000, "1000"))
    assert (gone.value.code, gone.value.message) == (
        "client_disconnected",
        "the client left after 4 of 1000 body bytes",
    )
    with pytest.raises(InvalidRequest) as bad:  # the protocol marked the scope
        asyncio.run(read_body(_gone({BAD_FRAMING: True}), 10_000))
    assert (bad.value.status, bad.value.code) == (400, "invalid_http")
