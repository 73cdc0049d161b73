"""Single-valued headers sent twice with different values, on `/mcp`: one real gateway
in front of the test MCP tool server (tests/support/mcp_tool_server.py), raw HTTP
(no SDK sends a header twice), a valid key.

Defects these tests find (each fails on the code before s73):
- `Mcp-Session-Id` and `MCP-Protocol-Version` were not single-valued headers
  (api/body.py `SINGLE_HEADERS`): sent twice with different values, the gateway read
  the first line while a proxy in front, or the SDK's transport, may take the other,
  so a call could be authorized for one session and served in another, or checked
  against one version and served under the other. Now 400 naming the header, in
  JSON-RPC's error shape, before the session is looked up; the tool does not run;
- `/mcp` never read which single-valued headers came with two values (the model
  endpoints refuse them, policy/headers.py `read`): a `tools/call` with two different
  `x-task-id` lines was served, counted in the first task. Now the same 400.
The same value on two lines is one value: served.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from support.gateways import Gateway
from support.mcp_http import ACCEPT, VERSION, initialize, open_session
from support.mcp_sessions import Tools, tool_gateway
from support.upstreams import Scripted

REGISTRY = [{"name": "web__lookup", "class": "read_only"}]
OTHER_VERSION = "2025-03-26"  # a handshake-era version the gateway also speaks


@pytest.fixture(scope="module")
def gw(scripted: Scripted, tools: Tools) -> Iterator[Gateway]:
    with tool_gateway(scripted, tools, REGISTRY) as g:
        yield g


def _call(rid: int, q: str) -> bytes:
    params = {"name": "web__lookup", "arguments": {"q": q}}
    return json.dumps(
        {"jsonrpc": "2.0", "id": rid, "method": "tools/call", "params": params}
    ).encode()


def _post(g: Gateway, body: bytes, headers: list[tuple[str, str]]) -> httpx.Response:
    r = httpx.post(g.url + "/mcp", content=body, headers=headers, timeout=30)
    assert "Traceback" not in r.text, r.text
    return r


def _headers(key: str, sid: str, **more: str | tuple[str, str]) -> list[tuple[str, str]]:
    """A request in session `sid` as header lines; a tuple value is sent on two lines."""
    one: dict[str, str | tuple[str, str]] = {
        "authorization": f"Bearer {key}",
        **ACCEPT,
        "mcp-session-id": sid,
        "mcp-protocol-version": VERSION,
        **more,
    }
    lines: list[tuple[str, str]] = []
    for name, value in one.items():
        for v in value if isinstance(value, tuple) else (value,):
            lines.append((name, v))
    return lines


def _refused(r: httpx.Response, header: str, *values: str) -> dict[str, Any]:
    """A 400 in JSON-RPC's error shape naming `header` as sent twice, echoing none of
    its `values`."""
    assert r.status_code == 400, r.text
    assert r.headers["content-type"].startswith("application/json")
    reply = r.json()
    assert set(reply) == {"jsonrpc", "id", "error"} and reply["jsonrpc"] == "2.0", reply
    assert reply["id"] is None, reply
    error = reply["error"]
    # Every invalid header on /mcp: Invalid params (-32602), ours in `data`.
    assert error["code"] == -32602, error
    assert error["data"] == {
        "type": "invalid_request_error",
        "code": "invalid_header",
        "status": 400,
    }
    assert header in error["message"] and "more than once" in error["message"], error
    assert "mcp-session-id" not in r.headers  # no session named for a refusal
    assert not any(v in r.text for v in values), r.text
    return dict(reply)


def test_two_session_ids_are_refused_400_before_either_session_is_used(
    gw: Gateway, tools: Tools
) -> None:
    """Two sessions the key really holds: which one the call belongs to is a guess,
    in either order; refused, the tool unrun; each session alone still serves."""
    first, second = open_session(gw, gw.key), open_session(gw, gw.key)
    q = "sid-" + os.urandom(4).hex()
    for pair in ((first, second), (second, first)):
        r = _post(gw, _call(1, q), _headers(gw.key, first, **{"mcp-session-id": pair}))
        _refused(r, "mcp-session-id", *pair)
    # An unknown session on the second line: the same 400, not the first one's answer.
    r = _post(gw, _call(2, q), _headers(gw.key, first, **{"mcp-session-id": (first, "nope")}))
    _refused(r, "mcp-session-id", first, "nope")
    assert Tools.runs(tools.http_log, "lookup", q=q) == 0
    for n, sid in enumerate((first, second)):
        r = _post(gw, _call(3 + n, q), _headers(gw.key, sid))
        assert r.status_code == 200, r.text
        assert r.json()["result"]["content"][0]["text"] == f"found: {q}"
    assert Tools.runs(tools.http_log, "lookup", q=q) == 2


def test_two_protocol_versions_are_refused_400(gw: Gateway, tools: Tools) -> None:
    """The negotiated version and another one the gateway speaks, in either order."""
    sid = open_session(gw, gw.key)
    q = "ver-" + os.urandom(4).hex()
    for pair in ((VERSION, OTHER_VERSION), (OTHER_VERSION, VERSION)):
        h = _headers(gw.key, sid, **{"mcp-protocol-version": pair})
        _refused(_post(gw, _call(1, q), h), "mcp-protocol-version", *pair)
    # Without a session too (an initialize): refused before one is opened.
    init = initialize("twice")
    h = [
        ("authorization", f"Bearer {gw.key}"),
        *ACCEPT.items(),
        ("mcp-protocol-version", VERSION),
        ("mcp-protocol-version", OTHER_VERSION),
    ]
    _refused(_post(gw, json.dumps(init).encode(), h), "mcp-protocol-version", OTHER_VERSION)
    assert Tools.runs(tools.http_log, "lookup", q=q) == 0


def test_two_task_ids_on_mcp_are_refused_400(gw: Gateway, tools: Tools) -> None:
    sid = open_session(gw, gw.key)
    q = "task-" + os.urandom(4).hex()
    h = _headers(gw.key, sid, **{"x-task-id": ("task-a", "task-b")})
    _refused(_post(gw, _call(1, q), h), "x-task-id", "task-a", "task-b")
    assert Tools.runs(tools.http_log, "lookup", q=q) == 0


def test_the_same_value_on_two_lines_is_one_value(gw: Gateway, tools: Tools) -> None:
    sid = open_session(gw, gw.key)
    q = "same-" + os.urandom(4).hex()
    h = _headers(
        gw.key,
        sid,
        **{"mcp-session-id": (sid, sid), "mcp-protocol-version": (VERSION, VERSION)},
    )
    r = _post(gw, _call(1, q), h)
    assert r.status_code == 200, r.text
    assert r.json()["result"]["content"][0]["text"] == f"found: {q}"
    assert Tools.runs(tools.http_log, "lookup", q=q) == 1
