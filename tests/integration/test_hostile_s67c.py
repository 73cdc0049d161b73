"""Hostile input against the surfaces test_hostile_s67.py and test_hostile_s67b.py leave
out: the legacy function-calling fields of chat completions (`functions`,
`function_call`) under a tool policy, what goes upstream when that policy removes every
tool a request offers, the response cache's key for completions, the fields PII
policies read, and PII at rest from the routes and fields test_pii_dataflow.py does not
send it through. Over sockets against a real gateway in front of the scripted
upstream (echoing, for PII) and a small upstream of this module's own that records the
bodies it receives and answers in the legacy shape (`message.function_call`, streamed as
`delta.function_call`), which the scripted upstream cannot.

Defects these tests found (each failed on the code before its fix, this stop):
- `functions` and `function_call` naming a tool that `tools.deny` forbids were sent
  upstream as the client wrote them, while the same tool in `tools` is removed: the
  legacy field offered the model any tool the policy forbids (decide/stages.py `Tools`
  reads `tools` only). Where tools are governed they are now refused (400);
- when the policy removes every tool of a request, `"tools": []` goes upstream, with a
  `tool_choice` still naming the removed tool: the OpenAI API refuses both (an empty
  `tools` array, and a `tool_choice` without tools), so a request the policy let through
  fails upstream instead of running without tools;
- the response cache keys a completion's prompt by its text (`str()`) and leaves `echo`
  and `suffix` out: token ids `[9001, 9002]`, or the two prompts `["a", "b"]`, are served
  the reply cached for the text "[9001, 9002]" or "['a', 'b']", and a request for an
  echo or a suffix the reply cached without them (decide/cache.py `cache_keys`);
- `mask_upstream` sends raw PII upstream, and `block` lets it through, from every field
  but message text, names, tool-call arguments, `prompt` and `user`: a completion's
  `suffix`, a `prediction`, an assistant's `refusal` part, a legacy `function_call`'s
  arguments, a `file` part's name, a tool's description, `metadata` and
  `prompt_cache_key` (policy/pii.py `mask_request`, through which policy/stages_pii.py
  also detects).

Gaps guarded (pass today; no other test covers them): no raw e-mail address, card number
or API key reaches the gateway's SQLite files (db, -wal) or its log when they arrive
through a stream, the Responses API (stored, chained, streamed, in the background, with
an Idempotency-Key), Messages, or the fields around the messages (`metadata`, tool
descriptions, a `response_format` schema, `stop`, `prediction`, `x-session-id`), with the cache on, in `observe_only`; and the cache keys a
completion's `logprobs` and `logit_bias` (no other test sends a prompt twice with and
without them).
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from support.gateways import Gateway, start_gateway
from support.legacy_upstream import DENIED, LegacyUpstream
from support.procs import Proc, free_port, wait_http

ALLOWED = "web__lookup"
PRIVATE = {
    "e-mail": "mallory.pii@example.net",
    "card": "4111 1111 1111 1111",
    "card digits": "4111111111111111",
    "key": "sk-proj-Zq8vL2mN4xR7tY1uW3eK9pA6sD0fG5hJ",
}
TEXT = f"write to {PRIVATE['e-mail']}, card {PRIVATE['card']}, key {PRIVATE['key']}"


def _function(name: str) -> dict[str, Any]:
    return {"name": name, "description": name, "parameters": {"type": "object"}}


@pytest.fixture(scope="module")
def legacy() -> Iterator[LegacyUpstream]:
    up = LegacyUpstream()
    yield up
    up.server.shutdown()


@pytest.fixture(scope="module")
def gw(legacy: LegacyUpstream) -> Iterator[Gateway]:
    port = free_port()
    echo = Proc(
        [sys.executable, "-m", "switchyard.bench.scripted_upstream", "--port", str(port), "--echo"],
        "scripted-echo",
    )
    wait_http(f"http://127.0.0.1:{port}/health", echo)
    config = {
        "models": [
            {
                "alias": "echo",
                "engine": {"kind": "openai", "base_url": f"http://127.0.0.1:{port}/v1"},
            },
            *(
                {
                    "alias": alias,
                    "engine": {"kind": "openai", "base_url": legacy.url},
                    "resilience": {"retries": 0},
                }
                for alias in ("legacy", "masked", "strict")
            ),
        ],
        "tools": {"deny": [DENIED]},
        "pii": {"mode": "observe_only", "models": {"masked": "mask_upstream", "strict": "block"}},
        "cache": {"enabled": True, "semantic": False},
        "embeddings": {"enabled": False},
    }
    g = start_gateway(config)
    yield g
    g.proc.stop()
    echo.stop()


def _chat(marker: str, **fields: Any) -> dict[str, Any]:
    return {
        "model": "legacy",
        "max_tokens": 8,
        "messages": [{"role": "user", "content": marker}],
        **fields,
    }


NO_STORE = {"cache-control": "no-store"}


def test_legacy_functions_naming_a_denied_tool_never_reach_the_upstream(
    gw: Gateway, legacy: LegacyUpstream
) -> None:
    """The tool `tools.deny` removes from `tools` must not be offered through the legacy
    `functions` (and forced by `function_call`) either: refused, or not sent."""
    body = _chat(
        "offer-legacy",
        functions=[_function(DENIED), _function(ALLOWED)],
        function_call={"name": DENIED},
    )
    r = gw.post("/v1/chat/completions", json=body, headers=NO_STORE)
    sent = legacy.last("offer-legacy")
    if sent is None:
        assert r.status_code in (400, 403), r.text
        assert r.json()["error"]["type"] in ("invalid_request_error", "permission_error")
    else:
        assert DENIED not in json.dumps(sent), sent


def test_a_request_whose_every_tool_is_denied_sends_no_empty_tools_upstream(
    gw: Gateway, legacy: LegacyUpstream
) -> None:
    """Removing the last tool must leave a request the upstream accepts: no `"tools":
    []` (the OpenAI API refuses an empty array) and no `tool_choice` naming a tool that
    is not offered; or the gateway refuses the request itself."""
    body = _chat(
        "all-denied",
        tools=[{"type": "function", "function": _function(DENIED)}],
        tool_choice={"type": "function", "function": {"name": DENIED}},
    )
    r = gw.post("/v1/chat/completions", json=body, headers=NO_STORE)
    sent = legacy.last("all-denied")
    if sent is None:
        assert r.status_code in (400, 403), r.text
        return
    assert sent.get("tools") != [], sent
    offered = {t["function"]["name"] for t in sent.get("tools") or []}
    choice = sent.get("tool_choice")
    if isinstance(choice, dict):
        assert choice["function"]["name"] in offered, sent


def _wait_background(gw: Gateway, rid: str) -> None:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        r = httpx.get(f"{gw.url}/v1/responses/{rid}", headers=gw.auth)
        if r.json().get("status") not in ("queued", "in_progress"):
            return
        time.sleep(0.1)
    raise AssertionError(f"background response {rid} never finished")


def test_no_raw_pii_at_rest_from_streams_responses_messages_and_side_fields(
    gw: Gateway,
) -> None:
    """Gap guard: test_pii_dataflow.py sends PII through JSON chat and completions only.
    Here it also comes through a stream, every way of the Responses API that stores,
    Messages, an Idempotency-Key and the fields around the messages; then no file the
    gateway wrote holds a raw value."""
    chat = {"model": "echo", "max_tokens": 8}
    said = [{"role": "user", "content": TEXT}]
    posts: list[tuple[str, dict[str, Any], dict[str, str]]] = [
        ("/v1/chat/completions", {**chat, "messages": said}, {"Idempotency-Key": "pii-chat"}),
        (
            "/v1/chat/completions",
            {
                **chat,
                "messages": [{"role": "user", "content": "fields"}],
                "metadata": {"who": PRIVATE["e-mail"], "key": PRIVATE["key"]},
                "tools": [
                    {
                        "type": "function",
                        "function": {"name": ALLOWED, "description": TEXT, "parameters": {}},
                    }
                ],
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "a", "schema": {"type": "object", "description": TEXT}},
                },
                "stop": [PRIVATE["e-mail"], PRIVATE["key"]],
                "prediction": {"type": "content", "content": TEXT},
            },
            {"x-session-id": PRIVATE["e-mail"]},
        ),
        (
            "/v1/responses",
            {
                "model": "echo",
                "max_output_tokens": 16,
                "input": TEXT,
                "instructions": TEXT,
                "metadata": {"who": PRIVATE["e-mail"]},
                "store": True,
            },
            {"Idempotency-Key": "pii-responses"},
        ),
        (
            "/v1/messages",
            {"model": "echo", "max_tokens": 16, "system": TEXT, "messages": said},
            {"anthropic-version": "2023-06-01"},
        ),
    ]
    for path, body, headers in posts:
        r = gw.post(path, json=body, headers=headers)
        assert r.status_code == 200, (path, r.text)
    first = gw.post("/v1/responses", json={"model": "echo", "input": TEXT, "store": True})
    chained = {
        "model": "echo",
        "input": [{"role": "user", "content": [{"type": "input_text", "text": TEXT}]}],
        "previous_response_id": first.json()["id"],
        "store": True,
    }
    assert gw.post("/v1/responses", json=chained).status_code == 200
    background = {"model": "echo", "input": TEXT, "store": True, "background": True}
    _wait_background(gw, gw.post("/v1/responses", json=background).json()["id"])
    for path, body in (
        ("/v1/chat/completions", {**chat, "messages": said, "stream": True}),
        ("/v1/responses", {"model": "echo", "input": TEXT, "store": True, "stream": True}),
    ):
        with gw.stream(body, path=path) as st:
            assert st.status_code == 200
            st.read()
    # The ledger writer commits a moment after each reply: the last trace stored
    # means every earlier row is written too.
    last = gw.post("/v1/chat/completions", json={**chat, "messages": said})
    gw.trace(last.headers["x-request-id"])
    files = [p for p in Path(gw.db).parent.iterdir() if p.is_file()] + [Path(gw.proc.log.name)]
    leaks = [
        (kind, f.name)
        for f in files
        for kind, raw in PRIVATE.items()
        if raw.encode() in f.read_bytes()
    ]
    assert not leaks, leaks


# A completion request, then one that differs in a field that changes the answer (or,
# for the last two, in the prompt's type only: a string that reads like token ids or a
# list of prompts is one prompt of that text).
CACHE_SHAPES: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "echo": ({"prompt": "cache-echo"}, {"prompt": "cache-echo", "echo": True}),
    "suffix": ({"prompt": "cache-suffix"}, {"prompt": "cache-suffix", "suffix": " the end."}),
    "token-ids": ({"prompt": "[9001, 9002]"}, {"prompt": [9001, 9002]}),
    "prompt-list": ({"prompt": "['cache-a', 'cache-b']"}, {"prompt": ["cache-a", "cache-b"]}),
    "logprobs": ({"prompt": "cache-lp"}, {"prompt": "cache-lp", "logprobs": 2}),
    "logit_bias": ({"prompt": "cache-lb"}, {"prompt": "cache-lb", "logit_bias": {"9906": -100}}),
}


@pytest.mark.parametrize("shape", list(CACHE_SHAPES))
def test_a_request_that_asks_for_another_answer_is_not_served_a_cached_reply(
    gw: Gateway, shape: str
) -> None:
    """A cached reply answers only a request that asks for the same thing. Defects: a
    completion that wants its prompt echoed or a suffix joined is served the reply
    cached without them; token ids `[9001, 9002]` hit the reply cached for the text
    "[9001, 9002]", and the prompts ["a", "b"] (two choices due) hit the one choice
    cached for the text "['a', 'b']" (decide/cache.py keys the prompt by `str()` and
    leaves `echo` and `suffix` out). `logprobs` and `logit_bias` pass today: they guard
    the keying of the fields no other test sends twice."""
    plain, shaped = CACHE_SHAPES[shape]
    path, base = "/v1/completions", {"model": "echo", "max_tokens": 8}
    first = gw.post(path, json={**base, **plain})
    assert first.status_code == 200, first.text
    assert gw.post(path, json={**base, **plain}).headers["x-switchyard-cache"] == "hit-exact"
    other = gw.post(path, json={**base, **shaped})
    assert other.status_code == 200, other.text
    assert not other.headers["x-switchyard-cache"].startswith("hit"), other.json()


EMAIL = PRIVATE["e-mail"]
# Fields that carry user text to the upstream besides those mask_request reads (message
# text, names, tool-call arguments, `prompt`, `user`); each with the marker in a message
# or the prompt, so the body the upstream received can be found.
UNMASKED: dict[str, tuple[str, dict[str, Any]]] = {
    "suffix": ("/v1/completions", {"prompt": "mask-suffix", "suffix": f"sign as {EMAIL}"}),
    "prediction": ("chat", {"prediction": {"type": "content", "content": f"to {EMAIL}"}}),
    "refusal-part": (
        "chat",
        {"messages": [{"role": "assistant", "content": [{"type": "refusal", "refusal": EMAIL}]}]},
    ),
    "legacy-function-call": (
        "chat",
        {
            "messages": [
                {
                    "role": "assistant",
                    "content": None,
                    "function_call": {"name": "f", "arguments": json.dumps({"to": EMAIL})},
                },
                {"role": "function", "name": "f", "content": "sent"},
            ]
        },
    ),
    "file-part": (
        "chat",
        {
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "see the file"},
                        {"type": "file", "file": {"filename": f"{EMAIL}.pdf", "file_id": "f1"}},
                    ],
                }
            ]
        },
    ),
    "tool-description": (
        "chat",
        {"tools": [{"type": "function", "function": {"name": "a", "description": EMAIL}}]},
    ),
    "metadata": ("chat", {"metadata": {"customer": EMAIL}}),
    "prompt_cache_key": ("chat", {"prompt_cache_key": EMAIL}),
}


def _unmasked_body(model: str, shape: str) -> tuple[str, dict[str, Any], str]:
    """(path, body, marker) of one UNMASKED shape, for `model`."""
    where, fields = UNMASKED[shape]
    marker = f"mask-{shape}-{model}"
    if where != "chat":
        fields = {**fields, "prompt": marker}
        return where, {"model": model, "max_tokens": 8, **fields}, marker
    said = [*fields.get("messages", []), {"role": "user", "content": marker}]
    body = {"model": model, "max_tokens": 8, **fields, "messages": said}
    return "/v1/chat/completions", body, marker


@pytest.mark.parametrize("shape", list(UNMASKED))
def test_mask_upstream_sends_no_raw_pii_in_any_field(
    gw: Gateway, legacy: LegacyUpstream, shape: str
) -> None:
    """`mask_upstream`: the upstream receives no raw PII, whichever field carries it.
    Defect: policy/pii.py `mask_request` masks message text, names, tool-call arguments,
    `prompt` and `user` only: a completion's `suffix`, a `prediction`, an assistant's
    `refusal` part, a legacy `function_call`'s arguments, a `file` part's name, a tool's
    description, `metadata` and `prompt_cache_key` (an end-user id like `user`) reach
    the upstream raw."""
    path, body, marker = _unmasked_body("masked", shape)
    r = gw.post(path, json=body, headers=NO_STORE)
    sent = legacy.last(marker)
    if sent is None:
        assert r.status_code == 400, r.text
    else:
        assert EMAIL not in json.dumps(sent), sent


@pytest.mark.parametrize("shape", ["suffix", "prediction", "metadata"])
def test_block_refuses_pii_in_any_field(gw: Gateway, legacy: LegacyUpstream, shape: str) -> None:
    """`block`: a request with PII is refused before the upstream, wherever the PII is.
    Defect: the detection reads the fields `mask_request` masks, so PII in a `suffix`,
    a `prediction` or `metadata` is sent upstream by a model whose policy is to block
    it."""
    path, body, marker = _unmasked_body("strict", shape)
    r = gw.post(path, json=body, headers=NO_STORE)
    assert legacy.last(marker) is None, r.text
    assert r.status_code == 400, r.text
