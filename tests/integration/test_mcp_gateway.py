"""The MCP tool gateway (`/mcp`) end to end: real MCP servers written with the official
SDK (tests/support/mcp_tool_server.py: one over stdio that the gateway starts, one over
Streamable HTTP that the test starts), the SDK's own client session talking to a real
gateway process over sockets. What a tool server's log shows is what actually ran."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from mcp import MCPError

from support.gateways import Gateway, cheap_config, start_gateway
from support.mcp_sessions import Tools, http_tool_server, session, text, wait_tools_ready
from support.paths import MCP_TOOL_SERVER
from support.upstreams import Scripted

SERVER = MCP_TOOL_SERVER
NARROW = "narrow-" + os.urandom(3).hex()
FULL = "full-" + os.urandom(3).hex()
SECRET = "s3cret-token"
REGISTRY = [
    {"name": "crm__lookup", "class": "read_only"},
    {"name": "web__lookup", "class": "read_only"},
    {"name": "crm__send_email", "class": "side_effect"},
    {"name": "crm__pay", "class": "side_effect", "requires_approval": True},
    {"name": "web__hang", "class": "side_effect"},
    {"name": "crm__whoami", "class": "read_only"},
    {"name": "crm__crash", "class": "read_only"},
    {"name": "crm__big", "class": "side_effect"},
    {"name": "web__big", "class": "read_only"},
    {"name": "flaky__explode", "class": "read_only"},
    {"name": "flaky__lookup", "class": "read_only"},
]
PRICE = 0.02  # USD per call of web__lookup (mcp.servers[].tool_prices)
MAX_RESULT = 4096  # mcp.max_result_bytes


@pytest.fixture(scope="module")
def gw(scripted: Scripted, tools: Tools) -> Iterator[Gateway]:
    with http_tool_server(tools) as url:
        config = cheap_config(
            scripted,
            mcp={
                "servers": [
                    {
                        "name": "crm",
                        "command": [sys.executable, SERVER, "stdio", tools.stdio_log],
                        "env": {"CRM_TOKEN": "SY_TEST_CRM_TOKEN"},
                        # Down for at least this long after it dies: long enough for a
                        # call to be sent while it is down (the restart test).
                        "restart_backoff_s": 2.0,
                    },
                    {
                        "name": "web",
                        "url": url,
                        "timeout_s": 1.5,
                        # "lokup": a typo: a price for a tool the server does not
                        # list is never charged, so the gateway says so.
                        "tool_prices": {"lookup": PRICE, "lokup": 1.0},
                    },
                    # The same server again, under a breaker that opens after two
                    # failures (its own: web's stays closed).
                    {
                        "name": "flaky",
                        "url": url,
                        "breaker": {"failures": 2, "cooldown_s": 1.5},
                    },
                ],
                "max_result_bytes": MAX_RESULT,
            },
            observe={"otel": {"exporter": "file", "path": tools.spans}},
            tools={
                "registry": REGISTRY,
                "deny": ["web__whoami"],
                "tenant_allow": {NARROW: ["crm__lookup", "web__lookup"]},
            },
        )
        g = start_gateway(config, env={"SY_TEST_CRM_TOKEN": SECRET})
        try:
            g.create_tenant(NARROW)
            g.narrow_key = g.create_key(NARROW)["key"]  # type: ignore[attr-defined]
            g.create_tenant(FULL)
            g.key = g.create_key(FULL)["key"]
            g.tenant = FULL  # type: ignore[attr-defined]
            wait_tools_ready(g)
            yield g
        finally:
            g.proc.stop()


def run(coro: Any) -> Any:
    return asyncio.run(coro)


# -- catalog and authorization ---------------------------------------------------


def test_catalog_is_namespaced_and_filtered_per_tenant(gw: Gateway) -> None:
    async def names(key: str) -> set[str]:
        async with session(gw, key) as s:
            return {t.name for t in (await s.list_tools()).tools}

    full = run(names(gw.key))
    assert {"crm__lookup", "crm__send_email", "crm__pay", "web__lookup", "web__hang"} <= full
    assert "web__whoami" not in full  # tools.deny
    assert run(names(gw.narrow_key)) == {"crm__lookup", "web__lookup"}  # type: ignore[attr-defined]


def test_a_forbidden_tool_is_refused_before_it_runs(gw: Gateway, tools: Tools) -> None:
    async def go() -> MCPError:
        async with session(gw, gw.narrow_key) as s:  # type: ignore[attr-defined]
            with pytest.raises(MCPError) as err:
                await s.call_tool("crm__send_email", {"to": "forbidden@x", "body": "hi"})
            return err.value

    err = run(go())
    assert err.code == -32043
    assert err.data["code"] == "tool_not_allowed"
    assert Tools.runs(tools.stdio_log, "send_email", to="forbidden@x") == 0


def test_unauthenticated_and_foreign_sessions_are_refused(gw: Gateway) -> None:
    r = httpx.post(gw.url + "/mcp", json={"jsonrpc": "2.0", "id": 1, "method": "ping"})
    assert r.status_code == 401
    assert r.json()["error"]["data"]["code"] == "invalid_api_key"
    assert "Traceback" not in r.text

    # A header is checked where it is read, before the SDK sees the request.
    r = httpx.post(
        gw.url + "/mcp",
        json={"jsonrpc": "2.0", "id": 1, "method": "ping"},
        headers={**gw.auth, "x-task-id": "not a task id!", "accept": "application/json"},
    )
    assert r.status_code == 400 and r.json()["error"]["code"] == -32602, r.text
    assert r.json()["error"]["data"]["code"] == "invalid_header"
    for name, value in (
        ("x-task-budget", "tool_calls=0"),
        ("x-task-budget", "tool_calls=1," * 100),
        ("x-task-timeout", "soon"),
    ):
        r = httpx.post(
            gw.url + "/mcp",
            json={"jsonrpc": "2.0", "id": 1, "method": "ping"},
            headers={**gw.auth, "x-task-id": "t1", name: value, "accept": "application/json"},
        )
        assert r.status_code == 400 and r.json()["error"]["data"]["code"] == "invalid_header"
        assert name in r.json()["error"]["message"] and "Traceback" not in r.text
    # A made-up session id is not found, whatever key sends it.
    r = httpx.post(
        gw.url + "/mcp",
        json={"jsonrpc": "2.0", "id": 1, "method": "ping"},
        headers={**gw.auth, "mcp-session-id": "x" * 40, "accept": "application/json"},
    )
    assert r.status_code == 404
    assert r.json()["error"]["code"] == -32602


def test_tools_on_both_transports_run_and_credentials_reach_only_the_server(
    gw: Gateway, tools: Tools
) -> None:
    async def go() -> tuple[str, str, str]:
        async with session(gw) as s:
            a = await s.call_tool("crm__lookup", {"q": "stdio"})
            b = await s.call_tool("web__lookup", {"q": "http"})
            c = await s.call_tool("crm__whoami", {})
            return text(a), text(b), text(c)

    assert run(go()) == ("found: stdio", "found: http", "token ok")
    assert Tools.runs(tools.http_log, "lookup", q="http") == 1
    assert SECRET not in gw.proc.output()
    ready = httpx.get(gw.url + "/readyz", headers=gw.admin).text
    assert SECRET not in ready


# -- approvals -------------------------------------------------------------------


def test_an_approval_required_tool_runs_only_with_a_token(gw: Gateway, tools: Tools) -> None:
    call_id = "call_sya_" + os.urandom(6).hex()
    amount = int.from_bytes(os.urandom(3), "big")

    async def refused() -> MCPError:
        async with session(gw) as s:
            with pytest.raises(MCPError) as err:
                await s.call_tool("crm__pay", {"amount": amount}, meta={"call_id": call_id})
            return err.value

    err = run(refused())
    assert err.data["code"] == "approval_required"
    assert "x-switchyard-approval" in err.message
    assert Tools.runs(tools.stdio_log, "pay", amount=amount) == 0

    token = gw.approve(gw.tenant, None, call_id)  # type: ignore[attr-defined]

    async def approved() -> list[str]:
        async with session(gw, **{"x-switchyard-approval": token}) as s:
            first = await s.call_tool("crm__pay", {"amount": amount}, meta={"call_id": call_id})
        async with session(gw) as s:  # a repeat: the stored result, no new token needed
            again = await s.call_tool("crm__pay", {"amount": amount}, meta={"call_id": call_id})
        return [text(first), text(again)]

    assert run(approved()) == [f"paid {amount}"] * 2
    assert Tools.runs(tools.stdio_log, "pay", amount=amount) == 1


# -- at most once ---------------------------------------------------------------


def test_one_call_id_sent_three_times_at_once_runs_once(gw: Gateway, tools: Tools) -> None:
    call_id = "call_sy_" + os.urandom(6).hex()
    to = f"{call_id}@example.com"

    async def one() -> str:
        async with session(gw, **{"x-switchyard-call-id": call_id}) as s:
            r = await s.call_tool("crm__send_email", {"to": to, "body": "hello"})
            return text(r)

    async def three() -> list[str]:
        return list(await asyncio.gather(one(), one(), one()))

    assert run(three()) == [f"sent to {to}"] * 3
    assert Tools.runs(tools.stdio_log, "send_email", to=to) == 1

    async def other_args() -> MCPError:
        async with session(gw, **{"x-switchyard-call-id": call_id}) as s:
            with pytest.raises(MCPError) as err:
                await s.call_tool("crm__send_email", {"to": "else@x", "body": "hello"})
            return err.value

    assert run(other_args()).data["code"] == "call_id_conflict"


def test_a_call_that_times_out_is_in_doubt_and_never_rerun(gw: Gateway, tools: Tools) -> None:
    call_id = "call_sy_" + os.urandom(6).hex()
    seconds = 3 + int.from_bytes(os.urandom(2), "big") / 1e6

    async def call() -> MCPError:
        async with session(gw) as s:
            with pytest.raises(MCPError) as err:
                await s.call_tool("web__hang", {"seconds": seconds}, meta={"call_id": call_id})
            return err.value

    first = run(call())
    assert first.data["code"] == "tool_call_in_doubt"
    assert "will not be run again" in first.message
    again = run(call())
    assert again.data["code"] == "tool_call_in_doubt"
    assert Tools.runs(tools.http_log, "hang", seconds=seconds) == 1
    # The operator sees it, without its arguments, and says it ran.
    listed = httpx.get(gw.url + "/admin/tool-calls", headers=gw.admin).json()["data"]
    mine = [c for c in listed if c["call_id"] == call_id]
    assert mine and mine[0]["tool"] == "web__hang" and "args" not in json.dumps(mine[0])
    r = httpx.post(
        gw.url + "/admin/tool-calls",
        json={"tenant": gw.tenant, "call_id": call_id, "ran": True},  # type: ignore[attr-defined]
        headers=gw.admin,
    )
    assert r.status_code == 200, r.text
    assert run(call()).data["code"] == "tool_call_done"
    assert Tools.runs(tools.http_log, "hang", seconds=seconds) == 1


# -- task trace and usage ---------------------------------------------------------


def test_a_tool_call_is_a_step_of_its_task_with_masked_arguments(gw: Gateway, tools: Tools) -> None:
    task = "task-" + os.urandom(4).hex()

    async def go() -> None:
        async with session(gw, **{"x-task-id": task}) as s:
            await s.call_tool("crm__lookup", {"q": "mail jane.doe@example.com please"})

    run(go())
    deadline = time.monotonic() + 20
    rows: list[dict[str, Any]] = []
    while time.monotonic() < deadline and not rows:
        rows = [r for r in gw.usage(task=task) if r.get("endpoint") == "tools.call"]
        time.sleep(0.2)
    assert rows, gw.usage(task=task)
    row = rows[0]
    assert row["model"] == "crm__lookup" and row["status"] == "ok"
    assert row["duration_ms"] > 0
    trace = gw.trace(row["request_id"])
    stages = {d["stage"]: d for d in trace["decisions"]}
    assert stages["tool_auth"]["outcome"] == "ok"
    assert stages["tool_exec"]["outcome"] == "ok"
    stored = json.dumps(trace)
    assert "jane.doe@example.com" not in stored
    assert "found: mail" in stored  # the (masked) result is there
    # Its OpenTelemetry span, named by the GenAI conventions for tool execution.
    deadline = time.monotonic() + 10
    spans: list[dict[str, Any]] = []
    while time.monotonic() < deadline and not spans:
        lines = Path(tools.spans).read_text().splitlines() if Path(tools.spans).exists() else []
        spans = [
            s
            for s in map(json.loads, lines)
            if s["attributes"].get("switchyard.request_id") == row["request_id"]
            and s["name"] == "execute_tool"
        ]
        time.sleep(0.2)
    assert spans and spans[0]["attributes"]["gen_ai.tool.name"] == "crm__lookup"
    assert spans[0]["attributes"]["switchyard.task_id"] == task
    r = httpx.get(f"{gw.url}/admin/tasks/{task}", headers=gw.admin)
    assert r.status_code == 200, r.text
    analysis = r.json()["task"]
    assert analysis["steps"][0]["kind"] == "tool"
    assert analysis["time_by_kind"]["tool_ms"] > 0


# -- cancel and supervision --------------------------------------------------------


def test_a_task_cancel_stops_its_running_tool_and_refuses_later_calls(
    gw: Gateway, tools: Tools
) -> None:
    task = "cancel-" + os.urandom(4).hex()
    call_id = "call_sy_" + os.urandom(6).hex()
    seconds = 1.2 + int.from_bytes(os.urandom(2), "big") / 1e6
    # The task opens with a model call, as an agent's does.
    chat = gw.openai().chat.completions.create(
        model="cheap",
        messages=[{"role": "user", "content": "plan"}],
        extra_headers={"x-task-id": task},
    )
    assert chat.choices

    async def go() -> tuple[MCPError, MCPError]:
        async with session(gw, **{"x-task-id": task}) as s:
            call = asyncio.create_task(
                s.call_tool("web__hang", {"seconds": seconds}, meta={"call_id": call_id})
            )
            while Tools.runs(tools.http_log, "hang", seconds=seconds) == 0:
                await asyncio.sleep(0.02)
            async with httpx.AsyncClient() as http:
                r = await http.delete(f"{gw.url}/v1/tasks/{task}", headers=gw.auth)
                assert r.status_code == 200, r.text
            with pytest.raises(MCPError) as stopped:
                await call
            with pytest.raises(MCPError) as later:
                await s.call_tool("crm__lookup", {"q": "after cancel"})
            return stopped.value, later.value

    stopped, later = run(go())
    assert stopped.data["code"] == "task_cancelled"
    assert "outcome is unknown" in stopped.message
    assert later.data["code"] == "task_cancelled"
    assert Tools.runs(tools.stdio_log, "lookup", q="after cancel") == 0
    # The tool server was told (MCP cancellation) and stopped the tool.
    deadline = time.monotonic() + 5
    while Tools.runs(tools.http_log, "hang_cancelled", seconds=seconds) == 0:
        assert time.monotonic() < deadline, "the tool server never heard of the cancel"
        time.sleep(0.05)


def test_a_client_that_cancels_its_call_stops_the_tool_and_leaves_it_in_doubt(
    gw: Gateway, tools: Tools
) -> None:
    """The SDK client's `notifications/cancelled` reaches a call the gateway serves on
    its own hot path, and from there the tool server (MCP cancellation)."""
    call_id = "call_sy_" + os.urandom(6).hex()
    seconds = 1.4 + int.from_bytes(os.urandom(2), "big") / 1e6

    bodies: list[bytes] = []

    async def go() -> MCPError:
        async with session(gw, bodies=bodies) as s:
            call = asyncio.create_task(
                s.call_tool("web__hang", {"seconds": seconds}, meta={"call_id": call_id})
            )
            while Tools.runs(tools.http_log, "hang", seconds=seconds) == 0:
                await asyncio.sleep(0.02)
            call.cancel()
            with pytest.raises(asyncio.CancelledError):
                await call
            with pytest.raises(MCPError) as again:
                await s.call_tool("web__hang", {"seconds": seconds}, meta={"call_id": call_id})
            # The cancelled call's POST is still answered (REQUEST_CANCELLED), and the SDK
            # hands that late answer to its session: closing the session before then
            # breaks the SDK's own stream (anyio.BrokenResourceError), a client-side race.
            deadline = time.monotonic() + 10
            while not any(b"-32800" in b for b in bodies):
                assert time.monotonic() < deadline, "the cancelled call's POST was never answered"
                await asyncio.sleep(0.02)
            await asyncio.sleep(0.2)
            return again.value

    again = run(go())
    assert again.data["code"] == "tool_call_in_doubt"
    deadline = time.monotonic() + 5
    while Tools.runs(tools.http_log, "hang_cancelled", seconds=seconds) == 0:
        assert time.monotonic() < deadline, "the tool server never heard of the cancel"
        time.sleep(0.05)
    assert Tools.runs(tools.http_log, "hang", seconds=seconds) == 1


def raw_session(gw: Gateway, http: httpx.Client) -> dict[str, str]:
    """Open an MCP session with plain HTTP; the headers of its later requests."""
    headers = {**gw.auth, "accept": "application/json, text/event-stream"}
    init = {
        "jsonrpc": "2.0",
        "id": 0,
        "method": "initialize",
        "params": {
            "protocolVersion": "2025-11-25",
            "capabilities": {},
            "clientInfo": {"name": "raw", "version": "1"},
        },
    }
    r = http.post(gw.url + "/mcp", json=init, headers=headers)
    assert r.status_code == 200, r.text
    headers |= {"mcp-session-id": r.headers["mcp-session-id"], "mcp-protocol-version": "2025-11-25"}
    note = {"jsonrpc": "2.0", "method": "notifications/initialized"}
    assert http.post(gw.url + "/mcp", json=note, headers=headers).status_code == 202
    return headers


def test_hostile_bodies_on_an_open_session_get_json_rpc_errors_without_exception_text(
    gw: Gateway, tools: Tools
) -> None:
    def call(rid: object, **params: object) -> dict[str, object]:
        return {"jsonrpc": "2.0", "id": rid, "method": "tools/call", "params": params}

    with httpx.Client(timeout=30) as http:
        h = raw_session(gw, http)

        def post(body: object = None, content: bytes | None = None) -> httpx.Response:
            if content is None:
                content = json.dumps(body).encode()
            r = http.post(
                gw.url + "/mcp", content=content, headers={**h, "content-type": "application/json"}
            )
            assert "Traceback" not in r.text and "pydantic" not in r.text.lower(), r.text
            return r

        # The hot path: a well-formed call, its id echoed, its request id in `_meta`.
        r = post(call("a-1", name="crm__lookup", arguments={"q": "raw"}))
        assert r.status_code == 200 and r.headers["mcp-session-id"] == h["mcp-session-id"]
        got = r.json()
        assert got["id"] == "a-1" and got["result"]["content"][0]["text"] == "found: raw"
        assert got["result"]["_meta"]["switchyard/request_id"].startswith("req_")
        # Refusals are JSON-RPC errors with our code in `data`.
        r = post(call(7, name="crm__nope", arguments={}))
        assert r.json()["id"] == 7 and r.json()["error"]["data"]["code"] == "unknown_tool"
        r = post(call(8, name="x" * 201, arguments={}))
        assert r.json()["id"] == 8 and r.json()["error"]["code"] == -32602
        # Malformed: not JSON, a batch, wrong types, an oversized or odd id, a member
        # too many. Each is answered (by the SDK's rules, reworded), none runs a tool.
        r = post(content=b'{"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": {')
        assert r.status_code == 400
        assert r.json()["error"]["message"] == "Parse error: the request body is not valid JSON"
        for body in (
            [call(1, name="crm__lookup", arguments={"q": "batch"})],
            call({"an": "object"}, name="crm__lookup", arguments={"q": "odd id"}),
            call(1, name="crm__lookup", arguments=["not", "an", "object"]),
            call(1, name=["crm__lookup"], arguments={"q": "list name"}),
            {**call(1, name="crm__lookup", arguments={"q": "extra"}), "extra": True},
            call(2**60, name="crm__lookup", arguments={"q": "big id"}),
            call("i" * 5000, name="crm__lookup", arguments={"q": "long id"}),
        ):
            r = post(body)
            assert r.status_code in (200, 202, 400), r.text  # 202: the SDK's, for an odd id
            reply = r.json() if r.content else {"result": None}
            assert isinstance(reply, dict) and ("error" in reply or "result" in reply), reply
            if r.status_code == 200 and "error" in reply:
                assert reply["error"]["code"] == -32602
        for q in ("batch", "odd id", "list name"):
            assert Tools.runs(tools.stdio_log, "lookup", q=q) == 0
        # Past server.max_body_bytes: 413, before anything is parsed.
        r = post(
            content=b'{"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": {"name": "'
            + b"x" * 8_000_100
            + b'"}}'
        )
        assert r.status_code == 413 and r.json()["error"]["data"]["code"] == "request_too_large"
        # The session still works, and ends.
        r = post(call(9, name="crm__lookup", arguments={"q": "still"}))
        assert r.json()["result"]["content"][0]["text"] == "found: still"
        assert http.delete(gw.url + "/mcp", headers=h).status_code == 200
        assert post(call(10, name="crm__lookup", arguments={"q": "gone"})).status_code == 404


def test_a_stdio_server_that_dies_is_restarted_and_reported(gw: Gateway, tools: Tools) -> None:
    def crm() -> dict[str, Any]:
        return dict(httpx.get(gw.url + "/readyz", headers=gw.admin).json()["models"]["mcp:crm"])

    before = crm()["restarts"]

    async def crash() -> None:
        async with session(gw) as s:
            with pytest.raises(MCPError):
                await s.call_tool("crm__crash", {})

    # An approved call sent while the server is down is refused before its approval
    # is spent: the same token runs it once the server is back.
    call_id = "call_sya_" + os.urandom(6).hex()
    amount = int.from_bytes(os.urandom(3), "big")
    token = gw.approve(gw.tenant, None, call_id)  # type: ignore[attr-defined]

    async def pay() -> str:
        async with session(gw, **{"x-switchyard-approval": token}) as s:
            try:
                r = await s.call_tool("crm__pay", {"amount": amount}, meta={"call_id": call_id})
            except MCPError as exc:
                return str(exc.data["code"])
            return text(r)

    run(crash())
    deadline = time.monotonic() + 30
    refused = None
    while time.monotonic() < deadline:
        state = crm()
        if state["state"] == "failed" and refused is None:
            refused = run(pay())
        if state["ready"] and state["restarts"] > before:
            break
        time.sleep(0.1)
    assert state["ready"] and state["restarts"] == before + 1, state
    assert refused == "tool_server_unavailable", refused
    assert Tools.runs(tools.stdio_log, "pay", amount=amount) == 0
    assert run(pay()) == f"paid {amount}"  # the approval was not spent on the refusal
    assert Tools.runs(tools.stdio_log, "pay", amount=amount) == 1
    public = httpx.get(gw.url + "/readyz").json()["models"]["mcp:crm"]
    assert "last_error" not in public  # the reason is for the admin only
    # The server printed its credential as it died: neither the log nor the admin's
    # view of the failure repeats it.
    assert "fatal: token=***" in gw.proc.output()
    assert SECRET not in gw.proc.output()

    async def lookup() -> str:
        async with session(gw) as s:
            return text(await s.call_tool("crm__lookup", {"q": "back"}))

    assert run(lookup()) == "found: back"


# -- the OpenAI Agents SDK, end to end ---------------------------------------------


def test_an_agents_sdk_agent_runs_its_side_effect_once_and_the_trace_names_the_tool(
    gw: Gateway, scripted: Scripted, tools: Tools
) -> None:
    """Model calls go to the chat endpoint (the scripted upstream proposes the tool
    call), tool calls to /mcp; the SDK sends no call ids, so the gateway matches the
    call to the task's proposed one, and a retried step gets the stored result."""
    import openai
    from agents import Agent, OpenAIChatCompletionsModel, Runner, set_tracing_disabled
    from agents.mcp import MCPServerStreamableHttp

    set_tracing_disabled(True)
    task = "agent-" + os.urandom(4).hex()
    to = f"{task}@example.com"
    calls = {"calls": [{"name": "crm__send_email", "arguments": {"to": to, "body": "hi"}}]}
    r = httpx.put(scripted.url + "/control/tool_calls", json={**calls, "until_result": True})
    assert r.status_code == 200
    headers = {"Authorization": f"Bearer {gw.key}", "x-task-id": task}

    async def agent_run() -> str:
        client = openai.AsyncOpenAI(
            base_url=gw.url + "/v1",
            api_key=gw.key,
            max_retries=0,
            default_headers={"x-task-id": task},
        )
        async with MCPServerStreamableHttp(
            params={"url": gw.url + "/mcp", "headers": headers}, name="switchyard"
        ) as server:
            agent = Agent(
                name="mailer",
                instructions="Send the email with the tool.",
                model=OpenAIChatCompletionsModel(model="cheap", openai_client=client),
                mcp_servers=[server],
            )
            result = await Runner.run(agent, f"email {to}")
            return str(result.final_output)

    async def retried_step() -> str:  # the same call again, no id, as a retry sends it
        async with session(gw, **{"x-task-id": task}) as s:
            return text(await s.call_tool("crm__send_email", {"to": to, "body": "hi"}))

    try:
        assert run(agent_run())
    finally:
        httpx.put(scripted.url + "/control/tool_calls", json={"calls": []})
    assert run(retried_step()) == f"sent to {to}"
    assert Tools.runs(tools.stdio_log, "send_email", to=to) == 1

    deadline = time.monotonic() + 20
    while True:
        r = httpx.get(f"{gw.url}/admin/tasks/{task}", headers=gw.admin)
        report = r.json().get("task", {}) if r.status_code == 200 else {}
        if report.get("tool_calls") == 2 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert report["llm_calls"] >= 2 and report["tool_calls"] == 2, report
    path = [s for s in report["steps"] if s["on_critical_path"]]
    slowest = max(path, key=lambda s: s["duration_ms"])
    assert slowest["kind"] == "tool" and slowest["model"] == "crm__send_email"
    assert report["time_by_kind"]["tool_ms"] >= 400  # the tool takes 0.5 s
    requests = {q["request_id"]: q for q in r.json()["requests"]}
    matched = [
        d
        for s in report["steps"]
        if s["kind"] == "tool"
        for d in requests[s["request_id"]]["decisions"]
        if d["stage"] == "tool_call_id"
    ]
    assert matched and matched[0]["evidence"]["call_id"].startswith("call_sy_")
    shown = subprocess.run(
        [sys.executable, "-m", "switchyard", "trace", "show", task],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "SWITCHYARD_SQLITE_PATH": gw.db},
    )
    assert "tool crm__send_email" in shown.stdout, shown.stdout + shown.stderr
    assert "critical path by kind:" in shown.stdout


def test_a_tool_that_hangs_is_cut_at_the_task_deadline(gw: Gateway, tools: Tools) -> None:
    task = "deadline-" + os.urandom(4).hex()
    seconds = 20 + int.from_bytes(os.urandom(2), "big") / 1e6
    gw.openai().chat.completions.create(
        model="cheap",
        messages=[{"role": "user", "content": "plan"}],
        extra_headers={"x-task-id": task, "x-task-timeout": "2"},
    )

    async def go() -> tuple[MCPError, float]:
        async with session(gw, **{"x-task-id": task}) as s:
            t = time.monotonic()
            with pytest.raises(MCPError) as err:  # crm's own timeout is 30 s
                await s.call_tool(
                    "crm__hang", {"seconds": seconds}, meta={"call_id": "call_sy_" + task}
                )
            return err.value, time.monotonic() - t

    err, took = run(go())
    assert err.data["code"] == "tool_call_in_doubt" and took < 5, (err, took)
    assert Tools.runs(tools.stdio_log, "hang", seconds=seconds) == 1


def test_tool_calls_are_held_to_the_keys_and_tenants_limits(gw: Gateway, tools: Tools) -> None:
    """Each tools/call reserves as one request against the key's and tenant's limits
    (rpm here) before it reaches the tool: the call over the limit never runs."""
    tenant = "rpm-" + os.urandom(3).hex()
    gw.create_tenant(tenant, rpm=2)
    key = gw.create_key(tenant)["key"]
    marker = "limited-" + os.urandom(3).hex()

    async def go() -> MCPError:
        async with session(gw, key) as s:
            for i in range(2):
                await s.call_tool("crm__lookup", {"q": f"{marker}-{i}"})
            with pytest.raises(MCPError) as err:
                await s.call_tool("crm__lookup", {"q": f"{marker}-2"})
            return err.value

    err = run(go())
    assert err.code == -32029 and err.data["code"] == "rate_limit_rpm"
    assert Tools.runs(tools.stdio_log, "lookup", q=f"{marker}-2") == 0
    assert Tools.runs(tools.stdio_log, "lookup", q=f"{marker}-0") == 1


# -- task budgets: tool calls and tool prices ------------------------------------------


def test_a_tasks_tool_call_budget_refuses_the_call_over_it_before_it_runs(
    gw: Gateway, tools: Tools
) -> None:
    """The task's first step is a tool call, so its x-task-budget sets the task's rules.
    A call refused after admission (no approval) gives its tool call back; the call over
    the budget is refused naming `tool_calls` and never runs; model calls keep their own
    count (`calls`)."""
    task = "tools-" + os.urandom(4).hex()
    marker = "budget-" + os.urandom(3).hex()
    h = {"x-task-id": task, "x-task-budget": "tool_calls=2, calls=5"}

    async def go() -> tuple[MCPError, MCPError]:
        async with session(gw, **h) as s:
            with pytest.raises(MCPError) as unapproved:
                await s.call_tool("crm__pay", {"amount": 1}, meta={"call_id": "call_sya_" + task})
            for i in range(2):
                assert text(await s.call_tool("crm__lookup", {"q": f"{marker}-{i}"}))
            with pytest.raises(MCPError) as over:
                await s.call_tool("crm__lookup", {"q": f"{marker}-2"})
            return unapproved.value, over.value

    unapproved, over = run(go())
    assert unapproved.data["code"] == "approval_required"
    assert over.code == -32029 and over.data["code"] == "task_budget_exceeded"
    assert "tool_calls budget of 2" in over.message
    assert Tools.runs(tools.stdio_log, "lookup", q=f"{marker}-2") == 0
    assert Tools.runs(tools.stdio_log, "lookup", q=f"{marker}-1") == 1
    # Model calls are counted apart: the task still takes one.
    chat = gw.post(
        "/v1/chat/completions",
        json={"model": "cheap", "messages": [{"role": "user", "content": "hi"}]},
        headers={"x-task-id": task},
    )
    assert chat.status_code == 200, chat.text
    rows = wait_rows(gw, task, 4)
    refused = [r for r in rows if r.get("error_code") == "task_budget_exceeded"]
    assert len(refused) == 1
    trace = gw.trace(refused[0]["request_id"])
    decision = next(d for d in trace["decisions"] if d["stage"] == "task")
    assert decision["outcome"] == "reject:tool_calls"
    assert decision["evidence"]["used"]["tool_calls"] == 2


def test_a_tools_price_counts_toward_the_tasks_cost_and_its_usage_row(
    gw: Gateway, tools: Tools
) -> None:
    task = "priced-" + os.urandom(4).hex()
    marker = "price-" + os.urandom(3).hex()
    budget = PRICE * 2.5  # room for two calls' prices, not three

    async def go() -> MCPError:
        async with session(gw, **{"x-task-id": task, "x-task-budget": f"cost_usd={budget}"}) as s:
            for i in range(2):
                assert text(await s.call_tool("web__lookup", {"q": f"{marker}-{i}"}))
            with pytest.raises(MCPError) as err:
                await s.call_tool("web__lookup", {"q": f"{marker}-2"})
            # An unpriced tool still fits.
            assert text(await s.call_tool("crm__lookup", {"q": marker})) == f"found: {marker}"
            return err.value

    err = run(go())
    assert err.data["code"] == "task_budget_exceeded" and "cost_usd budget" in err.message
    assert Tools.runs(tools.http_log, "lookup", q=f"{marker}-2") == 0
    rows = wait_rows(gw, task, 4)
    costs = sorted((r["model"], r["status"], r["cost_usd"]) for r in rows)
    assert costs == [
        ("crm__lookup", "ok", 0.0),
        ("web__lookup", "error", 0.0),
        ("web__lookup", "ok", PRICE),
        ("web__lookup", "ok", PRICE),
    ]
    # The mistyped price names a tool web does not list: the admin is told, the public
    # readiness report does not show configuration.
    admin = httpx.get(gw.url + "/readyz", headers=gw.admin).json()["models"]
    assert admin["mcp:web"]["unknown_prices"] == ["lokup"]
    assert "unknown_prices" not in admin["mcp:crm"]
    public = httpx.get(gw.url + "/readyz").json()["models"]["mcp:web"]
    assert "unknown_prices" not in public
    assert "tool_prices names tools it does not list, which are never charged: lokup" in (
        gw.proc.output()
    )


def wait_rows(gw: Gateway, task: str, n: int) -> list[dict[str, Any]]:
    """The task's usage rows, once the ledger writer has `n` of them."""
    deadline = time.monotonic() + 20
    while True:
        rows = gw.usage(task=task)
        if len(rows) >= n or time.monotonic() > deadline:
            return rows
        time.sleep(0.1)


# -- breakers ------------------------------------------------------------------------


def test_a_failing_tool_server_is_cut_off_by_its_breaker_then_probed(
    gw: Gateway, tools: Tools
) -> None:
    """flaky (the HTTP tool server under a breaker that opens after two failures)
    answers explode with an HTTP 500: a read-only call is tried twice, so one call opens
    the breaker; while open, calls fail at once without reaching the server (a side
    effect's id stays free); after the cool-down one probe goes through: a failing probe
    opens it again, a good one closes it. web, the same server under its own breaker, is
    never affected."""
    marker = "breaker-" + os.urandom(3).hex()
    call_id = "call_sy_" + os.urandom(6).hex()
    email = {"to": call_id + "@example.com", "body": "hi"}

    def breaker() -> dict[str, Any]:
        models = httpx.get(gw.url + "/readyz", headers=gw.admin).json()["models"]
        assert models["mcp:web"]["breaker"]["state"] == "closed"
        return dict(models["mcp:flaky"]["breaker"])

    async def call(s: Any, tool: str, args: dict[str, Any], **meta: str) -> MCPError | str:
        try:
            return text(await s.call_tool(tool, args, meta=meta or None))
        except MCPError as exc:
            return exc

    def refused(got: MCPError | str, code: str) -> bool:
        return isinstance(got, MCPError) and got.data["code"] == code

    async def go() -> None:
        async with session(gw) as s:
            assert refused(await call(s, "flaky__explode", {}), "tool_server_error")
            assert breaker()["state"] == "open"
            cut = await call(s, "flaky__lookup", {"q": f"{marker}-open"})
            assert refused(cut, "tool_circuit_open")
            assert isinstance(cut, MCPError) and cut.code == -32053
            assert "not sent" in cut.message
            got = await call(s, "flaky__send_email", email, call_id=call_id)
            assert refused(got, "tool_circuit_open")
            assert await call(s, "web__lookup", {"q": marker}) == f"found: {marker}"
            await asyncio.sleep(1.6)  # the cool-down: a probe that fails opens it again
            assert refused(await call(s, "flaky__explode", {}), "tool_server_error")
            again = await call(s, "flaky__lookup", {"q": f"{marker}-reopened"})
            assert refused(again, "tool_circuit_open")
            await asyncio.sleep(1.6)
            # The probe: the side effect the open breaker refused runs now, once.
            got = await call(s, "flaky__send_email", email, call_id=call_id)
            assert got == f"sent to {email['to']}"
            assert breaker()["state"] == "closed"
            probe = await call(s, "flaky__lookup", {"q": f"{marker}-closed"})
            assert probe == f"found: {marker}-closed"

    run(go())
    assert Tools.runs(tools.http_log, "lookup", q=f"{marker}-open") == 0
    assert Tools.runs(tools.http_log, "lookup", q=f"{marker}-reopened") == 0
    assert Tools.runs(tools.http_log, "lookup", q=f"{marker}-closed") == 1
    assert Tools.runs(tools.http_log, "send_email", to=email["to"]) == 1
    assert Tools.runs(tools.http_log, "explode") == 0  # the 500 came before the tool
    state = httpx.get(gw.url + "/readyz").json()["models"]["mcp:flaky"]["breaker"]
    assert state["opens"] >= 2  # the public view shows the breaker too


# -- result size ---------------------------------------------------------------------


def test_a_result_over_the_cap_is_neither_passed_on_nor_stored(gw: Gateway, tools: Tools) -> None:
    call_id = "call_sy_" + os.urandom(6).hex()
    to = call_id + "@example.com"
    big = MAX_RESULT + 100

    async def go() -> tuple[str, MCPError, MCPError, MCPError]:
        async with session(gw) as s:
            small = text(await s.call_tool("web__big", {"n": 100}))
            with pytest.raises(MCPError) as read_only:
                await s.call_tool("web__big", {"n": big})
            with pytest.raises(MCPError) as side:
                await s.call_tool("crm__big", {"n": big, "to": to}, meta={"call_id": call_id})
            with pytest.raises(MCPError) as repeat:
                await s.call_tool("crm__big", {"n": big, "to": to}, meta={"call_id": call_id})
            return small, read_only.value, side.value, repeat.value

    small, read_only, side, repeat = run(go())
    assert small == "x" * 100
    assert read_only.data["code"] == "tool_result_too_large"
    assert "mcp.max_result_bytes: 4096" in read_only.message
    assert side.data["code"] == "tool_result_too_large" and "will not be run again" in side.message
    assert repeat.data["code"] == "tool_result_too_large" and "ran once already" in repeat.message
    assert Tools.runs(tools.stdio_log, "big", n=big, to=to) == 1
    # Done, not in doubt: nothing for an operator to resolve.
    listed = httpx.get(gw.url + "/admin/tool-calls", headers=gw.admin).json()["data"]
    assert call_id not in {c["call_id"] for c in listed}
    rows = [r for r in gw.usage() if r.get("error_code") == "tool_result_too_large"]
    assert len(rows) >= 2
    trace = gw.trace(rows[-1]["request_id"])
    stored = json.dumps(trace)
    assert "x" * 200 not in stored  # the result was not kept, not even in the trace
    exec_ = next(d for d in trace["decisions"] if d["stage"] == "tool_exec")
    assert exec_["outcome"] == "too_large" and exec_["evidence"]["result_bytes"] > MAX_RESULT


# -- tenants never share call records ------------------------------------------------


def test_two_tenants_using_one_call_id_never_see_each_others_calls(
    gw: Gateway, tools: Tools
) -> None:
    """Call ids are the clients': tenant B sending tenant A's id gets neither A's stored
    result nor A's refusal (in doubt, conflict): its call is its own. The operator's
    listing and resolution are per tenant too."""
    other = "other-" + os.urandom(3).hex()
    gw.create_tenant(other)
    other_key = gw.create_key(other)["key"]
    done_id = "call_sy_" + os.urandom(6).hex()
    doubt_id = "call_sy_" + os.urandom(6).hex()
    to = done_id + "@example.com"
    seconds = 2.5 + int.from_bytes(os.urandom(2), "big") / 1e6

    async def send(key: str) -> str:
        async with session(gw, key) as s:
            r = await s.call_tool(
                "crm__send_email", {"to": to, "body": "hi"}, meta={"call_id": done_id}
            )
            return text(r)

    async def hang(key: str, secs: float) -> MCPError | str:
        async with session(gw, key) as s:
            try:
                r = await s.call_tool("web__hang", {"seconds": secs}, meta={"call_id": doubt_id})
                return text(r)
            except MCPError as exc:
                return exc

    assert run(send(gw.key)) == f"sent to {to}"
    assert run(send(other_key)) == f"sent to {to}"  # its own run, not A's stored result
    assert Tools.runs(tools.stdio_log, "send_email", to=to) == 2
    assert run(send(gw.key)) == f"sent to {to}"  # A's repeat: A's stored result
    assert Tools.runs(tools.stdio_log, "send_email", to=to) == 2

    a = run(hang(gw.key, seconds))
    assert isinstance(a, MCPError) and a.data["code"] == "tool_call_in_doubt"
    # B, same id, other arguments: neither A's doubt nor a conflict with A's arguments.
    assert run(hang(other_key, 0.05)) == "woke up"

    def listed(tenant: str | None = None) -> list[dict[str, Any]]:
        params = {"tenant": tenant} if tenant else {}
        r = httpx.get(gw.url + "/admin/tool-calls", params=params, headers=gw.admin)
        return list(r.json()["data"])

    assert doubt_id not in {c["call_id"] for c in listed(other)}
    mine = [c for c in listed(gw.tenant) if c["call_id"] == doubt_id]  # type: ignore[attr-defined]
    assert len(mine) == 1 and "result" not in mine[0]

    def resolve(tenant: str) -> int:
        body = {"tenant": tenant, "call_id": doubt_id, "ran": False}
        return httpx.post(gw.url + "/admin/tool-calls", json=body, headers=gw.admin).status_code

    assert resolve(other) == 404  # B's record of that id is done, not in doubt
    assert resolve(gw.tenant) == 200  # type: ignore[attr-defined]
