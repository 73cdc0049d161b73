"""The ledger's writer process: commits batches of usage rows and traces to SQLite.

The gateway serialises each batch once, on its event loop, and writes it down a pipe;
everything after that (parsing, binding, SQLite, the WAL's disk writes) happens here,
in another process. A writer thread in the gateway's own process cost the event loop
more than its share of the CPU: every SQLite call released and re-took the GIL, so the
loop and the writer handed it back and forth several times per request (~3.5 futex
calls per request at one client; none with the ledger off).

Frames on stdin: one kind byte, a 4-byte big-endian length, the payload.
- `B`: a `traces.LedgerBatch` as JSON: `entries`, one `LedgerEntry` (a flat array) per
  request, each made into its usage row and, unless its decisions are null, its trace
  record, all committed in one transaction; `blocks`, the templates of the folded runs
  of decisions those entries refer to (`traces.expand_decisions`); `responses`, the
  stored responses (sealed) made meanwhile, inserted in the same transaction.
- `F`: an 8-byte sequence number: answered on stdout (the same frame) once everything
  before it is committed.
- `K`: the 32-byte key stored responses are sealed with (observe/sealing.py), the
  first frame of a writer whose gateway stores responses.
- `S` (or end of input): commit what came before, then exit.

    python -m switchyard.observe.ledger_writer PATH [MAX_BYTES]

PATH `-` reads the database from SWITCHYARD_LEDGER_DB (a PostgreSQL URI is passed so,
not on the command line, which every user of the machine can read).
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import signal
import sqlite3
import struct
import sys
import time
from typing import Any, BinaryIO

import msgspec

from switchyard.observe.db import connect, is_sqlite
from switchyard.observe.sealing import Sealer
from switchyard.observe.traces import (
    LedgerBatch,
    LedgerEntry,
    StoredRow,
    enforce_disk,
    insert_args,
    trace_from_entry,
)

log = logging.getLogger("switchyard.ledger")

HEADER = struct.Struct(">cI")
BATCH, FLUSH, STOP, KEY = b"B", b"F", b"S", b"K"

USAGE_COLUMNS = (
    "request_id",
    "client_request_id",
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
    "images",  # the media stage's: count, bytes received, pixels before and after
    "image_bytes",
    "image_pixels_in",
    "image_pixels_out",
    "adapter",  # the LoRA adapter that served it, and its revision
    "adapter_revision",
    "placement",  # placement's mode and reason, for an alias with a placement policy
)
TRACE_COLUMNS = (
    "request_id",
    "client_request_id",
    "task_id",
    "tenant_id",
    "status",
    "received_at",
    "record",
)


def _insert(table: str, columns: tuple[str, ...]) -> str:
    marks = ", ".join("?" * len(columns))
    return f"INSERT OR REPLACE INTO {table} ({', '.join(columns)}) VALUES ({marks})"


INSERT_USAGE = _insert("usage", USAGE_COLUMNS)
INSERT_TRACES = _insert("traces", TRACE_COLUMNS)
INSERT_TEMPLATES = "INSERT OR IGNORE INTO trace_templates (id, template) VALUES (?, ?)"
# A response id is 128 random bits: a second insert of one is a frame sent again to a
# restarted writer, never another response, so it is ignored.
INSERT_RESPONSES = (
    "INSERT OR IGNORE INTO responses (tenant_id, id, created_at, status, model, deployment,"
    " previous_response_id, background, owner, body, updated_at)"
    " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"
)
_TEMPLATE = msgspec.json.Encoder(enc_hook=str)
ADD_DAILY = (
    "INSERT INTO usage_daily (day, tenant_id, key_id, model, requests, errors, input_tokens,"
    " output_tokens, cost_usd) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)"
    " ON CONFLICT (day, tenant_id, key_id, model) DO UPDATE SET"
    " requests = usage_daily.requests + excluded.requests,"
    " errors = usage_daily.errors + excluded.errors,"
    " input_tokens = usage_daily.input_tokens + excluded.input_tokens,"
    " output_tokens = usage_daily.output_tokens + excluded.output_tokens,"
    " cost_usd = usage_daily.cost_usd + excluded.cost_usd"
)


def daily_rollups(named: list[LedgerEntry]) -> list[tuple[Any, ...]]:
    """The batch's additions to usage_daily: per UTC day, tenant, key and model."""
    sums: dict[tuple[str, str, str, str], list[Any]] = {}
    days: dict[int, str] = {}
    for e in named:
        at = int(e.received_at // 86400)
        day = days.get(at)
        if day is None:
            day = days[at] = time.strftime("%Y-%m-%d", time.gmtime(at * 86400))
        key = (day, e.tenant_id or "", e.key_id or "", e.requested_model or "")
        acc = sums.get(key)
        if acc is None:
            acc = sums[key] = [0, 0, 0, 0, 0.0]
        acc[0] += 1
        acc[1] += e.status != "ok"
        acc[2] += e.input_tokens or 0
        acc[3] += e.output_tokens or 0
        acc[4] += e.cost_usd or 0.0
    return [(*k, *v) for k, v in sums.items()]


def frame(kind: bytes, payload: bytes = b"") -> bytes:
    return HEADER.pack(kind, len(payload)) + payload


def _read_exactly(stream: BinaryIO, n: int) -> bytes | None:
    data = b""
    while len(data) < n:
        chunk = stream.read(n - len(data))
        if not chunk:
            return None
        data += chunk
    return data


def read_frame(stream: BinaryIO) -> tuple[bytes, bytes] | None:
    """The next frame, or None at the end of the input."""
    head = _read_exactly(stream, HEADER.size)
    if head is None:
        return None
    kind, size = HEADER.unpack(head)
    payload = _read_exactly(stream, size) if size else b""
    if payload is None:
        return None
    return kind, payload


def usage_row(e: LedgerEntry) -> tuple[Any, ...]:
    """The `usage` row (USAGE_COLUMNS) of an entry."""
    received, first, end = e.t_received, e.t_client_first_byte, e.t_ended
    if end is None:
        end = received
    return (
        e.request_id,
        e.client_request_id,
        e.task_id,
        e.tenant_id,
        e.key_id,
        e.endpoint,
        e.requested_model,
        e.revision,
        e.upstream,
        e.input_tokens,
        e.output_tokens,
        e.cost_usd,
        e.cache,
        e.status,
        e.error_code,
        e.attempts,
        e.received_at,
        e.queue_ms,
        (first - received) * 1000 if first else None,
        (end - received) * 1000,
        *(e.images if e.images is not None else (None, None, None, None)),
        *(e.adapter if e.adapter is not None else (None, None)),
        e.placement,
    )


def _sqlite_safe(row: tuple[Any, ...]) -> tuple[Any, ...]:
    """`row` with integers SQLite cannot hold (beyond 64 bits) as text."""
    return tuple(str(v) if isinstance(v, int) and not -(2**63) <= v < 2**63 else v for v in row)


def _sealed(batch: LedgerBatch, sealer: Sealer | None) -> list[tuple[Any, ...]]:
    """The batch's stored responses as `responses` rows, their bodies sealed. Without
    a key (none came down the pipe) none is written: nothing unsealed reaches the disk."""
    if not batch.responses:
        return []
    if sealer is None:
        log.error("%d stored responses dropped: no key to seal them", len(batch.responses))
        return []
    return [
        (
            *(r.tenant_id, r.id, r.created_at, r.status, r.model, r.deployment),
            *(r.previous_response_id, r.background, r.owner),
            sealer.seal_json(r.tenant_id, r.id, bytes(r.body)),
            r.updated_at,
        )
        for r in batch.responses
    ]


def write_batch(conn: sqlite3.Connection, batch: LedgerBatch, sealer: Sealer | None = None) -> bool:
    """Commit one batch: every usage row, trace and stored response (sealed with
    `sealer`), or (after retries) none of them."""
    try:
        entries = batch.entries
        rows = [usage_row(e) for e in entries]
        daily = daily_rollups(entries)
        traces = [insert_args(trace_from_entry(e)) for e in entries if e.decisions is not None]
        templates = [(bid, _TEMPLATE.encode(t).decode()) for bid, t in batch.blocks.items()]
        responses = _sealed(batch, sealer)
    except Exception:  # a malformed batch must not end the writer
        log.exception("dropped a malformed batch of %d entries", len(batch.entries))
        return False
    attempt, outage_until = 0, time.monotonic() + OUTAGE_S
    while True:
        attempt += 1
        try:
            conn.execute("BEGIN IMMEDIATE")
            try:
                conn.executemany(INSERT_USAGE, rows)
                conn.executemany(ADD_DAILY, daily)
                if traces:
                    conn.executemany(INSERT_TEMPLATES, templates)
                    conn.executemany(INSERT_TRACES, traces)
                if responses:
                    conn.executemany(INSERT_RESPONSES, responses)
            except OverflowError:  # a value SQLite cannot bind: keep the rows, as text
                # (PostgreSQL: held at BIGINT's bounds, observe/pg.py)
                safe = getattr(conn, "safe_row", _sqlite_safe)
                if conn.in_transaction:  # PostgreSQL: the failed statement ended it
                    conn.execute("ROLLBACK")
                    conn.execute("BEGIN IMMEDIATE")
                conn.executemany(INSERT_USAGE, [safe(r) for r in rows])
                conn.executemany(ADD_DAILY, [safe(r) for r in daily])
                if traces:
                    conn.executemany(INSERT_TEMPLATES, templates)
                    conn.executemany(INSERT_TRACES, [safe(r) for r in traces])
                if responses:
                    conn.executemany(INSERT_RESPONSES, responses)
            conn.execute("COMMIT")
            return True
        except (sqlite3.Error, OverflowError) as exc:
            with contextlib.suppress(sqlite3.Error):
                if conn.in_transaction:
                    conn.execute("ROLLBACK")
            log.error("ledger write failed (attempt %d): %s", attempt, exc)
            # A database that cannot be reached (PostgreSQL down, SQLite locked) is
            # waited for up to OUTAGE_S; batches queue behind this one meanwhile (the
            # gateway counts what its bounded queue cannot hold). Other errors: 3 tries.
            waiting = isinstance(exc, sqlite3.OperationalError) and time.monotonic() < outage_until
            if attempt >= 3 and not waiting:
                break
            time.sleep(min(1.0, 0.05 * attempt))
    log.error(
        "dropped %d usage rows and %d stored responses after repeated write failures",
        len(rows),
        len(responses),
    )
    return False


class _Responses(msgspec.Struct):
    responses: list[msgspec.Raw] = []


_BATCH = msgspec.json.Decoder(LedgerBatch)
_LOOSE = msgspec.json.Decoder()
_RESPONSES = msgspec.json.Decoder(_Responses)  # each one alone, when the batch failed
_ROW = msgspec.json.Decoder(StoredRow)


def decode_batch(payload: bytes) -> LedgerBatch | None:
    """The batch, validated; when one entry does not fit its type, the others are
    kept (each bad one logged). None when the payload is not a batch at all."""
    try:
        return _BATCH.decode(payload)
    except msgspec.ValidationError:
        pass
    except msgspec.DecodeError:
        log.exception("unreadable ledger batch (%d bytes) dropped", len(payload))
        return None
    try:
        raw = _LOOSE.decode(payload)
        blocks = msgspec.convert(raw["blocks"], dict[str, list[tuple[str, str, str, Any]]])
        entries = []
        for e in raw["entries"]:
            try:
                entries.append(msgspec.convert(e, LedgerEntry))
            except msgspec.ValidationError as exc:
                log.error("ledger row %r dropped: %s", e[0] if e else None, exc)
        responses = []
        try:
            raws = _RESPONSES.decode(payload).responses
        except msgspec.ValidationError as exc:
            log.error("the stored responses of a batch were dropped: %s", exc)
            raws = []
        for r in raws:
            try:
                responses.append(_ROW.decode(r))
            except msgspec.ValidationError as exc:
                log.error("a stored response was dropped: %s", exc)
        return LedgerBatch(blocks, entries, responses)
    except (msgspec.ValidationError, KeyError, TypeError):
        log.exception("unreadable ledger batch (%d bytes) dropped", len(payload))
        return None


# How long a batch waits for a database that cannot be reached before it is dropped.
OUTAGE_S = 30.0
# How often the writer checks the byte budget (observe.max_disk_mb) between batches.
DISK_CHECK_S = 0.5


def serve(path: str, source: BinaryIO, acks: BinaryIO, max_bytes: int = 0) -> None:
    """Commit batches until the end of the input. With `max_bytes`, the writer keeps
    the file under it as it writes (`traces.enforce_disk`, at most every DISK_CHECK_S):
    it is the one process that adds rows, so the budget holds within a fraction of a
    second of load instead of growing until the gateway's next retention pass."""
    conn = connect(path)
    sqlite = is_sqlite(conn)
    sealer: Sealer | None = None
    checked = 0.0
    try:
        while True:
            got = read_frame(source)
            if got is None or got[0] == STOP:
                return
            kind, payload = got
            if kind == BATCH:
                batch = decode_batch(payload)
                if batch is not None:
                    write_batch(conn, batch, sealer)
                now = time.monotonic()
                # PostgreSQL's budget counts rows (COUNT(*)): the gateways' retention
                # pass checks it, every observe.retention_interval_s.
                if max_bytes and sqlite and now - checked >= DISK_CHECK_S:
                    checked = now
                    try:
                        enforce_disk(conn, max_bytes)
                    except sqlite3.Error as exc:  # the next check tries again
                        log.warning("byte budget not enforced: %s", exc)
            elif kind == KEY:
                sealer = Sealer(payload)
            elif kind == FLUSH:
                acks.write(frame(FLUSH, payload))
                acks.flush()
    finally:
        conn.close()


def main() -> None:
    # The writer lives as long as its pipe: Ctrl-C or a SIGTERM sent to the whole
    # process group must not cut it off before the gateway has sent its last batch.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    # A batch parses into a few thousand short-lived lists and dicts, all freed by
    # reference counting once committed; at the default threshold (700) the collector
    # would scan each batch several times while it is being built (measured: a parse
    # cost ~6x its own time). Cycles are rare here (an error's traceback), so the
    # collector runs seldom, over what outlives a batch.
    gc.freeze()
    gc.set_threshold(100_000, 50, 50)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    max_bytes = int(sys.argv[2]) if len(sys.argv) > 2 else 0
    path = sys.argv[1] if sys.argv[1] != "-" else os.environ["SWITCHYARD_LEDGER_DB"]
    serve(path, sys.stdin.buffer, sys.stdout.buffer, max_bytes)


if __name__ == "__main__":
    main()
