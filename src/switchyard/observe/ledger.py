"""The usage ledger: one row per finished request, committed by a writer process.

Rows are group-committed: what finishes within `flush_s` (default 20 ms) of the first
queued row is serialised once, on the caller's thread, and sent down a pipe to the
writer process (`ledger_writer.py`), which commits it in one transaction. A crash
therefore loses the rows of requests still in flight plus at most the last `flush_s`
of finished ones; a row is inserted whole or not at all (with its trace). Committing
each row on its own cost more CPU than serving the request, and a writer thread in
this process made the event loop hand the GIL back and forth with it several times
per request.

Without a running event loop (the CLI, tests) rows wait for `flush()`, `close()` or a
full batch.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import os
import select
import struct
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any

import orjson

from switchyard.observe.db import connect
from switchyard.observe.ledger_writer import BATCH, FLUSH, HEADER, STOP, frame
from switchyard.observe.traces import trace_record
from switchyard.pipeline import RequestContext

log = logging.getLogger("switchyard.ledger")

_MAX_BATCH = 512  # rows per frame
_PIPE_BYTES = 1 << 20  # ~450 traced requests queued before a send would wait
_SEQ = struct.Struct(">Q")


@dataclass(slots=True)
class Finished:
    """A settled request as handed to the ledger."""

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

    def entry(self) -> tuple[tuple[Any, ...], dict[str, Any] | None]:
        """What the writer needs: the usage row, and the trace record when traced."""
        if not self.with_trace:
            return self.usage_row(), None
        usage = {
            "status": self.status,
            "input_tokens": self.input_tokens,
            "output_tokens": self.output_tokens,
            "cost_usd": self.cost_usd,
        }
        return self.usage_row(), trace_record(self.ctx, usage, self.ctx.planned_steps)


def _dumps(entries: list[tuple[tuple[Any, ...], dict[str, Any] | None]]) -> bytes:
    return orjson.dumps(entries, default=str, option=orjson.OPT_SERIALIZE_NUMPY)


def _read(fd: int, n: int) -> bytes | None:
    data = b""
    while len(data) < n:
        chunk = os.read(fd, n - len(data))
        if not chunk:
            return None
        data += chunk
    return data


class UsageLedger:
    def __init__(self, sqlite_path: str, flush_s: float = 0.02) -> None:
        self.path = sqlite_path
        self.flush_s = flush_s
        connect(sqlite_path).close()  # the schema exists before anyone reads
        self._batch: list[Finished] = []
        self._timer: asyncio.TimerHandle | None = None
        self._lock = threading.Lock()  # one sender at a time on the pipe
        self._seq = 0
        self._closed = False
        self._proc = self._spawn()

    def _spawn(self) -> subprocess.Popen[bytes]:
        proc = subprocess.Popen(
            [sys.executable, "-m", "switchyard.observe.ledger_writer", self.path],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )
        assert proc.stdin is not None
        with contextlib.suppress(OSError):  # Linux: room for bursts while it commits
            fcntl.fcntl(proc.stdin.fileno(), 1031, _PIPE_BYTES)  # F_SETPIPE_SZ
        return proc

    def record(self, finished: Finished) -> None:
        """Queue a settled request; its usage row and (optionally) its trace are
        committed in the same transaction."""
        with self._lock:
            self._batch.append(finished)
            first, full = len(self._batch) == 1, len(self._batch) >= _MAX_BATCH
        if full:
            self._send_batch()
        elif first and self.flush_s > 0:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:
                return  # no loop: sent by flush(), close() or a full batch
            self._timer = loop.call_later(self.flush_s, self._send_batch)
        elif first:
            self._send_batch()

    def _send_batch(self) -> None:
        with self._lock:
            batch, self._batch = self._batch, []
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
            if batch:
                # Built here, once per batch, rather than as each request settles: at
                # one client the next request would wait for it.
                self._send(frame(BATCH, _dumps([f.entry() for f in batch])), len(batch))

    def _send(self, data: bytes, rows: int) -> None:
        """Write to the writer (lock held); a writer that died is started again once."""
        for attempt in (1, 2):
            stdin = self._proc.stdin
            try:
                assert stdin is not None
                stdin.write(data)
                stdin.flush()
                return
            except (BrokenPipeError, ValueError, OSError) as exc:
                if self._closed or attempt == 2:
                    log.error("ledger writer unavailable (%s): %d rows lost", exc, rows)
                    return
                log.error("ledger writer exited (%s); starting it again", exc)
                with contextlib.suppress(Exception):
                    self._proc.kill()
                self._proc = self._spawn()

    def flush(self, timeout_s: float = 10.0) -> None:
        """Wait until every row queued before this call is committed."""
        self._send_batch()
        with self._lock:
            self._seq += 1
            seq = self._seq
            self._send(frame(FLUSH, _SEQ.pack(seq)), 0)
            stdout = self._proc.stdout
            assert stdout is not None
            deadline = time.monotonic() + timeout_s
            while True:
                left = deadline - time.monotonic()
                if left <= 0 or not select.select([stdout], [], [], left)[0]:
                    log.warning("ledger flush timed out after %.1f s", timeout_s)
                    return
                ack = _read(stdout.fileno(), HEADER.size + _SEQ.size)
                if ack is None:
                    return  # the writer is gone; its rows were reported when sent
                if _SEQ.unpack(ack[HEADER.size :])[0] >= seq:
                    return

    def close(self) -> None:
        self._send_batch()
        with self._lock:
            self._closed = True
            self._send(frame(STOP), 0)
            with contextlib.suppress(Exception):
                assert self._proc.stdin is not None
                self._proc.stdin.close()
        try:
            self._proc.wait(10)
        except subprocess.TimeoutExpired:
            log.error("ledger writer did not stop; killing it")
            self._proc.kill()
            self._proc.wait(5)
        if self._proc.stdout is not None:
            self._proc.stdout.close()

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
