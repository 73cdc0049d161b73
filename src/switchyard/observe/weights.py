"""Deployment weights set at run time: moved to state/weights.py; this module keeps the old
import path."""

from switchyard.state.weights import (
    REFRESH_S,
    read_weights,
    write_weights,
)

__all__ = [
    "REFRESH_S",
    "read_weights",
    "write_weights",
]
