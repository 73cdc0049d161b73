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
- `K`: the 32-byte key stored responses are sealed with (state/sealing.py), the
  first frame of a writer whose gateway stores responses.
- `S` (or end of input): commit what came before, then exit.

    python -m switchyard.observe.ledger_writer PATH [MAX_BYTES]

PATH `-` reads the database from SWITCHYARD_LEDGER_DB (a PostgreSQL URI is passed so,
not on the command line, which every user of the machine can read).
"""

from __future__ import annotations

import gc
import logging
import os
import signal
import sqlite3
import sys
import time
from typing import BinaryIO

from switchyard.observe.db import connect, is_sqlite
from switchyard.observe.sealing import Sealer
from switchyard.observe.traces import (
    enforce_disk,
)

# Moved to the state layer (this module keeps the old import path):
from switchyard.state.ledger_batch import (
    _BATCH,
    _LOOSE,
    _RESPONSES,
    _ROW,
    _TEMPLATE,
    ADD_DAILY,
    BATCH,
    FLUSH,
    HEADER,
    INSERT_RESPONSES,
    INSERT_TEMPLATES,
    INSERT_TRACES,
    INSERT_USAGE,
    KEY,
    STOP,
    TRACE_COLUMNS,
    USAGE_COLUMNS,
    _insert,
    _read_exactly,
    _Responses,
    _sealed,
    _sqlite_safe,
    daily_rollups,
    decode_batch,
    frame,
    read_frame,
    usage_row,
    write_batch,
)

log = logging.getLogger("switchyard.ledger")

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

__all__ = [
    "ADD_DAILY",
    "BATCH",
    "DISK_CHECK_S",
    "FLUSH",
    "HEADER",
    "INSERT_RESPONSES",
    "INSERT_TEMPLATES",
    "INSERT_TRACES",
    "INSERT_USAGE",
    "KEY",
    "OUTAGE_S",
    "STOP",
    "TRACE_COLUMNS",
    "USAGE_COLUMNS",
    "_BATCH",
    "_LOOSE",
    "_RESPONSES",
    "_ROW",
    "_TEMPLATE",
    "_Responses",
    "_insert",
    "_read_exactly",
    "_sealed",
    "_sqlite_safe",
    "daily_rollups",
    "decode_batch",
    "frame",
    "main",
    "read_frame",
    "serve",
    "usage_row",
    "write_batch",
]
