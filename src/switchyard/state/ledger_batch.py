"""The ledger's batches: the frames the gateway sends its writer process, the rows they
decode to, and `write_batch`, which commits one batch (by the writer process,
observe/ledger_writer.py, or in the caller for the in-memory store).

A batch may reach the database twice: a gateway connected to a shared writer (state/
ledger.py, `writer_socket`) sends what the writer had not answered again, as `AGAIN`,
to the writer that replaces a dead one, and the dead one may have committed it before it
died. Every row is keyed by the gateway's own request id (128 random bits), so the rows
themselves are idempotent (`INSERT OR REPLACE` usage and traces, `INSERT OR IGNORE`
templates and stored responses); the one sum, `usage_daily`, adds only the entries of an
`AGAIN` batch whose request id is not in `usage` yet, checked inside the batch's own
transaction.

A row with error `worker_exited` (`LOST`) is written by the supervisor of `serve
--workers N` for a request whose worker died before its own row was committed, as far
as the supervisor can tell (scale/workers.py): the worker's own row may reach the
writer all the same (sent before the worker died, or committed before its answer was
read). So such a row is written only where the request has no row yet: it never
replaces one, nor adds to the daily sums twice. In the other order, the request's own
row replaces it and the daily sums get back what it had added. The writer knows which
rows those may be from the `LOST` rows it wrote lately (`_LOST_WRITTEN`), so a batch
costs one query more only when it holds such a request; an `AGAIN` batch, whose rows
are all looked up anyway, finds them whoever wrote them.
"""

from __future__ import annotations

import contextlib
import logging
import math
import sqlite3
import struct
import time
from collections.abc import Iterable
from typing import Any, BinaryIO

import msgspec

from switchyard.state.sealing import Sealer
from switchyard.state.traces import (
    LedgerBatch,
    LedgerEntry,
    StoredRow,
    WriterBatch,
    insert_args,
    trace_from_entry,
)

log = logging.getLogger("switchyard.ledger")

# How long a batch waits for a database that cannot be reached before it is dropped.
OUTAGE_S = 30.0

HEADER = struct.Struct(">cI")
BATCH, FLUSH, STOP, KEY = b"B", b"F", b"S", b"K"
AGAIN = b"A"  # a batch sent again to a new writer: the old one may have committed it
LOST = "worker_exited"  # the error of a row written for a dead worker's request
# Request ids of the LOST rows this process wrote lately, oldest first: the request's
# own row, should it come later, takes back what they added to the daily sums. Module
# state: `write_batch` is given the connection alone (a sqlite3 connection takes no
# attribute), and one process writes one database (observe/ledger_writer.py).
_LOST_WRITTEN: dict[str, None] = {}
_LOST_KEPT = 100_000
READY = b"R"  # a shared writer to its owner: listening

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
# A response id holds 80 random bits per millisecond: a second insert of one is a frame
# sent again to a restarted writer, never another response, so it is ignored.
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


def daily_rollups(named: Iterable[LedgerEntry]) -> list[tuple[Any, ...]]:
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


def frame(kind: bytes, *payload: bytes) -> bytes:
    """A frame whose payload is the pieces `payload`, joined (a batch's: in one copy)."""
    return b"".join((HEADER.pack(kind, sum(map(len, payload))), *payload))


def _read_exactly(stream: BinaryIO, n: int) -> bytes | None:
    data = b""
    while len(data) < n:
        chunk = stream.read(n - len(data))
        if not chunk:
            return None
        data += chunk
    return data


# A flush's answer (`F`): the flush number the gateway sent, then how many of its rows
# the writer has dropped so far on this connection (`DROPPED`), each a big-endian u64.
FLUSHED = struct.Struct(">QQ")


def flushed(payload: bytes, lost: int) -> bytes:
    """The answer's payload to a flush whose payload was `payload` (its number)."""
    return payload[:8] + FLUSHED.pack(0, lost)[8:]


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


def _existing(conn: sqlite3.Connection, request_ids: list[str]) -> dict[str, Any]:
    """Which of `request_ids` already have a usage row: for each, None when it is the
    request's own row, else (a `LOST` row) what it added to usage_daily, negated."""
    found: dict[str, Any] = {}
    for i in range(0, len(request_ids), 500):  # well under SQLite's bound variables
        part = request_ids[i : i + 500]
        sql = _EXISTING.format(", ".join("?" * len(part)))
        for rid, error, at, tenant, key, model, status, tin, tout, cost in conn.execute(sql, part):
            if error != LOST:
                found[rid] = None
                continue
            day = time.strftime("%Y-%m-%d", time.gmtime(int(at // 86400) * 86400))
            errors = -1 if status != "ok" else 0
            found[rid] = (
                *(day, tenant or "", key or "", model or "", -1, errors),
                *(-(tin or 0), -(tout or 0), -(cost or 0.0)),
            )
    return found


_EXISTING = (
    "SELECT request_id, error_code, received_at, tenant_id, key_id, model, status,"
    " input_tokens, output_tokens, cost_usd FROM usage WHERE request_id IN ({})"
)


def _scrubbed(row: tuple[Any, ...]) -> tuple[Any, ...]:
    """`row` with what no store holds made storable: a NUL in text becomes U+FFFD (the
    replacement character), a float that is no number (NaN, infinity) 0.0, an integer
    beyond 64 bits is held at BIGINT's bounds."""
    return tuple(_storable(v) for v in row)


def _storable(v: Any) -> Any:
    if v.__class__ is str:
        return v.replace("\x00", "\ufffd")
    if v.__class__ is float and not math.isfinite(v):
        return 0.0
    if v.__class__ is int and not -_BIGINT <= v <= _BIGINT:
        return _BIGINT if v > 0 else -_BIGINT
    return v


_BIGINT = 2**63 - 1


def _isolated(
    conn: sqlite3.Connection,
    batch: LedgerBatch,
    sealer: Sealer | None,
    again: bool,
    scrub: bool,
    exc: Exception,
) -> bool:
    """A batch the database refused for one of its values (not an outage): each row
    (with its trace) and each stored response is committed alone, so one bad value
    loses no other request's row; a row refused alone is written again with its
    values made storable (`_scrubbed`), and one refused even then is dropped, counted
    in `DROPPED` and logged by its request id, never its content. True when every row
    was kept."""
    parts = [LedgerBatch(batch.blocks, [e], []) for e in batch.entries]
    parts += [LedgerBatch(batch.blocks, [], [r]) for r in batch.responses]
    if len(parts) > 1:
        log.error(
            "ledger batch of %d rows refused (%s): writing each row alone",
            len(parts),
            type(exc).__name__,
        )
        kept = [write_batch(conn, part, sealer, again, scrub) for part in parts]
        return all(kept)
    if not scrub:
        return write_batch(conn, batch, sealer, again, scrub=True)
    DROPPED[0] += len(parts)
    for e in batch.entries:  # ids the gateway made: safe to log
        log.error(
            "ledger row %s dropped: the database refused it (%s)", e.request_id, type(exc).__name__
        )
    for r in batch.responses:
        log.error(
            "stored response %s dropped: the database refused it (%s)", r.id, type(exc).__name__
        )
    return False


# Rows (usage rows and stored responses) the writer dropped since this process started:
# refused for one of their values even made storable (`_isolated`), or after repeated
# write failures. A list, counted in place; the writer reports it with each flush's
# answer (observe/ledger_writer.py), and the gateway counts it as dropped (/metrics).
DROPPED = [0]


def write_batch(
    conn: sqlite3.Connection,
    batch: LedgerBatch,
    sealer: Sealer | None = None,
    again: bool = False,
    scrub: bool = False,
) -> bool:
    """Commit one batch: every usage row, trace and stored response (sealed with
    `sealer`), or (after retries) none of them. `again`: the batch may have been
    committed already (an `AGAIN` frame): its entries already in `usage` are written
    again, unchanged, and left out of the daily sums. A `LOST` entry where its request
    has a row is left out; a request's own entry replacing a `LOST` row takes back
    what that row added to the daily sums (the module docstring). A batch refused
    for a value in it (a NUL in text, a key too long to index) is written row by row
    (`_isolated`); `scrub`: its values are made storable first (`_scrubbed`)."""
    try:
        entries = batch.entries
        rows = [usage_row(e) for e in entries]
        daily = daily_rollups(entries)
        traced = [e for e in entries if e.decisions is not None]
        traces = [insert_args(trace_from_entry(e)) for e in traced]
        templates = [(bid, _TEMPLATE.encode(t).decode()) for bid, t in batch.blocks.items()]
        responses = _sealed(batch, sealer)
        if scrub:
            rows = [_scrubbed(r) for r in rows]
            traces = [_scrubbed(t) for t in traces]
            responses = [_scrubbed(r) for r in responses]
        lost = {e.request_id for e in entries if e.error_code == LOST}
        if again:
            check = [e.request_id for e in entries]
        else:
            late = (
                [e.request_id for e in entries if e.request_id in _LOST_WRITTEN]
                if _LOST_WRITTEN
                else []
            )
            check = [*lost, *late]
    except Exception:  # a malformed batch must not end the writer
        log.exception("dropped a malformed batch of %d entries", len(batch.entries))
        return False
    all_rows, all_traces = rows, traces
    skip: set[str] = set()
    attempt, outage_until = 0, time.monotonic() + OUTAGE_S
    while True:
        attempt += 1
        try:
            conn.execute("BEGIN IMMEDIATE")
            if check:
                found = _existing(conn, check)
                # Kept out: a LOST entry where its request has a row.
                skip = {rid for rid in lost if rid in found}
                # Counted already: a row of its own, or a LOST row written again.
                counted = {rid for rid, was in found.items() if was is None or rid in lost}
                taken = [was for rid, was in found.items() if was is not None and rid not in lost]
                daily = [
                    *daily_rollups(e for e in entries if e.request_id not in counted),
                    *taken,
                ]
                if skip:
                    rows = [
                        r
                        for r, e in zip(all_rows, entries, strict=True)
                        if e.request_id not in skip
                    ]
                    traces = [
                        t
                        for t, e in zip(all_traces, traced, strict=True)
                        if e.request_id not in skip
                    ]
            if scrub:
                daily = [_scrubbed(d) for d in daily]
            try:
                conn.executemany(INSERT_USAGE, rows)
                conn.executemany(ADD_DAILY, daily)
                if traces:
                    conn.executemany(INSERT_TEMPLATES, templates)
                    conn.executemany(INSERT_TRACES, traces)
                if responses:
                    conn.executemany(INSERT_RESPONSES, responses)
            except OverflowError:  # a value SQLite cannot bind: keep the rows, as text
                # (PostgreSQL: held at BIGINT's bounds, state/sql_pg.py)
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
            if lost:  # those written: a row of the request's own may follow
                _LOST_WRITTEN.update(dict.fromkeys(lost - skip))
                for rid in list(_LOST_WRITTEN)[: max(0, len(_LOST_WRITTEN) - _LOST_KEPT)]:
                    del _LOST_WRITTEN[rid]
            return True
        except (sqlite3.Error, OverflowError) as exc:
            with contextlib.suppress(sqlite3.Error):
                if conn.in_transaction:
                    conn.execute("ROLLBACK")
            if isinstance(exc, sqlite3.DataError | sqlite3.IntegrityError | OverflowError):
                # A value of the batch, not the database: the same every time.
                return _isolated(conn, batch, sealer, again, scrub, exc)
            log.error("ledger write failed (attempt %d): %s", attempt, exc)
            # A database that cannot be reached (PostgreSQL down, SQLite locked) is
            # waited for up to OUTAGE_S; batches queue behind this one meanwhile (the
            # gateway counts what its bounded queue cannot hold). Other errors: 3 tries.
            waiting = isinstance(exc, sqlite3.OperationalError) and time.monotonic() < outage_until
            if attempt >= 3 and not waiting:
                break
            time.sleep(min(1.0, 0.05 * attempt))
    DROPPED[0] += len(batch.entries) + len(batch.responses)
    log.error(
        "dropped %d usage rows and %d stored responses after repeated write failures",
        len(batch.entries),
        len(batch.responses),
    )
    return False


class _Responses(msgspec.Struct):
    responses: list[msgspec.Raw] = []


_BATCH = msgspec.json.Decoder(WriterBatch)  # its decisions kept as JSON (WriterEntry)
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
