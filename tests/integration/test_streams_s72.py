"""Stream and reply ends under a hostile upstream: chat completion chunks and whole
replies no engine should send, read through one real gateway (tool gate off:
`tools.check_outputs: false`) by a chat, a Responses and a Messages client, over
sockets. The upstream is tests/support/hostile_upstream.py, scripted per model.

Defects these tests find (each fails on the code before this stop):
- a stream that ends with `[DONE]` while choice 0 never had a `finish_reason` (a
  truncated answer) was presented as complete: Responses `response.completed`, Messages
  `end_turn` + `message_stop`, and the ledger row `ok`. It is now a broken stream in the
  translated protocols (`error` + `response.failed`; Messages' `error` event) and an
  `incomplete` row (`upstream_error`); a chat client gets the upstream's bytes unchanged
  (its `[DONE]` included), its row `incomplete` (reply.py `relay`, api/sse.py
  `translated`);
- a whole reply whose choices come out of order (index 1 first) was answered from
  choice 1: Responses and Messages read `choices[0]` (now reply.py `first_choice`);
- with the tool gate off, interleaved tool-call pieces (call 0, then 1, then 0 again)
  made the Responses stream send an arguments delta after its item's
  `response.output_item.done` (api/responses_reply.py `ResponseEvents`), with the done
  events carrying arguments short of the final response's.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import anthropic
import pytest

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
from support.stream_reads import stored, streamed, streamed_bytes, terminal

OTHER = "LEAK-FROM-CHOICE-ONE"
TOOLS: list[Any] = [{"type": "function", "name": "lookup", "parameters": {"type": "object"}}]
MTOOLS: list[Any] = [{"name": "lookup", "input_schema": {"type": "object"}}]


_event, _chunk, _call, DONE, USAGE = sse_event, chunk_event, call_event, DONE_EVENT, USAGE_EVENT
TEXT = _chunk({"role": "assistant", "content": "The first half of"})

# Each stream as the upstream writes it (a chat client of it reads these bytes back).
STREAMS = {
    # Text, usage, [DONE]: the engine never said the answer finished.
    "nofinish": (TEXT, USAGE, DONE),
    # The same with a finish of another choice only: choice 0 still never finished.
    "otherfinish": (TEXT, _chunk({}, "stop", index=1), USAGE, DONE),
    # Whole answers: spaced JSON (as Python writes it) and compact (as engines do).
    "finished": (TEXT, _chunk({}, "stop"), USAGE, DONE),
    "compact": (
        _chunk({"role": "assistant", "content": "The first half of"}, compact=True),
        _chunk({}, "stop", compact=True),
        USAGE,
        DONE,
    ),
    # Two calls whose pieces interleave: 0, 1, 0 again.
    "interleaved": (
        _call(0, '{"q": ', head="a"),
        _call(1, '{"q": "b"}', head="b"),
        _call(0, '"a"}'),
        _chunk({}, "tool_calls"),
        USAGE,
        DONE,
    ),
    # A call, text, a second call, then the first call's last piece.
    "mixed": (
        _call(0, '{"q": ', head="a"),
        _chunk({"content": "Checking."}),
        _call(1, '{"q": "b"}', head="b"),
        _call(0, '"a"}'),
        _chunk({}, "tool_calls"),
        USAGE,
        DONE,
    ),
}
# A whole reply whose choices come out of order: choice 1 first.
SWAPPED = {
    "id": "c1", "object": "chat.completion", "created": 1, "model": "m",
    "choices": [
        {"index": 1, "message": {"role": "assistant", "content": OTHER}, "finish_reason": "stop"},
        {"index": 0, "message": {"role": "assistant", "content": "Paris"},
         "finish_reason": "length"},
    ],
    "usage": {"prompt_tokens": 5, "completion_tokens": 7, "total_tokens": 12},
}  # fmt: skip
REPLIES = {
    **{name: sse_reply(*events) for name, events in STREAMS.items()},
    "swapped": json_reply(json.dumps(SWAPPED).encode()),
}


@pytest.fixture(scope="module")
def up() -> Iterator[Hostile]:
    with hostile_upstream(REPLIES) as hostile:
        yield hostile


@pytest.fixture(scope="module")
def gw(up: Hostile) -> Iterator[Gateway]:
    config = {
        "models": up.models(REPLIES, CHEAP_PRICE),
        "embeddings": {"enabled": False},
        "tools": {"check_outputs": False},  # the tool gate off: calls relayed as they come
    }
    g = start_gateway(config)
    yield g
    g.proc.stop()


# -- reading the streams -----------------------------------------------------------------


def _responses(gw: Gateway, key: str, model: str) -> list[tuple[str, dict[str, Any]]]:
    body = {"model": model, "input": "hi", "tools": TOOLS}
    return streamed(gw, key, "/v1/responses", body)


def _messages(gw: Gateway, key: str, model: str) -> list[tuple[str, dict[str, Any]]]:
    body = {"model": model, "max_tokens": 64, "tools": MTOOLS,
            "messages": [{"role": "user", "content": "hi"}]}  # fmt: skip
    return streamed(gw, key, "/v1/messages", body)


def _row(gw: Gateway, tenant: str) -> tuple[str, str | None]:
    rows = gw.stored_rows(tenant)
    assert len(rows) == 1, rows
    return rows[0]["status"], rows[0]["error_code"]


# -- 1. [DONE] before choice 0 finished ----------------------------------------------------


@pytest.mark.parametrize("model", ["nofinish", "otherfinish"])
def test_an_unfinished_responses_stream_fails(gw: Gateway, model: str) -> None:
    """`[DONE]` with no `finish_reason` for choice 0 is a truncated answer: `error` then
    `response.failed` (stored so), never `response.completed`; the row `incomplete`,
    `upstream_error`. Before: `response.completed` and an `ok` row."""
    tenant, key = gw.new_tenant("nf")
    events = _responses(gw, key, model)
    kinds = [k for k, _ in events]
    assert kinds[-2:] == ["error", "response.failed"], kinds
    assert "response.completed" not in kinds, kinds
    final = terminal(events)
    assert final["status"] == "failed" and final["error"]["code"] == "server_error", final
    texts = [p["text"] for i in final["output"] if i["type"] == "message" for p in i["content"]]
    assert texts == ["The first half of"], final["output"]  # what came, shown as failed
    assert _row(gw, tenant) == ("incomplete", "upstream_error")
    assert stored(gw, key, final["id"]) == final


def test_an_unfinished_messages_stream_ends_in_an_error_event(gw: Gateway) -> None:
    """A Messages client gets Anthropic's `error` event last, no `message_delta` stop
    and no `message_stop`; the row is `incomplete`. Before: `end_turn`, `message_stop`."""
    tenant, key = gw.new_tenant("nf")
    events = _messages(gw, key, "nofinish")
    kinds = [k for k, _ in events]
    assert kinds[-1] == "error" and events[-1][1]["error"]["type"] == "api_error", events[-1]
    assert "message_stop" not in kinds and "message_delta" not in kinds, kinds
    assert _row(gw, tenant) == ("incomplete", "upstream_error")
    client = anthropic.Anthropic(base_url=gw.url, api_key=key, max_retries=0)
    stream = client.messages.stream(
        model="nofinish", max_tokens=64, messages=[{"role": "user", "content": "hi"}]
    )
    with pytest.raises(anthropic.APIStatusError), stream as reading:  # an error, not a stop
        reading.get_final_message()


def test_an_unfinished_chat_stream_is_relayed_as_it_came_and_recorded_incomplete(
    gw: Gateway,
) -> None:
    """A chat client (relayed as it came) gets the upstream's bytes unchanged, `[DONE]`
    included and no error event added, while the row says `incomplete`,
    `upstream_error`. Before: the same bytes, and an `ok` row."""
    tenant, key = gw.new_tenant("nf")
    body = {"model": "nofinish", "messages": [{"role": "user", "content": "hi"}],
            "stream_options": {"include_usage": True}}  # fmt: skip
    got = streamed_bytes(gw, key, "/v1/chat/completions", body)
    assert got == b"".join(STREAMS["nofinish"])
    assert _row(gw, tenant) == ("incomplete", "upstream_error")


@pytest.mark.parametrize("model", ["finished", "compact"])
def test_a_finished_stream_is_complete_in_every_protocol(gw: Gateway, model: str) -> None:
    """Pin, both spacings of the upstream's JSON: a chat stream whose choice 0 finished
    is relayed as it came with an `ok` row; Responses `completed`; Messages `end_turn`."""
    tenant, key = gw.new_tenant("fin")
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}],
            "stream_options": {"include_usage": True}}  # fmt: skip
    got = streamed_bytes(gw, key, "/v1/chat/completions", body)
    assert got == b"".join(STREAMS[model])
    assert _row(gw, tenant) == ("ok", None)
    final = terminal(_responses(gw, key, model))
    assert final["status"] == "completed", final
    events = _messages(gw, key, model)
    stops = [d["delta"]["stop_reason"] for k, d in events if k == "message_delta"]
    assert stops == ["end_turn"] and events[-1][0] == "message_stop", events


# -- 2. a whole reply's choices out of order -----------------------------------------------


def test_a_whole_responses_reply_answers_choice_zero_wherever_it_sits(gw: Gateway) -> None:
    """Choice 0 ("Paris", cut at `length`) sits second: the response is its text,
    `incomplete` for `max_output_tokens`. Before: choice 1's text, `completed`."""
    _, key = gw.new_tenant("sw")
    r = gw.post("/v1/responses", key, json={"model": "swapped", "input": "hi"})
    assert r.status_code == 200, r.text[:400]
    obj = r.json()
    texts = [p["text"] for i in obj["output"] if i["type"] == "message" for p in i["content"]]
    assert texts == ["Paris"], obj["output"]
    assert (obj["status"], obj["incomplete_details"]) == (
        "incomplete",
        {"reason": "max_output_tokens"},
    ), obj


def test_a_whole_messages_reply_answers_choice_zero_wherever_it_sits(gw: Gateway) -> None:
    """The Messages answer is choice 0's text and stop (`max_tokens`). Before: choice
    1's text and `end_turn`."""
    _, key = gw.new_tenant("sw")
    body = {"model": "swapped", "max_tokens": 64, "messages": [{"role": "user", "content": "hi"}]}
    r = gw.post("/v1/messages", key, json=body)
    assert r.status_code == 200, r.text[:400]
    obj = r.json()
    assert [b["text"] for b in obj["content"] if b["type"] == "text"] == ["Paris"], obj
    assert obj["stop_reason"] == "max_tokens", obj


# -- 3. interleaved tool calls, the tool gate off ----------------------------------------------


@pytest.mark.parametrize(
    ("model", "shape"),
    [
        ("interleaved", [("function_call", '{"q": "a"}'), ("function_call", '{"q": "b"}')]),
        (
            "mixed",
            [
                ("function_call", '{"q": "a"}'),
                ("message", "Checking."),
                ("function_call", '{"q": "b"}'),
            ],
        ),
    ],
)
def test_interleaved_calls_make_valid_responses_events(
    gw: Gateway, model: str, shape: list[tuple[str, str]]
) -> None:
    """No arguments delta after its item's `response.output_item.done`; items are done
    once each, in output order; each done event carries the item as the final (and
    stored) response has it; each call's arguments are all its pieces in order, as the
    deltas tell them too. Before: call 0 was done when call 1 opened, and its last
    piece came after as a delta of a done item."""
    _, key = gw.new_tenant("ilv")
    events = _responses(gw, key, model)
    final = terminal(events)
    assert final["status"] == "completed", final
    said = [
        (i["type"], i["arguments"] if i["type"] == "function_call" else i["content"][0]["text"])
        for i in final["output"]
    ]
    assert said == shape, final["output"]
    done: list[int] = []
    deltas: dict[int, str] = {}
    for kind, data in events:
        if kind == "response.function_call_arguments.delta":
            assert data["output_index"] not in done, f"a delta after its item was done: {data}"
            deltas[data["output_index"]] = deltas.get(data["output_index"], "") + data["delta"]
        if kind == "response.function_call_arguments.done":
            assert data["arguments"] == final["output"][data["output_index"]]["arguments"], data
        if kind == "response.output_item.done":
            done.append(data["output_index"])
            assert data["item"] == final["output"][data["output_index"]], data
    assert done == list(range(len(shape))), done
    calls = {k: i["arguments"] for k, i in enumerate(final["output"]) if i["type"] != "message"}
    assert deltas == calls
    assert stored(gw, key, final["id"]) == final
    with gw.openai(key).responses.stream(model=model, input="hi", tools=TOOLS) as stream:
        for _ in stream:
            pass
        sdk = stream.get_final_response()
    args = [json.loads(i.arguments) for i in sdk.output if i.type == "function_call"]
    assert args == [{"q": "a"}, {"q": "b"}], sdk.output


def test_interleaved_calls_reach_a_messages_client_whole(gw: Gateway) -> None:
    """Pin, the tool gate off: each call is one whole `tool_use` block, in order."""
    _, key = gw.new_tenant("ilv")
    with anthropic.Anthropic(base_url=gw.url, api_key=key, max_retries=0).messages.stream(
        model="interleaved", max_tokens=64, tools=MTOOLS,
        messages=[{"role": "user", "content": "hi"}],
    ) as stream:  # fmt: skip
        final = stream.get_final_message()
    assert [b.input for b in final.content if b.type == "tool_use"] == [{"q": "a"}, {"q": "b"}]
    assert final.stop_reason == "tool_use"
