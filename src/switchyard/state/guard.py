"""The canary guard's window (decide/balance.py) as counts, and what shares it between
gateway processes: `SharedGuard` in Redis (state/guard_redis.py) when
`storage.redis_url` is set; without it there is nothing shared and each process's guard
judges its own window.

A window is four counts, what the guard's rules need over several processes' outcomes
together (state/guard_redis.py says why they suffice for the p95 rule).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple, Protocol


class GuardCounts(NamedTuple):
    """A canary's outcomes in a window: requests, errors, successes, and successes
    slower than the guard's `max_p95_ms` (0 without that bound)."""

    n: int = 0
    errors: int = 0
    good: int = 0
    slow: int = 0

    def plus(self, other: GuardCounts) -> GuardCounts:
        return GuardCounts(
            self.n + other.n,
            self.errors + other.errors,
            self.good + other.good,
            self.slow + other.slow,
        )


NONE = GuardCounts()


class GuardSource(Protocol):
    """What shares its canaries' windows (decide/balance.py's Balancer)."""

    def guard_windows(self, now: float) -> dict[str, tuple[GuardCounts, float]]:
        """Each canary's counts in this process's window, by deployment name, with the
        window's length in seconds."""
        ...

    def guard_adopt(self, others: Mapping[str, GuardCounts], now: float) -> None:
        """The other processes' counts, by deployment name (empty: judge alone); the
        source judges its canaries over both and cuts those in breach."""
        ...


class GuardShare(Protocol):
    """What a balancer asks of the shared window."""

    def watch(self, source: GuardSource) -> None:
        """Share `source`'s canaries' windows from now on."""
        ...

    def poke(self) -> None:
        """A canary's outcome was recorded here: exchange until the windows are empty."""
        ...

    async def close(self) -> None:
        """Stop exchanging and close the connection (the gateway's stop)."""
        ...
