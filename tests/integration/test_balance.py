"""Several deployments per model alias (models[].deployments): the balancer on its own
(decide/balance.py, with real Deployments from a real Registry), then through a real
gateway in front of two scripted upstreams speaking HTTP."""

from __future__ import annotations

import collections
import concurrent.futures
import json
import random
import subprocess
import sys
import time
from typing import Any

import httpx
import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from support.gateways import Gateway, start_gateway
from support.upstreams import Scripted
from switchyard.config import ConfigError, Settings, parse_settings
from switchyard.decide.balance import Balancer, affinity_key, prompt_prefix
from switchyard.engines.registry import Deployment, Registry
from switchyard.request import Generation
from switchyard.state.breakers_memory import CircuitBreaker


def _model(strategy: str, deployments: list[dict[str, Any]], **balance: Any) -> dict[str, Any]:
    return {
        "alias": "chat",
        "revision": "r1",
        "deployments": deployments,
        "balance": {"strategy": strategy, **balance},
    }


def _remote(name: str, **kw: Any) -> dict[str, Any]:
    return {"name": name, "engine": {"kind": "openai", "base_url": f"http://{name}.invalid"}, **kw}


def _balancer(
    strategy: str, deployments: list[dict[str, Any]], seed: int = 7, **balance: Any
) -> tuple[Balancer, dict[str, Deployment], dict[str, CircuitBreaker]]:
    s = Settings.model_validate({"models": [_model(strategy, deployments, **balance)]})
    reg = Registry(s)
    deps = reg.replicas["chat"]
    breakers = {d.name: CircuitBreaker(d.name, d.model.resilience.breaker) for d in deps}
    b = Balancer("chat", deps, s.models[0].balance, breakers, random.Random(seed))
    return b, {d.replica.name: d for d in deps if d.replica is not None}, breakers


def _pick(b: Balancer, **kw: Any) -> tuple[Deployment, str, dict[str, Any]]:
    """One request, chosen and settled at once (nothing stays in flight)."""
    d, why, ev = b.choose(**kw)
    b.settled(d, None, None)
    return d, why, ev


@pytest.mark.parametrize(
    "weights", [[1.0, 1.0], [1.0, 3.0], [5.0, 3.0, 2.0], [95.0, 5.0], [2.0, 0.0, 2.0]]
)
def test_the_weighted_split_is_within_three_points_of_the_weights(weights: list[float]) -> None:
    b, _, _ = _balancer("weighted", [_remote(f"d{i}", weight=w) for i, w in enumerate(weights)])
    counts = collections.Counter(_pick(b)[0].replica.name for _ in range(2000))  # type: ignore[union-attr]
    total = sum(weights)
    for i, w in enumerate(weights):
        share = counts[f"d{i}"] / 2000
        assert abs(share - w / total) <= 0.03, (weights, counts)
    if 0.0 in weights:
        assert counts[f"d{weights.index(0.0)}"] == 0


def test_a_task_stays_on_one_deployment_and_tenants_do_not_share_tasks() -> None:
    b, _, _ = _balancer("weighted", [_remote("a"), _remote("b"), _remote("c")])
    where: dict[tuple[str, str], set[str]] = collections.defaultdict(set)
    rng = random.Random(3)
    for _ in range(600):
        tenant, task = rng.choice(["t1", "t2"]), f"task-{rng.randrange(30)}"
        d, why, ev = _pick(b, tenant=tenant, affinity=("task", task))
        where[(tenant, task)].add(d.name)
    assert all(len(v) == 1 for v in where.values()), where
    # The same task id of two tenants is two tasks: over 30 ids, some land apart.
    assert any(where[("t1", f"task-{i}")] != where[("t2", f"task-{i}")] for i in range(30))
    d, why, ev = _pick(b, tenant="t1", affinity=("task", "task-0"))
    assert ev["affinity"] == {"kind": "task", "outcome": "kept"} and why.startswith("affinity")


def test_affinity_yields_to_an_open_breaker_and_to_load() -> None:
    b, deps, breakers = _balancer("least_outstanding", [_remote("a"), _remote("b")])
    first, _, _ = _pick(b, tenant="t", affinity=("session", "s1"))
    other = next(d for d in deps.values() if d is not first)
    br = breakers[first.name]
    for _ in range(br.cfg.min_requests + 1):  # enough failures to open it
        br.record(False, time.monotonic())
    assert br.state == "open"
    d, _why, ev = _pick(b, tenant="t", affinity=("session", "s1"))
    assert d is other
    assert ev["affinity"]["outcome"] == "yielded" and "circuit open" in ev["affinity"]["why"]
    assert ev["candidates"][first.name]["skipped"].startswith("circuit open")
    # Load: concurrent requests of one session (none settled) stay together until
    # their deployment holds more than 1.5 x the average (rounded up).
    b2, _, _ = _balancer("least_outstanding", [_remote("a"), _remote("b")])
    got = [b2.choose(tenant="t", affinity=("session", "s2")) for _ in range(4)]
    outcomes = [ev["affinity"]["outcome"] for _, _, ev in got]
    assert outcomes == ["new", "kept", "kept", "yielded"], got
    assert "affinity bound" in got[3][2]["affinity"]["why"] and got[3][0] is not got[0][0]


def test_a_deployment_open_not_ready_or_outside_the_region_is_never_chosen() -> None:
    b, deps, breakers = _balancer(
        "weighted",
        [
            _remote("open"),
            {"name": "cold", "engine": {"kind": "llamacpp", "gguf": "/nonexistent.gguf"}},
            _remote("eu", region="eu"),
            _remote("us", region="us"),
        ],
    )
    br = breakers[deps["open"].name]
    for _ in range(br.cfg.min_requests + 1):
        br.record(False, time.monotonic())
    chosen = collections.Counter(_pick(b, regions=["us"])[0].replica.name for _ in range(300))  # type: ignore[union-attr]
    assert chosen == {"us": 300}
    _, _, ev = _pick(b, regions=["us"])
    c = ev["candidates"]
    assert c["chat/open"]["skipped"].startswith("circuit open")
    assert c["chat/cold"]["skipped"] == "not ready (engine stopped)"
    assert c["chat/eu"]["skipped"] == "region 'eu' is outside the allowed ['us']"
    assert "skipped" not in c["chat/us"]
    # None eligible: the first, with every reason, so the executor's refusal applies.
    d, why, ev = _pick(b, regions=["mars"])
    assert d is deps["open"] and why.startswith("no deployment is eligible")


def test_least_outstanding_prefers_fewer_in_flight() -> None:
    b, deps, _ = _balancer("least_outstanding", [_remote("a"), _remote("b")])
    for _ in range(5):
        deps["a"].live.in_flight += 1  # five requests still running on a
    picks = [b.choose()[0].replica.name for _ in range(5)]  # type: ignore[union-attr]
    assert picks == ["b"] * 5  # b has fewer until it also holds five


def test_latency_prefers_the_faster_probes_and_returns_after_recovery() -> None:
    b, _deps, _ = _balancer("latency", [_remote("a"), _remote("b")], probe=0.1, stale_s=1000)
    now = 1000.0
    speed = {"a": 0.5, "b": 0.1}

    def run(n: int) -> collections.Counter[str]:
        nonlocal now
        got: collections.Counter[str] = collections.Counter()
        for _ in range(n):
            now += 0.01
            d, _, _ = b.choose(now=now)
            name = d.replica.name  # type: ignore[union-attr]
            got[name] += 1
            b.settled(d, speed[name], 0.0, now=now)
        return got

    run(2)  # each is measured once (never measured: probed first)
    got = run(200)
    assert got["b"] > 160 and got["a"] > 0, got  # the probe share still measures a
    speed.update(a=0.05, b=0.6)  # a recovered, b slowed
    run(60)
    got = run(200)
    assert got["a"] > 160, got


def test_affinity_keys_come_from_the_task_then_the_session() -> None:
    assert affinity_key("t1", Generation(model="m", prompt_cache_key="k"), None) == (
        "task",
        "t1",
    )
    assert affinity_key(None, Generation(model="m", prompt_cache_key="k", user="u"), None) == (
        "session",
        "k",
    )
    assert affinity_key(None, Generation(model="m", user="u"), {"x-session-id": "s"}) == (
        "session",
        "s",
    )
    assert affinity_key(None, Generation(model="m", user="u"), {}) == ("session", "u")


@pytest.mark.parametrize(
    ("model", "needle"),
    [
        (_model("weighted", [_remote("a"), _remote("a")]), "duplicate name 'a'"),
        (_model("weighted", [_remote("a", weight=0)]), "every weight is 0"),
        (
            {
                **_model("weighted", [_remote("a", region="us")]),
                "data_boundary": ["eu"],
                "region": "eu",
            },
            "deployments[0] (a).region: 'us' is outside the model's data_boundary",
        ),
        (_model("fastest", [_remote("a")]), "balance.strategy"),
    ],
)
def test_bad_deployment_configs_name_the_key(model: dict[str, Any], needle: str) -> None:
    with pytest.raises(ConfigError) as exc:
        parse_settings({"models": [model]})
    assert needle in str(exc.value)


# -- through the gateway ---------------------------------------------------------------


def _gateway(two: tuple[Scripted, Scripted], strategy: str, **balance: Any) -> Gateway:
    a, b = two
    deps = [
        {
            "name": "a",
            "engine": {"kind": "openai", "base_url": a.url + "/v1"},
            "labels": {"z": "1"},
        },
        {"name": "b", "engine": {"kind": "openai", "base_url": b.url + "/v1"}},
    ]
    return start_gateway(
        {"models": [_model(strategy, deps, **balance)], "embeddings": {"enabled": False}}
    )


def _ask(gw: Gateway, **headers: str) -> httpx.Response:
    r = httpx.post(
        gw.url + "/v1/chat/completions",
        json={"model": "chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
        headers={"Authorization": f"Bearer {gw.key}", **headers},
        timeout=30,
    )
    assert r.status_code == 200, r.text
    return r


def _clear(two: tuple[Scripted, Scripted]) -> None:
    for s in two:
        httpx.put(s.url + "/control/fault", json={"fault": None})


def test_least_outstanding_sends_traffic_to_the_idle_deployment(
    two: tuple[Scripted, Scripted],
) -> None:
    a, _ = two
    _clear(two)
    gw = _gateway(two, "least_outstanding", affinity=False)
    try:
        a.fault("delay:1500", count=1000)  # a answers in 1.5 s, b at once
        with concurrent.futures.ThreadPoolExecutor(6) as ex:
            replies = list(ex.map(lambda _: _ask(gw), range(36)))
        served = collections.Counter(r.headers["x-switchyard-upstream"] for r in replies)
        assert served["chat/b"] > 2 * served["chat/a"], served  # the deployments' names
        trace = gw.trace(replies[-1].headers["x-request-id"])
        sel = next(d for d in trace["decisions"] if d["stage"] == "select")
        assert sel["evidence"]["strategy"] == "least_outstanding"
        assert set(sel["evidence"]["candidates"]) == {"chat/a", "chat/b"}
        assert "in_flight" in sel["evidence"]["candidates"]["chat/a"]
        ready = httpx.get(gw.url + "/readyz").json()["models"]["chat"]
        assert ready["kind"] == "deployments" and set(ready["deployments"]) == {"a", "b"}
        assert ready["deployments"]["a"]["labels"] == {"z": "1"}
        metrics = httpx.get(gw.url + "/metrics", headers=gw.admin).text
        assert 'switchyard_deployment_selected_total{deployment="chat/b",model="chat"}' in metrics
        assert 'switchyard_deployment_in_flight{deployment="chat/a",model="chat"}' in metrics
    finally:
        _clear(two)
        gw.proc.stop()


def test_latency_aware_moves_off_a_slow_deployment_and_back(
    two: tuple[Scripted, Scripted],
) -> None:
    a, b = two
    _clear(two)
    gw = _gateway(two, "latency", affinity=False, probe=0.1, stale_s=60)
    try:
        a.fault("delay:400", count=1000)

        def served(n: int) -> collections.Counter[str]:
            return collections.Counter(_ask(gw).headers["x-switchyard-upstream"] for _ in range(n))

        dep_a, dep_b = "chat/a", "chat/b"  # the header names the deployment

        def settle_on(dep: str) -> None:
            """Until `dep` wins three times in a row (a hang guard of 100 requests):
            the probe share measures the other again and the EWMAs cross."""
            streak = 0
            for _ in range(100):
                streak = streak + 1 if served(1)[dep] else 0
                if streak == 3:
                    return
            raise AssertionError(f"traffic never moved to {dep}")

        settle_on(dep_b)
        got = served(30)
        assert got[dep_b] >= 22, got
        _clear(two)
        b.fault("delay:400", count=1000)  # a recovered, b slowed
        settle_on(dep_a)
        got = served(30)
        assert got[dep_a] >= 22, got
    finally:
        _clear(two)
        gw.proc.stop()


def test_a_task_sticks_to_its_deployment_through_the_gateway(
    two: tuple[Scripted, Scripted],
) -> None:
    _clear(two)
    gw = _gateway(two, "weighted")
    try:
        for task in ("task-1", "task-2", "task-3", "task-4"):
            ups = {
                _ask(gw, **{"x-task-id": task}).headers["x-switchyard-upstream"] for _ in range(6)
            }
            assert len(ups) == 1, (task, ups)
        r = _ask(gw, **{"x-task-id": "task-1"})
        sel = next(
            d for d in gw.trace(r.headers["x-request-id"])["decisions"] if d["stage"] == "select"
        )
        assert sel["evidence"]["affinity"] == {"kind": "task", "outcome": "kept"}
    finally:
        gw.proc.stop()


def test_a_failed_deployment_fails_over_and_a_fallback_alias_is_balanced(
    two: tuple[Scripted, Scripted],
) -> None:
    a, b = two
    _clear(two)
    deps = [
        {"name": "a", "engine": {"kind": "openai", "base_url": a.url + "/v1"}},
        {"name": "b", "engine": {"kind": "openai", "base_url": b.url + "/v1"}},
    ]
    cfg = {
        "models": [
            {
                **_model("weighted", deps, affinity=False),
                "resilience": {"retries": 0},
            },
            {  # fails, then falls back to an alias of several deployments
                "alias": "front",
                "engine": {"kind": "openai", "base_url": a.url + "/v1"},
                "fallbacks": ["back"],
                "resilience": {"retries": 0},
            },
            {
                "alias": "back",
                "deployments": [
                    {**deps[0], "weight": 0.0},  # rolled back: never to be chosen
                    deps[1],
                ],
                "balance": {"failover": 0},
            },
        ],
        "embeddings": {"enabled": False},
    }
    gw = start_gateway(cfg)
    try:
        a.fault("status:500", count=1000)
        replies = [_ask(gw) for _ in range(12)]  # _ask: every one is a 200
        assert {r.headers["x-switchyard-upstream"] for r in replies} == {"chat/b"}
        moved = [
            d
            for r in replies
            for d in gw.trace(r.headers["x-request-id"])["decisions"]
            if d["stage"] == "failover"
        ]
        assert moved, "weighted 1:1 over 12 requests never chose the failing deployment"
        assert {d["outcome"] for d in moved} == {"try:chat/b"}
        assert all(d["evidence"]["from"] == "chat/a" for d in moved)
        # Nothing stays in flight on the deployment a request left.
        live = httpx.get(gw.url + "/readyz").json()["models"]["chat"]["deployments"]
        assert live["a"]["in_flight"] == 0 and live["b"]["in_flight"] == 0, live
        r = httpx.post(
            gw.url + "/v1/chat/completions",
            json={"model": "front", "messages": [{"role": "user", "content": "hi"}]},
            headers={"Authorization": f"Bearer {gw.key}"},
            timeout=30,
        )
        assert r.status_code == 200 and r.headers["x-switchyard-upstream"] == "back/b"
        fb = next(
            d for d in gw.trace(r.headers["x-request-id"])["decisions"] if d["stage"] == "fallback"
        )
        assert fb["outcome"] == "try:back" and fb["evidence"]["deployment"] == "back/b", fb
        assert fb["evidence"]["balance"]["strategy"] == "least_outstanding"
    finally:
        _clear(two)
        gw.proc.stop()


# -- prefix affinity ---------------------------------------------------------------------

_LONG = "You are the support assistant of a logistics platform. " * 30  # ~1,700 chars


def _chat(system: str, question: str) -> dict[str, Any]:
    return {
        "messages": [
            {"role": "system", "content": system},
            {"role": "user", "content": question},
        ]
    }


def _gen(body: dict[str, Any]) -> Generation:
    return Generation(model="m", **body)


def test_the_prompt_prefix_is_the_first_characters_of_a_long_enough_prompt() -> None:
    body = _chat(_LONG, "where is my parcel?")
    whole = "\x00".join(["system", _LONG, "user", "where is my parcel?"])
    assert prompt_prefix(_gen(body), 1024, 4096) == whole
    assert prompt_prefix(_gen(body), 1024, 1024) == whole[:1024]
    assert prompt_prefix(_gen(body), 1024, 100) is None  # 100 chars kept: shorter than the minimum
    assert prompt_prefix(_gen(_chat("short", "hi")), 1024, 4096) is None
    parts = {"messages": [{"role": "user", "content": [{"type": "text", "text": _LONG}]}]}
    assert prompt_prefix(_gen(parts), 1024, 4096) == ("user\x00" + _LONG)[:4096]
    assert prompt_prefix(Generation(model="m", prompt=_LONG), 1024, 64) is None
    assert prompt_prefix(Generation(model="m", prompt=_LONG), 10, 64) == _LONG[:64]


def test_requests_sharing_a_prefix_go_to_one_deployment_and_prefixes_spread() -> None:
    b, _, _ = _balancer("least_outstanding", [_remote("a"), _remote("b"), _remote("c")])
    where: dict[int, set[str]] = collections.defaultdict(set)
    for i in range(300):
        p = i % 12
        prefix = prompt_prefix(_gen(_chat(f"{p} {_LONG}", f"question {i}")), 1024, 1024)
        d, why, ev = _pick(b, prefix=prefix)
        where[p].add(d.name)
        assert why.startswith("prefix affinity") and ev["prefix_affinity"] == "its point"
    assert all(len(v) == 1 for v in where.values()), where
    assert len({next(iter(v)) for v in where.values()}) >= 2, where


@settings(max_examples=30)
@given(st.lists(st.text(min_size=1, max_size=20), min_size=5, max_size=40, unique=True))
def test_a_deployment_leaving_the_ring_moves_only_its_own_prefixes(names: list[str]) -> None:
    """Consistent hashing: with one deployment's breaker open, every prefix that was
    not on it stays where it was."""
    b, deps, breakers = _balancer("weighted", [_remote(x) for x in "abcd"])
    before = {n: _pick(b, prefix=n)[0].name for n in names}
    br = breakers[deps["b"].name]
    for _ in range(br.cfg.min_requests + 1):
        br.record(False, time.monotonic())
    after = {n: _pick(b, prefix=n)[0].name for n in names}
    for n in names:
        assert after[n] != "chat/b"
        if before[n] != "chat/b":
            assert after[n] == before[n], n


def test_prefix_affinity_yields_to_load_on_the_ring() -> None:
    b, _, _ = _balancer("least_outstanding", [_remote("a"), _remote("b")])
    held = [b.choose(prefix="same prefix") for _ in range(4)]  # none settled
    hows = [ev["prefix_affinity"] for _, _, ev in held]
    assert hows[:3] == ["its point"] * 3, hows  # 1, 2, then 3 in flight: within the bound
    assert hows[3].startswith("next on the ring"), hows
    assert held[3][0] is not held[0][0]


def test_a_long_prefix_lands_on_one_llama_server_replica() -> None:
    gw = start_gateway(
        {
            "models": [
                {
                    "alias": "smol",
                    "revision": "r1",
                    "deployments": [
                        {"name": n, "engine": {"kind": "llamacpp", "parallel": 1, "ctx": 1024}}
                        for n in ("r1", "r2")
                    ],
                }
            ],
            "embeddings": {"enabled": False},
        }
    )
    try:
        # /readyz answers once one deployment of an alias can serve; affinity is only
        # stable once both are eligible, so wait for the second too.
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            deps = httpx.get(gw.url + "/readyz").json()["models"]["smol"]["deployments"]
            if all(d.get("state") == "ready" for d in deps.values()):
                break
            time.sleep(0.2)
        assert all(d.get("state") == "ready" for d in deps.values()), deps
        ups: dict[int, set[str]] = collections.defaultdict(set)
        for i in range(12):
            p = i % 3
            r = httpx.post(
                gw.url + "/v1/chat/completions",
                json={
                    "model": "smol",
                    **_chat(f"Team {p}. {_LONG}", f"Question {i}: how do I track a parcel?"),
                    "max_tokens": 2,
                },
                headers={"Authorization": f"Bearer {gw.key}"},
                timeout=120,
            )
            assert r.status_code == 200, r.text
            ups[p].add(r.headers["x-switchyard-upstream"])
        assert all(len(v) == 1 for v in ups.values()), ups
        assert all(next(iter(v)) in ("smol/r1", "smol/r2") for v in ups.values())
    finally:
        gw.proc.stop()


# -- revisions: canaries, the guard, promote / rollback, pins ------------------------------


def test_one_task_never_mixes_revisions_even_under_load() -> None:
    b, _deps, _ = _balancer(
        "least_outstanding",
        [_remote("stable", revision="r17", weight=95), _remote("canary", revision="r18", weight=5)],
    )
    held = [b.choose(tenant="t", affinity=("task", "agent-1")) for _ in range(12)]  # none settled
    assert len({d.model.revision for d, _, _ in held}) == 1, [d.name for d, _, _ in held]
    first = held[0][0]
    first.live.weight = 0.0  # rolled back: the task moves, to the other revision
    d, _, ev = b.choose(tenant="t", affinity=("task", "agent-1"))
    assert d is not first and ev["affinity"]["why"] == "weight 0"


def _versioned(a: Scripted, b: Scripted, **extra: Any) -> dict[str, Any]:
    return {
        "models": [
            {
                "alias": "chat",
                "revision": "r17",
                "deployments": [
                    {
                        "name": "stable",
                        "revision": "r17",
                        "engine": {"kind": "openai", "base_url": a.url + "/v1"},
                    },
                    {
                        "name": "canary",
                        "revision": "r18",
                        "canary": True,
                        "engine": {"kind": "openai", "base_url": b.url + "/v1"},
                    },
                ],
                "balance": {"strategy": "weighted", "affinity": False},
                "canary_guard": {"max_error_rate": 0.2, "min_samples": 4, "window_s": 120},
                "resilience": {"retries": 0},
                **extra,
            },
            {
                "alias": "solo",
                "revision": "s1",
                "engine": {"kind": "openai", "base_url": a.url + "/v1"},
            },
        ],
        "embeddings": {"enabled": False},
    }


def _revision(gw: Gateway, key: str, model: str = "chat") -> httpx.Response:
    return httpx.post(
        gw.url + "/v1/chat/completions",
        json={"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
        headers={"Authorization": f"Bearer {key}"},
        timeout=30,
    )


def _weights(gw: Gateway) -> dict[str, float]:
    deps = httpx.get(gw.url + "/readyz").json()["models"]["chat"]["deployments"]
    return {n: d["weight"] for n, d in deps.items()}


def _until(pred: Any, what: str, timeout_s: float = 20) -> None:
    deadline = time.monotonic() + timeout_s  # a hang guard, not a timing assertion
    while not pred():
        assert time.monotonic() < deadline, what
        time.sleep(0.1)


@pytest.fixture
def versioned(two: tuple[Scripted, Scripted], tmp_path: Any) -> tuple[dict[str, Any], str]:
    """The stable/canary config over the two scripted upstreams (no faults), and a
    fresh SQLite file for it."""
    _clear(two)
    return _versioned(*two), str(tmp_path / "sy.db")


def test_the_canary_guard_cuts_a_failing_canary_and_the_cut_survives_a_restart(
    two: tuple[Scripted, Scripted], versioned: tuple[dict[str, Any], str]
) -> None:
    b = two[1]
    cfg, db = versioned
    gw = start_gateway(cfg, db=db)
    try:
        b.fault("status:500", count=1000)  # the canary fails every request
        replies = [_revision(gw, gw.key) for _ in range(40)]
        # Each request the canary failed failed over to the stable deployment (no task,
        # no pin: any revision may serve it), and the guard counted the failure.
        assert [r.status_code for r in replies] == [200] * 40
        assert {r.headers["x-switchyard-revision"] for r in replies} == {"r17"}
        assert _weights(gw) == {"stable": 1.0, "canary": 0.0}
        traces = [gw.trace(r.headers["x-request-id"]) for r in replies]
        over = [
            i for i, t in enumerate(traces) if any(d["stage"] == "failover" for d in t["decisions"])
        ]
        assert len(over) >= 4 and max(over) < 39, over  # min_samples failures, then no more
        first = next(d for d in traces[over[0]]["decisions"] if d["stage"] == "failover")
        assert first["outcome"] == "try:chat/stable" and first["evidence"]["from"] == "chat/canary"
        cuts = [d for t in traces for d in t["decisions"] if d["stage"] == "canary"]
        assert len(cuts) == 1 and cuts[0]["outcome"] == "cut", cuts
        assert "error rate" in cuts[0]["reason"] and "chat/canary" in cuts[0]["reason"]
        # A pinned request keeps its revision: the failing canary's error reaches it.
        pinner = gw.create_key(gw.create_tenant("t-pin")["id"], may_pin_revisions=True)["key"]
        r = _revision(gw, pinner, "chat@r18")
        assert r.status_code in (502, 503), r.text  # the 500, or its circuit now open
        none = next(
            d for d in gw.trace(r.headers["x-request-id"])["decisions"] if d["stage"] == "failover"
        )
        assert none["outcome"] == "none:chat", none
        metrics = httpx.get(gw.url + "/metrics", headers=gw.admin).text
        assert 'switchyard_canary_cuts_total{deployment="chat/canary",model="chat"} 1.0' in metrics
    finally:
        gw.proc.stop()
    _clear(two)
    gw = start_gateway(cfg, db=db)  # the stored weight outlives the process
    try:
        assert _weights(gw) == {"stable": 1.0, "canary": 0.0}
        assert {_revision(gw, gw.key).headers["x-switchyard-revision"] for _ in range(10)} == {
            "r17"
        }
    finally:
        gw.proc.stop()


def test_promote_and_rollback_move_the_weights_of_a_running_gateway(
    versioned: tuple[dict[str, Any], str], tmp_path: Any
) -> None:
    cfg, db = versioned
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    gw = start_gateway(cfg, db=db)
    try:

        def cli(*argv: str) -> dict[str, Any]:
            done = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "switchyard",
                    "models",
                    *argv,
                    "--config",
                    str(path),
                    "--db",
                    db,
                ],
                capture_output=True,
                text=True,
                timeout=60,
            )
            assert done.returncode == 0, done.stderr
            return dict(json.loads(done.stdout))

        assert cli("promote", "chat")["weights"] == {"stable": 0.0, "canary": 1.0}
        _until(lambda: _weights(gw) == {"stable": 0.0, "canary": 1.0}, "promote applied")
        assert {_revision(gw, gw.key).headers["x-switchyard-revision"] for _ in range(6)} == {"r18"}
        assert cli("rollback", "chat")["weights"] == {"stable": 1.0, "canary": 0.0}
        _until(lambda: _weights(gw) == {"stable": 1.0, "canary": 0.0}, "rollback applied")
        # The admin API sets weights by name, and refuses unknown names or all zeros.
        url = gw.url + "/admin/models/chat/weights"
        r = httpx.post(url, json={"weights": {"stable": 3, "canary": 1}}, headers=gw.admin)
        assert r.status_code == 200 and r.json()["weights"] == {"stable": 3.0, "canary": 1.0}
        assert cli("weights", "chat")["weights"] == {"stable": 3.0, "canary": 1.0}
        bad = httpx.post(url, json={"weights": {"nope": 1}}, headers=gw.admin)
        assert bad.status_code == 400 and "unknown deployments" in bad.json()["error"]["message"]
        zero = httpx.post(url, json={"weights": {"stable": 0, "canary": 0}}, headers=gw.admin)
        assert zero.status_code == 400
        r = httpx.post(gw.url + "/admin/models/chat/rollback", headers=gw.admin)
        assert r.json()["weights"] == {"stable": 1.0, "canary": 0.0}
    finally:
        gw.proc.stop()


def test_a_revision_is_pinned_only_by_a_key_that_may(
    versioned: tuple[dict[str, Any], str],
) -> None:
    gw = start_gateway(versioned[0])
    try:
        tenant = "t-pin"
        gw.create_tenant(tenant)
        pinner = gw.create_key(tenant, may_pin_revisions=True)["key"]
        r = _revision(gw, gw.key, "chat@r18")
        assert r.status_code == 403 and r.json()["error"]["code"] == "revision_pin_not_allowed"
        revs = {
            _revision(gw, pinner, "chat@r18").headers["x-switchyard-revision"] for _ in range(8)
        }
        assert revs == {"r18"}
        assert _revision(gw, pinner, "chat@canary").headers["x-switchyard-revision"] == "r18"
        r = _revision(gw, pinner, "chat@r99")
        assert r.status_code == 404 and "no revision 'r99'" in r.json()["error"]["message"]
        assert _revision(gw, gw.key, "solo@s1").status_code == 200  # its own revision: a no-op
        assert _revision(gw, gw.key, "solo@s2").status_code == 404
        assert _revision(gw, gw.key, "chat@").status_code == 404
    finally:
        gw.proc.stop()
