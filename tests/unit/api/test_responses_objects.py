"""A response object's encoding (issue #45): `Shell.encoded` puts each state of the
object together from runs of members encoded once per response and the JSON of what
the state sets. It must be byte for byte what orjson makes of the object written out
member by member (the Responses API's `response` object, in its order), for any
request's echo (instructions, tools, text format, metadata with every JSON-escaping
case), any state, output, usage, error and model, whatever states came before; and
`ResponseEvents` must carry and keep exactly those bytes."""

from __future__ import annotations

import json
import time
from typing import Any

import orjson
from hypothesis import given, settings
from hypothesis import strategies as st

from support.chat_replies import chat_reply, live_chunks
from switchyard.api.responses_codec import ResponsesRequest, check
from switchyard.api.responses_reply import (
    ResponseEvents,
    Shell,
    response_json,
    to_response,
)
from switchyard.errors import UpstreamError
from switchyard.reply import read_typed

_ESCAPES = ['"', "\\", "/", "\n", "\x00", "\x1f", "\x7f", "\u2028", "\U0001f600"]
_text = st.text(
    alphabet=st.one_of(st.sampled_from(_ESCAPES), st.characters(exclude_categories=["Cs"])),
    max_size=12,
)
_schema = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-(2**40), 2**40), _text),
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(_text, inner, max_size=3)),
    max_leaves=6,
)
_tool = st.fixed_dictionaries(
    {"type": st.just("function"), "name": st.sampled_from(["f", "g.h", "a-b_c"])},
    optional={"description": _text, "parameters": st.dictionaries(_text, _schema, max_size=3)},
)
_any_requests = st.fixed_dictionaries(
    {"model": st.just("m"), "input": _text.filter(bool)},
    optional={
        "instructions": _text,
        "max_output_tokens": st.integers(16, 2**31 - 1),
        "temperature": st.one_of(st.integers(0, 2), st.floats(0, 2)),
        "top_p": st.floats(0, 1),
        "parallel_tool_calls": st.booleans(),
        "store": st.just(True),
        "background": st.booleans(),
        "previous_response_id": st.just("resp_" + "ab" * 16),
        "metadata": st.dictionaries(_text, _text, max_size=3),
        "tools": st.lists(_tool, max_size=2, unique_by=lambda t: t["name"]),
        "tool_choice": st.sampled_from(["auto", "none", "required"]),
        "text": st.sampled_from(
            [
                {},
                {"format": {"type": "text"}},
                {"format": {"type": "json_object"}},
                {"format": {"type": "json_schema", "name": "w", "schema": {"a": ["\u2028"]}}},
            ]
        ),
    },
)
# `required` forces a call: only with a tool to answer it (a check refuses it otherwise).
_requests = _any_requests.filter(lambda b: b.get("tool_choice") != "required" or b.get("tools"))
_states = st.lists(
    st.tuples(
        st.sampled_from(["in_progress", "completed", "incomplete", "failed", "cancelled"]),
        st.lists(st.dictionaries(_text, _schema, max_size=3), max_size=2),
        st.one_of(st.none(), st.dictionaries(_text, st.integers(0, 99), max_size=2)),
        st.one_of(st.none(), st.fixed_dictionaries({"code": _text, "message": _text})),
        st.one_of(st.none(), st.just(""), st.just("max_output_tokens"), _text),
        _text,
    ),
    min_size=1,
    max_size=4,
)


def _object(
    req: ResponsesRequest,
    rid: str,
    created_at: float,
    completed_at: int | None,
    state: tuple[Any, ...],
) -> dict[str, Any]:
    """The response object in this state, written out member by member."""
    status, output, usage, error, incomplete, model = state
    echo = req.echo
    return {
        "id": rid,
        "object": "response",
        "created_at": int(created_at),
        "status": status,
        "completed_at": completed_at,
        "background": req.background,
        "error": error,
        "incomplete_details": {"reason": incomplete} if incomplete else None,
        "instructions": req.instructions,
        "max_output_tokens": echo.get("max_output_tokens"),
        "model": model,
        "output": output,
        "parallel_tool_calls": echo.get("parallel_tool_calls", True),
        "previous_response_id": req.previous_response_id,
        "store": req.store,
        "temperature": echo.get("temperature"),
        "top_p": echo.get("top_p"),
        "text": echo.get("text") or {"format": {"type": "text"}},
        "tool_choice": echo.get("tool_choice", "auto"),
        "tools": echo.get("tools") or [],
        "truncation": "disabled",
        "metadata": echo.get("metadata") or {},
        "usage": usage if status in ("completed", "failed", "incomplete", "cancelled") else None,
    }


@settings(max_examples=400, deadline=None)
@given(_requests, _states, _text, st.floats(0, 2e9))
def test_each_state_is_the_bytes_of_the_object_written_out(
    body: dict[str, Any], states: list[tuple[Any, ...]], rid: str, created_at: float
) -> None:
    req = check(body)
    shell = Shell(rid, req, "first", created_at=created_at)
    for state in states:
        status, output, usage, error, incomplete, model = state
        shell.model = model
        before = int(time.time())
        got = shell.encoded(status, orjson.dumps(output), usage, error, incomplete)
        after = int(time.time())
        completed_at = orjson.loads(got)["completed_at"]
        if status == "completed":
            assert before <= completed_at <= after
        else:
            assert completed_at is None
        want = _object(req, rid, created_at, completed_at, state)
        assert got == orjson.dumps(want)
        assert (
            shell.object(status, output, usage, error, incomplete) | {"completed_at": completed_at}
            == want
        )


_calls = st.lists(
    st.tuples(
        st.text(alphabet="abc", min_size=1, max_size=4),
        st.sampled_from(["f", "g"]),
        st.dictionaries(st.sampled_from("xy"), st.integers(0, 9), max_size=2),
    ),
    max_size=2,
)
_USAGE = {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}


def _shell(body: dict[str, Any]) -> Shell:
    return Shell("resp_" + "5" * 32, check(body), "m", created_at=7.0, ids=lambda p: p + "_1")


@settings(max_examples=150, deadline=None)
@given(_requests, _text, _calls, st.sampled_from(["stop", "length", "tool_calls"]))
def test_a_whole_reply_and_its_stream_carry_the_object_they_keep(
    body: dict[str, Any], text: str, calls: list[tuple[str, str, dict[str, Any]]], finish: str
) -> None:
    """The whole reply's JSON is its object's encoding; a stream's last event carries the
    bytes it keeps for the store (`final_json`), which read back as `final`; both are
    the object written out for the same output, usage and state."""
    chat = chat_reply(text, calls, finish, _USAGE)
    status, whole = response_json(chat, _shell(body))
    obj = orjson.loads(whole)
    assert status == obj["status"] == ("incomplete" if finish == "length" else "completed")
    state = (status, obj["output"], obj["usage"], None, obj["incomplete_details"], "m")
    if obj["incomplete_details"] is not None:
        state = (*state[:4], "max_output_tokens", "m")
    want = _object(check(body), "resp_" + "5" * 32, 7.0, obj["completed_at"], state)
    assert whole == orjson.dumps(want)
    assert to_response(chat, _shell(body)) | {"completed_at": obj["completed_at"]} == want

    events = ResponseEvents(_shell(body))
    out: list[bytes] = []
    for c in live_chunks(text, calls, finish, _USAGE, 3):
        events.chunk(read_typed(json.dumps(c).encode()), out)
    events.end(out)
    last = b"".join(out).split(b"\n\n")[-2].split(b"\ndata: ", 1)[1]
    assert events.final_json is not None and events.status == status
    assert orjson.loads(last)["response"] == orjson.loads(events.final_json)
    assert last.endswith(
        b',"response":' + events.final_json + b',"sequence_number":%d}' % (events.seq - 1)
    )
    assert events.final == orjson.loads(events.final_json)


def test_a_broken_stream_keeps_the_failed_object_its_last_event_carried() -> None:
    events = ResponseEvents(_shell({"model": "m", "input": "x"}))
    out: list[bytes] = []
    events.chunk(read_typed(b'{"choices":[{"delta":{"content":"half"}}]}'), out)
    events.failed(UpstreamError("the upstream ended the stream early"), out)
    last = orjson.loads(b"".join(out).split(b"\n\n")[-2].split(b"\ndata: ", 1)[1])
    assert events.status == "failed" and events.final_json is not None
    assert last["type"] == "response.failed"
    assert last["response"] == events.final == orjson.loads(events.final_json)
    assert last["response"]["error"]["code"] == "server_error"  # OpenAI's code for it
    assert last["response"]["output"][0]["content"][0]["text"] == "half"
