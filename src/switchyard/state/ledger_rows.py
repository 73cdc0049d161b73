"""A settled request's ledger row, encoded for the writer process.

The row is encoded when the request settles (`encoded_row`), so a batch holds bytes
rather than request contexts; a row that cannot be serialised is repaired field by
field or dropped, and counted either way (`LedgerCounts`). `batch_parts` joins a batch's
rows, the block templates they refer to and any stored responses into one frame body.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import msgspec

from switchyard.pipeline import RequestContext
from switchyard.state.traces import LedgerEntry, ledger_entry

log = logging.getLogger("switchyard.ledger")


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


def batch_parts(
    rows: list[Row], templates: dict[str, Any], responses: list[bytes] | None = None
) -> list[bytes]:
    """The batch as one JSON object, in pieces to be joined once (`batch_json`, or
    into its frame: `ledger_batch.frame`): `entries` (one array per request), `blocks`
    (the templates of the compact block items those entries hold, by id) and, when
    there are any, `responses` (stored responses, each an encoded `StoredRow`).
    Pieces, because a batch is about a megabyte: each copy of it is a fresh allocation
    the kernel faults in page by page (joined in four copies, it cost the event loop
    ~1.5 us per row; in one, ~0.2)."""
    used: set[str] = set()
    for _, ids in rows:
        used.update(ids)
    blocks = {i: templates[i] for i in used}
    parts = [b'{"blocks":', _ENCODER.encode(blocks), b',"entries":[']
    _listed(parts, [data for data, _ in rows])
    if responses:
        parts.append(b'],"responses":[')
        _listed(parts, responses)
    parts.append(b"]}")
    return parts


def _listed(parts: list[bytes], items: list[bytes]) -> None:
    """Append `items` to `parts`, a comma between each two."""
    for item in items:
        parts += (item, b",")
    if items:
        parts.pop()


def batch_json(
    rows: list[Row], templates: dict[str, Any], responses: list[bytes] | None = None
) -> bytes:
    """The batch as one JSON object (`batch_parts`)."""
    return b"".join(batch_parts(rows, templates, responses))
