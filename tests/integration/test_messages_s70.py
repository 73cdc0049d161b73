"""The Messages rules of the s70 review beyond its own tests
(tests/integration/test_hostile_s70c.py), over sockets against one real gateway in
front of the scripted upstream (`scripted.requests()` counts what went upstream):

- a reply with nothing to say is `content: []` (Anthropic's shape), whole and streamed,
  as the official `anthropic` SDK reads it: never the empty text block the codec refuses;
- tool blocks that pair up still go upstream as chat tool calls and results, while a
  result answered twice, or answering a call of an earlier turn than the one before, is
  a 400;
- `cache_control` in each shape the Messages API takes is accepted wherever it may
  appear (text, system and tool_result blocks, tools); any other value is a 400 there;
- empty text is refused in system and tool_result blocks as in a turn's;
- two tools of one name are a 400 on chat completions and Responses too (one rule,
  policy/validate.py `tools_array`), in the OpenAI error shape;
- a repeated credential header is a 401 on every route that reads it, before anything
  goes upstream; the request is served when the header comes once.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import pytest

from support.gateways import Gateway, cheap_config, start_gateway
from support.hostile_upstream import Hostile, hostile_upstream, json_reply, sse_reply
from support.upstreams import Scripted

ASK = [{"role": "user", "content": "look it up"}]
TOOL = {"name": "search", "description": "search", "input_schema": {"type": "object"}}
COUNT = "/v1/messages/count_tokens"
CHAT_TOOL = {"type": "function", "function": {"name": "search", "parameters": {"type": "object"}}}


USAGE = {"prompt_tokens": 5, "completion_tokens": 0, "total_tokens": 5}
SILENT = {  # an engine with nothing to say, whole and streamed
    "whole": json_reply(
        json.dumps(
            {
                "id": "chatcmpl-1",
                "object": "chat.completion",
                "created": 1,
                "model": "m",
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": ""},
                        "finish_reason": "stop",
                    }
                ],
                "usage": USAGE,
            }
        ).encode()
    ),
    "stream": sse_reply(
        *(
            b"data: "
            + json.dumps(
                {
                    "id": "chatcmpl-1",
                    "object": "chat.completion.chunk",
                    "created": 1,
                    "model": "m",
                    **part,
                }
            ).encode()
            + b"\n\n"
            for part in (
                {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]},
                {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]},
                {"choices": [], "usage": USAGE},
            )
        ),
        b"data: [DONE]\n\n",
    ),
}


@pytest.fixture(scope="module")
def silent() -> Iterator[Hostile]:
    with hostile_upstream(SILENT) as up:
        yield up


@pytest.fixture(scope="module")
def gw(scripted: Scripted, silent: Hostile) -> Iterator[Gateway]:
    models = [
        {"alias": f"silent-{name}", "engine": {"kind": "openai", "base_url": silent.base_url(name)}}
        for name in SILENT
    ]
    g = start_gateway(cheap_config(scripted, *models))
    yield g
    g.proc.stop()


def _post(gw: Gateway, body: Any, path: str = "/v1/messages") -> httpx.Response:
    h = {"x-api-key": gw.key, "anthropic-version": "2023-06-01"}
    return httpx.post(gw.url + path, json=body, headers=h, timeout=30)


def _body(**fields: Any) -> dict[str, Any]:
    return {"model": "cheap", "max_tokens": 16, "messages": ASK, **fields}


def _refused(gw: Gateway, scripted: Scripted, body: dict[str, Any], param: str) -> str:
    """`body` is a 400 in Anthropic's shape naming `param`, and nothing went upstream;
    its message."""
    before = scripted.requests()
    r = _post(gw, body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert r.json()["type"] == "error" and error["type"] == "invalid_request_error", r.text
    assert param in error["message"], error
    assert scripted.requests() == before
    return str(error["message"])


def _use(call_id: str) -> dict[str, Any]:
    return {"type": "tool_use", "id": call_id, "name": "search", "input": {"q": call_id}}


def _result(call_id: str, **more: Any) -> dict[str, Any]:
    return {"type": "tool_result", "tool_use_id": call_id, "content": "42", **more}


def _sdk(gw: Gateway) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=gw.url, api_key=gw.key, max_retries=0)


def test_a_reply_with_nothing_to_say_has_no_block_whole_or_streamed(gw: Gateway) -> None:
    """An engine answering "" was a `content: [{"type": "text", "text": ""}]`, a block
    the gateway itself refuses when a client sends it back; it is `content: []` now
    (no `content_block_*` event when streamed), and the SDK reads that both ways."""
    r = _post(gw, _body(model="silent-whole"))
    assert r.status_code == 200, r.text
    assert r.json()["content"] == [] and r.json()["stop_reason"] == "end_turn"
    with httpx.stream(
        "POST",
        gw.url + "/v1/messages",
        json=_body(model="silent-stream", stream=True),
        headers={"x-api-key": gw.key, "anthropic-version": "2023-06-01"},
        timeout=30,
    ) as s:
        assert s.status_code == 200
        events = [line[7:] for line in s.iter_lines() if line.startswith("event: ")]
    assert events == ["message_start", "ping", "message_delta", "message_stop"], events
    sdk = _sdk(gw)
    whole = sdk.messages.create(
        model="silent-whole", max_tokens=16, messages=[{"role": "user", "content": "hi"}]
    )
    assert whole.content == [] and whole.stop_reason == "end_turn"
    with sdk.messages.stream(
        model="silent-stream", max_tokens=16, messages=[{"role": "user", "content": "hi"}]
    ) as stream:
        final = stream.get_final_message()
    assert final.content == [] and final.stop_reason == "end_turn"


def test_tool_blocks_that_pair_up_go_upstream_as_tool_calls_and_results(
    gw: Gateway, scripted: Scripted
) -> None:
    """Two calls, each answered in the next turn (results first, then text), the
    conversation going on after: served, and the upstream gets the assistant's
    tool_calls and one `tool` message per result."""
    messages = [
        *ASK,
        {"role": "assistant", "content": [_use("toolu_a"), _use("toolu_b")]},
        {"role": "user", "content": [_result("toolu_b"), _result("toolu_a"), *_text("and?")]},
        {"role": "assistant", "content": "both done"},
        {"role": "user", "content": "thanks"},
    ]
    r = _post(gw, _body(messages=messages, tools=[TOOL]))
    assert r.status_code == 200, r.text
    sent = httpx.get(scripted.url + "/control/last").json()["body"]["messages"]
    calls = [c["id"] for m in sent if m["role"] == "assistant" for c in m.get("tool_calls") or []]
    assert calls == ["toolu_a", "toolu_b"]
    assert [m["tool_call_id"] for m in sent if m["role"] == "tool"] == ["toolu_b", "toolu_a"]
    count = {"model": "cheap", "messages": messages, "tools": [TOOL]}  # no max_tokens there
    r = _post(gw, count, COUNT)
    assert r.status_code == 200 and r.json()["input_tokens"] > 0, r.text


def _text(text: str) -> list[dict[str, Any]]:
    return [{"type": "text", "text": text}]


def test_a_result_answered_twice_or_for_an_older_turn_is_a_400(
    gw: Gateway, scripted: Scripted
) -> None:
    twice = [
        *ASK,
        {"role": "assistant", "content": [_use("toolu_1")]},
        {"role": "user", "content": [_result("toolu_1"), _result("toolu_1")]},
    ]
    _refused(gw, scripted, _body(messages=twice, tools=[TOOL]), "messages[2].content[1]")
    # toolu_1 was answered in messages[2]: messages[4] may not answer it again, though
    # the id exists in the conversation
    late = [
        *twice[:2],
        {"role": "user", "content": [_result("toolu_1")]},
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": [_result("toolu_1")]},
    ]
    _refused(gw, scripted, _body(messages=late, tools=[TOOL]), "messages[4].content[0]")
    # a call id of an earlier turn used again by a later call
    again = [
        *twice[:2],
        {"role": "user", "content": [_result("toolu_1")]},
        {"role": "assistant", "content": [_use("toolu_1")]},
        {"role": "user", "content": [_result("toolu_1")]},
    ]
    _refused(gw, scripted, _body(messages=again, tools=[TOOL]), "messages[3].content[0].id")


CACHE_OK = [
    {"type": "ephemeral"},
    {"type": "ephemeral", "ttl": "5m"},
    {"type": "ephemeral", "ttl": "1h"},
]


@pytest.mark.parametrize("cc", CACHE_OK)
def test_each_cache_control_shape_of_the_messages_api_is_accepted_everywhere(
    gw: Gateway, cc: dict[str, Any]
) -> None:
    """On a system block, a text block, a tool_result block, a tool_use block and a
    tool: served (the hint is not forwarded)."""
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "q", "cache_control": cc}]},
        {"role": "assistant", "content": [{**_use("toolu_c"), "cache_control": cc}]},
        {"role": "user", "content": [_result("toolu_c", cache_control=cc)]},
    ]
    system = [{"type": "text", "text": "be brief", "cache_control": cc}]
    body = _body(system=system, messages=messages, tools=[{**TOOL, "cache_control": cc}])
    r = _post(gw, body)
    assert r.status_code == 200, r.text


@pytest.mark.parametrize(
    ("cc", "where"),
    [
        ({"type": "ephemeral", "ttl": "2h"}, "system"),
        ({"type": "ephemeral", "ttl": 300}, "tool"),
        ({"type": "ephemeral", "extra": 1}, "result"),
        ([], "system"),
    ],
)
def test_a_malformed_cache_control_is_a_400_wherever_it_is(
    gw: Gateway, scripted: Scripted, cc: Any, where: str
) -> None:
    messages: list[dict[str, Any]] = list(ASK)
    system: Any = "be brief"
    tool: dict[str, Any] = dict(TOOL)
    if where == "system":
        system, param = [{"type": "text", "text": "be brief", "cache_control": cc}], "system[0]"
    elif where == "tool":
        tool["cache_control"], param = cc, "tools[0]"
    else:
        messages = [
            *ASK,
            {"role": "assistant", "content": [_use("toolu_r")]},
            {"role": "user", "content": [_result("toolu_r", cache_control=cc)]},
        ]
        param = "messages[2].content[0]"
    body = _body(system=system, messages=messages, tools=[tool])
    message = _refused(gw, scripted, body, param + ".cache_control")
    assert "ephemeral" in message


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"system": [{"type": "text", "text": ""}]}, "system[0].text"),
        (
            {
                "messages": [
                    *ASK,
                    {"role": "assistant", "content": [_use("toolu_e")]},
                    {"role": "user", "content": [_result("toolu_e", content=_text(""))]},
                ],
                "tools": [TOOL],
            },
            "messages[2].content[0].content[0].text",
        ),
    ],
)
def test_empty_text_is_refused_in_system_and_tool_result_blocks(
    gw: Gateway, scripted: Scripted, fields: dict[str, Any], param: str
) -> None:
    _refused(gw, scripted, _body(**fields), param)


def _openai(r: httpx.Response, status: int) -> dict[str, Any]:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert isinstance(error, dict) and "type" in error and "message" in error, r.text
    return dict(error)


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        (
            "/v1/chat/completions",
            {"model": "cheap", "messages": ASK, "tools": [CHAT_TOOL, CHAT_TOOL]},
            "tools[1].function.name",
        ),
        (
            "/v1/responses",
            {
                "model": "cheap",
                "input": "look it up",
                "tools": [{"type": "function", "name": "search"}] * 2,
            },
            "tools[1].name",
        ),
    ],
)
def test_two_tools_of_one_name_are_a_400_on_the_openai_protocols_too(
    gw: Gateway, scripted: Scripted, path: str, body: dict[str, Any], param: str
) -> None:
    before = scripted.requests()
    headers = {"authorization": f"Bearer {gw.key}"}
    r = httpx.post(gw.url + path, json=body, headers=headers, timeout=30)
    error = _openai(r, 400)
    assert error["param"] == param and error["type"] == "invalid_request_error", error
    assert scripted.requests() == before
    one = {**body, "tools": body["tools"][:1]}
    assert httpx.post(gw.url + path, json=one, headers=headers, timeout=30).status_code == 200


@pytest.mark.parametrize(
    ("path", "name"),
    [
        ("/v1/chat/completions", "authorization"),
        ("/v1/responses", "authorization"),
        (COUNT, "x-api-key"),
        (COUNT, "authorization"),
    ],
)
def test_a_repeated_credential_header_is_a_401_on_every_route_that_reads_it(
    gw: Gateway, scripted: Scripted, path: str, name: str
) -> None:
    """Both lines hold the valid key (the second line is not bogus): still two
    credentials, refused in the route's error shape before anything goes upstream."""
    good = f"Bearer {gw.key}" if name == "authorization" else gw.key
    if path == COUNT:
        body: dict[str, Any] = {"model": "cheap", "messages": ASK}
    elif path == "/v1/responses":
        body = {"model": "cheap", "input": "hi"}
    else:
        body = {"model": "cheap", "messages": ASK}
    before = scripted.requests()
    extra = [("anthropic-version", "2023-06-01")]
    r = httpx.post(gw.url + path, json=body, headers=[(name, good), (name, good), *extra])
    assert r.status_code == 401, r.text
    if path == COUNT:
        assert r.json()["error"]["type"] == "authentication_error", r.text
    else:
        assert _openai(r, 401)["code"] is not None
    assert "more than once" in r.text
    assert scripted.requests() == before
    once = httpx.post(gw.url + path, json=body, headers=[(name, good), *extra], timeout=30)
    assert once.status_code == 200, once.text
