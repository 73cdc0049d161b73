"""Hostile review of `/mcp` (session 72): a client holding a valid key against one real
gateway in front of the test MCP tool server (tests/support/mcp_tool_server.py), over
sockets, with raw HTTP where the input is one no SDK would send.

Defects these tests find (each fails on the code before this session's fixes):
- a `tools/call` refused for its own bounds (a name past 200 characters, arguments
  nested past 128 levels or holding an integer past 64 bits) left no usage row and no
  trace (api/mcp.py `_call` refused it before the tool service opened its record),
  where every other refused call, an unknown tool's among them, has both;
- a request in a session naming an MCP-Protocol-Version other than the one the session
  negotiated was served: a handshake version (`2025-03-26` in a `2025-06-18` session)
  as if it were that one, any other value (`2026-07-28`, `bogus`) by the SDK's
  sessionless transport, which ignored the session and answered -32602 about `_meta`;
  now 400 with Invalid Request (-32600) naming the negotiated version, the tool unrun;
- an `initialize` inside an open session was answered 200 and negotiated anew;
  now 400 with Invalid Request for the request's own id, the session unchanged;
- a GET, a DELETE or another method without a session was refused 400/405 with an
  `Mcp-Session-Id` header naming a session the SDK made for the refusal and
  discarded at once (the transport gives a session id only with an InitializeResult).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from support.gateways import Gateway
from support.mcp_http import ACCEPT, VERSION, in_session, initialize, open_session
from support.mcp_sessions import Tools, tool_gateway
from support.upstreams import Scripted

REGISTRY = [{"name": "web__lookup", "class": "read_only"}]


@pytest.fixture(scope="module")
def gw(scripted: Scripted, tools: Tools) -> Iterator[Gateway]:
    with tool_gateway(scripted, tools, REGISTRY) as g:
        yield g


def _call(rid: Any, name: str, **arguments: Any) -> dict[str, Any]:
    params = {"name": name, "arguments": arguments}
    return {"jsonrpc": "2.0", "id": rid, "method": "tools/call", "params": params}


def _post(g: Gateway, body: Any, headers: dict[str, str]) -> httpx.Response:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(g.url + "/mcp", content=raw, headers=headers, timeout=30)
    assert "Traceback" not in r.text and "pydantic" not in r.text.lower(), r.text
    return r


def _nested(levels: int) -> Any:
    deep: Any = "leaf"
    for _ in range(levels):
        deep = {"a": deep}
    return deep


# -- a refused call is recorded ------------------------------------------------------


def test_a_call_refused_for_its_bounds_has_its_usage_row_and_trace(gw: Gateway) -> None:
    """Each refusal is Invalid params for the request's id, and each is one usage row
    (endpoint tools.call, status error, code invalid_request) whose trace names the
    refusal; the tool never runs."""
    tenant, key = gw.new_tenant("bounds")
    sid = open_session(gw, key)
    h = in_session(key, sid)
    big = (
        b'{"jsonrpc":"2.0","id":3,"method":"tools/call","params":{"name":"web__lookup",'
        b'"arguments":{"q":123456789012345678901234567890}}}'
    )
    bodies: list[Any] = [
        _call(1, "web__lookup", q=_nested(200)),
        _call(2, "web__" + "l" * 300, q="x"),
        big,
    ]
    for i, body in enumerate(bodies, 1):
        r = _post(gw, body, h)
        assert r.status_code == 200, r.text
        reply = r.json()
        assert reply["id"] == i and reply["error"]["code"] == -32602, reply
        assert reply["error"]["data"]["code"] == "invalid_request", reply
    rows = gw.stored_rows(tenant, 3)
    assert len(rows) == 3, rows
    assert sorted(row["model"] for row in rows) == ["(unknown tool)", "web__lookup", "web__lookup"]
    assert {(row["endpoint"], row["status"], row["error_code"]) for row in rows} == {
        ("tools.call", "error", "invalid_request")
    }, rows
    for row in rows:
        decisions = gw.trace(row["request_id"])["decisions"]
        assert [(d["stage"], d["outcome"]) for d in decisions] == [
            ("validate", "reject:invalid_request")
        ], decisions


# -- the negotiated protocol version binds the session --------------------------------


@pytest.mark.parametrize("version", ["2025-03-26", "2026-07-28", "bogus"])
def test_a_version_the_session_did_not_negotiate_is_refused_400(
    gw: Gateway, tools: Tools, version: str
) -> None:
    """The session negotiated 2025-06-18: a request naming another version is 400
    Invalid Request naming the negotiated one, the tool unrun; the same request with
    the negotiated version is served."""
    sid = open_session(gw, gw.key)
    q = "ver-" + os.urandom(4).hex()
    h = {**in_session(gw.key, sid), "mcp-protocol-version": version}
    r = _post(gw, _call(5, "web__lookup", q=q), h)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["code"] == -32600 and VERSION in error["message"], error
    assert error["data"]["code"] == "invalid_header", error
    r = httpx.get(gw.url + "/mcp", headers={**h, "accept": "text/event-stream"}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["code"] == -32600, r.text
    assert Tools.runs(tools.http_log, "lookup", q=q) == 0
    r = _post(gw, _call(6, "web__lookup", q=q), in_session(gw.key, sid))
    assert r.status_code == 200 and r.json()["result"]["content"][0]["text"] == f"found: {q}"


def test_an_initialize_inside_an_open_session_is_refused(gw: Gateway) -> None:
    """Initialization happens once per session: a second `initialize` (here asking for
    another version) is 400 Invalid Request for its own id; the session goes on with
    the version it negotiated."""
    sid = open_session(gw, gw.key)
    again = initialize()
    again["id"] = "re-init"
    again["params"]["protocolVersion"] = "2025-03-26"
    r = _post(gw, again, in_session(gw.key, sid))
    assert r.status_code == 400, r.text
    reply = r.json()
    assert reply["id"] == "re-init" and reply["error"]["code"] == -32600, reply
    assert "result" not in reply
    r = _post(gw, _call(7, "web__lookup", q="after"), in_session(gw.key, sid))
    assert r.status_code == 200 and r.json()["result"]["content"][0]["text"] == "found: after"


# -- a session id comes only with an InitializeResult ---------------------------------


@pytest.mark.parametrize(("method", "status"), [("GET", 400), ("DELETE", 400), ("PUT", 405)])
def test_a_request_without_a_session_is_refused_naming_none(
    gw: Gateway, method: str, status: int
) -> None:
    headers = {"authorization": f"Bearer {gw.key}", **ACCEPT, "mcp-protocol-version": VERSION}
    r = httpx.request(method, gw.url + "/mcp", headers=headers, timeout=30)
    assert r.status_code == status, r.text
    assert r.json()["error"]["code"] == -32600, r.text
    assert "mcp-session-id" not in r.headers, dict(r.headers)
    if method == "PUT":  # a session's own refusal still names it
        sid = open_session(gw, gw.key)
        r = httpx.put(gw.url + "/mcp", headers=in_session(gw.key, sid), timeout=30)
        assert r.status_code == 405 and r.headers["mcp-session-id"] == sid, r.text
