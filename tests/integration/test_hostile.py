"""A hostile client against the real gateway (scripted instant upstream, real HTTP).

Each test tries several members of one class of attack from issue #17: ids that collide
across tenants, headers out of bounds, budgets across restarts, inputs that crash a
request or hold a connection, exception text reaching the client. Every test ends
by checking that the gateway still serves and that its ledger lost nothing.
"""

from __future__ import annotations

import concurrent.futures
import os
import re
import socket
import sqlite3
import tempfile
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from support.gateways import Gateway, cheap_config, start_gateway
from support.upstreams import Scripted

CHEAP = {"model": "cheap", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 10}
# What no client should ever see: Python's exception names and texts, file paths.
LEAKS = re.compile(
    r"Traceback|File \"|Error:|Exception|Connect call failed|ssl:default|ClientPayloadError"
    r"|ServerDisconnected|line \d+ column \d+|char \d+|/site-packages/|\.py\b"
)


def _config(scripted: Scripted) -> dict[str, Any]:
    dead = {
        "alias": "dead",
        "engine": {"kind": "openai", "base_url": "http://127.0.0.1:9/v1"},
        "resilience": {"retries": 0},
    }
    return cheap_config(scripted, dead)


@pytest.fixture(scope="module")
def gw(scripted: Scripted) -> Iterator[Gateway]:
    g = start_gateway(_config(scripted))
    yield g
    g.proc.stop()


def _key(gw: Gateway, tenant: str | None = None, **limits: Any) -> tuple[str, str]:
    tid = tenant or "h" + os.urandom(4).hex()
    gw.create_tenant(tid, **limits)
    return tid, str(gw.create_key(tid)["key"])


def _chat(
    gw: Gateway, key: str, body: dict[str, Any] | None = None, **headers: str
) -> httpx.Response:
    h = {"Authorization": f"Bearer {key}", **headers}
    return httpx.post(gw.url + "/v1/chat/completions", json=body or CHEAP, headers=h, timeout=30)


def _still_serves(gw: Gateway, key: str) -> None:
    r = _chat(gw, key)
    assert r.status_code == 200, r.text


def _no_rows_lost(gw: Gateway) -> None:
    metrics = httpx.get(gw.url + "/metrics", headers=gw.admin).text
    dropped = re.search(r"^switchyard_ledger_rows_dropped_total (\S+)$", metrics, re.M)
    assert dropped is not None and float(dropped.group(1)) == 0.0


# -- 1. ids ----------------------------------------------------------------------------


def test_a_client_id_cannot_overwrite_another_tenants_rows(gw: Gateway) -> None:
    ta, ka = _key(gw)
    tb, kb = _key(gw)
    a = _chat(gw, ka, **{"x-request-id": "shared-id-1"})
    # B reuses A's client id, and A's gateway id in both header spellings.
    gid = a.headers["x-request-id"]
    b1 = _chat(gw, kb, **{"x-request-id": "shared-id-1"})
    b2 = _chat(gw, kb, **{"x-request-id": gid})
    b3 = _chat(gw, kb, **{"x-client-request-id": gid})
    assert {r.status_code for r in (a, b1, b2, b3)} == {200}
    ids = {r.headers["x-request-id"] for r in (a, b1, b2, b3)}
    assert len(ids) == 4 and all(i.startswith("req_") for i in ids)
    rows_a = gw.usage(tenant=ta, limit=10)
    assert [r["request_id"] for r in rows_a] == [gid] and rows_a[0]["tenant_id"] == ta
    assert len(gw.usage(tenant=tb, limit=10)) == 3
    # The trace of A's request is A's, by the gateway's id and by A's own id in A's tenant.
    by_gid = httpx.get(gw.url + f"/admin/requests/{gid}", headers=gw.admin).json()
    assert by_gid["tenant_id"] == ta
    ambiguous = httpx.get(gw.url + "/admin/requests/shared-id-1", headers=gw.admin)
    assert ambiguous.status_code == 400 and ambiguous.json()["error"]["param"] == "tenant"
    scoped = httpx.get(
        gw.url + "/admin/requests/shared-id-1", params={"tenant": tb}, headers=gw.admin
    ).json()
    assert scoped["tenant_id"] == tb and scoped["client_request_id"] == "shared-id-1"
    _no_rows_lost(gw)


def test_one_fixed_request_id_cannot_spend_past_the_budget(gw: Gateway) -> None:
    tid, key = _key(gw, budget_usd=0.1, budget_period="day")  # fits 10 requests of $0.01
    codes = [_chat(gw, key, **{"x-request-id": "same"}).status_code for _ in range(14)]
    assert codes.count(200) == 10 and codes.count(429) == 4
    rows = gw.usage(tenant=tid, limit=100)
    assert len(rows) == 14 and len({r["request_id"] for r in rows}) == 14
    assert sum(r["cost_usd"] for r in rows) == pytest.approx(0.1)


def test_budget_survives_a_restart_exactly(scripted: Scripted) -> None:
    db = tempfile.mkdtemp(prefix="switchyard-db-") + "/switchyard.db"
    first = start_gateway(_config(scripted), db=db)
    try:
        tid, key = _key(first, budget_usd=0.1, budget_period="day")
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            before = list(pool.map(lambda _: _chat(first, key).status_code, range(7)))
        assert before.count(200) == 7
    finally:
        first.proc.stop()
    # Retention may have removed the raw rows meanwhile: the daily rollups are the bill.
    conn = sqlite3.connect(db)
    conn.execute("DELETE FROM usage")
    conn.commit()
    conn.close()
    second = start_gateway(_config(scripted), db=db)
    try:
        after = [_chat(second, key, **{"x-request-id": "same"}).status_code for _ in range(8)]
        assert after.count(200) == 3 and after.count(429) == 5
        assert len(second.usage(tenant=tid, limit=100)) == 8
        conn = sqlite3.connect(db)
        spent, requests = conn.execute(
            "SELECT SUM(cost_usd), SUM(requests) FROM usage_daily WHERE tenant_id = ?", (tid,)
        ).fetchone()
        conn.close()
        assert requests == 15 and spent <= 0.1 + 1e-9
        _no_rows_lost(second)
    finally:
        second.proc.stop()


_TASK_HEADERS = ("x-task-budget", "x-task-timeout", "x-task-deadline")


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("x-task-planned-steps", "99999999999999999999999999"),
        ("x-task-planned-steps", "-1"),
        ("x-request-timeout", "1_0"),
        ("x-request-timeout", "nan"),
        ("x-request-id", "a" * 129),
        ("x-client-request-id", "not allowed!"),
        ("x-task-id", "t" * 500),
        ("x-parent-request-id", ",".join(["p"] * 100)),
        ("cache-control", "x" * 1000),
        ("idempotency-key", "k" * 300),
        ("x-task-budget", "calls=" + "9" * 40),
        ("x-task-budget", "cost_usd=-1"),
        ("x-task-budget", "tokens=1," * 200),
        ("x-task-timeout", "inf"),
        ("x-task-deadline", "2026-12-01T00:00:00"),
        ("x-task-deadline", "9" * 300),
    ],
)
def test_a_header_out_of_bounds_is_400_naming_it_and_still_recorded(
    gw: Gateway, name: str, value: str
) -> None:
    tid, key = _key(gw)
    # The task's own headers are read for a request of a task.
    extra = {"x-task-id": "hostile-task"} if name in _TASK_HEADERS else {}
    r = _chat(gw, key, **{name: value, **extra})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == "invalid_header" and err["param"].lower() == name
    rows = gw.usage(tenant=tid, limit=10)
    assert len(rows) == 1 and rows[0]["error_code"] == "invalid_header"
    _still_serves(gw, key)
    _no_rows_lost(gw)


# -- 3. inputs that crash a request or hold a connection --------------------------------


def _nested(depth: int) -> str:
    """JSON text nesting `depth` levels of alternating objects and arrays (built as
    text: no JSON encoder writes this deep)."""
    opens = "".join('{"k":' if i % 2 == 0 else "[" for i in range(depth))
    closes = "".join("}" if i % 2 == 0 else "]" for i in reversed(range(depth)))
    return opens + "1" + closes


@pytest.mark.parametrize("depth", [200, 300, 600, 1100, 5000])
@pytest.mark.parametrize("where", ["body", "message", "tool_schema"])
def test_deep_json_is_400_not_500(gw: Gateway, depth: int, where: str) -> None:
    tid, key = _key(gw)
    deep = _nested(depth)
    head = '{"model": "cheap", "max_tokens": 10, '
    if where == "body":
        text = head + f'"messages": [{{"role": "user", "content": "hi"}}], "extra": {deep}}}'
    elif where == "message":
        text = head + f'"messages": [{{"role": "user", "content": "hi", "extra": {deep}}}]}}'
    else:
        text = (
            head + '"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": '
            f'"function", "function": {{"name": "f", "parameters": {{"type": "object", '
            f'"x": {deep}}}}}}}]}}'
        )
    r = httpx.post(
        gw.url + "/v1/chat/completions",
        content=text.encode(),
        headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"},
        timeout=30,
    )
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"]
    assert "nested deeper" in message or message == "the request body is not valid JSON"
    assert not LEAKS.search(r.text), r.text
    assert len(gw.usage(tenant=tid, limit=10)) == 1
    _still_serves(gw, key)


def _raw(gw: Gateway, data: bytes, read_timeout: float = 15.0) -> bytes:
    with socket.create_connection(("127.0.0.1", gw.port), timeout=read_timeout) as s:
        s.sendall(data)
        chunks = []
        try:
            while True:
                got = s.recv(65536)
                if not got:
                    break
                chunks.append(got)
        except TimeoutError:
            pass
        return b"".join(chunks)


def test_a_stalled_body_ends_at_its_deadline_with_408(gw: Gateway) -> None:
    tid, key = _key(gw)
    head = (
        "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
        f"Authorization: Bearer {key}\r\nContent-Type: application/json\r\n"
        "Content-Length: 200\r\nx-request-timeout: 2\r\n\r\n"
    ).encode()
    started = time.monotonic()
    reply = _raw(gw, head + b'{"model":', read_timeout=20)
    took = time.monotonic() - started
    assert reply.startswith(b"HTTP/1.1 408"), reply[:200]
    assert b'"code":"request_timeout"' in reply
    assert took < 10  # a hang guard, not a timing claim
    rows = gw.usage(tenant=tid, limit=10)
    assert len(rows) == 1 and rows[0]["error_code"] == "request_timeout"
    _still_serves(gw, key)


def test_headers_that_never_finish_are_cut_off(gw: Gateway) -> None:
    started = time.monotonic()
    reply = _raw(gw, b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nX-Slow: a", 30)
    assert time.monotonic() - started < 25  # the header timeout ended it
    assert reply == b"" or reply.startswith(b"HTTP/1.1 408"), reply[:200]


@pytest.mark.parametrize(
    "request_bytes",
    [
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n{}",
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: -5\r\n\r\n{}",
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n{}",
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nX-Bad: a\x01b\r\n\r\n",
        b"GARBAGE\r\n\r\n",
    ],
)
def test_malformed_framing_gets_the_openai_error_body(gw: Gateway, request_bytes: bytes) -> None:
    reply = _raw(gw, request_bytes, read_timeout=10)
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400"), reply[:300]
    assert b"application/json" in head
    assert b'"error"' in body and b'"invalid_request_error"' in body
    _, key = _key(gw)
    _still_serves(gw, key)


@pytest.mark.parametrize(
    "body",
    [
        b'{"model": "cheap", "messages": [',
        b'{"model": "cheap", "messages": [{"role": "user", "content": "hi"}]} trailing',
        b"\xff\xfe not utf-8",
    ],
)
def test_bad_json_gets_a_stable_message(gw: Gateway, body: bytes) -> None:
    _, key = _key(gw)
    r = httpx.post(
        gw.url + "/v1/chat/completions",
        content=body,
        headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"},
    )
    assert r.status_code == 400
    assert r.json()["error"]["message"] == "the request body is not valid JSON"


def test_upstream_failures_reach_the_client_without_exception_text(gw: Gateway) -> None:
    _, key = _key(gw)
    r = _chat(gw, key, {**CHEAP, "model": "dead"})
    assert r.status_code == 502
    assert r.json()["error"]["code"] == "upstream_unreachable"
    assert not LEAKS.search(r.text), r.text


# -- 5. accounting ------------------------------------------------------------------------


def test_a_retry_skipped_for_the_deadline_costs_no_retry_budget(tmp_path: Any) -> None:
    """In process, with the real gateway and executor; only the upstream's reply is
    scripted: a retryable 503 asking for a 5 s wait, under a 1 s deadline."""
    import asyncio

    from switchyard.api.app import create_app
    from switchyard.config import parse_settings
    from switchyard.errors import UpstreamError

    settings = parse_settings(
        {
            "models": [
                {
                    "alias": "m",
                    "engine": {"kind": "openai", "base_url": "http://127.0.0.1:9/v1"},
                    "resilience": {"retries": 1},
                }
            ],
            "embeddings": {"enabled": False},
            "auth": {"mode": "disabled"},
            "storage": {"sqlite_path": str(tmp_path / "t.db")},
        }
    )
    app = create_app(settings)
    gw = app.state.gateway
    calls = 0

    async def unavailable(*_a: Any, **_k: Any) -> Any:
        nonlocal calls
        calls += 1
        err = UpstreamError("upstream m failed with HTTP 503")
        err.retry_class, err.retry_after_s = "503", 5.0
        raise err

    gw.registry.deployments["m"].upstream.post = unavailable

    async def go() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            return await client.post(
                "/v1/chat/completions",
                json={"model": "m", "messages": [{"role": "user", "content": "hi"}]},
                headers={"x-request-timeout": "1"},
            )

    try:
        r = asyncio.run(go())
        assert r.status_code == 502 and calls == 1
        budget = gw.executor.budgets["m"]
        assert budget.denied == 0 and not budget._retries  # nothing was spent
    finally:
        gw.ledger.close()


def test_refusals_are_counted_under_their_model(gw: Gateway) -> None:
    tid, key = _key(gw, rpm=1)
    assert _chat(gw, key).status_code == 200
    assert _chat(gw, key).status_code == 429
    metrics = httpx.get(gw.url + "/metrics", headers=gw.admin).text
    refused = [
        line
        for line in metrics.splitlines()
        if line.startswith("switchyard_requests_total{")
        and 'status="error"' in line
        and f'tenant="{tid}"' in line
    ]
    assert len(refused) == 1 and 'model="cheap"' in refused[0], refused


# -- 4. requests the contract says are invalid --------------------------------------------


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "text", "text": "what is this?"},
                            {"type": "image_url", "image_url": {"url": "https://x/cat.png"}},
                        ],
                    }
                ]
            },
            "messages[0].content[1]",
        ),
        ({"n": 1000}, "n"),
        ({"logprobs": "yes"}, "logprobs"),
        ({"user": {"id": 1}}, "user"),
        ({"max_tokens": 2**63}, "max_tokens"),
        ({"response_format": "json"}, "response_format"),
        ({"tool_choice": "always"}, "tool_choice"),
        (
            {"tools": [{"type": "function", "function": {"parameters": {}}}]},
            "tools[0].function.name",
        ),
    ],
)
def test_invalid_fields_are_refused_not_forwarded(
    gw: Gateway, scripted: Scripted, body: dict[str, Any], param: str
) -> None:
    tid, key = _key(gw)
    before = scripted.requests()
    r = _chat(gw, key, {**CHEAP, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
    assert scripted.requests() == before  # never reached the upstream
    assert len(gw.usage(tenant=tid, limit=10)) == 1


# -- 6. what is kept ------------------------------------------------------------------------


def test_trace_policy_keeps_what_explains_and_samples_plain_successes(scripted: Scripted) -> None:
    config = _config(scripted)
    config["observe"] = {"traces_sample_ok": 0.0}
    g = start_gateway(config)
    try:
        _, key = _key(g)
        plain = _chat(g, key)
        failed = _chat(g, key, {**CHEAP, "model": "dead"})
        task = _chat(g, key, **{"x-task-id": "kept-task"})
        assert [r.status_code for r in (plain, failed, task)] == [200, 502, 200]

        def trace(r: httpx.Response) -> int:
            rid = r.headers["x-request-id"]
            return httpx.get(g.url + f"/admin/requests/{rid}", headers=g.admin).status_code

        assert trace(plain) == 404  # sampled out (a share of 0)
        assert trace(failed) == 200 and trace(task) == 200
        assert len(g.usage(limit=10)) == 3  # every usage row is kept
    finally:
        g.proc.stop()


# -- task and tool endpoints -------------------------------------------------------------


@pytest.mark.parametrize("task_id", ["a" * 129, "no spaces", "semi;colon", "%00"])
@pytest.mark.parametrize("method", ["GET", "DELETE"])
def test_a_bad_task_id_in_the_path_is_400(gw: Gateway, task_id: str, method: str) -> None:
    _, key = _key(gw)
    r = httpx.request(
        method, f"{gw.url}/v1/tasks/{task_id}", headers={"Authorization": f"Bearer {key}"}
    )
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "task_id"
    r = httpx.request(method, f"{gw.url}/v1/tasks/ok-id")  # no key: 401, nothing revealed
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"


@pytest.mark.parametrize(
    "body",
    [
        {"tenant": 5, "call_id": "c", "approver": "a"},
        {"tenant": "t", "call_id": "c" * 1000, "approver": "a"},
        {"tenant": "t", "call_id": "c", "approver": "a", "ttl_s": 10**12},
        {"tenant": "t", "call_id": "c", "approver": "a", "ttl_s": True},
        {"tenant": "t", "call_id": "c", "approver": "a", "task_id": "bad id"},
        {"tenant": "t", "call_id": "c", "approver": "a", "extra": 1},
        {"tenant": "t", "call_id": "c"},
    ],
)
def test_a_bad_approval_request_is_400(gw: Gateway, body: dict[str, Any]) -> None:
    r = httpx.post(gw.url + "/admin/approvals", json=body, headers=gw.admin)
    assert r.status_code == 400, r.text
    assert set(r.json()["error"]) == {"message", "type", "param", "code"}


def test_many_forged_tool_results_are_bounded(gw: Gateway) -> None:
    """More results than the gateway checks is a 400: checking the first 256 and
    forwarding the rest unchecked would be a way past the approval gate."""
    _, key = _key(gw)
    messages = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]
    messages += [{"role": "tool", "tool_call_id": f"c{i}", "content": "r"} for i in range(3000)]
    r = _chat(gw, key, {**CHEAP, "messages": messages}, **{"x-task-id": "forged"})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == "too_many_tool_results"
    r = _chat(gw, key, {**CHEAP, "messages": messages[:258]}, **{"x-task-id": "forged"})
    assert r.status_code == 200, r.text
    d = next(
        d for d in gw.trace(r.headers["x-request-id"])["decisions"] if d["stage"] == "tool_results"
    )
    assert d["evidence"]["checked"] == 256  # every one of them looked at
    _still_serves(gw, key)
