"""Hostile input this stop found on its own (beside test_hostile_s68a.py and
test_hostile_s68b.py), over sockets against a real gateway in its default tools
configuration in front of an upstream that answers in the legacy function-calling
shape (support/legacy_upstream.py).

Defects these tests found (each failed on the code before its fix, this stop):
- with no tool policy (only `tools.check_outputs`, on by default) a chat request's
  legacy `functions`/`function_call` went upstream, and the model's `function_call`
  came back past the reply gate, which governs `tool_calls` only: no idempotency key
  on a side-effecting call, no block. They are now refused wherever the gate is on, as
  they already were under a tool policy (decide/stages.py `Tools`);
- `tools` was unbounded in every protocol: a request could carry tens of thousands of
  tools, each costing policy, PII and cache work. At most 128 now, as the OpenAI API
  (policy/validate.py `tools_array`, which the Responses and Messages codecs share);
- a compressed reply whose declared length is small was read whole however much it
  inflated to (a gzip bomb: 96 MB from under a megabyte, relayed as a 200): its bytes
  are counted as they inflate, and past the reply bound it is a 502
  (engines/upstream.py `_read`).
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from support.gateways import Gateway, start_gateway
from support.hostile_upstream import Hostile, hostile_upstream, json_reply
from support.legacy_upstream import DENIED, LegacyUpstream

INFLATED = 96 << 20  # past the 64 MiB a whole reply may hold


@pytest.fixture(scope="module")
def legacy() -> Iterator[LegacyUpstream]:
    up = LegacyUpstream()
    yield up
    up.server.shutdown()


def _bomb() -> bytes:
    """A chat completion of `INFLATED` bytes, gzip-compressed to well under 1 MB."""
    head = b'{"object": "chat.completion", "choices": [{"index": 0, "message": {"content": "'
    tail = b'"}, "finish_reason": "stop"}]}'
    return gzip.compress(head + b"a" * (INFLATED - len(head) - len(tail)) + tail, 6)


@pytest.fixture(scope="module")
def hostile() -> Iterator[Hostile]:
    bomb = json_reply(_bomb(), headers={"Content-Encoding": "gzip"})
    with hostile_upstream({"bomb": bomb}) as up:
        yield up


@pytest.fixture(scope="module")
def gw(legacy: LegacyUpstream, hostile: Hostile) -> Iterator[Gateway]:
    g = start_gateway(
        {
            "models": [
                {
                    "alias": "legacy",
                    "engine": {"kind": "openai", "base_url": legacy.url},
                    "resilience": {"retries": 0},
                },
                {
                    "alias": "bomb",
                    "engine": {"kind": "openai", "base_url": hostile.base_url("bomb")},
                    "resilience": {"retries": 0},
                },
            ],
            "cache": {"enabled": False},
            "embeddings": {"enabled": False},
        }
    )
    yield g
    g.proc.stop()


def _function(name: str) -> dict[str, Any]:
    return {"name": name, "parameters": {"type": "object"}}


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("field", ["functions", "function_call"])
def test_legacy_function_calling_is_refused_where_replies_are_governed(
    gw: Gateway, legacy: LegacyUpstream, field: str, stream: bool
) -> None:
    marker = f"legacy-{field}-{stream}"
    body: dict[str, Any] = {
        "model": "legacy",
        "max_tokens": 8,
        "stream": stream,
        "messages": [{"role": "user", "content": marker}],
        field: [_function(DENIED)] if field == "functions" else "auto",
    }
    r = gw.post("/v1/chat/completions", json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == field and "send 'tools'" in error["message"], error
    assert legacy.last(marker) is None  # nothing went upstream
    # The same request with `tools` is served, its call keyed by the gate.
    del body[field]
    r = gw.post("/v1/chat/completions", json={**body, "stream": False, "tools": []})
    assert r.status_code == 200, r.text


def _tools(n: int, shape: str) -> list[dict[str, Any]]:
    if shape == "chat":
        return [{"type": "function", "function": _function(f"t{k}")} for k in range(n)]
    if shape == "responses":
        return [{"type": "function", **_function(f"t{k}")} for k in range(n)]
    return [{"name": f"t{k}", "input_schema": {"type": "object"}} for k in range(n)]


REQUESTS = {
    "chat": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "many"}]}),
    "responses": ("/v1/responses", {"input": "many", "store": False}),
    "messages": ("/v1/messages", {"messages": [{"role": "user", "content": "many"}]}),
}


@pytest.mark.parametrize("shape", sorted(REQUESTS))
def test_at_most_128_tools_in_every_protocol(
    gw: Gateway, legacy: LegacyUpstream, shape: str
) -> None:
    path, fields = REQUESTS[shape]
    marker = f"{shape}-tools"
    cap = "max_output_tokens" if shape == "responses" else "max_tokens"
    base = {"model": "legacy", cap: 8 if shape != "responses" else 16, **fields}
    base = json.loads(json.dumps(base).replace('"many"', json.dumps(marker)))
    headers = gw.auth
    r = httpx.post(gw.url + path, json={**base, "tools": _tools(129, shape)}, headers=headers)
    assert r.status_code == 400, r.text
    body = r.json()
    if shape == "messages":
        assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
        assert "at most 128 tools" in body["error"]["message"], body
    else:
        assert body["error"]["param"] == "tools" and "at most 128" in body["error"]["message"]
    assert legacy.last(marker) is None
    r = httpx.post(gw.url + path, json={**base, "tools": _tools(128, shape)}, headers=headers)
    assert r.status_code == 200, r.text
    sent = legacy.last(marker)
    assert sent is not None and len(sent["tools"]) == 128


def test_a_compressed_reply_is_bounded_by_what_it_inflates_to(gw: Gateway) -> None:
    body = {"model": "bomb", "max_tokens": 8, "messages": [{"role": "user", "content": "x"}]}
    r = gw.post("/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 502, (r.status_code, len(r.content))
    assert r.json()["error"]["code"] == "upstream_error"
