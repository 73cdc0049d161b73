"""Which implementation of each store a gateway uses, chosen from settings in one place.

- the store (keys, approvals, idempotency, tool calls, stored responses, the usage
  ledger and traces): `MemoryStore` for `storage.backend: memory`, else `SqliteStore`
  on the SQLite file or, through the same translating connection (state/sql_pg.py),
  the PostgreSQL database that config.store_target names;
- the limiter and the agent tasks' state: in Redis when `storage.redis_url` is set, so
  every gateway process counts against the same limits and tasks, else in memory.

- the breakers' windows shared between processes: in Redis when `storage.redis_url`
  is set, else none (each process's breakers are its own).

- sessions' deployments (affinity): shared through Redis when `storage.redis_url` is
  set and a model has several deployments (state/affinity_redis.py).

- the learned prompt overhead: shared through Redis when `storage.redis_url` is set
  (state/overhead_redis.py), else each process's own.

- the response cache's entries: each process's own index (decide/cache.py), shared
  through Redis (state/cache_redis.py) when `cache.shared` and `storage.redis_url` are
  set.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from switchyard.config import SINGLE, ProcessRole, Settings
from switchyard.state.breakers import SharedBreakerState
from switchyard.state.cache import CacheShare, LocalEntries
from switchyard.state.keys import Limits
from switchyard.state.limits import Limiter
from switchyard.state.limits_memory import MemoryLimiter
from switchyard.state.responses import Sealer, instance_name
from switchyard.state.store import MemoryStore, SqliteStore, Store
from switchyard.state.tasks import TaskStore
from switchyard.state.tasks_memory import MemoryTaskStore

if TYPE_CHECKING:
    from switchyard.state.affinity_redis import SessionAffinity
    from switchyard.state.keys_redis import KeyChanges
    from switchyard.state.overhead_redis import SharedOverhead


def build_store(settings: Settings, target: str, role: ProcessRole = SINGLE) -> Store:
    """The store at `target` (config.store_target), with the tenants' default limits.
    Each process owns its own background responses under a name of its own (a
    restarted gateway or worker is a new owner: what the old one ran is failed as its
    lease lapses, or at once when its process on this host is gone), and all write
    through one ledger writer."""
    d = settings.tenants_defaults
    defaults = Limits(d.rpm, d.tpm, d.max_concurrency, d.budget.usd, d.budget.period)
    flush_s = settings.observe.ledger_flush_ms / 1000
    # Stored responses (state/responses.py): sealed with the configured key or the
    # home's key file (a bad one stops the start here), owned by this process.
    sealer = Sealer.from_settings(settings)
    owner = instance_name()
    kept_days = settings.responses.retention_days
    store = (
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
            writer_socket=role.ledger_socket,
        )
    )
    store.responses.lease_s = settings.responses.lease_s
    return store


def build_limiter(settings: Settings, role: ProcessRole = SINGLE) -> Limiter:
    """Rate, token and concurrency counters: in Redis when shared, else in memory. A
    worker's reservations are held in its name, so the supervisor can give back a dead
    worker's (scale/workers.py)."""
    if settings.storage.redis_url:
        from switchyard.state.limits_redis import RedisLimiter

        return RedisLimiter(
            settings.storage.redis_url,
            timeout_s=settings.storage.redis_timeout_s,
            owner=role.name if role.worker else None,
        )
    return MemoryLimiter()


def build_tasks(settings: Settings, role: ProcessRole = SINGLE) -> TaskStore:
    """The agent tasks' state: in Redis when shared, else in this process."""
    t = settings.tasks
    if settings.storage.redis_url:  # one task state for every gateway process
        from switchyard.state.tasks_redis import RedisTaskStore

        return RedisTaskStore(
            settings.storage.redis_url,
            timeout_s=settings.storage.redis_timeout_s,
            idle_ttl_s=t.idle_ttl_s,
            max_calls=t.max_tool_calls,
            max_tasks=t.max_tasks,
            owner=role.name if role.worker else None,
        )
    return MemoryTaskStore(t.max_tasks, t.idle_ttl_s, t.max_tool_calls)


def build_shared_breakers(settings: Settings) -> SharedBreakerState | None:
    """The breakers' state shared by every gateway process: in Redis when shared."""
    if settings.storage.redis_url:
        from switchyard.state.breakers_redis import SharedBreakers

        return SharedBreakers(settings.storage.redis_url, settings.storage.redis_timeout_s)
    return None


def build_cache_share(settings: Settings, cache: LocalEntries) -> CacheShare | None:
    """The response cache's entries shared with every gateway process, in Redis, when
    cache.shared and storage.redis_url are set; else None (each process its own)."""
    if settings.cache.shared and settings.storage.redis_url:
        from switchyard.state.cache_redis import SharedCache

        return SharedCache(cache, settings.storage.redis_url, settings.storage.redis_timeout_s)
    return None


def build_overhead_share(settings: Settings) -> SharedOverhead | None:
    """The learned prompt overhead shared by every gateway process, in Redis when
    `storage.redis_url` is set (state/overhead_redis.py); else None."""
    if settings.storage.redis_url:
        from switchyard.state import overhead_redis  # Redis's client only when used

        return overhead_redis.SharedOverhead(
            settings.storage.redis_url, settings.storage.redis_timeout_s
        )
    return None


def build_key_changes(settings: Settings) -> KeyChanges | None:
    """Key and tenant changes told to every gateway process, through Redis when
    `storage.redis_url` is set (state/keys_redis.py); else None (one process)."""
    if settings.storage.redis_url:
        from switchyard.state.keys_redis import KeyChanges  # Redis's client only when used

        return KeyChanges(settings.storage.redis_url, settings.storage.redis_timeout_s)
    return None


def build_session_affinity(settings: Settings) -> SessionAffinity | None:
    """Sessions' deployments shared by every gateway process, in Redis when
    `storage.redis_url` is set and a model has several deployments
    (state/affinity_redis.py); else None (each process's balancers remember alone)."""
    if settings.storage.redis_url and any(m.deployments for m in settings.models):
        from switchyard.state import affinity_redis  # Redis's client only when used

        return affinity_redis.SessionAffinity(
            settings.storage.redis_url, settings.storage.redis_timeout_s
        )
    return None
