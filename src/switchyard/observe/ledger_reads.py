"""The ledger's reads: moved to state/ledger_reads.py; this module keeps the old
import path."""

from switchyard.state.ledger_reads import (
    LedgerReads,
    _percentiles,
    live_summary,
    spent_since,
    task_rows,
    usage_rows,
)

__all__ = [
    "LedgerReads",
    "_percentiles",
    "live_summary",
    "spent_since",
    "task_rows",
    "usage_rows",
]
