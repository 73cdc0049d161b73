"""Storage: the one store (keys, ledger, traces, idempotency, approvals, stored
responses) and the rate limiter, chosen from settings.storage.

The memory store for `storage.backend: memory`, SQLite (or PostgreSQL through the same
connection, observe/store.py) otherwise; the Redis limiter when storage.redis_url is
set, so every gateway process counts against the same limits.
"""

from __future__ import annotations

from switchyard.config import Settings
from switchyard.observe.responses import Sealer, instance_name
from switchyard.observe.store import MemoryStore, SqliteStore, Store
from switchyard.policy.keys import Limits
from switchyard.policy.limits import Limiter, MemoryLimiter


def build_store(settings: Settings, target: str) -> Store:
    """The store at `target` (config.store_target), with the tenants' default limits."""
    d = settings.tenants_defaults
    defaults = Limits(d.rpm, d.tpm, d.max_concurrency, d.budget.usd, d.budget.period)
    flush_s = settings.observe.ledger_flush_ms / 1000
    # Stored responses (observe/responses.py): sealed with the configured key or the
    # home's key file (a bad one stops the start here), owned by host:port.
    sealer = Sealer.from_settings(settings)
    owner = instance_name(settings.server.port)
    kept_days = settings.responses.retention_days
    return (
        MemoryStore(
            defaults,
            settings.idempotency.ttl_s,
            flush_s,
            sealer=sealer,
            owner=owner,
            response_retention_days=kept_days,
        )
        if settings.storage.backend == "memory"
        else SqliteStore(
            target,
            defaults,
            settings.idempotency.ttl_s,
            flush_s,
            int(settings.observe.max_disk_mb * 1024 * 1024),
            sealer=sealer,
            owner=owner,
            response_retention_days=kept_days,
        )
    )


def build_limiter(settings: Settings) -> Limiter:
    """Rate, token and concurrency counters: in Redis when shared, else in memory."""
    if settings.storage.redis_url:
        from switchyard.policy.redis_limits import RedisLimiter

        return RedisLimiter(settings.storage.redis_url, timeout_s=settings.storage.redis_timeout_s)
    return MemoryLimiter()
