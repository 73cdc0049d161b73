"""The engine pool over real llama.cpp servers: continuous batching, residency (lazy
load, LRU eviction, pinning, one load for concurrent first requests) and its records.

Only one GGUF ships (SmolLM2-135M), so "several local models" here are several aliases
of that one file, each its own llama-server process with its own context size.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from support.gateways import Gateway, local_model, start_gateway

NO_EOS = {"0": -100, "2": -100}


def _chat(model: str, max_tokens: int = 4, content: str = "Hi", **extra: Any) -> dict[str, Any]:
    return {
        "model": model,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "temperature": 0,
        **extra,
    }


def _decision(trace: dict[str, Any], stage: str) -> dict[str, Any]:
    found = [d for d in trace["decisions"] if d["stage"] == stage]
    assert len(found) == 1, trace["decisions"]
    return dict(found[0])


def _engines(gw: Gateway) -> dict[str, Any]:
    r = httpx.get(gw.url + "/admin/engines", headers=gw.admin, timeout=30)
    assert r.status_code == 200, r.text
    return dict(r.json())


@pytest.fixture(scope="module")
def batching() -> Iterator[Gateway]:
    gw = start_gateway(
        {
            "models": [
                local_model("two-slots", parallel=2, ctx=1024),
                local_model("one-slot", parallel=1, ctx=1024),
            ],
            "embeddings": {"enabled": False},
        }
    )
    try:
        yield gw
    finally:
        gw.proc.stop()


def _stream_times(gw: Gateway, body: dict[str, Any], out: dict[str, Any]) -> None:
    """Times of the first and last content events of a streamed chat."""
    first = last = None
    n = 0
    with gw.stream(body) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {") and '"content"' in line:
                now = time.monotonic()
                first = first or now
                last = now
                n += 1
    out.update(first=first, last=last, chunks=n)


def test_two_requests_to_one_server_are_decoded_together(batching: Gateway) -> None:
    """With two slots, each stream's first token comes before the other's last: the
    server decodes them in one batch (the one-at-a-time worker would finish the first
    before it starts the second)."""
    a: dict[str, Any] = {}
    b: dict[str, Any] = {}
    body = _chat("two-slots", 48, "Count from one to a hundred.", stream=True, logit_bias=NO_EOS)
    ta = threading.Thread(target=_stream_times, args=(batching, body, a))
    tb = threading.Thread(target=_stream_times, args=(batching, body, b))
    ta.start()
    tb.start()
    ta.join(120)
    tb.join(120)
    assert a["chunks"] >= 40 and b["chunks"] >= 40, (a, b)
    assert a["first"] < b["last"] and b["first"] < a["last"], (a, b)
    info = httpx.get(batching.url + "/readyz").json()["models"]["two-slots"]
    assert info["runtime"] == "server" and info["parallel"] == 2


def test_a_cancelled_stream_frees_its_slot(batching: Gateway) -> None:
    """The client goes away mid-stream: the server stops generating for it, so the
    only slot serves the next request (which would otherwise wait ~1,500 tokens)."""
    body = _chat("one-slot", 1500, "Write a very long story.", stream=True, logit_bias=NO_EOS)
    with batching.stream(body) as r:
        assert r.status_code == 200
        seen = 0
        for line in r.iter_lines():
            if line.startswith("data: {"):
                seen += 1
            if seen >= 3:
                break  # closing the response closes the connection
    ready = httpx.get(batching.url + "/readyz", headers=batching.admin)  # addresses: admin
    engine = ready.json()["models"]["one-slot"]["upstream"]
    slots_url = engine.removesuffix("/v1") + "/slots"
    deadline = time.monotonic() + 20
    while True:
        slots = httpx.get(slots_url, timeout=10).json()
        if not any(s["is_processing"] for s in slots):
            break
        assert time.monotonic() < deadline, f"slot still busy: {slots}"
        time.sleep(0.1)
    started = time.monotonic()
    ok = batching.post("/v1/chat/completions", json=_chat("one-slot", 4), timeout=60)
    assert ok.status_code == 200, ok.text
    assert time.monotonic() - started < 30  # a hang guard, not a timing claim


def _pool_gateway(pinned: str | None = None) -> Gateway:
    models = [
        local_model(alias, ctx=256 + 64 * i, parallel=1, lazy=True, pinned=alias == pinned)
        for i, alias in enumerate(("m-a", "m-b", "m-c"))
    ]
    return start_gateway(
        {
            "models": models,
            "engines": {"max_loaded": 2, "min_residency_s": 0, "idle_ttl_s": 0},
            "embeddings": {"enabled": False},
        }
    )


def _ask(gw: Gateway, alias: str) -> dict[str, Any]:
    r = gw.post("/v1/chat/completions", json=_chat(alias), timeout=120)
    assert r.status_code == 200, r.text
    return _decision(gw.trace(r.headers["x-request-id"]), "residency")


def test_the_third_model_evicts_the_least_recently_used_and_says_so() -> None:
    gw = _pool_gateway()
    try:
        ready = httpx.get(gw.url + "/readyz")
        assert ready.status_code == 200  # lazy models are loadable, not missing
        assert {m["state"] for m in _engines(gw)["engines"].values()} == {"cold"}
        first = _ask(gw, "m-a")
        assert first["outcome"] == "cold-load" and first["evidence"]["evicted"] == []
        assert first["evidence"]["load_ms"] > 0
        assert _ask(gw, "m-a")["outcome"] == "hot"
        assert _ask(gw, "m-b")["outcome"] == "cold-load"
        third = _ask(gw, "m-c")
        assert third["outcome"] == "cold-load"
        evicted = third["evidence"]["evicted"]
        assert [e["alias"] for e in evicted] == ["m-a"], third
        assert "least recently used" in evicted[0]["reason"]
        pool = _engines(gw)["pool"]
        assert pool["loaded"] == ["m-b", "m-c"] and pool["evictions"] == 1
        assert pool["models"]["m-a"]["state"] == "cold"
        # The evicted model is served again, by loading it again (evicting m-b now).
        back = _ask(gw, "m-a")
        assert back["outcome"] == "cold-load"
        assert [e["alias"] for e in back["evidence"]["evicted"]] == ["m-b"]
        metrics = httpx.get(gw.url + "/metrics", headers=gw.admin).text
        assert 'switchyard_engine_evictions_total{model="m-a",reason="lru"} 1.0' in metrics
        assert 'switchyard_engine_loads_total{model="m-a"} 2.0' in metrics
    finally:
        gw.proc.stop()


def test_a_pinned_model_is_never_evicted_and_one_load_serves_concurrent_requests() -> None:
    gw = _pool_gateway(pinned="m-a")
    try:
        engines = _engines(gw)["engines"]
        assert engines["m-a"]["state"] == "ready"  # pinned: loaded at start
        assert engines["m-b"]["state"] == "cold"
        # Four first requests at once to a cold model: one load serves them all.
        with concurrent.futures.ThreadPoolExecutor(4) as ex:
            decisions = list(ex.map(lambda _: _ask(gw, "m-b"), range(4)))
        assert {d["outcome"] for d in decisions} == {"cold-load"}
        assert sum(not d["evidence"]["joined_load"] for d in decisions) == 1
        assert _engines(gw)["engines"]["m-b"]["loads"] == 1
        # m-a is the least recently used, but pinned: m-b goes instead.
        third = _ask(gw, "m-c")
        assert [e["alias"] for e in third["evidence"]["evicted"]] == ["m-b"], third
        assert _engines(gw)["pool"]["loaded"] == ["m-a", "m-c"]
    finally:
        gw.proc.stop()


def test_a_request_whose_deadline_cannot_cover_the_load_is_refused_at_once() -> None:
    gw = _pool_gateway()
    try:
        _ask(gw, "m-a")  # measures m-a's cold start
        _ask(gw, "m-b")
        _ask(gw, "m-c")  # evicts m-a
        started = time.monotonic()
        r = gw.post(
            "/v1/chat/completions",
            json=_chat("m-a"),
            headers={"x-request-timeout": "0.05"},
        )
        assert r.status_code == 503, r.text
        assert r.json()["error"]["code"] == "model_loading"
        assert int(r.headers["retry-after"]) >= 1
        assert time.monotonic() - started < 10  # refused, not waited out
        assert _engines(gw)["engines"]["m-a"]["state"] == "cold"  # and nothing loaded
    finally:
        gw.proc.stop()
