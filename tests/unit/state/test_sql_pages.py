"""A new SQLite file gets 8 KiB pages; an existing one keeps its own. Either way the
WAL is checkpointed (and, under synchronous=NORMAL, synced) every 4 MiB, as SQLite's
default of 1000 pages was with 4 KiB pages: larger pages never widen what a power loss
may take (state/sql.py `connect`)."""

from __future__ import annotations

import sqlite3
from pathlib import Path

from switchyard.state.sql import connect


def _pages(conn: sqlite3.Connection) -> tuple[int, int]:
    return (
        conn.execute("PRAGMA page_size").fetchone()[0],
        conn.execute("PRAGMA wal_autocheckpoint").fetchone()[0],
    )


def test_a_new_file_has_8_kib_pages_and_a_checkpoint_every_4_mib(tmp_path: Path) -> None:
    conn = connect(str(tmp_path / "new.db"))
    assert _pages(conn) == (8192, 512)
    conn.close()
    again = connect(str(tmp_path / "new.db"))  # reopened: the same
    assert _pages(again) == (8192, 512)


def test_an_older_file_keeps_its_pages_and_its_4_mib_checkpoints(tmp_path: Path) -> None:
    old = sqlite3.connect(tmp_path / "old.db")
    old.execute("PRAGMA page_size=4096")
    old.execute("CREATE TABLE t (x)")
    old.execute("PRAGMA journal_mode=WAL")
    old.close()
    conn = connect(str(tmp_path / "old.db"))
    assert _pages(conn) == (4096, 1024)
    assert conn.execute("SELECT count(*) FROM usage").fetchone()[0] == 0  # schema added
