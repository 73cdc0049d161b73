"""Money under a hostile tenant (s72): a key under a small daily budget on priced models,
every request shape that might spend past it or lose or double what the ledger says.

Defects these tests find (each failed before its fix):
- a routed alias (`auto`) is reserved at no price: the reservation (and a task's
  cost_usd) is made at the price of the alias the client named
  (policy/stages_admission.py `generation_estimate`), and `auto` is no model, so it
  reserves $0 and any number of requests run at once or one after another, each
  billed at the route model's price: a $0.50 budget pays for every request sent;
- a routed alias never learns its template overhead: settle.py taught the prompt
  counts to the route's model, while the next `auto` request is estimated under
  `auto` (policy/cost.py `plan`), so its reservation stays at the assumed floor
  however many tokens the upstream bills for its prompt;
- an idempotent replay's row carries the tokens of the reply it replays (settle.py
  read the stored body's usage), so the ledger shows tokens no upstream generated:
  each repeat of a key doubles its tokens in the tenant's rows and rollups.

Shapes that hold (probed, no test kept): concurrency past the budget, `n`, no or huge
`max_tokens`, both caps set, unusable usage (NaN, negative, strings, floats, none),
streams without usage, a client that leaves a stream, a task cancelled mid-call, a
fallback to a dearer model, idempotent replays (billed once), Messages, completions,
background Responses, continuations (the stored conversation is counted).
"""

from __future__ import annotations

import concurrent.futures
import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from support.chat_replies import chat_reply
from support.gateways import Gateway, start_gateway
from support.hostile_upstream import Hostile, hostile_upstream, json_reply
from support.upstreams import Scripted

PRICEY = {"input": 0.0, "output": 10_000.0}  # 16 output tokens: $0.16
NO_STORE = {"Cache-Control": "no-store"}
TEMPLATE = 900  # prompt tokens the `tmpl` upstream bills for any prompt (a long template)
PROBE = "template probe"  # what routes a request of the tenant `TMPL_TENANT` to `tmpl`
TMPL_TENANT = "s72-money-tmpl"


def _billed_prompt() -> bytes:
    body = chat_reply("ok", [], "stop", {"prompt_tokens": TEMPLATE, "completion_tokens": 4})
    return json.dumps(body).encode()


@pytest.fixture(scope="module")
def up() -> Iterator[Hostile]:
    with hostile_upstream({"tmpl": json_reply(_billed_prompt())}) as hostile:
        yield hostile


@pytest.fixture(scope="module")
def gw(scripted: Scripted, up: Hostile) -> Iterator[Gateway]:
    """`auto` routes to `pricey` (the default route), and, for one tenant's probe
    text, to `tmpl`, whose upstream bills every prompt at TEMPLATE tokens."""
    scripted.content(None)
    pricey = {
        "alias": "pricey",
        "engine": {"kind": "openai", "base_url": scripted.url + "/v1"},
        "price": PRICEY,
    }
    tmpl = {**up.models(["tmpl"], PRICEY)[0]}
    router = {
        "enabled": True,
        "policy_version": "s72-money",
        "default_route": "big",
        "routes": [
            {"name": "big", "model": "pricey", "examples": ["write an essay"]},
            {"name": "tmpl", "model": "tmpl", "examples": [PROBE], "tenants": [TMPL_TENANT]},
        ],
    }
    g = start_gateway(
        {"models": [pricey, tmpl], "router": router, "cache": {"enabled": True, "semantic": False}}
    )
    yield g
    g.proc.stop()


def _chat(
    gw: Gateway,
    key: str,
    model: str,
    text: str = "hi",
    headers: dict[str, str] | None = None,
    **more: Any,
) -> httpx.Response:
    body = {"model": model, "messages": [{"role": "user", "content": text}], **more}
    sent = {**NO_STORE, **(headers or {})}
    return gw.post("/v1/chat/completions", key=key, json=body, headers=sent, timeout=30)


def test_a_routed_alias_is_reserved_at_its_routes_price(gw: Gateway) -> None:
    """Eight `auto` requests at once, then four more one after another, under $0.50:
    each is billed $0.16 at `pricey`; what is billed never passes the budget, the rest
    are 429 insufficient_quota, and every request has its one row."""
    budget = 0.5
    tenant, key = gw.new_tenant("s72-auto", budget_usd=budget)

    def one(_: int) -> httpx.Response:
        return _chat(gw, key, "auto", max_tokens=16)

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(one, range(8)))
    answers += [one(0) for _ in range(4)]
    codes = [r.status_code for r in answers]
    assert set(codes) == {200, 429}, codes
    for r in answers:
        if r.status_code == 429:
            assert r.json()["error"]["code"] == "insufficient_quota", r.text
        else:
            assert r.headers["x-switchyard-model"] == "pricey", r.headers
    rows = gw.stored_rows(tenant, len(answers))
    assert len(rows) == len(answers)
    assert len({r["request_id"] for r in rows}) == len(answers)
    spent = sum(float(r["cost_usd"]) for r in rows)
    assert codes.count(200) * 0.16 == pytest.approx(spent), rows
    assert spent <= budget + 1e-9, (spent, codes)


def test_a_routed_alias_learns_the_prompt_its_upstream_bills(gw: Gateway) -> None:
    """`tmpl` bills every prompt at 900 tokens. After the first reply, the next `auto`
    request routed there reserves at least that prompt (the learned template
    overhead, docs/guides/budgets.md), as a request naming `tmpl` does."""
    gw.create_tenant(TMPL_TENANT, budget_usd=5.0)
    key = str(gw.create_key(TMPL_TENANT)["key"])
    reserved = []
    for _ in range(2):
        r = _chat(gw, key, "auto", PROBE, max_tokens=8)
        assert r.status_code == 200, r.text
        assert r.headers["x-switchyard-model"] == "tmpl", r.headers
        trace = gw.trace(r.headers["x-request-id"])
        window = next(d for d in trace["decisions"] if d["stage"] == "window")
        reserved.append(window["evidence"]["prompt_tokens"])
    assert reserved[0] < TEMPLATE, reserved  # before any reply: the assumed floor
    assert reserved[1] >= TEMPLATE, reserved


def test_an_idempotent_replay_records_no_tokens(gw: Gateway) -> None:
    """Three sends of one Idempotency-Key: one upstream call, billed once; the two
    replays are rows of 0 tokens and $0, so the tenant's rows add up to what the
    upstream generated, not three times it."""
    tenant, key = gw.new_tenant("s72-replay", budget_usd=1.0)
    answers = [
        _chat(gw, key, "pricey", max_tokens=16, headers={"Idempotency-Key": "once"})
        for _ in range(3)
    ]
    assert [r.status_code for r in answers] == [200] * 3
    assert [r.headers.get("x-switchyard-idempotent-replay") for r in answers] == [
        None,
        "true",
        "true",
    ]
    rows = gw.stored_rows(tenant, 3)
    assert len(rows) == 3
    first, *replays = rows
    generated = answers[0].json()["usage"]["completion_tokens"]
    assert (first["output_tokens"], first["cost_usd"]) == (generated, pytest.approx(0.16))
    for row in replays:
        assert row["cache"] == "idempotent_replay", row
        assert (row["input_tokens"], row["output_tokens"], row["cost_usd"]) == (0, 0, 0.0), row
    assert sum(r["output_tokens"] for r in rows) == generated
