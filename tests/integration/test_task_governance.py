"""Agent tasks as a unit of policy: budgets, deadlines and cancel (policy/tasks.py).

The store's rules are driven directly with explicit clocks; the rest runs through a
real gateway in front of a scripted upstream on loopback.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st

from support.gateways import Gateway, start_gateway
from support.upstreams import Scripted, start_scripted
from switchyard.config import Price
from switchyard.errors import InvalidRequest
from switchyard.identity import TaskBudget
from switchyard.policy import headers
from switchyard.policy.admit import cost_usd
from switchyard.policy.cost import PromptOverhead, plan
from switchyard.request import Generation, from_object
from switchyard.state.tasks import TaskFirst, ToolCallNote
from switchyard.state.tasks_memory import MemoryTaskStore

# -- headers ------------------------------------------------------------------------------


def test_task_budget_header_any_subset() -> None:
    assert headers.task_budget(
        "calls=10, tokens=50000, cost_usd=0.50, wall_s=120, tool_calls=4"
    ) == {
        "calls": 10,
        "tokens": 50000,
        "cost_usd": 0.5,
        "wall_s": 120.0,
        "tool_calls": 4,
    }
    assert headers.task_budget("cost_usd=2") == {"cost_usd": 2.0}


@pytest.mark.parametrize(
    "value",
    [
        "",
        "calls",
        "calls=",
        "calls=1.5",
        "calls=0",
        "tool_calls=0",
        "tool_calls=2.5",
        "tool_calls=" + "9" * 14,
        "calls=-1",
        "calls=1, calls=2",
        "money=3",
        "cost_usd=1e3",
        "cost_usd=inf",
        "wall_s=nan",
        "tokens=1_000",
        "calls=1;tokens=2",
        "calls=" + "9" * 20,
        "calls=1," * 100,
        "calls=\uff11",  # a full-width digit
    ],
)
def test_task_budget_header_refuses_what_it_cannot_read(value: str) -> None:
    with pytest.raises(InvalidRequest) as e:
        headers.task_budget(value)
    assert e.value.param == "x-task-budget" and e.value.code == "invalid_header"


def test_task_deadline_header_is_rfc3339_with_an_offset() -> None:
    assert headers.task_deadline("2026-12-01T12:00:00Z") == 1796126400.0
    assert headers.task_deadline("2026-12-01T13:00:00+01:00") == 1796126400.0
    for bad in ("2026-12-01", "2026-12-01T12:00:00", "tomorrow", "2026-13-01T00:00:00Z"):
        with pytest.raises(InvalidRequest) as e:
            headers.task_deadline(bad)
        assert e.value.param == "x-task-deadline"
    assert headers.task_timeout("2.5") == 2.5
    with pytest.raises(InvalidRequest):
        headers.task_timeout("0")


def test_a_task_deadline_is_at_most_a_week_ahead() -> None:
    """A deadline in the year 9999 would be no deadline: like `x-task-timeout`, it is
    bounded, here to seven days after the request came."""
    now = 1796126400.0  # 2026-12-01T12:00:00Z
    assert headers.task_deadline("2026-12-08T12:00:00Z", now) == now + 7 * 86400
    for far in ("2026-12-08T12:00:01Z", "9999-12-31T23:59:59Z"):
        with pytest.raises(InvalidRequest) as e:
            headers.task_deadline(far, now)
        assert e.value.param == "x-task-deadline" and "7 days" in e.value.message


budgets = st.builds(
    TaskBudget,
    calls=st.none() | st.integers(1, 50),
    tokens=st.none() | st.integers(1, 10**6),
    cost_usd=st.none() | st.floats(0.001, 100),
    wall_s=st.none() | st.floats(0.1, 1000),
    tool_calls=st.none() | st.integers(1, 50),
)


@given(budgets, budgets)
def test_a_client_can_only_lower_a_budget(default: TaskBudget, asked: TaskBudget) -> None:
    got = default.lower(asked)
    for name in ("calls", "tokens", "cost_usd", "wall_s", "tool_calls"):
        d, a, g = getattr(default, name), getattr(asked, name), getattr(got, name)
        if d is not None:
            assert g is not None and g <= d  # never raised above the default
        if a is not None:
            assert g is not None and g <= a
        if d is None and a is None:
            assert g is None


# -- the store ----------------------------------------------------------------------------


def _run(coro: Any) -> Any:
    return asyncio.run(coro)


def test_concurrent_calls_cannot_overshoot_together() -> None:
    """Reservations: five calls admitted before any settles fit only as far as the
    budget goes; settling replaces the estimate by what was used."""

    async def go() -> None:
        store = MemoryTaskStore()
        first = TaskFirst(TaskBudget(cost_usd=0.35))
        key = ("acme", "t1")
        got = [await store.admit(key, first, f"r{i}", 100, 0.1, 1000.0) for i in range(5)]
        assert [a.allowed for a in got] == [True, True, True, False, False]
        assert got[3].refused == "cost_usd"
        for i in range(3):
            await store.settle(key, f"r{i}", 40, 0.02)
        # 0.06 spent: room again for two more estimates of 0.1 (0.26), not three (0.36).
        again = [await store.admit(key, first, f"s{i}", 100, 0.1, 1001.0) for i in range(4)]
        assert [a.allowed for a in again] == [True, True, False, False]
        state = await store.describe(key, 1001.0)
        assert state is not None and state["refused"] == {"cost_usd": 4}

    _run(go())


def test_tasks_are_per_tenant_and_the_first_request_sets_the_rules() -> None:
    async def go() -> None:
        store = MemoryTaskStore()
        a = await store.admit(("acme", "t"), TaskFirst(TaskBudget(calls=1)), "r1", 1, 0, 0.0)
        # Another tenant's task of the same id is its own, with its own rules.
        b = await store.admit(("zeta", "t"), TaskFirst(TaskBudget(calls=5)), "r2", 1, 0, 0.0)
        assert a.allowed and b.allowed
        # A later request cannot raise the budget its task started with.
        c = await store.admit(("acme", "t"), TaskFirst(TaskBudget(calls=9)), "r3", 1, 0, 1.0)
        assert not c.allowed and c.refused == "calls"
        assert (await store.cancel(("zeta", "t"), 2.0)) is not None
        d = await store.admit(("zeta", "t"), TaskFirst(TaskBudget()), "r4", 1, 0, 3.0)
        assert d.refused == "cancelled"
        e = await store.admit(("acme", "other"), TaskFirst(TaskBudget()), "r5", 1, 0, 3.0)
        assert e.allowed  # cancelling zeta's task touched nothing of acme's

    _run(go())


def test_deadline_from_timeout_deadline_and_wall_time() -> None:
    async def go() -> None:
        store = MemoryTaskStore()
        first = TaskFirst(TaskBudget(wall_s=50), timeout_s=20, deadline_at=130.0)
        a = await store.admit(("t", "x"), first, "r1", 1, 0, 100.0)
        assert a.deadline_at == 120.0 and a.deadline_by == "x-task-timeout"
        assert (await store.admit(("t", "x"), first, "r2", 1, 0, 119.9)).allowed
        late = await store.admit(("t", "x"), first, "r3", 1, 0, 120.0)
        assert late.refused == "deadline"
        wall = await store.admit(("t", "w"), TaskFirst(TaskBudget(wall_s=5)), "r4", 1, 0, 0.0)
        assert wall.deadline_by == "wall_s"
        assert (
            await store.admit(("t", "w"), TaskFirst(TaskBudget()), "r5", 1, 0, 5.0)
        ).refused == ("wall_s")

    _run(go())


def test_state_is_bounded_and_expires() -> None:
    async def go() -> None:
        store = MemoryTaskStore(max_tasks=3, idle_ttl_s=10)
        for i in range(5):
            await store.admit(("t", f"k{i}"), TaskFirst(TaskBudget(calls=1)), f"r{i}", 1, 0, 0.0)
        assert [await store.describe(("t", f"k{i}"), 0.0) is None for i in range(5)] == [
            True,
            True,
            False,
            False,
            False,
        ]
        # Idle past the TTL, a task starts afresh (its id may be reused).
        again = await store.admit(("t", "k4"), TaskFirst(TaskBudget(calls=1)), "r9", 1, 0, 11.0)
        assert again.allowed

    _run(go())


def test_a_call_refused_after_admission_gives_its_call_back() -> None:
    async def go() -> None:
        store = MemoryTaskStore()
        first = TaskFirst(TaskBudget(calls=1))
        assert (await store.admit(("t", "k"), first, "r1", 10, 0, 0.0)).allowed
        await store.settle(("t", "k"), "r1", 0, 0.0, called=False)
        assert (await store.admit(("t", "k"), first, "r2", 10, 0, 0.0)).allowed
        await store.settle(("t", "k"), "r2", 0, 0.0)  # a real call keeps its count
        assert (await store.admit(("t", "k"), first, "r3", 10, 0, 0.0)).refused == "calls"

    _run(go())


def test_tool_calls_are_their_own_budget_and_their_price_counts_as_cost() -> None:
    """`calls` counts model calls, `tool_calls` the tools/call requests through /mcp;
    both draw on one `cost_usd`. A tool call refused after admission gives its tool call
    back, never a model call."""

    async def go() -> None:
        store = MemoryTaskStore()
        first = TaskFirst(TaskBudget(calls=1, tool_calls=2, cost_usd=0.1))
        k = ("t", "k")
        assert (await store.admit(k, first, "m1", 10, 0.01, 0.0)).allowed
        assert (await store.admit(k, first, "m2", 10, 0.01, 0.0)).refused == "calls"
        a = await store.admit(k, first, "t1", 0, 0.05, 0.0, tool=True)
        assert a.allowed and a.used["tool_calls"] == 1 and a.used["calls"] == 1
        assert a.remaining() == pytest.approx({"calls": 0, "tool_calls": 1, "cost_usd": 0.04})
        # The price does not fit what is left of cost_usd: refused on cost, not count.
        assert (await store.admit(k, first, "t2", 0, 0.05, 0.0, tool=True)).refused == "cost_usd"
        await store.settle(k, "t1", 0, 0.0, called=False)  # never sent: all given back
        state = await store.describe(k, 0.0)
        assert state is not None
        assert state["used"] == {"calls": 1, "tokens": 10, "cost_usd": 0.01, "tool_calls": 0}
        assert (await store.admit(k, first, "t3", 0, 0.01, 0.0, tool=True)).allowed
        assert (await store.admit(k, first, "t4", 0, 0.01, 0.0, tool=True)).allowed
        out = await store.admit(k, first, "t5", 0, 0.0, 0.0, tool=True)
        assert out.refused == "tool_calls" and out.remaining()["tool_calls"] == 0
        assert (await store.describe(k, 0.0))["refused"] == {  # type: ignore[index]
            "calls": 1,
            "cost_usd": 1,
            "tool_calls": 1,
        }

    _run(go())


# -- through a gateway --------------------------------------------------------------------

PRICE = {"input": 1.0, "output": 2.0}  # USD per million tokens
TIMEOUTS = {"connect_s": 1, "first_byte_s": 10, "total_s": 30}


@pytest.fixture(scope="module")
def upstream() -> Iterator[Scripted]:
    proc, s = start_scripted("--tokens", "16")
    yield s
    proc.stop()


@pytest.fixture(scope="module")
def gw(upstream: Scripted) -> Iterator[Gateway]:
    g = start_gateway(
        {
            "server": {"default_deadline_s": 30},
            "models": [
                {
                    "alias": "m",
                    "engine": {"kind": "openai", "base_url": upstream.url + "/v1"},
                    "price": PRICE,
                    "timeouts": TIMEOUTS,
                },
                {
                    "alias": "narrow",
                    "engine": {"kind": "openai", "base_url": upstream.url + "/v1"},
                    "limits": {"max_concurrency": 1, "queue": 8},
                    "timeouts": TIMEOUTS,
                },
            ],
        }
    )
    yield g
    g.proc.stop()


def _body(**over: Any) -> dict[str, Any]:
    return {
        "model": "m",
        "messages": [{"role": "user", "content": "plan the trip"}],
        "max_tokens": 100,
        **over,
    }


def _task(name: str) -> str:
    return f"{name}-{time.monotonic_ns()}"


def _wait_trace(gw: Gateway, rid: str) -> dict[str, Any]:
    return gw.trace(rid)


def _stage(trace: dict[str, Any], name: str) -> dict[str, Any]:
    return next(d for d in trace["decisions"] if d["stage"] == name)


def test_five_concurrent_steps_against_a_cost_budget_that_fits_three(
    gw: Gateway, upstream: Scripted
) -> None:
    body = _body()
    raw = orjson.dumps(body)
    price = Price(**PRICE)
    cost = plan(
        from_object(Generation, body)[0], len(raw), "m", None, 512, 1024, PromptOverhead(64)
    )
    estimate = cost.usd(price)
    # Room for three, and less than a minimal answer (16 tokens) beside them: a fourth
    # cannot shrink its cap to fit (policy/cost.py), it is refused.
    minimal = cost_usd(price, cost.prompt, 16)
    budget = estimate * 3 + minimal / 2
    task = _task("cost")
    upstream.fault("delay:600", count=5)  # all five are in flight together
    hdrs = {
        "x-task-id": task,
        "x-task-budget": f"cost_usd={budget:.9f}",
        "content-type": "application/json",
    }
    with concurrent.futures.ThreadPoolExecutor(5) as pool:
        replies = list(
            pool.map(lambda _: gw.post("/v1/chat/completions", content=raw, headers=hdrs), range(5))
        )
    codes = sorted(r.status_code for r in replies)
    assert codes == [200, 200, 200, 429, 429], [r.text for r in replies]
    refused = [r.json()["error"] for r in replies if r.status_code == 429]
    assert {e["code"] for e in refused} == {"task_budget_exceeded"}
    assert all(e["param"] == "cost_usd" and "cost_usd budget" in e["message"] for e in refused)
    # The ledger agrees: three calls charged, their cost within the budget.
    deadline = time.monotonic() + 10
    while True:
        rows = gw.usage(task=task)
        if len(rows) == 5 or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert sorted(r["status"] for r in rows) == ["error", "error", "ok", "ok", "ok"]
    assert sum(1 for r in rows if r["error_code"] == "task_budget_exceeded") == 2
    assert sum(r["cost_usd"] for r in rows) <= budget
    # The refusal is a decision with what the task had used and had left.
    rid = next(r.headers["x-request-id"] for r in replies if r.status_code == 429)
    d = _stage(_wait_trace(gw, rid), "task")
    assert d["outcome"] == "reject:cost_usd"
    assert d["evidence"]["remaining"]["cost_usd"] < estimate


def test_a_tenant_default_is_lowered_by_the_client_never_raised(gw: Gateway) -> None:
    tenant = "budgeted-" + str(time.monotonic_ns())
    gw.create_tenant(tenant, task_budget={"calls": 2})
    key = gw.create_key(tenant, task_budget={"calls": 5})["key"]  # a key cannot raise it
    task = _task("default")
    h = {"Authorization": f"Bearer {key}", "x-task-id": task, "x-task-budget": "calls=9"}
    codes = [
        httpx.post(gw.url + "/v1/chat/completions", json=_body(), headers=h, timeout=30).status_code
        for _ in range(3)
    ]
    assert codes == [200, 200, 429]
    # The header lowers it: one call only for a new task.
    h2 = {**h, "x-task-id": _task("lowered"), "x-task-budget": "calls=1"}
    codes = [
        httpx.post(
            gw.url + "/v1/chat/completions", json=_body(), headers=h2, timeout=30
        ).status_code
        for _ in range(2)
    ]
    assert codes == [200, 429]


def test_a_bad_task_header_is_a_400_naming_it(gw: Gateway) -> None:
    for name, value in (
        ("x-task-budget", "calls=lots"),
        ("x-task-timeout", "1_0"),
        ("x-task-deadline", "soon"),
    ):
        r = gw.post(
            "/v1/chat/completions", json=_body(), headers={"x-task-id": _task("bad"), name: value}
        )
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["code"] == "invalid_header" and err["param"] == name


def test_the_task_deadline_cuts_a_later_steps_timeout(gw: Gateway, upstream: Scripted) -> None:
    task = _task("deadline")
    h = {"x-task-id": task, "x-task-timeout": "1.5"}
    assert gw.post("/v1/chat/completions", json=_body(), headers=h).status_code == 200
    upstream.fault("delay:5000", count=1)
    t0 = time.monotonic()
    r = gw.post("/v1/chat/completions", json=_body(), headers=h)
    assert r.status_code == 504, r.text
    assert time.monotonic() - t0 < 4.0  # the task's 1.5 s, not the request's 30 s
    d = _stage(_wait_trace(gw, r.headers["x-request-id"]), "task")
    assert d["evidence"]["deadline_cut"] is True
    # Past the deadline, a call is refused before anything else.
    time.sleep(max(0.0, 1.6 - (time.monotonic() - t0)))
    r = gw.post("/v1/chat/completions", json=_body(), headers=h)
    assert r.status_code == 504 and r.json()["error"]["code"] == "task_deadline_exceeded"


def test_a_queued_step_past_the_task_deadline_is_never_sent_upstream(
    gw: Gateway, upstream: Scripted
) -> None:
    upstream.fault("delay:2500", count=1)
    before = upstream.requests()
    holder = threading.Thread(
        target=lambda: gw.post("/v1/chat/completions", json=_body(model="narrow"))
    )
    holder.start()  # takes narrow's only slot for 2.5 s
    time.sleep(0.5)
    r = gw.post(
        "/v1/chat/completions",
        json=_body(model="narrow"),
        headers={"x-task-id": _task("queued"), "x-task-timeout": "1"},
    )
    holder.join()
    assert r.status_code == 504 and r.json()["error"]["code"] == "deadline_exceeded", r.text
    assert upstream.requests() == before + 1  # only the holder's call went upstream


def _read_stream(gw: Gateway, task: str, out: list[Any], started: threading.Event) -> None:
    body = _body(stream=True)
    with gw.stream(body, headers={"x-task-id": task}) as r:
        out.append(r.status_code)
        for line in r.iter_lines():
            if line.startswith("data: "):
                started.set()
                out.append(line[6:])


def test_cancel_stops_the_tasks_streams_and_refuses_new_calls(
    gw: Gateway, upstream: Scripted
) -> None:
    task = _task("cancel")
    upstream.fault("slow:300", count=2)  # 16 events x 0.3 s: about 5 s each
    outs: list[list[Any]] = [[], []]
    events = [threading.Event(), threading.Event()]
    threads = [
        threading.Thread(target=_read_stream, args=(gw, task, outs[i], events[i])) for i in range(2)
    ]
    for t in threads:
        t.start()
    assert all(e.wait(10) for e in events)
    # Another tenant cannot see or cancel it.
    other = "other-" + str(time.monotonic_ns())
    gw.create_tenant(other)
    okey = gw.create_key(other)["key"]
    r = httpx.delete(
        f"{gw.url}/v1/tasks/{task}", headers={"Authorization": f"Bearer {okey}"}, timeout=10
    )
    assert r.status_code == 404
    r = httpx.delete(f"{gw.url}/v1/tasks/{task}", headers=gw.auth, timeout=10)
    assert r.status_code == 200, r.text
    report = r.json()
    assert report["cancelled"] is True
    assert len(report["running"]) == 2 and sorted(report["stopped"]) == sorted(report["running"])
    for t in threads:
        t.join(10)
        assert not t.is_alive()
    for out in outs:
        assert out[0] == 200
        last = json.loads(out[-1])
        assert last["error"]["code"] == "task_cancelled", out[-3:]
        assert "[DONE]" not in out
    # Both upstream connections were closed, so the engine stopped generating.
    deadline = time.monotonic() + 5
    while True:
        stats = httpx.get(upstream.url + "/stats").json()
        if stats["open_streams"] == 0 or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert stats["open_streams"] == 0 and stats["aborted"] >= 2
    r = gw.post("/v1/chat/completions", json=_body(), headers={"x-task-id": task})
    assert r.status_code == 409 and r.json()["error"]["code"] == "task_cancelled"
    # The report lists the stopped calls, and what was refused after the cancel.
    time.sleep(0.5)
    t = httpx.get(f"{gw.url}/admin/tasks/{task}", headers=gw.admin, timeout=10).json()["task"]
    gov = t["governance"]
    assert sorted(gov["stopped"]) == sorted(report["stopped"])
    assert gov["cancelled_at"] is not None
    assert gov["after_cancel"]["refused"] == 1


def test_cancel_a_non_streamed_call_in_flight(gw: Gateway, upstream: Scripted) -> None:
    task = _task("cancel-json")
    upstream.fault("delay:4000", count=1)
    out: list[httpx.Response] = []
    th = threading.Thread(
        target=lambda: out.append(
            gw.post("/v1/chat/completions", json=_body(), headers={"x-task-id": task})
        )
    )
    th.start()
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        r = httpx.get(f"{gw.url}/v1/tasks/{task}", headers=gw.auth, timeout=5)
        if r.status_code == 200 and r.json()["running"]:
            break
        time.sleep(0.05)
    r = httpx.delete(
        f"{gw.url}/admin/tasks/{task}", params={"tenant": _tenant(gw)}, headers=gw.admin
    )
    assert r.status_code == 200, r.text
    th.join(10)
    assert out[0].status_code == 409 and out[0].json()["error"]["code"] == "task_cancelled"
    assert r.json()["stopped"] == [out[0].headers["x-request-id"]]


def _tenant(gw: Gateway) -> str:
    r = httpx.get(f"{gw.url}/v1/tasks/none-such", headers=gw.auth, timeout=5)
    assert r.status_code == 404
    keys = httpx.get(f"{gw.url}/admin/keys", headers=gw.admin, timeout=5).json()["data"]
    prefix = gw.key[:10]
    return str(next(k["tenant_id"] for k in keys if k["prefix"] == prefix))


# -- the shared store: the same answers as the in-process one --------------------------

steps = st.lists(
    st.one_of(
        st.tuples(
            st.just("admit"),
            st.sampled_from(["a", "a", "a", "b"]),
            st.sampled_from([0, 300, 400, 500]),
            st.sampled_from([0.0, 0.03, 0.04]),
        ),
        st.tuples(
            st.just("admit"),
            st.sampled_from(["a", "b", "c", "c"]),  # three tasks, room for two
            st.sampled_from([0, 300, 400, 500]),  # tokens: sums land on the budget's edge
            st.sampled_from([0.0, 0.03, 0.04]),
        ),
        # A tool call through /mcp: one of tool_calls, no tokens, its price as cost.
        st.tuples(
            st.just("tool"),
            st.sampled_from(["a", "b", "c"]),
            st.just(0),
            st.sampled_from([0.0, 0.02, 0.05]),
        ),
        st.tuples(
            st.just("settle"),
            st.integers(0, 30),
            st.sampled_from([0, 100, 300]),
            st.sampled_from([0.0, 0.01]),
        ),
        st.tuples(st.just("cancel"), st.sampled_from(["a", "b", "c"])),
        # Notes on one task often enough to pass its cap of three (ids repeat too).
        st.tuples(st.just("note"), st.just(0), st.sampled_from(["x", "y", "z", "w", "v"])),
        st.tuples(st.just("note"), st.integers(0, 30), st.sampled_from(["x", "y", "z", "w"])),
        st.tuples(st.just("tick"), st.sampled_from([1.0, 2.5])),
    ),
    min_size=1,
    max_size=40,
)


def test_the_redis_store_answers_as_the_memory_store(redis_url: str) -> None:
    """Over generated sequences of admits, settles, cancels, tool-call notes and clock
    ticks on three tasks, with room for two and three notes each, `RedisTaskStore`
    (its Lua scripts) gives every answer `MemoryTaskStore` gives: allowed or refused
    and why, the use after each step, which tasks are kept and which notes."""
    from hypothesis import settings as hsettings

    from switchyard.state.tasks_redis import RedisTaskStore

    first = TaskFirst(
        TaskBudget(calls=4, tokens=1000, cost_usd=0.1, wall_s=6, tool_calls=2), timeout_s=5
    )

    @hsettings(max_examples=150, deadline=None)
    @given(steps)
    def check(seq: list[Any]) -> None:
        async def go() -> None:
            mem = MemoryTaskStore(max_tasks=2, max_calls=3)
            # A fresh client per example: a generous connect timeout, as a loaded CI
            # machine can take longer than the default 0.5 s to accept one.
            red = RedisTaskStore(
                redis_url,
                prefix=f"prop{time.monotonic_ns()}:",
                timeout_s=5,
                max_tasks=2,
                max_calls=3,
            )
            now, admitted = 1000.0, []
            try:
                for step in seq:
                    if step[0] in ("admit", "tool"):
                        key = ("t", step[1])
                        rid = f"r{len(admitted)}"
                        tool = step[0] == "tool"
                        a = await mem.admit(key, first, rid, step[2], step[3], now, tool)
                        b = await red.admit(key, first, rid, step[2], step[3], now, tool)
                        assert (a.allowed, a.refused) == (b.allowed, b.refused)
                        assert a.used == pytest.approx(b.used)
                        assert a.budget == b.budget
                        assert (a.deadline_at, a.deadline_by) == (b.deadline_at, b.deadline_by)
                        if a.allowed:
                            admitted.append((key, rid))
                    elif step[0] == "settle" and admitted:
                        key, rid = admitted[step[1] % len(admitted)]
                        called = step[1] % 3 != 0
                        await mem.settle(key, rid, step[2], step[3], called)
                        await red.settle(key, rid, step[2], step[3], called)
                    elif step[0] == "cancel":
                        a2 = await mem.cancel(("t", step[1]), now)
                        b2 = await red.cancel(("t", step[1]), now)
                        assert (a2 is None) == (b2 is None)
                    elif step[0] == "note" and admitted:
                        key, rid = admitted[step[1] % len(admitted)]
                        notes = [ToolCallNote(f"call_{step[2]}", "t", "side_effect", rid, None)]
                        await mem.note_tool_calls(key, notes)
                        await red.note_tool_calls(key, notes)
                    elif step[0] == "tick":
                        now += step[1]
                for name in ("a", "b", "c"):
                    a3 = await mem.describe(("t", name), now)
                    b3 = await red.describe(("t", name), now)
                    assert (a3 is None) == (b3 is None)
                    if a3 is not None and b3 is not None:
                        assert a3["used"] == pytest.approx(b3["used"])
                        assert a3["budget"] == b3["budget"]
                        assert a3["refused"] == b3["refused"]
                        assert a3["cancelled_at"] == b3["cancelled_at"]
                        ids = sorted(c["call_id"] for c in a3["tool_calls"])
                        assert ids == sorted(c["call_id"] for c in b3["tool_calls"])
            finally:
                await red.close()

        asyncio.run(go())

    check()


def test_two_gateways_share_one_task_budget_through_redis(
    redis_url: str, upstream: Scripted
) -> None:
    config = {
        "storage": {"redis_url": redis_url},
        "models": [
            {
                "alias": "m",
                "engine": {"kind": "openai", "base_url": upstream.url + "/v1"},
                "timeouts": TIMEOUTS,
            }
        ],
    }
    a = start_gateway(config)
    b = start_gateway(config, db=a.db)
    try:
        b.key = a.key
        task = _task("shared")
        h = {"x-task-id": task, "x-task-budget": "calls=3"}
        codes = [
            g.post("/v1/chat/completions", json=_body(), headers=h).status_code
            for g in (a, b, a, b)
        ]
        assert codes == [200, 200, 200, 429]
        # A cancel through one gateway stops the task's stream on the other, and
        # refuses the task's later calls there.
        task2 = _task("shared-cancel")
        upstream.fault("slow:300", count=1)
        out: list[Any] = []
        started = threading.Event()
        reader = threading.Thread(target=_read_stream, args=(b, task2, out, started))
        reader.start()
        assert started.wait(10)
        assert httpx.delete(f"{a.url}/v1/tasks/{task2}", headers=a.auth).status_code == 200
        reader.join(10)
        assert not reader.is_alive()
        assert json.loads(out[-1])["error"]["code"] == "task_cancelled"
        r = b.post("/v1/chat/completions", json=_body(), headers={"x-task-id": task2})
        assert r.status_code == 409 and r.json()["error"]["code"] == "task_cancelled"
    finally:
        a.proc.stop()
        b.proc.stop()


def test_the_task_report_governance_section_is_exact() -> None:
    """On known records: budget use, refusals by cause, the goodput against the
    deadline, what the cancel stopped and what came after, and the tool calls."""
    from switchyard.observe.render import render_task
    from switchyard.observe.tasks import analyze_task

    def rec(
        rid: str, at: float, ms: float, status: str, *decisions: dict[str, Any]
    ) -> dict[str, Any]:
        return {
            "request_id": rid,
            "task_id": "T",
            "received_at": at,
            "status": status,
            "timings": {"duration_ms": ms},
            "decisions": list(decisions),
        }

    def task(outcome: str, at: float, **ev: Any) -> dict[str, Any]:
        return {"stage": "task", "outcome": outcome, "started_at": at, "evidence": ev}

    budget = {"calls": 3}
    records = [
        rec("r1", 100.0, 1000, "ok",
            task("admitted", 100.0, budget=budget, used={"calls": 1}, deadline_at=110.0),
            {"stage": "tool_calls", "outcome": "blocked:1", "started_at": 101.0, "evidence": {
                "calls": [
                    {"name": "wire", "class": "side_effect", "action": "blocked"},
                    {"name": "ticket", "class": "side_effect", "action": "relayed",
                     "id": "call_sy_ab", "idempotency_key": "ab"},
                ]}}),
        rec("r2", 101.5, 9000, "ok",  # ends at 110.5: after the deadline
            task("admitted", 101.5, budget=budget, used={"calls": 2}, deadline_at=110.0)),
        rec("r3", 102.0, 500, "error", task("reject:calls", 102.0, budget=budget, used={"calls": 2})),
        rec("r4", 103.0, 4000, "cancelled",
            task("admitted", 103.0, budget=budget, used={"calls": 3}, deadline_at=110.0),
            task("stopped", 105.0)),
        rec("r5", 106.0, 1, "error", task("reject:cancelled", 106.0, cancelled_at=105.0),
            {"stage": "tool_results", "outcome": "duplicate:1", "started_at": 106.0, "evidence": {
                "duplicates": [{"call_id": "call_sy_ab", "tool": "ticket", "results": 2}],
                "approved": [{"call_id": "x", "tool": "mail", "approver": "ops"}]}}),
    ]  # fmt: skip
    g = analyze_task(records)["governance"]
    assert g["budget"] == budget and g["used"] == {"calls": 3}
    assert g["refused"] == {"calls": 1, "cancelled": 1} and g["refused_by_budget"] == 1
    assert g["goodput"] == {"deadline_at": 110.0, "ok_by_deadline": 1, "steps": 5, "ratio": 0.2}
    assert g["cancelled_at"] == 105.0 and g["stopped"] == ["r4"]
    assert g["after_cancel"] == {"refused": 1, "ran": [], "ended_after": ["r2", "r4"]}
    assert [c["name"] for c in g["tool_calls"]] == ["wire", "ticket"]
    assert [c["name"] for c in g["side_effects"]] == ["ticket"]
    assert g["duplicate_results"][0]["call_id"] == "call_sy_ab"
    assert g["approvals"] == [
        {"request_id": "r5", "call_id": "x", "tool": "mail", "approver": "ops"}
    ]
    text = render_task(analyze_task(records), records)
    assert "budget: calls 3/3" in text
    assert "goodput: 1 of 5 steps ok by the task's deadline" in text
    assert "cancelled: stopped r4; after it 1 refused, 0 ran, 2 still ending" in text
    assert "r1: wire (side_effect) blocked" in text
    assert "approved: x (mail) by ops" in text


def test_a_tasks_deployment_is_one_record_for_every_gateway(redis_url: str) -> None:
    """Task affinity lives in the task store: a task's steps, alternating between two
    gateways that share Redis, stay on the one deployment the first step got — which
    two gateways with only their own affinity maps would agree on by chance only."""
    ups = [start_scripted() for _ in range(2)]
    config = {
        "storage": {"redis_url": redis_url},
        "models": [
            {
                "alias": "pair",
                "timeouts": TIMEOUTS,
                "balance": {"strategy": "weighted"},
                "deployments": [
                    {"name": f"d{i}", "engine": {"kind": "openai", "base_url": s.url + "/v1"}}
                    for i, (_, s) in enumerate(ups)
                ],
            }
        ],
    }
    a = start_gateway(config)
    b = start_gateway(config, db=a.db)
    try:
        b.key = a.key
        served: dict[str, set[str]] = {}
        for n in range(8):
            task = _task(f"affinity-{n}")
            for step in range(4):
                g = (a, b)[step % 2]
                r = g.post(
                    "/v1/chat/completions", json=_body(model="pair"), headers={"x-task-id": task}
                )
                assert r.status_code == 200, r.text
                served.setdefault(task, set()).add(r.headers["x-switchyard-upstream"])
        assert all(len(v) == 1 for v in served.values()), served
        # Both deployments served some task: the choice itself was not fixed.
        assert len(set().union(*served.values())) == 2
        state = httpx.get(f"{a.url}/v1/tasks/{task}", headers=a.auth).json()
        assert set(state["deployments"]) == {"pair"}
    finally:
        a.proc.stop()
        b.proc.stop()
        for proc, _ in ups:
            proc.stop()


def test_a_task_call_cancelled_while_its_admission_is_on_the_wire_holds_nothing() -> None:
    """A call's admission is sent and then its caller is cancelled while Redis is
    paused (the task's own cancel fans out so; shutdown too). The caller gets its
    cancellation at once; the admission still runs, and the call it held is settled
    unused when its reply comes in: a task allowed one call admits the next one."""
    import signal

    from support.redis_server import start_redis, stop_redis
    from switchyard.state.tasks_redis import RedisTaskStore

    proc, url = start_redis()
    first = TaskFirst(TaskBudget(calls=1, tokens=1000))
    key = ("acme", "t-cut")

    async def main() -> list[bool]:
        store = RedisTaskStore(url, prefix="cut:", timeout_s=5)
        try:
            # Connected first: the cancel must land on the script, not on the connect.
            assert (await store.admit(("acme", "warm"), first, "w", 1, 0.0, 999.0)).allowed
            proc.send_signal(signal.SIGSTOP)
            task = asyncio.create_task(store.admit(key, first, "r1", 10, 0.0, 1000.0))
            await asyncio.sleep(0.2)  # sent, waiting for the reply
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            proc.send_signal(signal.SIGCONT)
            await asyncio.sleep(0.3)  # the reply comes in; the held call is settled
            again = await store.admit(key, first, "r2", 10, 0.0, 1001.0)
            third = await store.admit(key, first, "r3", 10, 0.0, 1002.0)
            return [again.allowed, third.allowed]
        finally:
            proc.send_signal(signal.SIGCONT)
            await store.close()

    try:
        outcome = asyncio.run(main())
    finally:
        stop_redis(proc)
    # r1 held nothing in the end: r2 is the task's one call, and r3 is over budget.
    assert outcome == [True, False]
