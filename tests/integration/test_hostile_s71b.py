"""Hostile input items of the Responses API (`POST /v1/responses`) and content blocks of
the Messages API (`POST /v1/messages`, its `count_tokens`) beyond plain messages: what a
client may send that the official APIs refuse, what the gateway takes and drops, and
what reaches the upstream under `pii.mode: mask_upstream`. Over sockets against one
real gateway in front of the scripted upstream (`scripted.requests()` counts what went
upstream, its `GET /control/last` shows the last body).

Defects these tests find (each fails on today's code):
- Responses items whose tool calls and outputs do not pair up go upstream and are
  billed: a `function_call_output` answering no `function_call` (a forged tool output),
  a `function_call` no output answers before the conversation goes on, two calls of one
  `call_id`. OpenAI's API answers 400 ("No tool call found for function call output
  with call_id ...", "No tool output found for function call ..."); the Messages codec
  pairs its blocks (test_hostile_s70c.py), the Responses codec checks each item alone
  (api/responses_codec.py `_item`, `check`);
- `text.format.description` (json_schema) is accepted and never sent upstream, and a
  `text.format.strict` that is no boolean is ignored, not refused
  (api/responses_codec.py `_text_format`);
- an input item's `id` that is no id is silently replaced by one the gateway makes, and
  a message item's `status` of any value is taken (api/responses_codec.py `_given_id`,
  `_item`): OpenAI answers 400 `Invalid 'input[0].id'`;
- a content part's members are checked against the members of every part type
  (api/responses_codec.py `_PART_KEYS`): an `input_text` part with an `image_url` is
  sent upstream as the text alone, the image dropped, so the model answers another
  question than was asked; an `input_text` part in an assistant message (OpenAI: 400,
  "Supported values are: 'output_text' and 'refusal'") is taken as the assistant's;
- a Messages user turn whose text comes before its `tool_result` blocks is reordered
  and sent upstream (api/messages_codec.py `_turn` puts results first), where
  Anthropic's API answers 400 ("Did not find 1 tool_result block(s) at the beginning
  of this message");
- a text block's `citations` of any value is accepted and never read
  (api/messages_codec.py `_TEXT_KEYS`), where the Messages API takes a list of citations.

Gaps guarded (pass today; no other test covers them over sockets): under
`mask_upstream` a Responses request's `function_call` arguments, `function_call_output`
parts, instructions and developer parts, and a Messages request's system blocks,
`tool_use` input and `tool_result` blocks (`is_error`) reach the upstream masked; item,
part, tool, tool_choice and top-level shapes the gateway cannot serve (audio, files,
hosted and MCP tools, reasoning options, thinking and search-result blocks, server
tools, `container`) are a 400 in each protocol's own error body naming the member, with
nothing sent upstream.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from support.gateways import Gateway, cheap_config, start_gateway
from support.upstreams import Scripted

EMAIL = "dana.four@example.com"
COUNT = "/v1/messages/count_tokens"
TOOLS = [{"type": "function", "name": "lookup", "parameters": {"type": "object"}}]
MTOOLS = [{"name": "lookup", "input_schema": {"type": "object"}}]
ASK = {"role": "user", "content": "look it up"}
PNG = (  # a 1x1 PNG
    "data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR4nGNgYGD4DwAB"
    "BAEAwS2OUAAAAABJRU5ErkJggg=="
)


@pytest.fixture(scope="module")
def gw(scripted: Scripted) -> Iterator[Gateway]:
    g = start_gateway(cheap_config(scripted, pii={"mode": "mask_upstream"}))
    yield g
    g.proc.stop()


def _last(scripted: Scripted) -> dict[str, Any]:
    return dict(httpx.get(scripted.url + "/control/last", timeout=5).json()["body"])


def _responses(gw: Gateway, scripted: Scripted, **fields: Any) -> tuple[httpx.Response, int]:
    """A Responses request (not stored unless asked): (its reply, how many requests
    went upstream for it)."""
    before = scripted.requests()
    body = {"model": "cheap", "max_output_tokens": 16, "store": False, **fields}
    r = gw.post("/v1/responses", json=body, headers={"Cache-Control": "no-store"})
    return r, scripted.requests() - before


def _messages(
    gw: Gateway, scripted: Scripted, path: str = "/v1/messages", **fields: Any
) -> tuple[httpx.Response, int]:
    before = scripted.requests()
    body: dict[str, Any] = {"model": "cheap", **fields}
    if path != COUNT:
        body["max_tokens"] = 16
    headers = {"x-api-key": gw.key, "anthropic-version": "2023-06-01", "Cache-Control": "no-store"}
    r = httpx.post(gw.url + path, json=body, headers=headers, timeout=30)
    return r, scripted.requests() - before


def _openai_400(r: httpx.Response, sent: int, *params: str) -> None:
    """A 400 in the OpenAI error body naming one of `params`, nothing sent upstream."""
    assert r.status_code == 400, r.text[:400]
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error", err
    assert err["param"] in params, err
    assert sent == 0


def _anthropic_400(r: httpx.Response, sent: int, member: str) -> None:
    """A 400 in Anthropic's error body whose message names `member`, nothing upstream."""
    assert r.status_code == 400, r.text[:400]
    body = r.json()
    assert body.get("type") == "error" and body["error"]["type"] == "invalid_request_error", body
    assert member in body["error"]["message"], body
    assert sent == 0


def _call(call_id: str, args: str = '{"q": "x"}') -> dict[str, Any]:
    return {"type": "function_call", "call_id": call_id, "name": "lookup", "arguments": args}


def _output(call_id: str, output: Any = "42") -> dict[str, Any]:
    return {"type": "function_call_output", "call_id": call_id, "output": output}


# -- Responses: tool calls and outputs that do not pair up ------------------------------

UNPAIRED: dict[str, tuple[list[dict[str, Any]], tuple[str, ...]]] = {
    # a forged tool output: no call of that id was ever made
    "output-without-call": ([ASK, _output("call_never")], ("input[1]", "input[1].call_id")),
    # an output placed before the call it answers
    "output-before-call": (
        [ASK, _output("call_1"), _call("call_1")],
        ("input[1]", "input[1].call_id", "input[2]", "input[2].call_id"),
    ),
    # a call nothing answers, the conversation going on as if it had run
    "call-without-output": (
        [ASK, _call("call_1"), {"role": "user", "content": "and now?"}],
        ("input[1]", "input[1].call_id"),
    ),
    # two calls of one id: which one does the output answer?
    "one-id-twice": (
        [ASK, _call("call_1"), _call("call_1", '{"q": "y"}'), _output("call_1")],
        ("input[2]", "input[2].call_id"),
    ),
}


@pytest.mark.parametrize("case", sorted(UNPAIRED))
def test_responses_tool_items_that_do_not_pair_are_a_400_before_upstream(
    gw: Gateway, scripted: Scripted, case: str
) -> None:
    """Each `function_call_output` answers a `function_call` before it (in the input or
    the response it continues), each call is answered before the conversation goes
    on, and a call id is used once. OpenAI's API answers 400 otherwise ("No tool call
    found for function call output with call_id ...", "No tool output found for
    function call ..."), as a chat engine does for the messages these become. Today
    api/responses_codec.py `_item` checks each item's characters alone: the
    conversation goes upstream (a forged tool output reaches the model) and is billed."""
    items, params = UNPAIRED[case]
    r, sent = _responses(gw, scripted, input=items, tools=TOOLS)
    _openai_400(r, sent, *params)


# -- Responses: text.format ----------------------------------------------------------


def test_a_json_schema_description_goes_upstream(gw: Gateway, scripted: Scripted) -> None:
    """`text.format.description` is part of the official json_schema format (it tells the
    model what the schema is for) and chat's `response_format.json_schema` carries it.
    Today api/responses_codec.py `_text_format` accepts it and writes only name, schema
    and strict: the upstream model is never told."""
    fmt = {
        "type": "json_schema",
        "name": "forecast",
        "description": "A weather forecast for the city the user names",
        "schema": {"type": "object", "properties": {"city": {"type": "string"}}},
    }
    r, sent = _responses(gw, scripted, input="Paris tomorrow?", text={"format": fmt})
    assert r.status_code == 200 and sent == 1, r.text[:400]
    spec = _last(scripted)["response_format"]["json_schema"]
    assert spec.get("description") == fmt["description"], spec


def test_a_json_schema_strict_that_is_no_boolean_is_a_400(gw: Gateway, scripted: Scripted) -> None:
    """`strict` is a boolean (or null). Today `_text_format` reads it only when it is
    one: `"strict": "true"` is dropped and the request served without strict
    decoding, where the official API answers 400 naming `text.format.strict`."""
    fmt = {"type": "json_schema", "name": "w", "strict": "true", "schema": {"type": "object"}}
    r, sent = _responses(gw, scripted, input="hi", text={"format": fmt})
    _openai_400(r, sent, "text.format.strict")


# -- Responses: item ids and status ---------------------------------------------------

BAD_ITEMS = {
    "id-with-spaces": (
        {"type": "message", "id": "my message 1", "role": "user", "content": "hi"},
        "input[0].id",
    ),
    "empty-id": ({"type": "message", "id": "", "role": "user", "content": "hi"}, "input[0].id"),
    "id-not-a-string": (
        {"type": "message", "id": 7, "role": "user", "content": "hi"},
        "input[0].id",
    ),
    "unknown-status": (
        {"type": "message", "role": "user", "status": "approved", "content": "hi"},
        "input[0].status",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_ITEMS))
def test_an_item_id_or_status_the_api_refuses_is_a_400(
    gw: Gateway, scripted: Scripted, case: str
) -> None:
    """An item's `id` names it in `GET /v1/responses/{id}/input_items` (and pages it);
    OpenAI answers 400 `Invalid 'input[0].id'` for one that is not an id, and takes a
    message's `status` only as in_progress, completed or incomplete. Today
    api/responses_codec.py `_given_id` replaces any id it does not like with one of its
    own (the client lists its items and finds none of its ids), and `status` is never
    read."""
    item, param = BAD_ITEMS[case]
    r, sent = _responses(gw, scripted, input=[item], store=True)
    _openai_400(r, sent, param)


# -- Responses: a part's members ------------------------------------------------------


def test_an_input_text_part_carrying_an_image_is_a_400_not_the_text_alone(
    gw: Gateway, scripted: Scripted
) -> None:
    """Every part type is checked against the members of all of them
    (api/responses_codec.py `_PART_KEYS`): an `input_text` part with an `image_url` is
    taken, and `_part` reads its text only. The upstream is asked "what is in this
    picture?" without the picture. The official API answers 400 (an unknown member of
    input_text)."""
    part = {"type": "input_text", "text": "What is in this picture?", "image_url": PNG}
    r, sent = _responses(gw, scripted, input=[{"role": "user", "content": [part]}])
    _openai_400(r, sent, "input[0].content[0].image_url", "input[0].content[0]")


def test_an_input_text_part_in_an_assistant_message_is_a_400(
    gw: Gateway, scripted: Scripted
) -> None:
    """An assistant message's parts are `output_text` or `refusal`; OpenAI answers 400
    ("Invalid value: 'input_text'. Supported values are: 'output_text' and 'refusal'").
    Today `_part` takes `input_text` in any role, so a request the official API refuses
    is served here."""
    turn = {"role": "assistant", "content": [{"type": "input_text", "text": "Sure."}]}
    r, sent = _responses(gw, scripted, input=[ASK, turn, {"role": "user", "content": "go"}])
    _openai_400(r, sent, "input[1].content[0]", "input[1].content[0].type")


# -- Messages: where text may stand in a turn with tool results ------------------------


@pytest.mark.parametrize("path", ["/v1/messages", COUNT])
def test_text_before_a_tool_result_in_its_turn_is_a_400(
    gw: Gateway, scripted: Scripted, path: str
) -> None:
    """A user turn that answers tool calls begins with its `tool_result` blocks; text
    may follow them. Anthropic's API answers 400 ("Did not find 1 tool_result block(s)
    at the beginning of this message") otherwise. Today api/messages_codec.py `_turn`
    moves the results before the turn's text and sends the conversation on (the model
    reads the client's words in another order than written)."""
    turns = [
        ASK,
        {
            "role": "assistant",
            "content": [{"type": "tool_use", "id": "toolu_1", "name": "lookup", "input": {}}],
        },
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "Here is what the tool said:"},
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": "42"},
            ],
        },
    ]
    r, sent = _messages(gw, scripted, path, messages=turns, tools=MTOOLS)
    _anthropic_400(r, sent, "messages[2]")


@pytest.mark.parametrize("citations", ["see page 2", {"page": 2}, [7]])
def test_citations_of_another_shape_are_a_400(
    gw: Gateway, scripted: Scripted, citations: Any
) -> None:
    """A text block's `citations` is a list of citation objects (or null). Today
    api/messages_codec.py `_TEXT_KEYS` accepts the member whatever it holds and never
    reads it."""
    block = {"type": "text", "text": "As cited.", "citations": citations}
    r, sent = _messages(gw, scripted, messages=[{"role": "user", "content": [block]}])
    _anthropic_400(r, sent, "messages[0].content[0].citations")


# -- gap guards: PII in the members these protocols add --------------------------------


def test_responses_tool_items_reach_the_upstream_masked(gw: Gateway, scripted: Scripted) -> None:
    """Under `mask_upstream` the texts of a function call's arguments, a
    `function_call_output`'s parts, the instructions and a developer message's parts
    go upstream as placeholders, never raw."""
    items = [
        {"role": "developer", "content": [{"type": "input_text", "text": f"cc {EMAIL}"}]},
        ASK,
        _call("call_1", json.dumps({"to": EMAIL})),
        _output(
            "call_1",
            [{"type": "input_text", "text": "sent to "}, {"type": "input_text", "text": EMAIL}],
        ),
    ]
    r, sent = _responses(gw, scripted, input=items, tools=TOOLS, instructions=f"Reply to {EMAIL}")
    assert r.status_code == 200 and sent == 1, r.text[:400]
    body = _last(scripted)
    assert EMAIL not in json.dumps(body), body
    by_role = {m["role"]: m for m in body["messages"]}
    assert by_role["tool"]["content"] == "sent to <EMAIL_1>"
    assert by_role["system"]["content"] == "Reply to <EMAIL_1>"
    assert json.loads(by_role["assistant"]["tool_calls"][0]["function"]["arguments"]) == {
        "to": "<EMAIL_1>"
    }


def test_messages_tool_blocks_and_system_blocks_reach_the_upstream_masked(
    gw: Gateway, scripted: Scripted
) -> None:
    """System blocks, a `tool_use` block's input and a `tool_result`'s text blocks (an
    error result too) go upstream masked."""
    turns = [
        ASK,
        {
            "role": "assistant",
            "content": [
                {"type": "text", "text": "Looking."},
                {"type": "tool_use", "id": "toolu_1", "name": "lookup", "input": {"to": EMAIL}},
            ],
        },
        {
            "role": "user",
            "content": [
                {
                    "type": "tool_result",
                    "tool_use_id": "toolu_1",
                    "is_error": True,
                    "content": [{"type": "text", "text": f"no mailbox {EMAIL}"}],
                }
            ],
        },
    ]
    system = [
        {"type": "text", "text": f"Support for {EMAIL}", "cache_control": {"type": "ephemeral"}}
    ]
    r, sent = _messages(gw, scripted, messages=turns, tools=MTOOLS, system=system)
    assert r.status_code == 200 and sent == 1, r.text[:400]
    body = _last(scripted)
    assert EMAIL not in json.dumps(body), body
    tool = next(m for m in body["messages"] if m["role"] == "tool")
    assert tool["content"] == "[tool error] no mailbox <EMAIL_1>"
    assert body["messages"][0] == {"role": "system", "content": "Support for <EMAIL_1>"}


# -- gap guards: what cannot be served is a named 400 in the protocol's shape ---------

RESPONSES_REFUSED: dict[str, tuple[dict[str, Any], str]] = {
    "input_audio-part": (
        {
            "input": [
                {
                    "role": "user",
                    "content": [
                        {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}
                    ],
                }
            ]
        },
        "input[0].content[0].input_audio",
    ),
    "input_file-by-data": (
        {
            "input": [
                {
                    "role": "user",
                    "content": [{"type": "input_file", "file_data": PNG, "filename": "a.pdf"}],
                }
            ]
        },
        "input[0].content[0].file_data",
    ),
    "input_file-by-url": (
        {
            "input": [
                {
                    "role": "user",
                    "content": [{"type": "input_file", "file_url": "https://files.test/a.pdf"}],
                }
            ]
        },
        "input[0].content[0].file_url",
    ),
    "image-in-function-output": (
        {
            "input": [
                ASK,
                _call("call_1"),
                _output("call_1", [{"type": "input_image", "image_url": PNG}]),
            ],
            "tools": TOOLS,
        },
        "input[2].output",
    ),
    "instructions-as-items": ({"input": "hi", "instructions": [ASK]}, "instructions"),
    "mcp-tool": (
        {
            "input": "hi",
            "tools": [{"type": "mcp", "server_label": "x", "server_url": "https://mcp.test"}],
        },
        "tools[0].type",
    ),
    "custom-tool": ({"input": "hi", "tools": [{"type": "custom", "name": "sql"}]}, "tools[0].type"),
    "file_search-tool": (
        {"input": "hi", "tools": [{"type": "file_search", "vector_store_ids": ["vs_1"]}]},
        "tools[0].type",
    ),
    "allowed_tools-choice": (
        {
            "input": "hi",
            "tools": TOOLS,
            "tool_choice": {
                "type": "allowed_tools",
                "mode": "auto",
                "tools": [{"type": "function", "name": "lookup"}],
            },
        },
        "tool_choice",
    ),
    "mcp-choice": (
        {"input": "hi", "tools": TOOLS, "tool_choice": {"type": "mcp", "server_label": "x"}},
        "tool_choice",
    ),
    "custom-choice": (
        {"input": "hi", "tools": TOOLS, "tool_choice": {"type": "custom", "name": "sql"}},
        "tool_choice",
    ),
    "max_tool_calls": ({"input": "hi", "max_tool_calls": 2}, "max_tool_calls"),
    "safety_identifier": ({"input": "hi", "safety_identifier": "u-1"}, "safety_identifier"),
    "service_tier": ({"input": "hi", "service_tier": "flex"}, "service_tier"),
    "text-verbosity": ({"input": "hi", "text": {"verbosity": "low"}}, "text.verbosity"),
}


@pytest.mark.parametrize("case", sorted(RESPONSES_REFUSED))
def test_responses_shapes_the_gateway_cannot_serve_are_named_400s(
    gw: Gateway, scripted: Scripted, case: str
) -> None:
    fields, param = RESPONSES_REFUSED[case]
    r, sent = _responses(gw, scripted, **fields)
    _openai_400(r, sent, param)


MESSAGES_REFUSED: dict[str, tuple[dict[str, Any], str]] = {
    "document-text": (
        {
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "document",
                            "source": {"type": "text", "media_type": "text/plain", "data": EMAIL},
                        }
                    ],
                }
            ]
        },
        "messages[0].content[0]",
    ),
    "search_result": (
        {
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "search_result",
                            "source": "https://a.test",
                            "title": "t",
                            "content": [{"type": "text", "text": EMAIL}],
                        }
                    ],
                }
            ]
        },
        "messages[0].content[0]",
    ),
    "redacted_thinking": (
        {
            "messages": [
                ASK,
                {"role": "assistant", "content": [{"type": "redacted_thinking", "data": "x"}]},
                {"role": "user", "content": "go"},
            ]
        },
        "messages[1].content[0]",
    ),
    "image-in-tool_result": (
        {
            "tools": MTOOLS,
            "messages": [
                ASK,
                {
                    "role": "assistant",
                    "content": [
                        {"type": "tool_use", "id": "toolu_1", "name": "lookup", "input": {}}
                    ],
                },
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "tool_result",
                            "tool_use_id": "toolu_1",
                            "content": [
                                {
                                    "type": "image",
                                    "source": {
                                        "type": "base64",
                                        "media_type": "image/png",
                                        "data": "iVBORw0KGgo=",
                                    },
                                }
                            ],
                        }
                    ],
                },
            ],
        },
        "messages[2].content[0].content[0]",
    ),
    "web_search-server-tool": (
        {
            "messages": [ASK],
            "tools": [{"type": "web_search_20250305", "name": "web_search", "max_uses": 1}],
        },
        "tools[0].type",
    ),
    "text_editor-tool": (
        {
            "messages": [ASK],
            "tools": [{"type": "text_editor_20250124", "name": "str_replace_editor"}],
        },
        "tools[0].type",
    ),
    "container": ({"messages": [ASK], "container": "cntr_1"}, "container"),
    "service_tier": ({"messages": [ASK], "service_tier": "standard_only"}, "service_tier"),
}


@pytest.mark.parametrize("case", sorted(MESSAGES_REFUSED))
def test_messages_shapes_the_gateway_cannot_serve_are_named_400s(
    gw: Gateway, scripted: Scripted, case: str
) -> None:
    fields, member = MESSAGES_REFUSED[case]
    r, sent = _messages(gw, scripted, **fields)
    _anthropic_400(r, sent, member)
    assert EMAIL not in r.text  # a refusal never quotes the client's text back
