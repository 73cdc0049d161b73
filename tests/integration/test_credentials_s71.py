"""One credential per request on `/mcp` and the admin API, and a tool server's long SSE
reply. Over sockets against one real gateway in front of a scripted
Streamable HTTP tool server.

Defects these tests find (each fails on the code before this session's fixes):
- the model endpoints refuse a credential header sent on two lines (401: two lines are
  two credentials, api/body.py `header_map`, policy/auth.py), but `/mcp` read its
  headers into a dict of its own (api/mcp_wire.py `_headers`, the first line wins), so
  a request with the valid key on the first `Authorization` line and anything on a
  second was served: a tool call on the fast path, an `initialize` and a DELETE on the
  SDK's path (the DELETE ended the session), and through a worker's relay
  (api/mcp_relay.py reads the same `_headers`);
- the admin guard (api/admin/guard.py `require_admin`) read `Authorization` with
  Starlette's `Headers.get` (the first line): the admin key followed by a bogus line
  read the admin API and /metrics, and changed a tenant.

Guarded (passes before and after; the fix made it linear): a tool
server that writes 200,000 short lines before its answer on an SSE reply
(engines/mcp_forward.py `_read_sse` copied the rest of its buffer for every line) is
still answered right, its answer's `data` split over two lines with CR LF endings.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from support.gateways import Gateway, cheap_config, start_gateway
from support.mcp_http import (
    ACCEPT,
    VERSION,
    ScriptedToolServer,
    in_session,
    initialize,
    open_session,
)
from support.mcp_sessions import wait_tools_ready
from support.procs import http_server
from support.upstreams import Scripted

LINES = 200_000  # ":\r\n" each: 600 kB, inside the default max_result_bytes (1 MiB)
REGISTRY = [{"name": "chatty__lines", "class": "read_only"}]


class _Chatty(ScriptedToolServer):
    """A tool server whose `lines` answers on an SSE stream: LINES comment lines, then
    the answer, its JSON split over two `data:` lines, every line ending CR LF; `ran`
    holds each run's `q`."""

    name = "chatty"
    tools = [{"name": "lines", "inputSchema": {"type": "object"}}]
    ran: list[str] = []

    def call(self, msg: dict[str, Any]) -> Any:
        q = str(msg["params"].get("arguments", {}).get("q"))
        self.ran.append(q)
        result = {"content": [{"type": "text", "text": f"after the lines: {q}"}]}
        head = json.dumps({"jsonrpc": "2.0", "id": msg["id"]})[:-1] + ","
        tail = json.dumps({"result": result})[1:]
        events = ":\r\n" * LINES + f"event: message\r\ndata: {head}\r\ndata: {tail}\r\n\r\n"
        self.reply(200, "text/event-stream", events.encode())
        return None


@pytest.fixture(scope="module")
def gw(scripted: Scripted) -> Iterator[Gateway]:
    with http_server(_Chatty) as base:
        config = cheap_config(
            scripted,
            mcp={"servers": [{"name": "chatty", "url": base + "/mcp"}]},
            tools={"registry": REGISTRY},
        )
        g = start_gateway(config)
        try:
            wait_tools_ready(g, ("chatty",))
            yield g
        finally:
            g.proc.stop()


@pytest.fixture(scope="module")
def workers(scripted: Scripted) -> Iterator[Gateway]:
    """`serve --workers 2`: every /mcp request is a worker's, relayed to the control
    plane's endpoint (api/mcp_relay.py)."""
    with http_server(_Chatty) as base:
        config = cheap_config(
            scripted,
            mcp={"servers": [{"name": "chatty", "url": base + "/mcp"}]},
            tools={"registry": REGISTRY},
        )
        g = start_gateway(config, serve_args=("--workers", "2"))
        try:
            wait_tools_ready(g, ("chatty",))
            yield g
        finally:
            g.proc.stop()


def _call(rid: int, q: str) -> dict[str, Any]:
    params = {"name": "chatty__lines", "arguments": {"q": q}}
    return {"jsonrpc": "2.0", "id": rid, "method": "tools/call", "params": params}


def _twice(headers: dict[str, str], second: str) -> list[tuple[str, str]]:
    """`headers` with a second `authorization` line holding `second`."""
    return [*headers.items(), ("authorization", second)]


def _jsonrpc_401(r: httpx.Response) -> None:
    """The /mcp refusal of a repeated credential: 401 with a JSON-RPC error body."""
    assert r.status_code == 401, r.text
    body = r.json()
    assert body["jsonrpc"] == "2.0" and body["id"] is None, body
    assert body["error"]["data"]["code"] == "invalid_api_key", body
    assert "more than once" in body["error"]["message"], body
    assert r.headers["www-authenticate"].startswith("Bearer"), r.headers


def _admin_401(r: httpx.Response) -> None:
    """The admin API's refusal: 401 with its own (OpenAI-shaped) error body."""
    assert r.status_code == 401, r.text
    error = r.json()["error"]
    assert error["type"] == "authentication_error", error
    assert error["code"] == "invalid_admin_key", error
    assert "more than once" in error["message"], error


# -- /mcp ------------------------------------------------------------------------------


@pytest.mark.parametrize("second", ["same", "bogus"])
def test_a_fast_path_call_with_two_authorization_lines_is_a_401_and_runs_nothing(
    gw: Gateway, second: str
) -> None:
    """A `tools/call` on an open session (the fast path) with the valid key on the first
    line and the same key, or a bogus one, on a second: refused 401 in the JSON-RPC
    shape before the tool runs; with one line the same call is served."""
    sid = open_session(gw, gw.key)
    q = f"twice-{second}-" + os.urandom(3).hex()
    h = in_session(gw.key, sid)
    line = h["authorization"] if second == "same" else "Bearer sy-not-a-key"
    r = httpx.post(gw.url + "/mcp", json=_call(5, q), headers=_twice(h, line), timeout=60)
    _jsonrpc_401(r)
    assert q not in _Chatty.ran
    r = httpx.post(gw.url + "/mcp", json=_call(6, q), headers=h, timeout=60)
    assert r.status_code == 200 and r.json()["id"] == 6, r.text
    assert _Chatty.ran.count(q) == 1


def test_an_initialize_with_two_authorization_lines_opens_no_session(gw: Gateway) -> None:
    """An `initialize` goes to the SDK's transport: the repeated credential is refused
    before it, so no session is opened (no `Mcp-Session-Id` comes back)."""
    h = {"authorization": f"Bearer {gw.key}", **ACCEPT}
    r = httpx.post(gw.url + "/mcp", json=initialize(), headers=_twice(h, h["authorization"]))
    _jsonrpc_401(r)
    assert "mcp-session-id" not in r.headers


def test_a_delete_with_two_authorization_lines_leaves_the_session_open(gw: Gateway) -> None:
    """A DELETE (the SDK's path) with a second `Authorization` line is refused and ends
    nothing: the session still serves a call afterwards."""
    sid = open_session(gw, gw.key)
    h = {
        "authorization": f"Bearer {gw.key}",
        "mcp-session-id": sid,
        "mcp-protocol-version": VERSION,
    }
    r = httpx.delete(gw.url + "/mcp", headers=_twice(h, "Bearer sy-not-a-key"), timeout=30)
    _jsonrpc_401(r)
    q = "after-delete-" + os.urandom(3).hex()
    r = httpx.post(gw.url + "/mcp", json=_call(9, q), headers=in_session(gw.key, sid), timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["result"]["content"][0]["text"] == f"after the lines: {q}", r.text


def test_a_workers_relay_refuses_two_authorization_lines(workers: Gateway) -> None:
    """Through a worker's relay (which authenticates with the same `_headers`, and
    forwards both lines to the control plane's endpoint): 401, and no tool runs."""
    h = {"authorization": f"Bearer {workers.key}", **ACCEPT}
    r = httpx.post(
        workers.url + "/mcp", json=initialize(), headers=_twice(h, "Bearer sy-not-a-key")
    )
    _jsonrpc_401(r)
    assert "mcp-session-id" not in r.headers
    sid = open_session(workers, workers.key)
    q = "relayed-" + os.urandom(3).hex()
    both = _twice(in_session(workers.key, sid), "Bearer sy-not-a-key")
    _jsonrpc_401(httpx.post(workers.url + "/mcp", json=_call(3, q), headers=both, timeout=60))
    assert q not in _Chatty.ran


# -- a long SSE reply --------------------------------------------------------------------


def test_an_answer_after_many_short_sse_lines_comes_back_whole(gw: Gateway) -> None:
    """LINES comment lines before the answer, whose JSON spans two `data:` lines ending
    CR LF: the call's result is the tool's, for the request's own id."""
    sid = open_session(gw, gw.key)
    q = "many-lines-" + os.urandom(3).hex()
    r = httpx.post(gw.url + "/mcp", json=_call(11, q), headers=in_session(gw.key, sid), timeout=60)
    assert r.status_code == 200, r.text
    reply = r.json()
    assert reply["id"] == 11 and "error" not in reply, reply
    assert reply["result"]["content"] == [{"type": "text", "text": f"after the lines: {q}"}]
    assert reply["result"]["isError"] is False, reply


# -- the admin API -----------------------------------------------------------------------


@pytest.mark.parametrize("second", ["same", "bogus"])
def test_the_admin_api_refuses_two_authorization_lines(gw: Gateway, second: str) -> None:
    """The admin key on the first line and the same key, or a bogus one, on a second:
    401 in the admin API's error shape, on a read, on /metrics and on a change (which
    changes nothing); /readyz shows only what it shows everyone."""
    line = gw.admin["Authorization"] if second == "same" else "Bearer not-the-admin-key"
    both = _twice(gw.admin, line)
    _admin_401(httpx.get(gw.url + "/admin/tenants", headers=both))
    _admin_401(httpx.get(gw.url + "/metrics", headers=both))
    tenant = f"twice-{second}-" + os.urandom(3).hex()
    _admin_401(httpx.post(gw.url + "/admin/tenants", json={"id": tenant}, headers=both))
    r = httpx.get(gw.url + f"/admin/tenants/{tenant}", headers=gw.admin)
    assert r.status_code == 404, r.text
    ready = httpx.get(gw.url + "/readyz", headers=both).json()
    assert "upstream" not in json.dumps(ready), ready
    assert "upstream" in json.dumps(httpx.get(gw.url + "/readyz", headers=gw.admin).json())
    assert httpx.get(gw.url + "/admin/tenants", headers=gw.admin).status_code == 200
