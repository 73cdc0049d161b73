"""Circuit-breaker state shared through Redis, so every gateway process stops calling
a failing deployment once one of them has opened its breaker.

Each process keeps its own `CircuitBreaker` (the decisions stay local and fast); two
facts are shared:

- "opened at T": a process that opens publishes it with a TTL of the cooldown; the
  others read the shared opens at most every `refresh_s` and open their own breaker
  from the same moment. A successful half-open probe clears the key.
- the consecutive failures, counted across processes: each failure is an INCR (with
  the breaker's window as its TTL) whose answer is compared with `failures`, so
  failures split across replicas, each below the threshold, still open the breaker.
  A success resets the count (a DEL, sent only while this process knows the count may
  be above zero: the count comes back with every refresh, so a healthy deployment
  costs no write per request).

- the failure-rate rule's counts: at each refresh a process writes its own window's
  outcomes and failures (`{prefix}rate:{alias}`, a hash field per process with the
  time it was written, expiring with the window) and reads the others', which its
  breaker counts with its own (`adopt_others`): a rate split across processes, each
  below `min_requests` or the rate alone, still opens the breaker, within a refresh.

Redis being unreachable never fails a request: the breakers just stay local.
"""

from __future__ import annotations

import logging
import os
import socket
import time
import uuid
from typing import Any

from redis.exceptions import RedisError

from switchyard.state.breakers_memory import CircuitBreaker
from switchyard.state.redis import count_failure, redis_client

log = logging.getLogger("switchyard.breaker")


class SharedBreakers:
    def __init__(
        self,
        url: str,
        timeout_s: float,
        prefix: str = "switchyard:breaker:",
        refresh_s: float = 0.25,
    ) -> None:
        self._redis = redis_client(url, timeout_s)
        self.prefix = prefix
        self.refresh_s = refresh_s
        self._fetched_at = -1e9
        self.errors = 0
        self.fails: dict[str, int] = {}  # shared consecutive failures, as last seen
        # This process among those sharing the rate counts (a restarted one is new).
        self.me = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self._shared_window: dict[str, tuple[int, int]] = {}  # what it last wrote

    async def close(self) -> None:
        await self._redis.aclose()

    async def sync(self, breakers: dict[str, CircuitBreaker]) -> None:
        """Open local breakers that another process opened, and share the failure
        rate's counts (at most every refresh_s)."""
        now_mono = time.monotonic()
        if now_mono - self._fetched_at < self.refresh_s:
            return
        self._fetched_at = now_mono
        aliases = list(breakers)
        keys = [self.prefix + a for a in aliases] + [self._fails_key(a) for a in aliases]
        wall = time.time()
        try:
            async with self._redis.pipeline(transaction=False) as pipe:
                pipe.mget(keys)
                for alias in aliases:
                    self._share_window(pipe, alias, breakers[alias], now_mono, wall)
                    pipe.hgetall(self._rate_key(alias))
                values, *rest = await pipe.execute()
        except (RedisError, OSError) as exc:
            self._failed("read", exc)
            return
        rates = [r for r in rest if isinstance(r, dict)]
        opens, fails = values[: len(aliases)], values[len(aliases) :]
        for alias, raw, count, rate in zip(aliases, opens, fails, rates, strict=True):
            self.fails[alias] = int(count) if count is not None else 0
            breaker = breakers[alias]
            if raw is not None:
                breaker.adopt_open(now_mono - max(0.0, wall - float(raw)))
            n, failed = self._others(rate, wall, breaker.cfg.window_s)
            if breaker.adopt_others(n, failed, now_mono):
                await self.opened(alias, breaker.cfg.cooldown_s)

    def _share_window(
        self, pipe: Any, alias: str, breaker: CircuitBreaker, now: float, wall: float
    ) -> None:
        """Queue the write of this process's window counts: when there are any, or to
        clear the last ones written (an idle healthy process writes nothing)."""
        counts = breaker.window(now)
        if counts == (0, 0) and self._shared_window.get(alias, (0, 0)) == (0, 0):
            return
        self._shared_window[alias] = counts
        key = self._rate_key(alias)
        pipe.hset(key, self.me, f"{counts[0]},{counts[1]},{wall!r}")
        pipe.pexpire(key, max(1, int(breaker.cfg.window_s * 2000)))

    def _others(self, rate: dict[Any, Any], wall: float, window_s: float) -> tuple[int, int]:
        """The other processes' outcomes and failures, from their fresh reports."""
        n = failed = 0
        for who, raw in rate.items():
            who = who.decode() if isinstance(who, bytes) else str(who)
            if who == self.me:
                continue
            try:
                text = raw.decode() if isinstance(raw, bytes) else str(raw)
                outcomes, failures, at = text.split(",")
                if wall - float(at) > window_s:  # a process that stopped reporting
                    continue
                n += max(0, int(outcomes))
                failed += max(0, int(failures))
            except ValueError:
                continue
        return n, failed

    def _rate_key(self, alias: str) -> str:
        return f"{self.prefix}rate:{alias}"

    def _fails_key(self, alias: str) -> str:
        return f"{self.prefix}fails:{alias}"

    async def failed(self, alias: str, window_s: float) -> int:
        """Count one failure across processes; the shared consecutive count, or 0 when
        Redis cannot say (the local count then decides alone)."""
        key = self._fails_key(alias)
        try:
            async with self._redis.pipeline(transaction=True) as pipe:
                pipe.incr(key)
                pipe.pexpire(key, max(1, int(window_s * 1000)))
                count, _ = await pipe.execute()
        except (RedisError, OSError) as exc:
            self._failed("count", exc)
            return 0
        self.fails[alias] = int(count)
        return int(count)

    async def succeeded(self, alias: str, local_failures: int) -> None:
        """A success ends the consecutive run everywhere; written only when the run may
        be non-zero (this process saw failures, or the last refresh showed some)."""
        if local_failures == 0 and self.fails.get(alias, 0) == 0:
            return
        self.fails[alias] = 0
        try:
            await self._redis.delete(self._fails_key(alias))
        except (RedisError, OSError) as exc:
            self._failed("reset", exc)

    async def opened(self, alias: str, cooldown_s: float) -> None:
        """Publish the open; the failure run that caused it starts over after it."""
        self.fails[alias] = 0
        try:
            async with self._redis.pipeline(transaction=True) as pipe:
                pipe.set(self.prefix + alias, repr(time.time()), px=int(cooldown_s * 1000))
                pipe.delete(self._fails_key(alias))
                await pipe.execute()
        except (RedisError, OSError) as exc:
            self._failed("publish", exc)

    async def closed(self, alias: str) -> None:
        self.fails[alias] = 0
        try:
            await self._redis.delete(self.prefix + alias, self._fails_key(alias))
        except (RedisError, OSError) as exc:
            self._failed("clear", exc)

    def _failed(self, what: str, exc: BaseException) -> None:
        what = f"shared breaker {what} (breakers stay local)"
        self.errors = count_failure(log, self.errors, what, exc)
