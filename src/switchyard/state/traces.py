"""Decision traces: one record per request, stored beside its usage row.

A trace keeps what explains a request — its decisions with reasons and evidence,
its timings, what served it and what it cost — and never the prompt or the reply.
Records are kept for `observe.traces_retention_days` and at most
`observe.traces_max_rows`; `enforce_retention` runs in the background.
"""

from __future__ import annotations

import hashlib
import json
import math
import sqlite3
import time
from collections.abc import Mapping, Sequence
from typing import Any

import msgspec

from switchyard.pipeline import Decision, RequestContext, decision_dict
from switchyard.state.sql import is_sqlite, newest_first


class LedgerEntry(msgspec.Struct, array_like=True, gc=False):
    """What the gateway hands the ledger writer per finished request, built on the
    event loop with no dicts and no arithmetic; the writer turns it into the usage row
    and the stored trace (`usage_row`, `trace_from_entry`). Encoded as one JSON array
    in this field order; the writer decodes it back into this type (validated)."""

    request_id: str  # the gateway's own (unguessable): the key of the usage row and trace
    client_request_id: str | None  # the client's x-client-request-id / x-request-id
    task_id: str | None
    parent_request_ids: tuple[str, ...]
    tenant_id: str | None
    key_id: str | None
    endpoint: str
    model: str | None  # what served it: the deployment's alias (after any fallback)
    requested_model: str | None  # the alias the pipeline resolved before execution
    revision: str | None
    upstream: str | None
    status: str
    error_code: str | None
    attempts: int
    input_tokens: int
    output_tokens: int
    cost_usd: float
    cache: str | None
    fallback_from: str | None
    planned_steps: int | None
    stream: bool
    received_at: float
    queue_ms: float | None
    t_received: float  # perf_counter milestones of the request (Timings)
    t_upstream_sent: float | None
    t_upstream_first_byte: float | None
    t_client_first_byte: float | None
    t_ended: float | None
    clock_base: float
    # [stage, outcome, reason, evidence, t0, t1] each, but for the folded blocks; None
    # when traces are off (only the usage row is kept).
    decisions: list[Any] | None
    # The pipeline's folded blocks: (template id, index in the full decision list, t0,
    # t1); the templates travel once per batch and are stored once (trace_templates).
    blocks: list[tuple[str, int, float, float]] = []
    # The request's images (the media stage): count, bytes received, pixels before
    # and after processing; None without images.
    images: tuple[int, int, int, int] | None = None
    # The LoRA adapter that served it and the adapter's revision; None for a base model.
    adapter: tuple[str, str] | None = None
    # Placement's "mode; reason=…" (models[].placement); None without a placement policy.
    placement: str | None = None


ENTRY_FIELDS = LedgerEntry.__struct_fields__


class WriterEntry(LedgerEntry, array_like=True, gc=False):
    """A `LedgerEntry` as the writer decodes it: its decisions stay the JSON they came
    as, to be written into the trace record as they are. Parsing them into lists and
    dicts only to encode them again cost the writer about half its Python time per
    request; the gateway's encoder wrote them, so the bytes are what encoding the
    parsed value again would give."""

    # An array, or null (then None, as in a LedgerEntry): anything else fails
    # validation like a LedgerEntry's would, and drops the entry alone.
    decisions: msgspec.Raw  # type: ignore[assignment]

    def __post_init__(self) -> None:
        first = memoryview(self.decisions)[:1]
        if first == b"n":
            self.decisions = None  # type: ignore[assignment]
        elif first != b"[":
            raise ValueError("Expected `array | null` for the decisions")


class StoredRow(msgspec.Struct, array_like=True, gc=False):
    """A new stored response of the Responses API (state/responses.py), as the writer
    inserts it into `responses` in the same transaction as the batch's usage rows. Its
    body travels as JSON down the pipe and is sealed by the writer (state/sealing.py:
    the key comes down the same pipe when the writer starts), so nothing readable of it
    reaches the disk and the gateway's event loop spends no time encrypting."""

    tenant_id: str
    id: str
    created_at: float
    status: str
    model: str
    deployment: str | None
    previous_response_id: str | None
    background: int
    owner: str | None
    body: msgspec.Raw  # the body's JSON
    updated_at: float


class LedgerBatch(msgspec.Struct):
    """One batch down the writer's pipe: the entries and the block templates they use,
    and the stored responses made meanwhile."""

    blocks: dict[str, list[tuple[str, str, str, Any]]]  # the templates, by id
    entries: Sequence[LedgerEntry]
    responses: list[StoredRow] = []


class WriterBatch(LedgerBatch):
    """A `LedgerBatch` as the writer decodes it (its entries `WriterEntry`)."""

    entries: list[WriterEntry]


# A run of static verdicts that the pipeline recorded as one block (pipeline.Pipeline)
# is the same for every request of its View but for its times. In a ledger entry such a
# run is one item, ("@", block id, t0, t1), and the writer expands it from the block's
# template (stage, outcome, reason, evidence) sent with the batch; the stored trace is
# the same as if it had been sent whole.


_TEMPLATE_KEY = msgspec.json.Encoder(enc_hook=str)


def template_id(template: list[tuple[str, str, str, Any]]) -> str:
    """A block template's id: the hash of its content (stable across processes)."""
    return hashlib.sha256(_TEMPLATE_KEY.encode(template)).hexdigest()[:24]


def compact_decisions(
    decisions: list[Decision], blocks: list[tuple[str, int, int]]
) -> tuple[list[Any], list[tuple[str, int, float, float]]]:
    """`decisions` without the block runs (bid, start, count), and the runs as
    (bid, start, t0, t1)."""
    if not blocks:
        return decisions, []
    rest: list[Any] = []
    refs = []
    at = 0
    for bid, start, count in blocks:
        first = decisions[start]
        rest.extend(decisions[at:start])
        refs.append((bid, start, first.t0, first.t1))
        at = start + count
    rest.extend(decisions[at:])
    return rest, refs


def expand_decisions(
    decisions: list[Any],
    refs: list[Any],
    blocks: Mapping[str, list[Any]],
) -> list[Any]:
    """The full decisions of a trace whose block runs are kept as references."""
    if not refs:
        return decisions
    out: list[Any] = []
    rest = iter(decisions)
    for bid, start, t0, t1 in refs:
        while len(out) < start:
            out.append(next(rest))
        out.extend(
            [stage, outcome, reason, evidence, t0, t1]
            for stage, outcome, reason, evidence in blocks[str(bid)]
        )
    out.extend(rest)
    return out


def ledger_entry(
    ctx: RequestContext, status: str, inp: int, out: int, cost: float, with_trace: bool
) -> LedgerEntry:
    """The writer's entry for a finished request; its folded blocks go compactly
    (`compact_decisions`)."""
    t, p, dep, model = ctx.timings, ctx.principal, ctx.deployment, ctx.model
    if with_trace:
        decisions, refs = compact_decisions(ctx.decisions, ctx.blocks)
    else:
        decisions, refs = None, []
    return LedgerEntry(
        ctx.input.request_id,
        ctx.input.client_request_id,
        ctx.input.task_id,
        ctx.input.parent_request_ids,
        p.tenant_id if p is not None else None,
        p.key_id if p is not None else None,
        ctx.input.called,
        dep.alias if dep is not None else ctx.alias,
        ctx.alias,
        model.revision if model is not None else None,
        dep.label if dep is not None else None,
        status,
        ctx.error_code,
        ctx.run.attempts,
        inp,
        out,
        cost,
        ctx.cache,
        ctx.run.fallback_from,
        ctx.input.planned_steps,
        ctx.stream,
        ctx.input.received_at,
        ctx.admission.queue_ms,
        t.received,
        t.upstream_sent,
        t.upstream_first_byte,
        t.client_first_byte,
        t.ended,
        ctx.input.received_at - t.received,
        decisions,
        refs,
        ctx.media_shape,
        (dep.adapter.name, dep.adapter.revision)
        if dep is not None and dep.adapter is not None
        else None,
        f"{ctx.placement.mode}; reason={ctx.placement.reason}"
        if ctx.placement is not None
        else None,
    )


def _ms(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else round((b - a) * 1000, 3)


class TraceTimings(msgspec.Struct, gc=False):
    """A trace record's `timings`, in milliseconds from the request's arrival."""

    queue_ms: float | None
    upstream_first_byte_ms: float | None
    client_first_byte_ms: float | None
    upstream_ms: float | None
    duration_ms: float | None


class TraceAdapter(msgspec.Struct, gc=False):
    """The LoRA adapter of a trace record: its name and revision."""

    name: str
    revision: str


class TraceRecord(msgspec.Struct, gc=False):
    """The stored form of a finished request (no bodies): the `record` column's JSON
    object, its keys in this order. A struct rather than a dict: the writer builds one
    per request, and a struct is built and encoded in ~1.2 us less (~20 %)."""

    request_id: str
    client_request_id: str | None
    task_id: str | None
    parent_request_ids: tuple[str, ...]
    tenant_id: str | None
    key_id: str | None
    endpoint: str
    model: str | None
    requested_model: str | None
    revision: str | None
    adapter: TraceAdapter | None
    upstream: str | None
    status: str
    error_code: str | None
    attempts: int
    input_tokens: int
    output_tokens: int
    cost_usd: float
    cache: str | None
    fallback_from: str | None
    planned_steps: int | None
    stream: bool
    received_at: float
    timings: TraceTimings
    # Stored compactly: [stage, outcome, reason, evidence, t0, t1] with perf_counter
    # times; `expand` gives the documented form on read. A WriterEntry's decisions
    # are the JSON they came as (msgspec.Raw), encoded as they are.
    clock_base: float
    decisions: list[Any] | msgspec.Raw | None
    blocks: list[tuple[str, int, float, float]]


def trace_from_entry(e: LedgerEntry) -> TraceRecord:
    """The stored form of a finished request, from its entry. Its folded blocks stay
    references (`blocks`) to the stored templates; reads expand them."""
    received, sent, end = e.t_received, e.t_upstream_sent, e.t_ended
    queue_ms = e.queue_ms
    return TraceRecord(
        e.request_id,
        e.client_request_id,
        e.task_id,
        e.parent_request_ids,
        e.tenant_id,
        e.key_id,
        e.endpoint,
        e.model,
        e.requested_model,
        e.revision,
        None if e.adapter is None else TraceAdapter(*e.adapter),
        e.upstream,
        e.status,
        e.error_code,
        e.attempts,
        e.input_tokens,
        e.output_tokens,
        e.cost_usd,
        e.cache,
        e.fallback_from,
        e.planned_steps,
        e.stream,
        e.received_at,
        TraceTimings(
            None if queue_ms is None else round(queue_ms, 3),
            _ms(received, e.t_upstream_first_byte),
            _ms(received, e.t_client_first_byte),
            _ms(sent, end) if sent is not None else None,
            _ms(received, end),
        ),
        e.clock_base,
        e.decisions,
        e.blocks,
    )


class Templates(dict[str, list[Any]]):
    """The stored block templates a read needs, loaded once each per read."""

    def __init__(self, conn: sqlite3.Connection) -> None:
        super().__init__()
        self._conn = conn

    def __missing__(self, bid: str) -> list[Any]:
        row = self._conn.execute(
            "SELECT template FROM trace_templates WHERE id = ?", (bid,)
        ).fetchone()
        template: list[Any] = json.loads(row[0]) if row is not None else []
        self[bid] = template
        return template


def expand(record: dict[str, Any], templates: Mapping[str, list[Any]]) -> dict[str, Any]:
    """A stored record in its documented form: its blocks expanded in place, each
    decision with `started_at` (unix seconds) and `duration_ms`, evidence always an
    object."""
    base = record.pop("clock_base", None)
    refs = record.pop("blocks", None)
    if base is None:
        return record
    decisions = record.get("decisions") or []
    if refs:
        decisions = expand_decisions(decisions, refs, templates)
    record["decisions"] = [decision_dict(d, base) for d in decisions]
    return record


def insert_sql() -> str:
    return (
        "INSERT OR REPLACE INTO traces (request_id, client_request_id, task_id, tenant_id,"
        " status, received_at, record) VALUES (?, ?, ?, ?, ?, ?, ?)"
    )


_RECORD = msgspec.json.Encoder(enc_hook=str)


def insert_args(record: TraceRecord) -> tuple[Any, ...]:
    """The `traces` row of a record."""
    return (
        record.request_id,
        record.client_request_id,
        record.task_id,
        record.tenant_id,
        record.status,
        record.received_at,
        _RECORD.encode(record).decode(),
    )


class AmbiguousRequestId(ValueError):
    """A client's request id (or task id) that several tenants used: name the tenant."""


def get_request(
    conn: sqlite3.Connection, request_id: str, tenant_id: str | None = None
) -> dict[str, Any] | None:
    """The trace of a request by the gateway's id, or else by the client's own id
    (`client_request_id`) within a tenant: the latest request that used it. A client
    id used by several tenants needs `tenant_id` (AmbiguousRequestId otherwise)."""
    sql = "SELECT record FROM traces WHERE request_id = ?"
    args: tuple[Any, ...] = (request_id,)
    if tenant_id is not None:
        sql, args = sql + " AND tenant_id = ?", (request_id, tenant_id)
    row = conn.execute(sql, args).fetchone()
    if row is None:
        if tenant_id is None:
            tenants = conn.execute(
                "SELECT DISTINCT tenant_id FROM traces WHERE client_request_id = ? LIMIT 2",
                (request_id,),
            ).fetchall()
            if len(tenants) > 1:
                raise AmbiguousRequestId(
                    f"several tenants used the request id {request_id[:128]!r}; name the tenant"
                )
        sql = "SELECT record FROM traces WHERE client_request_id = ?"
        args = (request_id,)
        if tenant_id is not None:
            sql, args = sql + " AND tenant_id = ?", (request_id, tenant_id)
        row = conn.execute(sql + " ORDER BY received_at DESC LIMIT 1", args).fetchone()
    return None if row is None else expand(dict(json.loads(row[0])), Templates(conn))


def get_task(
    conn: sqlite3.Connection, task_id: str, tenant_id: str | None = None
) -> list[dict[str, Any]]:
    """The records of a task: `tenant_id`'s task of that id (task ids are the
    clients'), or the one tenant's that used it; a task id several tenants used needs
    `tenant_id` (AmbiguousRequestId), never one analysis over several tenants' tasks."""
    if tenant_id is None:
        tenants = conn.execute(
            "SELECT DISTINCT tenant_id FROM traces WHERE task_id = ? LIMIT 2", (task_id,)
        ).fetchall()
        if len(tenants) > 1:
            raise AmbiguousRequestId(
                f"several tenants used the task id {task_id[:128]!r}; name the tenant"
            )
    sql, args = "SELECT record FROM traces WHERE task_id = ?", [task_id]
    if tenant_id is not None:
        sql, args = sql + " AND tenant_id = ?", [task_id, tenant_id]
    rows = conn.execute(sql + " ORDER BY received_at", args).fetchall()
    templates = Templates(conn)
    return [expand(json.loads(r[0]), templates) for r in rows]


def list_requests(
    conn: sqlite3.Connection,
    tenant_id: str | None = None,
    since: float | None = None,
    status: str | None = None,
    limit: int = 100,
) -> list[dict[str, Any]]:
    equal = (("tenant_id", tenant_id), ("status", status))
    rows = newest_first(conn, "SELECT record FROM traces", equal, limit, since)
    out = []
    for (raw,) in rows:
        rec = json.loads(raw)
        rec.pop("decisions", None)  # the list view is a summary
        rec.pop("clock_base", None)
        rec.pop("blocks", None)
        out.append(rec)
    return out


def enforce_retention(
    conn: sqlite3.Connection, retention_days: float, max_rows: int, now: float | None = None
) -> int:
    """Delete traces older than the retention and beyond the size cap; returns count."""
    now = time.time() if now is None else now
    cur = conn.execute("DELETE FROM traces WHERE received_at < ?", (now - retention_days * 86400,))
    deleted = cur.rowcount
    (count,) = conn.execute("SELECT COUNT(*) FROM traces").fetchone()
    if count > max_rows:
        cur = conn.execute(
            "DELETE FROM traces WHERE request_id IN (SELECT request_id FROM traces"
            " ORDER BY received_at ASC LIMIT ?)",
            (count - max_rows,),
        )
        deleted += cur.rowcount
    return int(deleted)


def bytes_in_use(conn: sqlite3.Connection) -> int:
    """Bytes of the SQLite file that hold data (its pages less the free ones)."""
    size = conn.execute("PRAGMA page_size").fetchone()[0]
    pages = conn.execute("PRAGMA page_count").fetchone()[0]
    free = conn.execute("PRAGMA freelist_count").fetchone()[0]
    return int((pages - free) * size)


# What the byte budget deletes, in this order, oldest first: (table, its time column,
# its key). Traces explain requests; rollout records are training data a trainer has
# usually exported (and has in its stream); `Idempotency-Key` replies answer only a
# repeat of their key, which comes soon after it if at all (state/idempotency.py);
# stored responses are conversations a client may still continue (state/responses.py);
# raw usage rows go last, rollups never.
BUDGETED = (
    ("traces", "received_at", "request_id"),
    ("rollouts", "created_at", "sample_id"),
    ("idempotency", "created_at", "tenant_id, key"),
    ("responses", "created_at", "id"),
    ("usage", "received_at", "request_id"),
)
# Tenants' own data, which their clients read back: the budget takes from the tenant
# holding the most bytes of the table first (its oldest rows), so a tenant that fills
# the disk pays for it, never another tenant's few rows (`fair_shares`).
FAIR = frozenset({"idempotency", "responses"})
# Rows the budget leaves alone: a claim in flight (its request is running; deleting it
# would let a repeat of its key run a second time).
_DELETABLE = {"idempotency": "state = 'done'"}


def fair_shares(totals: Mapping[str, float], want: float) -> dict[str, float]:
    """How many bytes each tenant gives up so that `want` bytes go: the largest
    holders are cut down to one level, none below it (water filling). {tenant: bytes},
    only the tenants that give something; everything when `want` is all there is."""
    ranked = sorted(((b, t) for t, b in totals.items() if b > 0), reverse=True)
    held = 0.0
    for i, (b, _) in enumerate(ranked):
        held += b
        below = ranked[i + 1][0] if i + 1 < len(ranked) else 0.0
        if held - (i + 1) * below >= want:
            level = (held - want) / (i + 1)
            return {t: b - level for b, t in ranked[: i + 1] if b > level}
    return {t: b for b, t in ranked}


def _size_sql(conn: Any, table: str) -> str | None:
    """A row's bytes as SQL over `t` (the table's alias): PostgreSQL's own measure, or
    on SQLite the length of every column and a little for the row and its index
    entries. None: SQLite has no such table (idempotency before any gateway used it)."""
    if not is_sqlite(conn):
        return "pg_column_size(t.*)"
    cols = [row[1] for row in conn.execute(f"PRAGMA table_info({table})")]
    if not cols:
        return None
    return "64 + " + " + ".join(f"coalesce(length(t.{c}), 0)" for c in cols)


def _victims(
    conn: Any, table: str, at: str, ident: str, size: str, want: float, limit: int
) -> list[tuple[tuple[Any, ...], float]]:
    """The rows to delete so that about `want` bytes go, each with its bytes: the
    oldest, and in a FAIR table the oldest of the tenants holding the most
    (`fair_shares`); at most `limit` rows a tenant, at least one from each that gives."""
    keep = _DELETABLE.get(table)
    where = f" WHERE {keep}" if keep else ""
    quotas: dict[str | None, float]
    if table in FAIR:
        totals = conn.execute(
            f"SELECT tenant_id, SUM({size}) FROM {table} t{where} GROUP BY tenant_id"
        ).fetchall()
        shares = fair_shares({str(r[0]): float(r[1] or 0) for r in totals}, want)
        quotas = {t: q for t, q in shares.items()}
    else:
        quotas = {None: want}
    width = len(ident.split(","))
    out: list[tuple[tuple[Any, ...], float]] = []
    for tenant, quota in quotas.items():
        terms = [keep] if keep else []
        args: list[Any] = []
        if tenant is not None:
            terms.append("tenant_id = ?")
            args.append(tenant)
        cond = f" WHERE {' AND '.join(terms)}" if terms else ""
        rows = conn.execute(
            f"SELECT {ident}, {size} FROM {table} t{cond} ORDER BY {at} ASC LIMIT ?",
            (*args, limit),
        ).fetchall()  # whole: no statement left open under the DELETE and the COMMIT
        taken = 0.0
        for row in rows:
            if taken >= quota:
                break
            bytes_ = float(row[width] or 0)
            out.append((tuple(row[:width]), bytes_))
            taken += bytes_
    return out


def _delete(conn: Any, table: str, ident: str, victims: list[tuple[tuple[Any, ...], float]]) -> int:
    marks = ", ".join("?" for _ in ident.split(","))
    cur = conn.executemany(
        f"DELETE FROM {table} WHERE ({ident}) = ({marks})", [v for v, _ in victims]
    )
    return max(int(cur.rowcount), 0) if cur.rowcount is not None else 0


def enforce_disk(conn: sqlite3.Connection, max_bytes: int, chunk: int = 2000) -> int:
    """Keep the file's data under `max_bytes` (observe.max_disk_mb): past it, delete the
    oldest traces, then the oldest rollout records, then `Idempotency-Key` replies,
    then stored responses, then the oldest raw usage rows, until 90 % of it is in use;
    the daily rollups (the bill) are never deleted. Replies and stored responses go
    from the tenant holding the most bytes of them first (`FAIR`).

    It deletes in steps sized by bytes, measuring the file again after each: a step
    takes about the bytes still over 90 %, scaled by what the last step's rows freed
    (rows deleted from pages that stay in use free none yet: then the next step
    doubles), at most `chunk` rows a tenant. One row too many thus costs about that
    row's bytes, never a whole chunk of every tenant's rows. Each step holds the write
    lock from its measure to its commit, so two passes (the ledger writer's and the
    gateway's retention) never both delete for the same excess.

    Freed pages go back to the disk where the file allows it (auto_vacuum=INCREMENTAL,
    every file made since), else they are reused by new rows, so the file stays flat.
    Returns the rows deleted."""
    if not is_sqlite(conn):
        return _enforce_rows_budget(conn, max_bytes, max(chunk, 50_000))
    if bytes_in_use(conn) <= max_bytes:
        return 0
    target = int(max_bytes * 0.9)
    deleted = 0
    for table, at, _key in BUDGETED:
        size = _size_sql(conn, table)
        if size is None:
            continue
        rate = 1.0  # bytes of the file freed per byte of rows deleted, as last seen
        while True:
            own = not conn.in_transaction
            if own:
                conn.execute("BEGIN IMMEDIATE")
            try:
                used = bytes_in_use(conn)
                victims = []
                if used > target:
                    want = (used - target) / rate
                    victims = _victims(conn, table, at, "rowid", size, want, chunk)
                n = _delete(conn, table, "rowid", victims) if victims else 0
                if own:
                    conn.execute("COMMIT")
            except BaseException:
                if own and conn.in_transaction:
                    conn.execute("ROLLBACK")
                raise
            if n <= 0:
                break  # under the target, or nothing of this table left to delete
            deleted += n
            freed = used - bytes_in_use(conn)
            removed = sum(b for _, b in victims)
            rate = max(freed / removed, 1 / 64) if freed > 0 else max(rate / 2, 1 / 64)
    if deleted:
        # executescript steps it to the end (execute() frees one page per step, and
        # Python steps a statement that returns no rows only once).
        conn.executescript("PRAGMA incremental_vacuum;")
        # And the WAL, which holds the deleted pages too, back to its limit.
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchall()
    return deleted


def row_bytes(
    conn: Any, table: str, sample: int = 500, at: str = "received_at"
) -> tuple[int, float]:
    """PostgreSQL: the table's rows and their mean size in bytes (pg_column_size of the
    newest `sample` rows). The file sizes are no measure there: deleted rows leave
    space that VACUUM marks reusable but does not give back."""
    (count,) = conn.execute(f"SELECT COUNT(*) FROM {table}").fetchone()
    if not count:
        return 0, 0.0
    (mean,) = conn.execute(
        f"SELECT AVG(pg_column_size(s.*)) FROM (SELECT * FROM {table}"
        f" ORDER BY {at} DESC LIMIT ?) s",
        (sample,),
    ).fetchone()
    return int(count), float(mean or 0.0)


def _enforce_rows_budget(conn: Any, max_bytes: int, chunk: int) -> int:
    """The byte budget on PostgreSQL: the rows' own bytes (count x mean row size) of
    traces, rollout records, idempotency replies, stored responses and raw usage rows;
    past `max_bytes`, the oldest of each, in that order, are deleted down to 90 % of
    it, those of a FAIR table from the tenants holding the most of it first. Rollups are
    never deleted."""
    sizes = {t: row_bytes(conn, t, at=at) for t, at, _ in BUDGETED}
    total = sum(n * mean for n, mean in sizes.values())
    if total <= max_bytes:
        return 0
    excess = total - max_bytes * 0.9
    deleted = 0
    for table, at, key in BUDGETED:
        n, mean = sizes[table]
        if excess <= 0 or n == 0 or mean <= 0:
            continue
        if table in FAIR:  # by each row's own bytes, tenant by tenant
            size = "pg_column_size(t.*)"
            left = min(excess, n * mean)
            excess -= left
            while left > 0:
                victims = _victims(conn, table, at, key, size, left, chunk)
                if not victims:
                    break
                deleted += _delete(conn, table, key, victims)
                left -= sum(b for _, b in victims)
            excess += max(left, 0.0)
            continue
        todo = min(n, math.ceil(excess / mean))
        excess -= todo * mean
        while todo > 0:
            cur = conn.execute(
                f"DELETE FROM {table} WHERE {key} IN (SELECT {key} FROM {table}"
                f" ORDER BY {at} ASC LIMIT ?)",
                (min(chunk, todo),),
            )
            if cur.rowcount <= 0:
                break
            todo -= cur.rowcount
            deleted += cur.rowcount
    return deleted
