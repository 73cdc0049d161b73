"""The ledger's typed entry: what goes down the writer's pipe is validated on the way
in, one bad entry costs only itself, and a value SQLite cannot bind keeps its row."""

from __future__ import annotations

from pathlib import Path

import msgspec

from switchyard.state.ledger_batch import decode_batch, write_batch
from switchyard.state.sql import connect
from switchyard.state.traces import LedgerBatch, LedgerEntry, get_request


def _entry(rid: str, **changes: object) -> LedgerEntry:
    e = LedgerEntry(
        rid, None, None, [], "t", "k", "chat.completions", "m", "m", "r1", "up", "ok",
        None, 1, 3, 4, 0.5, None, None, None, False, 1_700_000_000.0, 0.1, 10.0, 10.001,
        10.002, 10.003, 10.004, 1_699_999_990.0,
        [["validate", "ok", "fine", None, 10.0, 10.0], ["place", "remote", "r", None, 10.0, 10.0]],
        [("t1", 1, 10.0, 10.0)],
    )  # fmt: skip
    return msgspec.structs.replace(e, **changes)


BLOCKS = {"t1": [("authorize", "allowed", "ok", {"model": "m"})]}


def test_a_batch_round_trips_and_blocks_expand_in_place(tmp_path: Path) -> None:
    payload = msgspec.json.encode(LedgerBatch(BLOCKS, [_entry("a"), _entry("b")]))
    batch = decode_batch(payload)
    assert batch is not None and [e.request_id for e in batch.entries] == ["a", "b"]
    conn = connect(str(tmp_path / "l.db"))
    assert write_batch(conn, batch)
    rec = get_request(conn, "a")
    assert rec is not None
    assert [d["stage"] for d in rec["decisions"]] == ["validate", "authorize", "place"]
    conn.close()


def test_an_entry_of_the_wrong_shape_is_dropped_alone() -> None:
    good = msgspec.json.encode(_entry("good")).decode()
    bad = good.replace('"ok"', "12", 1)  # status must be a string
    payload = f'{{"blocks": {msgspec.json.encode(BLOCKS).decode()}, "entries": [{good}, {bad}]}}'
    batch = decode_batch(payload.encode())
    assert batch is not None and [e.request_id for e in batch.entries] == ["good"]
    assert decode_batch(b"not json") is None


def test_a_count_sqlite_cannot_hold_keeps_its_row_and_batch(tmp_path: Path) -> None:
    conn = connect(str(tmp_path / "l.db"))
    batch = LedgerBatch(BLOCKS, [_entry("huge", input_tokens=10**30), _entry("next")])
    assert write_batch(conn, decode_batch(msgspec.json.encode(batch)))  # type: ignore[arg-type]
    rows = dict(conn.execute("SELECT request_id, input_tokens FROM usage").fetchall())
    # bound as text, which the INTEGER column keeps as the nearest number it can hold
    assert rows == {"huge": 1e30, "next": 3}
    conn.close()


def test_a_block_template_is_stored_once_and_traces_refer_to_it(tmp_path: Path) -> None:
    conn = connect(str(tmp_path / "l.db"))
    for i in range(3):
        batch = LedgerBatch(BLOCKS, [_entry(f"r{i}a"), _entry(f"r{i}b")])
        assert write_batch(conn, decode_batch(msgspec.json.encode(batch)))  # type: ignore[arg-type]
    assert [r[0] for r in conn.execute("SELECT id FROM trace_templates")] == ["t1"]
    raw = conn.execute("SELECT record FROM traces WHERE request_id = 'r2b'").fetchone()[0]
    assert "authorize" not in raw  # the block is a reference, not a copy
    rec = get_request(conn, "r2b")
    assert rec is not None and rec["decisions"][1]["evidence"] == {"model": "m"}
    conn.close()
