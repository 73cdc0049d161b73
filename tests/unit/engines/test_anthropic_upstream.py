"""The Anthropic-protocol upstream's translation, without sockets: chat requests onto the
Messages API, `message` replies and SSE event streams back, errors onto the hierarchy,
and the `anthropic` engine kind's config. The scripted upstream's request check (the
provider's rules, bench/scripted_messages.py) and the official `anthropic` SDK's types
stand in for the provider."""

from __future__ import annotations

import asyncio
import itertools
import json
from typing import Any

import orjson
import pytest
from anthropic.types import Message, MessageParam, RawMessageStreamEvent, ToolChoiceParam, ToolParam
from hypothesis import given
from hypothesis import strategies as st
from pydantic import TypeAdapter

from switchyard.bench import scripted_messages
from switchyard.config import AnthropicEngine, ConfigError, Timeouts, parse_settings
from switchyard.engines.anthropic import (
    DEFAULT_MAX_TOKENS,
    AnthropicStream,
    AnthropicUpstream,
    StreamTranslator,
    chat_to_messages,
    chat_usage,
    message_to_chat,
)
from switchyard.engines.registry import Registry
from switchyard.engines.upstream import _upstream_error
from switchyard.errors import (
    InvalidRequest,
    RateLimited,
    UpstreamError,
    UpstreamOverloaded,
    UpstreamStatusError,
)

LOOKUP = {
    "type": "function",
    "function": {
        "name": "lookup",
        "description": "Look a word up",
        "parameters": {"type": "object", "properties": {"q": {"type": "string"}}},
    },
}


def _provider_accepts(body: dict[str, Any]) -> None:
    """The Messages request passes the provider's rules and the SDK's types."""
    assert scripted_messages.check_request(body) is None, body
    TypeAdapter(list[MessageParam]).validate_python(body["messages"])
    if "tools" in body:
        TypeAdapter(list[ToolParam]).validate_python(body["tools"])
    if "tool_choice" in body:
        TypeAdapter(ToolChoiceParam).validate_python(body["tool_choice"])


# -- chat request -> Messages request ---------------------------------------------------


def test_a_conversation_with_tools_and_images_is_translated() -> None:
    chat = {
        "model": "claude-x",
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "developer", "content": [{"type": "text", "text": "Use tools."}]},
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "What are these?"},
                    {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBOR"}},
                    {"type": "image_url", "image_url": {"url": "https://example.test/a.jpg"}},
                ],
            },
            {
                "role": "assistant",
                "content": "Let me look.",
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "lookup", "arguments": '{"q": "png"}'},
                    },
                    {
                        "id": "call_2",
                        "type": "function",
                        "function": {"name": "lookup", "arguments": ""},
                    },
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "an image format"},
            {"role": "tool", "tool_call_id": "call_2", "content": [{"type": "text", "text": "ok"}]},
            {"role": "user", "content": "Thanks"},
        ],
        "tools": [LOOKUP],
        "tool_choice": "required",
        "max_tokens": 100,
        "stop": "END",
        "temperature": 0.5,
        "top_p": 0.9,
        "top_k": 40,
        "user": "u-1",
        "seed": 7,
        "presence_penalty": 0.1,
        "n": 1,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    out = chat_to_messages(chat)
    assert out["system"] == [
        {"type": "text", "text": "Be brief."},
        {"type": "text", "text": "Use tools."},
    ]
    user, assistant, results = out["messages"]
    assert user["role"] == "user"
    assert user["content"][1] == {
        "type": "image",
        "source": {"type": "base64", "media_type": "image/png", "data": "iVBOR"},
    }
    assert user["content"][2]["source"] == {"type": "url", "url": "https://example.test/a.jpg"}
    assert assistant == {
        "role": "assistant",
        "content": [
            {"type": "text", "text": "Let me look."},
            {"type": "tool_use", "id": "call_1", "name": "lookup", "input": {"q": "png"}},
            {"type": "tool_use", "id": "call_2", "name": "lookup", "input": {}},
        ],
    }
    # Both results and the next user words are one user turn, the results first.
    assert results["role"] == "user"
    assert results["content"] == [
        {"type": "tool_result", "tool_use_id": "call_1", "content": "an image format"},
        {
            "type": "tool_result",
            "tool_use_id": "call_2",
            "content": [{"type": "text", "text": "ok"}],
        },
        {"type": "text", "text": "Thanks"},
    ]
    assert out["tools"] == [
        {
            "name": "lookup",
            "description": "Look a word up",
            "input_schema": LOOKUP["function"]["parameters"],  # type: ignore[index]
        }
    ]
    assert out["tool_choice"] == {"type": "any"}
    assert out["stop_sequences"] == ["END"]
    assert (out["temperature"], out["top_p"], out["top_k"]) == (0.5, 0.9, 40)
    assert out["metadata"] == {"user_id": "u-1"}
    assert out["max_tokens"] == 100 and out["stream"] is True
    for dropped in ("seed", "presence_penalty", "n", "stream_options", "user", "stop"):
        assert dropped not in out
    _provider_accepts(out)


@pytest.mark.parametrize(
    ("choice", "parallel", "expected"),
    [
        ("auto", None, {"type": "auto"}),
        ("none", None, {"type": "none"}),
        ("required", None, {"type": "any"}),
        (
            {"type": "function", "function": {"name": "lookup"}},
            None,
            {"type": "tool", "name": "lookup"},
        ),
        (None, None, None),
        (None, False, {"type": "auto", "disable_parallel_tool_use": True}),
        ("required", False, {"type": "any", "disable_parallel_tool_use": True}),
    ],
)
def test_tool_choice_is_translated(choice: Any, parallel: Any, expected: Any) -> None:
    chat: dict[str, Any] = {
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
        "tools": [LOOKUP],
    }
    if choice is not None:
        chat["tool_choice"] = choice
    if parallel is not None:
        chat["parallel_tool_calls"] = parallel
    out = chat_to_messages(chat)
    assert out.get("tool_choice") == expected
    _provider_accepts(out)


def test_max_tokens_is_the_tighter_cap_or_the_default() -> None:
    base = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    assert chat_to_messages(base)["max_tokens"] == DEFAULT_MAX_TOKENS
    assert chat_to_messages(base, 64)["max_tokens"] == 64
    assert chat_to_messages({**base, "max_completion_tokens": 9})["max_tokens"] == 9
    assert (
        chat_to_messages({**base, "max_tokens": 30, "max_completion_tokens": 20})["max_tokens"]
        == 20
    )


def test_empty_turns_are_left_out_and_a_lone_text_is_a_string() -> None:
    out = chat_to_messages(
        {
            "model": "m",
            "messages": [
                {"role": "user", "content": "hi"},
                {"role": "assistant", "content": ""},
                {"role": "user", "content": [{"type": "text", "text": "again"}]},
            ],
            "stop": ["a", "b"],
        }
    )
    assert out["messages"] == [
        {
            "role": "user",
            "content": [{"type": "text", "text": "hi"}, {"type": "text", "text": "again"}],
        }
    ]
    assert out["stop_sequences"] == ["a", "b"]
    assert "system" not in out
    _provider_accepts(out)


@pytest.mark.parametrize(
    ("change", "param"),
    [
        ({"n": 2}, "n"),
        ({"logprobs": True}, "logprobs"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
        ({"min_p": 0.1}, "min_p"),
        ({"functions": [{"name": "f"}]}, "functions"),
        (
            {
                "messages": [
                    {"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}
                ]
            },
            "messages[0].content[0]",
        ),
        ({"messages": [{"role": "function", "name": "f", "content": "x"}]}, "messages[0].role"),
        (
            {
                "messages": [
                    {
                        "role": "assistant",
                        "tool_calls": [
                            {
                                "id": "c",
                                "type": "function",
                                "function": {"name": "f", "arguments": "[1]"},
                            }
                        ],
                    }
                ]
            },
            "messages[0].tool_calls[0].function.arguments",
        ),
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [{"type": "image_url", "image_url": {"url": "ftp://x"}}],
                    }
                ]
            },
            "messages[0].content[0]",
        ),
    ],
)
def test_what_cannot_be_translated_is_refused_naming_it(change: dict[str, Any], param: str) -> None:
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **change}
    with pytest.raises(InvalidRequest) as info:
        chat_to_messages(chat)
    assert info.value.status == 400
    assert info.value.param == param
    assert "Messages API" in info.value.message


def test_defaults_of_untranslatable_fields_are_accepted() -> None:
    chat = {
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
        "n": 1,
        "logprobs": False,
        "response_format": {"type": "text"},
        "logit_bias": {"1": 2},
        "metadata": {"a": "b"},
    }
    out = chat_to_messages(chat)
    assert set(out) == {"model", "max_tokens", "messages"}


def test_only_chat_is_served() -> None:
    up = AnthropicUpstream("u", "http://127.0.0.1:9/v1", "k", "2023-06-01")
    payload = orjson.dumps({"model": "m", "prompt": "hi"})
    with pytest.raises(InvalidRequest, match="chat only"):
        asyncio.run(up.post("/completions", payload, Timeouts()))
    assert asyncio.run(up.tokenize("hi", 1.0)) is None


# -- Messages reply -> chat reply -------------------------------------------------------


def _sdk_message(
    content: list[dict[str, Any]], stop: str = "end_turn", **usage: int
) -> dict[str, Any]:
    """A Messages reply, checked against the SDK's Message type."""
    msg = {
        "id": "msg_1",
        "type": "message",
        "role": "assistant",
        "model": "claude-x-1",
        "content": content,
        "stop_reason": stop,
        "stop_sequence": None,
        "usage": {"input_tokens": 10, "output_tokens": 4, **usage},
    }
    Message.model_validate(msg)
    return msg


def test_a_message_becomes_a_chat_completion() -> None:
    msg = _sdk_message(
        [
            {"type": "thinking", "thinking": "hmm", "signature": "s"},
            {"type": "text", "text": "Looking "},
            {"type": "text", "text": "it up."},
            {"type": "tool_use", "id": "toolu_1", "name": "lookup", "input": {"q": "x"}},
        ],
        stop="tool_use",
        cache_read_input_tokens=5,
        cache_creation_input_tokens=2,
    )
    chat = message_to_chat(msg, "fallback-name", 123)
    assert chat["object"] == "chat.completion" and chat["created"] == 123
    assert chat["model"] == "claude-x-1" and chat["id"] == "msg_1"
    choice = chat["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] == "Looking it up."
    call = choice["message"]["tool_calls"][0]
    assert call["id"] == "toolu_1" and call["type"] == "function"
    assert call["function"]["name"] == "lookup"
    assert json.loads(call["function"]["arguments"]) == {"q": "x"}
    assert chat["usage"] == {
        "prompt_tokens": 17,
        "completion_tokens": 4,
        "total_tokens": 21,
        "prompt_tokens_details": {"cached_tokens": 5},
    }


@pytest.mark.parametrize(
    ("stop", "finish"),
    [
        ("end_turn", "stop"),
        ("stop_sequence", "stop"),
        ("max_tokens", "length"),
        ("tool_use", "tool_calls"),
        ("refusal", "content_filter"),
    ],
)
def test_stop_reasons_map_to_finish_reasons(stop: str, finish: str) -> None:
    msg = _sdk_message([{"type": "text", "text": "x"}], stop=stop)
    assert message_to_chat(msg, "m", 0)["choices"][0]["finish_reason"] == finish


def test_tool_calls_alone_have_null_content() -> None:
    msg = _sdk_message([{"type": "tool_use", "id": "t", "name": "f", "input": {}}], stop="tool_use")
    message = message_to_chat(msg, "m", 0)["choices"][0]["message"]
    assert message["content"] is None
    assert message["tool_calls"][0]["function"]["arguments"] == "{}"


def test_a_reply_that_is_no_message_is_an_upstream_error() -> None:
    for bad in (None, [], {"type": "message"}):
        with pytest.raises(UpstreamError):
            message_to_chat(bad, "m", 0)


def test_usage_counts_null_cache_counts_as_zero() -> None:
    usage = {"input_tokens": 3, "output_tokens": 2, "cache_read_input_tokens": None}
    assert chat_usage(usage) == {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}


@pytest.mark.parametrize(
    "usage",
    [
        None,
        {},
        ["input_tokens", 5, "output_tokens", 900],
        {"input_tokens": 3},  # no output_tokens: nothing says what was written
        {"input_tokens": 3, "output_tokens": None},
        {"input_tokens": "5", "output_tokens": 900},
        {"input_tokens": 5, "output_tokens": "900"},
        {"input_tokens": 5, "output_tokens": [900]},
        {"input_tokens": 5, "output_tokens": True},
        {"input_tokens": 5, "output_tokens": -1},
        {"input_tokens": 5, "output_tokens": 4, "cache_read_input_tokens": True},
        {"input_tokens": 5, "output_tokens": 4, "cache_creation_input_tokens": 1.5},
        {"input_tokens": 2**31 - 1, "output_tokens": 4, "cache_read_input_tokens": 2**31 - 1},
    ],
)
def test_unusable_usage_is_no_usage(usage: Any) -> None:
    """Counts `usage.counts` would refuse, or none at all, give no chat usage: the
    whole reply carries none and a stream no usage chunk, so settling bills the
    estimate (the cap) as for an OpenAI upstream, never $0."""
    assert chat_usage(usage) is None
    msg = _sdk_message([{"type": "text", "text": "long answer"}])
    msg["usage"] = usage
    assert "usage" not in message_to_chat(msg, "m", 0)
    t = StreamTranslator("m", 0, True)
    start = {"id": "msg_1", "model": "m"}
    if usage is not None:
        start["usage"] = usage
    items = t.feed("message_start", {"message": start})
    items += t.feed(
        "content_block_delta", {"index": 0, "delta": {"type": "text_delta", "text": "x"}}
    )
    items += t.feed("message_delta", {"delta": {"stop_reason": "end_turn"}})
    items += t.feed("message_stop", {})
    assert items[-1] == b"[DONE]" and all(b'"usage"' not in i for i in items)


# -- errors -------------------------------------------------------------------------------


def _anthropic_error(kind: str, message: str) -> bytes:
    return orjson.dumps({"type": "error", "error": {"type": kind, "message": message}})


def test_anthropic_error_bodies_map_onto_the_hierarchy() -> None:
    bad = _upstream_error(
        400, _anthropic_error("invalid_request_error", "max_tokens: too big"), "u"
    )
    assert isinstance(bad, UpstreamStatusError) and bad.status == 400
    assert bad.message == "max_tokens: too big" and bad.retry_class is None
    limited = _upstream_error(
        429, _anthropic_error("rate_limit_error", "slow"), "u", {"Retry-After": "2"}
    )
    assert isinstance(limited, RateLimited) and limited.retry_class == "429"
    assert limited.retry_after_s == 2.0
    overloaded = _upstream_error(529, _anthropic_error("overloaded_error", "Overloaded"), "u")
    assert isinstance(overloaded, UpstreamError) and overloaded.retry_class == "503"
    assert overloaded.status == 502
    busy = _upstream_error(529, b"", "u", {"Retry-After": "3"})
    assert isinstance(busy, UpstreamOverloaded) and busy.status == 503
    assert _upstream_error(500, _anthropic_error("api_error", "x"), "u").retry_class == "500"


@pytest.mark.parametrize(
    ("kind", "cls", "retry_class"),
    [
        ("overloaded_error", UpstreamError, "503"),
        ("api_error", UpstreamError, "500"),
        ("rate_limit_error", RateLimited, "429"),
        ("invalid_request_error", UpstreamStatusError, None),
    ],
)
def test_an_error_event_mid_stream_raises_the_mapped_error(
    kind: str, cls: type[Exception], retry_class: str | None
) -> None:
    t = StreamTranslator("m", 0, True, "u")
    t.feed("message_start", {"message": {"id": "msg_1", "model": "m", "usage": {}}})
    t.feed("content_block_start", {"index": 0, "content_block": {"type": "text", "text": ""}})
    with pytest.raises(cls) as info:
        t.feed("error", {"type": "error", "error": {"type": kind, "message": "boom secret"}})
    assert info.value.retry_class == retry_class  # type: ignore[attr-defined]
    # The client sees the gateway's words; the upstream's stay in `detail` (log, trace).
    assert "secret" not in info.value.message  # type: ignore[attr-defined]
    assert "boom secret" in (info.value.detail or "")  # type: ignore[attr-defined]


class _OneRead:
    """An aiohttp response whose whole body arrives in one network read."""

    def __init__(self, body: bytes) -> None:
        self.headers: dict[str, str] = {}
        self.content = self
        self.body = body
        self.closed = False

    async def iter_any(self) -> Any:
        yield self.body

    def close(self) -> None:
        self.closed = True


def test_what_came_before_an_error_event_in_the_same_read_is_relayed_first() -> None:
    msg = _sdk_message([{"type": "text", "text": "partial answer"}])
    events = _events(msg, [7])[:5]  # start, block start, ping, two text deltas
    events.append({"type": "error", "error": {"type": "overloaded_error", "message": "x"}})
    body = b"".join(
        b"event: " + e["type"].encode() + b"\ndata: " + orjson.dumps(e) + b"\n\n" for e in events
    )
    resp = _OneRead(body)
    up = AnthropicUpstream("u", "http://127.0.0.1:9/v1", None, "2023-06-01")
    stream = AnthropicStream(resp, up, StreamTranslator("m", 0, True, "u"))  # type: ignore[arg-type]
    got: list[bytes] = []

    async def read() -> None:
        async for batch in stream.data():
            got.extend(batch)

    with pytest.raises(UpstreamError) as info:
        asyncio.run(read())
    assert info.value.retry_class == "503"
    text = "".join(orjson.loads(c)["choices"][0]["delta"].get("content") or "" for c in got)
    assert text == "partial answer" and b"[DONE]" not in got
    stream.close()
    assert resp.closed


def test_an_event_that_is_not_json_is_an_upstream_error() -> None:
    with pytest.raises(UpstreamError):
        StreamTranslator("m", 0, True).feed_data(b"not json")


_TEXT = {"index": 0, "delta": {"type": "text_delta", "text": "x"}}
_START = {"message": {"id": "msg_1", "model": "m", "usage": {"output_tokens": 1}}}


@pytest.mark.parametrize(
    "events",
    [
        [("content_block_delta", _TEXT)],  # text before message_start
        [("content_block_start", {"index": 0, "content_block": {"type": "text"}})],
        [("message_delta", {"delta": {"stop_reason": "end_turn"}})],
        [("message_stop", {})],
        [("message_start", _START), ("message_start", _START)],  # a second start
        [
            ("message_start", _START),
            ("message_delta", {"delta": {}}),
            ("content_block_delta", _TEXT),
        ],
        [
            ("message_start", _START),
            ("message_delta", {"delta": {}}),
            ("content_block_start", {"index": 1, "content_block": {"type": "text", "text": "y"}}),
        ],
    ],
)
def test_an_event_out_of_order_breaks_the_stream(events: list[tuple[str, dict[str, Any]]]) -> None:
    """An event out of its place ends the stream as an unreadable one does (the relay
    sends an error event), before any chunk no OpenAI upstream could send goes out:
    content after the finish chunk, chunks under the placeholder id."""
    t = StreamTranslator("m", 0, True, "u")
    *before, (kind, data) = events
    sent = [i for k, d in before for i in t.feed(k, d)]
    assert all(orjson.loads(i)["id"] == "msg_1" for i in sent)
    with pytest.raises(UpstreamError) as info:
        t.feed(kind, data)
    assert info.value.message == f"upstream u sent the Messages-API event {kind} out of order"


def test_pings_and_new_event_types_may_come_anywhere() -> None:
    t = StreamTranslator("m", 0, False)
    assert t.feed("ping", {}) == [] and t.feed("some_new_event", {}) == []
    assert orjson.loads(t.feed("message_start", _START)[0])["id"] == "msg_1"
    assert t.feed("message_delta", {"delta": {"stop_reason": "end_turn"}}) != []
    assert t.feed("ping", {}) == []
    assert t.feed("message_stop", {})[-1] == b"[DONE]"


@pytest.mark.parametrize("bad", ['{"q": "x"}', ["q"], 3, True])
def test_a_tool_input_that_is_not_an_object_is_an_upstream_error(bad: Any) -> None:
    """A `tool_use` input must be an object: a string would go out as the JSON of a
    string (`"\\"{...}\\""`), arguments no client can read."""
    msg = _sdk_message([{"type": "tool_use", "id": "t", "name": "f", "input": {}}], stop="tool_use")
    msg["content"][0]["input"] = bad
    with pytest.raises(UpstreamError):
        message_to_chat(msg, "m", 0)
    t = StreamTranslator("m", 0, True, "u")
    t.feed("message_start", _START)
    block = {"type": "tool_use", "id": "t", "name": "f", "input": bad}
    with pytest.raises(UpstreamError, match="input is not an object"):
        t.feed("content_block_start", {"index": 0, "content_block": block})


# -- Messages stream -> chat chunks -------------------------------------------------------


def _events(msg: dict[str, Any], cuts: list[int], pings: bool = True) -> list[dict[str, Any]]:
    """`msg` as the provider streams it: text and tool input cut at `cuts` (fractions
    reused in turn), a ping after each block start when `pings`."""
    start = {
        **msg,
        "content": [],
        "stop_reason": None,
        "usage": {**msg["usage"], "output_tokens": 1},
    }
    out: list[dict[str, Any]] = [{"type": "message_start", "message": start}]
    k = 0
    for i, block in enumerate(msg["content"]):
        if block["type"] == "text":
            head, whole, kind, key = (
                {"type": "text", "text": ""},
                block["text"],
                "text_delta",
                "text",
            )
        else:
            head = {**block, "input": {}}
            # A call without input streams one empty piece (the provider's way).
            whole = orjson.dumps(block["input"]).decode() if block["input"] else ""
            kind, key = "input_json_delta", "partial_json"
        out.append({"type": "content_block_start", "index": i, "content_block": head})
        if pings:
            out.append({"type": "ping"})
        if not whole and kind == "input_json_delta":
            out.append(
                {"type": "content_block_delta", "index": i, "delta": {"type": kind, key: ""}}
            )
        at = 0
        while at < len(whole):
            step = max(1, cuts[k % len(cuts)] if cuts else len(whole))
            k += 1
            out.append(
                {
                    "type": "content_block_delta",
                    "index": i,
                    "delta": {"type": kind, key: whole[at : at + step]},
                }
            )
            at += step
        out.append({"type": "content_block_stop", "index": i})
    out.append(
        {
            "type": "message_delta",
            "delta": {"stop_reason": msg["stop_reason"], "stop_sequence": None},
            "usage": {"output_tokens": msg["usage"]["output_tokens"]},
        }
    )
    out.append({"type": "message_stop"})
    return out


def _accumulate(items: list[bytes]) -> tuple[dict[str, Any], str | None, dict[str, Any] | None]:
    """What an OpenAI client makes of chunk data: (message, finish_reason, usage)."""
    assert items[-1] == b"[DONE]"
    chunks = [orjson.loads(i) for i in items[:-1]]
    first = chunks[0]["choices"][0]["delta"]
    assert first["role"] == "assistant"
    text: list[str] = []
    calls: dict[int, dict[str, Any]] = {}
    finish = usage = None
    for c in chunks:
        assert c["object"] == "chat.completion.chunk"
        if not c["choices"]:
            usage = c["usage"]
            continue
        choice = c["choices"][0]
        delta = choice["delta"]
        if delta.get("content"):
            text.append(delta["content"])
        for tc in delta.get("tool_calls", []):
            call = calls.setdefault(tc["index"], {"arguments": ""})
            if "id" in tc:
                call.update(id=tc["id"], name=tc["function"]["name"])
            call["arguments"] += tc["function"]["arguments"]
        if choice["finish_reason"] is not None:
            assert finish is None, "one finish chunk"
            finish = choice["finish_reason"]
    message: dict[str, Any] = {"content": "".join(text) or None}
    if calls:
        message["tool_calls"] = [calls[i] for i in sorted(calls)]
    return message, finish, usage


def test_a_stream_is_translated_as_an_openai_upstream_streams() -> None:
    msg = _sdk_message(
        [
            {"type": "text", "text": "Hello there"},
            {"type": "tool_use", "id": "toolu_1", "name": "lookup", "input": {"q": "x"}},
            {"type": "tool_use", "id": "toolu_2", "name": "now", "input": {}},
        ],
        stop="tool_use",
    )
    t = StreamTranslator("fallback", 5, True)
    items: list[bytes] = []
    for event in _events(msg, [4]):
        TypeAdapter(RawMessageStreamEvent).validate_python(event) if event[
            "type"
        ] != "ping" else None
        items += t.feed(event["type"], event)
    message, finish, usage = _accumulate(items)
    assert message["content"] == "Hello there"
    assert message["tool_calls"] == [
        {"id": "toolu_1", "name": "lookup", "arguments": '{"q":"x"}'},
        {"id": "toolu_2", "name": "now", "arguments": "{}"},  # no input: {}
    ]
    assert finish == "tool_calls"
    assert usage == {"prompt_tokens": 10, "completion_tokens": 4, "total_tokens": 14}
    first = orjson.loads(items[0])
    assert first["model"] == "claude-x-1" and first["id"] == "msg_1" and first["created"] == 5


def test_no_usage_chunk_unless_asked_and_nothing_after_the_end() -> None:
    msg = _sdk_message([{"type": "text", "text": "hi"}])
    t = StreamTranslator("m", 0, False)
    items = [i for e in _events(msg, []) for i in t.feed(e["type"], e)]
    assert all(b'"usage"' not in i for i in items)
    assert items[-1] == b"[DONE]"
    assert t.feed("message_stop", {"type": "message_stop"}) == []
    assert t.feed("some_new_event", {"type": "some_new_event"}) == []


# -- properties ---------------------------------------------------------------------------

_names = st.text(alphabet="abcdefghijklmnopqrstuvwxyz_", min_size=1, max_size=12)
_json = st.recursive(
    st.none() | st.booleans() | st.integers(-1000, 1000) | st.text(max_size=10),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_names, inner, max_size=3),
    max_leaves=8,
)
_calls = st.lists(st.tuples(_names, st.dictionaries(_names, _json, max_size=4)), max_size=3)
_texts = st.text(min_size=1, max_size=40).filter(str.strip)


@given(text=st.none() | _texts, calls=_calls)
def test_an_assistant_turn_round_trips_through_the_messages_api(
    text: str | None, calls: list[tuple[str, dict[str, Any]]]
) -> None:
    """chat -> Messages (the assistant turn's blocks) -> a `message` with those blocks
    -> chat: the same text and the same calls."""
    tool_calls = [
        {"id": f"call_{i}", "type": "function", "function": {"name": n, "arguments": json.dumps(a)}}
        for i, (n, a) in enumerate(calls)
    ]
    assistant: dict[str, Any] = {"role": "assistant", "content": text}
    if tool_calls:
        assistant["tool_calls"] = tool_calls
    out = chat_to_messages(
        {"model": "m", "messages": [{"role": "user", "content": "q"}, assistant]}
    )
    turns = out["messages"]
    if text is None and not calls:
        assert len(turns) == 1  # an empty turn is left out
        return
    blocks = turns[1]["content"]
    blocks = [{"type": "text", "text": blocks}] if isinstance(blocks, str) else blocks
    back = message_to_chat(_sdk_message(blocks), "m", 0)["choices"][0]["message"]
    assert back["content"] == text  # None: tool calls alone
    got = [
        (c["id"], c["function"]["name"], json.loads(c["function"]["arguments"]))
        for c in back.get("tool_calls", [])
    ]
    assert got == [(f"call_{i}", n, a) for i, (n, a) in enumerate(calls)]


@st.composite
def _conversations(draw: Any) -> list[dict[str, Any]]:
    """Well-formed chat conversations: user turns, assistant turns (text and/or tool
    calls), each call answered by a tool message right after."""
    out: list[dict[str, Any]] = []
    if draw(st.booleans()):
        out.append({"role": "system", "content": draw(_texts)})
    ids = 0
    for _ in range(draw(st.integers(1, 4))):
        out.append({"role": "user", "content": draw(_texts)})
        names = draw(st.lists(_names, max_size=2))
        text = draw(st.none() | _texts) if names else draw(_texts)
        calls = []
        for n in names:
            calls.append(
                {"id": f"c{ids}", "type": "function", "function": {"name": n, "arguments": "{}"}}
            )
            ids += 1
        turn: dict[str, Any] = {"role": "assistant", "content": text}
        if calls:
            turn["tool_calls"] = calls
        out.append(turn)
        out += [{"role": "tool", "tool_call_id": c["id"], "content": draw(_texts)} for c in calls]
    return out


@given(_conversations())
def test_well_formed_conversations_translate_to_requests_the_provider_accepts(
    messages: list[dict[str, Any]],
) -> None:
    out = chat_to_messages({"model": "m", "messages": messages, "tools": [LOOKUP]})
    _provider_accepts(out)
    roles = [t["role"] for t in out["messages"]]
    assert all(a != b for a, b in itertools.pairwise(roles)), roles


_blocks = st.lists(
    st.one_of(
        _texts.map(lambda t: {"type": "text", "text": t}),
        st.tuples(_names, st.dictionaries(_names, _json, max_size=3)).map(
            lambda c: {"type": "tool_use", "name": c[0], "input": c[1]}
        ),
    ),
    min_size=1,
    max_size=4,
)


@given(
    blocks=_blocks,
    stop=st.sampled_from(["end_turn", "max_tokens", "tool_use", "stop_sequence"]),
    cuts=st.lists(st.integers(1, 7), max_size=5),
    pings=st.booleans(),
    cached=st.integers(0, 50),
)
def test_a_streamed_message_gives_what_the_whole_one_gives(
    blocks: list[dict[str, Any]], stop: str, cuts: list[int], pings: bool, cached: int
) -> None:
    """However the provider cuts its stream, the chunks add up to the chat completion
    of the whole message: the same content, tool calls, finish reason and usage."""
    content = [
        {**b, "id": f"toolu_{i}"} if b["type"] == "tool_use" else b for i, b in enumerate(blocks)
    ]
    msg = _sdk_message(content, stop=stop, cache_read_input_tokens=cached)
    whole = message_to_chat(msg, "m", 0)
    t = StreamTranslator("m", 0, True)
    items = [i for e in _events(msg, cuts, pings) for i in t.feed(e["type"], e)]
    message, finish, usage = _accumulate(items)
    expected = whole["choices"][0]["message"]
    assert message["content"] == (expected["content"] or None)
    got_calls = [
        (c["id"], c["name"], json.loads(c["arguments"])) for c in message.get("tool_calls", [])
    ]
    want_calls = [
        (c["id"], c["function"]["name"], json.loads(c["function"]["arguments"]))
        for c in expected.get("tool_calls", [])
    ]
    assert got_calls == want_calls
    assert finish == whole["choices"][0]["finish_reason"]
    assert usage == whole["usage"]


# -- config and registry ------------------------------------------------------------------


def _model(**engine: Any) -> dict[str, Any]:
    return {"alias": "claude", "engine": {"kind": "anthropic", **engine}}


def test_the_engine_kind_is_configured_like_an_openai_upstream(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("TEST_ANTHROPIC_KEY", "sk-1")
    s = parse_settings(
        {
            "models": [
                _model(
                    base_url="https://host/v1/", api_key_env="TEST_ANTHROPIC_KEY", model="claude-x"
                )
            ]
        }
    )
    spec = s.models[0].engine
    assert isinstance(spec, AnthropicEngine)
    assert spec.base_url == "https://host/v1" and spec.anthropic_version == "2023-06-01"
    assert spec.api_key() == "sk-1"
    dep = Registry(s).get("claude")
    assert dep is not None and dep.engine is None  # external: nothing managed
    assert isinstance(dep.upstream, AnthropicUpstream)
    assert dep.upstream_model == "claude-x" and dep.location == "cloud"
    assert dep.token_ids is None and dep.lora is None
    assert dep.describe()["kind"] == "anthropic" and dep.describe()["state"] == "external"


@pytest.mark.parametrize(
    ("models", "says"),
    [
        ([_model(base_url="http://h", api_key="sk-inline")], "not allowed inline"),
        ([_model(base_url="ftp://h")], "http:// or https://"),
        (
            [{**_model(base_url="http://h"), "capabilities": {"supports_json_schema": True}}],
            "supports_json_schema",
        ),
        (
            [{**_model(base_url="http://h"), "capabilities": {"supports_token_ids": True}}],
            "supports_token_ids",
        ),
        (
            [
                {
                    **_model(base_url="http://h"),
                    "region": "us",
                    "fallbacks": ["local"],
                    "data_boundary": ["us"],
                },
                {"alias": "local", "region": "eu", "engine": {"kind": "llamacpp"}},
            ],
            "outside this model's data_boundary",
        ),
        (
            [
                {
                    "alias": "local",
                    "engine": {"kind": "llamacpp"},
                    "fallbacks": ["claude"],
                    "data_boundary": ["local"],
                },
                {**_model(base_url="http://h"), "region": "us"},
            ],
            "outside this model's data_boundary",
        ),
    ],
)
def test_bad_anthropic_configs_are_refused_at_load(models: list[dict[str, Any]], says: str) -> None:
    with pytest.raises(ConfigError, match=says):
        parse_settings({"models": models})


def test_an_anthropic_model_cannot_carry_adapters_or_rl() -> None:
    claude = _model(base_url="http://h")
    adapter = {"name": "a", "base": "claude", "base_revision": "unversioned", "path": "demo:pirate"}
    with pytest.raises(ConfigError, match="only those load adapters"):
        parse_settings({"models": [claude], "adapters": [adapter]})
    with pytest.raises(ConfigError, match="revisions are managed"):
        parse_settings({"models": [claude], "rl": {"models": {"claude": {}}}})
