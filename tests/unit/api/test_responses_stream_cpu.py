"""The cheaper reading of a translated stream's chunks (issue #45): the relay's data of
the usual shape is read straight into typed structs (reply.read_typed), whose parts
(reply.typed_parts) are the chunk object's (reply.chunk_parts of reply.read_chunk), and
`ResponseEvents.chunk` reads a chunk that carries text and nothing else off the struct
itself; whatever reading a chunk took, its events are the same. All are property tests
over chunks of every shape, the malformed included."""

from __future__ import annotations

import asyncio
import json
import re
from types import SimpleNamespace
from typing import Any

import msgspec
import orjson
from hypothesis import given, settings
from hypothesis import strategies as st

from support.chat_replies import live_chunks
from switchyard.api.responses_codec import check
from switchyard.api.responses_reply import ResponseEvents, Shell
from switchyard.api.sse import translated
from switchyard.pipeline import Status
from switchyard.reply import (
    ChunkParts,
    TypedChunk,
    chunk_parts,
    read_chunk,
    read_typed,
    typed_parts,
)

_scalar = st.one_of(st.none(), st.booleans(), st.integers(-5, 5), st.text(max_size=8), st.just(""))
_json = st.recursive(
    _scalar,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=5), inner, max_size=3)
    ),
    max_leaves=6,
)
_call = st.fixed_dictionaries(
    {},
    optional={
        "index": st.one_of(st.integers(0, 3), _scalar),
        "id": _scalar,
        "type": st.just("function"),
        "function": st.one_of(
            st.fixed_dictionaries(
                {}, optional={"name": _scalar, "arguments": st.one_of(_scalar, _json)}
            ),
            _scalar,
        ),
    },
)
_delta = st.one_of(
    st.fixed_dictionaries(
        {},
        optional={
            "role": st.just("assistant"),
            "content": st.one_of(st.text(max_size=20), _scalar, _json),
            "tool_calls": st.one_of(st.lists(st.one_of(_call, _scalar), max_size=3), _json),
            "refusal": _scalar,
        },
    ),
    _json,
)
_choice = st.one_of(
    st.fixed_dictionaries(
        {},
        optional={
            "index": st.integers(0, 2),
            "delta": _delta,
            "logprobs": st.none(),
            "finish_reason": st.one_of(
                st.sampled_from(["stop", "length", "tool_calls", ""]), _scalar
            ),
        },
    ),
    _json,
)
_usage = st.one_of(
    st.fixed_dictionaries(
        {"prompt_tokens": st.integers(0, 99), "completion_tokens": st.integers(0, 99)}
    ),
    _json,
)
_chunk = st.fixed_dictionaries(
    {},
    optional={
        "id": st.one_of(st.just("chatcmpl-1"), _scalar),
        "object": st.just("chat.completion.chunk"),
        "created": st.integers(0, 2**31),
        "model": st.text(max_size=8),
        "choices": st.one_of(st.lists(_choice, max_size=3), _json),
        "usage": _usage,
        "extra": _json,
    },
)


def _outcome(read: Any, data: bytes) -> Any:
    """What reading `data` gives: its parts, or the kind of error it raises."""
    try:
        return read(data)
    except msgspec.DecodeError as exc:
        return type(exc)


def _typed_or_general(data: bytes) -> ChunkParts:
    """The parts as `translated` reads them: typed when the data has the usual shape,
    as a chunk object when it has any other."""
    try:
        return typed_parts(read_typed(data))
    except msgspec.ValidationError:
        return chunk_parts(read_chunk(data))


@settings(max_examples=600, deadline=None)
@given(st.one_of(_chunk, _json))
def test_a_chunk_read_typed_has_the_parts_of_the_chunk_object(obj: Any) -> None:
    """Whatever the data (a chunk of the usual shape, a malformed one, JSON that is no
    object), reading it typed where it has the usual shape gives what
    `chunk_parts(read_chunk(...))` gives, or raises the same error."""
    data = json.dumps(obj).encode()
    assert _outcome(_typed_or_general, data) == _outcome(lambda d: chunk_parts(read_chunk(d)), data)


# Chunks of the usual shape only (every member of the type the typed reading admits,
# so none falls back to the general reading): the equivalence of the typed path itself,
# over many more of its own inputs than the mixed strategy above gives it.
_text_or_none = st.one_of(st.none(), st.just(""), st.text(max_size=12))
_usual_choice = st.fixed_dictionaries(
    {},
    optional={
        "index": st.integers(0, 2),
        "delta": st.fixed_dictionaries(
            {},
            optional={
                "role": st.just("assistant"),
                "content": _text_or_none,
                "tool_calls": st.one_of(st.none(), st.lists(st.one_of(_call, _scalar), max_size=3)),
                "refusal": _scalar,
            },
        ),
        "logprobs": st.none(),
        "finish_reason": st.one_of(
            st.none(), st.sampled_from(["stop", "length", "tool_calls", ""]), st.text(max_size=4)
        ),
    },
)
_usual_chunk = st.fixed_dictionaries(
    {},
    optional={
        "id": st.just("chatcmpl-1"),
        "object": st.just("chat.completion.chunk"),
        "choices": st.one_of(st.none(), st.lists(_usual_choice, max_size=2)),
        "usage": st.one_of(st.none(), _usage.filter(lambda u: isinstance(u, dict))),
    },
)


@settings(max_examples=600, deadline=None)
@given(_usual_chunk)
def test_a_chunk_of_the_usual_shape_read_typed_has_the_parts_of_the_chunk_object(
    obj: dict[str, Any],
) -> None:
    """A chunk whose members are all of the types the typed reading admits (text and
    finish strings, empty or not, or null; calls a list or null; usage an object or
    null) is read without the general path, and its parts are `chunk_parts`'s."""
    data = json.dumps(obj).encode()
    chunk = read_typed(data)  # the typed path, not the fallback
    assert isinstance(chunk, TypedChunk)
    assert typed_parts(chunk) == chunk_parts(read_chunk(data))


def test_data_that_is_not_json_raises_as_the_chunk_reader_does() -> None:
    for data in (b"", b"{", b'{"choices": [', b"not json"):
        got = _outcome(read_typed, data)  # not a ValidationError: `translated` lets it out
        assert got is _outcome(read_chunk, data) is msgspec.DecodeError


def _shell() -> Shell:  # the same ids and times, so two streams can be compared
    req = check({"model": "m", "input": "x"})
    return Shell("resp_" + "3" * 32, req, "m", created_at=1.0, ids=lambda p: f"{p}_1")


def _timeless(events: bytes) -> bytes:
    return re.sub(rb'"completed_at":\d+', b'"completed_at":0', events)


@settings(max_examples=150, deadline=None)
@given(
    st.text(max_size=40),
    st.lists(
        st.tuples(
            st.from_regex(r"call_[a-z0-9]{1,6}", fullmatch=True),
            st.sampled_from(["lookup", "send"]),
            st.dictionaries(st.sampled_from("abc"), st.integers(), max_size=2),
        ),
        max_size=2,
    ),
    st.sampled_from(["stop", "length", "tool_calls"]),
    st.integers(1, 12),
    st.lists(st.sampled_from([b"[1]", b'"text"', b"null", b"3"]), max_size=3),
)
def test_a_stream_translated_from_its_data_is_the_stream_from_chunk_objects(
    text: str,
    calls: list[tuple[str, str, dict[str, Any]]],
    finish: str,
    piece: int,
    noise: list[bytes],
) -> None:
    """The relay's data through `translated` (the usual chunk read typed) and the same
    chunks handed over as chunk objects make the same bytes; data that is no object
    adds no event either way."""
    usage = {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}
    chunks = live_chunks(text, calls, finish, usage, piece)
    data = [json.dumps(c).encode() for c in chunks]
    batch = [*noise, *data[:1], *noise, *data[1:]]

    async def source() -> Any:
        yield batch

    async def run() -> bytes:
        ctx: Any = SimpleNamespace(status=Status.OK)
        events = ResponseEvents(_shell())
        return b"".join([b async for b in translated(ctx, source(), events)])

    streamed = _timeless(asyncio.run(run()))
    written: list[bytes] = []
    events = ResponseEvents(_shell())
    for c in chunks:
        events.chunk(read_chunk(json.dumps(c).encode()), written)
    events.end(written)
    assert streamed == _timeless(b"".join(written))
    assert b"event: response.completed" in streamed or finish == "length"


def _translation(chunks: list[Any]) -> tuple[Any, ...]:
    """What a stream's events make of these chunks, each handed over as it is (a typed
    chunk, a chunk object): the events written for each, then its closing events, and
    the state they leave; or the error a chunk raised, and the events before it."""
    events = ResponseEvents(_shell())
    written: list[bytes] = []
    for c in chunks:
        out: list[bytes] = []
        try:
            events.chunk(c, out)
        except Exception as exc:  # compared, not swallowed
            return written, type(exc), str(exc)
        written.append(b"".join(out))
    state = (events.seq, events.output, events.usage, events.finish, events._text)
    out = []
    events.end(out)
    return written, state, _timeless(b"".join(out)), events.status


@settings(max_examples=400, deadline=None)
@given(st.lists(st.one_of(_usual_chunk, _chunk), max_size=8))
def test_a_stream_of_chunks_read_typed_makes_the_events_of_the_chunk_objects(
    objs: list[dict[str, Any]],
) -> None:
    """Chunks of any shape, one after another (text alone, text with calls, a finish,
    usage, malformed members): each handed over as `translated` reads it (typed when
    it has the usual shape, so a chunk that carries text and nothing else is read off
    its struct) writes the events, and leaves the state, that the chunk object does
    through the one rule of its parts (`chunk_parts`)."""
    data = [json.dumps(o).encode() for o in objs]
    typed: list[Any] = []
    for d in data:
        try:
            typed.append(read_typed(d))
        except msgspec.ValidationError:
            typed.append(read_chunk(d))
    assert _translation(typed) == _translation([read_chunk(d) for d in data])


# Chunks on either side of the shortcut's every test: text or not (none, a number, other
# JSON), beside calls (none, empty, some), a finish, usage, no choice, a null delta.
_near_plain = st.fixed_dictionaries(
    {
        "choices": st.one_of(
            st.lists(
                st.fixed_dictionaries(
                    {
                        "index": st.just(0),
                        "delta": st.one_of(
                            st.none(),
                            st.fixed_dictionaries(
                                {
                                    "content": st.one_of(
                                        st.text(max_size=6), st.none(), st.integers(0, 2), _json
                                    )
                                },
                                optional={
                                    "role": st.just("assistant"),
                                    "tool_calls": st.one_of(st.none(), st.lists(_call, max_size=2)),
                                },
                            ),
                        ),
                    },
                    optional={"finish_reason": st.one_of(st.none(), st.sampled_from(["stop", ""]))},
                ),
                min_size=1,
                max_size=1,
            ),
            st.just([]),
            st.none(),
        )
    },
    optional={"usage": st.one_of(st.none(), _usage.filter(lambda u: isinstance(u, dict)))},
)


@settings(max_examples=500, deadline=None)
@given(st.lists(_near_plain, min_size=1, max_size=6))
def test_a_chunk_read_off_its_struct_as_text_alone_is_one_that_has_nothing_else(
    objs: list[dict[str, Any]],
) -> None:
    """Chunks of the usual shape that carry text and nothing else, and chunks that
    carry one thing more (calls, even an empty list, a finish, even an empty one,
    usage) or less (no text, no choice, a null delta): read typed, each writes what
    its chunk object writes, so the shortcut takes exactly the chunks whose parts are
    their text alone."""
    data = [orjson.dumps(o) for o in objs]
    typed = [read_typed(d) for d in data]
    assert all(isinstance(c, TypedChunk) for c in typed)
    assert _translation(typed) == _translation([read_chunk(d) for d in data])


_states = st.lists(
    st.tuples(
        st.sampled_from(
            ["queued", "in_progress", "completed", "failed", "incomplete", "cancelled"]
        ),
        st.lists(st.fixed_dictionaries({"id": st.text(max_size=4)}), max_size=2),
        st.one_of(st.none(), st.fixed_dictionaries({"total_tokens": st.integers(0, 9)})),
        st.one_of(st.none(), st.fixed_dictionaries({"code": st.text(max_size=4)})),
        st.one_of(st.none(), st.just("max_output_tokens")),
        st.text(max_size=6),
    ),
    min_size=1,
    max_size=5,
)
_requests = st.fixed_dictionaries(
    {"model": st.just("m"), "input": st.just("x")},
    optional={
        "instructions": st.text(max_size=8),
        "max_output_tokens": st.integers(16, 99),
        "temperature": st.floats(0, 2),
        "top_p": st.floats(0, 1),
        "parallel_tool_calls": st.booleans(),
        "store": st.booleans(),
        "metadata": st.dictionaries(st.sampled_from("ab"), st.text(max_size=4), max_size=2),
        # Not `required`: it forces a call, and these requests offer no tool.
        "tool_choice": st.sampled_from(["auto", "none"]),
    },
)


@settings(max_examples=200, deadline=None)
@given(_requests, _states)
def test_each_state_of_a_response_is_the_object_a_fresh_shell_makes(
    body: dict[str, Any], states: list[tuple[Any, ...]]
) -> None:
    """A shell encodes the members its states repeat once, at its first state: whatever
    states came before (the stream's `in_progress`, then its end), each state's object
    is the one a shell that made no state before gives, member for member and in order."""
    req = check(body)
    shell = Shell("resp_" + "4" * 32, req, "m", created_at=5.0)
    for status, output, usage, error, incomplete, model in states:
        shell.model = model
        fresh = Shell("resp_" + "4" * 32, req, model, created_at=5.0)
        got = shell.object(status, output, usage, error, incomplete)
        want = fresh.object(status, output, usage, error, incomplete)
        got.pop("completed_at")
        done_at = want.pop("completed_at")
        assert (done_at is not None) == (status == "completed")
        assert list(got.items()) == list(want.items())
        assert got["usage"] == (
            usage if status in ("completed", "failed", "incomplete", "cancelled") else None
        )
        assert got["incomplete_details"] == ({"reason": incomplete} if incomplete else None)
