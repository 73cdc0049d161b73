"""Side-effecting tool calls' records, at most once:
moved to state/tool_calls.py; this module keeps the old import path."""

from switchyard.state.tool_calls import (
    POLL_S,
    Claim,
    Sealer,
    ToolCallRecords,
    _rid,
    log,
)

__all__ = [
    "POLL_S",
    "Claim",
    "Sealer",
    "ToolCallRecords",
    "_rid",
    "log",
]
