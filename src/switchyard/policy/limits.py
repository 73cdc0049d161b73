"""Rate limits, concurrency and budgets: moved to the state layer.

The `Limiter` interface and its types are in state/limits.py, `MemoryLimiter` in
state/limits_memory.py and `RedisLimiter` in state/limits_redis.py; this module keeps
the old import path.
"""

from switchyard.state.limits import (
    _PERIOD_KEYS,
    WINDOW_S,
    Ask,
    Limiter,
    LimiterUnavailable,
    Period,
    ScopeLimits,
    Verdict,
    period_key,
    period_reset_s,
    period_start,
)
from switchyard.state.limits_memory import (
    BUCKET_S,
    MemoryLimiter,
    _ScopeState,
    _Window,
)

__all__ = [
    "BUCKET_S",
    "WINDOW_S",
    "_PERIOD_KEYS",
    "Ask",
    "Limiter",
    "LimiterUnavailable",
    "MemoryLimiter",
    "Period",
    "ScopeLimits",
    "Verdict",
    "_ScopeState",
    "_Window",
    "period_key",
    "period_reset_s",
    "period_start",
]
