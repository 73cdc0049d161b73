"""The usage ledger: one row per finished request, committed by a writer process.

Rows are group-committed: what finishes within `flush_s` (default 20 ms) of the first
queued row is serialised once, on the event loop, and handed to a sender thread that
writes it down a pipe to the writer process (`ledger_writer.py`), which commits it in
one transaction. A crash therefore loses the rows of requests still in flight plus at
most the last `flush_s` of finished ones (and what the pipe held); a row is inserted
whole or not at all (with its trace).

Why a process: a writer thread in this process made the event loop hand the GIL back
and forth with it on every SQLite call (~3.5 futex calls per request). Why a sender
thread: a pipe write blocks when the writer stalls (SQLite waits up to 10 s for a lock
another connection holds), and the event loop must never wait for that. The thread
only moves bytes: one wake-up per batch. Batches wait in memory while the writer is
slow (up to `_MAX_QUEUED_BYTES`, then they are dropped and logged); a writer that dies
is started again, with a growing pause if it keeps dying.

Without a running event loop (the CLI, tests) rows wait for `flush()`, `close()`, a
full batch or interpreter exit.
"""

from __future__ import annotations

import asyncio
import atexit
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
import weakref
from collections import deque
from dataclasses import dataclass
from typing import Any

import orjson

from switchyard.observe.db import connect
from switchyard.observe.ledger_writer import BATCH, FLUSH, HEADER, STOP, frame
from switchyard.observe.traces import trace_record
from switchyard.pipeline import RequestContext

log = logging.getLogger("switchyard.ledger")

_MAX_BATCH = 512  # rows per frame
_MAX_QUEUED_BYTES = 64 << 20  # batches waiting for a stalled writer (~30k traced rows)
_PIPE_BYTES = 1 << 20
_SEQ = struct.Struct(">Q")
_STOP_ITEM = (b"", -1)


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


def _batch_json(batch: list[Finished]) -> tuple[bytes, int]:
    """The batch as one JSON array, each request serialised once and on its own: one
    that cannot be built or serialised is logged and left out rather than costing the
    rest of the batch. Returns the array and how many rows it holds."""
    parts = []
    for f in batch:
        try:
            entry = f.entry()
            parts.append(orjson.dumps(entry, default=str, option=orjson.OPT_SERIALIZE_NUMPY))
        except Exception:
            log.exception("ledger row of %s dropped: it could not be built", f.ctx.request_id)
    return b"[" + b",".join(parts) + b"]", len(parts)


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
        self._lock = threading.Lock()  # _batch, _timer, _queued
        self._batch: list[Finished] = []
        self._timer: asyncio.TimerHandle | None = None
        self._timer_loop: asyncio.AbstractEventLoop | None = None
        self._outbox: deque[tuple[bytes, int]] = deque()  # frames for the sender thread
        self._queued = 0  # bytes in the outbox
        self._kick = threading.Event()
        self._flush_lock = threading.Lock()
        self._seq = 0
        self._closed = False
        self.dropped = 0  # rows lost to a stalled or failing writer (logged)
        self._failures = 0  # writer deaths in a row, each soon after its start
        self._spawned_at = 0.0
        self._proc = self._spawn()
        self._sender = threading.Thread(target=self._send_loop, name="ledger-sender", daemon=True)
        self._sender.start()
        ref = weakref.ref(self)
        atexit.register(lambda: (lambda led: led.close() if led is not None else None)(ref()))

    def _spawn(self) -> subprocess.Popen[bytes]:
        self._spawned_at = time.monotonic()
        proc = subprocess.Popen(
            [sys.executable, "-m", "switchyard.observe.ledger_writer", self.path],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )
        assert proc.stdin is not None
        with contextlib.suppress(OSError):  # Linux: room for bursts while it commits
            fcntl.fcntl(proc.stdin.fileno(), 1031, _PIPE_BYTES)  # F_SETPIPE_SZ
        return proc

    # -- the event loop's side ---------------------------------------------------------
    def record(self, finished: Finished) -> None:
        """Queue a settled request; its usage row and (optionally) its trace are
        committed in the same transaction."""
        with self._lock:
            self._batch.append(finished)
            full = len(self._batch) >= _MAX_BATCH
            timed = self._timer is not None
        if full or self.flush_s <= 0:
            self._send_batch()
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return  # no loop: sent by flush(), close(), a full batch or exit
        if timed and self._timer_loop is loop:
            return
        with self._lock:  # first row of a batch, or the timer's loop is gone
            self._timer = loop.call_later(self.flush_s, self._send_batch)
            self._timer_loop = loop

    def _send_batch(self) -> None:
        """Serialise the queued rows into one frame for the sender thread. A timer
        firing for a batch that was already sent finds nothing to do."""
        with self._lock:
            batch, self._batch = self._batch, []
            self._timer = None
        if not batch:
            return
        payload, rows = _batch_json(batch)
        if not rows:
            return
        data = frame(BATCH, payload)
        with self._lock:
            if self._queued + len(data) > _MAX_QUEUED_BYTES:
                self.dropped += rows
                log.error(
                    "ledger writer is %d MB behind: %d rows dropped (%d so far)",
                    self._queued >> 20,
                    rows,
                    self.dropped,
                )
                return
            self._queued += len(data)
            self._outbox.append((data, rows))
        self._kick.set()

    # -- the sender thread ---------------------------------------------------------------
    def _send_loop(self) -> None:
        while True:
            self._kick.wait()
            self._kick.clear()
            while self._outbox:
                data, rows = self._outbox.popleft()
                if rows < 0:  # close()
                    self._write(frame(STOP), 0)
                    with contextlib.suppress(Exception):
                        assert self._proc.stdin is not None
                        self._proc.stdin.close()
                    return
                if rows > 0:  # a batch (flush frames are not counted)
                    with self._lock:
                        self._queued -= len(data)
                self._write(data, rows)

    def _write(self, data: bytes, rows: int) -> None:
        """Write one frame (sender thread); a writer that died is started again, with a
        pause growing to 30 s while it keeps dying, and the frame goes to the new one."""
        while True:
            stdin = self._proc.stdin
            try:
                assert stdin is not None
                stdin.write(data)
                stdin.flush()
                return
            except (BrokenPipeError, ValueError, OSError, AssertionError) as exc:
                if self._closed:
                    self.dropped += rows
                    log.error("ledger writer gone at close (%s): %d rows lost", exc, rows)
                    return
                # A writer that dies within seconds of starting will likely do so again.
                quick = time.monotonic() - self._spawned_at < 5.0
                self._failures = self._failures + 1 if quick else 1
                pause = min(30.0, 0.1 * 2 ** (self._failures - 1)) if self._failures > 1 else 0
                log.error(
                    "ledger writer exited (%s, code %s); rows it had not committed are "
                    "lost; starting it again%s",
                    exc,
                    self._proc.poll(),
                    f" in {pause:.1f} s" if pause else "",
                )
                with contextlib.suppress(Exception):
                    self._proc.kill()
                    self._proc.wait(5)
                time.sleep(pause)
                try:
                    self._proc = self._spawn()
                except OSError as spawn_exc:
                    log.error("could not start the ledger writer: %s", spawn_exc)

    # -- flush and close ---------------------------------------------------------------
    def flush(self, timeout_s: float = 10.0) -> None:
        """Wait until every row queued before this call is committed (or `timeout_s`)."""
        self._send_batch()
        with self._flush_lock:
            self._seq += 1
            seq = self._seq
            self._outbox.append((frame(FLUSH, _SEQ.pack(seq)), 0))
            self._kick.set()
            deadline = time.monotonic() + timeout_s
            while (left := deadline - time.monotonic()) > 0:
                proc = self._proc
                stdout = proc.stdout
                assert stdout is not None
                poller = select.poll()
                poller.register(stdout.fileno(), select.POLLIN)
                if not poller.poll(min(left, 0.2) * 1000):
                    continue  # (the writer may have been replaced meanwhile)
                ack = _read(stdout.fileno(), HEADER.size + _SEQ.size)
                if ack is None:  # that writer is gone; wait for its successor's answer
                    while self._proc is proc and time.monotonic() < deadline:
                        time.sleep(0.01)
                    continue
                if _SEQ.unpack(ack[HEADER.size :])[0] >= seq:
                    return
            log.warning("ledger flush timed out after %.1f s", timeout_s)

    def close(self) -> None:
        if self._closed:
            return
        self._send_batch()
        self._closed = True
        self._outbox.append(_STOP_ITEM)
        self._kick.set()
        self._sender.join(15)
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
