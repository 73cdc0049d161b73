"""Tenant isolation, hostile: a key of tenant B that wants to read, change, cancel or
learn anything of tenant A's, against real gateways over sockets (the scripted upstream
behind them; one gateway per task store, shared by the tests).

Defects these tests find (each failed before its fix):
- task states are bounded by `tasks.max_tasks` for the whole gateway, the least recently
  admitted dropped first, whoever they belonged to: tenant B, by sending requests under
  fresh `x-task-id`s, dropped tenant A's task states, so A's cancelled task ran again
  (200, not 409 `task_cancelled`) and A's task budget started afresh (its used calls
  forgotten), in the in-process store and in Redis alike. Now the tenant holding the
  most task states loses its own least recently admitted one;
- (within one tenant, with Redis) a task id ending in `:calls` (`:held`, `:order`) named
  the Redis key of another task's tool-call notes (reservations, note order):
  state/tasks_redis.py `_k`. Task `x:calls` found a key there already, so it was never
  given its budget and ran without one (a third call past `calls=2` was served), and
  wrote its use into `x`'s notes;
- `x-ratelimit-remaining-requests` reported a model's own rpm window (every tenant's
  traffic) when it was the tightest: tenant B could count tenant A's requests. Now the
  headers are the key's and its tenant's own (policy/admit.py `rate_headers`).
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import httpx
import pytest

from support.gateways import Gateway, cheap_config, start_gateway
from support.upstreams import Scripted

MAX_TASKS = 8


def _gateway(scripted: Scripted, redis_url: str | None) -> Gateway:
    """A gateway keeping at most MAX_TASKS task states, in its own process or in Redis."""
    config = cheap_config(scripted, tasks={"max_tasks": MAX_TASKS})
    if redis_url is not None:
        config["storage"] = {"redis_url": redis_url}
    return start_gateway(config)


@pytest.fixture(scope="module")
def memory_gw(scripted: Scripted) -> Iterator[Gateway]:
    g = _gateway(scripted, None)
    yield g
    g.proc.stop()


@pytest.fixture(scope="module")
def redis_gw(scripted: Scripted, redis_url: str) -> Iterator[Gateway]:
    g = _gateway(scripted, redis_url)
    yield g
    g.proc.stop()


@pytest.fixture(params=["memory", "redis"])
def gw(request: pytest.FixtureRequest) -> Gateway:
    """Each task store's gateway in turn (started once for the module)."""
    g: Gateway = request.getfixturevalue(f"{request.param}_gw")
    return g


def _chat(gw: Gateway, key: str, task: str, **headers: str) -> httpx.Response:
    body = {"model": "cheap", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    return gw.post("/v1/chat/completions", key, json=body, headers={"x-task-id": task, **headers})


def _task_id() -> str:
    return "task-" + os.urandom(4).hex()


def test_another_tenants_new_tasks_do_not_drop_a_cancelled_task(gw: Gateway) -> None:
    _, key_a = gw.new_tenant("a")
    _, key_b = gw.new_tenant("b")
    task = _task_id()
    assert _chat(gw, key_a, task).status_code == 200
    cancel = httpx.delete(f"{gw.url}/v1/tasks/{task}", headers={"Authorization": f"Bearer {key_a}"})
    assert cancel.status_code == 200, cancel.text
    # B fills the store with tasks of its own (twice the room).
    for _ in range(2 * MAX_TASKS):
        assert _chat(gw, key_b, _task_id()).status_code == 200
    r = _chat(gw, key_a, task)
    assert r.status_code == 409, r.text
    assert r.json()["error"]["code"] == "task_cancelled"
    got = httpx.get(f"{gw.url}/v1/tasks/{task}", headers={"Authorization": f"Bearer {key_a}"})
    assert got.status_code == 200 and got.json()["cancelled_at"] is not None


def test_another_tenants_new_tasks_do_not_reset_a_task_budget(gw: Gateway) -> None:
    _, key_a = gw.new_tenant("a")
    _, key_b = gw.new_tenant("b")
    task = _task_id()
    budget = {"x-task-budget": "calls=1"}
    assert _chat(gw, key_a, task, **budget).status_code == 200
    for _ in range(2 * MAX_TASKS):
        assert _chat(gw, key_b, _task_id()).status_code == 200
    r = _chat(gw, key_a, task, **budget)
    assert r.status_code == 429, r.text
    err = r.json()["error"]
    assert (err["code"], err["param"]) == ("task_budget_exceeded", "calls")
    # A's task kept what it used (B's flood cost B its own oldest tasks).
    got = httpx.get(f"{gw.url}/v1/tasks/{task}", headers={"Authorization": f"Bearer {key_a}"})
    assert got.status_code == 200 and got.json()["used"]["calls"] == 1


def test_a_task_id_never_names_another_tasks_redis_keys(
    redis_gw: Gateway, scripted: Scripted
) -> None:
    gw = redis_gw
    _, key = gw.new_tenant("a")
    task = _task_id()
    budget = {"x-task-budget": "calls=2"}
    # The model proposes a tool call in `task`: the task keeps a note of it.
    calls = [{"name": "lookup", "arguments": {"q": "fares"}}]
    assert httpx.put(scripted.url + "/control/tool_calls", json={"calls": calls}).is_success
    try:
        assert _chat(gw, key, task, **budget).status_code == 200
    finally:
        httpx.put(scripted.url + "/control/tool_calls", json={"calls": []})
    for _ in range(2):
        assert _chat(gw, key, task + ":calls", **budget).status_code == 200
    r = _chat(gw, key, task + ":calls", **budget)
    assert r.status_code == 429, r.text
    assert r.json()["error"]["param"] == "calls"
    auth = {"Authorization": f"Bearer {key}"}
    for name, used, notes in ((task, 1, 1), (task + ":calls", 2, 0)):
        got = httpx.get(f"{gw.url}/v1/tasks/{name}", headers=auth)
        assert got.status_code == 200, got.text
        body = got.json()
        assert (body["budget"], body["used"]["calls"]) == ({"calls": 2}, used)
        assert len(body["tool_calls"]) == notes


def test_rate_headers_do_not_count_another_tenants_requests(scripted: Scripted) -> None:
    """A model's own rpm window (`models[].limits.rpm`) is every tenant's traffic: its
    remaining count in `x-ratelimit-remaining-requests` let tenant B count tenant A's
    requests (99, then 91 after A's 7). The headers are the key's and tenant's own;
    a model limit still refuses (429 with Retry-After)."""
    shared = {
        "alias": "shared",
        "engine": {"kind": "openai", "base_url": scripted.url + "/v1"},
        "limits": {"rpm": 100},
    }
    g = start_gateway(cheap_config(scripted, shared))
    try:
        _, key_a = g.new_tenant("a", rpm=1000)
        _, key_b = g.new_tenant("b", rpm=1000)
        body = {"model": "shared", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}

        def remaining(key: str) -> str:
            r = g.post("/v1/chat/completions", key, json=body)
            assert r.status_code == 200, r.text
            return r.headers["x-ratelimit-remaining-requests"]

        before = remaining(key_b)
        for _ in range(7):
            remaining(key_a)
        assert int(remaining(key_b)) == int(before) - 1  # B's own second request, no more
    finally:
        g.proc.stop()
