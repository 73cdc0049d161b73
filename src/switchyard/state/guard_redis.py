"""The canary guard's window shared through Redis, so the guard (decide/balance.py)
judges a canary over the outcomes of every gateway process, not the 1/N slice one
worker of N sees.

What is shared is what the guard's rules need over the union, as four counts per
canary deployment in a process's window: requests, errors, successful requests, and
successful requests slower than `max_p95_ms`. The error rule is a ratio of sums; the p95
rule needs no latencies: with `good` successes of which `slow` took longer than the
bound, the window's p95 (the `int(0.95 * good)`-th of the sorted latencies) is above the
bound exactly when `slow >= good - int(0.95 * good)`. So the cut over the union is the
cut one window holding every outcome would make, with four integers per process instead
of its latencies (a bounded list would lose exactness past its bound, a histogram
between its buckets).

    {prefix}guard:{deployment}   a hash, one field per process: "n,errors,good,slow,wall",
                                 expiring after twice the guard's window

Each process exchanges (writes its counts, reads the others', one pipelined round trip)
every REFRESH_S while its own window holds outcomes: the loop starts at a canary's
outcome (`poke`) and ends once the window is empty, after writing zeros, so an idle
process costs nothing. A report older than the window (a process that stopped) is left
out. The guard judges at each exchange, not only at a local outcome, since an outcome
elsewhere is not an event here; the last process to exchange after the last outcome
reads every report, so a breach over the union is cut within a refresh or two.

Redis being unreachable never fails a request: the guard then judges each process's own
window, and the failures are logged (the first and every 100th).
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
import uuid
from collections.abc import Mapping
from typing import Any

from redis.exceptions import RedisError

from switchyard.state.guard import NONE, GuardCounts, GuardSource
from switchyard.state.redis import count_failure, redis_client

log = logging.getLogger("switchyard")

REFRESH_S = 0.25  # as the breakers' shared counts (state/breakers_redis.py)


class SharedGuard:
    def __init__(
        self,
        url: str,
        timeout_s: float,
        prefix: str = "switchyard:",
        refresh_s: float = REFRESH_S,
    ) -> None:
        self._redis = redis_client(url, timeout_s)
        self.prefix = prefix
        self.refresh_s = refresh_s
        self.errors = 0
        # This process among those sharing (a restarted one is new).
        self.me = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self._sources: list[GuardSource] = []
        self._written: dict[str, GuardCounts] = {}  # what it last wrote, by deployment
        self._task: asyncio.Task[None] | None = None

    def watch(self, source: GuardSource) -> None:
        self._sources.append(source)

    def poke(self) -> None:
        """A canary's outcome was recorded here: the exchange runs until this process's
        windows are empty (called on the event loop, from the request's release)."""
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        while await self.refresh(time.monotonic()):
            await asyncio.sleep(self.refresh_s)
        # Its windows are empty (nothing to cut) and it stops exchanging, so what it
        # read of the others would go stale: until the next outcome here, it is alone.
        for source in self._sources:
            source.guard_adopt({}, time.monotonic())

    async def refresh(self, now: float) -> bool:
        """One exchange: write this process's counts, read the others', and hand them to
        the sources (which judge). True while this process's windows hold outcomes."""
        own: dict[str, tuple[GuardCounts, float]] = {}
        for source in self._sources:
            own.update(source.guard_windows(now))
        others = await self._exchange(own)
        for source in self._sources:
            source.guard_adopt(others, now)
        return any(counts.n for counts, _ in own.values())

    async def _exchange(
        self, own: Mapping[str, tuple[GuardCounts, float]]
    ) -> dict[str, GuardCounts]:
        """Write what changed (zeros once a window empties, then nothing), read every
        deployment's reports; the others' fresh counts summed (empty when Redis fails)."""
        names = list(own)
        wall = time.time()
        writes: dict[str, GuardCounts] = {}
        try:
            async with self._redis.pipeline(transaction=False) as pipe:
                for name in names:
                    counts, window_s = own[name]
                    key = self._key(name)
                    if counts.n or self._written.get(name, NONE).n:
                        pipe.hset(key, self.me, f"{','.join(map(str, counts))},{wall!r}")
                        pipe.pexpire(key, max(1, int(window_s * 2000)))
                        writes[name] = counts
                    pipe.hgetall(key)
                replies = await pipe.execute()
        except (RedisError, OSError) as exc:
            self.errors = count_failure(log, self.errors, "sharing the canary guard's window", exc)
            return {}
        self._written.update(writes)
        reports = [r for r in replies if isinstance(r, dict)]
        return {
            name: self._others(report, wall, own[name][1])
            for name, report in zip(names, reports, strict=True)
        }

    def _others(self, report: dict[Any, Any], wall: float, window_s: float) -> GuardCounts:
        """The other processes' counts from their fresh reports."""
        total = NONE
        for who, raw in report.items():
            who = who.decode() if isinstance(who, bytes) else str(who)
            if who == self.me:
                continue
            try:
                text = raw.decode() if isinstance(raw, bytes) else str(raw)
                *counts, at = text.split(",")
                if len(counts) != 4 or wall - float(at) > window_s:  # stopped reporting
                    continue
                total = total.plus(GuardCounts(*(max(0, int(c)) for c in counts)))
            except ValueError:
                continue
        return total

    def _key(self, deployment: str) -> str:
        return f"{self.prefix}guard:{deployment}"

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        await self._redis.aclose()
