"""The Responses stream's byte templates (issue #45): each event whose framing is fixed
is put together from constant pieces and the JSON of what varies, and must be byte
for byte what `_sse` makes of the event's object, for any ids, indexes, sequence
numbers and text (every JSON-escaping case: quotes, backslashes, control characters,
non-ASCII, astral characters; a lone surrogate, which orjson refuses, refused alike)."""

from __future__ import annotations

import json
from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from support.chat_replies import live_chunks
from switchyard.api.responses_codec import check
from switchyard.api.responses_reply import (
    _CREATED,
    _IN_PROGRESS,
    _RESPONSE_DONE,
    ResponseEvents,
    Shell,
    _json_str,
    _sse,
    delta_event,
    message_added,
    message_done,
    response_event,
    text_delta_head,
)
from switchyard.reply import TypedChunk, read_typed

# Text with every case JSON escapes, and characters outside the BMP.
_ESCAPES = ['"', "\\", "/", "\n", "\r", "\t", "\b", "\f", "\x00", "\x1f", "\x7f", "\u2028"]
_text = st.text(
    alphabet=st.one_of(st.sampled_from(_ESCAPES), st.characters(exclude_categories=["Cs"])),
    max_size=40,
)
_ids = st.one_of(st.text(alphabet="abcdef0123456789_", min_size=1, max_size=40), _text)
_index = st.integers(0, 1000)
_seq = st.integers(0, 2**40)


def _events(out: bytes) -> list[bytes]:
    return [e + b"\n\n" for e in out.split(b"\n\n") if e]


def _text_chunk(text: str) -> TypedChunk:
    """A chunk that carries `text` and nothing else, read as the relay's data is."""
    return read_typed(orjson.dumps({"choices": [{"index": 0, "delta": {"content": text}}]}))


@settings(max_examples=300, deadline=None)
@given(_ids, _index, _seq)
def test_a_message_items_opening_events_are_the_bytes_of_their_objects(
    item_id: str, index: int, seq: int
) -> None:
    added = {
        "type": "response.output_item.added",
        "output_index": index,
        "item": {
            "id": item_id,
            "type": "message",
            "role": "assistant",
            "status": "in_progress",
            "content": [],
        },
        "sequence_number": seq,
    }
    part = {
        "type": "response.content_part.added",
        "item_id": item_id,
        "output_index": index,
        "content_index": 0,
        "part": {"type": "output_text", "text": "", "annotations": [], "logprobs": []},
        "sequence_number": seq + 1,
    }
    assert message_added(orjson.dumps(item_id), index, seq) == _sse(added) + _sse(part)


@settings(max_examples=300, deadline=None)
@given(_ids, _index, _text, _seq)
def test_a_message_items_closing_events_are_the_bytes_of_their_objects(
    item_id: str, index: int, text: str, seq: int
) -> None:
    where = {"item_id": item_id, "output_index": index, "content_index": 0}
    part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
    item = {
        "id": item_id,
        "type": "message",
        "role": "assistant",
        "status": "completed",
        "content": [part],
    }
    expected = (
        _sse({"type": "response.output_text.done", **where, "text": text, "logprobs": [],
              "sequence_number": seq})
        + _sse({"type": "response.content_part.done", **where, "part": part,
                "sequence_number": seq + 1})
        + _sse({"type": "response.output_item.done", "output_index": index, "item": item,
                "sequence_number": seq + 2})
    )  # fmt: skip
    assert message_done(orjson.dumps(item_id), index, text, seq) == expected


@settings(max_examples=200, deadline=None)
@given(_ids, _text, _seq)
def test_a_response_event_is_the_bytes_of_its_object(rid: str, text: str, seq: int) -> None:
    response = {"id": rid, "object": "response", "output": [{"text": text}], "usage": None}
    for head, kind in (
        (_CREATED, "response.created"),
        (_IN_PROGRESS, "response.in_progress"),
        (_RESPONSE_DONE["completed"], "response.completed"),
        (_RESPONSE_DONE["incomplete"], "response.incomplete"),
    ):
        made = response_event(head, orjson.dumps(response), seq)
        assert made == _sse({"type": kind, "response": response, "sequence_number": seq})


def test_a_lone_surrogate_is_refused_by_the_template_as_by_the_object() -> None:
    with pytest.raises(orjson.JSONEncodeError):
        _sse({"type": "response.output_text.done", "text": "\ud800"})
    with pytest.raises(orjson.JSONEncodeError):
        message_done(b'"msg_1"', 0, "\ud800", 0)
    # A text delta's string is msgspec's (no decoded chunk holds a lone surrogate):
    # refused too, by msgspec's own error.
    with pytest.raises(UnicodeEncodeError):
        delta_event(text_delta_head("msg_1", 0), "\ud800", 0)


@settings(max_examples=500, deadline=None)
@given(_text)
def test_a_text_deltas_string_is_the_json_orjson_writes(text: str) -> None:
    """The text delta's string is written by msgspec's encoder (cheaper for a token's
    few characters), every other string by orjson: the same bytes for any text."""
    assert _json_str(text) == orjson.dumps(text)


_calls = st.lists(
    st.tuples(
        st.from_regex(r"call_[a-z0-9]{1,8}", fullmatch=True),
        st.from_regex(r"[a-z_]{1,12}", fullmatch=True),
        st.dictionaries(st.text(max_size=4), _text, max_size=2),
    ),
    max_size=2,
)


@settings(max_examples=150, deadline=None)
@given(_text, _calls, st.sampled_from(["stop", "length", "tool_calls"]), st.integers(1, 9))
def test_every_event_of_a_stream_is_the_bytes_of_its_object_in_order(
    text: str, calls: list[tuple[str, str, dict[str, Any]]], finish: str, piece: int
) -> None:
    """A whole stream, templated events and object-made ones together: every event is
    `_sse` of the object its data holds, numbered 0, 1, 2, ...; the message's closing
    events carry the text the deltas told, and the final object is what was sent."""
    usage = {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}
    shell = Shell("resp_" + "4" * 32, check({"model": "m", "input": "x"}), "m")
    events = ResponseEvents(shell)
    out: list[bytes] = []
    for c in live_chunks(text, calls, finish, usage, piece):
        events.chunk(read_typed(json.dumps(c).encode()), out)
    events.end(out)
    sent = _events(b"".join(out))
    objs = [orjson.loads(e.split(b"\ndata: ", 1)[1]) for e in sent]
    assert [_sse(o) for o in objs] == sent
    assert [o["sequence_number"] for o in objs] == list(range(len(objs)))
    told = "".join(o["delta"] for o in objs if o["type"] == "response.output_text.delta")
    done = [o["text"] for o in objs if o["type"] == "response.output_text.done"]
    assert done == ([told] if told or not calls else [])
    assert objs[-1]["response"] == orjson.loads(orjson.dumps(events.final))
    assert objs[-1]["type"] == (
        "response.incomplete" if finish == "length" else "response.completed"
    )


@settings(max_examples=100, deadline=None)
@given(st.lists(_text.filter(bool), min_size=1, max_size=6), st.integers(1000, 1030))
def test_text_deltas_are_their_events_before_and_past_the_tails_made_once(
    texts: list[str], first: int
) -> None:
    """The text deltas' tails are made once for the first sequence numbers and formatted
    past them: on either side, and across, each delta is its event's bytes."""
    events = ResponseEvents(Shell("resp_" + "6" * 32, check({"model": "m", "input": "x"}), "m"))
    events.chunk(_text_chunk(texts[0]), [])  # started, the message open
    head = text_delta_head(events.output[0]["id"], 0)
    events.seq = first
    for text in texts:
        out: list[bytes] = []
        seq = events.seq
        events.chunk(_text_chunk(text), out)
        assert out == [delta_event(head, text, seq)]
        assert _events(out[0]) == [_sse(orjson.loads(out[0].split(b"\ndata: ", 1)[1]))]
