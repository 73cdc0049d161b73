"""The usage ledger: one row per finished request, committed by a writer process.

Rows are group-committed: what finishes within `flush_s` (default 20 ms) of the first
queued row is serialised once, on the event loop, and written down a pipe to the
writer process (`ledger_writer.py`), which commits it in one transaction. A crash
therefore loses the rows of requests still in flight plus at most the last `flush_s`
of finished ones (and what the pipe held); a row is inserted whole or not at all
(with its trace).

Why a process: a writer thread in this process made the event loop hand the GIL back
and forth with it on every SQLite call (~3.5 futex calls per request). Why a
non-blocking pipe and no thread at all: a pipe write blocks when the writer stalls
(SQLite waits up to 10 s for a lock another connection holds), and the event loop must
never wait for that; a sender thread avoided the wait but brought the GIL handoffs
back (measured: 17 % fewer req/s). So the loop writes what the pipe takes and leaves
the rest to a writability callback. Frames wait in memory while the writer is slow
(up to `_MAX_QUEUED_BYTES`, then they are dropped and logged); a writer that dies is
started again (after a growing pause if it keeps dying) and gets the frame the dead
one had not finished reading.

Without a running event loop (the CLI, tests) rows wait for `flush()`, `close()`, a
full batch or interpreter exit. On the loop, readers that must see every answered
request (admin reads) await `flush_async()`, which never blocks the loop: a writer
held up by an SQLite lock delays only them.

The parts beside it: encoding a settled request's row (ledger_rows.py) and the reads
(ledger_reads.py). Their names used elsewhere are imported from here.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import fcntl
import logging
import os
import select
import sqlite3
import struct
import subprocess
import sys
import threading
import time
import weakref
from collections import deque
from collections.abc import Iterator
from typing import Any

from switchyard.state.ledger_batch import BATCH, FLUSH, HEADER, KEY, STOP, frame
from switchyard.state.ledger_reads import LedgerReads
from switchyard.state.ledger_reads import live_summary as live_summary
from switchyard.state.ledger_reads import spent_since as spent_since
from switchyard.state.ledger_reads import task_rows as task_rows
from switchyard.state.ledger_reads import usage_rows as usage_rows
from switchyard.state.ledger_rows import _ENCODER, Finished, LedgerCounts, Row, encoded_row
from switchyard.state.ledger_rows import batch_json as batch_json
from switchyard.state.sql import connect
from switchyard.state.sql_pg import is_postgres
from switchyard.state.traces import StoredRow, template_id

log = logging.getLogger("switchyard.ledger")

_MAX_BATCH = 512  # rows per frame
_MAX_QUEUED_BYTES = 64 << 20  # batches waiting for a stalled writer (~30k traced rows)
_PIPE_BYTES = 1 << 20
_SEQ = struct.Struct(">Q")


def _read(fd: int, n: int) -> bytes | None:
    data = b""
    while len(data) < n:
        chunk = os.read(fd, n - len(data))
        if not chunk:
            return None
        data += chunk
    return data


class UsageLedger(LedgerReads):
    def __init__(
        self,
        sqlite_path: str,
        flush_s: float = 0.02,
        max_disk_bytes: int = 0,
        seal_key: bytes | None = None,
    ) -> None:
        """`max_disk_bytes` (observe.max_disk_mb): the writer keeps the file under it
        as it writes; 0 = no byte budget. `seal_key`: the key the writer seals stored
        responses with (`store_response`), given to each writer down its pipe."""
        self.path = sqlite_path
        self._seal_key = seal_key
        self.flush_s = flush_s
        self.max_disk_bytes = max_disk_bytes
        connect(sqlite_path).close()  # the schema exists before anyone reads
        # One lock for the batch, the timer and the frames: the event loop and a
        # caller of flush()/close() in another thread may both be here.
        self._lock = threading.RLock()
        self._batch: list[Row] = []
        self._responses: list[bytes] = []  # stored responses for this batch (StoredRow)
        self._batch_flush = 0  # the flush number answered once they are committed
        self._sent = 0  # the last such flush number sent
        # Block templates (see traces.compact_decisions) by id, and ids by their JSON form.
        self._templates: dict[str, Any] = {}
        self._timer: asyncio.TimerHandle | None = None
        self._timer_loop: asyncio.AbstractEventLoop | None = None
        self._frames: deque[tuple[bytes, int]] = deque()  # not yet fully in the pipe
        self._offset = 0  # bytes of the first frame already written
        self._queued = 0  # bytes in _frames
        self._watching: asyncio.AbstractEventLoop | None = None  # loop with add_writer
        self._seq = 0
        self._acked = 0  # the highest flush the writer has answered
        self._resent_for: Any = None  # the dead writer whose flushes were sent again
        self._closed = False
        self._counts = LedgerCounts()  # rows repaired, or lost before the pipe (logged)
        self._stalled = 0  # rows lost to a stalled or failing writer (logged)
        self._failures = 0  # writer deaths in a row, each soon after its start
        self._spawned_at = 0.0
        self._respawn_at = 0.0
        self._proc: subprocess.Popen[bytes] | None = self._spawn()
        ref = weakref.ref(self)
        atexit.register(lambda: (lambda led: led.close() if led is not None else None)(ref()))

    @property
    def dropped(self) -> int:
        """Rows lost before they reached the writer (each one logged)."""
        return self._stalled + self._counts.dropped

    @property
    def queued_bytes(self) -> int:
        """Serialised batches waiting for the writer (it is behind when this grows)."""
        return self._queued

    @property
    def repaired(self) -> int:
        """Rows written with an unserialisable field replaced (each one logged)."""
        return self._counts.repaired

    def _spawn(self) -> subprocess.Popen[bytes]:
        self._spawned_at = time.monotonic()
        pg = is_postgres(self.path)  # a URI goes by the environment, not argv
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "switchyard.observe.ledger_writer",
                "-" if pg else self.path,
                str(self.max_disk_bytes),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env={**os.environ, "SWITCHYARD_LEDGER_DB": self.path} if pg else None,
        )
        assert proc.stdin is not None
        fd = proc.stdin.fileno()
        with contextlib.suppress(OSError):  # Linux: room for bursts while it commits
            fcntl.fcntl(fd, 1031, _PIPE_BYTES)  # F_SETPIPE_SZ
        if self._seal_key is not None:  # its first frame, whole (an empty pipe takes it)
            os.write(fd, frame(KEY, self._seal_key))
        os.set_blocking(fd, False)
        return proc

    def block_id(self, template: list[tuple[str, str, str, Any]]) -> str:
        """The id under which entries refer to a run of decisions (stage, outcome,
        reason, evidence): a hash of its content, so the same template has the same
        id in every process and across restarts (it is stored once)."""
        bid = template_id(template)
        with self._lock:
            self._templates.setdefault(bid, template)
        return bid

    # -- queueing (event loop) --------------------------------------------------------
    def record(self, finished: Finished) -> None:
        """Queue a settled request; its usage row and (optionally) its trace are
        committed in the same transaction."""
        row = encoded_row(finished, self._counts)
        if row is None:
            return
        with self._lock:
            self._batch.append(row)
            full = len(self._batch) >= _MAX_BATCH
            timer_loop = self._timer_loop if self._timer is not None else None
        self._gathered(full, timer_loop)

    def store_response(self, row: StoredRow) -> int:
        """Queue a stored response (state/responses.py, sealed) with the batch being
        gathered: the writer inserts it in that batch's transaction. Returns the flush
        number the writer answers once it is committed (`committed`)."""
        data = _ENCODER.encode(row)
        with self._lock:
            self._responses.append(data)
            if not self._batch_flush:
                self._seq += 1
                self._batch_flush = self._seq
            seq = self._batch_flush
            full = len(self._responses) >= _MAX_BATCH
            timer_loop = self._timer_loop if self._timer is not None else None
        self._gathered(full, timer_loop)
        return seq

    def committed(self, seq: int) -> bool:
        """Whether everything up to flush number `seq` is committed (the writer's
        answers waiting are read, without blocking, once that flush was sent)."""
        if self._acked < seq <= self._sent:
            self._take_acks()
        return self._acked >= seq

    def behind(self) -> bool:
        """The writer is so far behind that rows are about to be dropped."""
        return self._queued > _MAX_QUEUED_BYTES // 2

    def _gathered(self, full: bool, timer_loop: asyncio.AbstractEventLoop | None) -> None:
        """Send the batch if it is full, else see that its timer is set (`timer_loop`:
        the loop of the timer already set, if one is)."""
        if full or self.flush_s <= 0:
            self._send_batch()
            return
        if timer_loop is not None and not timer_loop.is_closed():
            return  # this batch's timer is set
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return  # no loop: sent by flush(), close(), a full batch or exit
        with self._lock:
            self._timer = loop.call_later(self.flush_s, self._send_batch)
            self._timer_loop = loop

    def _send_batch(self) -> None:
        """Serialise the queued rows into one frame and write it. A timer firing for a
        batch that was already sent finds nothing to do."""
        with self._lock:  # held while queued: flush numbers go out in order
            batch, self._batch = self._batch, []
            responses, self._responses = self._responses, []
            seq, self._batch_flush = self._batch_flush, 0
            self._timer = None
            if batch or responses:
                data = frame(BATCH, batch_json(batch, self._templates, responses))
                self._enqueue(data, len(batch) + len(responses))
            if seq:
                self._enqueue(frame(FLUSH, _SEQ.pack(seq)), 0)
                self._sent = seq

    def _enqueue(self, data: bytes, rows: int) -> None:
        with self._lock:
            if rows and self._queued + len(data) > _MAX_QUEUED_BYTES:
                self._stalled += rows
                log.error(
                    "ledger writer is %d MB behind: %d rows dropped (%d so far)",
                    self._queued >> 20,
                    rows,
                    self.dropped,
                )
                return
            self._frames.append((data, rows))
            self._queued += len(data)
        self._pump()

    # -- the pipe ------------------------------------------------------------------------
    def _pump(self) -> None:
        """Write what the pipe takes now, without waiting. What is left is written when
        the pipe is writable again (a callback on the running loop), or by flush()."""
        with self._lock:
            while self._frames:
                proc = self._proc
                if proc is None or proc.poll() is not None:
                    if not self._restart():
                        break
                    continue
                data = self._frames[0][0]
                assert proc.stdin is not None
                try:
                    n = os.write(proc.stdin.fileno(), memoryview(data)[self._offset :])
                except BlockingIOError:
                    break
                except OSError as exc:  # the writer is gone (or going): restart it
                    log.error("ledger writer exited (%s, code %s)", exc, proc.poll())
                    with contextlib.suppress(Exception):
                        proc.kill()
                        proc.wait(5)
                    continue
                self._offset += n
                if self._offset == len(data):
                    self._frames.popleft()
                    self._queued -= len(data)
                    self._offset = 0
            waiting = bool(self._frames) and self._proc is not None
        self._watch(waiting)

    def _watch(self, waiting: bool) -> None:
        """Ask the running loop to call `_pump` when the pipe can take more."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        with self._lock:
            proc = self._proc
            if waiting and proc is not None and proc.stdin is not None:
                if self._watching is None:
                    loop.add_writer(proc.stdin.fileno(), self._pump)
                    self._watching = loop
            elif self._watching is loop and proc is not None and proc.stdin is not None:
                loop.remove_writer(proc.stdin.fileno())
                self._watching = None

    def _restart(self) -> bool:
        """Start a new writer (lock held), after a growing pause when the last one died
        soon after it started. The frame the dead writer was reading goes whole to the
        new one; what the dead writer had read but not committed is lost."""
        now = time.monotonic()
        if self._closed or now < self._respawn_at:
            return False
        old = self._proc
        if old is not None:
            self._proc = None
            with contextlib.suppress(Exception):
                if self._watching is not None and old.stdin is not None:
                    self._watching.remove_writer(old.stdin.fileno())
                old.kill()
                old.wait(5)
            self._watching = None
            self._failures = self._failures + 1 if now - self._spawned_at < 5.0 else 1
            if self._failures > 1:
                pause = min(30.0, 0.1 * 2 ** (self._failures - 1))
                self._respawn_at = now + pause
                log.error("ledger writer keeps exiting; starting it again in %.1f s", pause)
                return False
        self._offset = 0
        try:
            self._proc = self._spawn()
        except OSError as exc:
            log.error("could not start the ledger writer: %s", exc)
            self._respawn_at = now + 1.0
            return False
        log.error("ledger writer started again; rows it had not committed are lost")
        return True

    def _drain(self, deadline: float) -> bool:
        """Write every queued frame, waiting for the pipe (flush, close)."""
        while True:
            self._pump()
            with self._lock:
                if not self._frames:
                    return True
                proc = self._proc
            if time.monotonic() >= deadline:
                return False
            if proc is None or proc.stdin is None:
                time.sleep(0.01)
                continue
            poller = select.poll()
            poller.register(proc.stdin.fileno(), select.POLLOUT)
            poller.poll(100)

    # -- flush and close -------------------------------------------------------------
    def _request_flush(self) -> int:
        """Queue the pending rows and a flush marker; the marker's sequence number."""
        self._send_batch()
        with self._lock:
            self._seq += 1
            seq = self._seq
            self._enqueue(frame(FLUSH, _SEQ.pack(seq)), 0)
            self._sent = seq
        return seq

    def _take_acks(self) -> None:
        """Read the flush answers already waiting, without blocking (each answer is
        one write of 13 bytes: atomic on a pipe). If the writer died before answering,
        the latest flush goes again, once, to its successor."""
        with self._lock:
            proc = self._proc
            if proc is None or proc.stdout is None:
                return
            fd = proc.stdout.fileno()
            poller = select.poll()
            poller.register(fd, select.POLLIN)
            while poller.poll(0):
                ack = _read(fd, HEADER.size + _SEQ.size)
                if ack is None:  # end of the pipe: that writer is gone
                    break
                self._acked = max(self._acked, _SEQ.unpack(ack[HEADER.size :])[0])
            else:
                return
            if self._resent_for is proc or self._acked >= self._seq:
                return
            self._resent_for = proc
            seq = self._seq
        self._enqueue(frame(FLUSH, _SEQ.pack(seq)), 0)

    def flush(self, timeout_s: float = 10.0) -> None:
        """Wait until every row queued before this call is committed (or `timeout_s`).
        Blocking: for threads without an event loop (CLI, tests); a loop awaits
        `flush_async`."""
        deadline = time.monotonic() + timeout_s
        seq = self._request_flush()
        while time.monotonic() < deadline:
            if not self._drain(deadline):
                break
            self._take_acks()
            if self._acked >= seq:
                return
            with self._lock:
                proc = self._proc
            if proc is not None and proc.stdout is not None:
                poller = select.poll()
                poller.register(proc.stdout.fileno(), select.POLLIN)
                poller.poll(100)
        log.warning("ledger flush timed out after %.1f s", timeout_s)

    async def flush_async(self, timeout_s: float = 10.0) -> bool:
        """`flush` for the event loop: waits without blocking it, so a writer held up
        by an SQLite lock delays only the caller (an admin read), not every request.
        The queued frames go out as the pipe takes them (the loop's writer callback).
        True once committed; False on timeout."""
        deadline = time.monotonic() + timeout_s
        seq = self._request_flush()
        pause = 0.001
        while True:
            self._pump()
            self._take_acks()
            if self._acked >= seq:
                return True
            if time.monotonic() >= deadline:
                log.warning("ledger flush timed out after %.1f s", timeout_s)
                return False
            await asyncio.sleep(pause)
            pause = min(pause * 2, 0.02)

    def close(self) -> None:
        if self._closed:
            return
        self._send_batch()
        self._enqueue(frame(STOP), 0)
        drained = self._drain(time.monotonic() + 15)
        self._closed = True
        proc = self._proc
        if proc is None:
            return
        with contextlib.suppress(Exception):
            if self._watching is not None and proc.stdin is not None:
                self._watching.remove_writer(proc.stdin.fileno())
        with contextlib.suppress(Exception):
            assert proc.stdin is not None
            proc.stdin.close()
        if not drained:
            log.error("ledger writer did not take the last rows in time")
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            log.error("ledger writer did not stop; killing it")
            proc.kill()
            proc.wait(5)
        if proc.stdout is not None:
            proc.stdout.close()

    # -- reads (admin, tests, budget seeding) -----------------------------------
    @contextlib.contextmanager
    def reading(self) -> Iterator[sqlite3.Connection]:
        conn = connect(self.path)
        try:
            yield conn
        finally:
            conn.close()
