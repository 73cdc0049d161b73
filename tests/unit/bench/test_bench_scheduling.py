"""The scheduling benchmark's workload and accounting (bench/scheduling.py), and the
scripted upstream's capacity model it relies on."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from support.paths import REPO
from switchyard.bench import agent, scheduling
from switchyard.bench.harness import stop_all
from switchyard.bench.metrics import RequestRecord
from switchyard.bench.scripted_upstream import ScriptedUpstream

WORKLOAD = REPO / "examples" / "bench" / "scheduling.yaml"


def test_the_committed_workload_offers_the_loads_it_names() -> None:
    w = scheduling.load_workload(str(WORKLOAD))
    assert [s.id for s in w.graph.steps] == ["plan", "search_a", "search_b", "search_c", "answer"]
    assert w.task_work_s == pytest.approx(0.5 + 3 * 0.3 + 0.9)
    for x in w.loads:  # slot-seconds offered per second = load x concurrency
        offered = w.task_rate(x) * (w.task_work_s + w.interactive_per_task * w.interactive_work_s)
        assert offered == pytest.approx(x * w.concurrency)
    for s in w.graph.steps:  # every step carries the task deadline and the cap
        assert s.headers["x-task-timeout"] == "8" and s.max_tokens == w.max_tokens
        assert scheduling.step_tokens(s) < w.max_tokens


def test_every_scheduler_gets_the_same_arrivals_and_loads_differ() -> None:
    w = scheduling.load_workload(str(WORKLOAD), duration_s=30)
    a, b = scheduling.schedule(w, 1.5), scheduling.schedule(w, 1.5)
    assert a == b and a == sorted(a)
    assert {k for _, k in a} == {"task", "interactive"}
    assert len(scheduling.schedule(w, 2.0)) > len(scheduling.schedule(w, 0.8))
    with pytest.raises(ValueError):
        scheduling.parse_schedulers("fcfs,lifo")


def _rec(
    i: int, ok: bool, tokens: int, end: float, status: int = 200, code: str | None = None
) -> RequestRecord:
    r = RequestRecord(i, f"r{i}", 0.0, 0.0, end_s=end, ok=ok, status=status, error_code=code)
    r.input_tokens, r.output_tokens = tokens, tokens
    return r


def test_goodput_counts_tasks_within_deadline_and_waste_counts_the_others() -> None:
    w = scheduling.load_workload(str(WORKLOAD), duration_s=60)
    good = agent.TaskRecord("good", "t", 0, False, 0.0, 1)
    good.records["a"] = _rec(0, True, 10, 7.0)
    late = agent.TaskRecord("late", "t", 1, False, 0.0, 1)
    late.records["a"] = _rec(1, True, 20, 9.0)
    refused = agent.TaskRecord("refused", "t", 2, False, 0.0, 1)
    refused.records["a"] = _rec(2, False, 0, 0.1, 503, "overloaded")
    warm = agent.TaskRecord("warm", "t", 3, True, 0.0, 1)
    warm.records["a"] = _rec(3, True, 99, 1.0)
    s = scheduling.summarize(w, [good, late, refused, warm], [_rec(4, True, 1, 0.5)])
    assert (s["tasks"], s["tasks_good"], s["task_goodput_per_min"]) == (3, 1, 1.0)
    assert s["wasted_tokens"] == 40  # the late task's prompt and output
    assert s["step_refusals"] == {"503:overloaded": 1}
    assert s["interactive_ok"] == 1


def test_scripted_upstream_serves_at_most_its_concurrency_and_the_asked_length() -> None:
    async def probe() -> tuple[int, int, int]:
        app = ScriptedUpstream(tokens=16, concurrency=2, service_ms=10_000)
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://up") as client:
            body = {"model": "m", "messages": [{"role": "user", "content": "[[tokens:3]] hi"}]}
            calls = [
                asyncio.create_task(client.post("/v1/chat/completions", json=body))
                for _ in range(4)
            ]
            for _ in range(50):
                await asyncio.sleep(0)
            busy, arrived = app.busy, app.requests
            for c in calls:
                c.cancel()
            await asyncio.gather(*calls, return_exceptions=True)
            app.concurrency = None  # no capacity model: answered at once
            reply = await client.post("/v1/chat/completions", json=body)
            app.concurrency = 2
            app.service_ms = 0
            sized = await client.post("/v1/chat/completions", json={**body, "max_tokens": 50})
        assert reply.json()["usage"]["completion_tokens"] == 16  # marker read with capacity only
        return busy, arrived, sized.json()["usage"]["completion_tokens"]

    assert asyncio.run(probe()) == (2, 4, 3)


LLAMA = WORKLOAD.with_name("scheduling-llama.yaml")


@settings(max_examples=50, deadline=None)
@given(
    st.floats(0.0, 5.0),
    st.floats(0.0, 0.1),
    st.lists(st.integers(1, 4000), min_size=2, max_size=40).filter(lambda xs: len(set(xs)) > 1),
)
def test_fit_line_recovers_the_line_it_was_given(a: float, b: float, xs: list[int]) -> None:
    got = scheduling.fit_line([(x, a + b * x) for x in xs])
    if b > 0:
        assert got == pytest.approx((a, b), rel=1e-6, abs=1e-9)
    else:  # a flat line: its mean
        assert got == pytest.approx((a, 0.0), rel=1e-6, abs=1e-9)


def test_fit_line_never_gives_a_negative_time() -> None:
    # Noise that tilts the line below the origin: refit through it.
    a, b = scheduling.fit_line([(10, 0.1), (10, 0.1), (100, 1.5), (100, 1.5)])
    assert a == 0.0 and b == pytest.approx((10 * 0.1 * 2 + 100 * 1.5 * 2) / (2 * 100 + 2 * 10000))
    # Longer answers no slower: the mean, whatever the length.
    assert scheduling.fit_line([(10, 1.0), (100, 0.5)]) == pytest.approx((0.75, 0.0))


def test_the_llama_workload_measures_its_engine_before_it_runs(tmp_path: Path) -> None:
    w = scheduling.load_workload(str(LLAMA))
    assert w.real and w.concurrency == 4 and w.deadline_s == 0.0  # not known before measuring
    small = replace(w, concurrency=2)
    children: list[Any] = []
    try:
        port = scheduling.start_engine(small, tmp_path, children)
        m = asyncio.run(scheduling.calibrate(small, f"http://127.0.0.1:{port}", seconds=3.0))
    finally:
        stop_all(children)
    # Longer answers took longer; on a busy machine the intercept may fit to 0.
    assert m.service_ms >= 0 and m.token_ms > 0 and m.service_s(16) > 0
    assert m.deadline_s == pytest.approx(4.7 * m.critical_path_s())
    assert m.critical_path_s() == pytest.approx(m.service_s(32) + m.service_s(16) + m.service_s(64))
    assert m.interactive_slo_ms == pytest.approx(5 * m.interactive_work_s * 1000)
    assert m.interactive_timeout_s == pytest.approx(10 * m.interactive_work_s)
    for s in m.graph.steps:  # each step asks for its own length, with the measured deadline
        assert s.max_tokens == scheduling.step_tokens(s)
        assert float(s.headers["x-task-timeout"]) == pytest.approx(m.deadline_s, abs=1e-3)
    assert m.calibration is not None and m.calibration["requests"] >= 2
    # ignore_eos: the engine generated the lengths asked for (16 to 64 tokens a request)
    assert 16 <= m.calibration["mean_tokens"] <= 64
