"""A worker of `switchyard serve --workers 2` killed mid-request: the request it was
serving gets one usage row, billed what it reserved, and its budget keeps that spend
(scale/workers.py `lost_request`, state/limits_redis.py `release_holds`). Real
processes: the gateway with its private Redis and ledger writer, the scripted upstream
streaming slowly, and a redis-server for the limiter's own exactly-once checks."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
import uuid
from collections.abc import Iterator

import httpx
import pytest
import redis

from support.gateways import Gateway, cheap_config, start_gateway
from support.procs import worker_pids
from support.upstreams import Scripted, start_scripted
from switchyard.state.limits import Ask, Billing, ScopeLimits
from switchyard.state.limits_redis import RedisLimiter

CAP = 50  # the dead stream's output cap: $1000 per million output tokens, $0.05 reserved
RESERVED = CAP * 1000.0 / 1_000_000
SMALL = 10  # a whole request's output: $0.01
BUDGET = 1.0
T0 = 1_750_000_000.0  # 2025-06-15 15:06:40 UTC: far from a day boundary


@pytest.fixture(scope="module")
def scripted() -> Iterator[Scripted]:
    proc, s = start_scripted("--tokens", "40")  # 40 events: 12 s at slow:300
    yield s
    proc.stop()


@pytest.fixture(scope="module")
def gw(scripted: Scripted) -> Iterator[Gateway]:
    g = start_gateway(cheap_config(scripted), serve_args=("--workers", "2"))
    yield g
    g.proc.stop()


def _workers(gw: Gateway) -> list[int]:
    """The worker processes' pids."""
    return worker_pids(gw.proc.popen.pid)


def _serving(gw: Gateway, client_port: int) -> int:
    """The worker whose end of the connection from `client_port` is open."""
    inode = None
    with open("/proc/net/tcp") as f:
        for line in f.read().splitlines()[1:]:
            cols = line.split()
            local, remote = cols[1], cols[2]
            if local.endswith(f":{gw.port:04X}") and remote.endswith(f":{client_port:04X}"):
                inode = cols[9]
    assert inode is not None, "no server end for the client's connection"
    for pid in _workers(gw):
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                if os.readlink(f"/proc/{pid}/fd/{fd}") == f"socket:[{inode}]":
                    return pid
            except OSError:
                continue
    raise AssertionError("no worker holds the connection")


def _post(gw: Gateway, key: str, max_tokens: int) -> httpx.Response:
    body = {"model": "cheap", "messages": [{"role": "user", "content": "hi"}]}
    return gw.post("/v1/chat/completions", key, json={**body, "max_tokens": max_tokens})


def _budget_used(gw: Gateway, tenant: str) -> float:
    r = httpx.get(gw.url + "/admin/tenants", params={"limit": 1000}, headers=gw.admin)
    assert r.status_code == 200, r.text
    [t] = [t for t in r.json()["data"] if t["id"] == tenant]
    return float(t["budget_used_usd"])


def _budget_left(gw: Gateway, request_id: str, tenant: str) -> float:
    """What the shared budget counter had left when the request was admitted, before
    its own reservation (its admit decision's evidence, from the limiter's reply)."""
    [admit] = [d for d in gw.trace(request_id)["decisions"] if d["stage"] == "admit"]
    return float(admit["evidence"]["scopes"][f"tenant:{tenant}"]["budget_remaining_usd"])


def test_a_killed_workers_stream_is_billed_once_at_what_it_reserved(
    gw: Gateway, scripted: Scripted
) -> None:
    tenant = "lost-" + os.urandom(3).hex()
    gw.create_tenant(tenant, budget_usd=BUDGET, budget_period="day")
    made = gw.create_key(tenant)
    key = made["key"]
    # A request that finishes normally first: its own row, never a second one.
    done = _post(gw, key, SMALL)
    assert done.status_code == 200, done.text
    assert len(gw.tenant_rows(tenant, 1)) == 1

    scripted.fault("slow:300", count=1)
    body = {
        "model": "cheap",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": CAP,
        "stream": True,
    }
    seen: list[str] = []
    with gw.stream(body, headers={"Authorization": f"Bearer {key}"}) as r:
        assert r.status_code == 200
        lost_id = r.headers["x-request-id"]
        client_port = r.extensions["network_stream"].get_extra_info("client_addr")[1]
        lines = r.iter_lines()
        for line in lines:
            if line.startswith("data: "):
                seen.append(line)
                break
        victim = _serving(gw, client_port)  # it has streamed to the client already
        os.kill(victim, signal.SIGKILL)
        with pytest.raises(httpx.HTTPError):  # the connection dies with its worker
            for line in lines:
                seen.append(line)
    assert seen and not any("[DONE]" in x for x in seen)

    deadline = time.monotonic() + 30
    while True:
        rows = gw.usage(tenant=tenant, limit=50)
        if len(rows) >= 2 or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    lost = [x for x in rows if x["request_id"] == lost_id]
    assert len(lost) == 1, rows
    row = lost[0]
    assert (row["status"], row["error_code"]) == ("incomplete", "worker_exited")
    assert (row["tenant_id"], row["key_id"]) == (tenant, made["id"])
    assert (row["model"], row["endpoint"]) == ("cheap", "chat.completions")
    assert row["cost_usd"] == pytest.approx(RESERVED) and row["cost_usd"] > 0
    # Its trace says why it cost that.
    trace = gw.trace(lost_id)
    assert [d["outcome"] for d in trace["decisions"]] == ["exited"]
    # The ledger's spend (what the admin API reports) includes it.
    assert _budget_used(gw, tenant) == pytest.approx(SMALL / 1000 + RESERVED)

    # A later request still works (on the surviving worker, or the restarted one), and
    # the shared budget counter kept the dead request's reservation: before this one,
    # the first request's $0.01 and the dead one's $0.05 were spent.
    later = _post(gw, key, SMALL)
    assert later.status_code == 200, later.text
    left = _budget_left(gw, later.headers["x-request-id"], tenant)
    assert left == pytest.approx(BUDGET - SMALL / 1000 - RESERVED)

    rows = gw.tenant_rows(tenant, 3)
    assert len(rows) == 3, rows  # one row each: done, lost, later
    assert len({x["request_id"] for x in rows}) == 3
    assert [x["request_id"] for x in rows].count(lost_id) == 1
    time.sleep(1.0)  # nothing more comes (the restarted worker writes no second row)
    assert len(gw.usage(tenant=tenant, limit=50)) == 3


# -- the limiter's side: exactly once, whatever comes after -----------------------------

KEY = ScopeLimits("key:k", tpm=1000, max_concurrency=1)
TENANT = ScopeLimits("tenant:t", budget_usd=1.0)


def _ask(rid: str, tokens: int, cost: float) -> Ask:
    billing = Billing(rid, "client-1", "task-1", "t", "k", "chat.completions", "cheap", T0, 4, True)
    return Ask(f"{rid}#admit", tokens, cost, billing)


def test_a_release_keeps_the_spend_and_happens_once(redis_url: str) -> None:
    prefix = f"t{uuid.uuid4().hex[:8]}:"

    async def body() -> None:
        worker = RedisLimiter(redis_url, prefix=prefix, owner="w1")
        supervisor = RedisLimiter(redis_url, prefix=prefix)
        try:
            assert worker.owned and not supervisor.owned
            settled, lost = _ask("done", 100, 0.2), _ask("lost", 300, 0.6)
            assert (await worker.reserve([KEY, TENANT], settled, now=T0)).allowed
            await worker.settle([KEY, TENANT], settled, 50, 0.1, now=T0)  # finished normally
            assert (await worker.reserve([KEY, TENANT], lost, now=T0)).allowed
            # The worker dies here: only the unsettled hold is ended, with its billing.
            [held] = await supervisor.release_holds("w1")
            assert (held.reservation, held.tokens, held.cost_usd) == ("lost#admit", 300, 0.6)
            assert held.billing == lost.billing
            # Twice, or the worker's own late settle: nothing more.
            assert await supervisor.release_holds("w1") == []
            await worker.settle([KEY, TENANT], lost, 0, 0.0, now=T0 + 1)
            probe = await supervisor.reserve([KEY, TENANT], _ask("p", 1, 0.0), now=T0 + 2)
            assert probe.allowed  # its concurrency slot came back
            # Its tokens and cost stay charged: 50 + 300 (+ the probe's 1) of 1000
            # tokens, 0.1 + 0.6 of $1.
            assert probe.state["key:k"]["remaining_tokens"] == 1000 - 350 - 1
            assert probe.state["tenant:t"]["budget_remaining_usd"] == pytest.approx(0.3)
        finally:
            await worker.close()
            await supervisor.close()

    asyncio.run(body())


def test_a_record_without_billing_is_released_and_counted(redis_url: str) -> None:
    """A hold an earlier version recorded ([.., keys, budget flags]) is still ended (its
    slot back, its spend kept), without billing: no row can be made of it."""
    prefix = f"t{uuid.uuid4().hex[:8]}:"
    raw = redis.Redis.from_url(redis_url)

    async def body() -> None:
        worker = RedisLimiter(redis_url, prefix=prefix, owner="w1")
        supervisor = RedisLimiter(redis_url, prefix=prefix)
        try:
            assert (await worker.reserve([KEY, TENANT], _ask("old", 10, 0.5), now=T0)).allowed
            owner = f"{prefix}rl:owner:w1"
            [(field, record)] = raw.hgetall(owner).items()
            rid, seq, cost, keys, _, _ = json.loads(record)
            raw.hset(owner, field, json.dumps([rid, seq, cost, keys, "01"]))
            [held] = await supervisor.release_holds("w1")
            assert (held.reservation, held.cost_usd, held.billing) == ("old#admit", 0.5, None)
            probe = await supervisor.reserve([KEY, TENANT], _ask("p", 1, 0.0), now=T0 + 1)
            assert probe.allowed
            assert probe.state["tenant:t"]["budget_remaining_usd"] == pytest.approx(0.5)
        finally:
            await worker.close()
            await supervisor.close()

    try:
        asyncio.run(body())
    finally:
        raw.close()
