"""RedisLimiter against a real redis-server on loopback, with the clock driven by `now`.

The server is a child process of the tests (no persistence); every test works under its
own key prefix, so tests never see each other's counters.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import socket
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from typing import Any, TypeVar

import pytest
import redis

from support.redis_server import start_redis as _start_redis
from support.redis_server import stop_redis as _stop
from switchyard.state.limits import Ask, LimiterUnavailable, ScopeLimits, Verdict, period_reset_s
from switchyard.state.limits_memory import MemoryLimiter
from switchyard.state.limits_redis import RedisLimiter

T0 = 1_750_000_000.0  # 2025-06-15 15:06:40 UTC: far from a day boundary
HANG_S = 5.0  # generous: only catches hangs and retry storms
T = TypeVar("T")


@pytest.fixture(scope="module")
def redis_url() -> Iterator[str]:
    proc, url = _start_redis()
    yield url
    _stop(proc)


@pytest.fixture
def prefix() -> str:
    return f"t{uuid.uuid4().hex[:8]}:"


def run(url: str, prefix: str, body: Callable[[RedisLimiter], Awaitable[T]]) -> T:
    """Run `body` with a fresh limiter in a fresh event loop (the client is loop-bound)."""

    async def main() -> T:
        lim = RedisLimiter(url, prefix=prefix)
        try:
            return await body(lim)
        finally:
            await lim.close()

    return asyncio.run(main())


def ask(rid: str, tokens: int = 1, cost: float = 0.0) -> Ask:
    return Ask(request_id=rid, tokens=tokens, cost_usd=cost)


def test_rpm_burst_straddling_minute_boundary(redis_url: str, prefix: str) -> None:
    sc = [ScopeLimits("key:rpm", rpm=10)]

    async def body(lim: RedisLimiter) -> None:
        for i in range(10):
            v = await lim.reserve(sc, ask(f"a{i}"), now=T0 + 59.5)
            assert v.allowed, i
        assert v.state["key:rpm"]["remaining_requests"] == 0
        v = await lim.reserve(sc, ask("b"), now=T0 + 59.5)
        assert (v.allowed, v.scope, v.limit) == (False, "key:rpm", "rpm")
        assert v.retry_after_s == pytest.approx(60.0)
        # A fixed per-minute window would start afresh here and admit ten more.
        v = await lim.reserve(sc, ask("c"), now=T0 + 60.5)
        assert not v.allowed
        assert v.retry_after_s == pytest.approx(59.0)
        assert v.state["key:rpm"]["reset_requests_s"] == pytest.approx(59.0)
        v = await lim.reserve(sc, ask("d"), now=T0 + 119.4)
        assert not v.allowed
        assert v.retry_after_s == pytest.approx(0.1)
        v = await lim.reserve(sc, ask("e"), now=T0 + 119.6)
        assert v.allowed
        assert v.state["key:rpm"]["remaining_requests"] == 9

    run(redis_url, prefix, body)


def test_rpm_never_exceeds_limit_in_any_60s_span(redis_url: str, prefix: str) -> None:
    sc = [ScopeLimits("key:span", rpm=10)]

    async def body(lim: RedisLimiter) -> list[float]:
        admitted, t = [], T0
        for i in range(500):
            t += 0.7 if i % 50 else 13.3  # steady attempts with the odd gap
            if (await lim.reserve(sc, ask(f"r{i}"), now=t)).allowed:
                admitted.append(t)
        return admitted

    admitted = run(redis_url, prefix, body)
    assert len(admitted) >= 50  # not trivially refusing everything
    for t in admitted:
        assert sum(1 for u in admitted if t - 60.0 < u <= t) <= 10, t


def test_tpm_settle_releases_unused_reservation(redis_url: str, prefix: str) -> None:
    sc = [ScopeLimits("key:tpm", tpm=1000)]

    async def body(lim: RedisLimiter) -> None:
        first = ask("first", tokens=800)
        v = await lim.reserve(sc, first, now=T0)
        assert v.allowed
        assert v.state["key:tpm"]["remaining_tokens"] == 200
        v = await lim.reserve(sc, ask("second", tokens=500), now=T0 + 1)
        assert (v.allowed, v.limit) == (False, "tpm")
        assert v.retry_after_s == pytest.approx(59.0)
        v = await lim.reserve(sc, ask("huge", tokens=1001), now=T0 + 1)
        assert (v.allowed, v.limit, v.retry_after_s) == (False, "tpm", math.inf)
        await lim.settle(sc, first, tokens=100, cost_usd=0.0, now=T0 + 2)
        v = await lim.reserve(sc, ask("second", tokens=500), now=T0 + 3)
        assert v.allowed
        assert v.state["key:tpm"]["remaining_tokens"] == 400
        # The window forgets both after 60 s.
        v = await lim.reserve(sc, ask("third", tokens=1000), now=T0 + 63.5)
        assert v.allowed

    run(redis_url, prefix, body)


def test_concurrency_slots_release_once_and_lapse(redis_url: str, prefix: str) -> None:
    sc = [ScopeLimits("key:conc", max_concurrency=2)]

    async def body(lim: RedisLimiter) -> None:
        a, b = ask("a"), ask("b")
        assert (await lim.reserve(sc, a, now=T0)).allowed
        assert (await lim.reserve(sc, b, now=T0)).allowed
        v = await lim.reserve(sc, ask("c"), now=T0)
        assert (v.allowed, v.limit, v.retry_after_s) == (False, "concurrency", 1.0)
        await lim.settle(sc, a, tokens=1, cost_usd=0.0, now=T0 + 1)
        await lim.settle(sc, a, tokens=1, cost_usd=0.0, now=T0 + 1)  # must not free b's slot
        assert (await lim.reserve(sc, ask("c"), now=T0 + 2)).allowed
        assert not (await lim.reserve(sc, ask("d"), now=T0 + 2)).allowed
        # b and c's process died without settling: their leases lapse.
        assert (await lim.reserve(sc, ask("d"), now=T0 + 2 + 601)).allowed
        assert (await lim.reserve(sc, ask("e"), now=T0 + 2 + 601)).allowed

    run(redis_url, prefix, body)


def test_reused_request_id_counts_every_request(redis_url: str, prefix: str) -> None:
    """Request ids can come from the client (x-request-id): reuse must not evade limits."""
    sc = [ScopeLimits("key:dup", rpm=3, max_concurrency=2)]

    async def body(lim: RedisLimiter) -> None:
        same = ask("same")
        assert (await lim.reserve(sc, same, now=T0)).allowed
        assert (await lim.reserve(sc, same, now=T0)).allowed
        assert (await lim.reserve(sc, same, now=T0)).limit == "concurrency"
        await lim.settle(sc, same, tokens=1, cost_usd=0.0, now=T0)
        await lim.settle(sc, same, tokens=1, cost_usd=0.0, now=T0)
        await lim.settle(sc, same, tokens=1, cost_usd=0.0, now=T0)  # nothing left
        assert (await lim.reserve(sc, same, now=T0)).allowed
        assert (await lim.reserve(sc, same, now=T0)).limit == "rpm"
        assert (await lim.reserve(sc, ask("other"), now=T0)).limit == "rpm"

    run(redis_url, prefix, body)


def test_budget_race_two_processes(redis_url: str, prefix: str) -> None:
    sc = [ScopeLimits("tenant:race", budget_usd=1.0)]

    async def main() -> list[Verdict]:
        # Generous timeouts: 100 concurrent calls open many connections at once, and
        # this test is about atomicity, not about how fast Redis answers a loaded host.
        one = RedisLimiter(redis_url, prefix=prefix, timeout_s=10)
        two = RedisLimiter(redis_url, prefix=prefix, timeout_s=10)
        try:
            calls = [
                (one if i % 2 else two).reserve(sc, ask(f"r{i}", cost=0.05), now=T0)
                for i in range(100)
            ]
            verdicts = list(await asyncio.gather(*calls))
            verdicts.append(await one.reserve(sc, ask("zero", cost=0.0), now=T0))
            return verdicts
        finally:
            await one.close()
            await two.close()

    verdicts = asyncio.run(main())
    *race, last = verdicts
    assert sum(v.allowed for v in race) == 20
    assert {v.limit for v in race if not v.allowed} == {"budget"}
    refused = next(v for v in race if not v.allowed)
    assert refused.retry_after_s == pytest.approx(period_reset_s("day", T0))
    assert last.state["tenant:race"]["budget_remaining_usd"] == pytest.approx(0.0, abs=1e-9)


def test_budget_settle_corrects_and_never_goes_negative(redis_url: str, prefix: str) -> None:
    sc = [ScopeLimits("key:spend", budget_usd=1.0)]
    next_day = T0 + 86400

    async def body(lim: RedisLimiter) -> None:
        a = ask("a", cost=0.6)
        assert (await lim.reserve(sc, a, now=T0)).allowed
        assert not (await lim.reserve(sc, ask("b", cost=0.6), now=T0)).allowed
        await lim.settle(sc, a, tokens=1, cost_usd=0.1, now=T0 + 1)
        await lim.settle(sc, a, tokens=1, cost_usd=0.1, now=T0 + 1)  # refunds nothing more
        v = await lim.reserve(sc, ask("b", cost=0.6), now=T0 + 2)
        assert v.allowed
        assert v.state["key:spend"]["budget_remaining_usd"] == pytest.approx(0.9)
        # b settles after midnight: today's counter starts at 0 and must stay there.
        await lim.settle(sc, ask("b", cost=0.6), tokens=1, cost_usd=0.2, now=next_day)
        v = await lim.reserve(sc, ask("c", cost=1.0), now=next_day + 1)
        assert v.allowed
        assert v.state["key:spend"]["budget_remaining_usd"] == pytest.approx(1.0)

    run(redis_url, prefix, body)


def test_refusal_by_second_scope_records_nothing_in_first(redis_url: str, prefix: str) -> None:
    key = ScopeLimits("key:k1", rpm=5, tpm=1000, max_concurrency=1, budget_usd=1.0)
    tenant = ScopeLimits("tenant:t1", budget_usd=0.1)

    async def body(lim: RedisLimiter) -> None:
        v = await lim.reserve([key, tenant], ask("x", tokens=900, cost=0.5), now=T0)
        assert (v.allowed, v.scope, v.limit) == (False, "tenant:t1", "budget")
        # Had the key scope held anything, this one would be refused (concurrency 1,
        # 900 + 900 tokens > 1000, 0.5 + 0.6 USD > 1.0).
        v = await lim.reserve([key], ask("y", tokens=900, cost=0.6), now=T0 + 1)
        assert v.allowed
        assert v.state["key:k1"]["remaining_requests"] == 4
        assert v.state["key:k1"]["remaining_tokens"] == 100
        assert v.state["key:k1"]["budget_remaining_usd"] == pytest.approx(1.0)

    run(redis_url, prefix, body)


def test_seed_spent_does_not_overwrite_live_counter(redis_url: str, prefix: str) -> None:
    sc = [ScopeLimits("tenant:seed", budget_usd=1.0)]

    async def body(lim: RedisLimiter) -> None:
        assert await lim.seed_spent("tenant:seed", "day", 0.7, now=T0)
        assert not await lim.seed_spent("tenant:seed", "day", 0.1, now=T0)
        v = await lim.reserve(sc, ask("a", cost=0.2), now=T0)
        assert v.allowed
        assert v.state["tenant:seed"]["budget_remaining_usd"] == pytest.approx(0.3)
        # A process starting now, with an older ledger, must not reset live spending.
        assert not await lim.seed_spent("tenant:seed", "day", 0.0, now=T0)
        assert (await lim.reserve(sc, ask("b", cost=0.2), now=T0)).limit == "budget"
        # Another period is another counter.
        assert await lim.seed_spent("tenant:seed", "month", 0.5, now=T0)

    run(redis_url, prefix, body)


def test_keys_expire(redis_url: str, prefix: str) -> None:
    sc = [ScopeLimits("key:ttl", rpm=5, tpm=100, max_concurrency=1, budget_usd=1.0)]
    run(redis_url, prefix, lambda lim: lim.reserve(sc, ask("a", 10, 0.1), now=T0))
    raw = redis.Redis.from_url(redis_url)
    try:
        keys = [k.decode() for k in raw.scan_iter(match=f"{prefix}*")]
        # seq, held, req, tok, tokamt, toktotal, inflight, spent, and the call's own key
        assert len(keys) == 9
        for k in keys:
            ttl = raw.ttl(k)
            if k.endswith(":seq"):
                assert ttl == -1, k  # one counter: does not grow
            elif ":spent:" in k:
                assert 31 * 86400 < ttl <= 40 * 86400, k
            else:
                assert 0 < ttl <= 600, k
    finally:
        raw.close()


def test_owner_record_keeps_the_format_earlier_versions_wrote(redis_url: str, prefix: str) -> None:
    """The reserve script writes the owner record around text the caller encoded; it
    must stay the JSON the script once encoded itself (cjson), so records left in a
    shared Redis across an upgrade are still released."""
    sc = [ScopeLimits("key:rec", max_concurrency=1, budget_usd=1.0)]
    rid = 'a/"\u00e9\t'  # what JSON must escape, and what cjson escapes that others do not
    owner_key = f"{prefix}rl:owner:w1"
    raw = redis.Redis.from_url(redis_url)

    async def main() -> None:
        worker = RedisLimiter(redis_url, prefix=prefix, owner="w1")
        supervisor = RedisLimiter(redis_url, prefix=prefix)
        try:
            assert (await worker.reserve(sc, ask(rid, 1, 0.4), now=T0)).allowed
            [(field, record)] = raw.hgetall(owner_key).items()
            rec_rid, seq, cost, keys, tokens, billing = json.loads(record)
            assert (rec_rid, seq, cost, tokens, billing) == (rid, "1", "0.4", 1, None)
            assert len(keys) == 8 and keys[1] == f"{prefix}rl:held:{rid}"
            # As the script encoded it before: cjson, which also escapes "/".
            old = "return redis.call('HSET', KEYS[1], ARGV[1], cjson.encode(cjson.decode(ARGV[2])))"
            raw.eval(old, 1, owner_key, field, record)
            assert b"\\/" in raw.hget(owner_key, field)

            assert await supervisor.release_owner("w1") == 1
            after = await supervisor.reserve(sc, ask("b", 1, 0.6), now=T0 + 1)
            assert after.allowed  # the slot is back; the dead request's $0.4 stays spent
            assert after.state["key:rec"]["budget_remaining_usd"] == pytest.approx(0.6)
        finally:
            await worker.close()
            await supervisor.close()

    try:
        asyncio.run(main())
    finally:
        raw.close()


def test_redis_down_raises_limiter_unavailable() -> None:
    proc, url = _start_redis()
    sc = [ScopeLimits("key:down", rpm=5, budget_usd=1.0)]

    async def main() -> None:
        lim = RedisLimiter(url, prefix="down:")
        try:
            assert (await lim.reserve(sc, ask("a"), now=T0)).allowed
            _stop(proc)
            calls: list[Callable[[], Awaitable[Any]]] = [
                lambda: lim.reserve(sc, ask("b"), now=T0),
                lambda: lim.settle(sc, ask("a"), tokens=1, cost_usd=0.0, now=T0),
                lambda: lim.seed_spent("key:down", "day", 0.5, now=T0),
            ]
            for call in calls:
                started = time.monotonic()
                with pytest.raises(LimiterUnavailable, match="Redis limiter unavailable"):
                    await call()
                assert time.monotonic() - started < HANG_S
        finally:
            await lim.close()

    try:
        asyncio.run(main())
    finally:
        _stop(proc)


def test_unresponsive_redis_times_out_as_unavailable() -> None:
    """A server that accepts connections but never answers must not hold requests up."""
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(16)
        url = f"redis://127.0.0.1:{silent.getsockname()[1]}/0"

        async def main() -> None:
            lim = RedisLimiter(url, timeout_s=0.2)
            try:
                with pytest.raises(LimiterUnavailable, match="Timeout"):
                    await lim.reserve([ScopeLimits("key:s", rpm=1)], ask("a"), now=T0)
            finally:
                await lim.close()

        started = time.monotonic()
        asyncio.run(main())
        assert time.monotonic() - started < HANG_S


def _same(mem: Verdict, red: Verdict) -> None:
    assert (red.allowed, red.scope, red.limit) == (mem.allowed, mem.scope, mem.limit)
    if math.isinf(mem.retry_after_s):
        assert red.retry_after_s == math.inf
    else:
        assert red.retry_after_s == pytest.approx(mem.retry_after_s, abs=1e-6)
    assert red.state.keys() == mem.state.keys()
    for scope, info in mem.state.items():
        assert red.state[scope] == pytest.approx(info, abs=1e-9), scope


def test_parity_with_memory_limiter(redis_url: str, prefix: str) -> None:
    key = ScopeLimits("key:p", rpm=8, tpm=2500, max_concurrency=4, budget_usd=3.0)
    tenant = ScopeLimits("tenant:p", rpm=12, tpm=4000, budget_usd=4.0, budget_period="month")
    dep = ScopeLimits("deployment:p", max_concurrency=3, tpm=3000)
    shapes = [[key, tenant, dep], [tenant, dep], [key, tenant], [dep]]
    rng = random.Random(7)
    mem = MemoryLimiter()
    mem.seed_spent("tenant:p", "month", 0.25, now=T0)

    async def body(red: RedisLimiter) -> dict[str, int]:
        assert await red.seed_spent("tenant:p", "month", 0.25, now=T0)
        held: list[tuple[list[ScopeLimits], Ask]] = []
        kinds: dict[str, int] = {}
        t = T0
        for i in range(300):
            t += rng.choice([0.0, 0.5, 1.5, 4.0, 9.0])
            if held and rng.random() < 0.4:
                sc, a = held.pop(rng.randrange(len(held)))
                tokens, cost = rng.randint(0, a.tokens), rng.uniform(0, a.cost_usd)
                await mem.settle(sc, a, tokens, cost, now=t)
                await red.settle(sc, a, tokens, cost, now=t)
                continue
            sc = rng.choice(shapes)
            a = Ask(f"r{i}", rng.choice([100, 400, 900, 5000]), rng.choice([0.01, 0.1, 0.3]))
            m, r = await mem.reserve(sc, a, now=t), await red.reserve(sc, a, now=t)
            _same(m, r)
            if m.allowed:
                held.append((sc, a))
            else:
                kinds[str(m.limit)] = kinds.get(str(m.limit), 0) + 1
        return kinds

    kinds = run(redis_url, prefix, body)
    # The sequence must have exercised every kind of refusal to compare anything.
    assert set(kinds) == {"rpm", "tpm", "concurrency", "budget"}, kinds
