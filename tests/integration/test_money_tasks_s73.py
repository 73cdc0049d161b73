"""Money when a request's reservation is extended (s73): in its task's budget, and when
its worker dies with the extension held.

Defects these tests find (each failed before its fix in policy/stages_admission.py
`Reserver.extend`, the task stores' `extend`, and scale/workers.py `lost_request`,
scale/worker.py `InFlight._facts`):

- a further call after one that may have been billed (a fallback after a timeout)
  extended the request's reservation in the limiter's scopes only: the task's budget
  held one call per request, so a task budget that held one call was passed by the
  fallback (and the task's `used` then showed the whole bill, past its budget);
- a worker that died during such a further call was billed the largest single hold of
  its request (one call) while Redis kept every hold charged (two calls), and its task
  kept one; a request under no limit (billed from its journal) was billed one call.

Also here: the memory and Redis task stores extend a call's hold alike, over
generated sequences.
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from support.cut_calls import CAP, NO_STORE, PRICE, STEADY, decisions
from support.gateways import Gateway, start_gateway
from support.procs import kill_workers
from support.upstreams import Scripted
from switchyard.identity import TaskBudget
from switchyard.state.tasks import TaskFirst
from switchyard.state.tasks_memory import MemoryTaskStore
from switchyard.state.tasks_redis import RedisTaskStore


@pytest.fixture(scope="module")
def gw(scripted: Scripted) -> Iterator[Gateway]:
    """`serve --workers 2` (task state and limits in its private Redis): `cut` times
    out after 0.5 s and falls back to `hold` (10 s), both at PRICE."""
    engine = {"kind": "openai", "base_url": scripted.url + "/v1"}
    models = [
        {
            "alias": "cut",
            "engine": engine,
            "price": PRICE,
            "timeouts": {"first_byte_s": 0.5},
            "resilience": {"retries": 0, **STEADY},
            "fallbacks": ["hold"],
        },
        {
            "alias": "hold",
            "engine": engine,
            "price": PRICE,
            "timeouts": {"first_byte_s": 10.0},
            "resilience": {"retries": 0, **STEADY},
        },
    ]
    g = start_gateway(
        {"models": models, "embeddings": {"enabled": False}}, serve_args=("--workers", "2")
    )
    yield g
    g.proc.stop()


def _redis(gw: Gateway) -> redis.Redis:
    return redis.Redis.from_url(f"unix://{Path(gw.db).parent}/run/redis.sock")


def _body() -> dict[str, Any]:
    return {"model": "cut", "messages": [{"role": "user", "content": "hi"}], "max_tokens": CAP}


def _task_headers(task: str, budget: str) -> dict[str, str]:
    return {**NO_STORE, "x-task-id": task, "x-task-budget": budget}


def _post(
    gw: Gateway, scripted: Scripted, key: str, hangs: int, headers: dict[str, str]
) -> tuple[httpx.Response, int]:
    before = scripted.requests()
    scripted.fault("hang", count=hangs)
    try:
        r = gw.post("/v1/chat/completions", key=key, json=_body(), headers=headers)
    finally:
        scripted.fault("hang", count=0)
    return r, scripted.requests() - before


def _task_used(gw: Gateway, key: str, task: str) -> dict[str, float]:
    r = httpx.get(f"{gw.url}/v1/tasks/{task}", headers={"Authorization": f"Bearer {key}"})
    assert r.status_code == 200, r.text
    return dict(r.json()["used"])


def _spent(raw: redis.Redis, tenant: str) -> float:
    """What the tenant's budget counts as spent in Redis (reservations included)."""
    [k] = raw.keys(f"switchyard:rl:tenant:{tenant}:spent:*")
    return float(raw.get(k) or 0)


def test_a_fallback_past_the_task_budget_is_refused_and_the_limiter_gives_back(
    gw: Gateway, scripted: Scripted
) -> None:
    """The tenant's budget ($5) holds two calls, the task's (`cost_usd=0.5`) one. The
    first call times out; the fallback needs the reservation extended: the limiter
    holds one more call, the task refuses it, so the limiter's hold is given back and
    no call is made (`retry` `denied:budget`, naming the task's budget). The task is
    billed that one call, within its budget; the tenant's budget keeps the same.
    (Before: the fallback was made and answered, and the task was billed two calls'
    worth against a budget of one.)"""
    tenant, key = gw.new_tenant("s73t-one", budget_usd=5.0)
    task = f"t1-{uuid.uuid4().hex[:8]}"
    r, calls = _post(gw, scripted, key, 1, _task_headers(task, "cost_usd=0.5"))
    assert r.status_code == 504, r.text
    assert r.json()["error"]["code"] == "upstream_timeout", r.text
    assert calls == 1
    [denied] = [d for d in decisions(gw, r, "retry") if d["outcome"] == "denied:budget"]
    ev = denied["evidence"]
    assert ev["reservation"] == "not extended", ev
    assert (ev["stage"], ev["scope"], ev["limit"]) == ("task", f"task:{task}", "cost_usd"), ev
    assert ev["needed_usd"] == pytest.approx(0.5), ev
    assert ev["task"]["budget"]["cost_usd"] == pytest.approx(0.5), ev
    assert "task" in denied["reason"], denied
    [row] = gw.stored_rows(tenant, 1)
    assert (row["status"], row["attempts"], row["output_tokens"]) == ("error", 1, CAP), row
    assert row["cost_usd"] == pytest.approx(0.5), row
    used = _task_used(gw, key, task)
    assert used["cost_usd"] == pytest.approx(0.5), used
    assert used["calls"] == 1, used
    raw = _redis(gw)
    try:
        assert _spent(raw, tenant) == pytest.approx(0.5)  # the limiter's extension is back
    finally:
        raw.close()


def test_a_fallback_within_the_task_budget_is_held_in_it_and_given_back_exactly(
    gw: Gateway, scripted: Scripted
) -> None:
    """A tenant with no budget, a task with `cost_usd=1.2`: the fallback's extension is
    held in the task (`retry` `extended`, its evidence naming the task's hold), the
    fallback answers, and the task is charged exactly the row's bill (the cut call's
    cap and the answer), its extension given back. (Before: the limiter had nothing to
    extend, so nothing was extended at all.)"""
    tenant, key = gw.new_tenant("s73t-two")
    task = f"t2-{uuid.uuid4().hex[:8]}"
    r, calls = _post(gw, scripted, key, 1, _task_headers(task, "cost_usd=1.2"))
    assert r.status_code == 200, r.text
    assert calls == 2
    [extended] = [d for d in decisions(gw, r, "retry") if d["outcome"] == "extended"]
    held = extended["evidence"]["task"]
    assert held["scope"] == f"task:{task}", held
    assert held["reserved_usd"] == pytest.approx(0.5), held
    assert held["used"]["cost_usd"] == pytest.approx(1.0), held  # two calls held
    [row] = gw.stored_rows(tenant, 1)
    out = r.json()["usage"]["completion_tokens"]
    assert row["cost_usd"] == pytest.approx((CAP + out) / 1000), row
    used = _task_used(gw, key, task)
    assert used["cost_usd"] == pytest.approx(row["cost_usd"]), used
    assert used["tokens"] == row["input_tokens"] + row["output_tokens"], used
    assert used["calls"] == 1, used


# -- a worker that dies during a further call ----------------------------------------


def _serving_again(gw: Gateway, key: str) -> None:
    deadline = time.monotonic() + 30
    body = {"model": "hold", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
    while True:
        try:
            if gw.post("/v1/chat/completions", key, json=body).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, "the workers did not come back"
        time.sleep(0.2)


def test_a_dead_workers_extended_request_is_billed_each_call_and_nothing_stays_held(
    gw: Gateway, scripted: Scripted
) -> None:
    """Two requests each time out on `cut` and are under way on their fallback when
    every worker is killed. One has a tenant budget and a task (its reservation is two
    holds in Redis, `#admit` and `#admit+1`, and two calls in the task); the other
    is under no limit (no hold: its row comes from the worker's journal). Each row
    bills both calls (two caps at PRICE, $1.00), the tenant's budget and the task keep
    exactly that, and no hold of the request is left. (Before: each row billed one
    call, $0.50, while Redis kept $1.00 spent, and the task held one call.)"""
    tenant, key = gw.new_tenant("s73t-dead", budget_usd=5.0)
    free, free_key = gw.new_tenant("s73t-free")
    task = f"t3-{uuid.uuid4().hex[:8]}"
    before = scripted.requests()
    scripted.fault("hang", count=4)
    errors: list[BaseException] = []

    def send(k: str, headers: dict[str, str]) -> None:
        try:
            gw.post("/v1/chat/completions", key=k, json=_body(), headers=headers)
        except httpx.HTTPError as exc:
            errors.append(exc)

    sent = [
        threading.Thread(target=send, args=(key, _task_headers(task, "cost_usd=3"))),
        threading.Thread(target=send, args=(free_key, NO_STORE)),
    ]
    try:
        for t in sent:
            t.start()
        deadline = time.monotonic() + 8
        while scripted.requests() - before < 4:  # both are on their fallback
            assert time.monotonic() < deadline, scripted.requests() - before
            time.sleep(0.05)
        time.sleep(0.6)  # the journal is written again every 0.2 s
        kill_workers(gw.proc.popen.pid)
        for t in sent:
            t.join(15)
    finally:
        scripted.fault("hang", count=0)
    assert len(errors) == 2, errors  # neither was answered
    rows = {t: gw.stored_rows(t, 1, timeout_s=30) for t in (tenant, free)}
    for who, [row] in rows.items():
        assert (row["status"], row["error_code"]) == ("incomplete", "worker_exited"), row
        assert row["output_tokens"] == 2 * CAP, (who, row)
        assert row["cost_usd"] == pytest.approx(1.0), (who, row)
    _serving_again(gw, free_key)
    rid = rows[tenant][0]["request_id"]
    [exited] = gw.trace(rid)["decisions"]
    assert exited["evidence"]["calls_billed"] == 2, exited
    assert exited["evidence"]["reservations"] == [f"{rid}#admit", f"{rid}#admit+1"], exited
    [journaled] = gw.trace(rows[free][0]["request_id"])["decisions"]
    assert journaled["evidence"]["calls_billed"] == 2, journaled
    raw = _redis(gw)
    try:
        assert _spent(raw, tenant) == pytest.approx(1.0)
        assert raw.keys(f"switchyard:rl:held:{rid}*") == []
        for owner in raw.keys("switchyard:rl:owner:*"):
            assert not any(rid in f.decode() for f in raw.hkeys(owner)), owner
    finally:
        raw.close()
    used = _task_used(gw, key, task)
    assert used["cost_usd"] == pytest.approx(1.0), used
    assert used["tokens"] == rows[tenant][0]["input_tokens"] + 2 * CAP, used


# -- the task stores: a call's extension, memory and Redis alike ---------------------

FIRST = TaskFirst(TaskBudget(calls=4, tokens=2000, cost_usd=0.4))
steps = st.lists(
    st.one_of(
        st.tuples(st.just("admit"), st.sampled_from("ab"), st.sampled_from([100, 600])),
        st.tuples(st.just("extend"), st.integers(0, 5), st.booleans()),
        st.tuples(st.just("settle"), st.integers(0, 5), st.floats(0, 1.5)),
    ),
    min_size=1,
    max_size=14,
)


@settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(seq=steps)
def test_the_stores_extend_a_calls_hold_alike(redis_url: str, seq: list[Any]) -> None:
    """Admits, extensions (each a call's own tokens and cost again; one sent twice,
    as a dropped connection resends it, counts once) and settles over two tasks: the
    Redis store answers as the memory store (held or refused and why, the use after
    each), a call settled or unknown extends nothing, and each settle gives back
    exactly what the call held with its extensions."""

    async def go() -> None:
        mem = MemoryTaskStore()
        red = RedisTaskStore(redis_url, prefix=f"x{uuid.uuid4().hex[:8]}:", timeout_s=5)
        calls: list[list[Any]] = []  # [key, rid, tokens, cost, extensions, settled]
        try:
            for step in seq:
                if step[0] == "admit":
                    key, rid = ("t", step[1]), f"r{len(calls)}"
                    tokens, cost = step[2], step[2] / 2000
                    a = await mem.admit(key, FIRST, rid, tokens, cost, 1000.0)
                    b = await red.admit(key, FIRST, rid, tokens, cost, 1000.0)
                    assert (a.allowed, a.refused) == (b.allowed, b.refused)
                    assert a.used == pytest.approx(b.used)
                    if a.allowed:
                        calls.append([key, rid, tokens, cost, 0, False])
                elif step[0] == "extend" and calls:
                    call = calls[step[1] % len(calls)]
                    key, rid, tokens, cost, n, settled = call
                    for _ in range(2 if step[2] else 1):  # sent twice: counted once
                        x = await mem.extend(key, rid, n + 1, tokens, cost, 1000.0)
                        y = await red.extend(key, rid, n + 1, tokens, cost, 1000.0)
                        assert (x is None) == (y is None) == settled
                        if x is not None and y is not None:
                            assert (x.allowed, x.refused) == (y.allowed, y.refused)
                            assert x.used == pytest.approx(y.used)
                            assert x.refused in (None, "tokens", "cost_usd")
                    if x is not None and x.allowed:
                        call[4] = n + 1
                elif step[0] == "settle" and calls:
                    call = calls[step[1] % len(calls)]
                    key, rid, tokens, cost, n, settled = call
                    before = await mem.describe(key, 1000.0)
                    used_t, used_c = int(tokens * step[2]), cost * step[2]
                    await mem.settle(key, rid, used_t, used_c)
                    await red.settle(key, rid, used_t, used_c)
                    after = await mem.describe(key, 1000.0)
                    assert before is not None and after is not None
                    if not settled:  # what it held, extensions included, is replaced
                        held_t, held_c = tokens * (n + 1), cost * (n + 1)
                        assert after["used"]["tokens"] == pytest.approx(
                            before["used"]["tokens"] - held_t + used_t
                        )
                        assert after["used"]["cost_usd"] == pytest.approx(
                            max(0.0, before["used"]["cost_usd"] - held_c + used_c), abs=1e-9
                        )
                    call[5] = True
            for name in "ab":
                m = await mem.describe(("t", name), 1000.0)
                r = await red.describe(("t", name), 1000.0)
                assert (m is None) == (r is None)
                if m is not None and r is not None:
                    assert m["used"] == pytest.approx(r["used"])
        finally:
            await red.close()

    asyncio.run(go())
