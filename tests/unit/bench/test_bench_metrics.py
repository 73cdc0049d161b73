"""Metric math of the bench harness on recorded streams with known timestamps (no I/O)."""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import orjson
import pytest

from switchyard.bench import agent, compare, load
from switchyard.bench.metrics import RequestRecord, Slo, parse_slo, percentile, stats, summarize


def rec(
    sent: float,
    chunks: list[float],
    end: float,
    tokens: int | None = None,
    ok: bool = True,
    **kw: Any,
) -> RequestRecord:
    r = RequestRecord(index=kw.pop("index", 0), request_id=kw.pop("rid", "r"), sent_s=sent, **kw)
    r.chunk_s = chunks
    r.first_token_s = chunks[0] if chunks else None
    r.end_s = end
    r.output_tokens = len(chunks) if tokens is None else tokens
    r.input_tokens = 10
    r.ok = ok
    r.error = None if ok else "http_503"
    r.token_source = "server"
    return r


def test_ttft_e2e_tpot_itl_are_exact() -> None:
    r = rec(1.0, [1.1, 1.15, 1.25, 1.30], 1.32, tokens=4)
    assert r.ttft_ms == pytest.approx(100.0)
    assert r.e2e_ms == pytest.approx(320.0)
    assert r.tpot_ms == pytest.approx((320.0 - 100.0) / 3)
    assert r.itl_ms == pytest.approx([50.0, 100.0, 50.0])
    # TPOT uses token counts, not chunks: 8 tokens in these 4 chunks.
    assert rec(1.0, [1.1, 1.15, 1.25, 1.30], 1.32, tokens=8).tpot_ms == pytest.approx(220.0 / 7)
    # Fewer than two tokens: no decode phase, no TPOT.
    assert rec(0.0, [0.2], 0.3).tpot_ms is None
    sched = rec(2.0, [2.5], 2.6, scheduled_s=1.99)
    assert sched.lag_ms == pytest.approx(10.0)


def test_percentiles_interpolate_linearly_like_numpy() -> None:
    assert percentile([1, 2, 3, 4], 50) == pytest.approx(2.5)
    assert percentile([1, 2, 3, 4], 90) == pytest.approx(3.7)
    assert percentile([4, 1, 3, 2], 99) == pytest.approx(3.97)
    assert percentile([7], 99) == 7
    rng = random.Random(1)
    values = [rng.expovariate(1.0) for _ in range(501)]
    for q in (50, 90, 95, 99):
        assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)))
    s = stats([10.0, 20.0, 30.0, 40.0])
    assert s["n"] == 4 and s["mean"] == 25.0 and s["max"] == 40.0 and s["p50"] == 25.0
    assert stats([])["p99"] is None


def test_summary_goodput_and_exclusions() -> None:
    records = [
        rec(0.0, [0.1, 0.2, 0.3], 0.3, index=0),  # ttft 100, tpot 100, e2e 300: good
        rec(0.0, [0.6, 0.62], 0.62, index=1),  # ttft 600: misses ttft:500
        rec(0.5, [0.6, 1.0, 1.4], 1.4, index=2),  # tpot 400: misses tpot:200
        rec(1.0, [], 2.0, tokens=0, ok=False, index=3),  # failed
        rec(1.5, [1.6], 1.7, index=4),  # one token: passes tpot, ttft 100: good
        rec(-5.0, [-4.0], -3.0, index=5, warmup=True),  # warm-up: left out entirely
    ]
    s = summarize(records, parse_slo(["ttft:500", "tpot:200,e2e:1000"]))
    assert s["requests"] == 5 and s["warmup_requests"] == 1
    assert s["completed"] == 4 and s["failed"] == 1 and s["errors"] == {"http_503": 1}
    assert s["duration_s"] == pytest.approx(2.0)  # first measured send 0.0 .. last end 2.0
    assert s["good_requests"] == 2
    assert s["goodput"] == pytest.approx(1.0)
    assert s["request_throughput"] == pytest.approx(2.0)
    assert s["output_throughput"] == pytest.approx((3 + 2 + 3 + 1) / 2.0)
    assert s["total_token_throughput"] == pytest.approx((9 + 40) / 2.0)
    assert s["ttft_ms"]["n"] == 4 and s["ttft_ms"]["max"] == pytest.approx(600.0)
    assert s["itl_ms"]["n"] == 2 + 1 + 2  # gaps of the successful streams only
    assert s["tpot_ms"]["n"] == 3
    # Without SLOs every success is good.
    assert summarize(records, Slo())["good_requests"] == 4


def test_success_without_content_misses_a_ttft_slo() -> None:
    empty = rec(0.0, [], 0.1, tokens=0)
    assert not Slo(ttft_ms=1000).met(empty)
    assert Slo(e2e_ms=1000).met(empty)


def test_parse_slo_rejects_unknown_names() -> None:
    assert parse_slo(["ttft:250", "task:8000"]) == Slo(ttft_ms=250, task_ms=8000)
    assert parse_slo(["e2el:900"]) == Slo(e2e_ms=900)
    with pytest.raises(ValueError):
        parse_slo(["latency:5"])
    with pytest.raises(ValueError):
        parse_slo(["ttft:fast"])


class FakeContent:
    def __init__(self, reads: list[bytes]) -> None:
        self.reads = reads

    async def iter_any(self) -> AsyncIterator[bytes]:
        for data in self.reads:
            yield data


class FakeResponse:
    def __init__(self, reads: list[bytes]) -> None:
        self.content = FakeContent(reads)


class FakeClock(load.Clock):
    def __init__(self, times: list[float]) -> None:
        self.times = iter(times)

    def now(self) -> float:
        return next(self.times)


def event(obj: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def test_stream_parsing_times_the_first_content_event_not_the_role_event() -> None:
    role = event({"choices": [{"delta": {"role": "assistant"}}]})
    hello = event({"choices": [{"delta": {"content": "Hel"}}]})
    world = event({"choices": [{"delta": {"content": "lo"}}]})
    usage = event({"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 3}})
    reads = [role, hello[:10], hello[10:] + world, usage + b"data: [DONE]\n\n"]
    client = load.Client(load.Target("http://x", "m"), FakeClock([1.0, 1.2, 1.25, 1.4]))
    r = RequestRecord(0, "r", sent_s=0.9)
    asyncio.run(client._read_stream(FakeResponse(reads), r))  # type: ignore[arg-type]
    r.end_s, r.ok = 1.4, r.error is None
    assert r.ok and r.text == "Hello"
    # The first content event was completed by the third read (t=1.25), with the second.
    assert r.chunk_s == [1.25, 1.25]
    assert r.ttft_ms == pytest.approx(350.0)
    assert r.itl_ms == [0.0]
    assert (r.input_tokens, r.output_tokens, r.token_source) == (7, 3, "server")
    assert r.tpot_ms == pytest.approx((500.0 - 350.0) / 2)


def test_stream_without_done_is_incomplete() -> None:
    reads = [event({"choices": [{"delta": {"content": "x"}}]})]
    client = load.Client(load.Target("http://x", "m"), FakeClock([1.0]))
    r = RequestRecord(0, "r", sent_s=0.0)
    asyncio.run(client._read_stream(FakeResponse(reads), r))  # type: ignore[arg-type]
    assert r.error == "incomplete_stream"


def test_arrival_schedules() -> None:
    const = load.arrivals(4.0, "constant", 1.0, seed=0)
    assert [next(const) for _ in range(4)] == pytest.approx([0.0, 0.25, 0.5, 0.75])
    poisson = load.arrivals(10.0, "poisson", 1.0, seed=3)
    times = [next(poisson) for _ in range(5001)]
    assert times == sorted(times)
    assert times[-1] / 5000 == pytest.approx(0.1, rel=0.05)  # mean gap 1/rate
    gaps = np.diff(times)
    gamma = load.arrivals(10.0, "gamma", 0.25, seed=3)
    bursty = np.diff([next(gamma) for _ in range(5001)])
    assert np.std(bursty) > 1.5 * np.std(gaps)  # shape 0.25: cv 2 vs Poisson's 1
    ramp = load.arrivals(10.0, "constant", 1.0, seed=0, ramp_up_s=2.0)
    ramped = [next(ramp) for _ in range(40)]
    assert sum(1 for t in ramped if t < 1.0) < sum(1 for t in ramped if 2.0 <= t < 3.0)
    assert ramped[-1] - ramped[-2] == pytest.approx(0.1)  # steady rate after the ramp


def test_budget_counts_warmup_separately() -> None:
    b = load._Budget(warmup=2, num=3, duration_s=None, ramp_up_s=0.0)
    assert [b.take(0.0) for _ in range(6)] == [True, True, False, False, False, None]
    d = load._Budget(warmup=0, num=None, duration_s=1.0, ramp_up_s=0.5)
    assert d.take(0.1) is True  # inside the ramp-up: warm-up
    assert d.take(0.6) is False and d.take(1.5) is False and d.take(1.61) is None


def test_critical_path_follows_the_latest_parent() -> None:
    task = agent.TaskRecord("t", "g", 0, False, None, 4)
    times = {"a": (0.0, 0.1), "b": (0.1, 0.5), "c": (0.1, 0.2), "d": (0.5, 0.6)}
    for k, (s, e) in times.items():
        task.records[k] = rec(s, [s + 0.01], e, rid=k)
    task.parents = {"a": (), "b": ("a",), "c": ("a",), "d": ("b", "c")}
    path, ms = task.critical_path()
    assert path == ["a", "b", "d"] and ms == pytest.approx(600.0)
    assert task.e2e_ms == pytest.approx(600.0) and task.ok


def test_task_graph_validation() -> None:
    ok = agent.parse_graphs(
        {"steps": [{"id": "b", "prompt": "{a}!", "depends_on": ["a"]}, {"id": "a", "prompt": "x"}]},
        "t",
    )
    assert [s.id for s in ok[0].steps] == ["a", "b"]  # parents first
    assert agent.fill("use {a} not {z}", {"a": "A"}) == "use A not {z}"
    bad = [
        {
            "steps": [
                {"id": "a", "prompt": "x", "depends_on": ["b"]},
                {"id": "b", "prompt": "y", "depends_on": ["a"]},
            ]
        },
        {"steps": [{"id": "a", "prompt": "x", "depends_on": ["nope"]}]},
        {"steps": [{"id": "a", "prompt": "{b}"}, {"id": "b", "prompt": "y"}]},  # not an ancestor
        {"steps": []},
    ]
    for data in bad:
        with pytest.raises(ValueError):
            agent.parse_graphs(data, "t")


def test_compare_ratios() -> None:
    def result(rps: float, p99: float) -> dict[str, Any]:
        records = [rec(0.0, [0.1], p99 / 1000)]
        summary = summarize(records, Slo())
        summary["request_throughput"] = rps
        return {
            "metadata": {
                "workload": {"kind": "synthetic"},
                "load": {},
                "endpoint": "e",
                "model": "m",
            },
            "points": [{"label": "c=1", "summary": summary, "tasks_summary": None}],
        }

    rows = {key: (a, b) for _, key, a, b in compare.rows(result(10.0, 200.0), result(5.0, 300.0))}
    a, b = rows["request_throughput"]
    assert compare.ratio(a, b) == pytest.approx(0.5)
    a, b = rows["e2e_ms.p99"]
    assert compare.ratio(a, b) == pytest.approx(1.5)
    assert compare.ratio(0.0, 1.0) is None


def test_stream_parsing_handles_crlf_split_across_reads() -> None:
    one = b'data: {"choices": [{"delta": {"content": "a"}}]}\r\n\r'
    two = b'\ndata: {"choices": [{"delta": {"content": "b"}}]}\r\n\r\ndata: [DONE]\r\n\r\n'
    client = load.Client(load.Target("http://x", "m"), FakeClock([1.0, 2.0]))
    r = RequestRecord(0, "r", sent_s=0.0)
    asyncio.run(client._read_stream(FakeResponse([one, two]), r))  # type: ignore[arg-type]
    assert r.error is None and r.text == "ab" and r.chunk_s == [2.0, 2.0]


def test_soak_summary_reads_growth_drift_and_the_disk_limit() -> None:
    import argparse

    from switchyard.bench.soak import summarize

    def sl(t: float, n: int, in_use: float, disk: float, rss: float) -> dict[str, float]:
        return {"t_s": t, "requests": n, "rps": n / t, "p50_ms": 1.0, "p99_ms": 5.0,
                "errors": 0, "rss_mib": rss, "disk_mb": disk, "in_use_mb": in_use}  # fmt: skip

    args = argparse.Namespace(
        warmup_slices=1, max_disk_mb=10.0, duration=50, slice=10, connections=8,
        traces_sample_ok=1.0,
    )  # fmt: skip
    slices = [
        sl(10, 1000, 3.0, 3.5, 100.0),
        sl(20, 2000, 6.0, 6.5, 104.0),  # 3 KB per request so far
        sl(30, 3000, 9.8, 10.5, 105.0),  # past 90 % of the limit: retention's turn
        sl(40, 4000, 9.0, 10.4, 103.0),
        sl(50, 5000, 9.2, 10.4, 106.0),
    ]
    got = summarize(slices, args)
    assert got["bytes_per_request"] == 3000.0
    assert got["rss_drift_after_warmup"] == round((106.0 - 104.0) / 104.0, 4)
    assert got["disk_limit_reached"] is True and got["disk_after_limit_mb"] == [10.4, 10.5]
    assert got["requests"] == 5000 and got["errors"] == 0
