"""The gateway's database: schema, migrations, connections:
moved to state/sql.py; this module keeps the old import path."""

from switchyard.state.sql import (
    BACKFILL_DAILY,
    IDEMPOTENCY_SCHEMA,
    LATE_INDEXES,
    MIGRATIONS,
    RESPONSES_SCHEMA,
    SCHEMA,
    USAGE_DAILY,
    _add_rollups,
    _has_table,
    connect,
    is_sqlite,
    migrate,
    newest_first,
    on_io,
    resolve_path,
)

__all__ = [
    "BACKFILL_DAILY",
    "IDEMPOTENCY_SCHEMA",
    "LATE_INDEXES",
    "MIGRATIONS",
    "RESPONSES_SCHEMA",
    "SCHEMA",
    "USAGE_DAILY",
    "_add_rollups",
    "_has_table",
    "connect",
    "is_sqlite",
    "migrate",
    "newest_first",
    "on_io",
    "resolve_path",
]
