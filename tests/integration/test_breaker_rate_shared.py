"""The breakers' failure-rate rule over several processes (state/breakers_redis.py):
each shares its window's counts through a real redis-server, so a failure rate split
across processes, each below `min_requests` alone, still opens every breaker."""

from __future__ import annotations

import asyncio
import time
import uuid

from hypothesis import given, settings
from hypothesis import strategies as st

from switchyard.config import BreakerConfig
from switchyard.state.breakers_memory import CircuitBreaker
from switchyard.state.breakers_redis import SharedBreakers

# Only the rate rule can open: the consecutive rule is out of reach.
CFG = BreakerConfig(failures=1000, failure_rate=0.5, window_s=30, min_requests=10)


class Process:
    """One gateway process's breaker and its shared state."""

    def __init__(self, url: str, prefix: str) -> None:
        self.breaker = CircuitBreaker("m", CFG)
        self.shared = SharedBreakers(url, 1.0, prefix=prefix, refresh_s=0.0)

    async def outcome(self, ok: bool) -> None:
        self.breaker.record(ok, time.monotonic())

    async def sync(self) -> None:
        await self.shared.sync({"m": self.breaker})


async def _processes(url: str, n: int) -> list[Process]:
    prefix = f"t{uuid.uuid4().hex[:8]}:"
    return [Process(url, prefix) for _ in range(n)]


def test_a_rate_split_over_processes_opens_every_breaker(redis_url: str) -> None:
    async def go() -> list[str]:
        procs = await _processes(redis_url, 3)
        for p in procs:  # 4 outcomes each, 3 of them failures: 12 in all, 75 %
            for ok in (True, False, False, False):
                await p.outcome(ok)
        assert all(p.breaker.state == "closed" for p in procs)  # 4 < min_requests alone
        for p in procs:
            await p.sync()  # shares its counts, reads the others'
        for p in procs:
            await p.sync()  # the first ones now read the last ones' counts
        states = [p.breaker.state for p in procs]
        for p in procs:
            await p.shared.close()
        return states

    assert asyncio.run(go()) == ["open"] * 3


def test_healthy_processes_stay_closed_and_write_nothing(redis_url: str) -> None:
    async def go() -> tuple[list[str], int]:
        procs = await _processes(redis_url, 3)
        for p in procs:
            for _ in range(8):
                await p.outcome(True)
            await p.outcome(False)  # 3 failures in 27: 11 %
        for _ in range(2):
            for p in procs:
                await p.sync()
        states = [p.breaker.state for p in procs]
        idle = Process(redis_url, procs[0].shared.prefix)
        await idle.sync()  # a process with nothing in its window writes no field
        fields = await procs[0].shared._redis.hlen(procs[0].shared._rate_key("m"))
        for p in [*procs, idle]:
            await p.shared.close()
        return states, int(fields)

    states, fields = asyncio.run(go())
    assert states == ["closed"] * 3
    assert fields == 3


def _alone(outcomes: list[bool]) -> CircuitBreaker:
    b = CircuitBreaker("m", CFG)
    for ok in outcomes:
        b.record(ok, time.monotonic())
    return b


@settings(max_examples=25, deadline=None)
@given(st.lists(st.lists(st.booleans(), max_size=12), min_size=1, max_size=4))
def test_shared_counts_decide_as_one_window_would(redis_url: str, runs: list[list[bool]]) -> None:
    """Whatever the outcomes per process, after two rounds of sharing every breaker is
    open exactly when the rate rule holds over all the outcomes together, or when one
    process's own outcomes opened it (an open is shared)."""

    async def go() -> list[str]:
        procs = await _processes(redis_url, len(runs))
        for p, outcomes in zip(procs, runs, strict=True):
            for ok in outcomes:
                await p.outcome(ok)
        for _ in range(2):
            for p in procs:
                await p.sync()
        states = [p.breaker.state for p in procs]
        for p in procs:
            await p.shared.close()
        return states

    every = [ok for outcomes in runs for ok in outcomes]
    failed = every.count(False)
    together = len(every) >= CFG.min_requests and failed / len(every) >= CFG.failure_rate
    alone = any(_alone(outcomes).state == "open" for outcomes in runs)
    expected = "open" if together or alone else "closed"
    assert asyncio.run(go()) == [expected] * len(runs)
