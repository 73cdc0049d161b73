"""`RedisLimiter` and the shared Redis client: moved to state/limits_redis.py and
state/redis.py; this module keeps the old import path.
"""

# Moved to the state layer (this module keeps the old import path):
from switchyard.state.limits_redis import (
    _KEYS_PER_SCOPE,
    _LUA_COMMON,
    _RESERVE,
    _SETTLE,
    BUDGET_TTL_S,
    LEASE_S,
    RedisLimiter,
    _arg,
)
from switchyard.state.redis import (
    _UNAVAILABLE,
    REDIS_PASSWORD_ENV,
    redis_client,
    shared_call,
)

__all__ = [
    "BUDGET_TTL_S",
    "LEASE_S",
    "REDIS_PASSWORD_ENV",
    "_KEYS_PER_SCOPE",
    "_LUA_COMMON",
    "_RESERVE",
    "_SETTLE",
    "_UNAVAILABLE",
    "RedisLimiter",
    "_arg",
    "redis_client",
    "shared_call",
]
