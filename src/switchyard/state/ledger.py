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

One writer for several gateway processes (`serve --workers N`, issue 50): the control
plane starts one with `spawn_shared_writer` on a Unix socket, and each worker's ledger
gets `writer_socket` and connects to it instead of starting its own. The loop's side is
the same (non-blocking writes of the same frames, a writability callback, the same
bounded queue and drop count); what differs is what a dead writer costs. Every batch
then carries a flush number, and a frame stays in memory (counted in `queued_bytes`
against the bound) until the writer answers it. If the writer goes (its owner starts
it again: `SharedWriter.restart_if_dead`), the ledger connects again after a growing
pause (`_RECONNECT_S`, doubled per failure up to `_RECONNECT_MAX_S`, back to the start
once a writer answers) and sends every frame not answered, first, as `AGAIN` frames. That loses no row, and duplicates
none: each row is keyed by its request id (unique, 128 random bits), so writing it again
replaces it with itself, and the daily sums add only the rows not already in `usage`
(state/ledger_batch.py). The key for stored responses is the first frame of every
connection, as on a pipe. Without `writer_socket` nothing of this runs.

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
import socket
import sqlite3
import struct
import subprocess
import sys
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from switchyard.state.ledger_batch import (
    AGAIN,
    BATCH,
    FLUSH,
    FLUSHED,
    HEADER,
    KEY,
    READY,
    STOP,
    frame,
)
from switchyard.state.ledger_reads import LedgerReads
from switchyard.state.ledger_reads import live_summary as live_summary
from switchyard.state.ledger_reads import spent_since as spent_since
from switchyard.state.ledger_reads import task_rows as task_rows
from switchyard.state.ledger_reads import usage_rows as usage_rows
from switchyard.state.ledger_rows import (
    _ENCODER,
    Finished,
    LedgerCounts,
    Row,
    batch_parts,
    encoded_row,
)
from switchyard.state.ledger_rows import batch_json as batch_json
from switchyard.state.sql import connect
from switchyard.state.sql_pg import is_postgres
from switchyard.state.traces import LedgerEntry, StoredRow, template_id

log = logging.getLogger("switchyard.ledger")

_MAX_BATCH = 512  # rows per frame
_MAX_QUEUED_BYTES = 64 << 20  # batches waiting for a stalled writer (~30k traced rows)
_PIPE_BYTES = 1 << 20
_SEQ = struct.Struct(">Q")
_ACK = HEADER.size + FLUSHED.size  # a flush's answer (ledger_batch.flushed)
_RECONNECT_S = 0.05  # the first pause before connecting again to a shared writer
_RECONNECT_MAX_S = 2.0
_WRITER = "switchyard.observe.ledger_writer"


def _read(fd: int, n: int) -> bytes | None:
    data = b""
    while len(data) < n:
        chunk = os.read(fd, n - len(data))
        if not chunk:
            return None
        data += chunk
    return data


def _start_shared(
    target: str, socket_path: str, max_disk_bytes: int, timeout_s: float
) -> subprocess.Popen[bytes]:
    """A shared writer process, once it listens (`spawn_shared_writer`)."""
    connect(target).close()  # the schema exists before any gateway reads
    pg = is_postgres(target)
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            _WRITER,
            "--listen",
            socket_path,
            "-" if pg else target,
            str(max_disk_bytes),
        ],
        # Its own session: a terminal's Ctrl-C reaches its owner, which stops the
        # gateways before their writer.
        start_new_session=True,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env={**os.environ, "SWITCHYARD_LEDGER_DB": target} if pg else None,
    )
    assert proc.stdout is not None
    poller = select.poll()
    poller.register(proc.stdout.fileno(), select.POLLIN)
    ready = _read(proc.stdout.fileno(), HEADER.size) if poller.poll(timeout_s * 1000) else None
    if ready is None or ready[:1] != READY:
        _stop_shared(proc, 0.0)
        raise RuntimeError(
            f"the ledger writer did not start listening on {socket_path}"
            f" (exit code {proc.returncode})"
        )
    return proc


def _stop_shared(proc: subprocess.Popen[bytes], timeout_s: float) -> int | None:
    with contextlib.suppress(OSError):
        assert proc.stdin is not None
        proc.stdin.close()
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        log.error("the shared ledger writer did not stop; killing it")
        proc.kill()
        proc.wait(5)
    if proc.stdout is not None:
        proc.stdout.close()
    return proc.returncode


@dataclass(slots=True)
class SharedWriter:
    """The one ledger writer of a host's gateway processes, as its owner (the control
    plane) holds it: `spawn_shared_writer` starts it."""

    target: str
    socket_path: str
    max_disk_bytes: int
    proc: subprocess.Popen[bytes]

    def restart_if_dead(self, timeout_s: float = 30.0) -> bool:
        """Start it again if it has exited (the owner's supervision): the gateways
        connect to the new one and send it what the dead one had not answered. True
        when it was started again."""
        if self.proc.poll() is None:
            return False
        _stop_shared(self.proc, 0.0)  # reaped, its pipes closed
        log.error(
            "the shared ledger writer exited (code %s); starting it again", self.proc.returncode
        )
        self.proc = _start_shared(self.target, self.socket_path, self.max_disk_bytes, timeout_s)
        return True

    def stop(self, timeout_s: float = 10.0) -> int | None:
        """Stop it (after the gateways have closed their ledgers): it commits every
        whole frame it has read, closes its connections and its socket, and exits
        (killed after `timeout_s`). Its exit code."""
        return _stop_shared(self.proc, timeout_s)


def spawn_shared_writer(
    target: str, socket_path: str, max_disk_bytes: int = 0, timeout_s: float = 30.0
) -> SharedWriter:
    """Start the one ledger writer of a host's gateway processes (`serve --workers N`:
    the control plane's; each gateway process's ledger gets `writer_socket=socket_path`).
    It listens on `socket_path` (mode 0600; in the caller's directory; a path under
    ~100 bytes) and commits to `target` (a SQLite path or a PostgreSQL URI, the latter
    passed in its environment), keeping a SQLite file under `max_disk_bytes` (0: no
    budget). Returns once it listens. It lives until `SharedWriter.stop` or until its
    owner exits (its stdin closes)."""
    proc = _start_shared(target, socket_path, max_disk_bytes, timeout_s)
    return SharedWriter(target, socket_path, max_disk_bytes, proc)


class UsageLedger(LedgerReads):
    def __init__(
        self,
        sqlite_path: str,
        flush_s: float = 0.02,
        max_disk_bytes: int = 0,
        seal_key: bytes | None = None,
        writer_socket: str | None = None,
    ) -> None:
        """`max_disk_bytes` (observe.max_disk_mb): the writer keeps the file under it
        as it writes; 0 = no byte budget (a shared writer has its own: its
        `spawn_shared_writer` argument). `seal_key`: the key the writer seals stored
        responses with (`store_response`), given to each writer down its pipe or
        connection. `writer_socket`: a shared writer's socket to connect to instead of
        starting a writer (see the module docstring)."""
        self.path = sqlite_path
        self._writer_socket = writer_socket
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
        # (frame, rows, the flush number that answers it): not yet fully in the pipe
        self._frames: deque[tuple[bytes, int, int]] = deque()
        self._unacked: deque[tuple[bytes, int, int]] = deque()  # shared: sent, unanswered
        self._sock: socket.socket | None = None  # shared: the connection to the writer
        self._inbox = bytearray()  # shared: answers read, not yet whole
        self._retry: asyncio.AbstractEventLoop | None = None  # a loop set to reconnect
        self._offset = 0  # bytes of the first frame already written
        self._queued = 0  # bytes in _frames (and _unacked)
        self._watching: asyncio.AbstractEventLoop | None = None  # loop with add_writer
        self._seq = 0
        self._acked = 0  # the highest flush the writer has answered
        self._writer_lost = 0  # rows the present writer said it dropped (`_answered`)
        self._resent_for: Any = None  # the dead writer whose flushes were sent again
        self._closed = False
        self._counts = LedgerCounts()  # rows repaired, or lost before the pipe (logged)
        self._stalled = 0  # rows lost to a stalled or failing writer (logged)
        self._failures = 0  # writer deaths (failed connections) in a row
        self._spawned_at = 0.0
        self._respawn_at = 0.0
        self._proc: subprocess.Popen[bytes] | None = None
        # Called with each settled request after its row is queued (`record`): a
        # worker's in-flight journal (scale/worker.py `InFlight`).
        self.on_record: Callable[[Finished], None] | None = None
        if writer_socket is None:
            self._proc = self._spawn()
        else:
            self._connect()
        ref = weakref.ref(self)
        atexit.register(lambda: (lambda led: led.close() if led is not None else None)(ref()))

    @property
    def dropped(self) -> int:
        """Rows lost (each one logged): before they reached the writer, or dropped by it
        (the database refused them, `_answered`)."""
        return self._stalled + self._counts.dropped

    @property
    def queued_bytes(self) -> int:
        """Serialised batches waiting for the writer (it is behind when this grows);
        with a shared writer, also those sent and not answered yet."""
        return self._queued

    @property
    def repaired(self) -> int:
        """Rows written with an unserialisable field replaced (each one logged)."""
        return self._counts.repaired

    def _spawn(self) -> subprocess.Popen[bytes]:
        self._spawned_at = time.monotonic()
        self._writer_lost = 0  # a new writer counts from 0
        pg = is_postgres(self.path)  # a URI goes by the environment, not argv
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                _WRITER,
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
        if row is not None:
            self._queue(row)
        if self.on_record is not None:
            self.on_record(finished)

    def record_entry(self, entry: LedgerEntry) -> None:
        """Queue a row that is no request's settle: a dead worker's request, billed by
        the supervisor of `serve --workers N` (scale/workers.py)."""
        self._queue((_ENCODER.encode(entry), ()))

    def _queue(self, row: Row) -> None:
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

    def committed(self, seq: int, read: bool = True) -> bool:
        """Whether everything up to flush number `seq` is committed (the writer's
        answers waiting are read, without blocking, once that flush was sent; with
        `read` False, only the answers already read: no system call)."""
        if read and self._acked < seq <= self._sent:
            self._take_acks()
        return self._acked >= seq

    def queued_flush(self) -> int:
        """The flush number whose answer (`committed`) means every row queued so far
        is committed: the batch being gathered's, else the last one sent (with a shared
        writer every batch has one; a batch to this ledger's own writer has one only
        when a flush follows it, so the next one)."""
        with self._lock:
            if self._batch or self._responses or self._writer_socket is None:
                return self._batch_flush or self._seq + 1
            return self._sent

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
                if not seq and self._writer_socket is not None:  # kept until answered
                    self._seq += 1
                    seq = self._seq
                data = frame(BATCH, *batch_parts(batch, self._templates, responses))
                self._enqueue(data, len(batch) + len(responses), seq)
            if seq:
                self._enqueue(frame(FLUSH, _SEQ.pack(seq)), 0, seq)
                self._sent = seq

    def _enqueue(self, data: bytes, rows: int, seq: int = 0) -> None:
        """Queue a frame (`seq`: the flush number that answers it, with a shared
        writer) and write what the pipe takes."""
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
            self._frames.append((data, rows, seq))
            self._queued += len(data)
        self._pump()

    # -- the pipe ------------------------------------------------------------------------
    def _pump(self) -> None:
        """Write what the pipe takes now, without waiting. What is left is written when
        the pipe is writable again (a callback on the running loop), or by flush()."""
        with self._lock:
            if self._writer_socket is None:
                self._pump_pipe()
            else:
                self._pump_socket()
            waiting = bool(self._frames) and self._out_fd() is not None
        self._watch(waiting)

    def _pump_pipe(self) -> None:
        """`_pump` for this ledger's own writer (lock held)."""
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

    def _watch(self, waiting: bool) -> None:
        """Ask the running loop to call `_pump` when the pipe can take more."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        with self._lock:
            fd = self._out_fd()
            if waiting and fd is not None:
                if self._watching is None:
                    loop.add_writer(fd, self._pump)
                    self._watching = loop
            elif self._watching is loop and fd is not None:
                loop.remove_writer(fd)
                self._watching = None
            if (
                self._writer_socket is not None
                and fd is None
                and self._frames
                and self._retry is not loop
                and not self._closed
            ):
                # A shared writer to connect to again: frames must not wait for traffic.
                delay = max(0.0, self._respawn_at - time.monotonic())
                loop.call_later(delay, self._retried)
                self._retry = loop

    def _retried(self) -> None:
        self._retry = None
        self._pump()

    def _out_fd(self) -> int | None:
        """The descriptor frames are written to, if the writer is there."""
        if self._sock is not None:
            return self._sock.fileno()
        proc = self._proc
        if proc is not None and proc.stdin is not None:
            return proc.stdin.fileno()
        return None

    def _in_fd(self) -> int | None:
        """The descriptor the writer's answers come on, if the writer is there."""
        if self._sock is not None:
            return self._sock.fileno()
        proc = self._proc
        if proc is not None and proc.stdout is not None:
            return proc.stdout.fileno()
        return None

    # -- the shared writer's connection (writer_socket) ------------------------------
    def _connect(self) -> bool:
        """Connect to the shared writer (lock held), unless in the pause after a failure.
        The key goes first, then every frame the last writer did not answer."""
        now = time.monotonic()
        if self._closed or now < self._respawn_at:
            return False
        assert self._writer_socket is not None
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, _PIPE_BYTES)
            sock.setblocking(False)
            sock.connect(self._writer_socket)
        except OSError as exc:
            sock.close()
            self._pause(f"cannot connect to the ledger writer at {self._writer_socket}: {exc}")
            return False
        self._sock = sock
        self._writer_lost = 0  # a new connection: counted from 0 by the writer
        if self._seal_key is not None:
            key = frame(KEY, self._seal_key)
            self._frames.appendleft((key, 0, 0))
            self._queued += len(key)
        return True

    def _pause(self, why: str) -> None:
        """The growing pause before the next connection (lock held)."""
        self._failures += 1
        pause = min(_RECONNECT_MAX_S, _RECONNECT_S * 2 ** (self._failures - 1))
        self._respawn_at = time.monotonic() + pause
        if self._failures == 1 or pause == _RECONNECT_MAX_S:
            log.error("%s; trying again in %.2f s", why, pause)

    def _pump_socket(self) -> None:
        """`_pump` for a shared writer (lock held): take its answers, then write what
        the connection takes now; a frame written whole waits for its answer."""
        self._read_acks()
        while self._frames:
            sock = self._sock
            if sock is None:
                if not self._connect():
                    return
                continue
            data = self._frames[0][0]
            try:
                n = sock.send(memoryview(data)[self._offset :], socket.MSG_NOSIGNAL)
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                self._lost(str(exc))
                continue
            self._offset += n
            if self._offset == len(data):
                self._unacked.append(self._frames.popleft())
                self._offset = 0

    def _read_acks(self) -> None:
        """Read the shared writer's answers waiting, without blocking, and let go of
        the frames they answer (lock held). The end of the connection: `_lost`."""
        sock = self._sock
        if sock is None:
            return
        ended: str | None = None
        while True:
            try:
                chunk = sock.recv(1 << 16)
            except (BlockingIOError, InterruptedError):
                break
            except OSError as exc:
                ended = str(exc)
                break
            if not chunk:
                ended = "the ledger writer closed the connection"
                break
            self._inbox += chunk
        whole = len(self._inbox) - len(self._inbox) % _ACK
        if whole:
            for at in range(HEADER.size, whole, _ACK):
                self._answered(*FLUSHED.unpack_from(self._inbox, at))
            del self._inbox[:whole]
            self._failures = 0  # a writer that answers: the next failure pauses briefly
            while self._unacked and self._unacked[0][2] <= self._acked:
                self._queued -= len(self._unacked.popleft()[0])
        if ended is not None:
            self._lost(ended)

    def _answered(self, seq: int, lost: int) -> None:
        """A flush's answer (lock held): flushes up to `seq` committed, and `lost`
        rows dropped by the writer so far (the database refused them: logged there),
        counted as dropped here, where /metrics reads them."""
        self._acked = max(self._acked, seq)
        if lost > self._writer_lost:
            self._counts.dropped += lost - self._writer_lost
            self._writer_lost = lost

    def _lost(self, why: str) -> None:
        """The shared writer is gone (lock held): what it had not answered goes again,
        first and whole, to the next one; a batch as `AGAIN` (it may have committed it)."""
        sock, self._sock = self._sock, None
        assert sock is not None
        if self._watching is not None:
            with contextlib.suppress(Exception):
                self._watching.remove_writer(sock.fileno())
            self._watching = None
        sock.close()
        self._inbox.clear()
        self._offset = 0
        again: list[tuple[bytes, int, int]] = []
        for data, rows, seq in self._unacked:
            kind = data[:1]
            if kind == KEY:  # the next connection gets its own
                self._queued -= len(data)
            else:
                again.append((AGAIN + data[1:] if kind == BATCH else data, rows, seq))
        self._unacked.clear()
        self._frames.extendleft(reversed(again))
        self._pause(f"lost the ledger writer ({why}); {len(again)} frames to send again")

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
                fd = self._out_fd()
            if time.monotonic() >= deadline:
                return False
            if fd is None:
                time.sleep(0.01)
                continue
            poller = select.poll()
            poller.register(fd, select.POLLOUT)
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
        the latest flush goes again, once, to its successor. (A shared writer's
        answers: `_read_acks`.)"""
        with self._lock:
            if self._writer_socket is not None:
                self._read_acks()
                return
            proc = self._proc
            if proc is None or proc.stdout is None:
                return
            fd = proc.stdout.fileno()
            poller = select.poll()
            poller.register(fd, select.POLLIN)
            while poller.poll(0):
                ack = _read(fd, _ACK)
                if ack is None:  # end of the pipe: that writer is gone
                    break
                self._answered(*FLUSHED.unpack_from(ack, HEADER.size))
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
                fd = self._in_fd()
            if fd is not None:
                poller = select.poll()
                poller.register(fd, select.POLLIN)
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
        """Commit what is queued and stop (this ledger's own writer; a shared one is
        only disconnected from: its owner stops it)."""
        if self._closed:
            return
        if self._writer_socket is not None:
            self._disconnect()
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

    def _disconnect(self) -> None:
        self.flush(15.0)
        with self._lock:
            self._closed = True
            if self._frames or self._unacked:
                log.error(
                    "the ledger writer did not commit the last rows in time (%d bytes lost)",
                    self._queued,
                )
            sock, self._sock = self._sock, None
            if sock is not None:
                if self._watching is not None:
                    with contextlib.suppress(Exception):
                        self._watching.remove_writer(sock.fileno())
                    self._watching = None
                sock.close()

    # -- reads (admin, tests, budget seeding) -----------------------------------
    @contextlib.contextmanager
    def reading(self) -> Iterator[sqlite3.Connection]:
        conn = connect(self.path)
        try:
            yield conn
        finally:
            conn.close()
