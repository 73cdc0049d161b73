"""Circuit breakers' state: each process's own breaker per deployment, and the state
shared between processes when there are several.

- memory (state/breakers_memory.py): `CircuitBreaker`, one per deployment, in this
  process; its decisions stay local and fast;
- Redis (state/breakers_redis.py): `SharedBreakers`, the opens and the consecutive
  failures every gateway process sees (`storage.redis_url`). Without Redis there is no
  shared state and each process's breakers decide alone.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from switchyard.state.breakers_memory import CircuitBreaker, State

__all__ = ["CircuitBreaker", "SharedBreakerState", "State"]


@runtime_checkable
class SharedBreakerState(Protocol):
    """What the executor asks of the breakers' state shared between processes."""

    async def sync(self, breakers: dict[str, CircuitBreaker]) -> None:
        """Open local breakers that another process opened."""
        ...

    async def failed(self, alias: str, window_s: float) -> int:
        """Count one failure across processes; the shared consecutive count (0: unknown)."""
        ...

    async def succeeded(self, alias: str, local_failures: int) -> None: ...

    async def opened(self, alias: str, cooldown_s: float) -> None: ...

    async def closed(self, alias: str) -> None: ...

    async def close(self) -> None: ...
