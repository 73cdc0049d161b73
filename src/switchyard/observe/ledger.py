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
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import fcntl
import logging
import math
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
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import msgspec

from switchyard.observe.db import connect
from switchyard.observe.ledger_writer import BATCH, FLUSH, HEADER, KEY, STOP, frame
from switchyard.observe.pg import is_postgres
from switchyard.observe.traces import LedgerEntry, StoredRow, ledger_entry, template_id
from switchyard.pipeline import RequestContext

log = logging.getLogger("switchyard.ledger")
T = TypeVar("T")

_MAX_BATCH = 512  # rows per frame
_MAX_QUEUED_BYTES = 64 << 20  # batches waiting for a stalled writer (~30k traced rows)
_PIPE_BYTES = 1 << 20
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

    def entry(self) -> LedgerEntry:
        """What the writer needs (traces.LedgerEntry): the writer derives the usage
        row and, when traced, the trace record from it."""
        return ledger_entry(
            self.ctx,
            self.status,
            self.input_tokens,
            self.output_tokens,
            self.cost_usd,
            self.with_trace,
        )


def _json_safe(value: Any) -> Any:
    """What the encoder writes for a type JSON has no form for: a numpy value as its
    list or number, anything else as its str."""
    tolist = getattr(value, "tolist", None)
    return tolist() if callable(tolist) else str(value)


_ENCODER = msgspec.json.Encoder(enc_hook=_json_safe)


class LedgerCounts:
    """Rows the ledger repaired or lost (exported as Prometheus counters)."""

    __slots__ = ("dropped", "repaired")

    def __init__(self) -> None:
        self.dropped = 0
        self.repaired = 0


def _plain(value: Any, depth: int = 0) -> Any:
    """A JSON-safe copy of `value`: integers beyond 64 bits become strings, text is
    made valid UTF-8, nesting past 64 levels and unknown types become their repr."""
    if value is None or isinstance(value, bool | float):
        return value
    if isinstance(value, int):
        return value if -(2**63) <= value < 2**64 else str(value)
    if isinstance(value, str):
        return value.encode("utf-8", "replace").decode("utf-8")
    if depth >= 64:
        return "<nested too deep>"
    if isinstance(value, dict):
        return {str(_plain(k, depth + 1)): _plain(v, depth + 1) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v, depth + 1) for v in value]
    if isinstance(value, msgspec.Struct):  # a Decision: its stored array
        return [_plain(v, depth + 1) for v in msgspec.structs.astuple(value)]
    return repr(value)[:200]


def _repaired(entry: LedgerEntry) -> tuple[bytes, list[str]] | None:
    """The entry encoded with each field that cannot be replaced by a JSON-safe copy
    (`_plain`), and the names of the fields replaced; None if even that fails."""
    changes: dict[str, Any] = {}
    for name in entry.__struct_fields__:
        value = getattr(entry, name)
        try:
            _ENCODER.encode(value)
        except Exception:
            changes[name] = _plain(value)
    try:
        return _ENCODER.encode(msgspec.structs.replace(entry, **changes)), sorted(changes)
    except Exception:
        return None


# A settled request ready for the writer: its entry, encoded, and the ids of the
# block templates it refers to.
Row = tuple[bytes, tuple[str, ...]]


def encoded_row(finished: Finished, counts: LedgerCounts) -> Row | None:
    """The request's row, encoded when it is settled, so the batch holds bytes, not
    the request's context (kept for a whole batch, every request's objects would
    outlive the collector's youngest generation and be scanned again and again).
    A row that cannot be serialised is written with the offending fields replaced by
    JSON-safe copies (logged, counted as repaired), so it still counts against
    budgets; one that cannot be built at all is logged, counted as dropped: None."""
    try:
        entry = finished.entry()
    except Exception:
        counts.dropped += 1
        log.exception(
            "ledger row of %s dropped: it could not be built", finished.ctx.input.request_id
        )
        return None
    try:
        data = _ENCODER.encode(entry)
    except Exception:
        fixed = _repaired(entry)
        if fixed is None:
            counts.dropped += 1
            log.error("ledger row of %s dropped: it could not be serialised", entry.request_id)
            return None
        data = fixed[0]
        counts.repaired += 1
        log.error(
            "ledger row of %s written with fields replaced (not serialisable): %s",
            entry.request_id,
            ", ".join(fixed[1]),
        )
    used = tuple(b[0] for b in finished.ctx.blocks) if finished.with_trace else ()
    return data, used


def batch_json(
    rows: list[Row], templates: dict[str, Any], responses: list[bytes] | None = None
) -> bytes:
    """The batch as one JSON object: `entries` (one array per request), `blocks`
    (the templates of the compact block items those entries hold, by id) and, when
    there are any, `responses` (stored responses, each an encoded `StoredRow`)."""
    used: set[str] = set()
    for _, ids in rows:
        used.update(ids)
    blocks = {i: templates[i] for i in used}
    head = b'{"blocks":' + _ENCODER.encode(blocks) + b',"entries":['
    body = head + b",".join(data for data, _ in rows)
    if responses:
        body += b'],"responses":[' + b",".join(responses)
    return body + b"]}"


def _read(fd: int, n: int) -> bytes | None:
    data = b""
    while len(data) < n:
        chunk = os.read(fd, n - len(data))
        if not chunk:
            return None
        data += chunk
    return data


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
        """Queue a stored response (observe/responses.py, sealed) with the batch being
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
    where: list[str] = []
    args: list[Any] = []
    for column, value in (
        ("tenant_id", tenant_id),
        ("key_id", key_id),
        ("task_id", task_id),
        ("model", model),
        ("status", status),
    ):
        if value is not None:
            where.append(f"{column} = ?")
            args.append(value)
    if since is not None:
        where.append("received_at >= ?")
        args.append(since)
    if before is not None:
        where.append("received_at < ?")
        args.append(before)
    sql = "SELECT * FROM usage"
    if where:
        sql += " WHERE " + " AND ".join(where)
    sql += " ORDER BY received_at DESC LIMIT ?"
    return [dict(r) for r in conn.execute(sql, (*args, limit)).fetchall()]


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
