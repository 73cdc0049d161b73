"""A batch's frame, joined from its pieces in one copy: the same JSON object whatever
the batch holds (rows, stored responses, both), its length in the header."""

from __future__ import annotations

import io

import msgspec
import pytest

from switchyard.state.ledger_batch import BATCH, FLUSH, decode_batch, frame, read_frame
from switchyard.state.ledger_rows import batch_json, batch_parts

TEMPLATES = {"t1": [("authorize", "allowed", "ok", {"model": "m"})], "t2": [("a", "b", "c", None)]}


@pytest.mark.parametrize(
    ("rows", "responses"),
    [
        ([(b'["a",1]', ("t1",)), (b'["b",2]', ()), (b'["c",3]', ("t1",))], None),
        ([], [b'["r1"]', b'["r2"]']),
        ([(b'["a",1]', ())], [b'["r1"]']),
    ],
)
def test_a_batch_frame_is_its_json_object_whole(
    rows: list[tuple[bytes, tuple[str, ...]]], responses: list[bytes] | None
) -> None:
    data = frame(BATCH, *batch_parts(rows, TEMPLATES, responses))
    got = read_frame(io.BytesIO(data + frame(FLUSH, b"12345678")))
    assert got is not None and got[0] == BATCH
    assert got[1] == batch_json(rows, TEMPLATES, responses)
    parsed = msgspec.json.decode(got[1])
    assert parsed["entries"] == [msgspec.json.decode(r) for r, _ in rows]
    assert parsed.get("responses") == (
        [msgspec.json.decode(r) for r in responses] if responses else None
    )
    used = {i for _, ids in rows for i in ids}
    assert set(parsed["blocks"]) == used


def test_a_frame_of_one_piece_is_header_and_payload() -> None:
    assert frame(FLUSH, b"12345678") == b"F\x00\x00\x00\x0812345678"
    assert frame(FLUSH) == b"F\x00\x00\x00\x00"
    assert decode_batch(batch_json([], TEMPLATES)) is not None
