"""The usage ledger: one row per finished request, written by one background thread.

Rows are group-committed: the writer collects what finishes within `flush_s`
(default 20 ms) of the first queued row and commits it in one transaction. A crash
therefore loses the rows of requests still in flight plus at most the last
`flush_s` of finished ones; a row is inserted whole or not at all (with its trace).
Committing each row on its own cost more CPU than serving the request.
"""

from __future__ import annotations

import logging
import queue
import sqlite3
import threading
import time
from dataclasses import dataclass, fields
from typing import Any

from switchyard.observe.db import connect
from switchyard.observe.traces import insert_args, insert_sql

log = logging.getLogger("switchyard.ledger")


@dataclass(slots=True)
class UsageRow:
    request_id: str
    task_id: str | None
    tenant_id: str | None
    key_id: str | None
    endpoint: str
    model: str | None
    revision: str | None
    upstream: str | None
    input_tokens: int
    output_tokens: int
    cost_usd: float
    cache: str | None
    status: str  # ok | error | incomplete | cancelled
    error_code: str | None
    attempts: int
    received_at: float
    queue_ms: float | None
    ttft_ms: float | None
    duration_ms: float | None


_COLUMNS = [f.name for f in fields(UsageRow)]


def _row_tuple(r: UsageRow) -> tuple[Any, ...]:
    # Not dataclasses.astuple: that deep-copies every field, on the hot thread.
    return tuple(getattr(r, c) for c in _COLUMNS)


_INSERT = (
    f"INSERT OR REPLACE INTO usage ({', '.join(_COLUMNS)}) "
    f"VALUES ({', '.join('?' for _ in _COLUMNS)})"
)
_STOP = object()


class UsageLedger:
    def __init__(self, sqlite_path: str, flush_s: float = 0.02) -> None:
        self.path = sqlite_path
        self.flush_s = flush_s
        self._queue: queue.Queue[Any] = queue.Queue()
        self._conn = connect(sqlite_path)
        self._written = 0
        self._thread = threading.Thread(target=self._run, name="usage-ledger", daemon=True)
        self._thread.start()

    def record(self, row: UsageRow, trace: dict[str, Any] | None = None) -> None:
        """Queue a finished request's usage row and (optionally) its trace; both are
        committed in the same transaction."""
        self._queue.put((row, trace))

    def flush(self, timeout_s: float = 10.0) -> None:
        """Wait until every row queued before this call is committed."""
        done = threading.Event()
        self._queue.put(done)
        done.wait(timeout_s)

    def close(self) -> None:
        self._queue.put(_STOP)
        self._thread.join(10)
        self._conn.close()

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            batch: list[tuple[UsageRow, dict[str, Any] | None]] = []
            events: list[threading.Event] = []
            stop = False
            # Group commit: collect what arrives within `flush_s` of the first row (a
            # commit per row costs more than the row); a flush request ends the wait.
            linger_until = time.monotonic() + self.flush_s
            while True:
                if item is _STOP:
                    stop = True
                elif isinstance(item, threading.Event):
                    events.append(item)
                else:
                    batch.append(item)
                if stop or events or len(batch) >= 512:
                    try:
                        item = self._queue.get_nowait()
                    except queue.Empty:
                        break
                    continue
                remaining = linger_until - time.monotonic()
                try:
                    item = (
                        self._queue.get(timeout=remaining)
                        if remaining > 0
                        else self._queue.get_nowait()
                    )
                except queue.Empty:
                    break
            if batch:
                self._write(batch)
            for e in events:
                e.set()
            if stop:
                return

    def _write(self, batch: list[tuple[UsageRow, dict[str, Any] | None]]) -> None:
        for attempt in range(3):
            try:
                self._conn.execute("BEGIN IMMEDIATE")
                self._conn.executemany(_INSERT, [_row_tuple(r) for r, _ in batch])
                traces = [insert_args(t) for _, t in batch if t is not None]
                if traces:
                    self._conn.executemany(insert_sql(), traces)
                self._conn.execute("COMMIT")
                self._written += len(batch)
                return
            except sqlite3.Error as exc:
                if self._conn.in_transaction:
                    self._conn.execute("ROLLBACK")
                log.error("ledger write failed (attempt %d): %s", attempt + 1, exc)
                time.sleep(0.05 * (attempt + 1))
        log.error("dropped %d usage rows after repeated write failures", len(batch))

    # -- reads (admin, tests, budget seeding) -----------------------------------
    def spent_since(self, column: str, value: str, since: float) -> float:
        if column not in ("tenant_id", "key_id"):
            raise ValueError(column)
        conn = connect(self.path)
        try:
            row = conn.execute(
                f"SELECT COALESCE(SUM(cost_usd), 0) FROM usage WHERE {column} = ? AND received_at >= ?",
                (value, since),
            ).fetchone()
            return float(row[0])
        finally:
            conn.close()

    def rows(
        self,
        tenant_id: str | None = None,
        key_id: str | None = None,
        task_id: str | None = None,
        limit: int = 100,
    ) -> list[dict[str, Any]]:
        where, args = [], []
        for column, value in (("tenant_id", tenant_id), ("key_id", key_id), ("task_id", task_id)):
            if value is not None:
                where.append(f"{column} = ?")
                args.append(value)
        sql = "SELECT * FROM usage"
        if where:
            sql += " WHERE " + " AND ".join(where)
        sql += " ORDER BY received_at DESC LIMIT ?"
        conn = connect(self.path)
        try:
            return [dict(r) for r in conn.execute(sql, (*args, limit)).fetchall()]
        finally:
            conn.close()
