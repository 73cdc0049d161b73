"""The usage ledger, committed by a writer process:
moved to state/ledger.py; this module keeps the old import path."""

from switchyard.state.ledger import (
    _MAX_BATCH,
    _MAX_QUEUED_BYTES,
    _PIPE_BYTES,
    _SEQ,
    Finished,
    UsageLedger,
    _read,
    batch_json,
    live_summary,
    log,
    spent_since,
    task_rows,
    usage_rows,
)

__all__ = [
    "_MAX_BATCH",
    "_MAX_QUEUED_BYTES",
    "_PIPE_BYTES",
    "_SEQ",
    "Finished",
    "UsageLedger",
    "_read",
    "batch_json",
    "live_summary",
    "log",
    "spent_since",
    "task_rows",
    "usage_rows",
]
