"""A settled request's ledger row: moved to state/ledger_rows.py; this module keeps the old
import path."""

from switchyard.state.ledger_rows import (
    _ENCODER,
    Finished,
    LedgerCounts,
    Row,
    _json_safe,
    _plain,
    _repaired,
    batch_json,
    encoded_row,
    log,
)

__all__ = [
    "_ENCODER",
    "Finished",
    "LedgerCounts",
    "Row",
    "_json_safe",
    "_plain",
    "_repaired",
    "batch_json",
    "encoded_row",
    "log",
]
