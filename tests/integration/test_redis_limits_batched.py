"""RedisLimiter's batched calls (state/redis_batch.py) against a real redis-server: many
concurrent reserves and settles in one pipelined round trip still hold every limit
exactly, each caller gets its own reply or error, NOSCRIPT is recovered from without
running a script twice, and a Redis that stops mid-batch fails every waiting caller.

Each test works under its own key prefix; the tests that stop or kill Redis start their
own server.
"""

from __future__ import annotations

import asyncio
import signal
import uuid
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import pytest
import redis
import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from support.redis_server import start_redis, stop_redis
from switchyard.state.limits import Ask, LimiterUnavailable, ScopeLimits, Verdict
from switchyard.state.limits_redis import _RESERVE, RedisLimiter

T0 = 1_750_000_000.0  # 2025-06-15 15:06:40 UTC: far from a day boundary
HANG_S = 10.0  # generous: a hung caller fails the test instead of the run
T = TypeVar("T")


@pytest.fixture
def prefix() -> str:
    return f"t{uuid.uuid4().hex[:8]}:"


def ask(rid: str, tokens: int = 1, cost: float = 0.0) -> Ask:
    return Ask(request_id=rid, tokens=tokens, cost_usd=cost)


def run(url: str, prefix: str, body: Callable[[RedisLimiter], Awaitable[T]]) -> T:
    """Run `body` with a fresh limiter in a fresh event loop, failing it if it hangs."""

    async def main() -> T:
        lim = RedisLimiter(url, prefix=prefix, timeout_s=10)
        try:
            async with asyncio.timeout(HANG_S):
                return await body(lim)
        finally:
            await lim.close()

    return asyncio.run(main())


def server_stat(url: str, section: str, field: str) -> Any:
    raw = redis.Redis.from_url(url)
    try:
        return raw.info(section).get(field)
    finally:
        raw.close()


def test_concurrent_reserves_admit_exactly_rpm_over_one_connection(
    redis_url: str, prefix: str
) -> None:
    sc = [ScopeLimits("key:burst", rpm=20)]
    connections = server_stat(redis_url, "stats", "total_connections_received")

    async def body(lim: RedisLimiter) -> list[Verdict]:
        return list(
            await asyncio.gather(*(lim.reserve(sc, ask(f"r{i}"), now=T0) for i in range(100)))
        )

    verdicts = run(redis_url, prefix, body)
    admitted = [v for v in verdicts if v.allowed]
    assert len(admitted) == 20
    assert {v.limit for v in verdicts if not v.allowed} == {"rpm"}
    # Each caller got its own reply: the admitted saw 19, 18, ... 0 requests left.
    left = sorted(v.state["key:burst"]["remaining_requests"] for v in admitted)
    assert left == list(range(20))
    # One batch at a time on one connection (unbatched, up to 100 would have opened).
    opened = server_stat(redis_url, "stats", "total_connections_received") - connections
    assert opened == 2  # the limiter's one, and the one reading this stat


def test_budget_race_with_settles_two_limiters(redis_url: str, prefix: str) -> None:
    sc = [ScopeLimits("tenant:race", budget_usd=1.0)]

    async def main() -> tuple[int, int, float]:
        one = RedisLimiter(redis_url, prefix=prefix, timeout_s=10)
        two = RedisLimiter(redis_url, prefix=prefix, timeout_s=10)
        lims = [one, two]

        async def race(tag: str) -> list[Ask]:
            asks = [ask(f"{tag}{i}", cost=0.05) for i in range(100)]
            verdicts = await asyncio.gather(
                *(lims[i % 2].reserve(sc, a, now=T0) for i, a in enumerate(asks))
            )
            return [a for a, v in zip(asks, verdicts, strict=True) if v.allowed]

        try:
            async with asyncio.timeout(HANG_S):
                first = await race("a")
                # Each settles at half its reservation: 20 * 0.025 = 0.5 USD spent.
                await asyncio.gather(
                    *(lims[i % 2].settle(sc, a, 1, 0.025, now=T0) for i, a in enumerate(first))
                )
                second = await race("b")
                last = await one.reserve(sc, ask("zero"), now=T0)
                return len(first), len(second), last.state["tenant:race"]["budget_remaining_usd"]
        finally:
            await one.close()
            await two.close()

    first, second, remaining = asyncio.run(main())
    assert (first, second) == (20, 10)
    assert remaining == pytest.approx(0.0, abs=1e-9)


def test_each_request_keeps_its_order_and_slots_hold(redis_url: str, prefix: str) -> None:
    """Forty requests, five reserve-settle rounds each, eight shared slots. Each request
    also has a scope of its own with one slot: had a settle overtaken its reserve (or
    answered another caller), the request's next reserve would find its slot taken."""
    shared = ScopeLimits("deployment:slots", max_concurrency=8)
    peak, held = 0, 0

    async def flow(lim: RedisLimiter, i: int) -> None:
        nonlocal peak, held
        scopes = [ScopeLimits(f"req:{i}", max_concurrency=1), shared]
        for n in range(5):
            a = ask(f"q{i}-{n}", tokens=i + 1)
            while not (v := await lim.reserve(scopes, a, now=T0)).allowed:
                assert v.scope == "deployment:slots", (i, n)
                await asyncio.sleep(0)
            held += 1
            peak = max(peak, held)
            held -= 1  # counted from the reply to the settle: within the server's hold
            await lim.settle(scopes, a, tokens=i + 1, cost_usd=0.0, now=T0)

    async def body(lim: RedisLimiter) -> None:
        await asyncio.gather(*(flow(lim, i) for i in range(40)))

    run(redis_url, prefix, body)
    assert 1 <= peak <= 8
    raw = redis.Redis.from_url(redis_url)
    try:
        assert raw.zcard(f"{prefix}rl:deployment:slots:inflight") == 0
        assert not list(raw.scan_iter(match=f"{prefix}rl:held:*"))
    finally:
        raw.close()


def test_script_error_fails_only_its_own_call(redis_url: str, prefix: str) -> None:
    raw = redis.Redis.from_url(redis_url)
    raw.set(f"{prefix}rl:key:broken:req", "not a sorted set")
    raw.close()
    good = [ScopeLimits("key:fine", rpm=100)]
    bad = [ScopeLimits("key:broken", rpm=100)]

    async def body(lim: RedisLimiter) -> list[Any]:
        calls = [lim.reserve(good, ask(f"g{i}"), now=T0) for i in range(10)]
        calls.insert(5, lim.reserve(bad, ask("b"), now=T0))
        return list(await asyncio.gather(*calls, return_exceptions=True))

    replies = run(redis_url, prefix, body)
    failed = replies.pop(5)
    assert isinstance(failed, ResponseError)
    assert not isinstance(failed, LimiterUnavailable)
    assert "WRONGTYPE" in str(failed)
    assert all(isinstance(v, Verdict) and v.allowed for v in replies)


def test_call_cancelled_while_queued_is_not_sent(redis_url: str, prefix: str) -> None:
    sc = [ScopeLimits("key:cancel", rpm=100)]

    async def body(lim: RedisLimiter) -> int:
        tasks = [asyncio.create_task(lim.reserve(sc, ask(f"c{i}"), now=T0)) for i in range(3)]
        await asyncio.sleep(0)  # the first is on the wire, the other two queued behind it
        tasks[1].cancel()
        outcomes = await asyncio.gather(*tasks, return_exceptions=True)
        assert isinstance(outcomes[1], asyncio.CancelledError)
        return sum(isinstance(v, Verdict) and v.allowed for v in outcomes)

    assert run(redis_url, prefix, body) == 2
    raw = redis.Redis.from_url(redis_url)
    try:
        assert raw.zcard(f"{prefix}rl:key:cancel:req") == 2
    finally:
        raw.close()


def test_script_flush_mid_run_reloads_and_reserves_once(redis_url: str, prefix: str) -> None:
    sc = [ScopeLimits("key:flush", rpm=10_000, tpm=10**9, max_concurrency=100)]
    flows, rounds = 30, 6
    before = _noscript_errors(redis_url)
    reserved: list[str] = []

    async def flow(lim: RedisLimiter, i: int) -> None:
        for n in range(rounds):
            a = ask(f"f{i}-{n}", tokens=10)
            assert (await lim.reserve(sc, a, now=T0)).allowed
            reserved.append(a.request_id)
            await lim.settle(sc, a, tokens=5, cost_usd=0.0, now=T0)

    async def flush_halfway() -> None:
        while len(reserved) < flows * rounds // 2:
            await asyncio.sleep(0)
        await _flush(redis_url)

    async def body(lim: RedisLimiter) -> None:
        await asyncio.gather(flush_halfway(), *(flow(lim, i) for i in range(flows)))

    run(redis_url, prefix, body)
    assert _noscript_errors(redis_url) > before  # the flush was hit mid-run
    # Every reserve ran once: one member per request in the window, one sequence
    # number each, every token settled at 5, no slot left held.
    _assert_counted(redis_url, f"{prefix}rl:", "key:flush", flows * rounds, held=0)


def test_noscript_resends_only_the_calls_it_answered(redis_url: str, prefix: str) -> None:
    """After a flush that leaves the reserve script loaded, one batch of settles and new
    reserves: the reserves run, the settles are answered NOSCRIPT and sent again alone
    (were the reserves sent again too, each would be counted twice)."""
    sc = [ScopeLimits("key:mixed", rpm=10_000, tpm=10**9, max_concurrency=100)]
    old = [ask(f"old{i}", tokens=10) for i in range(20)]
    new = [ask(f"new{i}", tokens=10) for i in range(20)]

    async def body(lim: RedisLimiter) -> tuple[int, list[Any]]:
        await asyncio.gather(*(lim.reserve(sc, a, now=T0) for a in old))
        await _flush(redis_url, keep=_RESERVE)
        before = _noscript_errors(redis_url)
        # The first call finds the wire free and goes alone; the rest queue behind it
        # and go out together.
        first = lim.reserve(sc, new[0], now=T0)
        settles = [lim.settle(sc, a, tokens=5, cost_usd=0.0, now=T0) for a in old]
        reserves = [lim.reserve(sc, a, now=T0) for a in new[1:]]
        return before, list(await asyncio.gather(first, *settles, *reserves))

    before, replies = run(redis_url, prefix, body)
    assert replies[0].allowed
    assert all(v.allowed for v in replies[21:])
    assert _noscript_errors(redis_url) == before + 20
    _assert_counted(redis_url, f"{prefix}rl:", "key:mixed", 40, held=20)


async def _flush(url: str, keep: str | None = None) -> None:
    """SCRIPT FLUSH, as a Redis restart would; `keep` is loaded again in the same
    transaction, so no batch sees it missing."""
    admin = aioredis.Redis.from_url(url)
    try:
        pipe = admin.pipeline(transaction=True)
        pipe.execute_command("SCRIPT FLUSH")
        if keep is not None:
            pipe.execute_command("SCRIPT LOAD", keep)
        await pipe.execute()
    finally:
        await admin.aclose()


def _assert_counted(url: str, base: str, scope: str, reserves: int, held: int) -> None:
    """Each of `reserves` ran once (one window member and one sequence number each), the
    settled ones at 5 of their 10 tokens, `held` still holding a slot."""
    raw = redis.Redis.from_url(url)
    try:
        assert raw.zcard(f"{base}{scope}:req") == reserves
        assert int(raw.get(f"{base}seq") or 0) == reserves
        settled = reserves - held
        assert float(raw.get(f"{base}{scope}:toktotal") or 0) == 5 * settled + 10 * held
        assert raw.zcard(f"{base}{scope}:inflight") == held
    finally:
        raw.close()


def _noscript_errors(url: str) -> int:
    stat = server_stat(url, "errorstats", "errorstat_NOSCRIPT")
    return 0 if stat is None else int(stat["count"])


async def _outcomes(calls: list[asyncio.Task[Any]]) -> list[Any]:
    async with asyncio.timeout(HANG_S):
        return list(await asyncio.gather(*calls, return_exceptions=True))


def test_redis_killed_mid_batch_fails_every_waiting_caller() -> None:
    proc, url = start_redis()
    sc = [ScopeLimits("key:kill", rpm=1000)]

    async def main() -> list[Any]:
        lim = RedisLimiter(url, prefix="kill:", timeout_s=5)
        try:
            assert (await lim.reserve(sc, ask("warm"), now=T0)).allowed
            proc.send_signal(signal.SIGSTOP)  # the next batch is written, never answered
            sent: list[asyncio.Task[Any]] = [
                asyncio.create_task(lim.reserve(sc, ask(f"s{i}"), now=T0)) for i in range(20)
            ]
            await asyncio.sleep(0.1)
            queued: list[asyncio.Task[Any]] = [
                asyncio.create_task(lim.reserve(sc, ask(f"q{i}"), now=T0)) for i in range(20)
            ]
            queued.append(asyncio.create_task(lim.settle(sc, ask("warm"), 1, 0.0, now=T0)))
            await asyncio.sleep(0)
            proc.kill()
            return await _outcomes(sent + queued)
        finally:
            await lim.close()

    try:
        outcomes = asyncio.run(main())
    finally:
        stop_redis(proc)
    assert len(outcomes) == 41
    for outcome in outcomes:
        assert isinstance(outcome, LimiterUnavailable), outcome
        assert "Redis limiter unavailable" in str(outcome)


def test_redis_stopped_mid_batch_times_out_every_caller_without_replay() -> None:
    proc, url = start_redis()
    sc = [ScopeLimits("key:stop", rpm=1000)]

    async def main() -> tuple[list[Any], Verdict]:
        lim = RedisLimiter(url, prefix="stop:", timeout_s=0.5)
        try:
            assert (await lim.reserve(sc, ask("warm"), now=T0)).allowed
            proc.send_signal(signal.SIGSTOP)
            sent = [asyncio.create_task(lim.reserve(sc, ask(f"s{i}"), now=T0)) for i in range(20)]
            await asyncio.sleep(0.1)
            queued = [asyncio.create_task(lim.reserve(sc, ask(f"q{i}"), now=T0)) for i in range(20)]
            outcomes = await _outcomes(sent + queued)
            proc.send_signal(signal.SIGCONT)
            return outcomes, await lim.reserve(sc, ask("after"), now=T0)
        finally:
            await lim.close()

    try:
        outcomes, after = asyncio.run(main())
        raw = redis.Redis.from_url(url)
        counted = raw.zcard("stop:rl:key:stop:req")
        raw.close()
    finally:
        proc.send_signal(signal.SIGCONT)
        stop_redis(proc)
    for outcome in outcomes:
        assert isinstance(outcome, LimiterUnavailable), outcome
        assert "Timeout" in str(outcome)
    assert after.allowed
    # warm, after, and each timed-out reserve at most once: a timeout is never resent.
    assert counted <= 2 + 40


def test_a_connection_redis_dropped_is_made_again_and_the_call_counted_once(
    redis_url: str, prefix: str
) -> None:
    """The batcher keeps one connection. When Redis closes it between calls (an idle
    timeout, CLIENT KILL, a restart), the next call connects again and is answered
    (the client's one retry on a connection error), and it reserves once."""
    sc = [ScopeLimits("key:dropped", rpm=1000)]

    async def body(lim: RedisLimiter) -> list[Verdict]:
        first = await lim.reserve(sc, ask("before"), now=T0)
        admin = aioredis.Redis.from_url(redis_url)
        try:
            # Every normal connection but this admin one: the batcher's among them.
            killed = await admin.client_kill_filter(_type="normal", skipme=True)
        finally:
            await admin.aclose()
        assert killed >= 1
        return [first, await lim.reserve(sc, ask("after"), now=T0)]

    verdicts = run(redis_url, prefix, body)
    assert [v.allowed for v in verdicts] == [True, True]
    assert verdicts[1].state["key:dropped"]["remaining_requests"] == 998  # each counted once
    raw = redis.Redis.from_url(redis_url)
    try:
        assert raw.zcard(f"{prefix}rl:key:dropped:req") == 2
    finally:
        raw.close()


def test_a_reserve_cancelled_while_its_reply_is_awaited_holds_nothing() -> None:
    """A reserve is written and then its caller is cancelled while it waits for the
    reply (Redis paused). The caller gets its cancellation at once; the script still
    runs, and what it reserved is settled unused when its reply comes in: the only
    concurrency slot is free again and the tokens and budget are back (the request
    still counts in its requests window). The calls after it get their own replies."""
    proc, url = start_redis()
    sc = [ScopeLimits("key:cut", rpm=1000, tpm=10_000, max_concurrency=1, budget_usd=1.0)]

    async def main() -> tuple[Verdict, Verdict]:
        lim = RedisLimiter(url, prefix="cut:", timeout_s=5)
        try:
            warm = ask("warm", tokens=1, cost=0.1)
            await lim.reserve(sc, warm, now=T0)
            await lim.settle(sc, warm, 1, 0.1, now=T0)
            proc.send_signal(signal.SIGSTOP)
            task = asyncio.create_task(lim.reserve(sc, ask("cut", tokens=7, cost=0.5), now=T0))
            await asyncio.sleep(0.2)  # written, waiting for the reply
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            proc.send_signal(signal.SIGCONT)
            await asyncio.sleep(0.3)  # the reply comes in; the hold is settled
            a = await lim.reserve(sc, ask("a", tokens=100, cost=0.2), now=T0)
            await lim.settle(sc, ask("a", tokens=100, cost=0.2), 100, 0.2, now=T0)
            b = await lim.reserve(sc, ask("b", tokens=200, cost=0.2), now=T0)
            return a, b
        finally:
            proc.send_signal(signal.SIGCONT)
            await lim.close()

    try:
        a, b = asyncio.run(main())
    finally:
        stop_redis(proc)
    assert a.allowed and b.allowed  # the cancelled reserve's slot came back
    state = a.state["key:cut"]
    assert state["remaining_tokens"] == 10_000 - 1 - 100  # none of its 7 tokens
    # Nor its $0.50: what a's verdict saw left before its own reservation is the
    # budget less warm's $0.10.
    assert state["budget_remaining_usd"] == pytest.approx(1.0 - 0.1)
    assert state["remaining_requests"] == 1000 - 3  # warm, cut, a: it counts as a request
    # Each reply is its own call's: b's remaining tokens are a's less b's own 200.
    assert b.state["key:cut"]["remaining_tokens"] == state["remaining_tokens"] - 200
