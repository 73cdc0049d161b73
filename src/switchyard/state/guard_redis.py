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

Anything that can write that Redis can write anything into the hash, so a report is
counted only when it is what a process writes: four counts of ASCII digits (at most
MAX_DIGITS each) that agree (errors and successes within the requests, slow within the
successes) and a finite time within the window of now, else it is left out, whatever
it holds. The read is bounded in Redis (one script per deployment, with the write):
at most MAX_REPORTS fields, each name and value at most MAX_FIELD bytes (longer ones are
skipped there), so a flooded hash costs a gateway a bounded reply.

Redis being unreachable never fails a request: the guard then judges each process's own
window, and the failures are logged (the first and every 100th).
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import re
import socket
import time
import uuid
from collections.abc import Mapping
from typing import Any

from redis.exceptions import NoScriptError, RedisError

from switchyard.state.guard import NONE, GuardCounts, GuardSource
from switchyard.state.redis import count_failure, redis_client

log = logging.getLogger("switchyard")

REFRESH_S = 0.25  # as the breakers' shared counts (state/breakers_redis.py)
MAX_REPORTS = 1024  # fields read per deployment: far above a host's gateway processes
MAX_FIELD = 128  # bytes of a field's name or value: a report is about 40
MAX_DIGITS = 15  # of a count: no window holds 10**15 outcomes
_REPORT = re.compile(
    rb"([0-9]{1,%d}),([0-9]{1,%d}),([0-9]{1,%d}),([0-9]{1,%d}),([0-9.eE+-]+)" % ((MAX_DIGITS,) * 4)
)

# Writes this process's report (ARGV[2], unless empty) with the hash's expiry, and reads
# at most ARGV[4] fields of the hash, skipping any name or value over ARGV[5] bytes: the
# whole hash where it is small enough, else one scan page of it.
_EXCHANGE = """
if ARGV[2] ~= '' then
  redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
  redis.call('PEXPIRE', KEYS[1], ARGV[3])
end
local limit, size = tonumber(ARGV[4]), tonumber(ARGV[5])
local flat
if redis.call('HLEN', KEYS[1]) <= limit then
  flat = redis.call('HGETALL', KEYS[1])
else
  flat = redis.call('HSCAN', KEYS[1], 0, 'COUNT', limit)[2]
end
local out = {}
for i = 1, #flat, 2 do
  if #out >= 2 * limit then break end
  if #flat[i] <= size and #flat[i + 1] <= size then
    out[#out + 1] = flat[i]
    out[#out + 1] = flat[i + 1]
  end
end
return out
"""


class SharedGuard:
    def __init__(
        self,
        url: str,
        timeout_s: float,
        prefix: str = "switchyard:",
        refresh_s: float = REFRESH_S,
    ) -> None:
        self._redis = redis_client(url, timeout_s)
        self._sha = self._redis.register_script(_EXCHANGE).sha
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
        calls: list[list[Any]] = []
        for name in names:
            counts, window_s = own[name]
            report = ""
            if counts.n or self._written.get(name, NONE).n:
                report = f"{','.join(map(str, counts))},{wall!r}"
                writes[name] = counts
            ttl_ms = max(1, int(window_s * 2000))
            calls.append([self._key(name), self.me, report, ttl_ms, MAX_REPORTS, MAX_FIELD])
        try:
            try:
                replies = await self._run_calls(calls)
            except NoScriptError:  # Redis restarted or flushed its scripts: once more
                await self._redis.script_load(_EXCHANGE)
                replies = await self._run_calls(calls)
        except (RedisError, OSError) as exc:
            self.errors = count_failure(log, self.errors, "sharing the canary guard's window", exc)
            return {}
        self._written.update(writes)
        return {
            name: self._others(reply, wall, own[name][1])
            for name, reply in zip(names, replies, strict=True)
        }

    async def _run_calls(self, calls: list[list[Any]]) -> list[Any]:
        """The exchange script once per deployment, in one pipelined round trip (by its
        digest: the script is sent only when Redis does not have it)."""
        async with self._redis.pipeline(transaction=False) as pipe:
            for key, *args in calls:
                pipe.evalsha(self._sha, 1, key, *args)
            return list(await pipe.execute())

    def _others(self, flat: list[bytes], wall: float, window_s: float) -> GuardCounts:
        """The other processes' counts from their fresh, well-formed reports (`flat`:
        field, value, field, value...)."""
        me = self.me.encode()
        total = NONE
        for who, raw in zip(flat[::2], flat[1::2], strict=True):
            counts = _report(raw, wall, window_s) if who != me else None
            if counts is not None:
                total = total.plus(counts)
        return total

    def _key(self, deployment: str) -> str:
        return f"{self.prefix}guard:{deployment}"

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        await self._redis.aclose()


def _report(raw: bytes, wall: float, window_s: float) -> GuardCounts | None:
    """A process's counts from its report, or None for one that is stale (written
    more than the window ago, or that far ahead) or is not what a process writes."""
    m = _REPORT.fullmatch(raw)
    if m is None:
        return None
    try:
        at = float(m[5])
    except ValueError:
        return None
    if not math.isfinite(at) or abs(wall - at) > window_s:
        return None
    c = GuardCounts(*(int(g) for g in m.groups()[:4]))
    if c.errors + c.good > c.n or c.slow > c.good:
        return None
    return c
