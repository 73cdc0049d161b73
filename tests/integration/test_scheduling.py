"""The model queue's scheduling rules (policy/admission.py), on a controlled clock: the
order waiters are served in, and which are refused and why. No timings are asserted."""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from support.gateways import Gateway, start_gateway
from support.upstreams import Scripted, start_scripted
from switchyard.errors import DeadlineUnreachable, Overloaded, RateLimited, SwitchyardError
from switchyard.policy.admission import STANDARD, DeploymentGate, Priority, ServiceModel, SlotAsk


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def gate(policy: str = "task_aware", queue: int = 16, clock: Clock | None = None) -> DeploymentGate:
    return DeploymentGate("m", 1, queue, policy, 2.0, 0.8, clock or Clock())  # type: ignore[arg-type]


def trained(g: DeploymentGate, service_s: float = 1.0, tokens: int = 100) -> DeploymentGate:
    for _ in range(ServiceModel.MIN_SAMPLES):
        g.model.observe(service_s, tokens)
    return g


def task(name: str, step: int, planned: int = 5, priority: Priority = Priority.STANDARD) -> SlotAsk:
    return SlotAsk(priority, ("tenant", name), step, planned)


async def serve(
    g: DeploymentGate, waiters: list[tuple[str, float, SlotAsk]], before: Any = None
) -> list[str]:
    """Hold the one slot, queue `waiters` in this order, run `before` (moves the clock),
    then release one slot at a time; the labels in the order served (refusals as
    label:code)."""
    assert g.try_acquire() is not None
    order: list[str] = []

    async def one(label: str, deadline: float, ask: SlotAsk) -> None:
        try:
            await g.acquire(deadline, ask)
            order.append(label)
        except SwitchyardError as exc:
            order.append(f"{label}:{exc.code}")

    jobs = []
    for label, deadline, ask in waiters:
        jobs.append(asyncio.create_task(one(label, deadline, ask)))
        await asyncio.sleep(0)  # queued in this order
    if before is not None:
        before()
    for _ in waiters:
        g.release()
        for _ in range(3):
            await asyncio.sleep(0)
    await asyncio.gather(*jobs)
    return order


def run(coro: Any) -> Any:
    return asyncio.run(coro)


# -- order ------------------------------------------------------------------------------


def test_task_aware_serves_the_earliest_deadline_first_and_fcfs_the_first_arrival() -> None:
    waiters = [("late", 30.0, STANDARD), ("soon", 10.0, STANDARD), ("mid", 20.0, STANDARD)]
    assert run(serve(gate(), waiters)) == ["soon", "mid", "late"]
    assert run(serve(gate("fcfs"), waiters)) == ["late", "soon", "mid"]


def test_later_steps_of_admitted_tasks_go_before_new_tasks_first_steps() -> None:
    waiters = [
        ("new-first", 5.0, task("new", 1)),
        ("single", 40.0, STANDARD),
        ("old-step3", 50.0, task("old", 3)),
    ]
    # A first step's deadline is earlier, yet admitted work (and single calls) go first.
    assert run(serve(gate(), waiters)) == ["single", "old-step3", "new-first"]


def test_higher_classes_first_and_aging_lifts_a_waiting_batch_request() -> None:
    batch = SlotAsk(Priority.BATCH)
    waiters = [("batch", 5.0, batch), ("standard", 50.0, STANDARD)]
    assert run(serve(gate(), waiters)) == ["standard", "batch"]

    clock = Clock()
    g = gate(clock=clock)

    async def aged() -> list[str]:
        assert g.try_acquire() is not None
        first = asyncio.create_task(g.acquire(100.0, batch))  # queued at t=0
        await asyncio.sleep(0)
        clock.t = 3.9
        second = asyncio.create_task(g.acquire(50.0, STANDARD))  # queued at t=3.9
        await asyncio.sleep(0)
        clock.t = 4.0  # batch waited two aging periods: it now ranks as interactive
        g.release()
        for _ in range(3):
            await asyncio.sleep(0)
        done = ["batch" if first.done() else "", "standard" if second.done() else ""]
        g.release()
        await asyncio.gather(first, second)
        return done

    assert run(aged()) == ["batch", ""]


@settings(max_examples=40, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.integers(1, 100), st.sampled_from(list(Priority)), st.booleans(), st.booleans()
        ),
        min_size=1,
        max_size=8,
    )
)
def test_served_order_is_the_documented_key(
    waiters: list[tuple[int, Priority, bool, bool]],
) -> None:
    """On a still clock, task_aware serves by (class, new task's first step, deadline,
    arrival) and fcfs by arrival, whatever the waiters."""
    specs = []
    for i, (deadline, priority, in_task, first) in enumerate(waiters):
        ask = (
            SlotAsk(priority, ("t", str(i)), 1 if first else 2, 3) if in_task else SlotAsk(priority)
        )
        specs.append((str(i), float(deadline), ask))
    expected = sorted(
        range(len(specs)),
        key=lambda i: (int(specs[i][2].priority), specs[i][2].new_task, specs[i][1], i),
    )
    assert run(serve(gate(), specs)) == [str(i) for i in expected]
    assert run(serve(gate("fcfs"), specs)) == [str(i) for i in range(len(specs))]


# -- refusals -------------------------------------------------------------------------


def test_a_waiter_that_cannot_finish_in_time_is_refused_at_once() -> None:
    async def probe(g: DeploymentGate) -> str:
        assert g.try_acquire() is not None
        try:
            waiter = asyncio.create_task(g.acquire(0.5, STANDARD))
            await asyncio.sleep(0)
            if not waiter.done():
                waiter.cancel()
                return "queued"
            await waiter
            return "admitted"
        except DeadlineUnreachable as exc:
            assert exc.status == 504 and exc.evidence is not None
            assert exc.evidence["estimate"]["service_s"] == pytest.approx(1.0)
            return exc.code

    assert run(probe(trained(gate()))) == "deadline_unreachable"
    assert run(probe(gate())) == "queued"  # nothing learned yet: no refusal on a guess
    assert run(probe(trained(gate("fcfs")))) == "queued"


def test_a_waiter_whose_time_ran_out_while_queued_is_refused_when_its_turn_comes() -> None:
    clock = Clock()
    g = trained(gate(clock=clock))
    waiters = [("tight", 3.0, STANDARD), ("loose", 50.0, STANDARD)]

    def later() -> None:
        clock.t = 2.5  # 2.5 + 1.0 of service is past 3.0

    assert run(serve(g, waiters, later)) == ["tight:deadline_unreachable", "loose"]


def test_the_estimate_is_the_learned_length_of_each_step_not_the_cap() -> None:
    m = ServiceModel()
    for _ in range(ServiceModel.MIN_SAMPLES):
        m.observe(0.2, 10, (5, 1))
        m.observe(2.0, 500, (5, 5))
    first, last = m.estimate(task("a", 1)), m.estimate(task("a", 5))
    assert first is not None and last is not None
    assert (first.source, last.source) == ("step", "step")
    assert first.service_s == pytest.approx(0.2) and last.service_s == pytest.approx(2.0)
    unknown = m.estimate(STANDARD)  # no step: the model's mean length
    assert unknown is not None and unknown.source == "model"


@settings(max_examples=50, deadline=None)
@given(
    st.floats(0.0, 2.0),
    st.floats(0.0, 0.05),
    st.lists(st.integers(1, 2000), min_size=2, max_size=30).filter(lambda xs: len(set(xs)) > 1),
    st.integers(1, 4000),
)
def test_service_model_recovers_a_linear_service_time(
    a: float, b: float, xs: list[int], x: int
) -> None:
    m = ServiceModel()
    for _ in range(3):
        for n in xs:
            m.observe(a + b * n, n)
    got = m.service_s(x)
    assert got is not None and got == pytest.approx(a + b * x, rel=1e-6, abs=1e-6)


def test_a_new_task_is_refused_while_saturated_but_admitted_tasks_steps_are_queued() -> None:
    async def probe() -> list[str]:
        g = trained(gate())
        assert g.try_acquire() is not None
        out: list[str] = []
        # Task A: 5 steps of 1 s, 10 s left: 0 s wait + 5 s of work within 80 % of 10 s.
        a = asyncio.create_task(g.acquire(10.0, task("A", 1)))
        await asyncio.sleep(0)
        out.append("A queued" if not a.done() else "A refused")
        # Task B: 5 s of A's work ahead (its first step and four planned) + 5 s > 8 s.
        try:
            await g.acquire(10.0, task("B", 1))
        except Overloaded as exc:
            assert exc.status == 503 and exc.headers["Retry-After"] == "5"
            assert exc.evidence is not None and exc.evidence["admission"]["wait_s"] == 5.0
            out.append(f"B {exc.code}")
        # A step of an admitted task with the same deadline is queued, ahead of A's start.
        c = asyncio.create_task(g.acquire(10.0, task("C", 3)))
        await asyncio.sleep(0)
        out.append("C queued" if not c.done() else "C refused")
        g.release()
        for _ in range(3):
            await asyncio.sleep(0)
        out.append("C served first" if c.done() and not a.done() else "A served first")
        g.release()
        await asyncio.gather(a, c)
        return out

    assert run(probe()) == ["A queued", "B overloaded", "C queued", "C served first"]


def test_a_full_queue_gives_a_new_tasks_place_to_an_admitted_tasks_step() -> None:
    async def probe(policy: str) -> list[str]:
        g = gate(policy, queue=1)
        assert g.try_acquire() is not None
        first = asyncio.create_task(g.acquire(10.0, task("new", 1)))
        await asyncio.sleep(0)
        later = asyncio.create_task(g.acquire(10.0, task("old", 2)))
        for _ in range(3):
            await asyncio.sleep(0)
        out = []
        for name, job in (("later", later), ("first", first)):
            if not job.done():
                out.append(f"{name} queued")
            elif (exc := job.exception()) is not None:
                assert isinstance(exc, (RateLimited, Overloaded))
                out.append(f"{name} {exc.code}")
        for job in (later, first):
            job.cancel()
        await asyncio.gather(later, first, return_exceptions=True)
        return out

    assert run(probe("task_aware")) == ["later queued", "first overloaded"]
    assert run(probe("fcfs")) == ["later queue_full", "first queued"]


def test_same_class_tasks_due_later_do_not_count_as_work_ahead_of_a_new_task() -> None:
    """Tenant X's tasks are due in 1000 s; tenant Y's new task, due in 10 s, ranks ahead
    of their later steps (earliest deadline first), so only X's step queued now (a later
    step: it goes before any new task's first step) is work ahead of it."""

    async def probe() -> tuple[list[str], dict[str, Any]]:
        g = trained(gate())
        assert g.try_acquire() is not None  # the one slot is held
        served: list[str] = []
        evidence: dict[str, Any] = {}

        async def one(label: str, deadline: float, ask: SlotAsk) -> None:
            admission = await g.acquire(deadline, ask)
            served.append(label)
            if label == "y":
                evidence.update(admission.evidence or {})

        jobs = []
        for label, ask in (("x1 step 2", task("x1", 2, 30)), ("x2 step 1", task("x2", 1, 30))):
            jobs.append(asyncio.create_task(one(label, 1000.0, ask)))
            await asyncio.sleep(0)
        # Before: 59 s of X's steps counted (both queued, 28 + 29 planned): 503.
        # Now: x1's queued step, 1 s, + 5 s of Y's own within 80 % of 10 s.
        jobs.append(asyncio.create_task(one("y", 10.0, task("y", 1, 5))))
        for _ in range(3):
            await asyncio.sleep(0)
        assert not jobs[-1].done(), jobs[-1].exception()
        for _ in jobs:
            g.release()
            for _ in range(3):
                await asyncio.sleep(0)
        await asyncio.gather(*jobs)
        return served, evidence["admission"]

    served, admission = run(probe())
    assert served == ["x1 step 2", "y", "x2 step 1"]  # the order the estimate assumed
    assert admission["backlog_s"] == 1.0 and admission["wait_s"] == 1.0


def test_work_ahead_of_a_new_task_is_its_class_due_no_later_or_a_higher_class() -> None:
    """A same-class task due earlier still counts (its steps run first), as does a
    higher class due whenever; a same-class task due later does not."""

    def backlog(others: list[tuple[float, SlotAsk]]) -> tuple[str, float]:
        async def probe() -> tuple[str, float]:
            g = trained(gate())
            assert g.try_acquire() is not None  # the one slot is held
            jobs = []
            for deadline, ask in others:
                jobs.append(asyncio.create_task(g.acquire(deadline, ask)))
                await asyncio.sleep(0)
            assert not any(job.done() for job in jobs)  # each admitted
            verdict, seen = "queued", -1.0
            try:
                await asyncio.wait_for(g.acquire(10.0, task("y", 1, 5)), 0.05)
            except Overloaded as exc:
                assert exc.evidence is not None
                verdict, seen = exc.code, exc.evidence["admission"]["backlog_s"]
            except TimeoutError:
                pass  # queued: never handed the held slot
            for job in jobs:
                job.cancel()
            await asyncio.gather(*jobs, return_exceptions=True)
            return verdict, seen

        return run(probe())

    early = (9.0, task("early", 1, 5))  # 5 s of work, due before Y
    far = (1000.0, task("far", 1, 30))  # 30 s, due long after Y
    urgent_far = (1000.0, task("urgent", 1, 30, Priority.INTERACTIVE))
    batch_early = (9.0, task("batch", 1, 5, Priority.BATCH))
    # Y (5 steps, 10 s): 5 s ahead + 5 s of its own is past 8 s: refused, the far task
    # not counted.
    assert backlog([early, far]) == ("overloaded", 5.0)
    assert backlog([far, early]) == ("overloaded", 5.0)
    assert backlog([far])[0] == "queued"
    # A higher class ranks ahead whatever its deadline; a lower one only when due first.
    assert backlog([urgent_far]) == ("overloaded", 30.0)
    assert backlog([batch_early]) == ("overloaded", 5.0)
    assert backlog([(1000.0, task("lazy", 1, 30, Priority.BATCH))])[0] == "queued"


HOLD = SlotAsk(Priority.STANDARD, ("t", "hold"), 2, None)  # holds a slot, plans nothing


def second_task_verdict(prepare: Any = None) -> tuple[str, dict[str, Any]]:
    """Two slots held, task A (5 steps of 1 s, 9 s left) queued: what becomes of task B
    (5 steps, 10 s left) after `prepare(gate, clock)`, and the admission's evidence.
    A is due first, so all its work runs before B's steps: with both slots for tasks B
    waits 5 s of A's work / 2 slots + 5 s of its own = 7.5 s, within 80 % of its 10 s;
    with one slot, 10 s, past it."""

    async def probe() -> tuple[str, dict[str, Any]]:
        clock = Clock()
        g = trained(DeploymentGate("m", 2, 16, "task_aware", 2.0, 0.8, clock))
        if prepare is not None:
            prepare(g, clock)
        assert g.try_acquire(HOLD) is not None and g.try_acquire(HOLD) is not None
        a = asyncio.create_task(g.acquire(clock.t + 9.0, task("A", 1)))
        b = asyncio.create_task(g.acquire(clock.t + 10.0, task("B", 1)))
        for _ in range(3):
            await asyncio.sleep(0)
        verdict, evidence = "queued", {}
        if b.done():
            exc = b.exception()
            assert isinstance(exc, Overloaded) and exc.evidence is not None
            verdict, evidence = exc.code, exc.evidence["admission"]
        for job in (a, b):
            job.cancel()
        await asyncio.gather(a, b, return_exceptions=True)
        return verdict, evidence

    return run(probe())


def singles(n: int, priority: Priority = Priority.STANDARD) -> Any:
    """`n` single calls arrive at once (each served at once and answered in 1 s)."""
    ask = STANDARD if priority is Priority.STANDARD else SlotAsk(priority)

    def prepare(g: DeploymentGate, clock: Clock) -> None:
        for _ in range(n):
            assert g.try_acquire(ask) is not None
            g.release(1.0, 100, ask)

    return prepare


def test_single_calls_keep_arriving_so_a_new_task_counts_the_slots_they_take() -> None:
    assert second_task_verdict()[0] == "queued"
    # 30 single calls in the 30 s window: one a second, 1 s each: one slot is theirs.
    verdict, evidence = second_task_verdict(singles(30))
    assert verdict == "overloaded"
    assert evidence["capacity"] == {"slots": 1.0, "single_calls": 1.0, "other_clients": 0}
    assert evidence["wait_s"] == 5.0
    # Batch calls rank below a standard task: they take nothing from it.
    assert second_task_verdict(singles(30, Priority.BATCH))[0] == "queued"
    assert second_task_verdict(singles(30, Priority.INTERACTIVE))[0] == "overloaded"


def test_the_single_calls_rate_decays_with_time() -> None:
    def then_quiet(g: DeploymentGate, clock: Clock) -> None:
        singles(30)(g, clock)
        clock.t = 2 * DeploymentGate.SINGLES_WINDOW_S  # e^-2 of a slot left: 1.86 slots

    assert second_task_verdict(then_quiet)[0] == "queued"


def test_other_clients_requests_at_the_engines_take_capacity() -> None:
    def busy(g: DeploymentGate, clock: Clock) -> None:
        g.others = lambda: 1

    verdict, evidence = second_task_verdict(busy)
    assert verdict == "overloaded"
    assert evidence["capacity"]["other_clients"] == 1 and evidence["capacity"]["slots"] == 1.0

    def absurd(g: DeploymentGate, clock: Clock) -> None:
        g.others = lambda: 10**12  # never below one slot, never an error

    verdict, evidence = second_task_verdict(absurd)
    assert verdict == "overloaded" and evidence["capacity"]["slots"] == 1.0


def test_a_single_calls_expected_length_is_learned_apart_from_tasks_steps() -> None:
    m = ServiceModel()
    for _ in range(ServiceModel.MIN_SAMPLES):
        m.observe(0.2, 10, STANDARD.step_key)
        m.observe(2.0, 500, (5, 5))
    single = m.estimate(SlotAsk(Priority.INTERACTIVE))
    assert single is not None and single.source == "step"
    assert single.service_s == pytest.approx(0.2)


def test_a_flood_of_new_tasks_gives_up_the_least_recently_seen_record_only() -> None:
    g = gate()
    g.MAX_TASKS = 3  # type: ignore[misc]
    g.max_concurrency = None  # every call takes a slot at once: only the records matter
    for name in ("A", "B", "C"):
        assert g.try_acquire(task(name, 1), 100.0) is not None
    assert g.try_acquire(task("A", 2), 100.0) is not None  # A seen again: now the newest
    assert g.try_acquire(task("D", 1), 100.0) is not None  # full: B, the oldest, goes
    assert [k[1] for k in g._tasks] == ["C", "A", "D"]
    assert g._tasks[("tenant", "A")].seen == 2  # A's progress kept


# -- through the gateway ------------------------------------------------------------------


@pytest.fixture(scope="module")
def gw(scripted: Scripted) -> Iterator[Gateway]:
    model = {
        "alias": "one",
        "engine": {"kind": "openai", "base_url": scripted.url + "/v1"},
        "limits": {"max_concurrency": 1, "queue": 4},
    }
    g = start_gateway({"models": [model], "embeddings": {"enabled": False}})
    yield g
    g.proc.stop()


def _chat(gw: Gateway, **headers: str) -> httpx.Response:
    body = {"model": "one", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
    return httpx.post(
        gw.url + "/v1/chat/completions", json=body, headers={**gw.auth, **headers}, timeout=30
    )


def test_priority_header_is_checked_and_only_lowers(gw: Gateway) -> None:
    bad = _chat(gw, **{"x-switchyard-priority": "urgent"})
    assert bad.status_code == 400
    assert bad.json()["error"]["code"] == "invalid_header"
    assert bad.json()["error"]["param"] == "x-switchyard-priority"
    ok = _chat(gw, **{"x-switchyard-priority": "interactive"})  # asks higher: stays standard
    assert ok.status_code == 200


def test_gateway_refuses_an_unreachable_request_without_sending_it(
    gw: Gateway, scripted: Scripted
) -> None:
    learn = ServiceModel.MIN_SAMPLES + 3
    scripted.fault("delay:300", count=learn)
    for _ in range(learn):  # the model learns: about 0.3 s a request
        assert _chat(gw).status_code == 200
    scripted.fault("delay:2000", count=1)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        held = pool.submit(_chat, gw)  # holds the only slot for 2 s
        time.sleep(0.5)
        before = scripted.requests()
        refused = _chat(gw, **{"x-request-timeout": "0.2"})
        assert scripted.requests() == before  # never sent
        assert held.result().status_code == 200
    assert refused.status_code == 504
    err = refused.json()["error"]
    assert err["code"] == "deadline_unreachable" and err["type"] == "timeout_error"
    assert "Traceback" not in err["message"]
    trace = gw.trace(refused.headers["x-request-id"])
    queue = [d for d in _decisions(trace) if d["stage"] == "queue"]
    assert queue and queue[-1]["outcome"] == "reject:deadline_unreachable"
    evidence = queue[-1]["evidence"]
    assert evidence["policy"] == "task_aware" and evidence["class"] == "standard"
    assert evidence["estimate"]["service_s"] > 0.2  # more than the time it had


def _decisions(trace: dict[str, Any]) -> list[dict[str, Any]]:
    found = trace.get("decisions") or trace.get("trace", {}).get("decisions") or []
    return list(found)


def test_the_class_is_the_tenants_lowered_by_the_header(gw: Gateway, scripted: Scripted) -> None:
    tenant = "t-inter-" + str(time.monotonic_ns())[-6:]
    gw.create_tenant(tenant, priority="interactive")
    key = gw.create_key(tenant, priority="interactive")["key"]  # the lower of the two counts
    scripted.fault("delay:1500", count=1)
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        held = pool.submit(_chat, gw)  # holds the only slot
        time.sleep(0.5)
        auth = {"Authorization": f"Bearer {key}", "x-request-timeout": "20"}
        own = pool.submit(_chat, gw, **auth)
        lowered = pool.submit(_chat, gw, **auth, **{"x-switchyard-priority": "batch"})
        replies = [held.result(), own.result(), lowered.result()]
    assert [r.status_code for r in replies] == [200, 200, 200]
    classes = []
    for r in replies[1:]:
        queue = [
            d for d in _decisions(gw.trace(r.headers["x-request-id"])) if d["stage"] == "queue"
        ]
        classes.append(queue[-1]["evidence"]["class"])
    assert classes == ["interactive", "batch"]


def test_the_engines_report_of_other_clients_reaches_task_admission() -> None:
    """A gateway reading its upstream's /metrics: requests beyond its own are another
    client's, and the admission of a new task counts them (trace evidence)."""
    proc, s = start_scripted()
    model = {
        "alias": "busy",
        "engine": {"kind": "openai", "base_url": s.url + "/v1", "load_metrics": "vllm"},
        "limits": {"max_concurrency": 2, "queue": 4},
    }
    g = start_gateway(
        {
            "models": [model],
            "engines": {"state_interval_s": 0.1, "state_stale_s": 2.0},
            "embeddings": {"enabled": False},
        }
    )
    try:

        def chat(**headers: str) -> httpx.Response:
            body = {"model": "busy", "messages": [{"role": "user", "content": "hi"}]}
            return httpx.post(
                g.url + "/v1/chat/completions", json=body, headers={**g.auth, **headers}, timeout=30
            )

        for _ in range(ServiceModel.MIN_SAMPLES + 1):  # learn the service time
            assert chat().status_code == 200
        r = httpx.put(s.url + "/control/load", json={"running": 5, "waiting": 0}, timeout=5)
        assert r.status_code == 200
        s.fault("delay:1500", count=2)
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            held = [pool.submit(chat) for _ in range(2)]  # both slots, 1.5 s each
            time.sleep(0.6)  # held, and the engine read since
            step = chat(
                **{"x-task-id": "t-busy", "x-task-planned-steps": "3", "x-task-timeout": "30"}
            )
            assert all(h.result().status_code == 200 for h in held)
        assert step.status_code == 200, step.text
        queue = [
            d for d in _decisions(g.trace(step.headers["x-request-id"])) if d["stage"] == "queue"
        ]
        capacity = queue[-1]["evidence"]["admission"]["capacity"]
        assert capacity["other_clients"] == 3  # 5 at the engine, 2 of them ours
        assert capacity["slots"] == 1.0
    finally:
        g.proc.stop()
        proc.stop()
