"""Decision traces: one record per request, stored beside its usage row.

A trace keeps what explains a request — its decisions with reasons and evidence,
its timings, what served it and what it cost — and never the prompt or the reply.
Records are kept for `observe.traces_retention_days` and at most
`observe.traces_max_rows`; `enforce_retention` runs in the background.
"""

from __future__ import annotations

import json
import sqlite3
import time
from typing import Any

import orjson

from switchyard.pipeline import RequestContext


def _ms(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else round((b - a) * 1000, 3)


def trace_record(
    ctx: RequestContext, usage: dict[str, Any], planned_steps: int | None
) -> dict[str, Any]:
    """The stored form of a finished request (no bodies)."""
    t = ctx.timings
    p = ctx.principal
    end = t.ended
    upstream_ms = _ms(t.upstream_sent, end) if t.upstream_sent is not None else None
    base = ctx.clock_base
    return {
        "request_id": ctx.request_id,
        "task_id": ctx.task_id,
        "parent_request_ids": ctx.parent_request_ids,
        "tenant_id": p.tenant_id if p is not None else None,
        "key_id": p.key_id if p is not None else None,
        "endpoint": ctx.endpoint,
        "model": ctx.deployment.alias if ctx.deployment is not None else ctx.alias,
        "requested_model": ctx.alias,
        "revision": ctx.model.revision if ctx.model is not None else None,
        "upstream": ctx.deployment.label if ctx.deployment is not None else None,
        "status": usage["status"],
        "error_code": ctx.error_code,
        "attempts": ctx.attempts,
        "input_tokens": usage["input_tokens"],
        "output_tokens": usage["output_tokens"],
        "cost_usd": usage["cost_usd"],
        "cache": ctx.cache,
        "fallback_from": ctx.fallback_from,
        "planned_steps": planned_steps,
        "stream": ctx.stream,
        "received_at": ctx.received_at,
        "timings": {
            "queue_ms": None if ctx.queue_ms is None else round(ctx.queue_ms, 3),
            "upstream_first_byte_ms": _ms(t.received, t.upstream_first_byte),
            "client_first_byte_ms": _ms(t.received, t.client_first_byte),
            "upstream_ms": upstream_ms,
            "duration_ms": _ms(t.received, end),
        },
        # Stored compactly, off the request's thread: [stage, outcome, reason, evidence,
        # t0, t1] with perf_counter times (tuples serialise several times faster than
        # dicts or dataclasses); `expand` gives the documented form on read.
        "clock_base": base,
        "decisions": [
            (d.stage, d.outcome, d.reason, d.evidence, d.t0, d.t1) for d in ctx.decisions
        ],
    }


def expand(record: dict[str, Any]) -> dict[str, Any]:
    """A stored record in its documented form: each decision with `started_at` (unix
    seconds) and `duration_ms`, evidence always an object."""
    base = record.pop("clock_base", None)
    if base is None:
        return record
    record["decisions"] = [
        {
            "stage": stage,
            "outcome": outcome,
            "reason": reason,
            "evidence": evidence if evidence is not None else {},
            "started_at": base + t0,
            "duration_ms": round((t1 - t0) * 1000.0, 3),
        }
        for stage, outcome, reason, evidence, t0, t1 in record.get("decisions") or []
    ]
    return record


def insert_sql() -> str:
    return (
        "INSERT OR REPLACE INTO traces (request_id, task_id, tenant_id, status, received_at, record)"
        " VALUES (?, ?, ?, ?, ?, ?)"
    )


def insert_args(record: dict[str, Any]) -> tuple[Any, ...]:
    return (
        record["request_id"],
        record["task_id"],
        record["tenant_id"],
        record["status"],
        record["received_at"],
        orjson.dumps(record, default=str, option=orjson.OPT_SERIALIZE_NUMPY).decode(),
    )


def get_request(conn: sqlite3.Connection, request_id: str) -> dict[str, Any] | None:
    row = conn.execute("SELECT record FROM traces WHERE request_id = ?", (request_id,)).fetchone()
    return None if row is None else expand(dict(json.loads(row[0])))


def get_task(conn: sqlite3.Connection, task_id: str) -> list[dict[str, Any]]:
    rows = conn.execute(
        "SELECT record FROM traces WHERE task_id = ? ORDER BY received_at", (task_id,)
    ).fetchall()
    return [expand(json.loads(r[0])) for r in rows]


def list_requests(
    conn: sqlite3.Connection,
    tenant_id: str | None = None,
    since: float | None = None,
    status: str | None = None,
    limit: int = 100,
) -> list[dict[str, Any]]:
    where: list[str] = []
    args: list[Any] = []
    if tenant_id is not None:
        where.append("tenant_id = ?")
        args.append(tenant_id)
    if since is not None:
        where.append("received_at >= ?")
        args.append(since)
    if status is not None:
        where.append("status = ?")
        args.append(status)
    sql = "SELECT record FROM traces"
    if where:
        sql += " WHERE " + " AND ".join(where)
    sql += " ORDER BY received_at DESC LIMIT ?"
    rows = conn.execute(sql, (*args, limit)).fetchall()
    out = []
    for (raw,) in rows:
        rec = json.loads(raw)
        rec.pop("decisions", None)  # the list view is a summary
        rec.pop("clock_base", None)
        out.append(rec)
    return out


def enforce_retention(
    conn: sqlite3.Connection, retention_days: float, max_rows: int, now: float | None = None
) -> int:
    """Delete traces older than the retention and beyond the size cap; returns count."""
    now = time.time() if now is None else now
    cur = conn.execute("DELETE FROM traces WHERE received_at < ?", (now - retention_days * 86400,))
    deleted = cur.rowcount
    (count,) = conn.execute("SELECT COUNT(*) FROM traces").fetchone()
    if count > max_rows:
        cur = conn.execute(
            "DELETE FROM traces WHERE request_id IN (SELECT request_id FROM traces"
            " ORDER BY received_at ASC LIMIT ?)",
            (count - max_rows,),
        )
        deleted += cur.rowcount
    return int(deleted)
