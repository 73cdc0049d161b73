"""/admin/cache: the response cache's stats, and invalidation here and, through
Redis, in every other gateway process (state/cache_redis.py)."""

from __future__ import annotations

import logging
from typing import Protocol

from redis.exceptions import RedisError
from starlette.requests import Request
from starlette.responses import Response

from switchyard.api.admin.guard import Guard
from switchyard.api.admin.params import as_json, read_fields
from switchyard.decide.cache import ResponseCache
from switchyard.errors import InvalidRequest, SharedStateUnavailable

log = logging.getLogger("switchyard")
_FILTERS = ("tenant", "model", "tag", "partition")
_FILTER_MAX = 256  # longer than any tenant id, alias, tag or partition key
_PARTITION_MIN = 12  # a partition is matched by its start: decisions show 12 characters


class CacheServices(Protocol):
    cache: ResponseCache | None  # None with cache.enabled: false


class Cache:
    """The response cache's stats and invalidation."""

    def __init__(self, services: CacheServices, guard: Guard) -> None:
        self.s = services
        self.guard = guard

    async def cache_invalidate(self, request: Request) -> Response:
        """{"tenant", "model", "tag", "partition", "dry_run"}: at least one filter."""
        self.guard(request)
        cache = self.s.cache
        if cache is None:
            raise InvalidRequest("the cache is not enabled (cache.enabled: false)")
        body = await read_fields(request, (*_FILTERS, "dry_run"))
        f = {k: body.get(k) for k in _FILTERS}
        for name, value in f.items():  # a filter of another type would match nothing
            if value is None:
                continue
            if not isinstance(value, str):
                raise InvalidRequest(f"'{name}' must be a string", param=name)
            # An empty filter (an unset shell variable) would be no filter to a caller
            # that drops it, and one past any key's size is not a name: both refused.
            if not 0 < len(value) <= _FILTER_MAX:
                raise InvalidRequest(f"'{name}' must be 1 to {_FILTER_MAX} characters", param=name)
        partition = f["partition"]
        if partition is not None and len(partition) < _PARTITION_MIN:
            raise InvalidRequest(
                f"'partition' must be at least its first {_PARTITION_MIN} characters "
                "(as decisions show it)",
                param="partition",
            )
        dry_run = body.get("dry_run", False)
        if not isinstance(dry_run, bool):  # "false" would read as true
            raise InvalidRequest("'dry_run' must be true or false", param="dry_run")
        try:
            out = cache.invalidate(**f, dry_run=dry_run)
        except ValueError as exc:
            raise InvalidRequest(str(exc)) from None
        share = cache.share
        if share is not None:  # Redis and every other gateway process
            try:
                out["shared"] = await share.invalidate(f, dry_run)
            except (RedisError, OSError):
                log.warning("cache invalidation not shared: Redis unreachable", exc_info=True)
                raise SharedStateUnavailable(
                    "removed from this gateway process only: the shared cache (Redis) is "
                    "unreachable; repeat the invalidation once it is back"
                ) from None
        return as_json(out)

    async def cache_stats(self, request: Request) -> Response:
        """The response cache: entries, hits by kind, the semantic checks and their state."""
        self.guard(request)
        cache = self.s.cache
        return as_json(cache.stats() if cache is not None else {"enabled": False})
