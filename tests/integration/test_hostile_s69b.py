"""Hostile review of the MCP gateway's own surface (`/mcp`: JSON-RPC framing, params,
arguments, the 2026-07-28 sessionless path, the workers' relay), of agent tasks' reports
and of the trace context a tool call carries. Over sockets against real gateways (one
process, and `serve --workers 2`) in front of the scripted upstream, a real MCP tool
server written with the official SDK (Streamable HTTP) and a scripted one that echoes
the arguments it receives.

Defects these tests found (each fails on the code of this stop):
- a body that is no JSON-RPC request at all (a batch, an empty batch, no `method`, a
  `jsonrpc` other than "2.0") is answered -32602 Invalid params, where JSON-RPC says
  -32600 Invalid Request (api/mcp_wire.py `_without_exception_text` rewords the SDK's
  "Validation error" as "Invalid request" but keeps its INVALID_PARAMS code);
- a `tools/call` whose `params` is an array, a string or a number is answered 400 with
  `id: null`: the request's id is known, so its answer names it, with -32602 as for a
  missing `params` (the SDK's envelope check refuses it before the id is read; api/
  mcp.py `_serve_fast` hands it over unread);
- arguments nested 300 deep (within what the body parser reads) are a -32603 internal
  error and a logged traceback: the evidence dump `orjson.dumps(arguments)`
  (mcp_service/__init__.py `_call`) stops at 254 levels and raises TypeError;
- an integer argument past 64 bits reaches the tool changed: the fast path parses the
  body with orjson (api/mcp.py `_serve_fast`), which reads 123456789012345678901234567890
  as the float 1.2345678901234568e+29, and engines/mcp_forward.py sends that float on;
- an `initialize` answered with a JSON-RPC error (a `protocolVersion` that is not a
  string) still names an `Mcp-Session-Id` and the session is kept: api/mcp.py
  `remember_session` keeps every session whose reply is under 400, so 100 such retries
  lock the key out of /mcp for the SDK's 30 idle minutes;
- a DELETE whose `Mcp-Protocol-Version` sends it to the SDK's sessionless path is
  refused 405, yet api/mcp.py `__call__` has already forgotten the session's owner and
  cancelled its calls: the live session answers its owner 404, its call is cancelled,
  and it no longer counts against the key, so one key passes MAX_SESSIONS_PER_KEY and
  can fill the SDK's 10,000 sessions for every tenant;
- a 2026-07-28 (sessionless) request is counted as a session being opened (api/mcp.py
  `__call__`: `opening` is any POST without `Mcp-Session-Id`), so a key holding its
  100 sessions gets 429 `too_many_sessions` for calls that open none;
- with `serve --workers N` every 2026-07-28 request fails: the relay (api/mcp_relay.py
  `_FORWARDED`) drops `Mcp-Method` and `Mcp-Name`, which that revision requires to
  match the body (-32020 header mismatch);
- with `serve --workers N` a tool call's span loses the client's trace: the relay drops
  `traceparent`, which the endpoint reads (api/mcp_wire.py `_caller`);
- with `serve --workers N` a request without a key is not refused until its whole
  body (up to `server.max_body_bytes`) has been read and relayed: api/mcp_relay.py
  reads the body before anything authenticates it (one process answers 401 at once);
- a task's report (`GET /admin/tasks/{id}`) grows with the square of its steps: each
  inferred step lists every step that ended before it as a parent (observe/tasks.py
  `_link`, `_step_dict`): 1,000 steps make a 23 MB answer, built on the event loop;
- the report of a task id two tenants used merges both tenants' requests into one
  critical path (api/admin/tasks.py `task_trace`, state/traces.py `get_task`), where a
  request id several tenants used is refused as ambiguous (`?tenant=` needed);
- `/admin/tasks/{id}` reads any text as a task id (looked up, echoed whole in its 404),
  where `/v1/tasks/{id}` refuses what is not 1 to 128 id characters (400 `task_id`).

Gaps guarded (pass today; no other test covers them): the 2026-07-28 path is governed
as a session is (no key: 401; a tool outside the tenant's allow list is refused and not
run; the catalog is the tenant's); another key's `notifications/cancelled` naming a
call in flight on someone else's session stops nothing; a tool call relayed by a worker
leaves no raw PII of its arguments or result in the database files or the spans.
"""

from __future__ import annotations

import asyncio
import http.server
import json
import os
import socket
import threading
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
from support.mcp_http import ACCEPT, ScriptedToolServer, in_session, initialize, open_session
from support.mcp_sessions import Tools, http_tool_server, session, text, wait_tools_ready
from support.upstreams import Scripted

NARROW = "narrow-" + os.urandom(3).hex()  # may run web__lookup only
REGISTRY = [
    {"name": "web__lookup", "class": "read_only"},
    {"name": "web__hang", "class": "read_only"},
    {"name": "web__send_email", "class": "side_effect"},
    {"name": "bank__echo", "class": "read_only"},
]
MODERN = "2026-07-28"
TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
TRACEPARENT = f"00-{TRACE_ID}-b7ad6b7169203331-01"
CHAT = {"model": "cheap", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]}


class _Echo(ScriptedToolServer):
    """A tool server whose `echo` answers with the arguments it received, as JSON."""

    name = "bank"
    tools = [{"name": "echo", "inputSchema": {"type": "object"}}]
    seen: list[str] = []

    def call(self, msg: dict[str, Any]) -> Any:
        raw = json.dumps(msg["params"].get("arguments"))
        self.seen.append(raw)
        return {"content": [{"type": "text", "text": raw}]}


@pytest.fixture(scope="module")
def web(tools: Tools) -> Iterator[str]:
    with http_tool_server(tools) as url:
        yield url


@pytest.fixture(scope="module")
def gw(scripted: Scripted, web: str) -> Iterator[Gateway]:
    echo = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Echo)
    threading.Thread(target=echo.serve_forever, daemon=True).start()
    bank = f"http://127.0.0.1:{echo.server_address[1]}/mcp"
    config = cheap_config(
        scripted,
        mcp={"servers": [{"name": "web", "url": web}, {"name": "bank", "url": bank}]},
        tools={"registry": REGISTRY, "tenant_allow": {NARROW: ["web__lookup"]}},
    )
    g = start_gateway(config)
    try:
        g.create_tenant(NARROW)
        wait_tools_ready(g, ("web", "bank"))
        yield g
    finally:
        g.proc.stop()
        echo.shutdown()


@pytest.fixture(scope="module")
def workers(scripted: Scripted, web: str, tools: Tools) -> Iterator[Gateway]:
    spans = str(Path(tools.spans).with_name("workers-spans.jsonl"))
    config = cheap_config(
        scripted,
        mcp={"servers": [{"name": "web", "url": web}]},
        tools={"registry": REGISTRY[:3]},
        observe={"otel": {"exporter": "file", "path": spans}},
    )
    g = start_gateway(config, serve_args=("--workers", "2"))
    g.spans = spans  # type: ignore[attr-defined]
    try:
        wait_tools_ready(g, ("web",))
        yield g
    finally:
        g.proc.stop()


def _rpc(g: Gateway, key: str, sid: str, body: Any = None, content: bytes | None = None) -> Any:
    """One POST on the session `sid`: (status, the JSON reply)."""
    raw = json.dumps(body).encode() if content is None else content
    r = httpx.post(g.url + "/mcp", content=raw, headers=in_session(key, sid), timeout=30)
    assert "Traceback" not in r.text and "pydantic" not in r.text.lower(), r.text
    return r.status_code, r.json()


def _call(rid: Any, **params: Any) -> dict[str, Any]:
    return {"jsonrpc": "2.0", "id": rid, "method": "tools/call", "params": params}


async def _modern(g: Gateway, key: str, tool: str, args: dict[str, Any]) -> Any:
    """A 2026-07-28 client (the SDK's `discover()`, no session): (the tools it lists,
    the call's result or the MCPError that refused it)."""
    async with (
        httpx2.AsyncClient(headers={"Authorization": f"Bearer {key}"}, timeout=30) as http,
        streamable_http_client(g.url + "/mcp", http_client=http) as (read, write),
        ClientSession(read, write) as s,
    ):
        await s.discover()
        listed = [t.name for t in (await s.list_tools()).tools]
        try:
            return listed, await s.call_tool(tool, args)
        except MCPError as exc:
            return listed, exc


def _modern_or_fail(g: Gateway, key: str, tool: str, args: dict[str, Any]) -> Any:
    try:
        return asyncio.run(_modern(g, key, tool, args))
    except Exception as exc:  # the SDK raises an ExceptionGroup from its task group
        inner = getattr(exc, "exceptions", ())
        pytest.fail(f"a 2026-07-28 client was not served: {exc!r} {inner!r}")


# -- JSON-RPC framing and params ---------------------------------------------------------


@pytest.mark.parametrize(
    "body",
    [
        [_call(1, name="web__lookup", arguments={"q": "batch-s69b"})],
        [],
        {"jsonrpc": "2.0", "id": 3},
        {"jsonrpc": "1.0", "id": 4, "method": "ping"},
    ],
    ids=["batch", "empty-batch", "no-method", "jsonrpc-1.0"],
)
def test_a_body_that_is_no_request_is_an_invalid_request(
    gw: Gateway, tools: Tools, body: Any
) -> None:
    """Not a JSON-RPC 2.0 request object at all: -32600 Invalid Request with id null
    (JSON-RPC 2.0 §5.1), never -32602, which says a known method's params are wrong."""
    sid = open_session(gw, gw.key)
    status, reply = _rpc(gw, gw.key, sid, body)
    assert status == 400, reply
    assert reply["id"] is None and reply["error"]["code"] == -32600, reply
    assert Tools.runs(tools.http_log, "lookup", q="batch-s69b") == 0


@pytest.mark.parametrize("params", [["web__lookup", {"q": "x"}], "web__lookup", 5])
def test_params_that_are_not_an_object_are_invalid_params_for_that_id(
    gw: Gateway, tools: Tools, params: Any
) -> None:
    """A `tools/call` whose `params` is not an object is Invalid params (-32602), answered
    with the request's own id, as a missing `params` is; the tool does not run."""
    sid = open_session(gw, gw.key)
    body = {"jsonrpc": "2.0", "id": 41, "method": "tools/call", "params": params}
    status, reply = _rpc(gw, gw.key, sid, body)
    assert status in (200, 400), reply
    assert reply["error"]["code"] == -32602, reply
    assert reply["id"] == 41, reply
    # The same request without params, for comparison: the shape it already gets.
    status, missing = _rpc(gw, gw.key, sid, {"jsonrpc": "2.0", "id": 42, "method": "tools/call"})
    assert missing["id"] == 42 and missing["error"]["code"] == -32602, missing


def test_deeply_nested_arguments_are_invalid_params_not_an_internal_error(
    gw: Gateway, tools: Tools
) -> None:
    """Arguments 300 levels deep (the body parser reads 1,024) are either passed on or
    refused as Invalid params; a client's input is never a -32603 internal error."""
    sid = open_session(gw, gw.key)
    q = "deep-" + os.urandom(4).hex()
    deep: Any = "leaf"
    for _ in range(300):
        deep = {"a": deep}
    status, reply = _rpc(
        gw, gw.key, sid, _call(51, name="web__lookup", arguments={"q": q, "d": deep})
    )
    assert status in (200, 400) and reply["id"] in (51, None), reply
    if "result" in reply:
        assert reply["result"]["content"][0]["text"] == f"found: {q}", reply
    else:
        assert reply["error"]["code"] == -32602, reply
        assert Tools.runs(tools.http_log, "lookup", q=q) == 0


def test_a_large_integer_argument_reaches_the_tool_as_sent(gw: Gateway) -> None:
    """An integer past 64 bits (an account number, an amount in minor units) reaches the
    tool as the same integer, or the call is refused as Invalid params; the tool never
    runs with another number."""
    sid = open_session(gw, gw.key)
    marker = "big-" + os.urandom(4).hex()
    amount = 123456789012345678901234567890
    raw = (
        '{"jsonrpc": "2.0", "id": 61, "method": "tools/call", "params": {"name": "bank__echo",'
        f' "arguments": {{"marker": "{marker}", "amount": {amount}}}}}}}'
    ).encode()
    status, reply = _rpc(gw, gw.key, sid, content=raw)
    seen = [s for s in _Echo.seen if marker in s]
    if "error" in reply:
        assert reply["error"]["code"] == -32602 and not seen, (reply, seen)
        return
    assert status == 200, reply
    assert seen == [json.dumps({"marker": marker, "amount": amount})], seen
    assert reply["result"]["content"][0]["text"] == seen[0], reply


# -- the 2026-07-28 (sessionless) path ---------------------------------------------------


def test_sessionless_calls_do_not_count_against_the_keys_sessions(gw: Gateway) -> None:
    """A key holding its 100 sessions may still make 2026-07-28 calls, which open none."""
    _, key = gw.new_tenant("hoard")

    async def hoard() -> list[int]:
        headers = {"authorization": f"Bearer {key}", **ACCEPT}
        async with httpx.AsyncClient(headers=headers, timeout=30) as c:
            got = await asyncio.gather(
                *(c.post(gw.url + "/mcp", json=initialize()) for _ in range(110))
            )
            return [r.status_code for r in got]

    codes = asyncio.run(hoard())
    assert 200 in codes and 429 in codes, codes  # the key is at its sessions' limit
    _, result = _modern_or_fail(gw, key, "web__lookup", {"q": "sessionless"})
    assert not isinstance(result, MCPError), result
    assert text(result) == "found: sessionless"


def test_a_sessionless_call_is_governed_as_a_sessions_is(gw: Gateway, tools: Tools) -> None:
    """Gap guard: on the 2026-07-28 path, no key is a 401; a tenant lists only its own
    tools and a tool outside its allow list is refused before it runs."""
    r = httpx.post(
        gw.url + "/mcp",
        json=_call(71, name="web__lookup", arguments={"q": "nokey"}),
        headers={**ACCEPT, "mcp-protocol-version": MODERN, "mcp-method": "tools/call"},
        timeout=30,
    )
    assert r.status_code == 401, r.text
    assert r.json()["error"]["data"]["code"] == "invalid_api_key", r.text
    key = str(gw.create_key(NARROW)["key"])
    to = f"s69b-{os.urandom(4).hex()}@example.com"
    listed, refused = _modern_or_fail(gw, key, "web__send_email", {"to": to, "body": "hi"})
    assert listed == ["web__lookup"], listed
    assert isinstance(refused, MCPError), refused
    assert refused.data["code"] == "tool_not_allowed", refused.data
    assert Tools.runs(tools.http_log, "send_email", to=to) == 0
    assert Tools.runs(tools.http_log, "lookup", q="nokey") == 0


def test_a_refused_initialize_opens_no_session(gw: Gateway) -> None:
    """An `initialize` answered with a JSON-RPC error opened nothing: it names no
    `Mcp-Session-Id`, and a client that retried one a hundred times may still open a
    session (today each refusal holds one of the key's 100 for the SDK's 30 idle
    minutes, and the key is locked out of /mcp)."""
    _, key = gw.new_tenant("badinit")
    bad = initialize()
    bad["params"]["protocolVersion"] = 5
    headers = {"authorization": f"Bearer {key}", **ACCEPT}
    r = httpx.post(gw.url + "/mcp", json=bad, headers=headers, timeout=30)
    assert r.json()["error"]["code"] == -32602, r.text
    assert "mcp-session-id" not in r.headers, r.headers

    async def retries() -> None:
        async with httpx.AsyncClient(headers=headers, timeout=30) as c:
            await asyncio.gather(*(c.post(gw.url + "/mcp", json=bad) for _ in range(100)))

    asyncio.run(retries())
    assert open_session(gw, key)


def test_a_delete_that_ends_no_session_changes_nothing(gw: Gateway, tools: Tools) -> None:
    """A DELETE the SDK refuses (405: its `Mcp-Protocol-Version` routes it to the
    sessionless path) ended nothing, so the session stays its owner's and its call in
    flight runs on; and a key cannot pass its 100 sessions by such DELETEs (today the
    gateway forgets the session first: the call is cancelled, the live session answers
    its owner 404 and no longer counts, so one key can fill the SDK's 10,000 for every
    tenant)."""
    _, key = gw.new_tenant("del")
    sid = open_session(gw, key)
    seconds = 1.0 + int.from_bytes(os.urandom(2), "big") / 1e6  # names this run in the log
    out: dict[str, Any] = {}

    def a_call() -> None:
        out["a"] = _rpc(gw, key, sid, _call(91, name="web__hang", arguments={"seconds": seconds}))

    thread = threading.Thread(target=a_call)
    thread.start()
    deadline = time.monotonic() + 10
    while Tools.runs(tools.http_log, "hang", seconds=seconds) == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    modern = {"mcp-protocol-version": MODERN}
    r = httpx.request("DELETE", gw.url + "/mcp", headers=in_session(key, sid, **modern))
    thread.join(30)
    if r.status_code < 400:  # it did end the session: then its call went with it
        return
    status, reply = out["a"]
    assert status == 200 and "result" in reply, (r.status_code, reply)
    assert reply["result"]["content"][0]["text"] == "woke up", reply
    ping = {"jsonrpc": "2.0", "id": 92, "method": "ping"}
    assert _rpc(gw, key, sid, ping) == (200, {"jsonrpc": "2.0", "id": 92, "result": {}})
    codes = []
    for _ in range(100):  # each refused DELETE leaves its session open
        r = httpx.post(
            gw.url + "/mcp", json=initialize(), headers={"authorization": f"Bearer {key}", **ACCEPT}
        )
        codes.append(r.status_code)
        if r.status_code == 200:
            more = in_session(key, r.headers["mcp-session-id"], **modern)
            httpx.request("DELETE", gw.url + "/mcp", headers=more)
    assert codes.count(200) == 99 and codes[-1] == 429, codes


# -- another key's cancel ---------------------------------------------------------------


def test_another_keys_cancel_notification_stops_nothing(gw: Gateway, tools: Tools) -> None:
    """Gap guard: B's `notifications/cancelled`, on B's own session, naming the id of a
    call A has in flight on A's session, neither stops A's call nor leaves it in doubt."""
    _, key_a = gw.new_tenant("ca")
    _, key_b = gw.new_tenant("cb")
    sid_a, sid_b = open_session(gw, key_a), open_session(gw, key_b)
    seconds = 1.0 + int.from_bytes(os.urandom(2), "big") / 1e6  # names this run in the log
    out: dict[str, Any] = {}

    def a_call() -> None:
        out["a"] = _rpc(
            gw, key_a, sid_a, _call(81, name="web__hang", arguments={"seconds": seconds})
        )

    thread = threading.Thread(target=a_call)
    thread.start()
    deadline = time.monotonic() + 10
    while Tools.runs(tools.http_log, "hang", seconds=seconds) == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    cancel = {"jsonrpc": "2.0", "method": "notifications/cancelled", "params": {"requestId": 81}}
    r = httpx.post(gw.url + "/mcp", json=cancel, headers=in_session(key_b, sid_b), timeout=30)
    assert r.status_code == 202, r.text
    thread.join(30)
    status, reply = out["a"]
    assert status == 200 and reply["result"]["content"][0]["text"] == "woke up", reply
    assert Tools.runs(tools.http_log, "hang_cancelled", seconds=seconds) == 0


# -- serve --workers 2: the relay ------------------------------------------------------------


def test_a_2026_client_is_served_through_workers(workers: Gateway) -> None:
    """The relay passes on every header the MCP transport uses: a 2026-07-28 client
    (`Mcp-Method`, `Mcp-Name` must match its body) is served as by one process."""
    listed, result = _modern_or_fail(workers, workers.key, "web__lookup", {"q": "relayed"})
    assert "web__lookup" in listed and not isinstance(result, MCPError), (listed, result)
    assert text(result) == "found: relayed"


def test_a_tool_span_keeps_the_clients_trace_through_workers(workers: Gateway) -> None:
    """The client's W3C `traceparent` reaches the control plane: the tool call's span is
    in the client's trace, with `serve --workers 2` as with one process."""

    async def go() -> Any:
        async with session(workers, workers.key, traceparent=TRACEPARENT) as s:
            return await s.call_tool("web__lookup", {"q": "traced"})

    result = asyncio.run(go())
    assert text(result) == "found: traced"
    rid = (result.meta or {}).get("switchyard/request_id")
    assert rid, result
    spans: list[dict[str, Any]] = []
    deadline = time.monotonic() + 15
    path = Path(workers.spans)  # type: ignore[attr-defined]
    while time.monotonic() < deadline and not spans:
        lines = path.read_text().splitlines() if path.exists() else []
        spans = [
            s
            for s in map(json.loads, lines)
            if s["name"] == "execute_tool" and s["attributes"].get("switchyard.request_id") == rid
        ]
        time.sleep(0.2)
    assert spans, f"no span for {rid}"
    assert spans[0]["trace_id"] == TRACE_ID, spans[0]


def test_the_relay_refuses_a_missing_key_before_it_reads_the_body(workers: Gateway) -> None:
    """Authentication comes before costly work: a worker's relay answers a request
    without a key 401 at once, as one process does, instead of reading (and buffering,
    and relaying) up to `server.max_body_bytes` first. Here the body never comes: one
    process answers anyway; the relay waits for it."""
    head = (
        b"POST /mcp HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Accept: application/json, text/event-stream\r\nContent-Length: 7000000\r\n\r\n"
    )
    for _ in range(4):  # new connections: the kernel spreads them over both workers
        with socket.create_connection(("127.0.0.1", workers.port), timeout=5) as s:
            s.sendall(head)
            try:
                got = s.recv(64)
            except TimeoutError:
                got = b"(no answer within 5 s)"
        assert got.startswith(b"HTTP/1.1 401"), got


def test_a_relayed_tool_calls_pii_is_not_kept_at_rest(workers: Gateway) -> None:
    """Gap guard: through a worker's relay, a tool call whose arguments and result carry
    an email address leaves no raw copy in the gateway's database files or its spans
    (the trace keeps them masked)."""
    tenant, key = workers.new_tenant("pii")
    email = f"mary.major.{os.urandom(4).hex()}@example.com"

    async def go() -> Any:
        async with session(workers, key) as s:
            return await s.call_tool("web__lookup", {"q": f"write to {email}"})

    assert text(asyncio.run(go())) == f"found: write to {email}"
    rows = workers.tenant_rows(tenant)
    assert rows and rows[0]["endpoint"] == "tools.call", rows
    trace = json.dumps(workers.trace(rows[0]["request_id"]))
    assert "found: write to" in trace and email not in trace, trace[:500]
    time.sleep(1.0)  # the span batch is written every 0.5 s
    stored = [f for f in Path(workers.db).parent.iterdir() if f.is_file()]
    stored.append(Path(workers.spans))  # type: ignore[attr-defined]
    for f in stored:
        assert email.encode() not in f.read_bytes(), f


# -- agent tasks' reports ----------------------------------------------------------------


def _steps(g: Gateway, key: str, task: str, n: int) -> None:
    """`n` chat calls in the task, eight at a time."""

    async def go() -> None:
        headers = {"Authorization": f"Bearer {key}", "x-task-id": task}
        async with httpx.AsyncClient(headers=headers, timeout=60) as c:
            gate = asyncio.Semaphore(8)

            async def one() -> None:
                async with gate:
                    r = await c.post(g.url + "/v1/chat/completions", json=CHAT)
                    assert r.status_code == 200, r.text

            await asyncio.gather(*(one() for _ in range(n)))

    asyncio.run(go())


def test_a_long_tasks_report_grows_linearly_with_its_steps(gw: Gateway) -> None:
    """A task's report is bounded by its steps: four times the steps make about four
    times the bytes (each step's record and its place in the graph), not sixteen."""
    tenant, key = gw.new_tenant("long")
    sizes = {}
    for n in (200, 800):
        task = f"long-{n}-" + os.urandom(3).hex()
        _steps(gw, key, task, n)
        r = httpx.get(
            f"{gw.url}/admin/tasks/{task}", params={"tenant": tenant}, headers=gw.admin, timeout=120
        )
        assert r.status_code == 200, r.text[:300]
        assert r.json()["task"]["steps_executed"] == n
        sizes[n] = len(r.content)
    assert sizes[800] < 6 * sizes[200], sizes


def test_two_tenants_tasks_of_one_id_are_never_analysed_as_one(gw: Gateway) -> None:
    """Task ids are the clients': two tenants' tasks of one id are two tasks. Their report
    without `?tenant=` is refused as ambiguous (as a request id several tenants used is),
    or is one tenant's; never one critical path through both tenants' requests."""
    task = "shared-" + os.urandom(4).hex()
    tenants = [gw.new_tenant("sa"), gw.new_tenant("sb")]
    for _, key in tenants:
        _steps(gw, key, task, 2)
    for tenant, _ in tenants:  # each tenant's own report is its two steps
        r = httpx.get(
            f"{gw.url}/admin/tasks/{task}", params={"tenant": tenant}, headers=gw.admin, timeout=30
        )
        assert r.status_code == 200 and r.json()["task"]["steps_executed"] == 2, r.text[:300]
    r = httpx.get(f"{gw.url}/admin/tasks/{task}", headers=gw.admin, timeout=30)
    if r.status_code == 400:
        assert r.json()["error"]["param"] == "tenant", r.text
        return
    assert r.status_code == 200, r.text[:300]
    owners = {rec["tenant_id"] for rec in r.json()["requests"]}
    assert len(owners) == 1, f"one analysis over the tasks of {sorted(owners)}"


@pytest.mark.parametrize("task_id", ["t" * 129, "bad id", "semi;colon"])
def test_an_admin_task_id_is_bounded_as_a_clients_is(gw: Gateway, task_id: str) -> None:
    """`/admin/tasks/{id}` reads its id as `/v1/tasks/{id}` does: 1 to 128 characters of
    the id alphabet, else 400 naming `task_id`; today any text is looked up (and
    echoed back whole in the 404)."""
    for method, query in (("GET", {}), ("DELETE", {"tenant": "t-any"})):
        r = httpx.request(
            method, f"{gw.url}/admin/tasks/{task_id}", params=query, headers=gw.admin, timeout=30
        )
        assert r.status_code == 400, (method, r.status_code, r.text[:200])
        assert r.json()["error"]["param"] == "task_id", r.text
