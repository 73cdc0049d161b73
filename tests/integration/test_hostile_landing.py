"""Hostile input against today's landings, over sockets against real gateways: the MCP
gateway's sessions, the admin PATCH of tenants and keys, and an engine's own /metrics
page (what an upstream could send)."""

from __future__ import annotations

import asyncio
import http.server
import json
import os
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
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
from support.paths import MCP_TOOL_SERVER
from support.upstreams import Scripted, start_scripted
from switchyard.api.mcp import MAX_SESSIONS_PER_KEY
from switchyard.engines.load import MAX_BYTES, EngineLoad, LoadWatch

SERVER = MCP_TOOL_SERVER


@pytest.fixture(scope="module")
def gw(scripted: Scripted) -> Iterator[Gateway]:
    log = os.path.join(tempfile.mkdtemp(prefix="hostile-mcp-"), "tools.log")
    Path(log).touch()
    config = cheap_config(
        scripted,
        mcp={
            "servers": [
                {
                    "name": "crm",
                    "command": [sys.executable, SERVER, "stdio", log],
                    "timeout_s": 1.0,
                }
            ]
        },
        tools={
            "registry": [
                {"name": "crm__lookup", "class": "read_only"},
                {"name": "crm__hang", "class": "side_effect"},
            ]
        },
    )
    g = start_gateway(config)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            models = httpx.get(g.url + "/readyz", headers=g.admin).json()["models"]
            if models.get("mcp:crm", {}).get("ready"):
                break
            time.sleep(0.2)
        yield g
    finally:
        g.proc.stop()


def _ping(g: Gateway, key: str, sid: str) -> httpx.Response:
    return httpx.post(
        g.url + "/mcp",
        headers=in_session(key, sid),
        json={"jsonrpc": "2.0", "id": 9, "method": "ping"},
        timeout=30,
    )


# -- /mcp: one key's session is never reachable by another ---------------------------


def test_a_repeated_session_header_does_not_reach_another_keys_session(gw: Gateway) -> None:
    gw.create_tenant("hostile-a")
    gw.create_tenant("hostile-b")
    key_a = gw.create_key("hostile-a")["key"]
    key_b = gw.create_key("hostile-b")["key"]
    victim = open_session(gw, key_a)
    own = open_session(gw, key_b)
    # B names A's session first and its own second: whichever of the two the gateway
    # checks, the SDK behind it must act on that same one.
    headers = [
        ("authorization", f"Bearer {key_b}"),
        ("mcp-session-id", victim),
        ("mcp-session-id", own),
        ("mcp-protocol-version", VERSION),
    ]
    r = httpx.request("DELETE", gw.url + "/mcp", headers=headers, timeout=30)
    assert r.status_code in (400, 404), r.text
    assert "Traceback" not in r.text
    # A's session is still A's and still open.
    r = _ping(gw, key_a, victim)
    assert r.status_code == 200, r.text
    assert r.json()["result"] == {}


# -- PATCH /admin/tenants/{id} and /admin/keys/{id} ------------------------------------


@pytest.mark.parametrize(
    "body",
    [
        {"tenant_id": "someone-else"},
        {"max_concurrency": 2**63},
        {"rpm": 2**64 - 1},
        {"tpm": 2**63},
    ],
)
def test_a_patch_with_hostile_fields_is_a_clear_400(gw: Gateway, body: dict[str, Any]) -> None:
    tenant = "hostile-patch"
    r = httpx.get(gw.url + f"/admin/tenants/{tenant}", headers=gw.admin)
    if r.status_code == 404:
        gw.create_tenant(tenant)
    key_id = gw.create_key(tenant)["id"]
    for path in (f"/admin/tenants/{tenant}", f"/admin/keys/{key_id}"):
        r = httpx.patch(gw.url + path, content=json.dumps(body), headers=gw.admin)
        assert r.status_code == 400, (path, r.text)
        assert r.json()["error"]["type"] == "invalid_request_error"
    # Nothing changed.
    r = httpx.get(gw.url + f"/admin/tenants/{tenant}", headers=gw.admin)
    assert r.json()["limits"]["max_concurrency"] is None


# -- an engine's own /metrics page ----------------------------------------------------


def test_an_engine_reporting_absurd_load_figures_breaks_nothing() -> None:
    proc, s = start_scripted()
    try:
        g = start_gateway(
            {
                "models": [
                    {
                        "alias": "chat",
                        "engine": {
                            "kind": "openai",
                            "base_url": s.url + "/v1",
                            "load_metrics": "vllm",
                        },
                    }
                ],
                "engines": {"state_interval_s": 0.2, "state_stale_s": 1.0},
                "embeddings": {"enabled": False},
            }
        )
        try:
            r = httpx.put(
                s.url + "/control/load",
                json={"running": 1e30, "waiting": -7, "kv_cache_usage": 0.5},
                timeout=5,
            )
            assert r.status_code == 200, r.text
            time.sleep(1.0)  # a few readings
            for path in ("/admin/engines", "/admin/live"):
                r = httpx.get(g.url + path, headers=g.admin, timeout=10)
                assert r.status_code == 200, (path, r.text)
            load = httpx.get(g.url + "/admin/engines", headers=g.admin).json()["load"]["chat"]
            # A figure no engine can report is not used (nor shown as a reading).
            assert load["running"] is None and load["waiting"] is None, load
            assert load["kv_cache_usage"] == 0.5
            r = httpx.post(
                g.url + "/v1/chat/completions",
                json={"model": "chat", "messages": [{"role": "user", "content": "hi"}]},
                headers={"Authorization": f"Bearer {g.key}"},
                timeout=30,
            )
            assert r.status_code == 200, r.text
        finally:
            g.proc.stop()
    finally:
        proc.stop()


class _Page(http.server.BaseHTTPRequestHandler):
    """A metrics page sent in `parts`, a pause between them (a slow or busy engine)."""

    parts: list[bytes] = []

    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("content-type", "text/plain")
        self.send_header("content-length", str(sum(len(p) for p in self.parts)))
        self.end_headers()
        for part in self.parts:
            self.wfile.write(part)
            self.wfile.flush()
            time.sleep(0.2)

    def log_message(self, *args: Any) -> None:
        pass


def _serve(parts: list[bytes]) -> http.server.ThreadingHTTPServer:
    handler = type("Page", (_Page,), {"parts": parts})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def _read(port: int) -> EngineLoad:
    """One reading by the gateway's LoadWatch of the engine at `port`."""
    load = EngineLoad("vllm", lambda: f"http://127.0.0.1:{port}")
    watch = LoadWatch([load], interval_s=5.0)

    async def read_once() -> None:
        import aiohttp

        watch._session = aiohttp.ClientSession()
        try:
            await watch.read(load)
        finally:
            await watch._session.close()

    asyncio.run(read_once())
    return load


def _read_page(parts: list[bytes]) -> EngineLoad:
    server = _serve(parts)
    try:
        return _read(server.server_address[1])
    finally:
        server.shutdown()


def test_a_metrics_page_that_arrives_in_parts_is_read_whole() -> None:
    """Cut where the first part ends, '12 running' would read as 1."""
    load = _read_page([b"vllm:num_requests_running 1", b"2\nvllm:num_requests_waiting 3\n"])
    assert load.error is None, load.error
    assert (load.running, load.waiting) == (12, 3)


def test_a_metrics_redirect_is_not_followed() -> None:
    """An upstream that answers its /metrics with a redirect does not get the gateway to
    fetch another address for it (here another page whose figures would be used)."""
    target = _serve([b"vllm:num_requests_running 7\n"])

    class Redirect(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(302)
            self.send_header("location", f"http://127.0.0.1:{target.server_address[1]}/x")
            self.send_header("content-length", "0")
            self.end_headers()

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Redirect)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        load = _read(server.server_address[1])
        assert load.running is None and load.error is not None, load
    finally:
        server.shutdown()
        target.shutdown()


def test_an_enormous_metrics_page_is_refused_not_parsed() -> None:
    """A page under the byte cap but with tens of thousands of series of a figure read
    would hold the event loop for a parse each interval: it is refused unparsed."""
    page = "".join(f'vllm:num_requests_running{{n="{i}"}} 1\n' for i in range(40_000))
    page = page[: page.rfind("\n", 0, MAX_BYTES) + 1].encode()
    load = _read_page([page])
    assert load.read_at == 0.0 and load.running is None
    assert load.error is not None and "series" in load.error, load.error


def test_one_key_cannot_take_every_mcp_session(gw: Gateway) -> None:
    """The SDK refuses new sessions past 10 000 open ones, all keys together: one key
    opening sessions in a loop is stopped at its own share, and another tenant still gets
    one."""
    gw.create_tenant("hostile-hoarder")
    gw.create_tenant("hostile-other")
    hoarder = gw.create_key("hostile-hoarder")["key"]
    other = gw.create_key("hostile-other")["key"]
    init = initialize("hoarder")

    async def hoard() -> tuple[list[int], list[str]]:
        async with httpx.AsyncClient(
            headers={"authorization": f"Bearer {hoarder}", **ACCEPT}, timeout=30
        ) as c:
            codes, sids = [], []
            for _ in range(5):  # bursts across the limit
                got = await asyncio.gather(*(c.post(gw.url + "/mcp", json=init) for _ in range(30)))
                codes += [r.status_code for r in got]
                sids += [r.headers["mcp-session-id"] for r in got if r.status_code == 200]
            refused = await c.post(gw.url + "/mcp", json=init)
            assert refused.status_code == 429, refused.text
            body = refused.json()
            assert body["error"]["data"]["code"] == "too_many_sessions", body
            return codes, sids

    codes, sids = asyncio.run(hoard())
    assert codes.count(200) == MAX_SESSIONS_PER_KEY and codes.count(429) == 150 - codes.count(200)
    sid = open_session(gw, other)  # another tenant is not affected
    assert _ping(gw, other, sid).status_code == 200
    # Ending a session makes room for one more.
    headers = {"authorization": f"Bearer {hoarder}", "mcp-protocol-version": VERSION}
    r = httpx.request("DELETE", gw.url + "/mcp", headers={**headers, "mcp-session-id": sids[0]})
    assert r.status_code == 200, r.text
    assert open_session(gw, hoarder)


def test_openings_whose_bodies_are_slow_cannot_pass_the_session_cap_together(
    gw: Gateway,
) -> None:
    """A key one session short of its cap sends five `initialize` requests at once whose
    bodies arrive late: each was checked against the cap before the body was read, and
    counted as opening only after it, so all five passed the check together and the key
    ended with 104 sessions. The place is taken with the check: one opens, four are 429."""
    gw.create_tenant("hostile-slow")
    key = gw.create_key("hostile-slow")["key"]
    for _ in range(MAX_SESSIONS_PER_KEY - 1):
        assert open_session(gw, key)
    body = json.dumps(initialize("slow")).encode()
    head = (
        "POST /mcp HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        f"Authorization: Bearer {key}\r\nAccept: {ACCEPT['accept']}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode()

    async def one() -> int:
        reader, writer = await asyncio.open_connection("127.0.0.1", gw.port)
        try:
            writer.write(head)
            await writer.drain()
            await asyncio.sleep(0.5)  # every opening is past its check, its body not read
            writer.write(body)
            await writer.drain()
            status = await asyncio.wait_for(reader.readline(), 30)
            return int(status.split()[1])
        finally:
            writer.close()

    async def five() -> list[int]:
        return list(await asyncio.gather(*(one() for _ in range(5))))

    codes = asyncio.run(five())
    assert sorted(codes) == [200, 429, 429, 429, 429], codes


@pytest.mark.parametrize(
    "body",
    [
        b"{not json",
        b"[1, 2, 3]",
        b'{"jsonrpc": "2.0", "id": {"x": 1}, "method": 5}',
        b'{"jsonrpc": "2.0", "id": 1, "method": "ping", "params": '
        + b"[" * 400
        + b"]" * 400
        + b"}",
    ],
)
def test_a_malformed_jsonrpc_body_gets_no_exception_text(gw: Gateway, body: bytes) -> None:
    sid = open_session(gw, gw.key)
    r = httpx.post(
        gw.url + "/mcp",
        content=body,
        headers=in_session(gw.key, sid),
        timeout=30,
    )
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    # -32600: a request whose id MCP does not allow (api/mcp.py answers it itself)
    assert error["code"] in (-32700, -32602, -32600), error
    for leak in ("validation error", "pydantic", "input_value", "line 1 column", "recursion"):
        assert leak not in r.text.lower(), r.text


def test_an_oversized_jsonrpc_body_is_a_jsonrpc_413(gw: Gateway) -> None:
    sid = open_session(gw, gw.key)
    big = b'{"jsonrpc": "2.0", "id": 1, "method": "ping", "params": {"x": "' + b"a" * 9_000_000
    headers = in_session(gw.key, sid)
    for content in (big + b'"}}', iter([big, b'"}}'])):  # declared, and streamed (chunked)
        r = httpx.post(gw.url + "/mcp", content=content, headers=headers, timeout=60)
        assert r.status_code == 413, r.text
        assert r.headers["content-type"].startswith("application/json")
        assert r.json()["error"]["data"]["code"] == "request_too_large", r.text


def test_the_name_of_an_unknown_tool_is_not_kept_at_rest(gw: Gateway) -> None:
    """A tool name is the client's free text until it names a tool: one carrying PII is
    refused, and the ledger and traces keep no copy of it."""
    sid = open_session(gw, gw.key)
    secret = "john.doe." + os.urandom(4).hex() + "@example.com"
    r = httpx.post(
        gw.url + "/mcp",
        headers=in_session(gw.key, sid),
        json={
            "jsonrpc": "2.0",
            "id": 2,
            "method": "tools/call",
            "params": {"name": f"crm__{secret}", "arguments": {}},
        },
        timeout=30,
    )
    assert r.json()["error"]["data"]["code"] == "unknown_tool", r.text
    time.sleep(0.5)
    r = httpx.get(gw.url + "/admin/requests", headers=gw.admin, timeout=30)  # flushes
    assert r.status_code == 200, r.text
    folder = Path(gw.db).parent
    for f in folder.iterdir():
        if f.is_file():
            assert secret.encode() not in f.read_bytes(), f


def test_an_operator_resolves_only_the_call_named(gw: Gateway) -> None:
    """Resolving a call in doubt as not run lets a repeat run it again: an over-long call
    id must not resolve the call whose id is its first 128 characters."""
    call_id = "c" * 127 + os.urandom(1).hex()[0]
    sid = open_session(gw, gw.key)
    r = httpx.post(
        gw.url + "/mcp",
        headers=in_session(gw.key, sid),
        json={
            "jsonrpc": "2.0",
            "id": 3,
            "method": "tools/call",
            "params": {
                "name": "crm__hang",
                "arguments": {"seconds": 3},
                "_meta": {"call_id": call_id},
            },
        },
        timeout=30,
    )
    assert r.json()["error"]["data"]["code"] == "tool_call_in_doubt", r.text
    tenant = httpx.get(gw.url + "/admin/tool-calls", headers=gw.admin).json()["data"]
    tenant = next(c["tenant_id"] for c in tenant if c["call_id"] == call_id)
    for wrong in (
        {"tenant": tenant, "call_id": call_id + "x", "ran": False},
        {"tenant": tenant + "x" * 64, "call_id": call_id, "ran": False},
    ):
        r = httpx.post(gw.url + "/admin/tool-calls", json=wrong, headers=gw.admin)
        assert r.status_code in (400, 404), r.text
    calls = httpx.get(gw.url + "/admin/tool-calls", headers=gw.admin).json()["data"]
    assert any(c["call_id"] == call_id for c in calls), "the call in doubt was resolved"


class _MalformedTools(ScriptedToolServer):
    """An MCP server over Streamable HTTP (JSON replies) whose `pay` tool runs (it is
    logged) and then answers with a result that is not a CallToolResult."""

    runs: list[dict[str, Any]] = []
    name = "malformed"
    tools = [
        {
            "name": "pay",
            "inputSchema": {"type": "object", "properties": {"amount": {"type": "integer"}}},
        }
    ]

    def call(self, msg: dict[str, Any]) -> Any:
        self.runs.append(msg["params"]["arguments"])
        return {"content": "paid, but not a list of content blocks", "isError": 7}


def test_a_side_effect_whose_result_is_malformed_is_never_run_twice(scripted: Scripted) -> None:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _MalformedTools)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    port = server.server_address[1]
    config = cheap_config(
        scripted,
        mcp={"servers": [{"name": "bank", "url": f"http://127.0.0.1:{port}/mcp"}]},
        tools={"registry": [{"name": "bank__pay", "class": "side_effect"}]},
    )
    g = start_gateway(config)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            models = httpx.get(g.url + "/readyz", headers=g.admin).json()["models"]
            if models.get("mcp:bank", {}).get("ready"):
                break
            time.sleep(0.2)
        sid = open_session(g, g.key)
        call = {
            "jsonrpc": "2.0",
            "id": 5,
            "method": "tools/call",
            "params": {"name": "bank__pay", "arguments": {"amount": 5}, "_meta": {"call_id": "p1"}},
        }
        headers = in_session(g.key, sid)
        codes = []
        for _ in range(2):  # the client repeats a call that failed
            r = httpx.post(g.url + "/mcp", headers=headers, json=call, timeout=30)
            assert r.status_code == 200 and "error" in r.json(), r.text
            assert "Traceback" not in r.text and "validation" not in r.text.lower(), r.text
            codes.append(r.json()["error"]["data"]["code"])
        # It ran once: its outcome is unknown to the gateway, so the repeat is refused.
        assert len(_MalformedTools.runs) == 1, (_MalformedTools.runs, codes)
        assert codes == ["tool_call_in_doubt", "tool_call_in_doubt"], codes
    finally:
        g.proc.stop()
        server.shutdown()


def test_a_wrong_content_type_gets_a_jsonrpc_error(gw: Gateway) -> None:
    sid = open_session(gw, gw.key)
    r = httpx.post(
        gw.url + "/mcp",
        content=b'{"jsonrpc": "2.0", "id": 1, "method": "ping"}',
        headers={
            "authorization": f"Bearer {gw.key}",
            "accept": ACCEPT["accept"],
            "content-type": "text/plain",
            "mcp-session-id": sid,
            "mcp-protocol-version": VERSION,
        },
        timeout=30,
    )
    assert 400 <= r.status_code < 500, r.text
    assert r.headers["content-type"].startswith("application/json"), r.text
    assert r.json()["jsonrpc"] == "2.0" and "message" in r.json()["error"], r.text
