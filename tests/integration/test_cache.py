"""Response cache: partitions, TTL, invalidation, cacheability, and the gateway path."""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from support.gateways import Gateway, start_gateway
from support.upstreams import Scripted
from switchyard.config import CacheConfig
from switchyard.decide.cache import ResponseCache, _Partition, cache_keys
from switchyard.decide.cacheability import cacheability, storable_reply
from switchyard.request import Generation, from_object

MSGS = [
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": "What is the refund window?"},
]


def _req(body: dict[str, Any]) -> Generation:
    """The typed request of a body (its model need not matter here)."""
    req: Generation = from_object(Generation, {"model": "m", **body})[0]
    return req


def _keys(tenant: str = "a", model: str = "m", revision: str = "r1", **body: Any) -> Any:
    b = {"messages": MSGS, "temperature": 0, **body}
    return cache_keys(
        _req(b), "chat.completions", f"tenant:{tenant}", tenant, model, revision, None, None
    )


def _vec(seed: int) -> np.ndarray:
    v = np.random.default_rng(seed).normal(size=384).astype(np.float32)
    return v / np.linalg.norm(v)


def test_the_cache_takes_its_dimension_from_the_embedder() -> None:
    """A 768-dimension embedding model: the cache stores and finds its vectors (it
    assumed 384 before), refuses a vector of another size, and a partition made under
    one model is never compared with another model's vectors."""
    dims: list[int | None] = [None]  # unknown until the embedder has loaded
    cache = ResponseCache(100, 10_000_000, dimensions=lambda: dims[0])
    dims[0] = 768
    wide = np.random.default_rng(7).normal(size=768).astype(np.float32)
    wide /= np.linalg.norm(wide)
    cache.store(_keys("a"), b'{"a":1}', wide, ttl_s=60, now=0)
    found = cache.nearest(_keys("a"), wide, now=1)
    assert found.entry is not None and found.similarity == pytest.approx(1.0, abs=1e-4)
    with pytest.raises(ValueError):
        cache.store(_keys("a", revision="r9"), b"{}", _vec(1), ttl_s=60, now=0)
    assert cache.nearest(_keys("a"), _vec(1), now=1).entry is None  # 384 vs a 768 partition


def test_partitions_isolate_tenants_at_any_threshold() -> None:
    cache = ResponseCache(100, 10_000_000)
    v = _vec(1)
    cache.store(_keys("a"), b'{"a":1}', v, ttl_s=60, now=0)
    other = _keys("b")
    assert cache.lookup_exact(other, now=1) is None
    found = cache.nearest(other, v, now=1)
    assert found.entry is None  # even threshold -1 has nothing to compare with
    assert cache.nearest(_keys("a"), v, now=1).entry is not None


@pytest.mark.parametrize(
    "changed",
    [
        {"revision": "r2"},
        {"model": "other"},
        {"messages": [{"role": "system", "content": "be verbose"}, MSGS[1]]},
        {"temperature": 0.5},
        {"tools": [{"type": "function", "function": {"name": "x"}}]},
        {
            "messages": [
                {"role": "user", "content": "earlier turn"},
                {"role": "assistant", "content": "ok"},
                MSGS[1],
            ]
        },
    ],
)
def test_anything_that_bounds_validity_changes_the_partition(changed: dict[str, Any]) -> None:
    base = _keys()
    kw = {k: changed.pop(k) for k in ("revision", "model") if k in changed}
    other = _keys(**kw, **changed)
    assert other.partition != base.partition and other.exact != base.exact
    assert other.query == base.query  # the compared text is the last user message only


def test_ttl_lru_and_invalidation_dry_run() -> None:
    cache = ResponseCache(max_entries=3, max_bytes=10_000_000)
    k1 = _keys("a")
    cache.store(k1, b"1", _vec(1), ttl_s=10, now=0)
    assert cache.has_exact(k1, now=5) and not cache.has_exact(k1, now=11)
    assert cache._exact[k1.exact].hits == 0  # has_exact touches nothing
    assert cache.lookup_exact(k1, now=5) is not None
    assert cache.lookup_exact(k1, now=11) is None  # expired and dropped
    assert len(cache) == 0
    keys = [_keys("a", model=f"m{i}") for i in range(4)]
    for i, k in enumerate(keys):
        cache.store(k, b"x", _vec(i), ttl_s=100, now=0)
    assert len(cache) == 3 and cache.lookup_exact(keys[0], now=1) is None  # LRU evicted
    report = cache.invalidate(model="m2", dry_run=True)
    assert report["matched"] == 1 and report["removed"] == 0 and len(cache) == 3
    report = cache.invalidate(model="m2")
    assert report["removed"] == 1 and cache.lookup_exact(keys[2], now=1) is None
    with pytest.raises(ValueError):
        cache.invalidate()


def test_semantic_matrix_survives_swap_removal() -> None:
    cache = ResponseCache(100, 10_000_000)
    ks = [
        cache_keys(
            _req({"messages": [{"role": "user", "content": f"q{i}"}]}),
            "chat.completions",
            "t",
            "t",
            "m",
            "r",
            None,
            None,
        )
        for i in range(5)
    ]
    for i, k in enumerate(ks):
        cache.store(k, f"{i}".encode(), _vec(i), ttl_s=100, now=0)
    cache._drop(cache.lookup_exact(ks[1], now=0))  # type: ignore[arg-type]
    for i in (0, 2, 3, 4):
        got = cache.nearest(ks[i], _vec(i), now=1)
        assert got.entry is not None and got.entry.body == f"{i}".encode()
        assert got.similarity == pytest.approx(1.0, abs=1e-5)


def _query_keys(text: str) -> Any:
    """Same partition for every text: only the last user message differs."""
    body = {"messages": [{"role": "user", "content": text}], "temperature": 0}
    return cache_keys(_req(body), "chat.completions", "tenant:a", "a", "m", "r1", None, None)


def _unit(rng: np.random.Generator, n: int) -> np.ndarray:
    v = rng.normal(size=(n, 384)).astype(np.float32)
    return v / np.linalg.norm(v, axis=1, keepdims=True)


def _near(rng: np.random.Generator, x: np.ndarray, cos: float) -> np.ndarray:
    """A unit vector at exactly `cos` from the unit vector x."""
    noise = rng.normal(size=384).astype(np.float32)
    noise -= (noise @ x) * x
    noise /= np.linalg.norm(noise)
    return (cos * x + np.sqrt(1 - cos**2) * noise).astype(np.float32)


@pytest.mark.parametrize("exact_max", [4096, 64])
def test_search_matches_brute_force_after_adds_and_removes(
    monkeypatch: pytest.MonkeyPatch, exact_max: int
) -> None:
    """Small partitions: one exact product. Large ones (exact_max lowered here so the
    test stays small): sign-code scan + exact re-rank, which must return the brute-force
    best whenever it is at or above the floor, and always an exact similarity."""
    monkeypatch.setattr(_Partition, "exact_max", exact_max)
    rng = np.random.default_rng(7)
    cache = ResponseCache(100_000, 1 << 40)
    keys = [_query_keys(f"q{i}") for i in range(3000)]
    vecs = _unit(rng, len(keys))
    for k, v in zip(keys, vecs, strict=True):
        cache.store(k, b"{}", v, ttl_s=100, now=0)
    for i in rng.choice(len(keys), 900, replace=False):  # swap-removes all over
        cache._drop(cache.lookup_exact(keys[i], now=0))  # type: ignore[arg-type]
    for i, v in enumerate(_unit(rng, 400)):
        cache.store(_query_keys(f"r{i}"), b"{}", v, ttl_s=100, now=0)
    (part,) = cache._partitions.values()
    n = len(part.entries)
    assert n == 2500 and all(e.row == i for i, e in enumerate(part.entries))
    assert np.array_equal(part.codes[:n], part._code(part.matrix[:n]))  # codes follow rows
    live = part.matrix[:n].copy()
    probe = _query_keys("probe")
    for j in range(40):
        target = int(rng.integers(n))
        cos = _Partition.exact_floor + 0.05 + 0.3 * j / 40
        for q in (_near(rng, live[target], cos), _unit(rng, 1)[0]):
            got = cache.nearest(probe, q, now=1)
            sims = live @ q
            assert got.entry is not None and got.similarity is not None
            # The similarity reported is the exact one of the returned entry...
            assert got.similarity == pytest.approx(float(sims[got.entry.row]), abs=1e-5)
            assert got.similarity <= float(sims.max()) + 1e-6
            # ...and the returned entry is the true best whenever that is >= the floor
            # (always, below exact_max).
            if sims.max() >= _Partition.exact_floor or n <= exact_max:
                assert got.entry.row == int(np.argmax(sims))
        assert cache.nearest(probe, live[target], now=1).entry is part.entries[target]


def test_large_partition_search_when_the_bound_admits_many(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A query inside a dense cluster: the floor's bound alone admits more than a
    shortlist of codes (the path that skips finding the shortlist-th code); the result
    is still the brute-force best. A query far from everything takes the other path."""
    monkeypatch.setattr(_Partition, "exact_max", 64)
    rng = np.random.default_rng(11)
    cache = ResponseCache(100_000, 1 << 40)
    center = _unit(rng, 1)[0]
    vecs = np.vstack([np.stack([_near(rng, center, 0.85) for _ in range(300)]), _unit(rng, 1500)])
    for i, v in enumerate(vecs):
        cache.store(_query_keys(f"c{i}"), b"{}", v, ttl_s=100, now=0)
    (part,) = cache._partitions.values()
    probe = _query_keys("probe")
    for q, many in ((_near(rng, center, 0.9), True), (_unit(rng, 1)[0], False)):
        bits = np.unpackbits(part.codes[: len(vecs)] ^ part._code(q), axis=1).sum(axis=1)
        assert (int((bits <= part._cut()).sum()) >= part.shortlist) is many
        got = cache.nearest(probe, q, now=1)
        sims = part.matrix[: len(vecs)] @ q
        assert got.entry is not None and got.similarity is not None
        assert got.similarity == pytest.approx(float(sims[got.entry.row]), abs=1e-5)
        # Exact above the floor; below it, the best of the 32 nearest codes.
        if many:
            assert got.entry.row == int(np.argmax(sims))
        else:
            near = np.argsort(bits, kind="stable")[: part.shortlist]
            assert bits[got.entry.row] <= bits[near[-1]]
            assert got.similarity >= float(sims[near].max()) - 1e-5


def test_cacheability_rules() -> None:
    cfg = CacheConfig(enabled=True, max_temperature=0.7, personalized_tenants=["p"])
    body = {"messages": MSGS, "temperature": 0}
    assert cacheability(_req(body), "chat.completions", None, "t", "m", cfg).lookup
    assert not cacheability(_req(body), "chat.completions", "no-store", "t", "m", cfg).store
    nc = cacheability(_req(body), "chat.completions", "no-cache", "t", "m", cfg)
    assert not nc.lookup and nc.store
    assert not cacheability(
        _req({**body, "temperature": 0.9}), "chat.completions", None, "t", "m", cfg
    ).store
    assert not cacheability(_req(body), "chat.completions", None, "p", "m", cfg).store
    assert not cacheability(
        _req({**body, "tools": [{}]}), "chat.completions", None, "t", "m", cfg
    ).store
    ids = cacheability(_req({**body, "return_token_ids": True}), "completions", None, "t", "m", cfg)
    assert not ids.lookup and not ids.store and "token ids" in ids.reason
    assert cacheability(
        _req({**body, "return_token_ids": False}), "completions", None, "t", "m", cfg
    ).store
    # the same question about another picture is another question
    picture = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    with_image = {
        **body,
        "messages": [
            MSGS[0],
            {"role": "user", "content": [{"type": "text", "text": "what?"}, picture]},
        ],
    }
    verdict = cacheability(_req(with_image), "chat.completions", None, "t", "m", cfg)
    assert not verdict.lookup and not verdict.store and "images" in verdict.reason
    tool_reply = {
        "choices": [{"message": {"tool_calls": [{"id": "1"}]}, "finish_reason": "tool_calls"}]
    }
    assert storable_reply(tool_reply) == "the reply calls tools"
    assert (
        storable_reply({"choices": [{"message": {"content": "hi"}, "finish_reason": "stop"}]})
        is None
    )


# -- through the gateway ------------------------------------------------------------------


@pytest.fixture(scope="module")
def gw(scripted: Scripted) -> Iterator[Gateway]:
    url = scripted.url + "/v1"
    g = start_gateway(
        {
            "models": [
                {
                    "alias": "m",
                    "revision": "r1",
                    "engine": {"kind": "openai", "base_url": url},
                    "resilience": {"retries": 0},
                },
                {"alias": "shadowed", "engine": {"kind": "openai", "base_url": url}},
            ],
            "cache": {
                "enabled": True,
                "threshold": 0.80,
                "models": {"shadowed": {"mode": "shadow"}},
                # In place of the shipped classes (this module checks those in process):
                # the semantic tests here ask an account question.
                "risk": {
                    "classes": {
                        "billing": {"policy": "exact_only", "terms": ["receipt"]},
                        "live": {"policy": "off", "terms": ["right now"]},
                    },
                    "tags": {"volatile": "off"},
                },
            },
            "pii": {"mode": "observe_only"},
        }
    )
    yield g
    g.proc.stop()


def _ask(
    gw: Gateway, text: str, key: str | None = None, model: str = "m", **kw: Any
) -> httpx.Response:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": text}],
        "temperature": 0,
        "max_tokens": 8,
        **kw.pop("body", {}),
    }
    headers = {"Authorization": f"Bearer {key or gw.key}", **kw.pop("headers", {})}
    return httpx.post(gw.url + "/v1/chat/completions", json=body, headers=headers, timeout=60)


def test_exact_then_semantic_hit_and_negation_veto(gw: Gateway, scripted: Scripted) -> None:
    first = _ask(gw, "How do I reset my password?")
    assert first.headers["x-switchyard-cache"] == "miss"
    n = scripted.requests()
    again = _ask(gw, "How do I reset my password?", headers={"x-request-id": "exact-1"})
    assert again.headers["x-switchyard-cache"] == "hit-exact"
    assert again.json()["choices"] == first.json()["choices"]
    para = _ask(gw, "How can I reset my password?", headers={"x-request-id": "para-1"})
    assert para.headers["x-switchyard-cache"] == "hit-semantic"
    # An exact hit needs no vector, so it is not embedded; the paraphrase is.
    for request_id, outcome in (("exact-1", "skip"), ("para-1", "ok")):
        rec = httpx.get(gw.url + f"/admin/requests/{request_id}", headers=gw.admin).json()
        embed = next(d for d in rec["decisions"] if d["stage"] == "embed")
        assert embed["outcome"] == outcome, embed
    assert float(para.headers["x-switchyard-cache-similarity"]) >= 0.80
    assert scripted.requests() == n  # neither hit reached the upstream
    neg = _ask(gw, "How do I not reset my password?")
    assert neg.headers["x-switchyard-cache"] == "miss"
    assert scripted.requests() == n + 1


def test_the_same_question_misspelt_is_served_below_the_threshold(
    gw: Gateway, scripted: Scripted
) -> None:
    """A typo can drop the cosine far below the threshold ("contintents" puts this
    repeat near 0.35): the same words once misspellings are respelt are put to the
    checks anyway, which pass them; a different question at that cosine is not."""
    first = _ask(gw, "How many continents are there on Earth?")
    assert first.headers["x-switchyard-cache"] == "miss"
    n = scripted.requests()
    typo = _ask(gw, "how many contintents are there on earth", headers={"x-request-id": "typo-1"})
    assert typo.headers["x-switchyard-cache"] == "hit-semantic"
    assert float(typo.headers["x-switchyard-cache-similarity"]) < 0.80
    rec = httpx.get(gw.url + "/admin/requests/typo-1", headers=gw.admin).json()
    cache = next(d for d in rec["decisions"] if d["stage"] == "cache")
    assert cache["evidence"]["same_question"] is True
    assert cache["evidence"]["verifier"].endswith("(the same words once respelt)")
    assert scripted.requests() == n
    other = _ask(gw, "How many oceans are there on Earth?")
    assert other.headers["x-switchyard-cache"] == "miss"


def test_a_lone_request_embeds_inline_and_concurrent_ones_use_the_worker(
    gw: Gateway, scripted: Scripted
) -> None:
    def embed_path(request_id: str) -> str:
        rec = httpx.get(gw.url + f"/admin/requests/{request_id}", headers=gw.admin).json()
        return str(next(d for d in rec["decisions"] if d["stage"] == "embed")["evidence"]["path"])

    _ask(gw, "Is the lone request inline?", headers={"x-request-id": "lone-1"})
    assert embed_path("lone-1") == "inline"
    scripted.fault("delay:300", count=4)  # keeps the four requests in flight together
    texts = ["Where is my parcel", "Which plan fits a team", "Can I pay by invoice", "Why so slow"]
    with ThreadPoolExecutor(4) as pool:
        replies = list(
            pool.map(
                lambda i: _ask(gw, texts[i] + "?", headers={"x-request-id": f"conc-{i}"}),
                range(4),
            )
        )
    assert [r.status_code for r in replies] == [200] * 4
    paths = [embed_path(f"conc-{i}") for i in range(4)]
    assert paths.count("worker") >= 3, paths  # at most the first one was alone
    # One refused for a bad header is counted out again too.
    bad = _ask(gw, "A bad header", headers={"x-request-timeout": "soon"})
    assert bad.status_code == 400
    # Every request was counted out again: the next lone one is inline.
    _ask(gw, "Is the next lone request inline?", headers={"x-request-id": "lone-2"})
    assert embed_path("lone-2") == "inline"
    # The same last message after other turns (another partition, so no exact hit),
    # as in an agent loop: its vector comes from the memo, no forward pass.
    earlier = [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Hi"}]
    body = {"messages": [*earlier, {"role": "user", "content": "Is the lone request inline?"}]}
    again = _ask(gw, "", body=body, headers={"x-request-id": "lone-3"})
    assert again.headers["x-switchyard-cache"] == "miss"
    assert embed_path("lone-3") == "memo"


def test_other_tenant_never_hits(gw: Gateway) -> None:
    _ask(gw, "Which plan includes priority support?")
    assert (
        _ask(gw, "Which plan includes priority support?").headers["x-switchyard-cache"]
        == "hit-exact"
    )
    gw.create_tenant("cache-b")
    key_b = gw.create_key("cache-b")["key"]
    assert (
        _ask(gw, "Which plan includes priority support?", key=key_b).headers["x-switchyard-cache"]
        == "miss"
    )


def test_errors_and_partial_streams_are_not_stored(gw: Gateway, scripted: Scripted) -> None:
    scripted.fault("status:500", count=1)
    assert _ask(gw, "What does error E42 mean?").status_code == 502
    assert _ask(gw, "What does error E42 mean?").headers["x-switchyard-cache"] == "miss"
    scripted.fault("drop-mid-stream", count=1)
    with gw.stream(
        {
            "model": "m",
            "messages": [{"role": "user", "content": "Stream me a story"}],
            "temperature": 0,
            "max_tokens": 8,
            "stream": True,
        }
    ) as r:
        "".join(r.iter_text())
    assert _ask(gw, "Stream me a story").headers["x-switchyard-cache"] == "miss"


def test_no_store_and_no_cache(gw: Gateway, scripted: Scripted) -> None:
    r = _ask(gw, "Tell me about no-store", headers={"Cache-Control": "no-store"})
    assert r.headers["x-switchyard-cache"] == "bypass"
    assert _ask(gw, "Tell me about no-store").headers["x-switchyard-cache"] == "miss"
    _ask(gw, "Tell me about no-cache")
    n = scripted.requests()
    r = _ask(gw, "Tell me about no-cache", headers={"Cache-Control": "no-cache"})
    assert r.headers["x-switchyard-cache"] == "bypass" and scripted.requests() == n + 1
    assert _ask(gw, "Tell me about no-cache").headers["x-switchyard-cache"] == "hit-exact"


def test_stream_hit_replays_as_sse(gw: Gateway) -> None:
    plain = _ask(gw, "Replay this as a stream")
    text = plain.json()["choices"][0]["message"]["content"]
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": "Replay this as a stream"}],
        "temperature": 0,
        "max_tokens": 8,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with gw.stream(body) as r:
        assert r.headers["x-switchyard-cache"] == "hit-exact"
        events = [e for e in "".join(r.iter_text()).split("\n\n") if e]
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e[6:]) for e in events[:-1]]
    content = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert content == text
    assert chunks[-1]["usage"] is not None


def test_shadow_mode_calls_the_model_and_records_agreement(gw: Gateway, scripted: Scripted) -> None:
    _ask(gw, "Where is my parcel?", model="shadowed")
    n = scripted.requests()
    r = _ask(gw, "Where is my parcel?", model="shadowed", headers={"x-request-id": "shadow-1"})
    assert r.headers["x-switchyard-cache"] == "shadow-hit"
    assert scripted.requests() == n + 1
    rec = httpx.get(gw.url + "/admin/requests/shadow-1", headers=gw.admin).json()
    shadow = next(d for d in rec["decisions"] if d["stage"] == "cache_shadow")
    assert shadow["evidence"]["answer_similarity"] == pytest.approx(1.0, abs=1e-3)


def test_shadow_evidence_of_a_false_hit_raises_the_partitions_threshold(
    gw: Gateway, scripted: Scripted
) -> None:
    scripted.content("Open Settings, choose Security, then Reset password and follow the link.")
    try:
        _ask(gw, "How do I reset my password?", model="shadowed")
        # A rewording the checks let through, whose fresh answer disagrees.
        scripted.content("Your parcel left our warehouse on Monday and arrives on Thursday.")
        r = _ask(
            gw, "How can I reset my password?", model="shadowed", headers={"x-request-id": "sf-1"}
        )
        assert r.headers["x-switchyard-cache"] == "shadow-hit"
        rec = httpx.get(gw.url + "/admin/requests/sf-1", headers=gw.admin).json()
        shadow = next(d for d in rec["decisions"] if d["stage"] == "cache_shadow")
        moved = shadow["evidence"]["partition_threshold"]
        prompt = shadow["evidence"]["prompt_similarity"]
        assert shadow["evidence"]["answer_similarity"] < 0.8
        assert moved["change"] == "raised"
        assert moved["threshold"] == pytest.approx(min(prompt + 0.01, 0.88), abs=1e-3)
        # The next lookup in that partition uses the raised threshold, and says so.
        _ask(
            gw,
            "How should I reset my password?",
            model="shadowed",
            headers={"x-request-id": "sf-2"},
        )
        rec = httpx.get(gw.url + "/admin/requests/sf-2", headers=gw.admin).json()
        cache = next(d for d in rec["decisions"] if d["stage"] == "cache")
        assert cache["evidence"]["threshold"] == pytest.approx(moved["threshold"], abs=1e-3)
        assert cache["evidence"]["configured_threshold"] == 0.80
        stats = httpx.get(gw.url + "/admin/cache/stats", headers=gw.admin).json()
        assert stats["raised_partitions"] >= 1
        assert "cross-encoder" in stats["semantic_checks"]
    finally:
        scripted.content(None)


def test_risk_classes_exact_only_never_serves_a_semantic_hit_and_off_never_caches(
    gw: Gateway, scripted: Scripted
) -> None:
    first = _ask(gw, "Where do I download the receipt for March?")
    assert first.headers["x-switchyard-cache"] == "miss"
    n = scripted.requests()
    # A paraphrase that the semantic cache would serve (0.80, the verifier agrees) is a
    # miss: billing questions are exact only. The exact repeat still hits.
    para = _ask(
        gw, "Where can I download the receipt for March?", headers={"x-request-id": "risk-1"}
    )
    assert para.headers["x-switchyard-cache"] == "miss"
    assert scripted.requests() == n + 1
    rec = httpx.get(gw.url + "/admin/requests/risk-1", headers=gw.admin).json()
    cache = next(d for d in rec["decisions"] if d["stage"] == "cache")
    assert cache["evidence"]["risk"] == "class:billing"
    assert cache["evidence"]["risk_policy"] == "exact_only"
    embed = next(d for d in rec["decisions"] if d["stage"] == "embed")
    assert embed["outcome"] == "skip" and "class:billing" in embed["reason"]
    again = _ask(gw, "Where do I download the receipt for March?")
    assert again.headers["x-switchyard-cache"] == "hit-exact"
    # Off: never looked up, never stored; by content and by tag.
    for text, headers in (
        ("What is the queue length right now?", {}),
        ("Which plan has the volatile discount?", {"x-switchyard-cache-tags": "volatile"}),
    ):
        for _ in range(2):
            r = _ask(gw, text, headers=headers)
            assert r.headers["x-switchyard-cache"] == "bypass", r.headers
    assert scripted.requests() == n + 1 + 4


def test_the_shipped_risk_classes() -> None:
    from switchyard.config import CacheRisk
    from switchyard.decide.risk import RiskClassifier

    risk = RiskClassifier(CacheRisk())
    cases = {
        "What's the weather in Lisbon today?": ("off", "class:live_data"),
        "What is the latest exchange rate for the yen?": ("off", "class:live_data"),
        "How do I reset my password?": ("exact_only", "class:account"),
        "Why was I charged twice?": ("exact_only", "class:payment"),
        "My card <CARD_1> was refused": ("exact_only", "class:payment"),
        "What dosage of ibuprofen is safe for a child?": ("exact_only", "class:medical"),
        "What is the capital of France?": ("semantic", None),
        "How do I export a CSV from the dashboard?": ("semantic", None),
        "Is myaccount.example a phishing site?": ("semantic", None),  # whole words only
    }
    for text, (policy, source) in cases.items():
        got = risk.classify(text, "m", ())
        assert (got.policy, got.source) == (policy, source), (text, got)
    # The strictest rule wins: a model rule, a tag rule, then the content classes.
    strict = RiskClassifier(CacheRisk(models={"m": "exact_only"}, tags={"t": "off"}))
    assert strict.classify("What is the capital of France?", "m", ()).source == "model:m"
    assert strict.classify("How do I reset my password?", "m", ("t",)).policy == "off"
    assert strict.classify("What's the weather today?", "m", ()).source == "class:live_data"
    assert (
        RiskClassifier(CacheRisk(classes={})).classify("my password today", "m", ()).source is None
    )


def test_invalidation_over_admin_api_with_dry_run(gw: Gateway) -> None:
    _ask(gw, "Invalidate me please")
    keys = httpx.get(gw.url + "/admin/keys", headers=gw.admin).json()["data"]
    tenant = next(k["tenant_id"] for k in keys if k["prefix"] == gw.key[:10])
    dry = httpx.post(
        gw.url + "/admin/cache/invalidate",
        json={"tenant": tenant, "dry_run": True},
        headers=gw.admin,
    )
    assert dry.status_code == 200 and dry.json()["matched"] >= 1 and dry.json()["removed"] == 0
    assert _ask(gw, "Invalidate me please").headers["x-switchyard-cache"] == "hit-exact"
    done = httpx.post(gw.url + "/admin/cache/invalidate", json={"tenant": tenant}, headers=gw.admin)
    assert done.json()["removed"] == dry.json()["matched"]
    assert _ask(gw, "Invalidate me please").headers["x-switchyard-cache"] == "miss"


PII = {
    "email": "jane.doe@example.org",
    "phone": "+1 415 555 0132",
    "card": "4111 1111 1111 1111",
    "iban": "DE89 3704 0044 0532 0130 00",
    "ssn": "123-45-6789",
    "kr_rrn": "900101-1234568",
    "ip": "203.0.113.77",
    "secret": "sk-live-9f8e7d6c5b4a39281706f5e4d3c2b1a0",
}


def test_no_raw_pii_in_cache_keys_traces_or_logs(gw: Gateway) -> None:
    for kind, value in PII.items():
        r = _ask(
            gw,
            f"My {kind} is {value}, please update my profile",
            headers={"x-request-id": f"pii-{kind}"},
        )
        assert r.status_code == 200
        rec = httpx.get(gw.url + f"/admin/requests/pii-{kind}", headers=gw.admin).json()
        pii = next(d for d in rec["decisions"] if d["stage"] == "pii")
        assert pii["outcome"] == "observed" and sum(pii["evidence"]["found"].values()) >= 1, (
            kind,
            pii,
        )
    raw_db = b"".join(p.read_bytes() for p in Path(gw.db).parent.glob("*") if p.is_file())
    conn = sqlite3.connect(gw.db)
    dump = "\n".join(conn.iterdump())
    logs = gw.proc.output()
    for value in PII.values():
        assert value not in dump and value.encode() not in raw_db
        assert value not in logs


def test_an_idempotent_request_answered_from_the_cache_replays_that_answer(
    gw: Gateway, scripted: Scripted
) -> None:
    text = "Which port does the gateway listen on by default?"
    assert _ask(gw, text).headers["x-switchyard-cache"] == "miss"
    hit = _ask(gw, text, headers={"Idempotency-Key": "cached-idem-1"})
    assert hit.status_code == 200 and hit.headers["x-switchyard-cache"] == "hit-exact"
    n = scripted.requests()
    again = _ask(gw, text, headers={"Idempotency-Key": "cached-idem-1"})
    assert again.headers.get("x-switchyard-idempotent-replay") == "true"
    assert again.json()["choices"] == hit.json()["choices"]
    assert scripted.requests() == n
