"""The Responses codec and reply translation (api/responses_codec.py,
api/responses_reply.py), without sockets: requests decode into the internal model with
the checks naming what is not supported; a reply streamed and the same reply whole are
one response object, as the official `openai` SDK assembles it."""

from __future__ import annotations

import asyncio
import json
import re
from types import SimpleNamespace
from typing import Any

import msgspec
import openai
import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from openai.types.responses import Response

from support.chat_replies import chat_reply, live_chunks
from switchyard.api.codecs import CHAT_TYPED
from switchyard.api.responses_codec import check, to_chat
from switchyard.api.responses_reply import (
    ResponseEvents,
    Shell,
    _sse,
    delta_event,
    text_delta_head,
    to_response,
)
from switchyard.api.sse import translated
from switchyard.errors import InvalidRequest, TaskCancelled, UpstreamError
from switchyard.pipeline import Status
from switchyard.policy.validate import validate_chat
from switchyard.reply import (
    ChatChunk,
    read_chunk,
    reply_usage,
    stream_chunks,
    translated_reply,
)
from switchyard.request import Generation, from_object, to_json

try:  # the HTTP package the SDK is built on (newer releases: httpx2)
    import httpx2 as sdk_http
except ImportError:
    import httpx as sdk_http  # type: ignore[no-redef]


def _param(body: dict[str, Any]) -> str | None:
    with pytest.raises(InvalidRequest) as info:
        check(body)
    return info.value.param


def test_items_decode_into_one_chat_conversation() -> None:
    req = check(
        {
            "model": "m",
            "instructions": "Be brief.",
            "input": [
                {"role": "user", "content": "Weather in Oslo?"},
                {"type": "function_call", "call_id": "c1", "name": "weather", "arguments": "{}"},
                {"type": "function_call", "call_id": "c2", "name": "time", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "c1", "output": "rain"},
                {"type": "function_call_output", "call_id": "c2", "output": "noon"},
                {"role": "assistant", "content": [{"type": "refusal", "refusal": "no photos"}]},
                {
                    "type": "message",
                    "role": "user",
                    "content": [
                        {"type": "input_text", "text": "and this?"},
                        {"type": "input_image", "image_url": "https://img.test/a.png"},
                    ],
                },
            ],
            "tools": [{"type": "function", "name": "weather", "parameters": {"type": "object"}}],
            "tool_choice": {"type": "function", "name": "weather"},
            "text": {"format": {"type": "json_schema", "name": "w", "schema": {"type": "object"}}},
            "max_output_tokens": 50,
            "include": [],
            "truncation": "disabled",
            "stream": True,
        }
    )
    chat = to_chat(req, [{"role": "user", "content": "earlier"}])
    validate_chat(chat)
    assert chat["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "earlier"},
        {"role": "user", "content": "Weather in Oslo?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "weather", "arguments": "{}"},
                },
                {"id": "c2", "type": "function", "function": {"name": "time", "arguments": "{}"}},
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "rain"},
        {"role": "tool", "tool_call_id": "c2", "content": "noon"},
        {"role": "assistant", "content": "no photos"},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "and this?"},
                {"type": "image_url", "image_url": {"url": "https://img.test/a.png"}},
            ],
        },
    ]
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "weather"}}
    assert chat["response_format"]["type"] == "json_schema" and chat["max_tokens"] == 50
    assert chat["stream_options"] == {"include_usage": True}
    assert [i["type"] for i in req.items] == [
        "message",
        "function_call",
        "function_call",
        "function_call_output",
        "function_call_output",
        "message",
        "message",
    ]
    assert len({i["id"] for i in req.items}) == 7 and req.store and not req.background


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": "x"}, "model"),
        ({"model": "m"}, "input"),
        ({"model": "m", "input": []}, "input"),
        ({"model": "m", "input": "x", "reasoning": {"effort": "low"}}, "reasoning"),
        ({"model": "m", "input": "x", "conversation": "c"}, "conversation"),
        ({"model": "m", "input": "x", "include": ["file_search_call.results"]}, "include"),
        ({"model": "m", "input": "x", "truncation": "auto"}, "truncation"),
        ({"model": "m", "input": "x", "user": "u\r\nX-Forged: 1"}, "user"),
        ({"model": "m", "input": [{"type": "item_reference", "id": "x"}]}, "input[0].type"),
        ({"model": "m", "input": [{"type": "reasoning", "summary": []}]}, "input[0].type"),
        (
            {"model": "m", "input": [{"role": "user", "content": [{"type": "input_file"}]}]},
            "input[0].content[0]",
        ),
        (
            {
                "model": "m",
                "input": [{"role": "user", "content": [{"type": "input_image", "file_id": "f"}]}],
            },
            "input[0].content[0].file_id",
        ),
        ({"model": "m", "input": "x", "tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"model": "m", "input": "x", "previous_response_id": "nope"}, "previous_response_id"),
        ({"model": "m", "input": "x", "background": True, "store": False}, "background"),
        ({"model": "m", "input": "x", "background": True, "stream": True}, "background"),
        ({"model": "m", "input": "x", "temperature": 3}, "temperature"),
        ({"model": "m", "input": "x", "text": {"format": {"type": "xml"}}}, "text.format.type"),
        ({"model": "m", "input": "x", "z" * 100_000: 1}, "z" * 64),
    ],
)
def test_what_is_not_supported_is_refused_by_name(body: dict[str, Any], param: str) -> None:
    got = _param(body)
    assert got is not None and got.startswith(param[:160]), got


# -- whole and streamed: one response ---------------------------------------------------
_name = st.from_regex(r"[A-Za-z0-9_\-]{1,12}", fullmatch=True)
_args = st.dictionaries(
    _name, st.one_of(st.integers(-(2**31), 2**31), st.text(max_size=8)), max_size=3
)
_calls = st.lists(st.tuples(_name, _name, _args), max_size=3, unique_by=lambda c: c[0])


USAGE = {"prompt_tokens": 9, "completion_tokens": 4, "total_tokens": 13}


def _assemble(stream: bytes) -> Response:
    """The response the official SDK assembles from our event stream."""

    def answer(request: Any) -> Any:
        return sdk_http.Response(200, content=stream, headers={"content-type": "text/event-stream"})

    client = openai.OpenAI(
        api_key="k",
        base_url="http://sdk.test/v1",
        http_client=sdk_http.Client(transport=sdk_http.MockTransport(answer)),
    )
    with client.responses.stream(model="m", input="x") as s:
        for _ in s:
            pass
        return s.get_final_response()


def _shape(r: Response) -> list[Any]:
    out: list[Any] = []
    for item in r.output:
        if item.type == "message":
            out.append(
                ("message", "".join(c.text for c in item.content if c.type == "output_text"))
            )
        elif item.type == "function_call":
            out.append(("call", item.call_id, item.name, json.loads(item.arguments)))
    return out


@settings(max_examples=150, deadline=None)
@given(
    st.text(max_size=60),
    _calls,
    st.sampled_from(["stop", "length", "tool_calls"]),
    st.integers(1, 30),
)
def test_a_streamed_reply_assembles_into_the_whole_reply(
    text: str, calls: list[tuple[str, str, dict[str, Any]]], finish: str, piece: int
) -> None:
    chat = chat_reply(text, calls, finish, USAGE)
    shell = Shell("resp_" + "0" * 32, check({"model": "m", "input": "x"}), "m")
    whole = Response.model_validate(to_response(chat, shell))
    chunks = live_chunks(text, calls, finish, USAGE, piece)  # as an upstream streams it
    events = ResponseEvents(shell)
    written: list[bytes] = []
    for c in chunks:
        events.chunk(read_chunk(json.dumps(c).encode()), written)  # as the relay reads it
    events.end(written)
    out = b"".join(written)
    seqs = [
        json.loads(e.split(b"\ndata: ", 1)[1])["sequence_number"] for e in out.split(b"\n\n") if e
    ]
    assert seqs == list(range(len(seqs)))
    if finish != "length":  # the SDK's stream helper ends on response.completed
        streamed = _assemble(out)
        assert _shape(streamed) == _shape(whole)
        assert streamed.usage is not None and streamed.usage.output_tokens == 4
        assert streamed.id == whole.id and streamed.status == whole.status == "completed"
    assert events.final is not None and [i["type"] for i in events.final["output"]] == [
        i.type for i in whole.output
    ]
    # Every output item: its own id, of its type's prefix, and completed once it ended.
    for out in (events.final["output"], [i.model_dump() for i in whole.output]):
        prefixes = [i["id"].split("_", 1)[0] for i in out]
        assert prefixes == ["msg" if i["type"] == "message" else "fc" for i in out]
        assert len({i["id"] for i in out}) == len(out)
        assert {i["status"] for i in out} == {"completed"}
    replay = ResponseEvents(Shell(shell.rid, shell.req, "m"))
    ignored: list[bytes] = []
    for c in stream_chunks(chat):
        replay.chunk(c, ignored)
    replay.end(ignored)
    assert replay.final is not None
    assert _shape(Response.model_validate(replay.final)) == _shape(whole)


def test_a_broken_stream_ends_failed_with_an_error_event() -> None:
    events = ResponseEvents(Shell("resp_" + "1" * 32, check({"model": "m", "input": "x"}), "m"))
    events.chunk(ChatChunk(choices=[{"index": 0, "delta": {"content": "half"}}]), [])
    written: list[bytes] = []
    events.failed(UpstreamError("the upstream ended the stream early"), written)
    tail = b"".join(written)
    kinds = [json.loads(e.split(b"\ndata: ", 1)[1])["type"] for e in tail.split(b"\n\n") if e]
    assert kinds == ["error", "response.failed"]
    assert events.final is not None and events.final["status"] == "failed"
    assert events.final["error"]["code"] == "server_error"  # OpenAI's code for it
    assert events.final["output"][0]["content"][0]["text"] == "half"  # what was streamed


def test_a_stream_stopped_between_events_ends_in_the_responses_shape() -> None:
    """A task cancel landing while a write is under way ends the stream with the
    protocol's own events, numbered on from the stream's, not chat's error event."""
    events = ResponseEvents(Shell("resp_" + "2" * 32, check({"model": "m", "input": "x"}), "m"))
    sent: list[bytes] = []
    events.chunk(ChatChunk(choices=[{"index": 0, "delta": {"content": "so far"}}]), sent)
    tail = events.error_event(TaskCancelled("the task 't' was cancelled"))
    parsed = [json.loads(e.split(b"\ndata: ", 1)[1]) for e in tail.split(b"\n\n") if e]
    assert [p["type"] for p in parsed] == ["error", "response.failed"]
    assert parsed[0]["code"] == "task_cancelled"
    last = max(
        json.loads(e.split(b"\ndata: ", 1)[1])["sequence_number"]
        for e in b"".join(sent).split(b"\n\n")
        if e
    )
    assert [p["sequence_number"] for p in parsed] == [last + 1, last + 2]
    assert parsed[1]["response"]["output"][0]["content"][0]["text"] == "so far"


@settings(max_examples=300, deadline=None)
@given(
    st.text(max_size=40),
    st.text(alphabet="abcdef0123456789_", min_size=1, max_size=40),
    st.integers(0, 1000),
    st.integers(0, 2**40),
)
def test_a_text_delta_event_is_the_bytes_of_its_object(
    text: str, item_id: str, index: int, seq: int
) -> None:
    """The stream's per-token event, put together from constant pieces, is byte for byte
    the SSE event of its object (what every other event is made from)."""
    fast = delta_event(text_delta_head(item_id, index), text, seq)
    event = {
        "type": "response.output_text.delta",
        "item_id": item_id,
        "output_index": index,
        "content_index": 0,
        "delta": text,
        "logprobs": [],
        "sequence_number": seq,
    }
    assert fast == _sse(event)
    assert json.loads(fast.split(b"\ndata: ", 1)[1]) == event


# -- the decoded request's bytes, the reply's usage -------------------------------------
_text = st.text(max_size=30)
_part = st.one_of(
    st.builds(lambda t: {"type": "input_text", "text": t}, _text),
    st.builds(
        lambda u: {"type": "input_image", "image_url": f"https://img.test/{u}.png"},
        st.from_regex(r"[a-z0-9]{1,8}", fullmatch=True),
    ),
)
_item = st.one_of(
    st.builds(lambda t: {"role": "user", "content": t}, _text),
    st.builds(
        lambda parts: {"type": "message", "role": "user", "content": parts},
        st.lists(_part, min_size=1, max_size=3),
    ),
    st.builds(lambda t: {"role": "assistant", "content": t}, _text),
    st.builds(
        lambda c, n, a: {"type": "function_call", "call_id": c, "name": n, "arguments": a},
        _name,
        _name,
        st.just('{"q": 1}'),
    ),
    st.builds(
        lambda c, o: {"type": "function_call_output", "call_id": c, "output": o}, _name, _text
    ),
)
_optional = {
    "instructions": _text,
    "max_output_tokens": st.integers(16, 2**31 - 1),
    "temperature": st.floats(0, 2),
    "top_p": st.floats(0, 1),
    "stream": st.booleans(),
    "store": st.booleans(),
    "parallel_tool_calls": st.booleans(),
    "user": st.text(st.characters(exclude_categories=("Cc",)), max_size=12),
    "metadata": st.dictionaries(_name, _text, max_size=3),
    "tools": st.lists(
        st.builds(
            lambda n: {"type": "function", "name": n, "parameters": {"type": "object"}}, _name
        ),
        max_size=2,
    ),
    "tool_choice": st.sampled_from(["auto", "none", "required"]),
    "text": st.sampled_from([{"format": {"type": "text"}}, {"format": {"type": "json_object"}}]),
}
_bodies = st.fixed_dictionaries(
    {"model": st.just("m"), "input": st.one_of(_text, st.lists(_item, min_size=1, max_size=4))},
    optional=_optional,
)


@settings(max_examples=300, deadline=None)
@given(_bodies, st.lists(st.builds(lambda t: {"role": "user", "content": t}, _text), max_size=2))
def test_the_chat_bytes_a_responses_request_sends_are_exactly_its_decoded_request(
    body: dict[str, Any], history: list[dict[str, Any]]
) -> None:
    """The route hands the stages and the upstream call the chat body's bytes beside
    the decoded request, as the chat route hands the client's (service.py's
    `ctx.wire`): they must say exactly what the request says, member for member, so
    the upstream gets the same request whichever way it is written."""
    try:
        req = check(body)
    except InvalidRequest:
        return  # e.g. an assistant message's image: refused, nothing sent
    chat = to_chat(req, history)
    validate_chat(chat)
    gen, exact = from_object(Generation, chat, CHAT_TYPED)
    assert exact  # every member set: the bytes may stand for it
    raw = orjson.dumps(chat)
    assert msgspec.json.decode(raw) == msgspec.json.decode(to_json(gen))


def test_a_translated_reply_keeps_the_usage_settling_would_read() -> None:
    """Parsed once: the usage of the bytes settling would read is kept when the
    protocol parses them; other bytes (a reply the reply side rewrote, a cache hit)
    leave it alone."""
    body = orjson.dumps(chat_reply("hi", [], "stop", USAGE))
    run = SimpleNamespace(usage=None, reply_body=body)
    ctx: Any = SimpleNamespace(run=run)
    assert translated_reply(ctx, body)["usage"] == USAGE
    assert run.usage == reply_usage(body) == USAGE
    other = SimpleNamespace(usage=None, reply_body=None)
    assert translated_reply(SimpleNamespace(run=other), body)["choices"]  # type: ignore[arg-type]
    assert other.usage is None  # not the bytes settling reads: left to it
    kept = {"prompt_tokens": 1}
    rewritten = SimpleNamespace(usage=kept, reply_body=body)
    translated_reply(SimpleNamespace(run=rewritten), body)  # type: ignore[arg-type]
    assert rewritten.usage is kept
    assert translated_reply(ctx, b"[1, 2]") == {}


def _timeless(events: bytes) -> bytes:
    """Events without the second a response completed at (two runs may straddle one)."""
    return re.sub(rb'"completed_at":\d+', b'"completed_at":0', events)


def test_a_translated_stream_reads_each_chunk_once_and_skips_what_is_not_one() -> None:
    """The relay's data, read as chunks (reply.read_chunk: only the members the
    translation uses); JSON that is not an object is no chunk and adds no event, the
    same chunks as objects give the same events."""
    chunks = live_chunks("hello there", [], "stop", USAGE, 3)
    req = check({"model": "m", "input": "x"})

    def shell() -> Shell:  # the same ids and times, so two streams can be compared
        return Shell("resp_" + "2" * 32, req, "m", created_at=1.0, ids=lambda p: f"{p}_1")

    data = [json.dumps(c).encode() for c in chunks]

    def events_of(batch: list[bytes]) -> bytes:
        async def source() -> Any:
            yield batch

        async def run() -> bytes:
            ctx: Any = SimpleNamespace(status=Status.OK)
            events = ResponseEvents(shell())
            return b"".join([b async for b in translated(ctx, source(), events)])

        return _timeless(asyncio.run(run()))

    plain = events_of(data)
    assert events_of([b"[1]", *data[:2], b'"text"', b"null", *data[2:]]) == plain
    written: list[bytes] = []
    events = ResponseEvents(shell())
    for c in chunks:
        events.chunk(ChatChunk(c.get("id"), c.get("choices"), c.get("usage")), written)
    events.end(written)
    assert _timeless(b"".join(written)) == plain
