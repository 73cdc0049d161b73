"""An `anthropic`-kind alias over real sockets: the gateway in front of the scripted
upstream's Messages API (which requires its own x-api-key), called with the `openai`
SDK: answers, streams, tool calls, usage in the ledger, errors mapped to the contract,
and a fallback from the failing upstream to the local engine."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from support.gateways import Gateway, local_model, start_gateway
from support.upstreams import Scripted, start_scripted

KEY = "sk-ant-test-" + os.urandom(6).hex()
KEY_ENV = "SWITCHYARD_TEST_ANTHROPIC_KEY"
UPSTREAM_MODEL = "claude-test-model"
WORDS = "Hello from the scripted upstream."
HELLO = [{"role": "user", "content": "Say hello"}]
LOOKUP = {
    "type": "function",
    "function": {
        "name": "lookup",
        "description": "Look a word up",
        "parameters": {"type": "object", "properties": {"q": {"type": "string"}}},
    },
}


def _claude(alias: str, scripted: Scripted, **more: Any) -> dict[str, Any]:
    return {
        "alias": alias,
        "revision": "claude-r1",
        "engine": {
            "kind": "anthropic",
            "base_url": scripted.url + "/v1",
            "api_key_env": KEY_ENV,
            "model": UPSTREAM_MODEL,
        },
        "capabilities": {"context_window": 200000, "supports_tools": True},
        "region": "local",
        "price": {"input": 0.0, "output": 1000.0},  # 5 tokens cost $0.005
        # No retries: each fault is one upstream answer, mapped as it came.
        "resilience": {"retries": 0},
        **more,
    }


@pytest.fixture(scope="module")
def anthropic_upstream() -> Iterator[Scripted]:
    proc, s = start_scripted("--anthropic-key", KEY)
    yield s
    proc.stop()


@pytest.fixture(scope="module")
def gw(anthropic_upstream: Scripted) -> Iterator[Gateway]:
    g = start_gateway(
        {
            "models": [
                _claude("claude-scripted", anthropic_upstream),
                _claude("claude-fallback", anthropic_upstream, fallbacks=["smollm2-135m"]),
                local_model(),
            ],
            "embeddings": {"enabled": False},
        },
        env={KEY_ENV: KEY},
    )
    yield g
    g.proc.stop()


def _last(s: Scripted) -> dict[str, Any]:
    """The last Messages request the upstream received: body and key headers."""
    r = httpx.get(s.url + "/control/last")
    assert r.status_code == 200, r.text
    return dict(r.json())


def _tool_calls(s: Scripted, calls: list[dict[str, Any]]) -> None:
    r = httpx.put(s.url + "/control/tool_calls", json={"calls": calls})
    assert r.status_code == 200, r.text


def _ledger_row(gw: Gateway, request_id: str) -> dict[str, Any]:
    deadline = time.monotonic() + 15
    while True:
        rows = [r for r in gw.usage(limit=100) if r["request_id"] == request_id]
        if rows or time.monotonic() > deadline:
            assert rows, f"no ledger row for {request_id}"
            return rows[0]
        time.sleep(0.1)


def test_the_scripted_upstream_speaks_the_wire_format_the_sdk_reads(
    anthropic_upstream: Scripted,
) -> None:
    """The fixture itself, read by the official `anthropic` SDK: a message, a text
    stream and a tool-use stream accumulate into its types; errors are its classes."""
    import anthropic

    client = anthropic.Anthropic(
        base_url=anthropic_upstream.url,
        api_key="unused",  # the SDK's bearer; the fixture checks x-api-key
        default_headers={"x-api-key": KEY, "anthropic-version": "2023-06-01"},
        max_retries=0,
    )
    ask: dict[str, Any] = {"model": "m", "max_tokens": 5, "messages": HELLO}
    msg = client.messages.create(**ask)
    assert (
        msg.content[0].type == "text" and msg.content[0].text == "Hello from the scripted upstream"
    )
    assert msg.stop_reason == "max_tokens" and msg.usage.output_tokens == 5
    with client.messages.stream(**{**ask, "max_tokens": 50}) as stream:
        assert "".join(stream.text_stream).startswith(WORDS * 2)
        assert stream.get_final_message().stop_reason == "end_turn"
    _tool_calls(anthropic_upstream, [{"name": "lookup", "arguments": {"q": "x"}}])
    try:
        tools = [{"name": "lookup", "input_schema": {"type": "object"}}]
        with client.messages.stream(**ask, tools=tools) as stream:
            final = stream.get_final_message()
    finally:
        _tool_calls(anthropic_upstream, [])
    block = final.content[0]
    assert block.type == "tool_use" and block.name == "lookup" and block.input == {"q": "x"}
    assert final.stop_reason == "tool_use"
    anthropic_upstream.fault("status:529")
    with pytest.raises(anthropic.InternalServerError) as info:
        client.messages.create(**ask)
    assert info.value.status_code == 529
    assert info.value.body["error"]["type"] == "overloaded_error"  # type: ignore[index]
    wrong = client.with_options(default_headers={"x-api-key": "wrong"})
    with pytest.raises(anthropic.AuthenticationError):
        wrong.messages.create(**ask)


def test_a_chat_request_is_served_by_the_messages_api(
    gw: Gateway, anthropic_upstream: Scripted
) -> None:
    raw = gw.openai().chat.completions.with_raw_response.create(
        model="claude-scripted",
        messages=[{"role": "system", "content": "Be brief."}, *HELLO],
        max_tokens=5,
        stop=["END"],
        temperature=0.2,
        user="alice",
        seed=7,  # no meaning there: not sent
    )
    reply = raw.parse()
    assert raw.headers["x-switchyard-upstream"] == "claude-scripted"
    assert reply.model == UPSTREAM_MODEL
    choice = reply.choices[0]
    assert choice.message.content == "Hello from the scripted upstream"  # 5 words
    assert choice.finish_reason == "length"  # max_tokens
    assert reply.usage is not None and reply.usage.completion_tokens == 5
    assert reply.usage.prompt_tokens > 0
    last = _last(anthropic_upstream)
    # The gateway's own key for the upstream, in x-api-key; never the client's.
    assert last["headers"] == {
        "x-api-key": KEY,
        "authorization": None,
        "anthropic-version": "2023-06-01",
    }
    assert last["body"] == {
        "model": UPSTREAM_MODEL,
        "max_tokens": 5,
        "messages": HELLO,
        "system": "Be brief.",
        "stop_sequences": ["END"],
        "temperature": 0.2,
        "metadata": {"user_id": "alice"},
    }
    row = _ledger_row(gw, raw.headers["x-request-id"])
    assert row["model"] == "claude-scripted" and row["status"] == "ok"
    assert (row["input_tokens"], row["output_tokens"]) == (reply.usage.prompt_tokens, 5)
    assert row["cost_usd"] == pytest.approx(0.005)


def test_a_stream_is_relayed_as_chat_chunks(gw: Gateway, anthropic_upstream: Scripted) -> None:
    client = gw.openai()
    with client.chat.completions.with_streaming_response.create(
        model="claude-scripted",
        messages=HELLO,
        stream=True,
        stream_options={"include_usage": True},
    ) as raw:
        request_id = raw.headers["x-request-id"]
        chunks = list(raw.parse())
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == (WORDS * 3)[: len(text)] and text.startswith(WORDS * 2)
    assert chunks[0].choices[0].delta.role == "assistant"
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "stop" and finishes.count("stop") == 1
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage is not None and usage.completion_tokens == 16
    body = _last(anthropic_upstream)["body"]
    assert body["stream"] is True and "stream_options" not in body
    assert _ledger_row(gw, request_id)["output_tokens"] == 16
    # The usage the gateway asked for on its own behalf is not relayed.
    plain = list(
        client.chat.completions.create(model="claude-scripted", messages=HELLO, stream=True)
    )
    assert all(c.usage is None for c in plain) and plain[-1].choices[0].finish_reason == "stop"


def test_tool_calls_come_back_as_chat_tool_calls_streamed_or_not(
    gw: Gateway, anthropic_upstream: Scripted
) -> None:
    client = gw.openai()
    ask = {"model": "claude-scripted", "messages": HELLO, "tools": [LOOKUP]}
    _tool_calls(anthropic_upstream, [{"name": "lookup", "arguments": {"q": "x"}}])
    try:
        reply = client.chat.completions.create(**ask, tool_choice="required")
        choice = reply.choices[0]
        assert choice.finish_reason == "tool_calls"
        call = choice.message.tool_calls[0]
        assert call.function.name == "lookup" and json.loads(call.function.arguments) == {"q": "x"}
        sent = _last(anthropic_upstream)["body"]
        assert sent["tools"] == [
            {
                "name": "lookup",
                "description": "Look a word up",
                "input_schema": LOOKUP["function"]["parameters"],  # type: ignore[index]
            }
        ]
        assert sent["tool_choice"] == {"type": "any"}

        chunks = list(client.chat.completions.create(**ask, stream=True))
        pieces = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
        assert pieces[0].id and pieces[0].function.name == "lookup"
        args = "".join(p.function.arguments or "" for p in pieces)
        assert json.loads(args) == {"q": "x"}
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
    finally:
        _tool_calls(anthropic_upstream, [])
    # The next turn: the call and its result go back as tool_use and tool_result.
    history = [
        *HELLO,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "42"},
    ]
    reply = client.chat.completions.create(
        model="claude-scripted", messages=history, tools=[LOOKUP], max_tokens=3
    )
    assert reply.choices[0].message.content == "Hello from the"
    sent = _last(anthropic_upstream)["body"]["messages"]
    assert sent[1] == {
        "role": "assistant",
        "content": [{"type": "tool_use", "id": call.id, "name": "lookup", "input": {"q": "x"}}],
    }
    assert sent[2] == {
        "role": "user",
        "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "42"}],
    }


@pytest.mark.parametrize(
    ("fault", "status", "code"),
    [
        ("status:429", 429, "upstream_rate_limited"),
        ("status:500", 502, "upstream_error"),
        ("status:529", 502, "upstream_error"),  # overloaded_error
        ("status:400", 400, "upstream_rejected"),
    ],
)
def test_upstream_errors_map_to_the_contract(
    gw: Gateway, anthropic_upstream: Scripted, fault: str, status: int, code: str
) -> None:
    body = {"model": "claude-scripted", "messages": HELLO, "max_tokens": 4}
    anthropic_upstream.fault(fault)
    r = gw.post("/v1/chat/completions", json=body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["code"] == code
    if status == 400:  # a 4xx says what is wrong, in the upstream's own words
        assert err["message"] == "scripted fault: HTTP 400"
    if status == 429:
        assert r.headers["retry-after"] == "1"
    assert gw.post("/v1/chat/completions", json=body).status_code == 200  # one request only


def test_the_openai_sdk_raises_its_own_errors(gw: Gateway, anthropic_upstream: Scripted) -> None:
    client = gw.openai()
    anthropic_upstream.fault("status:429")
    with pytest.raises(openai.RateLimitError):
        client.chat.completions.create(model="claude-scripted", messages=HELLO)
    # An error event in the middle of the stream breaks it: never a silent success.
    anthropic_upstream.fault("stream-error:529")
    stream = client.chat.completions.create(model="claude-scripted", messages=HELLO, stream=True)
    with pytest.raises(openai.APIError):
        list(stream)
    anthropic_upstream.fault("stream-error:529")
    with gw.stream({"model": "claude-scripted", "messages": HELLO, "stream": True}) as r:
        events = [e for e in "".join(r.iter_text()).split("\n\n") if e]
    assert "data: [DONE]" not in events and events[-1].startswith('data: {"error"')
    assert any('"content"' in e for e in events[:-1]), "the text before the error was relayed"


def test_what_the_messages_api_cannot_serve_is_refused(gw: Gateway) -> None:
    r = gw.post("/v1/completions", json={"model": "claude-scripted", "prompt": "hi"})
    assert r.status_code == 400 and "chat only" in r.json()["error"]["message"], r.text
    r = gw.post(
        "/v1/chat/completions", json={"model": "claude-scripted", "messages": HELLO, "n": 2}
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "n", r.text


def test_a_failing_anthropic_upstream_falls_back_to_the_local_engine(
    gw: Gateway, anthropic_upstream: Scripted
) -> None:
    anthropic_upstream.fault("status:500")
    raw = gw.openai().chat.completions.with_raw_response.create(
        model="claude-fallback", messages=HELLO, max_tokens=8
    )
    assert raw.headers["x-switchyard-fallback"] == "claude-fallback -> smollm2-135m"
    assert raw.headers["x-switchyard-model"] == "smollm2-135m"
    assert raw.parse().choices[0].message.content
    anthropic_upstream.fault("status:529")
    body = {"model": "claude-fallback", "messages": HELLO, "max_tokens": 8, "stream": True}
    with gw.stream(body) as r:
        assert r.status_code == 200
        assert r.headers["x-switchyard-fallback"] == "claude-fallback -> smollm2-135m"
        text = "".join(r.iter_text())
    assert text.rstrip().endswith("data: [DONE]")
    # Healthy again, the alias is served by its own upstream.
    raw = gw.openai().chat.completions.with_raw_response.create(
        model="claude-fallback", messages=HELLO, max_tokens=3
    )
    assert "x-switchyard-fallback" not in raw.headers
    assert raw.parse().choices[0].message.content == "Hello from the"
