"""The Anthropic Messages API (`/v1/messages`), driven by the official `anthropic` SDK
over sockets: a real gateway in front of the local engine and of a scripted upstream
(which proposes tool calls on demand). Messages requests run through the same policy
as chat: keys, authorization, tool governance, traces and usage rows."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import pytest

from support.gateways import Gateway, start_gateway
from support.upstreams import Scripted, start_scripted

REGISTRY = [
    {"name": "search", "class": "read_only"},
    {"name": "wire_money", "class": "side_effect", "allowed_tenants": ["bank"]},
    {"name": "send_email", "class": "side_effect", "requires_approval": True},
]
TOOLS = [
    {"name": n, "description": n, "input_schema": {"type": "object"}}
    for n in ("search", "wire_money", "send_email")
]


@pytest.fixture(scope="module")
def upstream() -> Iterator[Scripted]:
    proc, s = start_scripted()
    yield s
    proc.stop()


@pytest.fixture(scope="module")
def gw(upstream: Scripted) -> Iterator[Gateway]:
    g = start_gateway(
        {
            "tools": {"registry": REGISTRY, "on_forbidden_call": "block"},
            "models": [
                {
                    "alias": "m",
                    "engine": {"kind": "openai", "base_url": upstream.url + "/v1"},
                    "price": {"input": 0.0, "output": 1000.0},
                },
                {"alias": "other", "engine": {"kind": "openai", "base_url": upstream.url + "/v1"}},
            ],
            "embeddings": {"enabled": False},
        }
    )
    yield g
    g.proc.stop()


def client(gw: Gateway, key: str | None = None, **kw: Any) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=gw.url, api_key=key or gw.key, max_retries=0, **kw)


def _calls(upstream: Scripted, *calls: tuple[str, dict[str, Any]]) -> None:
    body = {"calls": [{"name": n, "arguments": a} for n, a in calls]}
    assert httpx.put(upstream.url + "/control/tool_calls", json=body).status_code == 200


ASK = [{"role": "user", "content": "pay the invoice"}]


def test_the_local_engine_answers_a_message_and_a_stream(default_gateway: Gateway) -> None:
    c = client(default_gateway)
    msg = c.messages.create(
        model="smollm2-135m",
        max_tokens=12,
        system="You are terse.",
        messages=[{"role": "user", "content": "Name a colour."}],
    )
    assert msg.type == "message" and msg.role == "assistant" and msg.model == "smollm2-135m"
    assert msg.content[0].type == "text" and msg.content[0].text.strip()
    assert msg.stop_reason in ("end_turn", "max_tokens")
    assert 0 < msg.usage.output_tokens <= 12 and msg.usage.input_tokens > 0
    with c.messages.stream(
        model="smollm2-135m",
        max_tokens=12,
        messages=[{"role": "user", "content": "Name a fruit."}],
    ) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert "content_block_delta" in kinds and "message_delta" in kinds
    assert final.content[0].type == "text" and final.content[0].text.strip()
    assert final.usage.output_tokens > 0


def test_messages_are_governed_metered_and_recorded(gw: Gateway, upstream: Scripted) -> None:
    _calls(upstream)
    c = client(gw)
    raw = c.messages.with_raw_response.create(model="m", max_tokens=10, messages=ASK)
    msg = raw.parse()
    rid = raw.headers["x-request-id"]
    assert raw.headers["x-switchyard-model"] == "m"
    assert msg.content[0].type == "text" and "scripted" in msg.content[0].text
    assert msg.usage.output_tokens > 0
    trace = gw.trace(rid)
    assert [d["stage"] for d in trace["decisions"]][:2] == ["authenticate", "validate"]
    rows = [r for r in gw.usage(limit=50) if r["request_id"] == rid]
    assert rows and rows[0]["endpoint"] == "messages" and rows[0]["status"] == "ok"
    assert rows[0]["output_tokens"] == msg.usage.output_tokens and rows[0]["cost_usd"] > 0
    # Authorization: Bearer works as well as x-api-key (the SDK's auth_token).
    bearer = anthropic.Anthropic(base_url=gw.url, auth_token=gw.key, api_key=None, max_retries=0)
    assert bearer.messages.create(model="m", max_tokens=5, messages=ASK).content
    # The upstream saw a chat request: the gateway's translation, never the client's key.
    assert upstream.requests() > 0


def test_errors_are_the_sdks_own_exceptions(gw: Gateway) -> None:
    with pytest.raises(anthropic.AuthenticationError) as auth:
        client(gw, key="sk-wrong").messages.create(model="m", max_tokens=5, messages=ASK)
    assert auth.value.body["type"] == "error"  # type: ignore[index]
    assert auth.value.body["error"]["type"] == "authentication_error"  # type: ignore[index]
    c = client(gw)
    with pytest.raises(anthropic.BadRequestError) as bad:
        c.messages.create(model="m", max_tokens=5, messages=ASK, extra_body={"container": "x"})
    assert "container" in bad.value.message
    with pytest.raises(anthropic.BadRequestError) as bad:
        c.messages.create(
            model="m",
            max_tokens=5,
            messages=[{"role": "user", "content": [{"type": "document", "source": {}}]}],  # type: ignore[list-item]
        )
    assert "document" in bad.value.message
    r = httpx.post(
        gw.url + "/v1/messages",
        headers={"x-api-key": gw.key, "anthropic-version": "2023-06-01"},
        json={"model": "m", "messages": ASK},
    )
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in r.json()["error"]["message"]
    with pytest.raises(anthropic.NotFoundError):
        c.messages.create(model="nope", max_tokens=5, messages=ASK)
    tenant = f"narrow-{time.monotonic_ns()}"
    gw.create_tenant(tenant)
    narrow = gw.create_key(tenant, allowed_models=["other"])["key"]
    with pytest.raises(anthropic.PermissionDeniedError):
        client(gw, key=narrow).messages.create(model="m", max_tokens=5, messages=ASK)
    # Not JSON, and a method the route does not take: still Anthropic's shape.
    r = httpx.post(gw.url + "/v1/messages", headers={"x-api-key": gw.key}, content=b"{")
    assert r.status_code == 400 and r.json()["type"] == "error"
    r = httpx.get(gw.url + "/v1/messages", headers={"x-api-key": gw.key})
    assert r.status_code == 405 and r.json()["type"] == "error"


def test_count_tokens(gw: Gateway) -> None:
    c = client(gw)
    small = c.messages.count_tokens(model="m", messages=ASK)
    big = c.messages.count_tokens(
        model="m", messages=[{"role": "user", "content": "pay the invoice " * 200}], tools=TOOLS
    )
    assert 0 < small.input_tokens < big.input_tokens
    with pytest.raises(anthropic.NotFoundError):
        c.messages.count_tokens(model="nope", messages=ASK)


def _tenant(gw: Gateway, name: str) -> tuple[str, str]:
    tenant = f"{name}-{time.monotonic_ns()}"
    gw.create_tenant(tenant)
    return tenant, gw.create_key(tenant)["key"]


def test_a_forbidden_tool_use_is_removed_streamed_or_not(gw: Gateway, upstream: Scripted) -> None:
    _, key = _tenant(gw, "shop")
    c = client(gw, key=key)
    _calls(upstream, ("search", {"q": "invoice 7"}), ("wire_money", {"to": "x", "usd": 500}))
    raw = c.messages.with_raw_response.create(model="m", max_tokens=50, messages=ASK, tools=TOOLS)
    msg = raw.parse()
    assert raw.headers["x-switchyard-tools-blocked"] == "1"
    uses = [b for b in msg.content if b.type == "tool_use"]
    assert [(u.name, u.input) for u in uses] == [("search", {"q": "invoice 7"})]
    assert msg.stop_reason == "tool_use"
    with c.messages.stream(model="m", max_tokens=50, messages=ASK, tools=TOOLS) as stream:
        events = list(stream)
        final = stream.get_final_message()
    assert "wire_money" not in json.dumps([e.model_dump() for e in events])
    uses = [b for b in final.content if b.type == "tool_use"]
    assert [(u.name, u.input) for u in uses] == [("search", {"q": "invoice 7"})]
    assert final.stop_reason == "tool_use"
    _calls(upstream)


def test_a_tool_result_that_needs_approval_is_refused(gw: Gateway, upstream: Scripted) -> None:
    tenant, key = _tenant(gw, "appr")
    task_id = f"a-{time.monotonic_ns()}"
    c = client(gw, key=key, default_headers={"x-task-id": task_id})
    _calls(upstream, ("send_email", {"to": "cfo@example.com"}))
    msg = c.messages.create(model="m", max_tokens=50, messages=ASK, tools=TOOLS)
    use = next(b for b in msg.content if b.type == "tool_use")
    assert use.name == "send_email" and use.input == {"to": "cfo@example.com"}
    _calls(upstream)
    turns: list[Any] = [
        *ASK,
        {"role": "assistant", "content": [use.model_dump(include={"type", "id", "name", "input"})]},
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "sent"}],
        },
    ]
    before = upstream.requests()
    with pytest.raises(anthropic.PermissionDeniedError) as refused:
        c.messages.create(model="m", max_tokens=50, messages=turns, tools=TOOLS)
    assert refused.value.body["error"]["code"] == "approval_required"  # type: ignore[index]
    assert upstream.requests() == before  # refused before anything went upstream
    token = gw.approve(tenant, task_id, use.id)
    ok = c.messages.create(
        model="m",
        max_tokens=50,
        messages=turns,
        tools=TOOLS,
        extra_headers={"x-switchyard-approval": token},
    )
    assert ok.content[0].type == "text"
