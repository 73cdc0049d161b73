"""The usage ledger: one row per finished request, written by one background thread.

Rows are group-committed: the writer collects what finishes within `flush_s`
(default 20 ms) of the first queued row and commits it in one transaction. A crash
therefore loses the rows of requests still in flight plus at most the last
`flush_s` of finished ones; a row is inserted whole or not at all (with its trace).
Committing each row on its own cost more CPU than serving the request.
"""

from __future__ import annotations

import logging
import sqlite3
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

import orjson

from switchyard.observe.db import connect
from switchyard.observe.traces import insert_args, trace_record
from switchyard.pipeline import RequestContext

log = logging.getLogger("switchyard.ledger")


_COLUMNS = (
    "request_id",
    "task_id",
    "tenant_id",
    "key_id",
    "endpoint",
    "model",
    "revision",
    "upstream",
    "input_tokens",
    "output_tokens",
    "cost_usd",
    "cache",
    "status",  # ok | error | incomplete | cancelled
    "error_code",
    "attempts",
    "received_at",
    "queue_ms",
    "ttft_ms",
    "duration_ms",
)


@dataclass(slots=True)
class Finished:
    """A settled request as handed to the ledger. The usage row and the trace are
    built from it on the ledger's thread, so the request's own path only queues it.
    The context is no longer written to once it is settled."""

    ctx: RequestContext
    status: str
    input_tokens: int
    output_tokens: int
    cost_usd: float
    with_trace: bool = True

    def usage_row(self) -> tuple[Any, ...]:
        ctx, t, p = self.ctx, self.ctx.timings, self.ctx.principal
        end = t.ended if t.ended is not None else t.received
        return (
            ctx.request_id,
            ctx.task_id,
            p.tenant_id if p is not None else None,
            p.key_id if p is not None else None,
            ctx.endpoint,
            ctx.alias,
            ctx.model.revision if ctx.model is not None else None,
            ctx.deployment.label if ctx.deployment is not None else None,
            self.input_tokens,
            self.output_tokens,
            self.cost_usd,
            ctx.cache,
            self.status,
            ctx.error_code,
            ctx.attempts,
            ctx.received_at,
            ctx.queue_ms,
            (t.client_first_byte - t.received) * 1000 if t.client_first_byte else None,
            (end - t.received) * 1000,
        )

    def trace_args(self) -> tuple[Any, ...]:
        """The trace as insert arguments for `traces`."""
        usage = {
            "status": self.status,
            "input_tokens": self.input_tokens,
            "output_tokens": self.output_tokens,
            "cost_usd": self.cost_usd,
        }
        return insert_args(trace_record(self.ctx, usage, self.ctx.planned_steps))


def _batch_insert(table: str, columns: tuple[str, ...]) -> str:
    """One statement for a whole batch: the rows arrive as one JSON array and SQLite
    unpacks them. sqlite3 releases the GIL around every statement step, so executemany
    (a step per row) meant a GIL handoff with the busy event loop for every row; this
    is one per batch. It costs the writer a little more CPU and the loop less
    (measured: ~10 % less event-loop CPU per request at 32 concurrent requests)."""
    picks = ", ".join(f"value->>{i}" for i in range(len(columns)))
    return f"INSERT OR REPLACE INTO {table} ({', '.join(columns)}) SELECT {picks} FROM json_each(?)"


_INSERT_USAGE = _batch_insert("usage", _COLUMNS)
_INSERT_TRACES = _batch_insert(
    "traces", ("request_id", "task_id", "tenant_id", "status", "received_at", "record")
)
_STOP = object()


def _json(rows: list[tuple[Any, ...]]) -> str:
    return orjson.dumps(rows, default=str, option=orjson.OPT_SERIALIZE_NUMPY).decode()


class UsageLedger:
    def __init__(self, sqlite_path: str, flush_s: float = 0.02) -> None:
        self.path = sqlite_path
        self.flush_s = flush_s
        # A deque and a wake-up event rather than queue.Queue: appending is one atomic
        # call with no lock, and the event is only set when the writer sleeps.
        self._pending: deque[Any] = deque()
        self._wake = threading.Event()  # rows are waiting
        self._urgent = threading.Event()  # a flush or close wants them now
        self._conn = connect(sqlite_path)
        self._written = 0
        self._thread = threading.Thread(target=self._run, name="usage-ledger", daemon=True)
        self._thread.start()

    def record(self, finished: Finished) -> None:
        """Queue a settled request; its usage row and (optionally) its trace are
        committed in the same transaction."""
        self._pending.append(finished)
        if not self._wake.is_set():
            self._wake.set()

    def flush(self, timeout_s: float = 10.0) -> None:
        """Wait until every row queued before this call is committed."""
        done = threading.Event()
        self._pending.append(done)
        self._urgent.set()
        self._wake.set()
        done.wait(timeout_s)

    def close(self) -> None:
        self._pending.append(_STOP)
        self._urgent.set()
        self._wake.set()
        self._thread.join(10)
        self._conn.close()

    def _run(self) -> None:
        pending = self._pending
        while True:
            # Idle until the first row arrives, then linger `flush_s` so that rows
            # finishing meanwhile share the commit. Rows do not wake the writer while
            # it lingers (that would be a thread switch per request); only a flush or
            # close cuts the wait short.
            self._wake.wait()
            if self.flush_s > 0 and not self._urgent.is_set():
                self._urgent.wait(self.flush_s)
            self._wake.clear()
            self._urgent.clear()
            batch: list[Finished] = []
            events: list[threading.Event] = []
            stop = False
            while pending:
                item = pending.popleft()
                if item is _STOP:
                    stop = True
                elif isinstance(item, threading.Event):
                    events.append(item)
                else:
                    batch.append(item)
            for i in range(0, len(batch), 512):
                self._write(batch[i : i + 512])
            for e in events:
                e.set()
            if stop:
                return
            if pending:
                self._wake.set()  # arrived while writing: go round again

    def _write(self, batch: list[Finished]) -> None:
        try:
            rows = [f.usage_row() for f in batch]
            traces = [f.trace_args() for f in batch if f.with_trace]
        except Exception:  # a bug here must not kill the writer thread
            log.exception("could not build %d ledger rows", len(batch))
            return
        for attempt in range(3):
            try:
                self._conn.execute("BEGIN IMMEDIATE")
                self._conn.execute(_INSERT_USAGE, (_json(rows),))
                if traces:
                    self._conn.execute(_INSERT_TRACES, (_json(traces),))
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
