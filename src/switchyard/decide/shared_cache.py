"""Response-cache entries shared through Redis: moved to the state layer
(state/cache_redis.py); this path re-exports it."""

from __future__ import annotations

from switchyard.state.cache_redis import RECENT_S, SharedCache, matches, pack, unpack

__all__ = ["RECENT_S", "SharedCache", "matches", "pack", "unpack"]
