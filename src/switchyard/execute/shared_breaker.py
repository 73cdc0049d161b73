"""Circuit-breaker state shared through Redis:
moved to state/breakers_redis.py; this module keeps the old import path."""

from switchyard.state.breakers_redis import (
    SharedBreakers,
    log,
)

__all__ = [
    "SharedBreakers",
    "log",
]
