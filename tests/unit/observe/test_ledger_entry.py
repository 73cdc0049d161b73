"""The ledger's typed entry: what goes down the writer's pipe is validated on the way
in, one bad entry costs only itself, and a value SQLite cannot bind keeps its row."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec

from switchyard.state.ledger_batch import decode_batch, write_batch
from switchyard.state.sql import connect
from switchyard.state.traces import ENTRY_FIELDS, LedgerBatch, LedgerEntry, get_request


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


def _records(conn: object) -> dict[str, str]:
    return dict(conn.execute("SELECT request_id, record FROM traces").fetchall())  # type: ignore[attr-defined]


def test_decisions_kept_as_sent_store_the_record_parsed_ones_would(tmp_path: Path) -> None:
    """The writer writes an entry's decisions into the trace as the JSON they came as;
    the stored record is the same text as that of the same entries parsed (what a
    caller of write_batch with LedgerEntry objects stores)."""
    evidence = {"é": "ünï ✓", "n": [1, 2.5, -3e-9, None, True], "deep": {"a": {"b": [{}]}}}
    decisions = [
        ["admit", "admitted", 'quote " and \\ and \n', evidence, 10.000001, 10.25],
        ["select", "deployment:m", "why", None, 1e300, 0.1],
    ]
    entries = [
        _entry(
            "a",
            task_id="task",
            parent_request_ids=("p1",),
            model="served",
            requested_model="asked",
            cache="hit",
            fallback_from="first",
            planned_steps=2,
            decisions=decisions,
            adapter=("lora", "v2"),
            images=(1, 2, 3, 4),
        ),
        _entry("b", blocks=[], t_upstream_sent=None, queue_ms=None, client_request_id="c"),
    ]
    sent = decode_batch(msgspec.json.encode(LedgerBatch(BLOCKS, entries)))
    assert sent is not None and isinstance(sent.entries[0].decisions, msgspec.Raw)
    kept, parsed = connect(str(tmp_path / "kept.db")), connect(str(tmp_path / "parsed.db"))
    assert write_batch(kept, sent)
    assert write_batch(parsed, LedgerBatch(BLOCKS, entries))
    assert _records(kept) == _records(parsed)
    record = json.loads(_records(kept)["a"])
    assert list(record.items()) == [
        ("request_id", "a"),
        ("client_request_id", None),
        ("task_id", "task"),
        ("parent_request_ids", ["p1"]),
        ("tenant_id", "t"),
        ("key_id", "k"),
        ("endpoint", "chat.completions"),
        ("model", "served"),
        ("requested_model", "asked"),
        ("revision", "r1"),
        ("adapter", {"name": "lora", "revision": "v2"}),
        ("upstream", "up"),
        ("status", "ok"),
        ("error_code", None),
        ("attempts", 1),
        ("input_tokens", 3),
        ("output_tokens", 4),
        ("cost_usd", 0.5),
        ("cache", "hit"),
        ("fallback_from", "first"),
        ("planned_steps", 2),
        ("stream", False),
        ("received_at", 1_700_000_000.0),
        (
            "timings",
            {
                "queue_ms": 0.1,
                "upstream_first_byte_ms": 2.0,
                "client_first_byte_ms": 3.0,
                "upstream_ms": 3.0,
                "duration_ms": 4.0,
            },
        ),
        ("clock_base", 1_699_999_990.0),
        ("decisions", decisions),
        ("blocks", [["t1", 1, 10.0, 10.0]]),
    ]
    kept.close()
    parsed.close()


def test_decisions_neither_an_array_nor_null_drop_their_entry_alone(tmp_path: Path) -> None:
    good = msgspec.json.encode(_entry("good")).decode()
    untraced = msgspec.json.encode(_entry("untraced", decisions=None)).decode()
    fields = list(msgspec.structs.astuple(_entry("bad")))
    fields[ENTRY_FIELDS.index("decisions")] = "x"
    bad = msgspec.json.encode(fields).decode()
    blocks = msgspec.json.encode(BLOCKS).decode()
    payload = f'{{"blocks": {blocks}, "entries": [{good}, {bad}, {untraced}]}}'
    batch = decode_batch(payload.encode())
    assert batch is not None and [e.request_id for e in batch.entries] == ["good", "untraced"]
    conn = connect(str(tmp_path / "l.db"))
    assert write_batch(conn, batch)
    assert [r[0] for r in conn.execute("SELECT request_id FROM usage ORDER BY 1")] == [
        "good",
        "untraced",
    ]
    assert list(_records(conn)) == ["good"]  # null decisions: a usage row, no trace
    conn.close()
