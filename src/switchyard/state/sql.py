"""The SQLite database: keys, tenants and the usage ledger, in WAL mode.

WAL lets the CLI read and write while a gateway serves, and a commit is durable
once it returns. Each component opens its own connection; writes are serialized by
SQLite itself (busy timeout instead of failing).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import sqlite3
from collections.abc import Callable, Iterable
from concurrent.futures import Executor
from pathlib import Path
from typing import Any, TypeVar

from switchyard.errors import DatabaseUnavailable, UnstorableValue
from switchyard.state.sql_pg import is_postgres

# The idempotency store's table (state/idempotency.py), here with the others: the
# PostgreSQL schema code reads every table's schema while it holds its advisory lock,
# so what it imports must stay small.
IDEMPOTENCY_SCHEMA = """
CREATE TABLE IF NOT EXISTS idempotency (
    tenant_id TEXT NOT NULL,
    key TEXT NOT NULL,
    body_hash TEXT NOT NULL,
    state TEXT NOT NULL,
    status INTEGER,
    headers TEXT,
    body BLOB,
    created_at REAL NOT NULL,
    PRIMARY KEY (tenant_id, key)
);
"""

# Stored responses of the Responses API (state/responses.py): tenant data. Everything
# the store filters on is plain text; `body` (the response, its input items and the
# conversation) is sealed with AES-GCM, so nothing readable of it sits on disk.
# Partial indexes keep the two in-flight queries (a tenant's running background
# responses, this instance's orphans at start) off the tenant's whole history.
RESPONSES_SCHEMA = """
CREATE TABLE IF NOT EXISTS responses (
    tenant_id TEXT NOT NULL,
    id TEXT NOT NULL,
    created_at REAL NOT NULL,
    updated_at REAL NOT NULL,
    status TEXT NOT NULL,
    model TEXT NOT NULL,
    deployment TEXT,
    previous_response_id TEXT,
    background INTEGER NOT NULL DEFAULT 0,
    owner TEXT,
    body BLOB NOT NULL,
    PRIMARY KEY (tenant_id, id)
);
CREATE INDEX IF NOT EXISTS responses_time ON responses(created_at);
CREATE INDEX IF NOT EXISTS responses_background ON responses(tenant_id)
    WHERE background = 1 AND status IN ('queued', 'in_progress');
CREATE INDEX IF NOT EXISTS responses_in_flight ON responses(owner)
    WHERE status IN ('queued', 'in_progress');
"""


SCHEMA = """
CREATE TABLE IF NOT EXISTS tenants (
    id TEXT PRIMARY KEY,
    created_at REAL NOT NULL,
    rpm INTEGER, tpm INTEGER, max_concurrency INTEGER,
    budget_usd REAL, budget_period TEXT,
    allowed_models TEXT NOT NULL DEFAULT '["*"]',
    labels TEXT NOT NULL DEFAULT '{}',
    task_budget TEXT,
    priority TEXT
);
CREATE TABLE IF NOT EXISTS api_keys (
    id TEXT PRIMARY KEY,
    tenant_id TEXT NOT NULL REFERENCES tenants(id),
    hash TEXT NOT NULL UNIQUE,
    prefix TEXT NOT NULL,
    name TEXT,
    created_at REAL NOT NULL,
    expires_at REAL,
    revoked_at REAL,
    allowed_models TEXT NOT NULL DEFAULT '["*"]',
    allowed_adapters TEXT NOT NULL DEFAULT '[]',
    may_pin_revisions INTEGER NOT NULL DEFAULT 0,
    may_report_device_state INTEGER NOT NULL DEFAULT 0,
    rpm INTEGER, tpm INTEGER, max_concurrency INTEGER,
    budget_usd REAL, budget_period TEXT,
    labels TEXT NOT NULL DEFAULT '{}',
    task_budget TEXT,
    priority TEXT
);
CREATE INDEX IF NOT EXISTS api_keys_tenant ON api_keys(tenant_id);
CREATE TABLE IF NOT EXISTS usage (
    request_id TEXT PRIMARY KEY,
    client_request_id TEXT,
    task_id TEXT,
    tenant_id TEXT,
    key_id TEXT,
    endpoint TEXT NOT NULL,
    model TEXT,
    revision TEXT,
    upstream TEXT,
    input_tokens INTEGER NOT NULL DEFAULT 0,
    output_tokens INTEGER NOT NULL DEFAULT 0,
    cost_usd REAL NOT NULL DEFAULT 0,
    cache TEXT,
    status TEXT NOT NULL,
    error_code TEXT,
    attempts INTEGER NOT NULL DEFAULT 0,
    received_at REAL NOT NULL,
    queue_ms REAL,
    ttft_ms REAL,
    duration_ms REAL
);
CREATE INDEX IF NOT EXISTS usage_tenant_time ON usage(tenant_id, received_at);
CREATE INDEX IF NOT EXISTS usage_key_time ON usage(key_id, received_at);
CREATE INDEX IF NOT EXISTS usage_task ON usage(task_id);
CREATE TABLE IF NOT EXISTS traces (
    request_id TEXT PRIMARY KEY,
    client_request_id TEXT,
    task_id TEXT,
    tenant_id TEXT,
    status TEXT NOT NULL,
    received_at REAL NOT NULL,
    record TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS traces_task ON traces(task_id);
CREATE INDEX IF NOT EXISTS traces_tenant_time ON traces(tenant_id, received_at);
CREATE INDEX IF NOT EXISTS traces_time ON traces(received_at);
-- The pipeline's folded blocks of decisions (the same for every request of a View), by
-- a hash of their content: a trace refers to them instead of repeating them.
CREATE TABLE IF NOT EXISTS trace_templates (
    id TEXT PRIMARY KEY,
    template TEXT NOT NULL
);
-- Approvals of tool calls that need one (policy/tool_calls.py): single-use, expiring,
-- kept as a hash of the token.
CREATE TABLE IF NOT EXISTS approvals (
    token_hash TEXT PRIMARY KEY,
    tenant_id TEXT NOT NULL,
    task_id TEXT,
    call_id TEXT NOT NULL,
    approver TEXT NOT NULL,
    created_at REAL NOT NULL,
    expires_at REAL NOT NULL,
    used_at REAL,
    used_by TEXT
);
-- Whether a call already had an approval (a later turn carries its result again).
CREATE INDEX IF NOT EXISTS approvals_used ON approvals(tenant_id, call_id)
    WHERE used_at IS NOT NULL;
-- Side-effecting MCP tool calls, at most once (state/tool_calls.py): who owns a call id,
-- its state (in_flight, done, in_doubt) and its result, sealed (state/sealing.py).
CREATE TABLE IF NOT EXISTS tool_calls (
    tenant_id TEXT NOT NULL,
    call_id TEXT NOT NULL,
    task_id TEXT,
    tool TEXT NOT NULL,
    args_hash TEXT NOT NULL,
    state TEXT NOT NULL,
    request_id TEXT NOT NULL,
    result BLOB,
    created_at REAL NOT NULL,
    updated_at REAL NOT NULL,
    PRIMARY KEY (tenant_id, call_id)
);
CREATE INDEX IF NOT EXISTS tool_calls_doubt ON tool_calls(tenant_id) WHERE state = 'in_doubt';
CREATE TABLE IF NOT EXISTS deployment_weights (
    alias TEXT NOT NULL,
    deployment TEXT NOT NULL,
    weight REAL NOT NULL,
    updated_at REAL NOT NULL,
    reason TEXT NOT NULL DEFAULT '',
    PRIMARY KEY (alias, deployment)
);
-- Seconds each local engine was busy (a request held on it), per UTC hour (unix time
-- // 3600): the cost report's utilization (observe/cost.py).
CREATE TABLE IF NOT EXISTS engine_busy (
    engine TEXT NOT NULL,
    hour INTEGER NOT NULL,
    busy_s REAL NOT NULL DEFAULT 0,
    PRIMARY KEY (engine, hour)
);
-- RL serving (engines/revisions.py, observe/rollouts.py): each registered revision of a
-- model with its state and the history of its state changes, and the rollout records.
CREATE TABLE IF NOT EXISTS rl_revisions (
    alias TEXT NOT NULL,
    revision TEXT NOT NULL,
    kind TEXT NOT NULL,
    path TEXT NOT NULL,
    sha256 TEXT NOT NULL,
    state TEXT NOT NULL,
    reason TEXT NOT NULL DEFAULT '',
    created_at REAL NOT NULL,
    updated_at REAL NOT NULL,
    history TEXT NOT NULL DEFAULT '[]',
    PRIMARY KEY (alias, revision)
);
CREATE TABLE IF NOT EXISTS rollouts (
    sample_id TEXT PRIMARY KEY,
    request_id TEXT NOT NULL,
    tenant_id TEXT,
    model TEXT NOT NULL,
    revision TEXT NOT NULL,
    created_at REAL NOT NULL,
    record TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS rollouts_time ON rollouts(created_at);
"""
# Every connection has it: retention and the byte budget (state/traces.py) delete from it
# in whichever process runs them.
SCHEMA += RESPONSES_SCHEMA

# Columns added after a table first shipped: (table, column, type). `connect` adds
# each to a file made before it, then the indexes that use them.
MIGRATIONS = (
    ("usage", "client_request_id", "TEXT"),
    ("traces", "client_request_id", "TEXT"),
    ("usage", "images", "INTEGER"),
    ("usage", "image_bytes", "INTEGER"),
    ("usage", "image_pixels_in", "INTEGER"),
    ("usage", "image_pixels_out", "INTEGER"),
    ("usage", "adapter", "TEXT"),
    ("usage", "adapter_revision", "TEXT"),
    ("api_keys", "may_pin_revisions", "INTEGER NOT NULL DEFAULT 0"),
    ("api_keys", "may_report_device_state", "INTEGER NOT NULL DEFAULT 0"),
    ("tenants", "task_budget", "TEXT"),
    ("usage", "placement", "TEXT"),
    ("api_keys", "task_budget", "TEXT"),
    ("tenants", "priority", "TEXT"),
    ("api_keys", "priority", "TEXT"),
)
# Partial: only requests that carry a client id pay for an index entry (a full index
# cost the writer two more B-tree inserts for every request).
LATE_INDEXES = """
CREATE INDEX IF NOT EXISTS usage_client ON usage(client_request_id, tenant_id)
    WHERE client_request_id IS NOT NULL;
CREATE INDEX IF NOT EXISTS traces_client ON traces(client_request_id, tenant_id)
    WHERE client_request_id IS NOT NULL;
"""


# The bill: usage per UTC day, tenant, key and model, kept whatever retention removes
# of the raw rows; budgets are seeded from it on restart. Written by the ledger writer
# in the same transaction as the rows it sums.
USAGE_DAILY = """
CREATE TABLE usage_daily (
    day TEXT NOT NULL,
    tenant_id TEXT NOT NULL DEFAULT '',
    key_id TEXT NOT NULL DEFAULT '',
    model TEXT NOT NULL DEFAULT '',
    requests INTEGER NOT NULL DEFAULT 0,
    errors INTEGER NOT NULL DEFAULT 0,
    input_tokens INTEGER NOT NULL DEFAULT 0,
    output_tokens INTEGER NOT NULL DEFAULT 0,
    cost_usd REAL NOT NULL DEFAULT 0,
    PRIMARY KEY (day, tenant_id, key_id, model)
);
CREATE INDEX usage_daily_tenant ON usage_daily(tenant_id, day);
CREATE INDEX usage_daily_key ON usage_daily(key_id, day);
"""
# A file made before the rollups existed gets them from its raw rows, once.
BACKFILL_DAILY = """
INSERT INTO usage_daily
SELECT date(received_at, 'unixepoch'), COALESCE(tenant_id, ''), COALESCE(key_id, ''),
       COALESCE(model, ''), COUNT(*), SUM(status != 'ok'), SUM(input_tokens),
       SUM(output_tokens), SUM(cost_usd)
FROM usage GROUP BY 1, 2, 3, 4
"""


def _has_table(conn: sqlite3.Connection, name: str) -> bool:
    row = conn.execute(
        "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ?", (name,)
    ).fetchone()
    return row is not None


def _add_rollups(conn: sqlite3.Connection) -> None:
    """Create usage_daily (and fill it from the raw rows) exactly once, under the write
    lock: the gateway and the ledger writer may both be connecting."""
    if _has_table(conn, "usage_daily"):
        return
    conn.execute("BEGIN IMMEDIATE")
    try:
        if not _has_table(conn, "usage_daily"):
            for statement in USAGE_DAILY.split(";"):
                if statement.strip():
                    conn.execute(statement)
            conn.execute(BACKFILL_DAILY)
        conn.execute("COMMIT")
    except BaseException:
        conn.execute("ROLLBACK")
        raise


def migrate(conn: sqlite3.Connection) -> None:
    for table, column, kind in MIGRATIONS:
        have = {row[1] for row in conn.execute(f"PRAGMA table_info({table})")}
        if column not in have:
            with contextlib.suppress(sqlite3.OperationalError):  # another process won
                conn.execute(f"ALTER TABLE {table} ADD COLUMN {column} {kind}")
    conn.executescript(LATE_INDEXES)
    _add_rollups(conn)


def newest_first(
    conn: sqlite3.Connection,
    select: str,
    equal: Iterable[tuple[str, Any]],
    limit: int,
    since: float | None = None,
    before: float | None = None,
) -> list[Any]:
    """The rows of `select` (a table of requests) where each named column equals its
    value (None: no filter), received at or after `since` and strictly before `before`,
    newest first. The column names are the caller's own, never a client's."""
    where: list[str] = []
    args: list[Any] = []
    for column, value in equal:
        if value is not None:
            where.append(f"{column} = ?")
            args.append(value)
    if since is not None:
        where.append("received_at >= ?")
        args.append(since)
    if before is not None:
        where.append("received_at < ?")
        args.append(before)
    sql = select + (" WHERE " + " AND ".join(where) if where else "")
    return conn.execute(sql + " ORDER BY received_at DESC LIMIT ?", (*args, limit)).fetchall()


def is_sqlite(conn: object) -> bool:
    """Whether a store connection is SQLite's (else PostgreSQL's, state/sql_pg.py)."""
    return isinstance(conn, sqlite3.Connection)


def resolve_path(path: str) -> str:
    if path == ":memory:" or is_postgres(path):
        return path
    p = Path(os.path.expandvars(os.path.expanduser(path)))
    p.parent.mkdir(parents=True, exist_ok=True)
    return str(p)


_PAGE_BYTES = 8192


def _has_nul(rows: Iterable[Any]) -> bool:
    """Whether statements' parameters (each a sequence or a mapping) hold text with a
    NUL (joined and searched once: a ledger batch has ~14,000 values)."""
    texts = [
        v
        for row in rows
        for v in (row.values() if isinstance(row, dict) else row)
        if v.__class__ is str
    ]
    return "\x00" in "".join(texts)


class Connection(sqlite3.Connection):
    """SQLite's connection, refusing text with a NUL character as PostgreSQL does
    (`UnstorableValue`, a 400), so the two stores answer alike: SQLite would keep
    a key named "a\\u0000b" and find no tenant "a\\u0000", where PostgreSQL
    refuses both; now both refuse. Checked in the caller, before SQLite sees it."""

    def execute(self, sql: str, parameters: Any = (), /) -> sqlite3.Cursor:
        if parameters and _has_nul((parameters,)):
            raise UnstorableValue()
        return super().execute(sql, parameters)

    def executemany(self, sql: str, parameters: Iterable[Any], /) -> sqlite3.Cursor:
        rows = parameters if isinstance(parameters, list | tuple) else list(parameters)
        if _has_nul(rows):
            raise UnstorableValue()
        return super().executemany(sql, rows)


def connect(path: str) -> sqlite3.Connection:
    """A connection with the schema in place. Safe to share across threads when the
    caller serializes use (check_same_thread=False). A PostgreSQL URI gives a
    connection with the same interface to that database (state/sql_pg.py)."""
    if is_postgres(path):
        from switchyard.state import sql_pg as pg

        return pg.connect(path)  # type: ignore[return-value]
    conn = sqlite3.connect(
        resolve_path(path),
        timeout=10,
        check_same_thread=False,
        isolation_level=None,
        factory=Connection,
    )
    conn.row_factory = sqlite3.Row
    # 8 KiB pages in a new file (an older one keeps its own): a request's trace is about
    # 2 KB, and with 4 KiB pages each one took a page, and a WAL frame, of its own.
    conn.execute(f"PRAGMA page_size={_PAGE_BYTES}")
    # Space freed by retention goes back to the disk (observe.max_disk_mb). Takes
    # effect only in a new, empty file; older files keep their freed pages for reuse.
    conn.execute("PRAGMA auto_vacuum=INCREMENTAL")
    conn.execute("PRAGMA journal_mode=WAL")
    # After a checkpoint the WAL file is cut back to this size; without it, it keeps
    # the largest size a burst ever gave it (~190 MB in a 40 s soak).
    conn.execute("PRAGMA journal_size_limit=67108864")
    conn.execute("PRAGMA synchronous=NORMAL")
    # Under NORMAL the WAL is synced at each checkpoint: one every 4 MiB of it, as
    # SQLite's default of 1000 pages was with 4 KiB pages, whatever this file's are
    # (larger pages take no more of what a power loss may cost).
    page = conn.execute("PRAGMA page_size").fetchone()[0]
    conn.execute(f"PRAGMA wal_autocheckpoint={(4 << 20) // page}")
    conn.execute("PRAGMA foreign_keys=ON")
    conn.executescript(SCHEMA)
    migrate(conn)
    return conn


T = TypeVar("T")


async def on_io(io: Executor | None, what: str, fn: Callable[..., T], *args: Any) -> T:
    """`fn(*args)` on a store's I/O thread (`io`: a slow disk or a lock wait delays only
    its caller, never the event loop), or in the caller without one (an in-memory
    database). A database that cannot be reached (PostgreSQL down) is 503
    `DatabaseUnavailable` naming `what`, logged: refused, never guessed."""
    try:
        if io is None:
            return fn(*args)
        return await asyncio.get_running_loop().run_in_executor(io, fn, *args)
    except sqlite3.OperationalError as exc:
        logging.getLogger("switchyard").error("store unavailable for %s: %s", what, exc)
        raise DatabaseUnavailable(f"the gateway's database is unavailable ({what})") from None
