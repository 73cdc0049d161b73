"""Key and tenant changes made through one gateway process, told to every other
process that shares Redis (the workers of one host, the replicas of several), so that a
revoked key, a lowered limit or budget and a changed priority apply in each of them at
once, not when its cache of verified keys (`auth.key_cache_s`) would have expired.

A change is published on `{prefix}keys-changed`; each process listens (`listen`) and
drops its cache. A process that was cut off from Redis drops it again once it is
subscribed anew, as it may have missed changes. An unreachable Redis leaves each
process with what its own cache says for at most `auth.key_cache_s`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from redis.exceptions import RedisError

from switchyard.state.redis import listen, redis_client

log = logging.getLogger("switchyard")


class KeyChanges:
    def __init__(self, url: str, timeout_s: float, prefix: str = "switchyard:") -> None:
        self._redis = redis_client(url, timeout_s)
        self.channel = f"{prefix}keys-changed"
        self.subscribed = asyncio.Event()

    async def publish(self) -> None:
        """Tell every other process that keys or tenants changed."""
        try:
            await self._redis.publish(self.channel, b"1")
        except (RedisError, OSError) as exc:
            log.warning(
                "could not tell the other gateway processes of a key change (%s): "
                "they apply it within auth.key_cache_s",
                exc,
            )

    async def listen(self, on_change: Callable[[], None]) -> None:
        """Call `on_change()` for each change any process publishes, and once each time
        the subscription is made (changes may have been missed), until cancelled."""

        async def subscribed() -> None:
            on_change()
            self.subscribed.set()

        def lost(exc: BaseException) -> None:
            self.subscribed.clear()
            log.warning("key change channel unavailable (%s); retrying in 1 s", exc)

        await listen(self._redis, self.channel, lambda _: on_change(), subscribed, lost)

    async def close(self) -> None:
        await self._redis.aclose()
