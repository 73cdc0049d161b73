"""MemoryLimiter and DeploymentGate, driven with explicit clocks (no servers)."""

from __future__ import annotations

import asyncio
import math
import time

import pytest

from switchyard.errors import RateLimited
from switchyard.policy.admission import DeadlineExceeded, DeploymentGate
from switchyard.policy.admit import rate_headers, refusal
from switchyard.policy.cost import prompt_tokens
from switchyard.request import Generation
from switchyard.state.limits import Ask, ScopeLimits, period_key, period_start
from switchyard.state.limits_memory import MemoryLimiter

T0 = 1_750_000_000.0


def run(coro):  # type: ignore[no-untyped-def]
    return asyncio.run(coro)


def test_rpm_window_never_admits_more_than_limit_in_any_60s() -> None:
    lim = MemoryLimiter()
    sc = [ScopeLimits("key:a", rpm=10)]
    admitted: list[float] = []
    t = T0
    while t < T0 + 300:
        if run(lim.reserve(sc, Ask(f"r{t}", 1, 0), now=t)).allowed:
            admitted.append(t)
        t += 0.37
    for i, start in enumerate(admitted):
        in_span = [x for x in admitted[i:] if x < start + 60]
        assert len(in_span) <= 10
    assert len(admitted) >= 45  # and it does keep admitting as the window slides


def test_burst_straddling_boundary() -> None:
    lim = MemoryLimiter()
    sc = [ScopeLimits("key:a", rpm=10)]
    for i in range(10):
        assert run(lim.reserve(sc, Ask(f"a{i}", 1, 0), now=T0 + 59.5)).allowed
    v = run(lim.reserve(sc, Ask("b", 1, 0), now=T0 + 60.5))
    assert not v.allowed and v.limit == "rpm"
    assert v.retry_after_s == pytest.approx(59.0)
    assert not run(lim.reserve(sc, Ask("c", 1, 0), now=T0 + 119.4)).allowed
    assert run(lim.reserve(sc, Ask("d", 1, 0), now=T0 + 119.6)).allowed


def test_tpm_reservation_and_correction() -> None:
    lim = MemoryLimiter()
    sc = [ScopeLimits("key:a", tpm=1000)]
    first = Ask("a", 800, 0)
    assert run(lim.reserve(sc, first, now=T0)).allowed
    v = run(lim.reserve(sc, Ask("b", 500, 0), now=T0 + 1))
    assert not v.allowed and v.limit == "tpm"
    run(lim.settle(sc, first, tokens=100, cost_usd=0, now=T0 + 2))
    v = run(lim.reserve(sc, Ask("c", 500, 0), now=T0 + 3))
    assert v.allowed
    assert v.state["key:a"]["remaining_tokens"] == 400
    too_big = run(lim.reserve(sc, Ask("d", 5000, 0), now=T0 + 4))
    assert not too_big.allowed and math.isinf(too_big.retry_after_s)
    assert refusal(too_big).code == "tokens_exceed_limit"


def test_concurrency_released_once() -> None:
    lim = MemoryLimiter()
    sc = [ScopeLimits("key:a", max_concurrency=2)]
    a, b = Ask("a", 1, 0), Ask("b", 1, 0)
    assert run(lim.reserve(sc, a, now=T0)).allowed
    assert run(lim.reserve(sc, b, now=T0)).allowed
    assert run(lim.reserve(sc, Ask("c", 1, 0), now=T0)).limit == "concurrency"
    run(lim.settle(sc, a, 1, 0, now=T0))
    run(lim.settle(sc, a, 1, 0, now=T0))  # a second settle must not free a second slot
    assert run(lim.reserve(sc, Ask("d", 1, 0), now=T0)).allowed
    assert not run(lim.reserve(sc, Ask("e", 1, 0), now=T0)).allowed


def test_budget_race_admits_only_what_fits() -> None:
    lim = MemoryLimiter()
    sc = [ScopeLimits("tenant:t", budget_usd=0.2)]

    async def many() -> list[bool]:
        vs = await asyncio.gather(
            *(lim.reserve(sc, Ask(f"r{i}", 1, 0.01), now=T0) for i in range(100))
        )
        return [v.allowed for v in vs]

    allowed = run(many())
    assert sum(allowed) == 20
    v = run(lim.reserve(sc, Ask("x", 1, 0.01), now=T0))
    assert v.limit == "budget" and refusal(v).code == "insufficient_quota"
    assert refusal(v).headers["Retry-After"]


def test_refusal_is_all_or_nothing_across_scopes() -> None:
    lim = MemoryLimiter()
    key = ScopeLimits("key:a", rpm=5)
    tenant = ScopeLimits("tenant:t", rpm=1)
    assert run(lim.reserve([key, tenant], Ask("a", 1, 0), now=T0)).allowed
    v = run(lim.reserve([key, tenant], Ask("b", 1, 0), now=T0))
    assert not v.allowed and v.scope == "tenant:t"
    # The key's window holds only the admitted request.
    v2 = run(lim.reserve([key], Ask("c", 1, 0), now=T0))
    assert v2.state["key:a"]["remaining_requests"] == 3


def test_budget_seed_and_period_start() -> None:
    lim = MemoryLimiter()
    sc = [ScopeLimits("key:a", budget_usd=1.0)]
    lim.seed_spent("key:a", "day", 0.95, now=T0)
    lim.seed_spent("key:a", "day", 0.0, now=T0)  # a live counter is not overwritten
    assert not run(lim.reserve(sc, Ask("a", 1, 0.1), now=T0)).allowed
    assert run(lim.reserve(sc, Ask("b", 1, 0.05), now=T0)).allowed
    start = period_start("day", T0)
    assert start <= T0 < start + 86400 and time.gmtime(start).tm_hour == 0


def test_rate_headers_pick_tightest_scope() -> None:
    lim = MemoryLimiter()
    v = run(
        lim.reserve(
            [ScopeLimits("key:a", rpm=100, tpm=1000), ScopeLimits("tenant:t", rpm=3)],
            Ask("a", 10, 0),
            now=T0,
        )
    )
    h = rate_headers(v)
    assert h["x-ratelimit-limit-requests"] == "3"
    assert h["x-ratelimit-remaining-requests"] == "2"
    assert h["x-ratelimit-limit-tokens"] == "1000"
    assert h["x-ratelimit-remaining-tokens"] == "990"


def test_prompt_estimate_scales_with_text() -> None:
    short, _ = prompt_tokens(
        Generation(model="m", messages=[{"role": "user", "content": "hi"}]), None, 0
    )
    long, _ = prompt_tokens(
        Generation(model="m", messages=[{"role": "user", "content": "word " * 400}]), None, 0
    )
    assert short < 30 < 500 < long


def test_gate_queue_full_and_deadline() -> None:
    async def scenario() -> None:
        gate = DeploymentGate("m", max_concurrency=1, queue=1)
        await gate.acquire(time.perf_counter() + 5)
        waiter = asyncio.create_task(gate.acquire(time.perf_counter() + 5))
        await asyncio.sleep(0)
        assert gate.queued == 1
        with pytest.raises(RateLimited) as full:
            await gate.acquire(time.perf_counter() + 5)
        assert full.value.code == "queue_full" and full.value.headers["Retry-After"]
        gate.release()  # hands the slot to the waiter
        adm = await waiter
        assert adm.waited_s >= 0 and gate.in_flight == 1
        with pytest.raises(DeadlineExceeded):
            await gate.acquire(time.perf_counter() + 0.05)
        assert gate.queued == 0  # the expired waiter left the queue
        gate.release()
        assert gate.in_flight == 0

    run(scenario())


def test_period_key_follows_the_clock_across_days_and_months() -> None:
    """The key of the day asked for last is reused only within that day: the clock
    moving on, or back, or to another period kind, gives that moment's own key."""
    midnight = 1_767_225_600.0  # 2026-01-01T00:00:00Z: a new day, month and year
    times = [
        T0,
        midnight - 0.001,
        midnight,
        midnight - 0.001,
        midnight + 86399.999,
        midnight + 86400.0,
        T0,
        midnight + 31 * 86400.0,
    ]
    for t in times:
        for period, fmt in (("day", "%Y-%m-%d"), ("month", "%Y-%m")):
            assert period_key(period, t) == time.strftime(fmt, time.gmtime(t)), (period, t)


def test_verdict_state_reads_each_scope_as_held_and_as_refused() -> None:
    """Admitted: each scope's remaining requests and tokens count this request (its
    budget left is read before it); refused: every scope as it was, nothing held."""
    lim = MemoryLimiter()
    key = ScopeLimits("key:a", rpm=2)
    tenant = ScopeLimits(
        "tenant:t", rpm=5, tpm=100, max_concurrency=2, budget_usd=1.0, budget_period="month"
    )
    v = run(lim.reserve([key, tenant], Ask("a", 30, 0.25), now=T0))
    assert v.allowed
    assert list(v.state["key:a"].items()) == [
        ("limit_requests", 2),
        ("remaining_requests", 1.0),
        ("reset_requests_s", 0.0),
    ]
    assert list(v.state["tenant:t"].items()) == [
        ("limit_requests", 5),
        ("remaining_requests", 4.0),
        ("reset_requests_s", 0.0),
        ("limit_tokens", 100),
        ("remaining_tokens", 70.0),
        ("reset_tokens_s", 0.0),
        ("budget_remaining_usd", 1.0),
    ]
    v = run(lim.reserve([key, tenant], Ask("b", 80, 0.25), now=T0 + 1))
    assert not v.allowed and (v.scope, v.limit) == ("tenant:t", "tpm")
    assert v.state["key:a"]["remaining_requests"] == 1.0
    assert v.state["key:a"]["reset_requests_s"] == 59.0
    assert v.state["tenant:t"]["remaining_tokens"] == 70.0
    assert v.state["tenant:t"]["budget_remaining_usd"] == 0.75
    run(lim.settle([key, tenant], Ask("a", 30, 0.25), tokens=10, cost_usd=0.5, now=T0 + 2))
    v = run(lim.reserve([key, tenant], Ask("c", 80, 0.25), now=T0 + 3))
    assert v.allowed
    assert v.state["tenant:t"]["remaining_tokens"] == 10.0
    assert v.state["tenant:t"]["budget_remaining_usd"] == 0.5
    assert v.state["key:a"]["remaining_requests"] == 0.0
