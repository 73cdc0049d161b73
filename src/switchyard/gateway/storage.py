"""Storage: the one store (keys, ledger, traces, idempotency, approvals, stored
responses) and the rate limiter, chosen from settings.storage by the state layer
(state/choose.py: memory, SQLite or PostgreSQL for the store; Redis or memory for the
limiter).
"""

from __future__ import annotations

from switchyard.state.choose import build_limiter, build_store

__all__ = ["build_limiter", "build_store"]
