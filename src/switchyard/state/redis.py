"""The Redis client of the shared state (limits, task state, breakers, cache entries)
and how an unreachable Redis is reported (`LimiterUnavailable`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Awaitable, Callable
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import OutOfMemoryError, ReadOnlyError, RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from switchyard.state.limits import (
    LimiterUnavailable,
)

# Redis is down, overloaded or read-only: the caller decides to fail open or closed.
_UNAVAILABLE = (
    RedisConnectionError,
    RedisTimeoutError,
    OSError,
    ReadOnlyError,
    OutOfMemoryError,
)


REDIS_PASSWORD_ENV = "SWITCHYARD_REDIS_PASSWORD"

log = logging.getLogger("switchyard")


def redis_client(url: str, timeout_s: float) -> aioredis.Redis:
    """The client of the shared state (limits, task state, breakers). One immediate
    retry on connection errors covers a pooled connection that Redis has dropped;
    backoff would hold every request up while Redis is down. Timeouts are not retried:
    the script may have run, and a replay would reserve twice. The password: the URL's,
    else $SWITCHYARD_REDIS_PASSWORD (so a secret need not sit in the config)."""
    return aioredis.Redis.from_url(
        url,
        password=os.environ.get(REDIS_PASSWORD_ENV) or None,
        socket_timeout=timeout_s,
        socket_connect_timeout=timeout_s,
        retry=Retry(NoBackoff(), 1, supported_errors=(RedisConnectionError,)),
    )


async def shared_call(state: str, what: str, coro: Awaitable[Any]) -> Any:
    """Await a Redis call; unreachable Redis becomes `LimiterUnavailable` (the caller
    applies policy.on_limiter_failure)."""
    try:
        return await coro
    except _UNAVAILABLE as exc:
        raise LimiterUnavailable(
            f"Redis {state} unavailable during {what}: {type(exc).__name__}: {exc}"
        ) from exc


def count_failure(log: logging.Logger, errors: int, what: str, exc: BaseException) -> int:
    """One more Redis failure of a shared-state component that keeps working without
    Redis (`errors`: its count before this one); logged the first and every 100th time,
    so Redis being down neither floods the log nor goes unseen. The new count."""
    errors += 1
    if errors == 1 or errors % 100 == 0:
        log.warning("%s failed (%d so far): %s", what, errors, exc)
    return errors


async def listen(
    client: aioredis.Redis,
    channel: str,
    on_message: Callable[[bytes], Any],
    on_subscribed: Callable[[], Awaitable[Any]] | None = None,
    on_lost: Callable[[BaseException], Any] | None = None,
) -> None:
    """Hand each message published on `channel` to `on_message`, until cancelled.
    Every time the subscription is made (first, and after Redis came back: messages
    may have been missed meanwhile) `on_subscribed` is awaited first; a lost one is
    told to `on_lost` (else logged) and made again a second later. The one loop of
    every channel the gateway processes share (task cancels, cache events, key
    changes)."""
    while True:
        pubsub = client.pubsub()
        try:
            await pubsub.subscribe(channel)
            if on_subscribed is not None:
                await on_subscribed()
            async for message in pubsub.listen():
                if message.get("type") == "message":
                    on_message(message["data"])
        except (*_UNAVAILABLE, RedisError) as exc:
            if on_lost is not None:
                on_lost(exc)
            else:
                log.warning("channel %s unavailable (%s); retrying in 1 s", channel, exc)
            await asyncio.sleep(1.0)
        finally:
            with contextlib.suppress(Exception):
                await pubsub.aclose()
