"""The MCP gateway's parts without servers: the at-most-once record (on a real SQLite
file, two stores standing for two gateway processes), the config's rules, the JSON-RPC
error shape and the task analysis's tool time."""

from __future__ import annotations

import asyncio
import os
import secrets
import sqlite3
import time
from pathlib import Path
from typing import Any

import orjson
import pytest
from pydantic import ValidationError

from switchyard.config import McpConfig, McpServerConfig
from switchyard.errors import PermissionDenied, ToolCallInDoubt, jsonrpc_code
from switchyard.observe.tasks import analyze_task
from switchyard.policy.tool_calls import args_digest
from switchyard.state.sealing import Sealer
from switchyard.state.sql import connect
from switchyard.state.tool_calls import ToolCallRecords

SEALER = Sealer(secrets.token_bytes(32))


def records(path: Path) -> ToolCallRecords:
    return ToolCallRecords(connect(str(path)), SEALER, None)


def soon(s: float = 2.0) -> float:
    return time.perf_counter() + s


def test_a_claimed_call_gives_its_sealed_result_to_every_repeat(tmp_path: Path) -> None:
    db = tmp_path / "s.db"
    a, b = records(db), records(db)  # two processes' stores on one file
    digest = args_digest("crm__send", {"to": "x@y.z"})

    async def go() -> None:
        first = await a.claim("t", "call_sy_1", "task", "crm__send", digest, "req1", soon())
        assert first.state == "owner"
        # Another process, while it runs: it waits, then gets the result.
        waiting = asyncio.create_task(
            b.claim("t", "call_sy_1", "task", "crm__send", digest, "req2", soon())
        )
        await asyncio.sleep(0.1)
        assert not waiting.done()
        await a.complete("t", "call_sy_1", {"content": [{"type": "text", "text": "sent"}]})
        got = await waiting
        assert got.state == "done" and got.result == {"content": [{"type": "text", "text": "sent"}]}
        assert got.request_id == "req1"

    asyncio.run(go())
    raw = sqlite3.connect(db).execute("SELECT result FROM tool_calls").fetchone()[0]
    assert b"sent" not in bytes(raw)  # sealed at rest


def test_in_doubt_stays_in_doubt_until_an_operator_resolves_it(tmp_path: Path) -> None:
    r = records(tmp_path / "s.db")
    d = args_digest("web__pay", {"n": 1})

    async def claim() -> str:
        return (await r.claim("t", "c1", None, "web__pay", d, "rq", soon(0.2))).state

    async def go() -> None:
        assert await claim() == "owner"
        await r.doubt("t", "c1")
        assert await claim() == "in_doubt"
        assert [c["call_id"] for c in r.in_doubt("t")] == ["c1"]
        assert r.in_doubt("other") == []
        assert r.resolve("t", "c1", ran=False)
        assert await claim() == "owner"  # released: a repeat runs it
        await r.doubt("t", "c1")
        assert r.resolve("t", "c1", ran=True)
        assert await claim() == "resolved_ran"
        assert not r.resolve("t", "c1", ran=True)  # no longer in doubt

    asyncio.run(go())


def test_a_released_call_runs_again_and_another_use_of_its_id_conflicts(tmp_path: Path) -> None:
    r = records(tmp_path / "s.db")
    d1, d2 = args_digest("x__t", {"a": 1}), args_digest("x__t", {"a": 2})
    assert args_digest("x__t", '{"a": 1}') == d1  # a JSON string is the same arguments

    async def go() -> None:
        assert (await r.claim("t", "c", None, "x__t", d1, "r1", soon())).state == "owner"
        assert (await r.claim("t", "c", None, "x__t", d2, "r2", soon(0.1))).state == "conflict"
        assert (await r.claim("u", "c", None, "x__t", d2, "r3", soon(0.1))).state == "owner"
        await r.release("t", "c")
        assert (await r.claim("t", "c", None, "x__t", d2, "r4", soon())).state == "owner"

    asyncio.run(go())


def test_a_repeat_gives_up_at_its_deadline_while_the_first_still_runs(tmp_path: Path) -> None:
    r = records(tmp_path / "s.db")

    async def go() -> None:
        assert (await r.claim("t", "c", None, "x__t", "d", "r1", soon())).state == "owner"
        t = time.perf_counter()
        got = await r.claim("t", "c", None, "x__t", "d", "r2", soon(0.3))
        assert got.state == "in_flight" and 0.25 < time.perf_counter() - t < 2

    asyncio.run(go())


def test_the_config_names_servers_one_way_and_each_needs_one_transport() -> None:
    McpServerConfig(name="crm", command=["python", "-m", "x"])
    McpServerConfig(name="web-2", url="http://127.0.0.1:9/mcp")
    for bad in (
        {"name": "crm_x", "url": "http://h/mcp"},  # `_` would make names ambiguous
        {"name": "crm"},
        {"name": "crm", "url": "http://h/mcp", "command": ["x"]},
        {"name": "crm", "url": "file:///etc/passwd"},
    ):
        with pytest.raises(ValidationError):
            McpServerConfig.model_validate(bad)
    with pytest.raises(ValidationError, match="unique"):
        McpConfig.model_validate({"servers": [{"name": "a", "url": "http://h"}] * 2})


def test_credentials_come_from_the_environment_only_by_reference() -> None:
    os.environ["SY_UNIT_TOKEN"] = "v4lue"
    try:
        cfg = McpServerConfig(
            name="crm", command=["x"], env={"TOKEN": "SY_UNIT_TOKEN", "GONE": "SY_UNIT_MISSING"}
        )
        assert cfg.credentials(cfg.env) == {"TOKEN": "v4lue"}
        assert "v4lue" not in cfg.model_dump_json()
    finally:
        del os.environ["SY_UNIT_TOKEN"]


def test_errors_are_json_rpc_errors_with_our_type_and_code() -> None:
    err = PermissionDenied("no", code="tool_not_allowed").jsonrpc_error()
    assert err == {
        "code": -32043,
        "message": "no",
        "data": {"type": "permission_error", "code": "tool_not_allowed", "status": 403},
    }
    assert ToolCallInDoubt("x").jsonrpc_error()["code"] == -32049
    assert jsonrpc_code(500) == -32603 and jsonrpc_code(418) == -32600


def test_the_task_analysis_splits_the_critical_path_into_model_tool_and_gaps() -> None:
    def rec(rid: str, endpoint: str, at: float, ms: float, queue: float = 0.0) -> dict:
        return {
            "request_id": rid,
            "task_id": "t",
            "endpoint": endpoint,
            "model": "crm__send" if endpoint == "tools.call" else "m",
            "status": "ok",
            "received_at": 1000.0 + at,
            "timings": {"duration_ms": ms, "queue_ms": queue},
        }

    a = analyze_task(
        [
            rec("a", "chat.completions", 0.0, 100, queue=20),
            rec("b", "tools.call", 0.15, 300),
            rec("c", "chat.completions", 0.5, 100),
        ]
    )
    assert a["llm_calls"] == 2 and a["tool_calls"] == 1
    assert [s["kind"] for s in a["steps"]] == ["model", "tool", "model"]
    assert a["time_by_kind"] == {
        "model_queue_ms": 20.0,
        "model_ms": 180.0,
        "tool_ms": 300.0,
        "gap_ms": 100.0,
    }


def test_a_call_whose_owner_stopped_mid_call_becomes_in_doubt(tmp_path: Path) -> None:
    r = records(tmp_path / "s.db")

    async def go() -> None:
        assert (await r.claim("t", "c", None, "x__t", "d", "r1", soon())).state == "owner"
        # (the owning gateway stops here, its row left in flight)
        got = await r.claim("t", "c", None, "x__t", "d", "r2", soon(0.1), stale_after_s=60)
        assert got.state == "in_flight"
        r.conn.execute("UPDATE tool_calls SET updated_at = updated_at - 61")
        got = await r.claim("t", "c", None, "x__t", "d", "r3", soon(0.1), stale_after_s=60)
        assert got.state == "in_doubt" and got.request_id == "r1"

    asyncio.run(go())


def test_retention_forgets_finished_calls_but_never_those_in_doubt(tmp_path: Path) -> None:
    r = records(tmp_path / "s.db")

    async def go() -> None:
        for cid in ("done", "doubt", "running"):
            assert (await r.claim("t", cid, None, "x__t", "d", "r", soon())).state == "owner"
        await r.complete("t", "done", {"content": []})
        await r.doubt("t", "doubt")

    asyncio.run(go())
    assert ToolCallRecords.forget_before(r.conn, time.time() - 60) == 0  # all recent
    assert ToolCallRecords.forget_before(r.conn, time.time() + 60) == 1
    left = {row[0] for row in r.conn.execute("SELECT call_id FROM tool_calls")}
    assert left == {"doubt", "running"}


def test_a_call_whose_result_was_too_large_is_done_never_in_doubt(tmp_path: Path) -> None:
    r = records(tmp_path / "s.db")

    async def go() -> None:
        assert (await r.claim("t", "c", None, "x__t", "d", "r1", soon())).state == "owner"
        await r.complete_too_large("t", "c")
        got = await r.claim("t", "c", None, "x__t", "d", "r2", soon(0.1))
        assert got.state == "too_large" and got.result is None and got.request_id == "r1"
        assert r.in_doubt("t") == []  # nothing for an operator to resolve
        assert not r.resolve("t", "c", ran=False)  # and no way to have it run again

    asyncio.run(go())
    assert ToolCallRecords.forget_before(r.conn, time.time() + 60) == 1  # retention, as done


def test_one_call_id_of_two_tenants_is_two_calls(tmp_path: Path) -> None:
    """A call record is keyed by (tenant, call id), and its result is sealed to its
    tenant: another tenant's claim of the same id owns a call of its own, and even a
    result copied into its row would not open."""
    from switchyard.state.sealing import SealError

    db = tmp_path / "s.db"
    a, b = records(db), records(db)
    d = args_digest("crm__send", {"to": "x@y.z"})

    async def go() -> None:
        assert (await a.claim("acme", "call_sy_1", "t", "crm__send", d, "r1", soon())).state == (
            "owner"
        )
        await a.complete("acme", "call_sy_1", {"content": [{"type": "text", "text": "acme's"}]})
        got = await b.claim("zeta", "call_sy_1", "t", "crm__send", d, "r2", soon(0.1))
        assert got.state == "owner" and got.result is None
        await b.doubt("zeta", "call_sy_1")
        again = await a.claim("acme", "call_sy_1", "t", "crm__send", d, "r3", soon(0.1))
        assert again.state == "done" and again.result is not None  # zeta's doubt: not acme's
        assert [c["tenant_id"] for c in a.in_doubt("zeta")] == ["zeta"]
        assert a.in_doubt("acme") == []
        assert not a.resolve("acme", "call_sy_1", ran=True)  # acme's is done, not in doubt

    asyncio.run(go())
    conn = sqlite3.connect(db)
    blob = conn.execute("SELECT result FROM tool_calls WHERE tenant_id = 'acme'").fetchone()[0]
    with pytest.raises(SealError):
        SEALER.open("zeta", "tool-call:call_sy_1", bytes(blob))


def test_the_config_bounds_result_sizes_prices_and_takes_a_breaker() -> None:
    from switchyard.config import TaskBudgetConfig

    assert McpConfig().max_result_bytes == 1_048_576
    for bad in (0, 1023, 64 * 1_048_576 + 1):
        with pytest.raises(ValidationError):
            McpConfig(max_result_bytes=bad)
    cfg = McpServerConfig(
        name="crm",
        url="http://h/mcp",
        tool_prices={"send_sms": 0.0075},
        breaker={"failures": 2, "cooldown_s": 5},  # type: ignore[arg-type]
    )
    assert cfg.breaker.failures == 2 and cfg.tool_prices == {"send_sms": 0.0075}
    assert McpServerConfig(name="crm", url="http://h/mcp").breaker.failures == 5
    for prices in ({"send_sms": -0.01}, {"send_sms": 1001.0}, {"": 1.0}, {"x" * 129: 1.0}):
        with pytest.raises(ValidationError, match="tool_prices"):
            McpServerConfig(name="crm", url="http://h/mcp", tool_prices=prices)
    assert TaskBudgetConfig(tool_calls=3).tool_calls == 3
    with pytest.raises(ValidationError):
        TaskBudgetConfig(tool_calls=0)


def test_what_counts_against_a_tool_servers_breaker() -> None:
    from switchyard.engines.mcp_servers import CallOutcome

    assert not CallOutcome(result={"content": []}).failed
    assert not CallOutcome(result={"content": [], "isError": True}).failed  # the tool's own
    assert not CallOutcome(error=(-32602, "bad params")).failed  # the caller's mistake
    assert CallOutcome(error=(-32001, "timed out"), sent=True, timed_out=True).failed
    assert CallOutcome(error=(-32000, "connection lost"), sent=True).failed
    assert CallOutcome(error=(-32603, "5xx"), sent=True, server_error=True).failed


# -- /mcp's hot path: which requests it takes, and what it answers --------------------


class _Service:
    """Stands for the tool service: answers, refuses, fails or waits as the name says."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any, Any]] = []

    async def call(
        self, who: Any, name: str, arguments: Any, meta: Any, check: Any = None
    ) -> dict[str, Any]:
        if check is not None:  # the endpoint's bounds, run where the service records
            check()
        self.calls.append((name, arguments, meta))
        if name == "refused":
            raise PermissionDenied("no", code="tool_not_allowed")
        if name == "broken":
            raise RuntimeError("secret internals")
        if name == "slow":
            await asyncio.sleep(30)
        return {"content": [{"type": "text", "text": f"ran {name}"}]}


def _endpoint() -> tuple[Any, _Service, Any]:
    from types import SimpleNamespace

    from switchyard.api.mcp import McpEndpoint
    from switchyard.identity import ANONYMOUS
    from switchyard.mcp_service import Caller

    service = _Service()
    endpoint = McpEndpoint(service, auth=None, max_body_bytes=10_000)  # type: ignore[arg-type]
    transport = SimpleNamespace(
        idle_scope=None, _idle_timeout=None, _requests_in_flight=0, is_terminated=False
    )
    caller = Caller(ANONYMOUS)

    async def serve(body: object) -> tuple[bool, int | None, Any]:
        sent: list[Any] = []  # this request's own messages

        async def send(message: Any) -> None:
            sent.append(message)

        raw = body if isinstance(body, bytes) else orjson.dumps(body)
        took = await endpoint._serve_fast(send, raw, "s1", transport, caller)
        if not took:
            return False, None, None
        status = sent[0]["status"]
        payload = sent[1]["body"]
        return True, status, orjson.loads(payload) if payload else None

    return endpoint, service, serve


def _call(rid: object, **params: object) -> dict[str, object]:
    return {"jsonrpc": "2.0", "id": rid, "method": "tools/call", "params": params}


def test_the_hot_path_takes_only_a_well_formed_tools_call() -> None:
    async def go() -> None:
        _, service, serve = _endpoint()
        took, status, reply = await serve(_call(1, name="a__b", arguments={"x": 1}))
        assert took and status == 200
        assert reply == {
            "jsonrpc": "2.0",
            "id": 1,
            "result": {"content": [{"type": "text", "text": "ran a__b"}]},
        }
        took, _, reply = await serve(_call("s-1", name="a__b", _meta={"call_id": "call_sy_1"}))
        assert took and reply["id"] == "s-1" and service.calls[-1][2] == {"call_id": "call_sy_1"}
        # Everything else is the SDK's to answer, as it always was.
        for body in (
            b"{not json",
            [_call(1, name="a__b")],
            {**_call(1, name="a__b"), "jsonrpc": "1.0"},
            {**_call(1, name="a__b"), "extra": 1},
            _call(2**53, name="a__b"),
            _call("", name="a__b"),
            _call("i" * 129, name="a__b"),
            {"jsonrpc": "2.0", "id": 1, "method": "tools/list"},
            {"jsonrpc": "2.0", "id": 1, "method": "tools/call"},
            _call(1, name=5),
            _call(1, name="a__b", arguments=[1]),
            _call(1, name="a__b", _meta="x"),
            {"jsonrpc": "2.0", "method": "notifications/cancelled", "params": {"requestId": 1}},
        ):
            before = len(service.calls)
            assert (await serve(body))[0] is False, body
            assert len(service.calls) == before
        # `params` that are no object are answered here, for the request's own id (the
        # SDK refuses the envelope before it reads the id): -32602, nothing runs.
        before = len(service.calls)
        took, status, reply = await serve(
            {"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": [1]}
        )
        assert took and status == 400 and len(service.calls) == before
        assert (reply["id"], reply["error"]["code"]) == (1, -32602)
        # An id no MCP request may have is answered here: the SDK would take the
        # message for a notification and answer nothing.
        for rid in (True, 1.5, {"id": 1}, None, [1]):
            before = len(service.calls)
            took, status, reply = await serve(_call(rid, name="a__b"))
            assert took and status == 400, rid
            assert reply == {
                "jsonrpc": "2.0",
                "id": None,
                "error": {
                    "code": -32600,
                    "message": "Invalid Request: an MCP request's id is a string or an integer",
                },
            }
            assert len(service.calls) == before

    asyncio.run(go())


def test_the_hot_path_answers_refusals_and_failures_as_json_rpc_errors() -> None:
    async def go() -> None:
        _, _, serve = _endpoint()
        _, status, reply = await serve(_call(3, name="refused"))
        assert status == 200 and reply["id"] == 3
        assert reply["error"]["code"] == jsonrpc_code(403)
        assert reply["error"]["data"]["code"] == "tool_not_allowed"
        _, _, reply = await serve(_call(4, name="broken"))
        assert reply["error"]["data"]["code"] == "internal_error"
        assert "secret internals" not in orjson.dumps(reply).decode()
        _, _, reply = await serve(_call(5, name="x" * 201))
        assert reply["error"]["code"] == jsonrpc_code(400)

    asyncio.run(go())


def test_a_cancel_notification_stops_a_hot_path_call() -> None:
    async def go() -> None:
        endpoint, _, serve = _endpoint()
        job = asyncio.ensure_future(serve(_call(9, name="slow")))
        await asyncio.sleep(0.05)
        assert ("s1", 9) in endpoint._calls
        cancel = {"jsonrpc": "2.0", "method": "notifications/cancelled", "params": {"requestId": 9}}
        took, status, _ = await serve(cancel)
        assert took and status == 202
        _, status, reply = await asyncio.wait_for(job, 5)
        assert status == 200 and reply["error"]["code"] == -32800 and reply["id"] == 9
        assert not endpoint._calls

    asyncio.run(go())
