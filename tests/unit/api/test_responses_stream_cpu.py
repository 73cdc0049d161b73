"""The cheaper reading of a translated stream's chunks (issue #45): the relay's data is
read straight into a chunk's parts (reply.read_parts) rather than into a chunk object
and then its parts, and a translator that takes parts (api/responses_reply.py's
ResponseEvents) writes the same events either way. Both claims are property tests over
chunks of every shape, the malformed included."""

from __future__ import annotations

import asyncio
import json
import re
from types import SimpleNamespace
from typing import Any

import msgspec
from hypothesis import given, settings
from hypothesis import strategies as st

from support.chat_replies import live_chunks
from switchyard.api.responses_codec import check
from switchyard.api.responses_reply import ResponseEvents, Shell
from switchyard.api.sse import translated
from switchyard.pipeline import Status
from switchyard.reply import _read_typed, _TypedChunk, chunk_parts, read_chunk, read_parts

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


@settings(max_examples=600, deadline=None)
@given(st.one_of(_chunk, _json))
def test_a_chunk_read_into_its_parts_has_the_parts_of_the_chunk_object(obj: Any) -> None:
    """Whatever the data (a chunk of the usual shape, a malformed one, JSON that is no
    object), `read_parts` gives what `chunk_parts(read_chunk(...))` gives, or raises
    the same error."""
    data = json.dumps(obj).encode()
    assert _outcome(read_parts, data) == _outcome(lambda d: chunk_parts(read_chunk(d)), data)


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
    assert isinstance(_read_typed(data), _TypedChunk)  # the typed path, not the fallback
    assert read_parts(data) == chunk_parts(read_chunk(data))


def test_data_that_is_not_json_raises_as_the_chunk_reader_does() -> None:
    for data in (b"", b"{", b'{"choices": [', b"not json"):
        got = _outcome(read_parts, data)
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
def test_a_stream_translated_from_parts_is_the_stream_from_chunk_objects(
    text: str,
    calls: list[tuple[str, str, dict[str, Any]]],
    finish: str,
    piece: int,
    noise: list[bytes],
) -> None:
    """The relay's data through `translated` (read into parts) and the same chunks
    handed over as chunk objects make the same bytes; data that is no object adds no
    event either way."""
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
        "max_output_tokens": st.integers(1, 99),
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
