"""A hostile upstream under the Responses and Messages streams: chat completion chunks no
engine should send (tool-call deltas interleaved or with an index that is no number,
arguments that never become JSON, a second choice the client never asked for, an
`error` object after some content, a refusal, reasoning deltas), as a Responses client
(`client.responses.stream`) and a Messages client (`client.messages.stream`) read them
through the gateway's translation (api/sse.py `translated`, api/responses_reply.py
`ResponseEvents`, api/messages_reply.py `MessageEvents`). Over sockets against one real
gateway in front of a hostile upstream of tests/support/hostile_upstream.py.

Defects these tests find (each fails on today's code):
- an upstream `error` event after some content, then `[DONE]`: reply.py `relay` marks
  the stream incomplete without raising, so api/sse.py `translated` neither ends nor
  fails it: the Responses client gets no `response.completed`, `response.failed` nor
  `error` (the SDK: "Didn't receive a `response.completed` event") and the stored
  response says `incomplete`, `client_disconnected`; the Messages client gets neither
  `message_stop` nor an `error` event;
- a chunk of choice 1 (for a client that asked for one) is read as the answer:
  reply.py `chunk_parts`/`typed_parts` read `choices[0]` whatever its `index`, so
  another choice's text reaches the Responses and the Messages client;
- arguments that never become JSON: the Messages stream relays them as
  `input_json_delta`, which the anthropic SDK cannot parse (ValueError mid-stream),
  where the whole reply wraps them as `{"_arguments": ...}` (messages_reply.py
  `_input`); the Responses stream hands them over as a completed call of a completed
  response;
- a refusal delta (`delta.refusal`) is dropped (reply.py `_parts` reads `content`):
  the Responses client gets an empty `completed` message, the Messages client an
  empty `end_turn`;
- `finish_reason: content_filter` is a `completed` response (ResponseEvents.end reads
  `length` alone), not `incomplete` with reason `content_filter`;
- the first finish does not end a choice: text after it joins the answer, and a
  `stop` after a `length` makes a cut answer `completed` / `end_turn`.

Gaps guarded (pass today; no other test covers them): a stream without `[DONE]` is
`error` + `response.failed`, stored so, and an `error` event on Messages; one delta past
MAX_EVENT_BYTES fails both streams the same way; interleaved tool-call deltas and a
call index that is no number reach both clients whole and in order (the tool gate,
policy/tool_calls_gate.py, holds keyed calls and renumbers them); reasoning deltas are
not presented as the answer's text; `content_filter` is a Messages `refusal`.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import anthropic
import pytest

from support.chat_replies import calls_reply
from support.gateways import CHEAP_PRICE, Gateway, start_gateway
from support.hostile_upstream import (
    DONE_EVENT,
    USAGE_EVENT,
    Hostile,
    call_event,
    chunk_event,
    hostile_upstream,
    json_reply,
    sse_event,
    sse_reply,
)
from support.stream_reads import stored, streamed, terminal

TOOLS: list[Any] = [{"type": "function", "name": "lookup", "parameters": {"type": "object"}}]
MTOOLS: list[Any] = [{"name": "lookup", "input_schema": {"type": "object"}}]
OTHER = "LEAK-FROM-CHOICE-ONE"
REFUSAL = "I can't help with that."
THOUGHT = "secret chain of thought"
NOT_JSON = ['{"q": ', "oops}"]


_event, _chunk, _call, DONE, USAGE = sse_event, chunk_event, call_event, DONE_EVENT, USAGE_EVENT
WHOLE_NOT_JSON = calls_reply(
    [
        {
            "id": "call_x",
            "type": "function",
            "function": {"name": "lookup", "arguments": "".join(NOT_JSON)},
        }
    ],
    {"prompt_tokens": 5, "completion_tokens": 7},
)

REPLIES = {
    # The engine broke off with an error object, then ended as if complete.
    "errmid": sse_reply(
        _chunk({"role": "assistant", "content": "The first half of"}),
        _event({"error": {"message": "the engine ran out of memory", "type": "server_error"}}),
        DONE,
    ),
    # The stream stops: no finish, no [DONE].
    "nodone": sse_reply(_chunk({"role": "assistant", "content": "The first half of"})),
    # A second choice beside the one asked for, in chunks of its own.
    "twochoices": sse_reply(
        _chunk({"role": "assistant", "content": "Paris"}),
        _chunk({"role": "assistant", "content": OTHER}, index=1),
        _chunk({}, "stop"),
        _chunk({}, "stop", index=1),
        USAGE,
        DONE,
    ),
    # Two calls whose deltas interleave (as an engine may send parallel calls).
    "interleaved": sse_reply(
        _call(0, "", head="a"),
        _call(1, "", head="b"),
        _call(0, '{"q": "a"}'),
        _call(1, '{"q": "b"}'),
        _chunk({}, "tool_calls"),
        USAGE,
        DONE,
    ),
    # A call whose index is no number.
    "listindex": sse_reply(_call([1], '{"q": "a"}', head="a"), _chunk({}, "tool_calls"), DONE),
    # A call whose arguments never become JSON.
    "notjson": sse_reply(
        _call(0, "", head="x"),
        *(_call(0, piece) for piece in NOT_JSON),
        _chunk({}, "tool_calls"),
        USAGE,
        DONE,
    ),
    "notjson-whole": json_reply(json.dumps(WHOLE_NOT_JSON).encode()),
    "refusal": sse_reply(
        _chunk({"role": "assistant", "content": None, "refusal": REFUSAL}),
        _chunk({}, "stop"),
        USAGE,
        DONE,
    ),
    # The engine's content filter stopped the answer part way.
    "filtered": sse_reply(
        _chunk({"role": "assistant", "content": "The first half of"}),
        _chunk({}, "content_filter"),
        USAGE,
        DONE,
    ),
    # One delta past the gateway's bound on a stream event (engines/upstream.py
    # MAX_EVENT_BYTES, 4 MiB).
    "huge": sse_reply(
        _chunk({"role": "assistant", "content": "start"}),
        _chunk({"content": "x" * (5 << 20)}),
        _chunk({}, "stop"),
        DONE,
    ),
    # Text after the choice's finish, and a second finish that contradicts the first.
    "afterfinish": sse_reply(
        _chunk({"role": "assistant", "content": "Paris"}),
        _chunk({}, "stop"),
        _chunk({"content": " and Rome"}),
        DONE,
    ),
    "twofinishes": sse_reply(
        _chunk({"role": "assistant", "content": "Paris"}),
        _chunk({}, "length"),
        _chunk({}, "stop"),
        DONE,
    ),
    "reasoning": sse_reply(
        _chunk({"role": "assistant", "reasoning_content": THOUGHT}),
        _chunk({"reasoning": THOUGHT}),
        _chunk({"content": "42"}),
        _chunk({}, "stop"),
        USAGE,
        DONE,
    ),
}


@pytest.fixture(scope="module")
def up() -> Iterator[Hostile]:
    with hostile_upstream(REPLIES) as hostile:
        yield hostile


@pytest.fixture(scope="module")
def gw(up: Hostile) -> Iterator[Gateway]:
    models = up.models(REPLIES, CHEAP_PRICE)
    g = start_gateway({"models": models, "embeddings": {"enabled": False}})
    yield g
    g.proc.stop()


# -- reading the two protocols' streams --------------------------------------------------


def _responses(gw: Gateway, key: str, model: str, **more: Any) -> list[tuple[str, dict[str, Any]]]:
    return streamed(
        gw, key, "/v1/responses", {"model": model, "input": "hi", "tools": TOOLS, **more}
    )


def _messages(gw: Gateway, key: str, model: str) -> list[tuple[str, dict[str, Any]]]:
    body = {"model": model, "max_tokens": 64, "tools": MTOOLS,
            "messages": [{"role": "user", "content": "hi"}]}  # fmt: skip
    return streamed(gw, key, "/v1/messages", body)


def _sdk(gw: Gateway, key: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=gw.url, api_key=key, max_retries=0)


def _final_message(gw: Gateway, key: str, model: str) -> Any:
    with _sdk(gw, key).messages.stream(
        model=model, max_tokens=64, tools=MTOOLS, messages=[{"role": "user", "content": "hi"}]
    ) as stream:
        return stream.get_final_message()


def _final_response(gw: Gateway, key: str, model: str) -> Any:
    with gw.openai(key).responses.stream(model=model, input="hi", tools=TOOLS) as stream:
        for _ in stream:
            pass
        return stream.get_final_response()


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def _text(response: dict[str, Any]) -> str:
    return "".join(
        part.get("text", "")
        for item in response["output"]
        if item["type"] == "message"
        for part in item["content"]
    )


# -- an error object after some content --------------------------------------------------


@pytest.mark.parametrize("model", ["errmid", "nodone"])
def test_a_broken_off_responses_stream_ends_failed_and_is_stored_so(
    gw: Gateway, model: str
) -> None:
    """A stream the engine broke off is `error` then `response.failed` for the client,
    the stored response is that failed response, and the ledger row is not `ok`. Today
    (errmid) an `error` object followed by `[DONE]` ends the client's stream with
    neither: reply.py `relay` sets INCOMPLETE without raising, and api/sse.py
    `translated` then sends no end at all; the stored response says `incomplete`
    (a client that left). nodone (no `[DONE]`) passes."""
    tenant, key = gw.new_tenant("err")
    events = _responses(gw, key, model)
    kinds = [k for k, _ in events]
    assert "error" in kinds, kinds
    final = terminal(events)
    assert final["status"] == "failed", final
    assert kinds[-1] == "response.failed", kinds
    # The stream's row before the GET below, which is a request of the tenant's too.
    rows = gw.stored_rows(tenant)
    assert [r["status"] for r in rows] == ["incomplete"], rows
    assert stored(gw, key, final["id"]) == final


def test_a_broken_off_responses_stream_is_read_to_its_failure_by_the_sdk(gw: Gateway) -> None:
    """The openai SDK's stream helper reads a broken stream to its `response.failed`
    (and sees the `error` event), rather than to a silent end."""
    _, key = gw.new_tenant("err")
    with gw.openai(key).responses.stream(model="errmid", input="hi") as stream:
        kinds = [e.type for e in stream]
    assert kinds[-2:] == ["error", "response.failed"], kinds


@pytest.mark.parametrize("model", ["errmid", "nodone"])
def test_a_broken_off_messages_stream_ends_in_an_error_event(gw: Gateway, model: str) -> None:
    """A Messages client of a broken stream gets Anthropic's `error` event last, never
    `message_stop`. Today (errmid) the stream just stops after the text delta, and the
    SDK's final message is the text so far with `stop_reason: None`. nodone passes."""
    _, key = gw.new_tenant("err")
    events = _messages(gw, key, model)
    kinds = [k for k, _ in events]
    assert kinds and kinds[-1] == "error", kinds
    assert "message_stop" not in kinds, kinds
    assert events[-1][1]["type"] == "error" and events[-1][1]["error"]["type"], events[-1]


# -- another choice ----------------------------------------------------------------------


def test_another_choice_never_reaches_a_responses_client(gw: Gateway) -> None:
    """Only choice 0 is the answer. Today choice 1's chunk is read as the answer
    (reply.py `typed_parts` reads `choices[0]` whatever its index): "Paris" and
    the other choice's text are one message."""
    _, key = gw.new_tenant("two")
    events = _responses(gw, key, "twochoices")
    final = terminal(events)
    assert _text(final) == "Paris", final["output"]
    deltas = "".join(d["delta"] for k, d in events if k == "response.output_text.delta")
    assert OTHER not in deltas


def test_another_choice_never_reaches_a_messages_client(gw: Gateway) -> None:
    _, key = gw.new_tenant("two")
    final = _final_message(gw, key, "twochoices")
    texts = [b.text for b in final.content if b.type == "text"]
    assert texts == ["Paris"], final.content


# -- interleaved calls -------------------------------------------------------------------


def test_interleaved_calls_are_whole_in_each_responses_event(gw: Gateway) -> None:
    """Pin: each call's `function_call_arguments.done` and `output_item.done` carry its
    whole arguments, no arguments delta comes after its item is done, and the final
    (and stored) response says the same (ResponseEvents closes an item when the next
    opens; the tool gate holds each keyed call until it is whole)."""
    _, key = gw.new_tenant("ilv")
    events = _responses(gw, key, "interleaved")
    final = terminal(events)
    calls = [i for i in final["output"] if i["type"] == "function_call"]
    assert [json.loads(i["arguments"]) for i in calls] == [{"q": "a"}, {"q": "b"}], calls
    done: set[int] = set()
    for kind, data in events:
        if kind == "response.function_call_arguments.delta":
            assert data["output_index"] not in done, f"a delta after its item was done: {data}"
        if kind == "response.function_call_arguments.done":
            item = final["output"][data["output_index"]]
            assert data["arguments"] == item["arguments"], (data, item)
        if kind == "response.output_item.done":
            done.add(data["output_index"])
            assert data["item"] == final["output"][data["output_index"]], data
    assert stored(gw, key, final["id"]) == final


def test_interleaved_calls_send_no_delta_after_a_blocks_stop(gw: Gateway) -> None:
    """Pin: a Messages block gets no delta after its `content_block_stop`; the SDK's
    final message has both calls with their inputs."""
    _, key = gw.new_tenant("ilv")
    events = _messages(gw, key, "interleaved")
    stopped: set[int] = set()
    for kind, data in events:
        if kind == "content_block_delta":
            assert data["index"] not in stopped, f"a delta after its block stopped: {data}"
        if kind == "content_block_stop":
            stopped.add(data["index"])
    final = _final_message(gw, key, "interleaved")
    uses = [b.input for b in final.content if b.type == "tool_use"]
    assert uses == [{"q": "a"}, {"q": "b"}], final.content


# -- a call index that is no number ------------------------------------------------------


def test_a_call_index_that_is_no_number_still_ends_the_responses_stream(gw: Gateway) -> None:
    """Pin: whatever the index (a list would be unhashable in `ResponseEvents.calls`),
    the stream ends in a terminal event, with one ledger row."""
    tenant, key = gw.new_tenant("idx")
    events = _responses(gw, key, "listindex")
    final = terminal(events)
    assert final["status"] in ("completed", "failed"), final
    assert len(gw.stored_rows(tenant)) == 1


def test_a_call_index_that_is_no_number_still_ends_the_messages_stream(gw: Gateway) -> None:
    _, key = gw.new_tenant("idx")
    events = _messages(gw, key, "listindex")
    kinds = [k for k, _ in events]
    assert kinds and kinds[-1] in ("message_stop", "error"), kinds


# -- arguments that never become JSON ----------------------------------------------------


def test_arguments_that_are_no_json_do_not_break_the_messages_sdk(gw: Gateway) -> None:
    """The anthropic SDK reads the stream to its end, and the call is presented as the
    whole reply presents it (`{"_arguments": ...}`, messages_reply.py `_input`). Today
    the stream relays the text as `input_json_delta`, and the SDK raises ValueError
    ("Unable to parse tool parameter JSON from model") mid-stream."""
    _, key = gw.new_tenant("nj")
    whole = _sdk(gw, key).messages.create(
        model="notjson-whole", max_tokens=64, tools=MTOOLS,
        messages=[{"role": "user", "content": "hi"}],
    )  # fmt: skip
    assert [b.input for b in whole.content if b.type == "tool_use"] == [
        {"_arguments": "".join(NOT_JSON)}
    ]
    final = _final_message(gw, key, "notjson")
    assert [b.input for b in final.content if b.type == "tool_use"] == [
        b.input for b in whole.content if b.type == "tool_use"
    ]


def test_arguments_that_are_no_json_are_no_completed_responses_call(gw: Gateway) -> None:
    """A `function_call` whose arguments are not JSON is not handed over as a completed
    response's valid call (the client would run a tool on arguments it cannot parse):
    the response is not `completed`, or the call is not, or its arguments were made
    JSON (as the Messages whole reply does). Today: a completed response with a
    completed call of arguments `{"q": oops}`, stored so."""
    _, key = gw.new_tenant("nj")
    events = _responses(gw, key, "notjson")
    final = terminal(events)
    calls = [i for i in final["output"] if i["type"] == "function_call"]
    presented = [i for i in calls if final["status"] == "completed" == i["status"]]
    assert [i["arguments"] for i in presented if not _is_json(i["arguments"])] == [], final
    assert stored(gw, key, final["id"]) == final


# -- a refusal, reasoning ----------------------------------------------------------------


def test_a_refusal_reaches_the_responses_client(gw: Gateway) -> None:
    """A refusal delta is the Responses `refusal` content part (as the API streams it:
    `response.refusal.delta`), not an empty completed message. Today it is dropped."""
    _, key = gw.new_tenant("ref")
    final = _final_response(gw, key, "refusal")
    parts = [p for item in final.output if item.type == "message" for p in item.content]
    assert [(p.type, getattr(p, "refusal", None)) for p in parts] == [("refusal", REFUSAL)]


def test_a_refusal_reaches_the_messages_client(gw: Gateway) -> None:
    """A Messages client is told the model refused (`stop_reason: refusal`, the
    Messages API's own), not handed an empty `end_turn`. Today it is dropped."""
    _, key = gw.new_tenant("ref")
    final = _final_message(gw, key, "refusal")
    assert final.stop_reason == "refusal", (final.stop_reason, final.content)


def test_reasoning_deltas_are_not_the_answer_in_either_protocol(gw: Gateway) -> None:
    """Pin: `reasoning_content`/`reasoning` deltas never become the answer's text: the
    Responses output and its stored copy say "42", the Messages text block "42"."""
    _, key = gw.new_tenant("rsn")
    events = _responses(gw, key, "reasoning")
    final = terminal(events)
    assert (final["status"], _text(final)) == ("completed", "42")
    assert stored(gw, key, final["id"]) == final
    message = _final_message(gw, key, "reasoning")
    assert [b.text for b in message.content if b.type == "text"] == ["42"]
    assert message.stop_reason == "end_turn"


# -- a content filter, an enormous delta -------------------------------------------------


def test_a_content_filtered_responses_stream_is_incomplete(gw: Gateway) -> None:
    """An answer the engine's content filter stopped (`finish_reason: content_filter`)
    is a Responses `incomplete` response, `incomplete_details.reason: content_filter`
    (the API's own reason), stored so. Today it is `completed`: `ResponseEvents.end`
    reads `length` alone."""
    _, key = gw.new_tenant("cf")
    events = _responses(gw, key, "filtered")
    final = terminal(events)
    assert (final["status"], final.get("incomplete_details")) == (
        "incomplete",
        {"reason": "content_filter"},
    ), final
    assert events[-1][0] == "response.incomplete"
    assert stored(gw, key, final["id"]) == final


def test_a_content_filtered_messages_stream_stops_as_a_refusal(gw: Gateway) -> None:
    """Pin: the Messages client is told `stop_reason: refusal`, with the text so far."""
    _, key = gw.new_tenant("cf")
    final = _final_message(gw, key, "filtered")
    assert final.stop_reason == "refusal"
    assert [b.text for b in final.content if b.type == "text"] == ["The first half of"]


def test_a_delta_past_the_event_bound_fails_both_streams(gw: Gateway) -> None:
    """Pin: one 5 MiB delta (past MAX_EVENT_BYTES) ends a Responses stream in `error`
    and `response.failed` (stored so, ledger row `incomplete`) and a Messages stream in
    an `error` event; neither is a 500 nor a hang."""
    tenant, key = gw.new_tenant("big")
    events = _responses(gw, key, "huge")
    kinds = [k for k, _ in events]
    final = terminal(events)
    assert final["status"] == "failed" and kinds[-2:] == ["error", "response.failed"], kinds
    rows = gw.stored_rows(tenant)  # the stream's row, before the GET's
    assert [r["status"] for r in rows] == ["incomplete"], rows
    assert stored(gw, key, final["id"]) == final
    kinds = [k for k, _ in _messages(gw, key, "huge")]
    assert kinds[-1] == "error" and "message_stop" not in kinds, kinds


# -- the first finish ends a choice ------------------------------------------------------


def test_text_after_the_finish_is_not_presented_as_the_answer(gw: Gateway) -> None:
    """A choice ends at its `finish_reason`: text the upstream sends after it is not
    the answer (or the stream fails as malformed). Today both protocols present
    "Paris and Rome" as a complete answer (`ResponseEvents.chunk`, `MessageEvents.chunk`
    keep translating after the finish), and the row is `ok`."""
    _, key = gw.new_tenant("fin")
    final = terminal(_responses(gw, key, "afterfinish"))
    assert final["status"] == "failed" or _text(final) == "Paris", final["output"]
    events = _messages(gw, key, "afterfinish")
    text = "".join(d["delta"].get("text", "") for k, d in events if k == "content_block_delta")
    assert events[-1][0] == "error" or text == "Paris", text


def test_a_second_finish_does_not_undo_a_cut(gw: Gateway) -> None:
    """An answer the engine cut (`length`) stays cut when a second finish (`stop`)
    follows: Responses `incomplete` (`max_output_tokens`), Messages `max_tokens`.
    Today the last finish wins (`self.finish = finish`, `self.stop_reason = ...`): a
    cut answer is `completed` / `end_turn`."""
    _, key = gw.new_tenant("fin")
    final = terminal(_responses(gw, key, "twofinishes"))
    assert (final["status"], final.get("incomplete_details")) == (
        "incomplete",
        {"reason": "max_output_tokens"},
    ), final
    assert _final_message(gw, key, "twofinishes").stop_reason == "max_tokens"
