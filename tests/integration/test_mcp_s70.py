"""Hostile review of `/mcp` (session 70): what a tool server may answer and what a client
may send, over sockets against one real gateway in front of a scripted Streamable HTTP
tool server.

Defects these tests find (each fails on the code before this session's fixes):
- a tool result nested deeper than the JSON writer goes (orjson stops at 254 levels,
  pydantic's serializer at 255) answered -32603 with a traceback in the gateway log
  (mcp_service/calls.py `_result`, engines/mcp_forward.py `_outcome`); one holding an
  integer past 64 bits likewise: the forwarder read it as a float (orjson) or the
  writer refused it. Now: `tool_result_too_large` for the caller's own id, the call
  recorded (trace decision `too_large`, usage row with the error code), a side effect
  done and never run again;
- a 2026-07-28 (sessionless) request whose `params` is not an object was -32600 with
  id null (the SDK's modern transport refuses it before it reads the id): now -32602
  Invalid params for the request's own id, as on the handshake transport, whose
  refusal also carried a string id past 128 characters as null.
"""

from __future__ import annotations

import asyncio
import io
import json
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import httpx2
import pytest
from mcp import ClientSession, MCPError
from mcp.client.streamable_http import streamable_http_client

from support.gateways import Gateway, cheap_config, start_gateway
from support.mcp_http import ACCEPT, ScriptedToolServer, in_session, open_session
from support.mcp_sessions import wait_tools_ready
from support.procs import http_server
from support.upstreams import Scripted

MODERN = "2026-07-28"


def _nested(levels: int) -> Any:
    deep: Any = "leaf"
    for _ in range(levels):
        deep = {"a": deep}
    return deep


class _Odd(ScriptedToolServer):
    """A tool server whose tools answer what a hostile or broken server may: a result
    nested `levels` deep, one holding an integer past 64 bits; `ran` counts each run by
    its argument `q`."""

    name = "odd"
    tools = [
        {"name": n, "inputSchema": {"type": "object"}}
        for n in ("nest", "nest_once", "bigint", "plain", "chatty")
    ]
    ran: list[str] = []
    answers: list[dict[str, Any]] = []  # the gateway's replies to this server's requests

    def do_POST(self) -> None:
        raw = self.rfile.read(int(self.headers["content-length"]))
        msg = json.loads(raw)
        if isinstance(msg, dict) and "id" in msg and "method" not in msg:
            self.answers.append(msg)
            self.reply(202, "application/json", b"")
            return
        self.rfile = io.BytesIO(raw)
        super().do_POST()

    def call(self, msg: dict[str, Any]) -> Any:
        tool, args = msg["params"]["name"], msg["params"].get("arguments") or {}
        self.ran.append(str(args.get("q")))
        if tool == "chatty":  # an SSE reply: many pings of its own, then the result
            q = args["q"]
            pings = [{"jsonrpc": "2.0", "id": f"{q}-{i}", "method": "ping"} for i in range(300)]
            result = {"content": [{"type": "text", "text": f"chatty {q}"}]}
            done = {"jsonrpc": "2.0", "id": msg["id"], "result": result}
            events = "".join(f"event: message\ndata: {json.dumps(m)}\n\n" for m in [*pings, done])
            self.reply(200, "text/event-stream", events.encode())
            return None
        if tool in ("nest", "nest_once"):
            deep = _nested(int(args["levels"]))
            return {"content": [{"type": "text", "text": "deep"}], "structuredContent": deep}
        if tool == "bigint":
            n = 123456789012345678901234567890
            return {"content": [{"type": "text", "text": str(n)}], "structuredContent": {"n": n}}
        return {"content": [{"type": "text", "text": f"plain {args.get('q')}"}]}


# A stdio tool server that writes its JSON-RPC lines itself: `nest` answers a result
# nested `levels` deep, `bigint` one holding an integer past 64 bits; each call's
# arguments are appended to the log file it is given.
RAW_STDIO = r"""
import json, sys
for line in sys.stdin:
    msg = json.loads(line)
    if "id" not in msg:
        continue
    method, res = msg.get("method"), {}
    if method == "initialize":
        res = {"protocolVersion": msg["params"]["protocolVersion"], "capabilities": {"tools": {}},
               "serverInfo": {"name": "raw", "version": "1"}}
    elif method == "tools/list":
        res = {"tools": [{"name": n, "inputSchema": {"type": "object"}} for n in ("nest", "bigint")]}
    elif method == "tools/call":
        args = msg["params"].get("arguments") or {}
        with open(sys.argv[1], "a") as f:
            f.write(json.dumps(args) + "\n")
        deep = "leaf"
        for _ in range(int(args.get("levels", 0))):
            deep = {"a": deep}
        if msg["params"]["name"] == "bigint":
            deep = {"n": 123456789012345678901234567890}
        res = {"content": [{"type": "text", "text": "raw"}], "structuredContent": deep}
    sys.stdout.write(json.dumps({"jsonrpc": "2.0", "id": msg["id"], "result": res}) + "\n")
    sys.stdout.flush()
"""

REGISTRY = [
    {"name": "odd__chatty", "class": "read_only"},
    {"name": "raw__nest", "class": "read_only"},
    {"name": "raw__bigint", "class": "read_only"},
    {"name": "odd__nest", "class": "read_only"},
    {"name": "odd__nest_once", "class": "side_effect"},
    {"name": "odd__bigint", "class": "read_only"},
    {"name": "odd__plain", "class": "read_only"},
]


@pytest.fixture(scope="module")
def raw_log(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("raw-stdio") / "calls.log"


@pytest.fixture(scope="module")
def gw(scripted: Scripted, raw_log: Path) -> Iterator[Gateway]:
    script = raw_log.with_name("raw_stdio.py")
    script.write_text(RAW_STDIO)
    raw_log.touch()
    # `timeout_s` 5: a reply the gateway cannot read would end as a timeout this soon.
    raw = {"name": "raw", "command": [sys.executable, str(script), str(raw_log)], "timeout_s": 5}
    with http_server(_Odd) as base:
        config = cheap_config(
            scripted,
            mcp={"servers": [{"name": "odd", "url": base + "/mcp"}, raw]},
            tools={"registry": REGISTRY},
        )
        g = start_gateway(config)
        try:
            wait_tools_ready(g, ("odd", "raw"))
            yield g
        finally:
            g.proc.stop()


def _post(g: Gateway, body: Any, headers: dict[str, str]) -> tuple[int, Any]:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(g.url + "/mcp", content=raw, headers=headers, timeout=30)
    assert "Traceback" not in r.text and "pydantic" not in r.text.lower(), r.text
    return r.status_code, r.json() if r.content else None


def _call(rid: Any, name: str, **arguments: Any) -> dict[str, Any]:
    params = {"name": name, "arguments": arguments}
    return {"jsonrpc": "2.0", "id": rid, "method": "tools/call", "params": params}


def _modern(g: Gateway, **more: str) -> dict[str, str]:
    return {"authorization": f"Bearer {g.key}", **ACCEPT, "mcp-protocol-version": MODERN, **more}


def _recorded(g: Gateway, tool: str, q: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """The usage row and the trace of the call of `tool` whose arguments hold `q` and
    that reached the tool (a repeat answered from its record did not)."""
    deadline = time.monotonic() + 10
    seen: set[str] = set()
    while time.monotonic() < deadline:
        for row in g.usage(limit=200):
            rid = row["request_id"]
            if row.get("model") != tool or rid in seen:
                continue
            seen.add(rid)
            trace = g.trace(rid)
            ran = any(d["stage"] == "tool_exec" for d in trace["decisions"])
            if ran and q in json.dumps(trace):
                return row, trace
        time.sleep(0.1)
    raise AssertionError(f"no usage row of {tool} with {q}")


def _refusal_recorded(g: Gateway, tool: str, q: str, why: str) -> None:
    """The call's usage row has the code, its trace the `too_large` decision and why."""
    row, trace = _recorded(g, tool, q)
    assert row["error_code"] == "tool_result_too_large", row
    execs = [d for d in trace["decisions"] if d["stage"] == "tool_exec"]
    assert [d["outcome"] for d in execs] == ["too_large"], trace
    assert why in execs[0]["evidence"]["result_refused"], execs
    assert "tools/call failed" not in g.proc.output()  # no traceback of ours


# -- what a tool server answers ---------------------------------------------------------


@pytest.mark.parametrize("levels", [130, 252, 300])
def test_a_result_nested_too_deep_is_refused_for_the_callers_id(gw: Gateway, levels: int) -> None:
    """A result nested past what the gateway writes is `tool_result_too_large` for the
    request's own id, recorded as the other refused results are; nothing crashes, and
    the same session goes on serving."""
    sid = open_session(gw, gw.key)
    q = f"deep-{levels}-" + os.urandom(3).hex()
    status, reply = _post(gw, _call(7, "odd__nest", q=q, levels=levels), in_session(gw.key, sid))
    assert status == 200 and reply["id"] == 7, reply
    assert reply["error"]["data"]["code"] == "tool_result_too_large", reply
    assert "nest" in reply["error"]["message"] and "Error" not in reply["error"]["message"]
    assert _Odd.ran.count(q) == 1  # read-only, but a result is no failure: not retried
    _refusal_recorded(gw, "odd__nest", q, "nests deeper than 128 levels")
    _, reply = _post(gw, _call(8, "odd__plain", q="after"), in_session(gw.key, sid))
    assert reply["result"]["content"][0]["text"] == "plain after", reply


def test_a_result_within_the_depth_is_passed_on(gw: Gateway) -> None:
    sid = open_session(gw, gw.key)
    status, reply = _post(gw, _call(9, "odd__nest", q="d100", levels=100), in_session(gw.key, sid))
    assert status == 200 and reply["id"] == 9, reply
    assert reply["result"]["structuredContent"] == _nested(100), str(reply)[:300]


def test_a_too_deep_side_effect_ran_once_and_is_not_run_again(gw: Gateway) -> None:
    """A side effect whose result is refused ran: it is recorded done (`too_large`), and a
    repeat of its call id gets the refusal again, never a second run."""
    sid = open_session(gw, gw.key)
    q = "once-" + os.urandom(3).hex()
    call_id = "c-" + q
    body = {**_call(11, "odd__nest_once", q=q, levels=300)}
    body["params"]["_meta"] = {"call_id": call_id}
    status, first = _post(gw, body, in_session(gw.key, sid))
    assert (
        status == 200
        and first["id"] == 11
        and first["error"]["data"]["code"] == "tool_result_too_large"
    ), first
    assert "will not be run again" in first["error"]["message"], first
    body["id"] = 12
    _, again = _post(gw, body, in_session(gw.key, sid))
    assert again["id"] == 12 and again["error"]["data"]["code"] == "tool_result_too_large"
    assert "ran once already" in again["error"]["message"], again
    assert _Odd.ran.count(q) == 1
    _refusal_recorded(gw, "odd__nest_once", q, "nests deeper than 128 levels")


def test_a_result_with_an_integer_past_64_bits_is_refused_not_changed(gw: Gateway) -> None:
    """123456789012345678901234567890 would reach the client as another number (read as
    a float) or not be written at all: refused, for the caller's id, and recorded."""
    sid = open_session(gw, gw.key)
    q = "big-" + os.urandom(3).hex()
    status, reply = _post(gw, _call("b-1", "odd__bigint", q=q), in_session(gw.key, sid))
    assert status == 200 and reply["id"] == "b-1", reply
    assert reply["error"]["data"]["code"] == "tool_result_too_large", reply
    assert "64 bits" in reply["error"]["message"], reply
    _refusal_recorded(gw, "odd__bigint", q, "64 bits")


async def _sdk_call(g: Gateway, modern: bool, tool: str, args: dict[str, Any]) -> Any:
    """A call by the SDK's client: a 2026-07-28 one (`discover()`, no session) or a
    handshake one; its result, or the MCPError that refused it."""
    async with (
        httpx2.AsyncClient(headers={"Authorization": f"Bearer {g.key}"}, timeout=30) as http,
        streamable_http_client(g.url + "/mcp", http_client=http) as (read, write),
        ClientSession(read, write) as s,
    ):
        await (s.discover() if modern else s.initialize())
        try:
            return await s.call_tool(tool, args)
        except MCPError as exc:
            return exc


@pytest.mark.parametrize("levels", [252, 300])
@pytest.mark.parametrize("modern", [True, False], ids=["2026-07-28", "handshake"])
def test_an_sdk_clients_call_of_a_too_deep_result_is_refused(
    gw: Gateway, modern: bool, levels: int
) -> None:
    """The SDK's client gets the same refusal, on either protocol version. 252 levels,
    which orjson still writes, failed for it before too (an error without `data`): the
    SDK's own reader and writer stop near 200 and 255 levels, hence the bound of 128."""
    q = "sdk-" + os.urandom(3).hex()
    got = asyncio.run(_sdk_call(gw, modern, "odd__nest", {"q": q, "levels": levels}))
    assert isinstance(got, MCPError), got
    assert got.data["code"] == "tool_result_too_large", got.data
    assert _Odd.ran.count(q) == 1


@pytest.mark.parametrize(
    ("tool", "levels", "why"),
    [
        ("raw__nest", 150, "nests deeper"),
        ("raw__nest", 300, "nests"),
        ("raw__bigint", 0, "64 bits"),
    ],
    ids=["150-levels", "300-levels", "bigint"],
)
def test_a_stdio_servers_unpassable_result_is_refused_at_once(
    gw: Gateway, raw_log: Path, tool: str, levels: int, why: str
) -> None:
    """Over stdio the same: refused for the caller's id, at once. A line nested past what
    the SDK's reader parses (about 200 levels) was dropped as unreadable, and the call
    waited out its whole timeout (5 s here), then ended a timeout: as if it might not
    have answered."""
    sid = open_session(gw, gw.key)
    q = f"raw-{levels}-" + os.urandom(3).hex()
    t0 = time.monotonic()
    status, reply = _post(gw, _call(61, tool, q=q, levels=levels), in_session(gw.key, sid))
    took = time.monotonic() - t0
    assert (
        status == 200
        and reply["id"] == 61
        and reply["error"]["data"]["code"] == "tool_result_too_large"
    ), reply
    assert why in reply["error"]["message"], reply
    assert took < 4, took
    assert raw_log.read_text().count(q) == 1
    _refusal_recorded(gw, tool, q, why)
    _, reply = _post(gw, _call(62, "raw__nest", q="ok", levels=3), in_session(gw.key, sid))
    assert reply["result"]["structuredContent"] == _nested(3), reply


def test_a_servers_flood_of_requests_in_a_reply_stream_gets_a_few_answers(gw: Gateway) -> None:
    """A tool server that writes 300 pings into one call's SSE stream: the gateway used
    to answer each with a POST of its own (on a connection of its own when none was
    idle, the connector unbounded); now a few, and the call still gets its result."""
    sid = open_session(gw, gw.key)
    q = "chatty-" + os.urandom(3).hex()
    status, reply = _post(gw, _call(71, "odd__chatty", q=q), in_session(gw.key, sid))
    assert status == 200 and reply["result"]["content"][0]["text"] == f"chatty {q}", reply
    time.sleep(2.0)  # the answers are posted in the background
    mine = [a for a in _Odd.answers if str(a["id"]).startswith(q)]
    assert 1 <= len(mine) <= 8, len(mine)
    assert all(a["result"] == {} for a in mine), mine


# -- what a client sends ----------------------------------------------------------------


@pytest.mark.parametrize("params", [["odd__plain"], "odd__plain", 5, True])
@pytest.mark.parametrize("rid", [31, "r-31", "x" * 500])
def test_sessionless_params_that_are_not_an_object_are_invalid_params_for_that_id(
    gw: Gateway, params: Any, rid: Any
) -> None:
    headers = _modern(gw, **{"mcp-method": "tools/call", "mcp-name": "odd__plain"})
    body = {"jsonrpc": "2.0", "id": rid, "method": "tools/call", "params": params}
    status, reply = _post(gw, body, headers)
    assert status == 400, reply
    assert reply["id"] == rid and reply["error"]["code"] == -32602, reply


@pytest.mark.parametrize("rid", ["x" * 500, 2**60])
def test_session_params_that_are_not_an_object_carry_any_readable_id(gw: Gateway, rid: Any) -> None:
    sid = open_session(gw, gw.key)
    body = {"jsonrpc": "2.0", "id": rid, "method": "tools/call", "params": [1]}
    status, reply = _post(gw, body, in_session(gw.key, sid))
    assert status == 400, reply
    assert reply["id"] == rid and reply["error"]["code"] == -32602, reply


@pytest.mark.parametrize("method", [5, None, ["tools/call"]], ids=["int", "null", "array"])
@pytest.mark.parametrize("modern", [True, False], ids=["2026-07-28", "handshake"])
def test_a_method_that_is_no_string_is_an_invalid_request_for_that_id(
    gw: Gateway, method: Any, modern: bool
) -> None:
    """The SDK refuses such a body before it reads the id (-32600, id null): the id is
    readable, so the error carries it (JSON-RPC 2.0 §5: null only when it is not)."""
    headers = _modern(gw) if modern else in_session(gw.key, open_session(gw, gw.key))
    body = {"jsonrpc": "2.0", "id": "m-1", "method": method, "params": {}}
    status, reply = _post(gw, body, headers)
    assert status == 400, reply
    assert reply["id"] == "m-1" and reply["error"]["code"] == -32600, reply


@pytest.mark.parametrize(
    "raw_id", [b"1.5", b"1180591620717411303424", b"null", b"true", b'{"a":1}', b"[1]"]
)
@pytest.mark.parametrize("modern", [True, False], ids=["2026-07-28", "handshake"])
def test_an_id_of_another_type_is_an_invalid_request_never_echoed_changed(
    gw: Gateway, raw_id: bytes, modern: bool
) -> None:
    """Gap guard: a fractional id, an integer past 64 bits (read as a float), null, a
    boolean, an object or an array: -32600 with id null, and the tool does not run."""
    headers = _modern(gw) if modern else in_session(gw.key, open_session(gw, gw.key))
    q = "id-" + os.urandom(3).hex()
    params = json.dumps({"name": "odd__plain", "arguments": {"q": q}}).encode()
    body = b'{"jsonrpc":"2.0","id":' + raw_id + b',"method":"tools/call","params":' + params + b"}"
    status, reply = _post(gw, body, headers)
    assert status == 400, reply
    assert reply["id"] is None and reply["error"]["code"] == -32600, reply
    assert q not in _Odd.ran


def test_a_repeated_or_oversized_session_header_never_reaches_another_keys_session(
    gw: Gateway,
) -> None:
    """Gap guard: two different `Mcp-Session-Id` lines are refused 400 before any
    session is looked up (which one counts would be a guess: s73), in either order,
    another key's session among them; the same id twice is one; an id past 128
    characters is a 404."""
    _, other_key = gw.new_tenant("s70")
    theirs, mine = open_session(gw, other_key), open_session(gw, gw.key)
    base = [(k, v) for k, v in in_session(gw.key, mine).items() if k != "mcp-session-id"]
    for first, second in ((mine, theirs), (theirs, mine), (mine, mine)):
        headers = [*base, ("mcp-session-id", first), ("mcp-session-id", second)]
        body = json.dumps(_call(81, "odd__plain", q="dup")).encode()
        r = httpx.post(gw.url + "/mcp", content=body, headers=headers, timeout=30)
        if first == second:
            assert r.status_code == 200 and r.json()["result"]["content"][0]["text"] == "plain dup"
        else:
            assert r.status_code == 400, r.text
            assert r.json()["error"]["data"]["code"] == "invalid_header", r.text
            assert theirs not in r.text
    headers = in_session(gw.key, "s" * 5000)
    status, reply = _post(gw, _call(82, "odd__plain", q="huge-sid"), headers)
    assert status == 404 and reply["error"]["data"]["code"] == "session_not_found", reply
