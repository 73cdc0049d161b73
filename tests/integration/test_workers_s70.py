"""`serve --workers N` and the shared limiter, read as an unlucky operator would: what
is billed when a connection to Redis drops mid-reply, or two supervisors share one
Redis prefix. Real redis-server processes throughout; a Redis
"drop" is a loopback TCP relay that closes the client's side instead of passing on a
reply Redis has already sent (the script ran; the client never hears of it)."""

from __future__ import annotations

import asyncio
import os
import signal
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import TypeVar

import httpx
import pytest
import redis

from support.gateways import Gateway, cheap_config, start_gateway
from support.procs import worker_pids
from support.upstreams import Scripted
from switchyard.identity import TaskBudget
from switchyard.scale.workers import worker_name
from switchyard.state.limits import Ask, Billing, ScopeLimits, Verdict
from switchyard.state.limits_redis import RedisLimiter
from switchyard.state.tasks import TaskFirst
from switchyard.state.tasks_redis import RedisTaskStore

T0 = 1_750_000_000.0  # 2025-06-15 15:06:40 UTC: far from a day boundary
HANG_S = 10.0
T = TypeVar("T")


class DroppingRelay:
    """A TCP relay to Redis that, once `drop_next_reply()` is armed, closes the
    client's connection when the next reply comes back from Redis, unsent."""

    def __init__(self, port: int) -> None:
        self._port = port
        self._armed = False
        self.dropped = 0
        self.server: asyncio.Server | None = None

    def drop_next_reply(self) -> None:
        self._armed = True

    async def start(self) -> str:
        self.server = await asyncio.start_server(self._relay, "127.0.0.1", 0)
        port = self.server.sockets[0].getsockname()[1]
        return f"redis://127.0.0.1:{port}/0"

    async def close(self) -> None:
        if self.server is not None:
            self.server.close()

    async def _relay(self, cr: asyncio.StreamReader, cw: asyncio.StreamWriter) -> None:
        sr, sw = await asyncio.open_connection("127.0.0.1", self._port)

        async def up() -> None:
            while data := await cr.read(65536):
                sw.write(data)
                await sw.drain()
            sw.close()

        async def down() -> None:
            while data := await sr.read(65536):
                if self._armed:  # Redis ran it and answered: the client never hears
                    self._armed = False
                    self.dropped += 1
                    break
                cw.write(data)
                await cw.drain()
            cw.close()
            sw.close()

        await asyncio.gather(up(), down(), return_exceptions=True)


def _port(url: str) -> int:
    return int(url.rsplit(":", 1)[1].split("/")[0])


def _with_relay(url: str, body: Callable[[DroppingRelay, str], Awaitable[T]]) -> T:
    async def main() -> T:
        relay = DroppingRelay(_port(url))
        via = await relay.start()
        try:
            async with asyncio.timeout(HANG_S):
                return await body(relay, via)
        finally:
            await relay.close()

    return asyncio.run(main())


@pytest.fixture
def prefix() -> str:
    return f"t{uuid.uuid4().hex[:8]}:"


# -- 3. a reply lost on a dropped connection: the retry must not reserve twice ---------


def test_reserve_whose_reply_is_lost_is_not_applied_twice(redis_url: str, prefix: str) -> None:
    """Redis runs a reserve, then the connection drops before its reply is read. The
    batcher's one retry on a connection error sends it again: before the fix the script
    ran twice (two requests in the rpm window, the tokens and the budget charged twice,
    two concurrency slots, one of which no settle ever frees)."""
    sc = [ScopeLimits("key:lost", rpm=100, tpm=1000, max_concurrency=2, budget_usd=1.0)]
    raw = redis.Redis.from_url(redis_url)

    async def body(relay: DroppingRelay, via: str) -> tuple[Verdict, Verdict]:
        lim = RedisLimiter(via, prefix=prefix, timeout_s=5)
        try:
            warm = Ask("warm", 10, 0.1)
            assert (await lim.reserve(sc, warm, now=T0)).allowed
            await lim.settle(sc, warm, 10, 0.1, now=T0)
            relay.drop_next_reply()
            lost = Ask("lost", 100, 0.25)
            verdict = await lim.reserve(sc, lost, now=T0)
            assert relay.dropped == 1
            assert raw.zcard(f"{prefix}rl:key:lost:inflight") == 1
            await lim.settle(sc, lost, 100, 0.25, now=T0)
            after = await lim.reserve(sc, Ask("after", 1, 0.0), now=T0)
            return verdict, after
        finally:
            await lim.close()

    try:
        verdict, after = _with_relay(redis_url, body)
        assert verdict.allowed
        # The lost reply's verdict is the state with its one reservation in it.
        assert verdict.state["key:lost"]["remaining_requests"] == 100 - 2
        assert verdict.state["key:lost"]["remaining_tokens"] == 1000 - 10 - 100
        assert raw.zcard(f"{prefix}rl:key:lost:req") == 3  # warm, lost once, after
        assert float(raw.get(f"{prefix}rl:key:lost:toktotal")) == 10 + 100 + 1
        state = after.state["key:lost"]
        assert state["budget_remaining_usd"] == pytest.approx(1.0 - 0.1 - 0.25)
        assert raw.zcard(f"{prefix}rl:key:lost:inflight") == 1  # `after` alone
        assert not list(raw.scan_iter(match=f"{prefix}rl:held:lost"))
    finally:
        raw.close()


def test_task_admission_whose_reply_is_lost_is_counted_once(redis_url: str, prefix: str) -> None:
    """The task store's client resends a script once on a connection error; an admit
    that Redis ran before the drop was applied again: the task counted two calls and
    twice the tokens for one, and its settle gave back one."""
    raw = redis.Redis.from_url(redis_url)
    first = TaskFirst(TaskBudget(calls=10, tokens=1000))

    async def body(relay: DroppingRelay, via: str) -> None:
        store = RedisTaskStore(via, prefix=prefix, timeout_s=5)
        try:
            warm = await store.admit(("acme", "t1"), first, "req_warm", 100, 0.0, T0)
            assert warm.allowed
            relay.drop_next_reply()
            adm = await store.admit(("acme", "t1"), first, "req_lost", 300, 0.0, T0)
            assert relay.dropped == 1 and adm.allowed
            state = raw.hgetall(f"{prefix}task:acme:t1")
            assert int(state[b"u_calls"]) == 2
            assert float(state[b"u_tokens"]) == 400
            await store.settle(("acme", "t1"), "req_lost", 50, 0.0)
            assert float(raw.hget(f"{prefix}task:acme:t1", "u_tokens")) == 150
        finally:
            await store.close()

    try:
        _with_relay(redis_url, body)
    finally:
        raw.close()


# -- 1 and 2: every request a dead worker was serving gets its row ----------------------


@pytest.fixture(scope="module")
def gw(scripted: Scripted) -> Iterator[Gateway]:
    g = start_gateway(cheap_config(scripted), serve_args=("--workers", "2"))
    yield g
    g.proc.stop()


def _kill_workers(gw: Gateway) -> None:
    """SIGKILL every worker (whichever served the request dies with them); the
    supervisor starts them again."""
    pids = worker_pids(gw.proc.popen.pid)
    assert len(pids) == 2, pids
    for pid in pids:
        os.kill(pid, signal.SIGKILL)


def _serving_again(gw: Gateway, key: str) -> None:
    deadline = time.monotonic() + 30
    while True:
        try:
            r = gw.post("/v1/chat/completions", key, json=_BODY)
            if r.status_code == 200:
                return
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, "the workers did not come back"
        time.sleep(0.2)


_BODY = {"model": "cheap", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}


def test_another_supervisors_worker_keeps_its_holds(gw: Gateway) -> None:
    """Two hosts' `serve --workers N` share one Redis (`storage.redis_url`; the prefix is
    fixed), and pids repeat across hosts (containers start alike). A worker was named
    `w{index}-{pid}`: when this supervisor's worker died, its release ended the other
    supervisor's live worker's holds of the same name (its concurrency slots freed
    under a running request) and billed its requests as lost in this gateway's ledger.
    Names now carry the supervisor's run, so the other worker's hold is left alone."""
    url = f"unix://{Path(gw.db).parent}/run/redis.sock"
    tenant = "other-" + os.urandom(3).hex()
    gw.create_tenant(tenant)
    made = gw.create_key(tenant)  # for a request once the workers are back
    raw = redis.Redis.from_url(url)
    pids = worker_pids(gw.proc.popen.pid)
    foreign = [worker_name(i, pid, "0ther0ther00") for pid in pids for i in (0, 1)]

    async def hold() -> None:
        for name in foreign:
            lim = RedisLimiter(url, owner=name)
            billing = Billing(f"req_{name}", None, None, tenant, "k", "chat.completions",
                              "cheap", time.time(), 1, False)  # fmt: skip
            ask = Ask(f"req_{name}#admit", 10, 0.01, billing)
            sc = [ScopeLimits(f"key:{name}", max_concurrency=1)]
            assert (await lim.reserve(sc, ask)).allowed
            await lim.close()

    try:
        asyncio.run(hold())
        _kill_workers(gw)
        _serving_again(gw, made["key"])
        time.sleep(1.0)
        for name in foreign:
            assert raw.hlen(f"switchyard:rl:owner:{name}") == 1, name
            assert raw.zcard(f"switchyard:rl:key:{name}:inflight") == 1, name
        rows = gw.stored_rows(tenant, 1)
        assert [x["status"] for x in rows] == ["ok"]  # none billed for the other host
    finally:
        raw.close()
