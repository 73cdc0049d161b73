"""The canary guard over several gateway processes (decide/balance.py with
state/guard_redis.py): each process's balancer shares its canary's window as counts
through a real redis-server, so errors or slow replies split across processes, each
process below `min_samples` alone, still cut the canary in every process; a healthy
canary stays; and the cut matches what one window holding every outcome would decide,
p95 included. Last, `serve --workers 2` as a user runs it: `min_samples` failures over
both workers cut the canary, one fewer does not."""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

import httpx
from hypothesis import example, given, settings
from hypothesis import strategies as st

from support.canary_guard import GUARD, Process, guard_settings
from support.gateways import ADMIN_KEY, Gateway, start_gateway
from support.procs import free_port
from support.upstreams import Scripted
from switchyard.gateway.deployments import build_guard_share
from switchyard.state.guard_redis import SharedGuard


def _processes(url: str, n: int, **kw: Any) -> list[Process]:
    prefix = f"t{uuid.uuid4().hex[:8]}:"
    return [Process(url, prefix, **kw) for _ in range(n)]


async def _rounds(procs: list[Process], rounds: int = 2) -> None:
    """Every process exchanges once per round, in order."""
    for _ in range(rounds):
        for p in procs:
            await p.refresh()


async def _close(procs: list[Process]) -> None:
    for p in procs:
        await p.share.close()


def test_errors_split_over_processes_cut_the_canary_in_every_one(redis_url: str) -> None:
    async def go() -> list[Process]:
        procs = _processes(redis_url, 3)
        for p in procs:  # 5 outcomes each, 2 errors: 15 in all, 40 % > 25 %
            for ok in (True, False, True, False, True):
                assert p.outcome(ok) is None  # 5 < min_samples alone
        await _rounds(procs)
        await _close(procs)
        return procs

    procs = asyncio.run(go())
    assert [p.cut for p in procs] == [True] * 3
    for p in procs:  # each cut once, saying the others' outcomes counted
        assert len(p.cuts) == 1
        assert "error rate 0.40 > 0.25 over 15 requests (10 of them in other" in p.cuts[0]


def test_slow_replies_split_over_processes_pass_the_p95_together(redis_url: str) -> None:
    """10 successes per process, one over 500 ms in two of them: alone (and two
    together) below `min_samples`; all 30, whose p95 (the 29th sorted) is the second
    slowest, just over the bound."""

    async def go(slow_per_process: list[int]) -> list[Process]:
        procs = _processes(redis_url, 3, guard={**GUARD, "min_samples": 25})
        for p, slow in zip(procs, slow_per_process, strict=True):
            for i in range(10):
                p.outcome(True, 900.0 if i < slow else 120.0)
        await _rounds(procs)
        await _close(procs)
        return procs

    slow = asyncio.run(go([1, 1, 0]))
    assert [p.cut for p in slow] == [True] * 3
    assert "p95 > 500 ms (2 of 30 successful requests slower) over 30 requests" in slow[0].cuts[0]
    # One slow reply in 30: the 29th is fast, so no process cuts.
    fast = asyncio.run(go([1, 0, 0]))
    assert [p.cut for p in fast] == [False] * 3
    assert [p.cuts for p in fast] == [[], [], []]


def test_the_gateways_wiring_exchanges_by_itself_and_stops_when_idle(redis_url: str) -> None:
    """Built as the gateway builds it: the outcomes start each process's exchange loop,
    which cuts over the union with no further request, and ends once the window is
    empty, having written zeros."""
    guard = {**GUARD, "window_s": 1.0}

    async def go() -> tuple[list[bool], list[int], list[bool], list[bytes]]:
        procs = _processes(redis_url, 2, guard=guard, wired=True)
        for p in procs:  # 8 each, half of them errors
            for ok in (True, False) * 4:
                p.outcome(ok)
        deadline = time.monotonic() + 20  # a hang guard, not a timing assertion
        while not all(p.cut for p in procs) and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        cut = [p.cut for p in procs]
        cuts = [len(p.cuts) for p in procs]
        while any(not p.share._task.done() for p in procs if p.share._task is not None):
            if time.monotonic() > deadline + 20:
                break
            await asyncio.sleep(0.05)
        stopped = [p.share._task is not None and p.share._task.done() for p in procs]
        raw = await procs[0].share._redis.hgetall(procs[0].share._key(procs[0].canary.name))
        await _close(procs)
        return cut, cuts, stopped, [v.split(b",", 4)[0] for v in raw.values()]

    cut, cuts, stopped, written = asyncio.run(go())
    assert cut == [True, True] and cuts == [1, 1]
    assert stopped == [True, True]
    assert written == [b"0", b"0"]  # each window emptied and said so


def test_an_unreachable_redis_leaves_each_process_judging_its_own() -> None:
    async def go() -> tuple[bool, bool, list[int]]:
        prefix = f"t{uuid.uuid4().hex[:8]}:"
        procs = [Process(f"redis://127.0.0.1:{free_port()}/0", prefix) for _ in range(2)]
        procs[0].outcome(False)  # a share of one error: cut only together
        for _ in range(11):
            procs[1].outcome(True)
        await _rounds(procs)  # nothing is shared, nothing raises
        alone = [procs[0].outcome(False) is not None for _ in range(11)]
        await _close(procs)
        return alone[-1], procs[1].cut, [p.share.errors for p in procs]

    cut_alone, other, errors = asyncio.run(go())
    assert cut_alone and not other  # 12 errors of its own cut it; the healthy one stays
    assert errors == [2, 2]


def test_only_a_guard_with_redis_is_shared(redis_url: str) -> None:
    """Without `storage.redis_url` (or without a guard) nothing is shared: each
    process's guard judges alone, as before."""
    alone = guard_settings(GUARD)
    assert build_guard_share(alone) is None
    shared = alone.model_copy(
        update={"storage": alone.storage.model_copy(update={"redis_url": redis_url})}
    )
    share = build_guard_share(shared)
    assert isinstance(share, SharedGuard)
    asyncio.run(share.close())
    unguarded = shared.model_copy(
        update={"models": [m.model_copy(update={"canary_guard": None}) for m in shared.models]}
    )
    assert build_guard_share(unguarded) is None


def _breaches(outcomes: list[tuple[bool, float]]) -> bool:
    """The guard over one window holding `outcomes` (its rule as written before it was
    shared: the p95 read from the sorted latencies)."""
    n = len(outcomes)
    if n < GUARD["min_samples"]:
        return False
    if sum(1 for ok, _ in outcomes if not ok) / n > GUARD["max_error_rate"]:
        return True
    lat = sorted(ms for ok, ms in outcomes if ok)
    return bool(lat) and lat[int(len(lat) * 0.95)] > GUARD["max_p95_ms"]


OUTCOME = st.tuples(st.booleans() | st.just(True), st.sampled_from([100.0, 500.0, 501.0, 900.0]))


@settings(max_examples=30, deadline=None)
@given(st.lists(st.lists(OUTCOME, max_size=14), min_size=1, max_size=4))
@example([[(True, 100.0)] * 7, [(True, 100.0)] * 6 + [(True, 501.0)]])  # p95 at the bound
@example([[(True, 100.0)] * 12, [(False, 100.0)] * 5])  # the error rate only together
def test_shared_windows_cut_as_one_window_would(
    redis_url: str, runs: list[list[tuple[bool, float]]]
) -> None:
    """Whatever the outcomes per process: after a round of exchanges in order (process k
    reads those before it) and a second (all read all), process k has cut its canary
    exactly when one window would have: its own outcomes as they came, what it read in
    the first round (its own with those before it), or every outcome together."""

    async def go() -> list[bool]:
        procs = _processes(redis_url, len(runs))
        for p, outcomes in zip(procs, runs, strict=True):
            for ok, ms in outcomes:
                p.outcome(ok, ms)
        await _rounds(procs)
        await _close(procs)
        return [p.cut for p in procs]

    every = [o for outcomes in runs for o in outcomes]
    expected = [
        any(_breaches(runs[k][:i]) for i in range(1, len(runs[k]) + 1))
        or _breaches([o for outcomes in runs[: k + 1] for o in outcomes])
        or _breaches(every)
        for k in range(len(runs))
    ]
    assert asyncio.run(go()) == expected


def _weight(gw: Gateway) -> float:
    deps = httpx.get(gw.url + "/readyz").json()["models"]["chat"]["deployments"]
    return float(deps["canary"]["weight"])


def test_workers_cut_a_canary_on_min_samples_failures_over_all_of_them(
    two: tuple[Scripted, Scripted],
) -> None:
    """Two workers (their private Redis), a canary failing every request, each request
    pinned to it on a new connection (the kernel spreads them over the workers): 7
    failures, one below `min_samples`, leave it; the 8th cuts it, though a worker alone
    would hold all 8 only once in 128 runs."""
    a, b = two
    config = {
        "models": [
            {
                "alias": "chat",
                "revision": "r17",
                "deployments": [
                    {"name": "stable", "engine": {"kind": "openai", "base_url": a.url + "/v1"}},
                    {
                        "name": "canary",
                        "revision": "r18",
                        "canary": True,
                        "engine": {"kind": "openai", "base_url": b.url + "/v1"},
                    },
                ],
                "balance": {"strategy": "weighted", "affinity": False},
                "canary_guard": {"max_error_rate": 0.2, "min_samples": 8, "window_s": 300},
                # Only the guard may stop the canary's traffic.
                "resilience": {
                    "retries": 0,
                    "breaker": {"failures": 1000, "min_requests": 1000},
                },
            }
        ],
        "embeddings": {"enabled": False},
    }
    gw = start_gateway(config, serve_args=("--workers", "2"))
    try:
        b.fault("status:500", count=1000)
        pinner = gw.create_key(gw.create_tenant("t-pin")["id"], may_pin_revisions=True)["key"]

        def failed() -> int:
            r = httpx.post(
                gw.url + "/v1/chat/completions",
                json={"model": "chat@r18", "messages": [{"role": "user", "content": "hi"}]},
                headers={"Authorization": f"Bearer {pinner}"},
                timeout=30,
            )
            return r.status_code

        assert [failed() for _ in range(7)] == [502] * 7
        time.sleep(3)  # several exchanges and a weights refresh: nothing to cut yet
        assert _weight(gw) == 1.0
        assert failed() == 502
        deadline = time.monotonic() + 20  # a hang guard, not a timing assertion
        while _weight(gw) != 0.0:
            assert time.monotonic() < deadline, gw.proc.output()[-3000:]
            time.sleep(0.1)
        # Whichever worker saw the breach first cut it, once for the host: the others,
        # finding it at an exchange or on their next outcome, apply the stored weight
        # without a second log line or count.
        time.sleep(2)  # exchanges and a weights refresh in every worker
        cuts = gw.proc.output().count("model chat: the canary guard cut chat/canary")
        assert cuts == 1, gw.proc.output()[-3000:]
        auth = {"Authorization": f"Bearer {ADMIN_KEY}"}
        metrics = httpx.get(gw.url + "/metrics", headers=auth).text
        counted = [
            float(line.rsplit(" ", 1)[1])
            for line in metrics.splitlines()
            if line.startswith("switchyard_canary_cuts_total{")
        ]
        assert sum(counted) == 1.0, counted
    finally:
        gw.proc.stop()
        httpx.put(b.url + "/control/fault", json={"fault": None})
