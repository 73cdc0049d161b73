"""The ledger's reads: spend since a time, usage rows, tasks and the live summary.

Plain functions over a connection (SQLite, or PostgreSQL through state/sql_pg.py), and
`LedgerReads`, the same reads on whatever connection a ledger's `reading()` lends.
"""

from __future__ import annotations

import contextlib
import math
import sqlite3
import time
from collections.abc import Callable
from typing import Any, TypeVar

from switchyard.state.sql import newest_first

T = TypeVar("T")


class LedgerReads:
    """The reads every ledger offers, over the connection its `reading()` lends."""

    def reading(self) -> contextlib.AbstractContextManager[sqlite3.Connection]:
        raise NotImplementedError

    def spent_since(self, column: str, value: str, since: float) -> float:
        """What a tenant or key spent since `since` (see `spent_since`)."""
        with self.reading() as conn:
            return spent_since(conn, column, value, since)

    def rows(
        self,
        tenant_id: str | None = None,
        key_id: str | None = None,
        task_id: str | None = None,
        limit: int = 100,
        **filters: Any,
    ) -> list[dict[str, Any]]:
        with self.reading() as conn:
            return usage_rows(conn, tenant_id, key_id, task_id, limit, **filters)

    def read(self, fn: Callable[..., T], *args: Any) -> T:
        """`fn(conn, *args)` on a reading connection (the admin API's other reads)."""
        with self.reading() as conn:
            return fn(conn, *args)


def spent_since(conn: sqlite3.Connection, column: str, value: str, since: float) -> float:
    """What a tenant or key spent since `since`. From the daily rollups (the bill,
    which retention never removes) when `since` is a UTC midnight, as budget
    periods start; else from the raw rows."""
    if column not in ("tenant_id", "key_id"):
        raise ValueError(column)
    if since % 86400 == 0:
        day = time.strftime("%Y-%m-%d", time.gmtime(since))
        row = conn.execute(
            f"SELECT COALESCE(SUM(cost_usd), 0) FROM usage_daily WHERE {column} = ? AND day >= ?",
            (value, day),
        ).fetchone()
    else:
        row = conn.execute(
            f"SELECT COALESCE(SUM(cost_usd), 0) FROM usage WHERE {column} = ? AND received_at >= ?",
            (value, since),
        ).fetchone()
    return float(row[0])


def usage_rows(
    conn: sqlite3.Connection,
    tenant_id: str | None = None,
    key_id: str | None = None,
    task_id: str | None = None,
    limit: int = 100,
    model: str | None = None,
    status: str | None = None,
    since: float | None = None,
    before: float | None = None,
) -> list[dict[str, Any]]:
    """Ledger rows, newest first, filtered by tenant, key, task, model and status, at or
    after `since` and strictly before `before` (the next page: the last row's
    received_at)."""
    equal = (
        ("tenant_id", tenant_id),
        ("key_id", key_id),
        ("task_id", task_id),
        ("model", model),
        ("status", status),
    )
    return [dict(r) for r in newest_first(conn, "SELECT * FROM usage", equal, limit, since, before)]


def task_rows(
    conn: sqlite3.Connection,
    tenant_id: str | None = None,
    limit: int = 100,
    before: float | None = None,
) -> list[dict[str, Any]]:
    """Tasks (requests sharing a task id, per tenant), most recently active first."""
    where: list[str] = ["task_id IS NOT NULL"]
    args: list[Any] = []
    if tenant_id is not None:
        where.append("tenant_id = ?")
        args.append(tenant_id)
    sql = (
        "SELECT task_id, tenant_id, COUNT(*) AS requests, MIN(received_at) AS started_at,"
        " MAX(received_at) AS last_at, SUM(input_tokens + output_tokens) AS tokens,"
        " SUM(cost_usd) AS cost_usd, SUM(CASE WHEN status = 'ok' THEN 0 ELSE 1 END) AS errors"
        " FROM usage WHERE " + " AND ".join(where) + " GROUP BY task_id, tenant_id"
    )
    if before is not None:
        sql += " HAVING MAX(received_at) < ?"
        args.append(before)
    sql += " ORDER BY last_at DESC LIMIT ?"
    return [dict(r) for r in conn.execute(sql, (*args, limit)).fetchall()]


def _percentiles(values: list[float]) -> dict[str, float | None]:
    """Nearest-rank p50/p95/p99 (None without values)."""
    xs = sorted(values)
    out: dict[str, float | None] = {}
    for name, q in (("p50", 0.50), ("p95", 0.95), ("p99", 0.99)):
        out[name] = round(xs[max(0, math.ceil(q * len(xs)) - 1)], 3) if xs else None
    return out


def live_summary(conn: sqlite3.Connection, since: float, now: float) -> dict[str, Any]:
    """What the console's live page shows of the ledger: rate, latency and TTFT
    percentiles, errors by code and the cache hit rate, over [since, now)."""
    rows = conn.execute(
        "SELECT status, error_code, cache, ttft_ms, duration_ms FROM usage"
        " WHERE received_at >= ? AND received_at < ?",
        (since, now),
    ).fetchall()
    errors: dict[str, int] = {}
    hits = looked = 0
    for status, code, cache, _, _ in rows:
        if status != "ok":
            errors[code or status] = errors.get(code or status, 0) + 1
        if cache in ("hit-exact", "hit-semantic", "miss", "shadow-hit"):
            looked += 1
            hits += cache in ("hit-exact", "hit-semantic")
    window = max(now - since, 1e-9)
    return {
        "window_s": round(window, 3),
        "requests": len(rows),
        "requests_per_s": round(len(rows) / window, 4),
        "latency_ms": _percentiles([r[4] for r in rows if r[4] is not None]),
        "ttft_ms": _percentiles([r[3] for r in rows if r[3] is not None]),
        "errors": dict(sorted(errors.items())),
        "error_rate": round(sum(errors.values()) / len(rows), 4) if rows else None,
        "cache_lookups": looked,
        "cache_hit_rate": round(hits / looked, 4) if looked else None,
    }
