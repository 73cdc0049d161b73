"""Embeddings are a request like any other: authenticated, authorized, limited,
budgeted, recorded in the ledger, traced and metered (the request service runs them
through the embeddings pipeline)."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from support.gateways import Gateway, start_gateway

EMBED = "all-minilm-l6-v2"


@pytest.fixture(scope="module")
def gw() -> Iterator[Gateway]:
    g = start_gateway(
        {
            "models": [
                {"alias": "chat", "engine": {"kind": "openai", "base_url": "http://127.0.0.1:9/v1"}}
            ],
            "embeddings": {"enabled": True, "price": 100.0},  # USD per million input tokens
        }
    )
    yield g
    g.proc.stop()


def _embed(gw: Gateway, key: str, body: dict[str, object]) -> httpx.Response:
    return httpx.post(
        gw.url + "/v1/embeddings",
        json=body,
        headers={"Authorization": f"Bearer {key}"},
        timeout=60,
    )


def test_rpm_refuses_embeddings_and_every_call_is_recorded_and_traced(gw: Gateway) -> None:
    gw.create_tenant("emb-rpm", rpm=2)
    key = gw.create_key("emb-rpm")["key"]
    got = [_embed(gw, key, {"model": EMBED, "input": ["hello", "world"]}) for _ in range(3)]
    assert [r.status_code for r in got] == [200, 200, 429]
    assert got[2].json()["error"]["code"] == "rate_limit_rpm"
    ok = got[0].json()
    assert len(ok["data"]) == 2 and len(ok["data"][0]["embedding"]) == 384
    tokens = ok["usage"]["prompt_tokens"]
    assert tokens > 0
    rows = gw.usage(tenant_id="emb-rpm")
    assert len(rows) == 3
    by_id = {r["request_id"]: r for r in rows}
    served = by_id[got[0].headers["x-request-id"]]
    assert served["endpoint"] == "embeddings" and served["model"] == EMBED
    assert served["status"] == "ok" and served["input_tokens"] == tokens
    assert served["cost_usd"] == pytest.approx(tokens * 100.0 / 1e6)
    refused = by_id[got[2].headers["x-request-id"]]
    assert refused["status"] == "error" and refused["error_code"] == "rate_limit_rpm"
    trace = httpx.get(
        gw.url + f"/admin/requests/{got[0].headers['x-request-id']}", headers=gw.admin
    ).json()
    stages = [(d["stage"], d["outcome"]) for d in trace["decisions"]]
    assert stages == [
        ("authenticate", "ok"),
        ("validate", "ok"),
        ("authorize", "allowed"),
        ("task", "skip"),
        ("admit", "admitted"),
        ("embed", "ok"),
    ]
    metrics = httpx.get(gw.url + "/metrics", headers=gw.admin).text
    assert (
        f'switchyard_requests_total{{model="{EMBED}",status="ok",tenant="emb-rpm"}} 2.0' in metrics
    )


def test_a_budget_stops_embeddings_once_spent(gw: Gateway) -> None:
    # A call of 90 letters is reserved 92 tokens ($0.0092: a token a character, plus
    # two) and billed what the tokenizer counts (47, $0.0047): one fits, two do not.
    gw.create_tenant("emb-budget", budget_usd=0.01)
    key = gw.create_key("emb-budget")["key"]
    first = _embed(gw, key, {"model": EMBED, "input": "x" * 90})
    second = _embed(gw, key, {"model": EMBED, "input": "x" * 90})
    assert first.status_code == 200, first.text
    assert second.status_code == 429 and second.json()["error"]["code"] == "insufficient_quota"


def test_dimensions_and_model_are_checked_before_any_work(gw: Gateway) -> None:
    gw.create_tenant("emb-dims")
    key = gw.create_key("emb-dims", allowed_models=["chat"])["key"]
    r = _embed(gw, key, {"model": EMBED, "input": "hi"})
    assert r.status_code == 403 and r.json()["error"]["code"] == "model_not_allowed"
    other = gw.create_key("emb-dims")["key"]
    r = _embed(gw, other, {"model": EMBED, "input": "hi", "dimensions": 768})
    assert r.status_code == 400 and r.json()["error"]["param"] == "dimensions"
    rows = {row["request_id"]: row for row in gw.usage(tenant_id="emb-dims")}
    refused = rows[r.headers["x-request-id"]]
    assert refused["input_tokens"] == 0 and refused["cost_usd"] == 0
    trace = httpx.get(gw.url + f"/admin/requests/{r.headers['x-request-id']}", headers=gw.admin)
    assert [d["stage"] for d in trace.json()["decisions"]] == ["authenticate"]
