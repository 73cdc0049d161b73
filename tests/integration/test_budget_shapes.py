"""A budget holds whatever the request's shape (policy/cost.py), against an upstream
that bills like an engine: the whole body as prompt, every sequence (`n`, `best_of`,
each prompt of a list) billed, and generation to its own limit (here 5,000 tokens)
when no cap is sent. Several requests at once, for every shape: what is billed stays
within the budget. Then the cap on the wire, its shrinking, and the context window.

Each of these failed before the cost rule: no cap was sent (5,000 tokens billed on a
512-token reservation), `n` and prompt lists were not multiplied in, tool calls,
their arguments and tool schemas were not counted, and the window was never checked
on the primary path.
"""

from __future__ import annotations

import base64
import concurrent.futures
import io
import time
from collections.abc import Iterator
from typing import Any

import httpx
import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from support.gateways import Gateway, start_gateway
from support.upstreams import Scripted, start_scripted
from switchyard.config import Price
from switchyard.policy.cost import PromptOverhead, plan
from switchyard.request import Generation, from_object

PRICE = {"input": 100.0, "output": 1000.0}  # USD per million tokens
BUDGET = 1.0


@pytest.fixture(scope="module")
def upstream() -> Iterator[Scripted]:
    proc, s = start_scripted("--tokens", "5000")
    yield s
    proc.stop()


def _model(alias: str, url: str, **caps: Any) -> dict[str, Any]:
    return {
        "alias": alias,
        "engine": {"kind": "openai", "base_url": url + "/v1", "model": "scripted"},
        "price": PRICE,
        "capabilities": {"context_window": 1_000_000, "supports_tools": True, **caps},
    }


@pytest.fixture(scope="module")
def gw(upstream: Scripted) -> Iterator[Gateway]:
    g = start_gateway(
        {
            "models": [
                _model("cheap", upstream.url),
                _model("vision", upstream.url, supports_vision=True),
                {**_model("small", upstream.url), "capabilities": {"context_window": 1000}},
            ],
            "embeddings": {"enabled": False},
        }
    )
    yield g
    g.proc.stop()


_TENANTS: dict[str, str] = {}  # key -> its tenant


def _new_budget_key(gw: Gateway, name: str) -> str:
    tenant = f"{name.replace('_', '-')}-{time.monotonic_ns() % 10**9}"
    gw.create_tenant(tenant, budget_usd=BUDGET)
    key = str(gw.create_key(tenant)["key"])
    _TENANTS[key] = tenant
    return key


def _billed(gw: Gateway, key: str, expected_rows: int) -> float:
    """What the upstream billed the tenant (the ledger records the upstream's usage at
    the model's price), once every admitted request's row is written."""
    deadline = time.monotonic() + 20
    rows: list[dict[str, Any]] = []
    while time.monotonic() < deadline:
        rows = [r for r in gw.usage(limit=500, tenant=_TENANTS[key]) if r["status"] == "ok"]
        if len(rows) >= expected_rows:
            break
        time.sleep(0.2)
    assert len(rows) >= expected_rows, rows
    return sum(float(r["cost_usd"]) for r in rows)


def _concurrently(gw: Gateway, key: str, path: str, body: dict[str, Any], n: int) -> list[int]:
    def one(_: int) -> int:
        r = httpx.post(
            gw.url + path,
            content=orjson.dumps(body),
            headers={"Authorization": f"Bearer {key}", "content-type": "application/json"},
            timeout=60,
        )
        assert r.status_code in (200, 429), r.text
        if r.status_code == 429:
            assert r.json()["error"]["code"] in ("insufficient_quota", "rate_limit_tpm"), r.text
        return r.status_code

    with concurrent.futures.ThreadPoolExecutor(n) as pool:
        return list(pool.map(one, range(n)))


def _png_data_url() -> str:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (64, 64), (200, 30, 30)).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


ARGS = orjson.dumps({"rows": ["x" * 60] * 300}).decode()  # ~20 KB of tool-call arguments
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": f"tool_{i}",
            "description": "d" * 400,
            "parameters": {"type": "object", "properties": {"a": {"type": "string"}}},
        },
    }
    for i in range(20)
]

SHAPES: dict[str, tuple[str, dict[str, Any], int]] = {
    # (path, body, concurrent requests)
    "no_max_tokens": (
        "/v1/chat/completions",
        {"model": "cheap", "messages": [{"role": "user", "content": "write a long essay"}]},
        3,
    ),
    "n_choices": (
        "/v1/chat/completions",
        {
            "model": "cheap",
            "n": 50,
            "max_tokens": 10,
            "messages": [{"role": "user", "content": "hi"}],
        },
        3,
    ),
    "prompt_list": (
        "/v1/completions",
        {"model": "cheap", "prompt": ["say hi"] * 50, "max_tokens": 10},
        3,
    ),
    "best_of": (
        "/v1/completions",
        {"model": "cheap", "prompt": "say hi", "best_of": 20, "max_tokens": 30},
        3,
    ),
    "tool_history": (
        "/v1/chat/completions",
        {
            "model": "cheap",
            "max_tokens": 10,
            "tools": TOOLS,
            "messages": [
                {"role": "user", "content": "go"},
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": "call_1",
                            "type": "function",
                            "function": {"name": "tool_1", "arguments": ARGS},
                        }
                    ],
                },
                {"role": "tool", "tool_call_id": "call_1", "content": "ok"},
            ],
        },
        5,
    ),
}


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_what_is_billed_stays_within_the_budget(gw: Gateway, shape: str) -> None:
    path, body, n = SHAPES[shape]
    key = _new_budget_key(gw, shape)
    codes = _concurrently(gw, key, path, body, n)
    assert 200 in codes or shape == "tool_history", codes
    billed = _billed(gw, key, codes.count(200))
    assert billed <= BUDGET + 1e-9, (shape, billed, codes)


def test_images_are_reserved_at_their_configured_count(gw: Gateway) -> None:
    image = {"type": "image_url", "image_url": {"url": _png_data_url()}}
    body = {
        "model": "vision",
        "max_tokens": 100,
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "what?"}] + [image] * 4}
        ],
    }
    key = _new_budget_key(gw, "images")
    codes = _concurrently(gw, key, "/v1/chat/completions", body, 10)
    assert 200 in codes and 429 in codes, codes  # ~$0.21 each: four fit, not ten
    assert _billed(gw, key, codes.count(200)) <= BUDGET + 1e-9


def test_the_cap_reserved_is_the_cap_sent(gw: Gateway, upstream: Scripted) -> None:
    """No max_tokens: the engine would write 5,000 tokens ($5 on a $1 budget); the
    gateway sends the 512 it reserved and says so."""
    key = _new_budget_key(gw, "cap")
    body = {"model": "cheap", "messages": [{"role": "user", "content": "write a long essay"}]}
    r = gw.post("/v1/chat/completions", key=key, json=body)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 512
    assert r.json()["choices"][0]["finish_reason"] == "length"
    assert r.headers["x-switchyard-max-tokens"] == "512; reason=default"


def test_a_cap_larger_than_what_is_left_shrinks_to_fit(gw: Gateway) -> None:
    """$1.00: the first request's 512 tokens ($0.51 and its prompt) fit; the second
    has ~$0.49 left and is sent with the cap that fits, not refused; once not even
    a minimal answer fits, 429 insufficient_quota names what is left."""
    key = _new_budget_key(gw, "shrink")
    body = {"model": "cheap", "messages": [{"role": "user", "content": "write"}]}
    hdrs = {"Authorization": f"Bearer {key}"}
    caps = []
    for _ in range(6):
        r = httpx.post(gw.url + "/v1/chat/completions", json=body, headers=hdrs, timeout=60)
        if r.status_code != 200:
            break
        caps.append(r.json()["usage"]["completion_tokens"])
    assert caps[0] == 512 and 16 <= caps[1] < 512, caps
    assert r.status_code == 429, r.text
    err = r.json()["error"]
    assert err["code"] == "insufficient_quota" and "left" in err["message"], err
    assert _billed(gw, key, len(caps)) <= BUDGET + 1e-9


def test_a_task_budget_shrinks_the_cap_too(gw: Gateway) -> None:
    key = _new_budget_key(gw, "taskcap")
    body = {"model": "cheap", "messages": [{"role": "user", "content": "write"}]}
    hdrs = {
        "Authorization": f"Bearer {key}",
        "x-task-id": f"t-{time.monotonic_ns()}",
        "x-task-budget": "cost_usd=0.2",
    }
    r = httpx.post(gw.url + "/v1/chat/completions", json=body, headers=hdrs, timeout=60)
    assert r.status_code == 200, r.text
    sent, reason = r.headers["x-switchyard-max-tokens"].split("; reason=")
    assert reason == "task" and 16 <= int(sent) < 200, r.headers
    assert r.json()["usage"]["completion_tokens"] == int(sent)


def test_the_context_window_is_checked_on_the_primary_path(gw: Gateway, upstream: Scripted) -> None:
    before = upstream.requests()
    long = {"model": "small", "messages": [{"role": "user", "content": "word " * 1000}]}
    r = gw.post("/v1/chat/completions", json=long)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == "context_length_exceeded"
    assert "1000" in r.json()["error"]["message"]
    assert upstream.requests() == before  # refused before anything went upstream
    # A prompt within the window: its default cap is what the window leaves.
    fits = {"model": "small", "messages": [{"role": "user", "content": "word " * 600}]}
    r = gw.post("/v1/chat/completions", json=fits)
    assert r.status_code == 200, r.text
    assert r.headers["x-switchyard-max-tokens"] == "250; reason=window"


# -- the rule itself ---------------------------------------------------------------------

texts = st.text(max_size=300)
messages = st.lists(
    st.fixed_dictionaries(
        {"role": st.sampled_from(["user", "assistant", "system"]), "content": texts}
    ),
    min_size=1,
    max_size=8,
)


@settings(max_examples=200, deadline=None)
@given(
    messages,
    st.none() | st.integers(1, 4096),
    st.integers(1, 16),
    st.lists(st.text(max_size=2000), max_size=3),
)
def test_the_reservation_covers_what_an_engine_bills(
    msgs: list[dict[str, Any]], max_tokens: int | None, n: int, extra: list[str]
) -> None:
    """Whatever the body carries (any field, any text), the reserved prompt is at
    least what the scripted upstream bills (the body's bytes / 4) and the output is
    the cap times every sequence."""
    body: dict[str, Any] = {"model": "m", "messages": msgs, "n": n, "junk": extra}
    if max_tokens is not None:
        body["max_tokens"] = max_tokens
    raw = orjson.dumps(body)
    cost = plan(from_object(Generation, body)[0], len(raw), "m", None, 512, 1024, PromptOverhead(0))
    assert cost.prompt >= len(raw) // 4
    assert cost.output == (max_tokens or 512) * n
    assert cost.lower <= cost.prompt


def test_fit_gives_the_largest_cap_that_fits() -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "n": 2}
    cost = plan(from_object(Generation, body)[0], None, "m", None, 512, 0, PromptOverhead(0))
    price = Price(**PRICE)
    usd_left = cost.usd(price) / 2
    cap = cost.fit(None, usd_left, price)
    cost.cap = cap
    assert cost.usd(price) <= usd_left + 1e-12
    cost.cap = cap + 1
    assert cost.usd(price) > usd_left
    assert cost.fit(cost.prompt + 2 * 7, None, price) == 7
    assert cost.fit(cost.prompt - 1, None, price) < 0


def test_the_learned_overhead_is_a_bounded_ratio_plus_a_floor() -> None:
    o = PromptOverhead(64, floor_cap=1024, ratio_cap=2.0)
    assert o.get("m", 1000) == 64  # before any reply: the floor
    o.observe("m", 100, 100 + 300)  # a template of ~300 tokens
    assert o.get("m", 100) >= 300
    o.observe("m", 10_000, 10_000 * 2 + 1024)  # a tokenizer at twice the estimate
    assert o.get("m", 10_000) + 10_000 >= 10_000 * 2 + 1024
    o.observe("m", 10, 10**9)  # an absurd count is bounded
    assert o.get("m", 10) <= 1024 + 2.0 * 10 + 1
