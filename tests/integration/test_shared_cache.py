"""The response cache shared by gateway processes through Redis (state/cache_redis.py):
the packed form, the raced-invalidation and resync rules against a real redis-server,
and two (then three) real gateways on one Redis and one store."""

from __future__ import annotations

import asyncio
import tempfile
import time
from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import pytest
import redis
from hypothesis import given, settings
from hypothesis import strategies as st

from support.gateways import Gateway, start_gateway
from support.redis_server import start_redis, stop_redis
from support.upstreams import Scripted
from switchyard.config import ShadowFeedback
from switchyard.decide.cache import CacheKeys, Entry, ResponseCache, cache_keys
from switchyard.decide.shadow_threshold import PartitionThresholds
from switchyard.request import Generation, from_object
from switchyard.state.cache_redis import SharedCache, pack, unpack

_text = st.text(max_size=40)


def _req(body: dict[str, Any]) -> Generation:
    """The typed request of a body (its model need not matter here)."""
    req: Generation = from_object(Generation, {"model": "m", **body})[0]
    return req


@settings(max_examples=200, deadline=None)
@given(
    keys=st.builds(
        CacheKeys, _text, _text, _text, st.lists(_text, max_size=3).map(tuple), _text, _text
    ),
    body=st.binary(max_size=300),
    dim=st.sampled_from([0, 1, 3, 384]),
    created=st.floats(0, 2e9),
    ttl=st.floats(0.001, 1e6),
    seed=st.integers(0, 2**32 - 1),
)
def test_pack_unpack_round_trips(
    keys: CacheKeys, body: bytes, dim: int, created: float, ttl: float, seed: int
) -> None:
    vec = np.random.default_rng(seed).standard_normal(dim).astype(np.float32) if dim else None
    entry = Entry(keys, body, created, created + ttl, 0)
    got = unpack(pack("origin-1", entry, vec))
    assert got is not None
    h, k, v, b = got
    assert (k, b, h["origin"], h["created"], h["expires"]) == (
        keys,
        body,
        "origin-1",
        created,
        created + ttl,
    )
    assert (v is None) == (vec is None)
    if vec is not None:
        assert v is not None and np.array_equal(v, vec)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_unpack_refuses_what_is_not_an_entry(raw: bytes) -> None:
    """Whatever sits under a key or on the channel, unpack answers an entry or None."""
    got = unpack(raw)
    assert got is None or isinstance(got[1], CacheKeys)
    assert unpack(b"\x00\x00\x00\x05hello") is None
    assert unpack(b"\x00\x00\xff\xff{}") is None


@pytest.fixture()
def redis_url() -> Iterator[str]:
    proc, url = start_redis()
    yield url
    stop_redis(proc)


def _keys(text: str, tenant: str = "t1") -> CacheKeys:
    body = {"messages": [{"role": "user", "content": text}]}
    return cache_keys(_req(body), "chat.completions", tenant, tenant, "m", "r1", None, None)


def _vec(seed: int) -> np.ndarray:
    v = np.random.default_rng(seed).standard_normal(8).astype(np.float32)
    return v / np.linalg.norm(v)


async def _until(cond: Any, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s  # a hang guard, not a timing claim
    while not cond():
        assert time.monotonic() < deadline, "not propagated"
        await asyncio.sleep(0.01)


def test_stores_and_invalidations_reach_the_other_index(redis_url: str) -> None:
    async def run() -> None:
        a, b = ResponseCache(100, 1 << 20), ResponseCache(100, 1 << 20)
        sa, sb = SharedCache(a, redis_url, 2.0), SharedCache(b, redis_url, 2.0)
        listeners = [asyncio.create_task(s.listen()) for s in (sa, sb)]
        await _until(lambda: sa.subscribed.is_set() and sb.subscribed.is_set())
        k1, k2 = _keys("one"), _keys("two", tenant="t2")
        for k, seed in ((k1, 1), (k2, 2)):
            assert await sa.put(a.store(k, b'{"x": 1}', _vec(seed), 60), _vec(seed))
        await _until(lambda: len(b) == 2)
        found = b.nearest(k1, _vec(1))
        assert found.entry is not None and found.entry.body == b'{"x": 1}'
        assert found.similarity == pytest.approx(1.0, abs=1e-6)

        out = await sb.invalidate({"tenant": "t1"}, dry_run=True)
        assert out["matched"] == 1 and out["removed"] == 0
        b.invalidate(tenant="t1")
        assert (await sb.invalidate({"tenant": "t1"}, dry_run=False))["removed"] == 1
        await _until(lambda: a.entry(k1.exact) is None)
        assert a.entry(k2.exact) is not None  # the other tenant's entry stays
        client = redis.Redis.from_url(redis_url)
        assert client.exists(sa._key(k1.exact)) == 0 and client.exists(sa._key(k2.exact)) == 1

        # A store that raced with the invalidation (made before it, published after
        # its scan) is dropped on arrival and deleted from Redis.
        late = Entry(k1, b"{}", time.time() - 5, time.time() + 60, 0)
        client.set(sa._key(k1.exact), pack("elsewhere", late, _vec(1)), px=60_000)
        sb.apply(b"P" + pack("elsewhere", late, _vec(1)))
        assert b.entry(k1.exact) is None
        await _until(lambda: client.exists(sa._key(k1.exact)) == 0)
        # One made after the invalidation arrives as usual.
        fresh = Entry(k1, b"{}", time.time(), time.time() + 60, 0)
        sb.apply(b"P" + pack("elsewhere", fresh, _vec(1)))
        assert b.entry(k1.exact) is not None

        # A resync (after a reconnect) drops what Redis lost and loads what it has.
        client.delete(sa._key(k2.exact))
        k3 = _keys("three")
        e3 = Entry(k3, b"{}", time.time(), time.time() + 60, 0)
        client.set(sa._key(k3.exact), pack("elsewhere", e3, None), px=60_000)
        await sa.resync()
        assert a.entry(k2.exact) is None and a.entry(k3.exact) is not None
        client.close()
        for t in listeners:
            t.cancel()
        for s in (sa, sb):
            await s.close()

    asyncio.run(run())


def test_a_partitions_moved_threshold_reaches_every_process(redis_url: str) -> None:
    """Shadow evidence in one process raises a partition's threshold (then lowers it):
    the other process uses the same threshold, and one that starts later catches up."""

    async def run() -> tuple[list[float], float]:
        cfg = ShadowFeedback(step=0.01, max_raise=0.08, lower_after=1)
        caches = [
            ResponseCache(100, 1 << 20, thresholds=PartitionThresholds(cfg)) for _ in range(2)
        ]
        shares = [SharedCache(c, redis_url, 2.0, prefix="thr:") for c in caches]
        listeners = [asyncio.create_task(s.listen()) for s in shares]
        await _until(lambda: all(s.subscribed.is_set() for s in shares))
        a, b = caches
        ta, tb = a.thresholds, b.thresholds
        assert ta is not None and tb is not None
        seen = []
        moved = ta.observe("p1", 0.9, 0.93, 0.1)  # a false hit at 0.93: raised to 0.94
        assert moved["change"] == "raised"
        await shares[0].threshold_moved("p1", ta.raised("p1"))
        await _until(lambda: tb.threshold("p1", 0.9) == ta.threshold("p1", 0.9))
        seen.append(tb.threshold("p1", 0.9))
        moved = ta.observe("p1", 0.9, 0.95, 0.99)  # an agreeing would-be hit: lowered
        assert moved["change"] == "lowered"
        await shares[0].threshold_moved("p1", ta.raised("p1"))
        await _until(lambda: tb.threshold("p1", 0.9) == ta.threshold("p1", 0.9))
        seen.append(tb.threshold("p1", 0.9))
        late = ResponseCache(100, 1 << 20, thresholds=PartitionThresholds(cfg))
        late_share = SharedCache(late, redis_url, 2.0, prefix="thr:")
        await late_share.resync()
        assert late.thresholds is not None
        caught_up = late.thresholds.threshold("p1", 0.9)
        for t in listeners:
            t.cancel()
        for s in [*shares, late_share]:
            await s.close()
        return seen, caught_up

    seen, caught_up = asyncio.run(run())
    assert seen == [pytest.approx(0.94), pytest.approx(0.93)]
    assert caught_up == pytest.approx(0.93)


def test_redis_down_keeps_stores_local(redis_url: str) -> None:
    async def run() -> None:
        cache = ResponseCache(100, 1 << 20)
        share = SharedCache(cache, "redis://127.0.0.1:1/0", 0.2)
        k = _keys("alone")
        assert await share.put(cache.store(k, b"{}", None, 60), None) is False
        assert cache.entry(k.exact) is not None and share.errors == 1
        await share.close()

    asyncio.run(run())


# -- through real gateways -------------------------------------------------------------


def _ask(gw: Gateway, text: str) -> httpx.Response:
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": text}],
        "temperature": 0,
        "max_tokens": 8,
    }
    return gw.post("/v1/chat/completions", json=body)


def _shared(gw: Gateway) -> dict[str, Any]:
    stats = httpx.get(gw.url + "/admin/cache/stats", headers=gw.admin, timeout=10).json()
    return {"entries": stats["entries"], **stats["shared"]}


def _wait(gw: Gateway, cond: Any) -> None:
    deadline = time.monotonic() + 10  # hang guard
    while not cond(_shared(gw)):
        assert time.monotonic() < deadline, _shared(gw)
        time.sleep(0.02)


def test_two_gateways_share_hits_and_invalidations(scripted: Scripted) -> None:
    redis_proc, url = start_redis()
    db = tempfile.mkdtemp(prefix="switchyard-db-") + "/switchyard.db"  # one store
    config = {
        "models": [
            {
                "alias": "m",
                "engine": {"kind": "openai", "base_url": scripted.url + "/v1"},
                "resilience": {"retries": 0},
            }
        ],
        # No content risk classes: this is about sharing (the password question would
        # be an exact-only account question by default).
        "cache": {"enabled": True, "threshold": 0.80, "risk": {"classes": {}}},
        "storage": {"redis_url": url, "redis_timeout_s": 3},
    }
    gws: list[Gateway] = []
    try:
        a = start_gateway(config, db=db)
        gws.append(a)
        b = start_gateway(config, db=db)
        gws.append(b)
        b.key = a.key  # the same tenant: a cache partition is per tenant
        _wait(b, lambda s: s["subscribed"])

        first = _ask(a, "How do I reset my password?")
        assert first.headers["x-switchyard-cache"] == "miss"
        calls = scripted.requests()
        _wait(b, lambda s: s["entries"] == 1)
        exact = _ask(b, "How do I reset my password?")
        assert exact.headers["x-switchyard-cache"] == "hit-exact"
        assert exact.json()["choices"] == first.json()["choices"]
        para = _ask(b, "How can I reset my password?")
        assert para.headers["x-switchyard-cache"] == "hit-semantic"
        assert scripted.requests() == calls  # neither reached the upstream

        # A gateway started later loads what Redis holds.
        c = start_gateway(config, db=db)
        gws.append(c)
        c.key = a.key
        _wait(c, lambda s: s["subscribed"] and s["entries"] == 1)
        assert _ask(c, "How do I reset my password?").headers["x-switchyard-cache"] == "hit-exact"

        tenant = httpx.get(b.url + "/admin/keys", headers=b.admin).json()["data"]
        tenant_id = next(k["tenant_id"] for k in tenant if k["prefix"] == a.key[:10])
        done = httpx.post(
            b.url + "/admin/cache/invalidate", json={"tenant": tenant_id}, headers=b.admin
        )
        assert done.status_code == 200, done.text
        assert done.json()["removed"] == 1 and done.json()["shared"]["removed"] == 1
        for g in (a, c):
            _wait(g, lambda s: s["entries"] == 0)
        assert _ask(a, "How do I reset my password?").headers["x-switchyard-cache"] == "miss"
        assert scripted.requests() == calls + 1

        # Redis gone: an invalidation says it did not reach every process.
        stop_redis(redis_proc)
        r = httpx.post(
            b.url + "/admin/cache/invalidate", json={"tenant": tenant_id}, headers=b.admin
        )
        assert r.status_code == 503, r.text
        assert r.json()["error"]["code"] == "shared_state_unavailable"
        assert "Traceback" not in r.text and r.headers["retry-after"] == "2"
    finally:
        for g in gws:
            g.proc.stop()
        stop_redis(redis_proc)
