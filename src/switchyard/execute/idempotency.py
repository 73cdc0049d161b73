"""The idempotency keys' store: moved to state/idempotency.py; this module keeps the old
import path."""

from switchyard.state.idempotency import (
    IdempotencyStore,
    StoredReply,
    _canonical,
    body_hash,
    log,
)

__all__ = [
    "IdempotencyStore",
    "StoredReply",
    "_canonical",
    "body_hash",
    "log",
]
