"""`switchyard serve --workers 4` as a user runs it: no Redis configured (the gateway
starts its own), one ledger writer, one control plane; what must be counted once is
counted once over every worker (scale/workers.py)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from support.gateways import Gateway, local_model, start_gateway
from support.mcp_sessions import Tools
from support.paths import MCP_TOOL_SERVER
from support.procs import worker_pids
from support.upstreams import Scripted, start_scripted

WORKERS = 4
BODY = {"model": "cheap", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 10}


@pytest.fixture(scope="module")
def scripted() -> Iterator[Scripted]:
    proc, s = start_scripted("--tokens", "10")
    yield s
    proc.stop()


@pytest.fixture(scope="module")
def gw(scripted: Scripted, tools: Tools) -> Iterator[Gateway]:
    upstream = {"kind": "openai", "base_url": scripted.url + "/v1"}
    stdio = [sys.executable, MCP_TOOL_SERVER, "stdio", tools.stdio_log]
    config = {
        "mcp": {"servers": [{"name": "crm", "command": stdio}]},
        "models": [
            # $1000 per million output tokens: 10 tokens cost exactly $0.01.
            {"alias": "cheap", "engine": upstream, "price": {"input": 0.0, "output": 1000.0}},
            {"alias": "narrow", "engine": upstream, "limits": {"max_concurrency": 2, "queue": 64}},
            local_model("smol"),  # one engine for every worker, in the control plane
            {
                "alias": "pair",
                "balance": {"strategy": "weighted"},
                "deployments": [
                    {"name": "a", "engine": upstream, "weight": 1},
                    {"name": "b", "engine": upstream, "weight": 1},
                ],
            },
        ],
        "embeddings": {"enabled": False},
    }
    g = start_gateway(config, serve_args=("--workers", str(WORKERS)))
    yield g
    g.proc.stop()


def _tenant(gw: Gateway, **limits: Any) -> str:
    tid = "t" + str(time.monotonic_ns())[-9:]
    gw.create_tenant(tid, **limits)
    return str(gw.create_key(tid)["key"])


def _post(gw: Gateway, key: str, body: dict[str, Any] = BODY, **headers: str) -> httpx.Response:
    # A new connection per request: the kernel spreads them over the workers.
    return httpx.post(
        gw.url + "/v1/chat/completions",
        json=body,
        headers={"Authorization": f"Bearer {key}", **headers},
        timeout=60,
    )


def _many(n: int, call: Any) -> list[httpx.Response]:
    with concurrent.futures.ThreadPoolExecutor(n) as pool:
        return list(pool.map(lambda _: call(), range(n)))


def _workers(gw: Gateway) -> list[int]:
    """The worker processes' pids."""
    return worker_pids(gw.proc.popen.pid)


def test_one_control_plane_many_workers_each_with_its_own_listener(gw: Gateway) -> None:
    pids = _workers(gw)
    assert len(pids) == WORKERS
    # Each worker holds its own listening socket on the port (SO_REUSEPORT).
    port_hex = f":{gw.port:04X}"
    inodes = set()
    for pid in pids:
        fds = {os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")}
        inodes |= {fd for fd in fds if fd.startswith("socket:")}
    with open("/proc/net/tcp") as f:
        listening = [
            line.split()[9]
            for line in f.read().splitlines()[1:]
            if line.split()[1].endswith(port_hex) and line.split()[3] == "0A"
        ]
    assert len(listening) == WORKERS
    assert {f"socket:[{i}]" for i in listening} <= inodes
    # One ledger writer and one redis-server for all of them: the supervisor's.
    children = os.popen(f"ps -o pid=,args= --ppid {gw.proc.popen.pid}").read()
    assert children.count("ledger_writer") == 1, children
    assert children.count("redis-server") == 1, children
    assert children.count("llama-server") == 1, children


def test_a_budget_race_over_every_worker_admits_exactly_what_fits(gw: Gateway) -> None:
    tid = "budget" + str(time.monotonic_ns())[-6:]
    gw.create_tenant(tid, budget_usd=0.2, budget_period="day")  # fits 20 requests of $0.01
    key = gw.create_key(tid)["key"]
    rs = _many(100, lambda: _post(gw, key))
    ok = [r for r in rs if r.status_code == 200]
    refused = [r for r in rs if r.status_code == 429]
    assert len(ok) == 20 and len(refused) == 80
    assert {r.json()["error"]["code"] for r in refused} == {"insufficient_quota"}
    deadline = time.monotonic() + 10
    while True:  # one ledger: every worker's rows, once
        rows = gw.usage(tenant=tid, limit=1000)
        if len(rows) == 100 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert len(rows) == 100
    assert len({r["request_id"] for r in rows}) == 100
    assert sum(r["cost_usd"] for r in rows) == pytest.approx(0.2)


def test_an_rpm_limit_over_every_worker_admits_exactly_the_limit(gw: Gateway) -> None:
    key = _tenant(gw, rpm=20)
    rs = _many(60, lambda: _post(gw, key))
    codes = [r.status_code for r in rs]
    assert codes.count(200) == 20 and codes.count(429) == 40


def test_one_idempotency_key_sent_ten_times_at_once_makes_one_upstream_call(
    gw: Gateway, scripted: Scripted
) -> None:
    key = _tenant(gw)
    scripted.fault("delay:300", count=10)
    before = scripted.requests()
    ikey = "idem-" + str(time.monotonic_ns())
    rs = _many(10, lambda: _post(gw, key, **{"Idempotency-Key": ikey}))
    scripted.fault("delay:0", count=0)
    assert [r.status_code for r in rs] == [200] * 10
    assert len({r.json()["id"] for r in rs}) == 1
    assert scripted.requests() - before == 1


def test_a_deployments_max_concurrency_holds_across_workers(
    gw: Gateway, scripted: Scripted
) -> None:
    key = _tenant(gw)
    httpx.delete(scripted.url + "/stats")
    scripted.fault("delay:400", count=12)
    rs = _many(12, lambda: _post(gw, key, {**BODY, "model": "narrow"}))
    scripted.fault("delay:0", count=0)
    assert [r.status_code for r in rs] == [200] * 12
    stats = httpx.get(scripted.url + "/stats").json()
    assert stats["peak_in_flight"] == 2  # 12 requests over 4 workers, 2 at a time
    traces = [gw.trace(r.headers["x-request-id"]) for r in rs]
    waited = [
        d
        for t in traces
        for d in t["decisions"]
        if d["stage"] == "queue" and d["outcome"] == "waited"
    ]
    assert len(waited) >= 8  # most of them queued at the one gate


def _live(gw: Gateway) -> dict[str, Any]:
    """/admin/live on a new connection: whichever worker the kernel picks answers."""
    r = httpx.get(gw.url + "/admin/live", headers=gw.admin, timeout=10)
    assert r.status_code == 200, r.text
    return dict(r.json())


def _live_shows(gw: Gateway, narrow: dict[str, Any]) -> list[dict[str, Any]]:
    """Once one worker's /admin/live shows `narrow`'s queue as given, 2 per worker more."""
    deadline = time.monotonic() + 10
    while _live(gw)["queues"]["narrow"] != narrow:
        assert time.monotonic() < deadline, _live(gw)["queues"]
        time.sleep(0.05)
    return [_live(gw) for _ in range(WORKERS * 2)]


def test_any_workers_live_view_shows_the_hosts_gates_and_engines(
    gw: Gateway, scripted: Scripted
) -> None:
    key = _tenant(gw)
    scripted.fault("delay:4000", count=2)
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        # New connections, spread over the workers: two hold `narrow`'s two slots
        # (its max_concurrency) upstream, the third waits at the one gate.
        calls = [pool.submit(_post, gw, key, {**BODY, "model": "narrow"}) for _ in range(3)]
        seen = _live_shows(gw, {"in_flight": 2, "queued": 1, "scope": "gateway"})
        assert [r.status_code for r in (c.result() for c in calls)] == [200] * 3
    for live in seen:  # any worker shows the host's counts, not its own slice
        assert live["queues"]["narrow"] == {"in_flight": 2, "queued": 1, "scope": "gateway"}
        assert live["queues"]["cheap"]["scope"] == "gateway"  # every worker's reports added
        assert set(live["engines"]) == {"smol"}  # the control plane's engine
        assert "control_plane" not in live
    # Given back: every worker shows the gate empty (not its last answer's counts).
    empty = {"in_flight": 0, "queued": 0, "scope": "gateway"}
    assert all(x["queues"]["narrow"] == empty for x in _live_shows(gw, empty))


def test_any_workers_live_view_counts_every_workers_requests_and_tool_breakers(
    gw: Gateway, scripted: Scripted
) -> None:
    """Requests in flight and an unlimited gate's counts live in each worker; any
    worker's /admin/live adds the others' reports to its own, and shows the tool
    servers' breakers, which run in the control plane."""
    key = _tenant(gw)
    n = 6  # new connections over 4 workers: all on one worker has odds of 1 in 1,024
    scripted.fault("delay:8000", count=n)
    held = {"in_flight": n, "queued": 0, "scope": "gateway"}
    with concurrent.futures.ThreadPoolExecutor(n) as pool:
        calls = [pool.submit(_post, gw, key) for _ in range(n)]
        deadline = time.monotonic() + 6
        while (x := _live(gw))["active_requests"] != n or x["queues"]["cheap"] != held:
            assert time.monotonic() < deadline, x
            time.sleep(0.05)
        time.sleep(1.5)  # each worker has reported since its request arrived
        seen = [_live(gw) for _ in range(WORKERS * 2)]
        assert [r.status_code for r in (c.result() for c in calls)] == [200] * n
    for live in seen:
        assert live["active_requests"] == n, live
        assert live["queues"]["cheap"] == held
        assert live["workers"] == WORKERS
        assert live["breakers"]["mcp:crm"] == "closed"  # the control plane's tool server
        assert "control_plane" not in live
    deadline = time.monotonic() + 10  # done: every worker's next report says so
    while any(_live(gw)["active_requests"] for _ in range(WORKERS * 2)):
        assert time.monotonic() < deadline
        time.sleep(0.2)


def _read_stream(
    gw: Gateway, key: str, task: str, out: list[Any], started: threading.Event
) -> None:
    body = {**BODY, "stream": True, "max_tokens": 16}
    headers = {"Authorization": f"Bearer {key}", "x-task-id": task}
    with httpx.stream(
        "POST", gw.url + "/v1/chat/completions", json=body, headers=headers, timeout=60
    ) as r:
        out.append(r.status_code)
        for line in r.iter_lines():
            if line.startswith("data: "):
                started.set()
                out.append(line[6:])


def test_a_task_cancel_reaches_its_calls_on_every_worker(gw: Gateway, scripted: Scripted) -> None:
    key = _tenant(gw)
    task = f"cancel-{time.monotonic_ns()}"
    n = 8  # 8 connections over 4 workers: all on one worker has odds of 1 in 16,384
    scripted.fault("slow:300", count=n)  # 16 events x 0.3 s each
    outs: list[list[Any]] = [[] for _ in range(n)]
    events = [threading.Event() for _ in range(n)]
    threads = [
        threading.Thread(target=_read_stream, args=(gw, key, task, outs[i], events[i]))
        for i in range(n)
    ]
    for t in threads:
        t.start()
    assert all(e.wait(15) for e in events)
    r = httpx.delete(
        f"{gw.url}/v1/tasks/{task}", headers={"Authorization": f"Bearer {key}"}, timeout=10
    )
    assert r.status_code == 200, r.text
    for t in threads:
        t.join(10)
        assert not t.is_alive()
    for out in outs:
        assert out[0] == 200
        assert json.loads(out[-1])["error"]["code"] == "task_cancelled", out[-3:]


def test_a_killed_worker_gives_back_what_it_held_and_is_started_again(
    gw: Gateway, scripted: Scripted
) -> None:
    key = _tenant(gw, max_concurrency=2)
    scripted.fault("hang", count=2)
    started = time.monotonic()
    ended: list[str] = []

    def held_call() -> None:
        try:
            ended.append(str(_post(gw, key).status_code))
        except httpx.HTTPError as exc:  # its worker is killed under it
            ended.append(type(exc).__name__)

    threads = [threading.Thread(target=held_call) for _ in range(2)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 10
    while httpx.get(scripted.url + "/stats").json()["in_flight"] < 2:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    # Both slots are held: a third request is refused.
    assert _post(gw, key).status_code == 429
    before = _workers(gw)
    for pid in before:  # every worker dies mid-request (whichever holds the two)
        os.kill(pid, signal.SIGKILL)
    for t in threads:
        t.join(10)
    assert ended == ["RemoteProtocolError"] * 2  # the connection died with its worker
    deadline = time.monotonic() + 60
    while True:  # the supervisor starts them again
        now = _workers(gw)
        if len(now) == WORKERS and not set(now) & set(before):
            try:
                if httpx.get(gw.url + "/healthz", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
        assert time.monotonic() < deadline, "the workers were not started again"
        time.sleep(0.2)
    # The dead workers' concurrency slots were given back at once (not after their
    # 600 s lease): two requests are admitted again.
    rs = _many(2, lambda: _post(gw, key))
    assert [r.status_code for r in rs] == [200, 200]
    assert time.monotonic() - started < 120


def _tools_ready(gw: Gateway) -> None:
    """The control plane's stdio tool server is up (as every worker's /readyz says)."""
    deadline = time.monotonic() + 60
    while True:
        models = httpx.get(gw.url + "/readyz", headers=gw.admin, timeout=10).json()["models"]
        if models.get("mcp:crm", {}).get("ready"):
            return
        assert time.monotonic() < deadline, models
        time.sleep(0.2)


def test_mcp_sessions_and_tool_servers_are_the_control_planes(gw: Gateway, tools: Tools) -> None:
    """Every request on its own connection, so they land on any worker: a session
    opened through one worker is used through the others."""
    import httpx2
    from mcp import ClientSession
    from mcp.client.streamable_http import streamable_http_client

    _tools_ready(gw)

    async def client(n: int) -> list[str]:
        async with (
            httpx2.AsyncClient(
                headers=gw.auth,
                timeout=60,
                limits=httpx2.Limits(max_keepalive_connections=0),
            ) as http,
            streamable_http_client(gw.url + "/mcp", http_client=http) as (read, write),
            ClientSession(read, write) as s,
        ):
            await s.initialize()
            for _ in range(50):  # the control plane starts the stdio server
                listed = await s.list_tools()
                if listed.tools:
                    break
                await asyncio.sleep(0.2)
            assert "crm__lookup" in {t.name for t in listed.tools}
            out = []
            for i in range(4):
                r = await s.call_tool("crm__lookup", {"q": f"c{n}-{i}"})
                out.append(str(r.content[0].text))
            return out

    async def four() -> list[list[str]]:
        return list(await asyncio.gather(*(client(n) for n in range(4))))

    got = asyncio.run(four())
    assert got == [[f"found: c{n}-{i}" for i in range(4)] for n in range(4)]
    assert Tools.runs(tools.stdio_log, "lookup") >= 16
    # One stdio tool server for every worker: the control plane's child.
    children = os.popen(f"ps -o args= --ppid {gw.proc.popen.pid}").read()
    assert children.count("mcp_tool_server") == 1, children


def test_metrics_from_any_worker_count_every_workers_requests(gw: Gateway) -> None:
    tid = "metrics" + str(time.monotonic_ns())[-6:]
    gw.create_tenant(tid)
    key = gw.create_key(tid)["key"]
    rs = _many(24, lambda: _post(gw, key))  # new connections: every worker serves some
    assert [r.status_code for r in rs] == [200] * 24
    line = f'switchyard_requests_total{{model="cheap",status="ok",tenant="{tid}"}}'
    deadline = time.monotonic() + 10
    while True:
        seen = []
        for _ in range(WORKERS * 2):  # each scrape on a new connection: any worker answers
            text = httpx.get(gw.url + "/metrics", headers=gw.admin, timeout=10).text
            seen += [x for x in text.splitlines() if x.startswith(line)]
        if (seen and all(x == f"{line} 24.0" for x in seen)) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert seen and all(x == f"{line} 24.0" for x in seen), seen


def test_every_workers_readiness_shows_what_the_control_plane_runs(gw: Gateway) -> None:
    deadline = time.monotonic() + 30
    while True:
        seen = [
            httpx.get(gw.url + "/readyz", headers=gw.admin, timeout=10).json()
            for _ in range(WORKERS * 2)  # new connections: any worker answers
        ]
        if all(r["models"].get("mcp:crm", {}).get("ready") for r in seen):
            break
        assert time.monotonic() < deadline, seen[-1]
        time.sleep(0.2)
    assert all(r["status"] == "ready" for r in seen)
    # The tool server is the control plane's: no worker runs one of its own.
    assert all(r["models"]["mcp:crm"]["kind"] == "stdio" for r in seen)


def test_one_engine_serves_every_worker_and_each_shows_it(gw: Gateway) -> None:
    key = _tenant(gw)
    body = {"model": "smol", "messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 4}
    rs = _many(4, lambda: _post(gw, key, body))  # through whichever workers
    assert [r.status_code for r in rs] == [200] * 4
    assert all(r.json()["usage"]["completion_tokens"] >= 1 for r in rs)
    for _ in range(WORKERS * 2):  # any worker answers with the control plane's engine
        engines = httpx.get(gw.url + "/admin/engines", headers=gw.admin, timeout=10).json()
        assert set(engines["engines"]) == {"smol"}
        assert engines["engines"]["smol"]["state"] == "ready"
        ready = httpx.get(gw.url + "/readyz", headers=gw.admin, timeout=10).json()
        assert ready["models"]["smol"]["kind"] == "llamacpp"


def test_a_worker_returns_the_token_ids_of_the_control_planes_llama_server(gw: Gateway) -> None:
    """`return_token_ids` through a worker: its upstream for `smol` is the engine front,
    which forwards the reply's native result and llama-server's /tokenize."""
    key = _tenant(gw)
    body = {
        "model": "smol",
        "messages": [{"role": "user", "content": "Say hi"}],
        "max_tokens": 4,
        "return_token_ids": True,
    }
    for r in _many(2, lambda: _post(gw, key, body)):  # through whichever workers
        assert r.status_code == 200, r.text
        reply = r.json()
        assert len(reply["prompt_token_ids"]) == reply["usage"]["prompt_tokens"]
        ids = reply["choices"][0]["token_ids"]
        assert len(ids) == reply["usage"]["completion_tokens"] >= 1


def test_a_sessions_requests_stay_on_its_deployment_across_workers(gw: Gateway) -> None:
    key = _tenant(gw)
    body = {**BODY, "model": "pair"}
    sessions = [f"s-{time.monotonic_ns()}-{i}" for i in range(4)]
    for session in sessions:
        rs = [_post(gw, key, body, **{"x-session-id": session}) for _ in range(8)]
        assert [r.status_code for r in rs] == [200] * 8
        served = {r.headers["x-switchyard-upstream"] for r in rs}
        assert len(served) == 1, (session, served)  # one deployment, whichever worker
    # Sessionless requests are spread: the balancer would pick either.
    rs = _many(16, lambda: _post(gw, key, body))
    assert {r.headers["x-switchyard-upstream"] for r in rs} == {"pair/a", "pair/b"}
