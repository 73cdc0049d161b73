"""Hostile clients of the Anthropic Messages surface (`/v1/messages` and its
`count_tokens`): request shapes the Messages API refuses that the gateway takes, sends
upstream and bills, and credentials sent twice. Over sockets against one real gateway
in front of the scripted upstream (`scripted.requests()` counts what went upstream).

Defects these tests find (each fails on today's code; api/messages_codec.py checks
each block and tool alone, never the request as a whole):
- a `tool_result` answering no `tool_use` of the turn before, a `tool_use` no
  `tool_result` answers, two `tool_use` blocks of one id: sent upstream as chat tool
  messages, where Anthropic's API (and an OpenAI-compatible engine) answers 400;
- `tool_use`/`tool_result` blocks in a request without `tools`;
- an `input_schema` that is no object schema; two tools of one name;
- an empty text block; a `cache_control` of any value; a whitespace stop sequence;
- a second `x-api-key` or `Authorization` line is silently dropped (api/body.py
  `header_map`), so a valid and a bogus credential together are served as the valid.
`count_tokens` takes the same shapes (one codec): the tests run both routes.
"""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from support.gateways import Gateway
from support.upstreams import Scripted

ASK = [{"role": "user", "content": "look it up"}]
TOOL = {"name": "search", "description": "search", "input_schema": {"type": "object"}}
COUNT = "/v1/messages/count_tokens"


def _post(gw: Gateway, body: Any, path: str = "/v1/messages", **headers: str) -> httpx.Response:
    h = {"x-api-key": gw.key, "anthropic-version": "2023-06-01", **headers}
    return httpx.post(gw.url + path, json=body, headers=h, timeout=30)


def _anthropic_error(r: httpx.Response) -> dict[str, Any]:
    body = r.json()
    assert body.get("type") == "error" and isinstance(body.get("error"), dict), r.text
    return dict(body["error"])


def _body(path: str, **fields: Any) -> dict[str, Any]:
    """A Messages body for `path` (count_tokens takes no `max_tokens`)."""
    base: dict[str, Any] = {"model": "cheap", "messages": ASK}
    if path != COUNT:
        base["max_tokens"] = 16
    return {**base, **fields}


def _refused(gw: Gateway, scripted: Scripted, path: str, body: dict[str, Any]) -> None:
    """`body` is a 400 in Anthropic's shape, and nothing went upstream."""
    before = scripted.requests()
    r = _post(gw, body, path)
    assert r.status_code == 400, r.text
    assert _anthropic_error(r)["type"] == "invalid_request_error"
    assert scripted.requests() == before


def _use(call_id: str) -> dict[str, Any]:
    return {"type": "tool_use", "id": call_id, "name": "search", "input": {"q": call_id}}


def _result(call_id: str) -> dict[str, Any]:
    return {"type": "tool_result", "tool_use_id": call_id, "content": "42"}


# Conversations whose tool calls and results do not pair up.
UNPAIRED = {
    # a result for a call the model never made: a client forges a tool's output
    "result-without-call": [{"role": "user", "content": [_result("toolu_never")]}],
    # a call no result answers, the conversation going on as if it had run
    "call-without-result": [
        *ASK,
        {"role": "assistant", "content": [_use("toolu_1")]},
        {"role": "user", "content": "and now?"},
    ],
    # two calls of one id: which one does the result answer?
    "one-id-twice": [
        *ASK,
        {"role": "assistant", "content": [_use("toolu_1"), _use("toolu_1")]},
        {"role": "user", "content": [_result("toolu_1")]},
    ],
}


@pytest.mark.parametrize("path", ["/v1/messages", COUNT])
@pytest.mark.parametrize("case", sorted(UNPAIRED))
def test_tool_calls_and_results_that_do_not_pair_are_a_400_before_upstream(
    gw: Gateway, scripted: Scripted, case: str, path: str
) -> None:
    """Each `tool_result` must answer a `tool_use` of the assistant turn just before,
    each `tool_use` must be answered by the next user turn, and ids are unique.
    Anthropic's API answers 400 otherwise (`unexpected tool_use_id found in
    tool_result blocks`, `tool_use ids were found without tool_result blocks
    immediately after`), as an OpenAI-compatible engine does for the chat messages
    these become. The gateway checks only each id's characters
    (api/messages_codec.py `_turn`, `_tool_use`, `_tool_result`) and sends the
    conversation upstream, billed: a forged tool output reaches the model."""
    _refused(gw, scripted, path, _body(path, messages=UNPAIRED[case], tools=[TOOL]))


@pytest.mark.parametrize("path", ["/v1/messages", COUNT])
@pytest.mark.parametrize("schema", [{"type": "string"}, {"type": "array", "items": {}}])
def test_an_input_schema_that_is_no_object_schema_is_a_400(
    gw: Gateway, scripted: Scripted, schema: dict[str, Any], path: str
) -> None:
    """A tool's `input_schema` must be an object schema (`"type": "object"`): a
    `tool_use` block's `input` is always an object. Anthropic's API answers 400 for
    any other; the gateway checks only that it is a dict (api/messages_codec.py
    `_tools`) and sends it upstream as the function's `parameters`, which no answer of
    the engine can then match."""
    tool = {"name": "search", "input_schema": schema}
    _refused(gw, scripted, path, _body(path, tools=[tool]))


@pytest.mark.parametrize("path", ["/v1/messages", COUNT])
def test_two_tools_of_one_name_are_a_400(gw: Gateway, scripted: Scripted, path: str) -> None:
    """Two tools of one name are ambiguous: a `tool_use` naming it cannot say which
    schema it follows, and tool governance keys calls by name. Anthropic's API answers
    400 (tool names must be unique); the gateway sends both upstream
    (api/messages_codec.py `_tools` checks each tool alone)."""
    tools = [TOOL, {**TOOL, "input_schema": {"type": "object", "properties": {"x": {}}}}]
    _refused(gw, scripted, path, _body(path, tools=tools))


@pytest.mark.parametrize("path", ["/v1/messages", COUNT])
def test_tool_blocks_without_tools_are_a_400(gw: Gateway, scripted: Scripted, path: str) -> None:
    """A conversation with `tool_use` and `tool_result` blocks and no `tools` goes
    upstream as tool calls and results for tools the request never declared (so no
    schema or registry check saw them). Anthropic's API answers 400 (`Requests which
    include tool_use or tool_result blocks must define tools`); the gateway checks
    nothing of the kind (api/messages_codec.py `to_chat`)."""
    tool_use = {"type": "tool_use", "id": "toolu_1", "name": "search", "input": {}}
    result = {"type": "tool_result", "tool_use_id": "toolu_1", "content": "x"}
    messages = [
        *ASK,
        {"role": "assistant", "content": [tool_use]},
        {"role": "user", "content": [result]},
    ]
    _refused(gw, scripted, path, _body(path, messages=messages))


@pytest.mark.parametrize("path", ["/v1/messages", COUNT])
def test_an_empty_text_block_is_a_400(gw: Gateway, scripted: Scripted, path: str) -> None:
    """A text block with no text: Anthropic's API answers 400 (`text content blocks
    must be non-empty`); the gateway sends an empty user message upstream and bills it
    (api/messages_codec.py `_text_block` takes any string)."""
    empty = [{"role": "user", "content": [{"type": "text", "text": ""}]}]
    _refused(gw, scripted, path, _body(path, messages=empty))


@pytest.mark.parametrize("cc", [5, "ephemeral", {"type": "forever"}])
def test_a_malformed_cache_control_is_a_400(gw: Gateway, scripted: Scripted, cc: Any) -> None:
    """`cache_control` is accepted and not forwarded, but its value is never checked
    (api/messages_codec.py `_no_extras_cc` lets the key through with any value): a
    number, a string, an unknown type are all served 200, where Anthropic's API
    answers 400 (`cache_control` is `{"type": "ephemeral"}`, with an optional `ttl`).
    A client that tests its request against the gateway learns a shape the real API
    refuses."""
    content = [{"type": "text", "text": "hi", "cache_control": cc}]
    path = "/v1/messages"
    _refused(gw, scripted, path, _body(path, messages=[{"role": "user", "content": content}]))


@pytest.mark.parametrize("name", ["x-api-key", "authorization"])
def test_a_second_credential_line_is_never_ignored(gw: Gateway, name: str) -> None:
    """Two `x-api-key` (or `Authorization`) lines are two credentials: the gateway
    hears the first and drops the second (api/body.py `header_map`: the first of
    repeated names wins; policy/auth.py reads that one), so a request carrying a
    valid key and a bogus one is served 200 as the valid key's. A bogus
    `Authorization` beside a valid `x-api-key` is refused 401 (two credentials are
    never merged, test_hostile_s68a.py): two lines of one header must be too."""
    bearer = name == "authorization"
    good = f"Bearer {gw.key}" if bearer else gw.key
    bogus = "Bearer sy-not-a-key" if bearer else "sy-not-a-key"
    headers = [(name, good), (name, bogus), ("anthropic-version", "2023-06-01")]
    body = {"model": "cheap", "max_tokens": 4, "messages": ASK}
    r = httpx.post(gw.url + "/v1/messages", json=body, headers=headers, timeout=30)
    assert r.status_code in (400, 401), r.text
    assert _anthropic_error(r)["type"] in ("invalid_request_error", "authentication_error")


@pytest.mark.parametrize("stop", [" ", "\n\t"])
def test_a_whitespace_stop_sequence_is_a_400(gw: Gateway, scripted: Scripted, stop: str) -> None:
    """A stop sequence of whitespace alone ends the answer at its first space or line:
    Anthropic's API answers 400 (each stop sequence must contain non-whitespace); the
    gateway checks only that it is non-empty (api/messages_codec.py `_stop`) and sends
    it upstream, billed, to cut the answer short."""
    path = "/v1/messages"
    _refused(gw, scripted, path, _body(path, stop_sequences=[stop]))
