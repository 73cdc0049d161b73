"""The circuit breaker per deployment: moved to state/breakers_memory.py; this module keeps the old
import path."""

from switchyard.state.breakers_memory import (
    CircuitBreaker,
    State,
)

__all__ = [
    "CircuitBreaker",
    "State",
]
