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

The failure-rate rule stays per process (its window of outcomes is not shared).
Redis being unreachable never fails a request: the breakers just stay local.
"""

from __future__ import annotations

import logging
import time

from redis.exceptions import RedisError

from switchyard.state.breakers_memory import CircuitBreaker
from switchyard.state.redis import redis_client

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

    async def close(self) -> None:
        await self._redis.aclose()

    async def sync(self, breakers: dict[str, CircuitBreaker]) -> None:
        """Open local breakers that another process opened (at most every refresh_s)."""
        now_mono = time.monotonic()
        if now_mono - self._fetched_at < self.refresh_s:
            return
        self._fetched_at = now_mono
        aliases = list(breakers)
        keys = [self.prefix + a for a in aliases] + [self._fails_key(a) for a in aliases]
        try:
            values = await self._redis.mget(keys)
        except (RedisError, OSError) as exc:
            self._failed("read", exc)
            return
        wall = time.time()
        opens, fails = values[: len(aliases)], values[len(aliases) :]
        for alias, raw, count in zip(aliases, opens, fails, strict=True):
            self.fails[alias] = int(count) if count is not None else 0
            if raw is None:
                continue
            opened_wall = float(raw)
            breakers[alias].adopt_open(now_mono - max(0.0, wall - opened_wall))

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
        self.errors += 1
        if self.errors == 1 or self.errors % 100 == 0:
            log.warning(
                "shared breaker %s failed (%d so far); breakers stay local: %s",
                what,
                self.errors,
                exc,
            )
