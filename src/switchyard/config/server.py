"""The gateway process: its listener, its store, its keys, and the replies it keeps
(idempotent repeats, stored responses)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from switchyard.config.base import Strict


class ServerConfig(Strict):
    host: str = "127.0.0.1"
    """Address the gateway listens on (`--host` overrides it); 0.0.0.0 listens on every
    interface."""
    port: int = Field(8000, ge=0, le=65535)
    """TCP port the gateway listens on (`--port` overrides it)."""
    max_body_bytes: int = Field(8_000_000, gt=0)
    """Largest request body accepted, in bytes; a larger one is answered 413 before it is parsed."""
    default_deadline_s: float = Field(60.0, gt=0)
    """Seconds a request may take in all (queueing, retries and fallbacks included); a client's
    `x-request-timeout` may shorten it. Every model's retry plan (`resilience`, `timeouts`) must fit
    in it, checked at load."""
    body_timeout_s: float = Field(30.0, gt=0)
    """Seconds within which a request's body must arrive (and within its deadline); otherwise
    408."""
    header_timeout_s: float = Field(10.0, gt=0)
    """Seconds within which a request's headers must be complete, counted from the connection's (or
    the request's) first byte; otherwise 408 and the connection closes."""
    max_header_bytes: int = Field(65_536, ge=1024)
    """Bytes a request's line and header block may hold as sent, CRLFs included; one more is
    answered 431 and the connection closes."""
    max_connections: int = Field(2048, ge=1)
    """Open client connections at once; one more is answered 503 `too_many_connections` and
    closed."""
    max_json_depth: int = Field(64, ge=8, le=200)
    """Deepest nesting of objects and arrays in a JSON body; deeper is refused with 400 before any
    work."""
    workers: int | Literal["auto"] = Field(1)
    """Gateway processes serving `port` (`--workers` overrides it): 1 = this process alone; N > 1 =
    N worker processes, each with its own `SO_REUSEPORT` listener, over one control plane (engines,
    ledger writer, retention) and Redis for everything they count together (a private
    `redis-server` on a Unix socket when `storage.redis_url` is null); `auto` = the usable cores.
    See the deployment guide."""

    @field_validator("workers")
    @classmethod
    def _workers(cls, v: int | str) -> int | str:
        if v != "auto" and (not isinstance(v, int) or not 1 <= v <= 256):
            raise ValueError("workers: a number from 1 to 256, or auto")
        return v


class StorageConfig(Strict):
    backend: Literal["sqlite", "memory"] = "sqlite"
    """`sqlite`: keys, ledger, traces and idempotency in `sqlite_path` (durable, shared with the CLI
    and other gateway processes); `memory`: all of it in this process only, lost on exit (tests,
    throwaway gateways)."""
    sqlite_path: str = "~/.switchyard/switchyard.db"
    """The SQLite database file (keys, tenants, usage ledger, traces). The `SWITCHYARD_SQLITE_PATH`
    variable or the CLI's `--db` override it; `postgres_dsn` replaces it."""
    postgres_dsn: str | None = Field(None, pattern=r"^postgres(ql)?://")
    """A `postgresql://user@host:5432/db` URI: the same tables in PostgreSQL instead of
    `sqlite_path`, for gateways on several machines; null = SQLite. Keep the password out of it:
    libpq reads PGPASSWORD or a password file (PGPASSFILE, ~/.pgpass)."""
    redis_url: str | None = None
    """Redis URL for state shared by gateway processes: limits and budgets, task state, breaker
    opens and failure runs, the response cache; null = each process keeps its own. A password not in
    the URL comes from `SWITCHYARD_REDIS_PASSWORD`."""
    redis_timeout_s: float = Field(0.5, gt=0)
    """Seconds per Redis call; past it the limiter counts as unavailable and
    `policy.on_limiter_failure` decides."""


class AuthConfig(Strict):
    mode: Literal["keys", "disabled"] = "keys"
    """`keys`: every request needs an API key; `disabled`: no authentication, for local experiments
    only (warns loudly at start)."""
    admin_key_env: str = "SWITCHYARD_ADMIN_KEY"
    """Environment variable that holds the admin key (admin API, /metrics); the admin API is off
    while it is unset."""
    bootstrap_dev_key: bool = True
    """On first start with no tenants, create tenant `dev` and print its key once."""
    key_cache_s: float = Field(2.0, ge=0)
    """Seconds a verified key stays cached (never past its expiry): a revocation through the CLI
    takes effect within this time; one through the admin API at once, in every gateway process
    that shares Redis with the one that took it."""


class IdempotencyConfig(Strict):
    ttl_s: float = Field(86400.0, gt=0)
    """Seconds a stored reply answers repeats of the same `Idempotency-Key` (same tenant, key and
    body); older replies are deleted by the retention pass (`observe.retention_interval_s`). Under
    `observe.max_disk_mb` replies are deleted after rollout records and before stored responses,
    from the tenant holding the most bytes of them first."""


class ResponsesConfig(Strict):
    """Stored responses of the Responses API (`/v1/responses`): tenant data, sealed at rest."""

    encryption_key_env: str | None = Field(None, pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")
    """Environment variable that holds the key sealing stored responses (AES-256-GCM): 32 bytes in
    base64. Null = a key the gateway makes on first start, `responses.key` (mode 0600) beside the
    SQLite file. Gateways on several machines sharing PostgreSQL must all be given the same key
    here; a variable named but unset, or not a 32-byte key, stops the start."""
    retention_days: float = Field(30.0, gt=0)
    """Days a stored response is kept (and may be retrieved or continued); older ones are deleted.
    Under `observe.max_disk_mb` they are deleted after traces and `Idempotency-Key` replies and
    before usage rows, from the tenant holding the most bytes of stored responses first (its
    oldest), so a tenant that fills the disk loses its own before another tenant's."""
    max_background_per_tenant: int = Field(16, ge=1)
    """Background responses (`background: true`) a tenant may have queued or running at once, over
    every gateway sharing the store; one more is refused with 429."""
    lease_s: float = Field(15.0, ge=1, le=3600)
    """Seconds a background response stays its gateway process's without a renewal: that process
    renews the leases of all it runs every third of this (one write); a response whose lease has
    lapsed (its gateway crashed, hung, or lost the database) is failed by any gateway on the store
    and no longer counts against `max_background_per_tenant`. One of a process of the same host
    that is gone is failed at once. Keep it well above the clock skew between gateway hosts."""
