"""The rollout store and the revision registry, in the gateway's store (SQLite or
PostgreSQL, the same SQL through state/sql_pg.py).

`rl_revisions` holds every registered revision of an RL-managed model with its state
and the history of its state changes, so revisions survive restarts. `rollouts`
holds one row per sample (its whole record as JSON) for `switchyard rollouts export`.

A record may hold PII the client sent or the model wrote. Before a record is stored
the gateway's PII masker runs over its texts; a record in which it finds any is stored
with masked texts and without its token ids (they would decode to the raw text), and
says so (`pii_masked`). The streamed reply always carries the full record.
"""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Iterable, Iterator
from typing import Any

import orjson


def read_revisions(conn: sqlite3.Connection, alias: str | None = None) -> list[dict[str, Any]]:
    sql = (
        "SELECT alias, revision, kind, path, sha256, state, reason, created_at, updated_at,"
        " history FROM rl_revisions"
    )
    args: tuple[Any, ...] = ()
    if alias is not None:
        sql += " WHERE alias = ?"
        args = (alias,)
    out = []
    for r in conn.execute(sql + " ORDER BY created_at", args):
        out.append(
            {
                "alias": r[0],
                "revision": r[1],
                "kind": r[2],
                "path": r[3],
                "sha256": r[4],
                "state": r[5],
                "reason": r[6],
                "created_at": float(r[7]),
                "updated_at": float(r[8]),
                "history": orjson.loads(r[9]),
            }
        )
    return out


def write_revision(conn: sqlite3.Connection, row: dict[str, Any]) -> None:
    """Insert or update one revision (its state, reason and history)."""
    conn.execute(
        "INSERT INTO rl_revisions (alias, revision, kind, path, sha256, state, reason,"
        " created_at, updated_at, history) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"
        " ON CONFLICT (alias, revision) DO UPDATE SET state = excluded.state,"
        " reason = excluded.reason, updated_at = excluded.updated_at,"
        " history = excluded.history",
        (
            row["alias"],
            row["revision"],
            row["kind"],
            row["path"],
            row["sha256"],
            row["state"],
            row["reason"][:1000],
            row["created_at"],
            row["updated_at"],
            orjson.dumps(row["history"][-200:]).decode(),
        ),
    )


def write_rollouts(conn: sqlite3.Connection, records: Iterable[dict[str, Any]]) -> int:
    """Store records (one transaction); a sample id already stored is kept as it was."""
    rows = [
        (
            r["sample_id"],
            r["request_id"],
            r.get("tenant_id"),
            r["provenance"]["model"],
            r["provenance"]["revision"],
            float(r["finished_at"]),
            orjson.dumps(r).decode(),
        )
        for r in records
    ]
    if not rows:
        return 0
    conn.execute("BEGIN IMMEDIATE")
    try:
        conn.executemany(
            "INSERT INTO rollouts (sample_id, request_id, tenant_id, model, revision,"
            " created_at, record) VALUES (?, ?, ?, ?, ?, ?, ?) ON CONFLICT (sample_id) DO NOTHING",
            rows,
        )
        conn.execute("COMMIT")
    except BaseException:
        conn.execute("ROLLBACK")
        raise
    return len(rows)


def export_rollouts(
    conn: sqlite3.Connection,
    since: float = 0.0,
    model: str | None = None,
    revision: str | None = None,
    tenant_id: str | None = None,
    batch: int = 1000,
) -> Iterator[dict[str, Any]]:
    """Stored records at or after `since`, oldest first, read in pages."""
    after_t, after_id = since, ""
    while True:
        sql = (
            "SELECT sample_id, created_at, record FROM rollouts WHERE"
            " (created_at > ? OR (created_at = ? AND sample_id > ?))"
        )
        args: list[Any] = [after_t, after_t, after_id]
        for column, value in (("model", model), ("revision", revision), ("tenant_id", tenant_id)):
            if value is not None:
                sql += f" AND {column} = ?"
                args.append(value)
        rows = conn.execute(
            sql + " ORDER BY created_at, sample_id LIMIT ?", (*args, batch)
        ).fetchall()
        for r in rows:
            yield orjson.loads(r[2])
        if len(rows) < batch:
            return
        after_t, after_id = float(rows[-1][1]), rows[-1][0]


def enforce_rollout_retention(
    conn: sqlite3.Connection, days: float, now: float | None = None
) -> int:
    cut = (now if now is not None else time.time()) - days * 86400
    cur = conn.execute("DELETE FROM rollouts WHERE created_at < ?", (cut,))
    return int(cur.rowcount or 0)
