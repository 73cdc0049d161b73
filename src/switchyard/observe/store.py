"""The store (keys, idempotency, budgets, the ledger, traces, stored responses):
moved to state/store.py; this module keeps the old import path."""

from switchyard.state.store import (
    MemoryLedger,
    MemoryStore,
    SqliteStore,
    Store,
    log,
    memory_connection,
)

__all__ = [
    "MemoryLedger",
    "MemoryStore",
    "SqliteStore",
    "Store",
    "log",
    "memory_connection",
]
