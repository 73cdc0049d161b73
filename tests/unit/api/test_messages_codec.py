"""The Anthropic Messages codec and reply translation (api/messages_codec.py,
api/messages_reply.py), without sockets: requests decode into the internal model with
the checks naming what is wrong; a reply streamed and the same reply whole give the
same message, as the official `anthropic` SDK assembles it."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import anthropic
import pytest
from anthropic.types import Message, RawMessageStreamEvent
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import TypeAdapter

from support.chat_replies import chat_reply, live_chunks
from switchyard.api.messages_codec import MessagesCodec, to_chat
from switchyard.api.messages_reply import MessageEvents, to_message
from switchyard.api.sse import replayed
from switchyard.errors import InvalidRequest, UpstreamError
from switchyard.policy.validate import validate_chat
from switchyard.reply import read_chunk, stream_chunks

try:  # the HTTP package the SDK is built on (newer releases: httpx2)
    import httpx2 as sdk_http
except ImportError:
    import httpx as sdk_http  # type: ignore[no-redef]

CODEC = MessagesCodec()
BASE = {"model": "m", "max_tokens": 64, "messages": [{"role": "user", "content": "hi"}]}
EVENT = TypeAdapter(RawMessageStreamEvent)


def _param(body: dict[str, Any]) -> str | None:
    with pytest.raises(InvalidRequest) as info:
        CODEC.decode(body)
    return info.value.param


def test_a_whole_conversation_decodes_into_chat_messages() -> None:
    body = {
        "model": "m",
        "max_tokens": 100,
        "system": [{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}],
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "What is in this picture?"},
                    {
                        "type": "image",
                        "source": {"type": "base64", "media_type": "image/png", "data": "iVBOR"},
                    },
                ],
            },
            {
                "role": "assistant",
                "content": [
                    {"type": "text", "text": "Let me look it up."},
                    {"type": "tool_use", "id": "toolu_1", "name": "search", "input": {"q": "x"}},
                ],
            },
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_1", "content": "a cat"},
                    {"type": "text", "text": "So?"},
                ],
            },
        ],
        "tools": [{"name": "search", "description": "web", "input_schema": {"type": "object"}}],
        "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
        "stop_sequences": ["END"],
        "temperature": 0.5,
        "top_k": 5,
        "metadata": {"user_id": "u-1"},
        "stream": True,
    }
    req, exact = CODEC.decode(body)
    assert exact is False  # the client's bytes are Anthropic's: never sent upstream as they are
    assert req.messages == [
        {"role": "system", "content": "Be brief."},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "What is in this picture?"},
                {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBOR"}},
            ],
        },
        {
            "role": "assistant",
            "content": "Let me look it up.",
            "tool_calls": [
                {
                    "id": "toolu_1",
                    "type": "function",
                    "function": {"name": "search", "arguments": '{"q":"x"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "toolu_1", "content": "a cat"},
        {"role": "user", "content": "So?"},
    ]
    assert req.tools == [
        {
            "type": "function",
            "function": {"name": "search", "parameters": {"type": "object"}, "description": "web"},
        }
    ]
    assert req.tool_choice == "required" and req.extra == {"parallel_tool_calls": False}
    assert (req.max_tokens, req.stop, req.temperature, req.top_k) == (100, ["END"], 0.5, 5)
    assert req.user == "u-1" and req.stream and req.include_usage


@pytest.mark.parametrize(
    ("change", "param"),
    [
        ({"max_tokens": None}, "max_tokens"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": 1.5}, "temperature"),
        ({"thinking": {"type": "enabled", "budget_tokens": 2000}}, "thinking"),
        ({"service_tier": "auto"}, "service_tier"),
        ({"mcp_servers": []}, "mcp_servers"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "system", "content": "x"}]}, "messages[0].role"),
        (
            {"messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]},
            "messages[0].content[0]",
        ),
        (
            {
                "messages": [
                    {"role": "user", "content": [{"type": "tool_use", "id": "a", "name": "b"}]}
                ]
            },
            "messages[0].content[0]",
        ),
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [{"type": "image", "source": {"type": "file", "id": "f"}}],
                    }
                ]
            },
            "messages[0].content[0].source",
        ),
        ({"tools": [{"type": "bash_20250124", "name": "bash"}]}, "tools[0].type"),
        ({"tools": [{"name": "a b", "input_schema": {}}]}, "tools[0].name"),
        ({"tool_choice": {"type": "tool"}}, "tool_choice.name"),
        ({"metadata": {"user_id": "u", "session": "s"}}, "metadata.session"),
        ({"metadata": {"user_id": "u\r\nX-Forged: 1"}}, "metadata.user_id"),
        ({"metadata": {"user_id": "u\x1b[31m"}}, "metadata.user_id"),
        ({"stop_sequences": ["a"] * 5}, "stop_sequences"),
        ({"model": ""}, "model"),
        # a hostile member name is named, bounded
        (
            {"messages": [{"role": "user", "content": "x", "z" * 100_000: 1}]},
            "messages[0]." + "z" * 64,
        ),
    ],
)
def test_what_cannot_be_honoured_is_refused_by_name(change: dict[str, Any], param: str) -> None:
    body = {**BASE, **change}
    if change.get("max_tokens", 1) is None:
        del body["max_tokens"]
    assert _param(body) == param


def test_a_tool_use_input_integer_past_64_bits_is_refused_not_rounded() -> None:
    """The body parser reads an integer no 64-bit integer holds as a float; re-encoded,
    it would reach the upstream rounded (an id 123456789012345678901 as
    1.2345678901234568e+20). Refused by name; 64-bit integers go through exactly."""
    from switchyard.api.body import parse_json

    def turn(number: str) -> dict[str, Any]:
        raw = (
            '{"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "q"},'
            ' {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "f",'
            ' "input": {"ids": [1, {"order": ' + number + "}]}}]},"
            ' {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1"}]}],'
            ' "tools": [{"name": "f", "input_schema": {"type": "object"}}]}'
        )
        return dict(parse_json(raw.encode()))

    # (refused by the body parser first, naming the number's own place)
    for number in ("123456789012345678901", "-9223372036854775809"):
        with pytest.raises(InvalidRequest) as refused:
            turn(number)
        assert refused.value.param == "messages[1].content[0].input.ids[1].order"
    for exact in ("9223372036854775807", "-9223372036854775808", "2.5"):
        req, _ = CODEC.decode(turn(exact))
        sent = req.messages[1]["tool_calls"][0]["function"]["arguments"]
        assert json.loads(sent) == {"ids": [1, {"order": json.loads(exact)}]}
        assert exact in sent


def test_count_tokens_bodies_take_no_max_tokens() -> None:
    chat = to_chat({"model": "m", "messages": [{"role": "user", "content": "hi"}]}, True)
    assert chat == {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    with pytest.raises(InvalidRequest):
        to_chat({**BASE, "temperature": 0.1}, True)


# -- generated requests ----------------------------------------------------------------
_text = st.text(min_size=1, max_size=20)
_name = st.from_regex(r"[A-Za-z0-9_\-]{1,12}", fullmatch=True)
# What a parsed body can hold (orjson reads a bigger integer as a float).
_args = st.dictionaries(_name, st.one_of(st.integers(-(2**63), 2**63 - 1), _text), max_size=3)
_user_block = st.one_of(
    st.builds(lambda t: {"type": "text", "text": t}, _text),
    st.builds(
        lambda d: {
            "type": "image",
            "source": {"type": "base64", "media_type": "image/png", "data": d},
        },
        st.from_regex(r"[A-Za-z0-9+/]{4,16}", fullmatch=True),
    ),
)
_assistant_text = st.builds(lambda t: {"type": "text", "text": t}, _text)


@st.composite
def _conversations(draw: st.DrawFn) -> tuple[list[dict[str, Any]], list[str]]:
    """Turns whose tool blocks pair up as the Messages API requires (each tool_use
    answered by a tool_result in the next turn, ids unique), and the tool names used."""
    turns: list[dict[str, Any]] = []
    names: list[str] = []
    for _ in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from(["text", "blocks", "assistant", "call"]))
        if kind == "text":
            turns.append({"role": "user", "content": draw(_text)})
        elif kind == "blocks":
            blocks = draw(st.lists(_user_block, min_size=1, max_size=4))
            turns.append({"role": "user", "content": blocks})
        elif kind == "assistant":
            blocks = draw(st.lists(_assistant_text, min_size=1, max_size=2))
            turns.append({"role": "assistant", "content": blocks})
        else:
            uses = draw(st.lists(st.tuples(_name, _args), min_size=1, max_size=3))
            ids = [f"toolu_{len(turns)}_{k}" for k in range(len(uses))]
            calls = [
                {"type": "tool_use", "id": i, "name": n, "input": a}
                for i, (n, a) in zip(ids, uses, strict=True)
            ]
            said = draw(st.lists(_assistant_text, max_size=1))
            turns.append({"role": "assistant", "content": said + calls})
            results = [
                {"type": "tool_result", "tool_use_id": i, "content": t, "is_error": e}
                for i, t, e in zip(
                    ids,
                    draw(st.lists(_text, min_size=len(ids), max_size=len(ids))),
                    draw(st.lists(st.booleans(), min_size=len(ids), max_size=len(ids))),
                    strict=True,
                )
            ]
            more = draw(st.lists(_user_block, max_size=2))
            turns.append({"role": "user", "content": results + more})
            names.extend(n for n, _ in uses)
    return turns, sorted(set(names))


def _body(parts: tuple[tuple[list[dict[str, Any]], list[str]], dict[str, Any]]) -> dict[str, Any]:
    (turns, names), rest = parts
    body = {**rest, "messages": turns}
    extra = [n for n in rest.get("tools", []) if n not in names]
    tools = names + extra
    if tools:
        body["tools"] = [{"name": n, "input_schema": {"type": "object"}} for n in tools]
    else:
        body.pop("tools", None)
    return body


_bodies = st.tuples(
    _conversations(),
    st.fixed_dictionaries(
        {"model": _name, "max_tokens": st.integers(1, 10_000)},
        optional={
            "system": st.one_of(_text, st.lists(_assistant_text, max_size=2)),
            "temperature": st.floats(0, 1),
            "top_p": st.floats(0, 1),
            "top_k": st.integers(0, 100),
            "stop_sequences": st.lists(_text.filter(str.strip), max_size=4),
            "stream": st.booleans(),
            "tools": st.lists(_name, max_size=3, unique=True),
            "metadata": st.builds(lambda u: {"user_id": u}, _name),
        },
    ),
).map(_body)


@settings(max_examples=300, deadline=None)
@given(_bodies)
def test_every_accepted_body_is_a_valid_chat_request_that_keeps_each_block(
    body: dict[str, Any],
) -> None:
    """Nothing is lost: each text, image, tool call and tool result reaches the chat
    messages, and what the codec builds always passes the chat checks."""
    req, _ = CODEC.decode(body)
    assert req.messages is not None
    validate_chat({"model": req.model, "messages": req.messages, "tools": req.tools})
    chat = json.dumps(req.messages)
    blocks = [b for m in body["messages"] if isinstance(m["content"], list) for b in m["content"]]
    for b in blocks:
        if b["type"] == "text":
            assert json.dumps(b["text"])[1:-1] in chat
        elif b["type"] == "image":
            assert b["source"]["data"] in chat
        elif b["type"] == "tool_use":
            calls = [c for m in req.messages for c in m.get("tool_calls") or []]
            assert any(
                c["id"] == b["id"] and json.loads(c["function"]["arguments"]) == b["input"]
                for c in calls
            )
        else:
            assert any(
                m["role"] == "tool" and m["tool_call_id"] == b["tool_use_id"] for m in req.messages
            )
    assert req.stream is bool(body.get("stream")) and req.include_usage is bool(body.get("stream"))


# -- replies: whole and streamed are one message -----------------------------------------
_calls = st.lists(st.tuples(_name, _name, _args), max_size=3, unique_by=lambda c: c[0])
_finish = st.sampled_from(["stop", "length", "tool_calls"])


USAGE = {"prompt_tokens": 11, "completion_tokens": 7, "total_tokens": 18}


def _assemble(stream: bytes) -> Message:
    """The message the official SDK assembles from our event stream (its public
    `messages.stream`, reading these bytes as the HTTP reply)."""
    for raw in stream.split(b"\n\n"):  # each event is typed as the SDK types it
        if raw:
            kind, data = raw.split(b"\n", 1)
            assert kind.startswith(b"event: ") and data.startswith(b"data: ")
            obj = json.loads(data[6:])
            assert obj["type"] == kind[7:].decode()
            if obj["type"] != "ping":  # a keep-alive, not one of the message's events
                assert EVENT.validate_python(obj).type == obj["type"]

    def answer(request: Any) -> Any:
        return sdk_http.Response(200, content=stream, headers={"content-type": "text/event-stream"})

    transport = sdk_http.MockTransport(answer)
    sdk = anthropic.Anthropic(
        api_key="k", base_url="http://sdk.test", http_client=sdk_http.Client(transport=transport)
    )
    with sdk.messages.stream(
        model="m", max_tokens=1, messages=[{"role": "user", "content": "x"}]
    ) as s:
        return s.get_final_message()


def _blocks(message: Message) -> list[dict[str, Any]]:
    keys = {"type", "text", "id", "name", "input"}
    return [b.model_dump(include=keys) for b in message.content]


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=60), _calls, _finish, st.integers(1, 40))
def test_a_streamed_reply_assembles_into_the_whole_reply(
    text: str, calls: list[tuple[str, str, dict[str, Any]]], finish: str, piece: int
) -> None:
    chat = chat_reply(text, calls, finish, USAGE)
    whole = Message.model_validate(to_message(chat, "m"))
    chunks = live_chunks(text, calls, finish, USAGE, piece)  # as an upstream streams it
    events = MessageEvents("m", 3)
    written: list[bytes] = []
    for c in chunks:
        events.chunk(read_chunk(json.dumps(c).encode()), written)  # as the relay reads it
    events.end(written)
    out = b"".join(written)
    streamed = _assemble(out)
    assert _blocks(streamed) == _blocks(whole)
    assert streamed.stop_reason == whole.stop_reason
    assert streamed.usage.output_tokens == whole.usage.output_tokens == 7
    assert streamed.id == whole.id and streamed.model == "m"

    # A cache hit replayed as a stream: the same message again.
    async def collect() -> bytes:
        return b"".join([b async for b in replayed(stream_chunks(chat), MessageEvents("m", 3))])

    assert _blocks(_assemble(asyncio.run(collect()))) == _blocks(whole)


def test_an_upstream_break_ends_the_stream_with_an_anthropic_error_event() -> None:
    from switchyard.api.messages_reply import error_event

    raw = error_event(UpstreamError("the upstream ended the stream before it was complete"))
    kind, data = raw.strip().split(b"\n", 1)
    assert kind == b"event: error"
    body = json.loads(data[6:])
    assert body["type"] == "error" and body["error"]["type"] == "api_error"


def test_error_types_follow_the_status() -> None:
    from switchyard import errors

    assert (
        errors.AuthenticationError("x").anthropic_body()["error"]["type"] == "authentication_error"
    )
    assert errors.RateLimited("x").anthropic_body()["error"]["type"] == "rate_limit_error"
    assert errors.UpstreamTimeout("x").anthropic_body()["error"]["type"] == "timeout_error"
    assert errors.InvalidRequest("x").anthropic_body()["error"]["type"] == "invalid_request_error"
    assert errors.ModelNotFound("x").anthropic_body()["error"]["type"] == "not_found_error"
    assert anthropic.__version__  # the official client this shape is checked against
