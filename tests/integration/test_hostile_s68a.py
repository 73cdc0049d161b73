"""Hostile input against the Anthropic Messages surface (`/v1/messages` and its
`count_tokens`) where the earlier hostile suites leave it out: what `count_tokens`
answers and for whom, a `tool_choice` that forces a tool the tenant may never run or
that no tool in the request answers, the error contract of the HTTP layer under the
Messages routes, and the budget, slot, credential and task-header rules through
Messages. Over sockets against a real gateway in front of the scripted upstream,
whose `GET /control/last` shows what went upstream.

Defects these tests found (each failed on the code before its fix, this stop):
- `count_tokens` is held to no limit: a key allowed 2 requests a minute counts a
  full-size body as often as it likes (api/anthropic.py `count_tokens` authenticates
  and parses, and no admission stage runs);
- `count_tokens` authorizes the model with its own partial copy of the rules: it
  answers for an adapter the tenant may not use (which `/v1/messages` refuses 403
  `adapter_not_allowed` and `/v1/models` hides) and for a revision the model does not
  have (404 on `/v1/messages`);
- a tool that the registry keeps from the tenant (`allowed_tenants`) is offered
  upstream, and a `tool_choice` forcing it goes upstream and is billed, while the same
  choice of a `tools.deny` tool is a 403 before any work (decide/tools.py `_denial`
  reads deny/allow/tenant_allow, not the registry that tool_calls_governor.py
  `ToolPolicy.refusal` applies to the reply);
- a `tool_choice` that forces a call (`any`, or `tool` naming one) with no such tool
  in `tools` goes upstream as `required` or a function choice without that function,
  or is a 403 "this key may not use" it, where Anthropic's API (and any
  OpenAI-compatible upstream) answers 400 (api/messages_codec.py `_tool_choice`);
- the HTTP layer's own refusals (a header byte that is not valid HTTP, headers past
  `server.max_header_bytes`) answer a Messages request in the OpenAI error shape
  (api/server.py `send_400_response`, `headers_too_large`).

Gaps guarded (pass today; no other test covers them through Messages): a huge
`max_tokens` under a small budget is capped on the wire to what the budget has left
and never billed past it; a Messages stream the client leaves midway gives its
concurrency slot back; two credentials are never merged (a bad Bearer is refused
whatever `x-api-key` says, and the request is billed to the Bearer's tenant only);
bad scheduling and task headers on a Messages request are a 400 in Anthropic's shape
naming the header, with nothing sent upstream.
"""

from __future__ import annotations

import hashlib
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from support.gateways import Gateway, cheap_config, local_model, start_gateway
from support.upstreams import Scripted

REGISTRY = [
    {"name": "search", "class": "read_only"},
    {"name": "wire_money", "class": "side_effect", "allowed_tenants": ["bank"]},
]
ADAPTER = "acme-only-lora"
ASK = [{"role": "user", "content": "pay the invoice"}]


def _tool(name: str) -> dict[str, Any]:
    return {"name": name, "description": name, "input_schema": {"type": "object"}}


@pytest.fixture(scope="module")
def gw(scripted: Scripted, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    # An adapter of a lazily loaded local model: registered, never loaded here (every
    # request for it is refused before that).
    lora = Path(tmp_path_factory.mktemp("lora")) / "acme.gguf"
    lora.write_bytes(os.urandom(4096))
    adapter = {
        "name": ADAPTER,
        "base": "smol",
        "base_revision": "smol-rev",
        "path": str(lora),
        "sha256": hashlib.sha256(lora.read_bytes()).hexdigest(),
        "allowed_tenants": ["acme"],
    }
    g = start_gateway(
        cheap_config(
            scripted,
            local_model("smol", lazy=True),
            adapters=[adapter],
            tools={"registry": REGISTRY, "on_forbidden_call": "block", "deny": ["rm_rf"]},
        )
    )
    yield g
    g.proc.stop()


def _post(gw: Gateway, path: str, body: Any, key: str, **headers: str) -> httpx.Response:
    h = {"x-api-key": key, "anthropic-version": "2023-06-01", **headers}
    return httpx.post(gw.url + path, json=body, headers=h, timeout=30)


def _anthropic_error(r: httpx.Response) -> dict[str, Any]:
    """The error of an Anthropic-shaped error body (fails on any other shape)."""
    body = r.json()
    assert body.get("type") == "error" and isinstance(body.get("error"), dict), r.text
    return dict(body["error"])


def _last(scripted: Scripted) -> dict[str, Any]:
    return dict(httpx.get(scripted.url + "/control/last").json()["body"])


# -- count_tokens -----------------------------------------------------------------------


def test_count_tokens_is_held_to_the_keys_request_rate(gw: Gateway) -> None:
    """A key allowed 2 requests a minute counts a 2 MB body five times in a row: every
    call is answered, each one read, parsed and estimated in full. Count calls are
    requests of the key (Anthropic limits them too): past the rate they get 429
    `rate_limit_error` as /v1/messages does."""
    tenant, key = gw.new_tenant("s68a", rpm=2)
    body = {"model": "cheap", "messages": [{"role": "user", "content": "word " * 400_000}]}
    codes = [_post(gw, "/v1/messages/count_tokens", body, key) for _ in range(5)]
    assert [r.status_code for r in codes] == [200, 200, 429, 429, 429]
    assert codes[0].json()["input_tokens"] > 400_000
    assert _anthropic_error(codes[2])["type"] == "rate_limit_error"
    # Each is a request of the key's, recorded as one and charged nothing.
    rows = gw.tenant_rows(tenant, n=5)
    assert sorted(r["status"] for r in rows) == ["error"] * 3 + ["ok"] * 2, rows
    assert {r["endpoint"] for r in rows} == {"messages.count_tokens"}
    assert sum(r["cost_usd"] or 0 for r in rows) == 0


@pytest.mark.parametrize("model", [ADAPTER, "cheap@no-such-revision"])
def test_count_tokens_answers_for_a_model_as_messages_does(gw: Gateway, model: str) -> None:
    """`count_tokens` checks the model by its own copy of the rules: it counts for an
    adapter the tenant is not in `allowed_tenants` of (which /v1/messages refuses 403
    `adapter_not_allowed` and /v1/models does not list) and for a revision the model
    does not have (404 on /v1/messages): another tenant's adapter is confirmed to
    exist. It answers as /v1/messages does for the same model."""
    _, key = gw.new_tenant("s68a")
    create = _post(gw, "/v1/messages", {"model": model, "max_tokens": 5, "messages": ASK}, key)
    count = _post(gw, "/v1/messages/count_tokens", {"model": model, "messages": ASK}, key)
    assert create.status_code in (403, 404), create.text
    assert count.status_code == create.status_code, (count.text, create.text)
    assert _anthropic_error(count)["type"] == _anthropic_error(create)["type"]


# -- tool_choice ------------------------------------------------------------------------


def test_a_forced_tool_the_registry_keeps_from_the_tenant_never_goes_upstream(
    gw: Gateway, scripted: Scripted
) -> None:
    """`wire_money` is registered for the tenant `bank` only. A `tool_choice` forcing
    it from another tenant is sent upstream (and billed) with the tool offered, though
    the gate will remove any call to it from the reply; the same choice of a
    `tools.deny` tool is a 403 before any work. Both are refused alike, and a tool the
    tenant may never run is not offered upstream."""
    _, key = gw.new_tenant("s68a")
    before = scripted.requests()
    body = {"model": "cheap", "max_tokens": 5, "messages": ASK}
    tools = [_tool("search"), _tool("wire_money")]
    denied = _post(
        gw,
        "/v1/messages",
        {**body, "tools": [_tool("rm_rf")], "tool_choice": {"type": "tool", "name": "rm_rf"}},
        key,
    )
    assert denied.status_code == 403, denied.text
    forced = _post(
        gw,
        "/v1/messages",
        {**body, "tools": tools, "tool_choice": {"type": "tool", "name": "wire_money"}},
        key,
    )
    assert forced.status_code == 403, forced.text
    assert _anthropic_error(forced)["type"] == "permission_error"
    only = _post(
        gw,
        "/v1/messages",
        {**body, "tools": [_tool("wire_money")], "tool_choice": {"type": "any"}},
        key,
    )
    assert only.status_code == 403, only.text
    assert scripted.requests() == before
    offered = _post(gw, "/v1/messages", {**body, "tools": tools}, key)
    assert offered.status_code == 200, offered.text
    names = [t["function"]["name"] for t in _last(scripted).get("tools") or []]
    assert names == ["search"], names


@pytest.mark.parametrize(
    ("tools", "choice"),
    [
        (None, {"type": "any"}),
        (None, {"type": "tool", "name": "search"}),
        ([_tool("search")], {"type": "tool", "name": "lookup"}),
    ],
)
def test_a_tool_choice_no_offered_tool_answers_is_a_400_before_upstream(
    gw: Gateway, scripted: Scripted, tools: list[dict[str, Any]] | None, choice: dict[str, Any]
) -> None:
    """A choice that forces a call no tool in the request can answer cannot be
    honoured: Anthropic's API refuses it 400, and so would an OpenAI-compatible
    upstream (`tool_choice` without `tools`). Today it is sent upstream as `required`
    or a function choice (and billed), or, where tools are governed, refused 403 as if
    the key were not allowed a tool that is not there."""
    _, key = gw.new_tenant("s68a")
    before = scripted.requests()
    body: dict[str, Any] = {
        "model": "cheap",
        "max_tokens": 5,
        "messages": ASK,
        "tool_choice": choice,
    }
    if tools is not None:
        body["tools"] = tools
    r = _post(gw, "/v1/messages", body, key)
    assert r.status_code == 400, r.text
    error = _anthropic_error(r)
    assert error["type"] == "invalid_request_error" and "tool_choice" in error["message"]
    assert scripted.requests() == before


# -- the HTTP layer's refusals ----------------------------------------------------------


@pytest.mark.parametrize(
    ("headers", "status"),
    [({"anthropic-beta": "tools\x01"}, 400), ({"anthropic-beta": "x" * 70_000}, 431)],
)
def test_the_http_layers_refusals_on_messages_take_anthropics_shape(
    gw: Gateway, headers: dict[str, str], status: int
) -> None:
    """A header byte that is not valid HTTP, or headers past `server.max_header_bytes`,
    are refused below the app, in the OpenAI error shape whatever the route: an
    Anthropic client on /v1/messages gets a body its SDK does not read as an error.
    The request line is known when either is refused, so the route picks the shape."""
    _, key = gw.new_tenant("s68a")
    r = _post(
        gw, "/v1/messages", {"model": "cheap", "max_tokens": 5, "messages": ASK}, key, **headers
    )
    assert r.status_code == status, r.text
    assert _anthropic_error(r)["type"] == "invalid_request_error"


# -- budgets, slots, credentials and headers through Messages (gaps) ----------------------


def test_a_huge_max_tokens_is_capped_to_what_the_budget_has_left(
    gw: Gateway, scripted: Scripted
) -> None:
    """Gap: test_budget_shapes sends chat only. With $0.05 a day left (50 output tokens
    at the price), `max_tokens` 2^31-1 goes upstream as at most 50, and once the
    budget is spent calls are refused in Anthropic's shape: nothing is billed past it."""
    budget = 0.05
    tenant, key = gw.new_tenant("s68a", budget_usd=budget, budget_period="day")
    body = {"model": "cheap", "max_tokens": 2**31 - 1, "messages": ASK}
    first = _post(gw, "/v1/messages", body, key)
    assert first.status_code == 200, first.text
    assert first.headers["x-switchyard-max-tokens"].endswith("reason=budget")
    assert 0 < _last(scripted)["max_tokens"] <= 50
    calls = 1
    for _ in range(8):  # 16 tokens a reply: the budget is spent within 4 calls
        last = _post(gw, "/v1/messages", body, key)
        calls += 1
        if last.status_code != 200:
            break
    assert last.status_code == 429, last.text
    assert _anthropic_error(last)["type"] == "rate_limit_error"
    rows = gw.tenant_rows(tenant, n=calls)
    assert sum(r["cost_usd"] or 0 for r in rows) <= budget + 1e-9, rows


def test_a_messages_stream_left_midway_gives_its_slot_back(gw: Gateway, scripted: Scripted) -> None:
    """Gap: test_hostile_s67 checks the ledger row of a Messages stream the client
    leaves; not what it held. A tenant allowed one request at a time leaves a slow
    stream after its first events: its row says cancelled, and its next call is served
    (the slot came back) rather than refused until the stream would have ended."""
    tenant, key = gw.new_tenant("s68a", max_concurrency=1)
    scripted.fault("slow:300", count=1)
    body = {"model": "cheap", "max_tokens": 16, "stream": True, "messages": ASK}
    headers = {"x-api-key": key, "anthropic-version": "2023-06-01"}
    with httpx.stream("POST", gw.url + "/v1/messages", json=body, headers=headers, timeout=30) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("event: content_block_delta"):
                break
    rows = gw.tenant_rows(tenant)
    assert [row["status"] for row in rows] == ["cancelled"], rows
    deadline = time.monotonic() + 5
    while True:
        again = _post(gw, "/v1/messages", {**body, "stream": False}, key)
        if again.status_code == 200 or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert again.status_code == 200, again.text


def test_two_credentials_are_never_merged(gw: Gateway) -> None:
    """Gap: no test sends both `Authorization` and `x-api-key`. A Bearer that is not a
    key is refused 401 whatever `x-api-key` holds (never a fall back to the other
    credential), and with two valid keys of two tenants the request is the Bearer's
    tenant's alone: one row, none for the other tenant."""
    a_tenant, a_key = gw.new_tenant("s68a")
    b_tenant, b_key = gw.new_tenant("s68a")
    body = {"model": "cheap", "max_tokens": 5, "messages": ASK}
    bad = _post(gw, "/v1/messages", body, a_key, authorization="Bearer sk-not-a-key")
    assert bad.status_code == 401, bad.text
    assert _anthropic_error(bad)["type"] == "authentication_error"
    both = _post(gw, "/v1/messages", body, a_key, authorization=f"Bearer {b_key}")
    assert both.status_code == 200, both.text
    assert len(gw.tenant_rows(b_tenant)) == 1
    assert gw.usage(tenant=a_tenant, limit=50) == []


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("x-switchyard-priority", "urgent"),
        ("x-switchyard-priority", "b" * 4000),
        ("x-task-id", "t" * 129),
        ("x-task-planned-steps", "0"),
        ("x-parent-request-id", "req_1,not an id"),
        ("x-request-timeout", "1_0"),
    ],
)
def test_a_bad_scheduling_or_task_header_on_messages_is_a_400_naming_it(
    gw: Gateway, scripted: Scripted, name: str, value: str
) -> None:
    """Gap: test_scheduling and test_task_governance send these to chat only. On
    /v1/messages each is a 400 in Anthropic's shape naming the header, before anything
    goes upstream."""
    _, key = gw.new_tenant("s68a")
    before = scripted.requests()
    body = {"model": "cheap", "max_tokens": 5, "messages": ASK}
    r = _post(gw, "/v1/messages", body, key, **{name: value})
    assert r.status_code == 400, r.text
    error = _anthropic_error(r)
    assert error["type"] == "invalid_request_error" and name in error["message"], r.text
    assert scripted.requests() == before
