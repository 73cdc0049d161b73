"""Circuit-breaker state shared through Redis, so every gateway process stops calling
a failing deployment once one of them has opened its breaker.

Each process keeps its own `CircuitBreaker` (the decisions stay local and fast); what
is shared is the fact "opened at T". A process that opens publishes it with a TTL of
the cooldown; the others read the shared opens at most every `refresh_s` and open
their own breaker from the same moment. A successful half-open probe clears the key.
Redis being unreachable never fails a request: the breakers just stay local.
"""

from __future__ import annotations

import logging
import time

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from switchyard.execute.breaker import CircuitBreaker

log = logging.getLogger("switchyard.breaker")


class SharedBreakers:
    def __init__(
        self,
        url: str,
        timeout_s: float,
        prefix: str = "switchyard:breaker:",
        refresh_s: float = 0.25,
    ) -> None:
        self._redis = aioredis.Redis.from_url(
            url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s
        )
        self.prefix = prefix
        self.refresh_s = refresh_s
        self._fetched_at = -1e9
        self.errors = 0

    async def close(self) -> None:
        await self._redis.aclose()

    async def sync(self, breakers: dict[str, CircuitBreaker]) -> None:
        """Open local breakers that another process opened (at most every refresh_s)."""
        now_mono = time.monotonic()
        if now_mono - self._fetched_at < self.refresh_s:
            return
        self._fetched_at = now_mono
        aliases = list(breakers)
        try:
            values = await self._redis.mget([self.prefix + a for a in aliases])
        except (RedisError, OSError) as exc:
            self._failed("read", exc)
            return
        wall = time.time()
        for alias, raw in zip(aliases, values, strict=True):
            if raw is None:
                continue
            opened_wall = float(raw)
            breakers[alias].adopt_open(now_mono - max(0.0, wall - opened_wall))

    async def opened(self, alias: str, cooldown_s: float) -> None:
        try:
            await self._redis.set(self.prefix + alias, repr(time.time()), px=int(cooldown_s * 1000))
        except (RedisError, OSError) as exc:
            self._failed("publish", exc)

    async def closed(self, alias: str) -> None:
        try:
            await self._redis.delete(self.prefix + alias)
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
