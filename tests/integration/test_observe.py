"""Decision traces, agent tasks, Prometheus metrics, OpenTelemetry and retention."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import functools
import json
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client.parser import text_string_to_metric_families

from support.gateways import Gateway, local_model, start_gateway
from support.procs import free_port
from support.stores import fill_store
from support.upstreams import Scripted, start_scripted
from switchyard.observe.otel import Tracing
from switchyard.pipeline import RequestContext, RequestInput, Timings
from switchyard.request import NOT_READ, Generation
from switchyard.state.sql import connect
from switchyard.state.traces import enforce_retention, get_request, insert_sql

BODY: dict[str, Any] = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
SPANS = Path(tempfile.mkdtemp(prefix="switchyard-otel-")) / "spans.jsonl"


@pytest.fixture(scope="module")
def fast() -> Iterator[Scripted]:
    proc, s = start_scripted("--fault", "delay:100")
    yield s
    proc.stop()


@pytest.fixture(scope="module")
def slow() -> Iterator[Scripted]:
    proc, s = start_scripted("--fault", "delay:400")
    yield s
    proc.stop()


@pytest.fixture(scope="module")
def gw(scripted: Scripted, fast: Scripted, slow: Scripted) -> Iterator[Gateway]:
    dead = f"http://127.0.0.1:{free_port()}/v1"
    g = start_gateway(
        {
            "models": [
                {
                    "alias": "plain",
                    "revision": "p1",
                    "engine": {"kind": "openai", "base_url": scripted.url + "/v1"},
                },
                {
                    "alias": "flaky",
                    "engine": {"kind": "openai", "base_url": dead},
                    "resilience": {"retries": 1, "backoff_base_s": 0.01, "backoff_max_s": 0.02},
                    "fallbacks": ["plain"],
                },
                {"alias": "fast", "engine": {"kind": "openai", "base_url": fast.url + "/v1"}},
                {"alias": "slow", "engine": {"kind": "openai", "base_url": slow.url + "/v1"}},
            ],
            "embeddings": {"enabled": False},
            "observe": {"otel": {"exporter": "file", "path": str(SPANS)}},
        }
    )
    yield g
    g.proc.stop()


def _chat(gw: Gateway, model: str, key: str | None = None, **headers: str) -> httpx.Response:
    h = {"Authorization": f"Bearer {key or gw.key}", **headers}
    return httpx.post(
        gw.url + "/v1/chat/completions", json={**BODY, "model": model}, headers=h, timeout=30
    )


def _trace(gw: Gateway, rid: str) -> dict[str, Any]:
    r = httpx.get(gw.url + f"/admin/requests/{rid}", headers=gw.admin)
    assert r.status_code == 200, r.text
    return dict(r.json())


def _decisions(rec: dict[str, Any]) -> list[tuple[str, str]]:
    return [(d["stage"], d["outcome"]) for d in rec["decisions"]]


# -- decision traces ----------------------------------------------------------------------


def test_plain_request_trace(gw: Gateway) -> None:
    assert _chat(gw, "plain", **{"x-request-id": "obs-plain"}).status_code == 200
    rec = _trace(gw, "obs-plain")
    stages = [s for s, _ in _decisions(rec)]
    assert stages == [
        "authenticate",
        "validate",
        "window",
        "authorize",
        "tool_results",
        "task",
        "admit",
        "pii",
        "embed",
        "cache",
        "route",
        "tools",
        "select",
        "deployment_limits",
        "queue",
        "residency",
        "place",
        "attempt",
    ]
    assert ("attempt", "ok") in _decisions(rec)
    assert rec["status"] == "ok" and rec["revision"] == "p1" and rec["output_tokens"] == 8
    assert all(d["reason"] for d in rec["decisions"])
    # Stored compactly, read back in the documented form: wall-clock starts in order,
    # inside the request's lifetime, and every evidence an object.
    assert "clock_base" not in rec
    starts = [d["started_at"] for d in rec["decisions"]]
    assert starts == sorted(starts) and rec["received_at"] - 1e-3 <= starts[0]
    assert starts[-1] <= rec["received_at"] + rec["timings"]["duration_ms"] / 1000 + 1e-3
    assert all(isinstance(d["evidence"], dict) and d["duration_ms"] >= 0 for d in rec["decisions"])
    t = rec["timings"]
    assert 0 < t["upstream_first_byte_ms"] <= t["duration_ms"]
    assert "messages" not in json.dumps(rec)  # no prompt bodies in traces


def test_rejection_by_limit_is_traced(gw: Gateway) -> None:
    gw.create_tenant("obs-limited", rpm=1)
    key = gw.create_key("obs-limited")["key"]
    assert _chat(gw, "plain", key).status_code == 200
    assert _chat(gw, "plain", key, **{"x-request-id": "obs-rejected"}).status_code == 429
    rec = _trace(gw, "obs-rejected")
    admit = next(d for d in rec["decisions"] if d["stage"] == "admit")
    assert admit["outcome"] == "reject:rpm"
    assert "tenant:obs-limited" in admit["reason"]
    assert admit["evidence"]["scopes"]["tenant:obs-limited"]["limit_requests"] == 1
    assert rec["status"] == "error" and rec["error_code"] == "rate_limit_rpm"
    assert not any(s == "attempt" for s, _ in _decisions(rec))


def test_retry_then_fallback_is_traced(gw: Gateway) -> None:
    r = _chat(gw, "flaky", **{"x-request-id": "obs-fallback"})
    assert r.status_code == 200 and r.headers["x-switchyard-fallback"] == "flaky -> plain"
    rec = _trace(gw, "obs-fallback")
    tail = [(s, o) for s, o in _decisions(rec) if s in ("attempt", "retry", "fallback")]
    assert tail == [
        ("attempt", "error:connect"),
        ("retry", "backoff"),
        ("attempt", "error:connect"),
        ("fallback", "try:plain"),
        ("attempt", "ok"),
    ]
    assert rec["fallback_from"] == "flaky" and rec["model"] == "plain" and rec["attempts"] == 3


def test_request_list_filters(gw: Gateway) -> None:
    r = httpx.get(
        gw.url + "/admin/requests", params={"status": "error", "limit": 5}, headers=gw.admin
    )
    assert r.status_code == 200
    rows = r.json()["data"]
    assert rows and all(x["status"] == "error" for x in rows)
    assert all("decisions" not in x for x in rows)


# -- agent tasks ------------------------------------------------------------------------------


def _run_diamond(gw: Gateway, task: str, explicit: bool) -> dict[str, str]:
    """Four calls A -> (B, C) -> D of one task; the gateway's id of each step's
    response, by name (a client names parents by the ids the gateway gave it)."""
    ids: dict[str, str] = {}

    def call(model: str, name: str, parents: list[str]) -> None:
        h = {"x-task-id": task, "x-client-request-id": f"{task}-{name}"}
        h["x-task-planned-steps"] = "4"
        if explicit and parents:
            h["x-parent-request-id"] = ",".join(ids[f"{task}-{p}"] for p in parents)
        r = _chat(gw, model, **h)
        assert r.status_code == 200
        assert r.headers["x-client-request-id"] == f"{task}-{name}"
        ids[f"{task}-{name}"] = r.headers["x-request-id"]

    call("fast", "A", [])
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        list(
            pool.map(
                lambda a: call(*a),
                [("fast", "B", ["A"]), ("slow", "C", ["A"])],
            )
        )
    call("fast", "D", ["B", "C"])
    return ids


@pytest.mark.parametrize("explicit", [True, False])
def test_task_critical_path(gw: Gateway, explicit: bool) -> None:
    task = f"diamond-{'explicit' if explicit else 'inferred'}"
    started = time.time()
    ids = _run_diamond(gw, task, explicit)
    wall_ms = (time.time() - started) * 1000
    r = httpx.get(gw.url + f"/admin/tasks/{task}", headers=gw.admin)
    assert r.status_code == 200
    t = r.json()["task"]
    assert t["critical_path"] == [ids[f"{task}-A"], ids[f"{task}-C"], ids[f"{task}-D"]]
    assert t["llm_calls"] == 4 and t["steps_planned"] == 4
    # The critical path sleeps A 100 + C 400 + D 100 ms upstream (the rest of e2e is the
    # client's own gaps, which vary); each sleep may end up to ~1 ms early (the scripted
    # upstream's loop keeps time in whole milliseconds), so allow a few ms below the sum.
    assert 100 * 2 + 400 - 5 <= t["e2e_ms"] <= wall_ms
    assert t["critical_path_ms"] == pytest.approx(t["e2e_ms"], abs=1)
    steps = {s["request_id"]: s for s in t["steps"]}
    b, c = steps[ids[f"{task}-B"]], steps[ids[f"{task}-C"]]
    assert ids[f"{task}-B"] not in c["parents"] and ids[f"{task}-C"] not in b["parents"]
    assert steps[ids[f"{task}-D"]]["inferred"] is (not explicit)
    assert c["upstream_ms"] >= 400 and c["gateway_ms"] >= 0


def test_trace_cli_renders_request_and_task(gw: Gateway) -> None:
    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "switchyard", "trace", *args, "--db", gw.db],
            capture_output=True,
            text=True,
            timeout=60,
        )

    ids = _run_diamond(gw, "cli-task", explicit=True)
    httpx.get(gw.url + "/admin/requests/cli-task-D", headers=gw.admin)  # flushes the ledger
    task = cli("show", "cli-task")
    assert task.returncode == 0, task.stderr
    path = " -> ".join(ids[f"cli-task-{n}"] for n in "ACD")
    assert f"critical path: {path}" in task.stdout
    assert sum(1 for line in task.stdout.splitlines() if line.startswith("*")) == 3
    req = cli("show", "obs-fallback")
    assert req.returncode == 0 and "fallback" in req.stdout and "error:connect" in req.stdout
    assert cli("show", "no-such-thing").returncode == 1
    listed = cli("list", "--limit", "3")
    assert listed.returncode == 0 and len(listed.stdout.strip().splitlines()) == 3


# -- Prometheus ---------------------------------------------------------------------------


def _metrics(gw: Gateway) -> dict[str, Any]:
    text = httpx.get(gw.url + "/metrics", headers=gw.admin).text
    return {f.name: f for f in text_string_to_metric_families(text)}


def _value(families: dict[str, Any], name: str, sample: str, **labels: str) -> float:
    fam = families.get(name)
    if fam is None:
        return 0.0
    return sum(
        s.value
        for s in fam.samples
        if s.name == sample and all(s.labels.get(k) == v for k, v in labels.items())
    )


def test_metrics_parse_and_move(gw: Gateway) -> None:
    before = _metrics(gw)
    assert _chat(gw, "plain").status_code == 200
    assert _chat(gw, "flaky").status_code == 200
    gw.create_tenant("obs-metrics", rpm=1)
    key = gw.create_key("obs-metrics")["key"]
    _chat(gw, "plain", key)
    assert _chat(gw, "plain", key).status_code == 429
    after = _metrics(gw)

    def delta(name: str, sample: str, **labels: str) -> float:
        return _value(after, name, sample, **labels) - _value(before, name, sample, **labels)

    assert (
        delta("switchyard_requests", "switchyard_requests_total", model="plain", status="ok") >= 2
    )
    assert (
        delta(
            "switchyard_fallbacks",
            "switchyard_fallbacks_total",
            from_model="flaky",
            to_model="plain",
        )
        == 1
    )
    assert delta("switchyard_retries", "switchyard_retries_total", model="plain") == 1
    assert (
        delta("switchyard_success", "switchyard_success_total", model="plain", after="fallback")
        == 1
    )
    assert delta("switchyard_rejections", "switchyard_rejections_total", kind="rpm") == 1
    assert (
        delta("switchyard_tokens", "switchyard_tokens_total", model="plain", direction="output")
        >= 16
    )
    assert (
        delta(
            "switchyard_upstream_attempts",
            "switchyard_upstream_attempts_total",
            model="flaky",
            outcome="connect",
        )
        == 2
    )
    buckets = {
        float(s.labels["le"])
        for s in after["switchyard_request_duration_seconds"].samples
        if s.name.endswith("_bucket") and s.labels["le"] != "+Inf"
    }
    assert min(buckets) == 0.001 and max(buckets) == 60.0
    assert "switchyard_breaker_state" in after
    # Bounded labels: no request ids anywhere.
    text = httpx.get(gw.url + "/metrics", headers=gw.admin).text
    assert "obs-plain" not in text and "req_" not in text


# -- OpenTelemetry --------------------------------------------------------------------------


def test_spans_nest_and_carry_request_id_in_memory() -> None:
    exporter = InMemorySpanExporter()
    tracing = Tracing(exporter, batch=False)
    now = time.perf_counter()
    ctx = RequestContext(
        input=RequestInput("req-otel", "chat.completions", time.time()),
        request=Generation(model="m", max_tokens=5),
        timings=Timings(received=now),
        deadline=now + 5,
    )
    parent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    tracing.start_request(ctx, {"traceparent": parent}, time.time_ns())
    ctx.record("admit", "admitted", "ok", time.perf_counter())
    span, headers = tracing.start_attempt(ctx, "m", "http://u")
    Tracing.end_attempt(span, None)
    tracing.finish(ctx, "ok", 3, 4, time.time_ns())
    spans = {s.name: s for s in exporter.get_finished_spans()}
    root = spans["chat"]
    assert root.parent is not None and root.parent.span_id == 0xB7AD6B7169203331
    assert root.context.trace_id == 0x0AF7651916CD43DD8448EB211C80319C
    for name in ("stage admit", "attempt m"):
        assert spans[name].parent.span_id == root.context.span_id
        assert spans[name].attributes["switchyard.request_id"] == "req-otel"
    assert root.attributes["gen_ai.usage.output_tokens"] == 4
    assert headers["traceparent"].split("-")[1] == "0af7651916cd43dd8448eb211c80319c"


def test_traceparent_is_the_parent_and_goes_upstream(gw: Gateway, scripted: Scripted) -> None:
    trace_id = "4bf92f3577b34da6a3ce929d0e0e4736"
    r = _chat(
        gw,
        "plain",
        **{"traceparent": f"00-{trace_id}-00f067aa0ba902b7-01", "x-request-id": "obs-otel"},
    )
    assert r.status_code == 200
    rid = r.headers["x-request-id"]
    upstream_tp = httpx.get(scripted.url + "/stats").json()["last_traceparent"]
    assert upstream_tp.split("-")[1] == trace_id
    deadline = time.monotonic() + 10
    spans: list[dict[str, Any]] = []
    while time.monotonic() < deadline:
        spans = (
            [json.loads(x) for x in SPANS.read_text().splitlines() if x] if SPANS.exists() else []
        )
        if any(
            s["name"] == "chat" and s["attributes"].get("switchyard.request_id") == rid
            for s in spans
        ):
            break
        time.sleep(0.1)
    mine = [s for s in spans if s["attributes"].get("switchyard.request_id") == rid]
    root = next(s for s in mine if s["name"] == "chat")
    assert root["attributes"]["switchyard.client_request_id"] == "obs-otel"
    assert root["trace_id"] == trace_id and root["parent_span_id"] == "00f067aa0ba902b7"
    attempt = next(s for s in mine if s["name"] == "attempt plain")
    assert attempt["parent_span_id"] == root["span_id"]
    assert upstream_tp.split("-")[2] == attempt["span_id"]
    assert {s["name"] for s in mine} >= {"stage admit", "stage select", "stage queue"}


# -- retention -------------------------------------------------------------------------------


def test_retention_removes_old_traces_and_keeps_recent(tmp_path: Path) -> None:
    conn = connect(str(tmp_path / "t.db"))
    now = 1_800_000_000.0
    for i, age_days in enumerate([30, 8, 6, 1, 0]):
        at = now - age_days * 86400
        rec = json.dumps(
            {"request_id": f"r{i}", "task_id": None, "tenant_id": "t", "status": "ok",
             "received_at": at}
        )  # fmt: skip
        conn.execute(insert_sql(), (f"r{i}", None, None, "t", "ok", at, rec))
    assert enforce_retention(conn, retention_days=7, max_rows=100, now=now) == 2
    assert get_request(conn, "r0") is None and get_request(conn, "r1") is None
    assert get_request(conn, "r2") is not None
    assert enforce_retention(conn, retention_days=7, max_rows=2, now=now) == 1  # size cap
    left = {r[0] for r in conn.execute("SELECT request_id FROM traces")}
    assert left == {"r3", "r4"}  # the oldest went first
    assert isinstance(conn, sqlite3.Connection)


def test_ledger_batch_keeps_every_value(tmp_path: Path) -> None:
    """Rows go to SQLite as one JSON array per batch; what comes back is what went in,
    numpy scalars included."""
    from switchyard.pipeline import RequestContext, RequestInput, Timings
    from switchyard.state.ledger import UsageLedger
    from switchyard.state.ledger_rows import Finished

    ledger = UsageLedger(str(tmp_path / "l.db"), flush_s=0.05)
    now = time.perf_counter()
    for i in range(3):
        ctx = RequestContext(
            RequestInput(
                f"led-{i}", "chat.completions", 1_800_000_000.123456 + i, None, "t" if i else None
            ),
            NOT_READ,
            Timings(now),
            now + 5,
        )
        ctx.alias, ctx.cache = "m", "miss"
        ctx.timings.ended = now + 0.25
        ctx.record("validate", "ok", 'fine "quoted" ünïcode', now, {"n": i, "x": None})
        ledger.record(Finished(ctx, "ok", 10 + i, 7, 0.000123 * (i + 1), with_trace=i != 2))
    odd = RequestContext(
        RequestInput("led-np", "chat.completions", 1_800_000_009.0), NOT_READ, Timings(now), now + 5
    )
    odd.timings.ended = now
    odd.cache = np.str_("miss")  # type: ignore[assignment]
    ledger.record(Finished(odd, "ok", np.int64(5), 3, np.float64(0.5)))  # type: ignore[arg-type]
    ledger.flush()
    rows = {r["request_id"]: r for r in ledger.rows(limit=10)}
    assert set(rows) == {"led-0", "led-1", "led-2", "led-np"}
    assert (rows["led-np"]["input_tokens"], rows["led-np"]["cost_usd"]) == (5, 0.5)
    assert rows["led-np"]["cache"] == "miss"
    r = rows["led-1"]
    assert r["task_id"] == "t" and rows["led-0"]["task_id"] is None
    assert (r["input_tokens"], r["output_tokens"], r["status"], r["cache"]) == (11, 7, "ok", "miss")
    assert abs(r["cost_usd"] - 0.000246) < 1e-15 and abs(r["duration_ms"] - 250.0) < 1e-6
    assert abs(r["received_at"] - 1_800_000_001.123456) < 1e-6
    conn = connect(str(tmp_path / "l.db"))
    rec = get_request(conn, "led-1")
    assert rec is not None and rec["decisions"][0]["reason"] == 'fine "quoted" ünïcode'
    assert rec["decisions"][0]["evidence"] == {"n": 1, "x": None}
    assert get_request(conn, "led-2") is None  # traced off for that one
    ledger.close()


def _finished(request_id: str) -> Any:
    from switchyard.pipeline import RequestContext, RequestInput, Timings
    from switchyard.state.ledger_rows import Finished

    now = time.perf_counter()
    ctx = RequestContext(
        RequestInput(request_id, "chat.completions", time.time()), NOT_READ, Timings(now), now + 5
    )
    ctx.timings.ended = now
    return Finished(ctx, "ok", 1, 1, 0.0)


def test_ledger_rows_reach_sqlite_after_the_flush_window_without_a_flush(tmp_path: Path) -> None:
    """Under an event loop a batch is sent flush_s after its first row; the writer
    process commits it with nobody asking."""
    from switchyard.state.ledger import UsageLedger

    ledger = UsageLedger(str(tmp_path / "l.db"), flush_s=0.05)

    async def main() -> None:
        for i in range(5):
            ledger.record(_finished(f"w-{i}"))
        await asyncio.sleep(0.05)

    try:
        asyncio.run(main())
        deadline = time.monotonic() + 10
        while len(ledger.rows(limit=10)) < 5 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert sorted(r["request_id"] for r in ledger.rows(limit=10)) == [
            f"w-{i}" for i in range(5)
        ]
    finally:
        ledger.close()


def test_ledger_writer_that_dies_is_restarted_and_close_commits(tmp_path: Path) -> None:
    from switchyard.state.ledger import UsageLedger

    ledger = UsageLedger(str(tmp_path / "l.db"), flush_s=0.05)
    ledger.record(_finished("before"))
    ledger.flush()
    first = ledger._proc
    first.kill()
    first.wait(5)
    ledger.record(_finished("after"))
    ledger.flush()
    assert ledger._proc.pid != first.pid  # started again
    ledger.record(_finished("at-close"))
    ledger.close()
    assert ledger._proc.poll() == 0  # stopped cleanly
    ids = {r["request_id"] for r in ledger.rows(limit=10)}
    assert ids == {"before", "after", "at-close"}


def test_metrics_fold_after_the_request_and_always_before_a_scrape() -> None:
    from switchyard.observe.metrics import Metrics

    metrics = Metrics()
    f = _finished("m-1")
    f.ctx.alias, f.ctx.run.chunk_gaps = "m", [0.01, 0.02]

    def count(text: str, name: str) -> float:
        for line in text.splitlines():
            if line.startswith(name + "{"):
                return float(line.rsplit(" ", 1)[1])
        return 0.0

    async def main() -> tuple[float, float, float]:
        metrics.observe(f.ctx, "ok", 3, 4, 0.0)
        queued = len(metrics._pending)
        scraped = metrics.exposition().decode()  # folds first
        return queued, count(scraped, "switchyard_requests_total"), len(metrics._pending)

    queued, requests, left = asyncio.run(main())
    assert (queued, requests, left) == (1, 1.0, 0)
    text = metrics.exposition().decode()
    assert count(text, "switchyard_tokens_total") == 3.0  # input; output is the next line
    assert 'switchyard_inter_chunk_seconds_count{model="unknown"} 2.0' in text


def test_a_batched_fold_exposes_what_one_by_one_updates_would() -> None:
    """Many requests folded at once: every counter and histogram line equals what
    prometheus_client's own inc/observe, called per request, produces."""
    from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

    from switchyard.observe.metrics import LATENCY_BUCKETS, Metrics, observe_many

    metrics = Metrics()
    reg = CollectorRegistry()
    requests = Counter("switchyard_requests", "x", ["model", "tenant", "status"], registry=reg)
    e2e = Histogram(
        "switchyard_request_duration_seconds",
        "x",
        ["model"],
        buckets=LATENCY_BUCKETS,
        registry=reg,
    )
    itl = Histogram(
        "switchyard_inter_chunk_seconds", "x", ["model"], buckets=LATENCY_BUCKETS, registry=reg
    )
    durations = [0.0005, 0.001, 0.0011, 0.0025, 0.7, 5.0, 75.0, 0.001]  # on and past bounds
    for i, d in enumerate(durations):
        f = _finished(f"b-{i}")
        f.ctx.alias, f.ctx.run.chunk_gaps = "m", [d / 2, d / 3]
        f.ctx.timings.ended = f.ctx.timings.received + d
        metrics._pending.append((f.ctx, "ok" if i % 3 else "error", 0, 0, 0.0))
        requests.labels("unknown", "anonymous", "ok" if i % 3 else "error").inc()
        e2e.labels("unknown").observe(f.ctx.timings.ended - f.ctx.timings.received)
        for gap in f.ctx.run.chunk_gaps:
            itl.labels("unknown").observe(gap)
    metrics.fold()

    def lines(text: bytes, prefixes: tuple[str, ...]) -> list[str]:
        out = [ln for ln in text.decode().splitlines() if ln.startswith(prefixes)]
        return sorted(ln for ln in out if "_created" not in ln)

    names = (
        "switchyard_requests_total",
        "switchyard_request_duration_seconds",
        "switchyard_inter_chunk_seconds",
    )
    got, want = lines(metrics.exposition(), names), lines(generate_latest(reg), names)
    assert len(want) == 2 + 2 * (len(LATENCY_BUCKETS) + 3)
    assert got == want

    class Plain:  # a histogram without prometheus_client's layout: observed one by one
        def __init__(self) -> None:
            self.seen: list[float] = []

        def observe(self, v: float) -> None:
            self.seen.append(v)

    plain = Plain()
    observe_many(plain, [1.0, 2.0])
    assert plain.seen == [1.0, 2.0]


def test_first_attempt_successes_expose_what_request_by_request_folding_would(
    tmp_path: Path,
) -> None:
    """The common request (served on its first attempt) is accumulated per shape at
    observe time; the exposition equals the one from folding each request on its own,
    for every metric, across shapes and across folds."""
    from switchyard.config import parse_settings
    from switchyard.gateway import Gateway
    from switchyard.observe.metrics import Metrics, _Batch
    from switchyard.pipeline import RequestContext, RequestInput, Timings
    from switchyard.policy.auth import ANONYMOUS

    gw = Gateway(
        parse_settings(
            {
                "models": [
                    {
                        "alias": a,
                        "engine": {"kind": "openai", "base_url": "http://127.0.0.1:9/v1"},
                        "price": {"input": 1.0, "output": 2.0},
                    }
                    for a in ("m1", "m2")
                ],
                "embeddings": {"enabled": False},
                "storage": {"sqlite_path": str(tmp_path / "g.db")},
            }
        )
    )
    fast, slow = Metrics(), Metrics()

    def request(i: int) -> tuple[RequestContext, int, int, float]:
        now = time.perf_counter()
        ctx = RequestContext(
            RequestInput(f"r{i}", "chat.completions", time.time()), NOT_READ, Timings(now), now + 5
        )
        dep = gw.registry.deployments["m1" if i % 3 else "m2"]
        ctx.principal, ctx.deployment, ctx.model, ctx.alias = ANONYMOUS, dep, dep.model, dep.alias
        ctx.run.attempts, ctx.status, ctx.admission.queue_ms = 1, "ok", 0.5 * i
        ctx.route = "r" if i % 4 == 0 else None
        ctx.cache = "miss" if i % 5 == 0 else None
        ctx.timings.ended = now + 0.002 * i
        ctx.timings.client_first_byte = now + 0.001 * i if i % 2 else None
        ctx.run.chunk_gaps = [0.01 * i, 0.003] if i % 2 else []
        return ctx, i, 2 * i, 0.001 * i

    for fold in range(2):
        batch = _Batch()
        for i in range(fold * 20, fold * 20 + 20):
            ctx, inp, out, cost = request(i)
            fast.observe(ctx, "ok", inp, out, cost)
            slow._observe(batch, ctx, "ok", inp, out, cost)
        assert fast._pending == []  # none took the request-by-request path
        fast.fold()
        batch.apply()

    def lines(m: Metrics) -> list[str]:
        text = m.exposition().decode().splitlines()
        return sorted(ln for ln in text if not ln.startswith("#") and "_created" not in ln)

    got, want = lines(fast), lines(slow)
    assert got == want
    assert any(ln.startswith('switchyard_route_decisions_total{route="route:r"}') for ln in got)
    assert any(ln.startswith('switchyard_cache_total{result="miss"} 8.0') for ln in got)


@pytest.mark.parametrize("stop", ["ctrl-c", "kill-9"])
def test_stopping_the_gateway_leaves_no_process_and_ctrl_c_loses_no_row(
    tmp_path: Path, scripted: Scripted, stop: str
) -> None:
    """Ctrl-C reaches the whole process group, the ledger's writer and the engine
    worker included: the writer must outlive the gateway's shutdown and commit its
    last batch, and nothing may die with a traceback. A gateway killed outright takes
    its writer (end of its pipe) and its engine worker (parent-death signal) along."""
    import os
    import signal

    import yaml

    port, db = free_port(), tmp_path / "sy.db"
    cfg = tmp_path / "c.yaml"
    cfg.write_text(
        yaml.safe_dump(
            {
                "server": {"port": port},
                "auth": {"mode": "disabled"},
                "storage": {"sqlite_path": str(db)},
                "embeddings": {"enabled": False},
                "models": [
                    {"alias": "m", "engine": {"kind": "openai", "base_url": scripted.url + "/v1"}},
                    local_model(ctx=512),
                ],
            }
        )
    )
    proc = subprocess.Popen(
        [sys.executable, "-m", "switchyard", "serve", "--config", str(cfg)],
        start_new_session=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if httpx.get(url + "/readyz", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.1)
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
        for _ in range(20):
            assert (
                httpx.post(url + "/v1/chat/completions", json=body, timeout=30).status_code == 200
            )
        if stop == "ctrl-c":
            os.killpg(proc.pid, signal.SIGINT)
        else:
            proc.kill()
        # The children share the gateway's stdout: it ends when the last one exits.
        out = proc.communicate(timeout=60)[0].decode()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
    deadline = time.monotonic() + 20  # a parent-death SIGTERM still shuts down cleanly
    while _children_of(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = _children_of(proc.pid)
    who = [_describe(p) for p in left]  # read before they are killed: names the survivor
    if left:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # do not leak them into later tests
    assert _processes_with(f"ledger_writer\0{db}".encode()) == []  # gone with its gateway
    assert left == [], who  # the engine worker too
    if stop == "ctrl-c":
        assert "Traceback" not in out, out
        conn = sqlite3.connect(db)
        assert conn.execute("SELECT count(*) FROM usage").fetchone()[0] == 20


def _describe(pid: str) -> str:
    """A process's state letter (Z: a zombie not yet reaped) and command line."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:200]
    except (OSError, IndexError):
        return f"{pid}: gone"
    return f"{pid} [{state}] {cmd}"


def _children_of(pid: int) -> list[str]:
    """Processes whose parent is `pid` (or that it left to init with its session)."""
    found = []
    for p in Path("/proc").iterdir():
        try:
            if p.name.isdigit():
                stat = (p / "stat").read_text().rsplit(")", 1)[1].split()
                if int(stat[1]) == pid or int(stat[3]) == pid:  # ppid, or session id
                    found.append(p.name)
        except (OSError, ValueError, IndexError):
            pass
    return found


def _processes_with(arg: bytes) -> list[str]:
    found = []
    for p in Path("/proc").iterdir():
        try:
            if p.name.isdigit() and arg in (p / "cmdline").read_bytes():
                found.append(p.name)
        except OSError:  # exited meanwhile
            pass
    return found


def test_a_stalled_ledger_writer_never_blocks_the_event_loop(tmp_path: Path) -> None:
    """The writer stopped (as if SQLite waited for a lock) while more rows than its pipe
    holds arrive: recording stays non-blocking and every row lands once it resumes."""
    import os
    import signal

    from switchyard.state.ledger import UsageLedger

    ledger = UsageLedger(str(tmp_path / "l.db"), flush_s=0.01)
    writer = ledger._proc
    os.kill(writer.pid, signal.SIGSTOP)
    n = 6000  # ~3 MB of frames: three times the pipe

    async def main() -> None:
        for i in range(n):
            ledger.record(_finished(f"s-{i}"))
            if i % 100 == 0:
                await asyncio.sleep(0.011)  # let the batch timers fire

    blocked = threading.Event()

    def rescue() -> None:  # a loop stuck writing to the pipe: free it and fail
        blocked.set()
        os.kill(writer.pid, signal.SIGCONT)

    watchdog = threading.Timer(60, rescue)
    watchdog.start()
    try:
        asyncio.run(main())
        assert not blocked.is_set(), "the event loop blocked on the stalled writer"
        assert ledger._queued > 0  # batches wait in memory, not in the loop
    finally:
        watchdog.cancel()
        os.kill(writer.pid, signal.SIGCONT)
    ledger.flush(timeout_s=60)
    try:
        conn = sqlite3.connect(tmp_path / "l.db")
        assert conn.execute("SELECT count(*) FROM usage").fetchone()[0] == n
        assert ledger.dropped == 0
    finally:
        ledger.close()


def test_an_async_flush_waits_for_a_stalled_writer_without_blocking_the_loop(
    tmp_path: Path,
) -> None:
    """Admin reads flush the ledger first. With the writer stopped (as if SQLite waited
    for a lock) the flush waits, then gives up, while the loop keeps running; once the
    writer resumes, a flush returns with every row committed."""
    import os
    import signal

    from switchyard.state.ledger import UsageLedger

    ledger = UsageLedger(str(tmp_path / "l.db"), flush_s=0.01)
    writer = ledger._proc
    for i in range(50):
        ledger.record(_finished(f"a-{i}"))
    os.kill(writer.pid, signal.SIGSTOP)

    async def main() -> tuple[bool, float, bool, float]:
        gaps: list[float] = []

        async def tick() -> None:
            last = time.monotonic()
            while True:
                await asyncio.sleep(0.01)
                now = time.monotonic()
                gaps.append(now - last)
                last = now

        ticker = asyncio.create_task(tick())
        t0 = time.monotonic()
        stalled = await ledger.flush_async(timeout_s=0.5)
        waited = time.monotonic() - t0
        os.kill(writer.pid, signal.SIGCONT)
        resumed = await ledger.flush_async(timeout_s=30)
        ticker.cancel()
        return stalled, waited, resumed, max(gaps)

    try:
        stalled, waited, resumed, worst_gap = asyncio.run(main())
    finally:
        os.kill(writer.pid, signal.SIGCONT)
    try:
        assert stalled is False and waited >= 0.5
        assert worst_gap < 0.25  # the loop kept turning while the flush waited
        assert resumed is True
        conn = sqlite3.connect(tmp_path / "l.db")
        assert conn.execute("SELECT count(*) FROM usage").fetchone()[0] == 50
        # Synchronous flushes share the answers: one after the async ones returns.
        ledger.record(_finished("a-last"))
        ledger.flush(timeout_s=10)
        assert conn.execute("SELECT count(*) FROM usage").fetchone()[0] == 51
    finally:
        ledger.close()


@pytest.mark.parametrize(
    ("evidence", "repaired"),
    [
        ({1: "a non-string key"}, 0),  # JSON has a form for it: the key as text
        ({"big": 10**30}, 0),  # JSON has it; SQLite gets it as text
        ({"text": "lone surrogate \ud800"}, 1),  # not UTF-8: replaced
        ({"deep": functools.reduce(lambda acc, _: [acc], range(300), [])}, 0),
    ],
)
def test_a_ledger_row_that_cannot_be_serialised_is_repaired_not_lost(
    tmp_path: Path, evidence: dict[Any, Any], repaired: int
) -> None:
    """The row is the bill: a field that cannot be written is replaced (and counted),
    the row, its trace and its neighbours are kept."""
    from switchyard.state.ledger import UsageLedger

    ledger = UsageLedger(str(tmp_path / "l.db"), flush_s=0.05)
    bad = _finished("bad")
    bad.ctx.record("validate", "ok", "fine", time.perf_counter(), evidence)
    for f in (_finished("good-1"), bad, _finished("good-2")):
        ledger.record(f)
    ledger.flush()
    try:
        rows = {r["request_id"]: r for r in ledger.rows(limit=10)}
        assert sorted(rows) == ["bad", "good-1", "good-2"]
        assert rows["bad"]["status"] == rows["good-1"]["status"]
        assert ledger.repaired == repaired and ledger.dropped == 0
        conn = connect(str(tmp_path / "l.db"))
        stored = get_request(conn, "bad")
        conn.close()
        assert stored is not None and stored["decisions"][-1]["stage"] == "validate"
    finally:
        ledger.close()


# -- the bill and the disk ----------------------------------------------------------------


def test_daily_rollups_sum_the_rows_and_seed_budgets_after_raw_rows_are_gone(
    tmp_path: Path,
) -> None:
    from switchyard.pipeline import RequestContext, RequestInput, Timings
    from switchyard.policy.auth import ANONYMOUS
    from switchyard.state.ledger import UsageLedger
    from switchyard.state.ledger_rows import Finished

    ledger = UsageLedger(str(tmp_path / "l.db"))
    day = time.strftime("%Y-%m-%d", time.gmtime())
    try:
        for i in range(30):
            now = time.perf_counter()
            ctx = RequestContext(
                RequestInput(f"r-{i}", "chat.completions", time.time()),
                NOT_READ,
                Timings(now),
                now + 5,
            )
            ctx.timings.ended = now
            ctx.alias = "cheap"
            ctx.principal = dataclasses.replace(ANONYMOUS, tenant_id="t1", key_id=f"k{i % 2}")
            ledger.record(Finished(ctx, "ok" if i % 3 else "error", 10, 5, 0.01))
        ledger.flush()
        conn = connect(ledger.path)
        rows = conn.execute(
            "SELECT key_id, requests, errors, input_tokens, output_tokens, cost_usd"
            " FROM usage_daily WHERE day = ? AND tenant_id = 't1' ORDER BY key_id",
            (day,),
        ).fetchall()
        assert [tuple(r)[:5] for r in rows] == [("k0", 15, 5, 150, 75), ("k1", 15, 5, 150, 75)]
        assert sum(r[5] for r in rows) == pytest.approx(0.30)
        # Retention may remove raw rows; the bill (and so the budget) stays.
        conn.execute("DELETE FROM usage")
        conn.close()
        midnight = (time.time() // 86400) * 86400
        assert ledger.spent_since("tenant_id", "t1", midnight) == pytest.approx(0.30)
        assert ledger.spent_since("key_id", "k0", midnight) == pytest.approx(0.15)
    finally:
        ledger.close()


def test_a_file_from_before_the_rollups_gets_them_from_its_rows(tmp_path: Path) -> None:
    path = str(tmp_path / "old.db")
    conn = connect(path)
    for i in range(4):
        conn.execute(
            "INSERT INTO usage (request_id, tenant_id, key_id, endpoint, model, input_tokens,"
            " output_tokens, cost_usd, status, received_at) VALUES (?, 't', 'k', 'chat', 'm',"
            " 3, 2, 0.5, 'ok', ?)",
            (f"old-{i}", 1_800_000_000.0 + i),
        )
    conn.execute("DROP TABLE usage_daily")  # as a file made before they existed
    conn.close()
    again = connect(path)
    again.close()
    conn = connect(path)  # a second connect must not add them twice
    row = conn.execute("SELECT day, requests, input_tokens, cost_usd FROM usage_daily").fetchall()
    assert [tuple(r) for r in row] == [("2027-01-15", 4, 12, 2.0)]
    conn.close()


def test_the_disk_budget_deletes_oldest_traces_then_rows_and_gives_space_back(
    tmp_path: Path,
) -> None:
    from switchyard.state.traces import bytes_in_use, enforce_disk

    conn = connect(str(tmp_path / "big.db"))
    assert conn.execute("PRAGMA auto_vacuum").fetchone()[0] == 2  # incremental
    # ~1.5 KB rows: two to a 4 KB page whatever columns a migration adds (2 KB rows sat
    # at the edge, and four added NULL columns made it one row per page)
    fill_store(conn, 3000, "x" * 1500)
    before_pages = conn.execute("PRAGMA page_count").fetchone()[0]
    budget = 3 * 1024 * 1024
    assert bytes_in_use(conn) > 2 * budget
    deleted = enforce_disk(conn, budget)
    assert deleted > 0 and bytes_in_use(conn) <= budget
    # Oldest first: traces, then rollout records, go before any usage row, and what is
    # left is the newest.
    assert conn.execute("SELECT COUNT(*) FROM traces").fetchone()[0] == 0
    assert conn.execute("SELECT COUNT(*) FROM rollouts").fetchone()[0] == 0
    oldest = conn.execute("SELECT MIN(received_at) FROM usage").fetchone()[0]
    assert oldest > 1_800_000_000.0
    assert conn.execute("SELECT cost_usd FROM usage_daily").fetchone()[0] == 9.5
    assert conn.execute("PRAGMA page_count").fetchone()[0] < before_pages / 2  # given back
    assert enforce_disk(conn, budget) == 0  # under budget: nothing more
    conn.close()


def test_the_ledger_writer_keeps_the_byte_budget_as_it_writes(tmp_path: Path) -> None:
    """The writer process enforces observe.max_disk_mb itself, between batches: with
    no retention pass at all, the file stays under the budget while the bill (the daily
    rollups) counts every request."""
    from switchyard.state.ledger import UsageLedger
    from switchyard.state.traces import bytes_in_use

    budget = 4 * 1024 * 1024
    ledger = UsageLedger(str(tmp_path / "l.db"), flush_s=0.05, max_disk_bytes=budget)
    try:
        for round_ in range(4):
            for i in range(1500):
                f = _finished(f"b-{round_}-{i}")
                f.ctx.record("validate", "ok", "x" * 400, time.perf_counter(), {"pad": "y" * 400})
                ledger.record(f)
            ledger.flush()
            time.sleep(0.6)  # past the writer's check interval
        ledger.record(_finished("last"))
        ledger.flush()
        conn = connect(str(tmp_path / "l.db"))
        in_use = bytes_in_use(conn)
        billed = conn.execute("SELECT SUM(requests) FROM usage_daily").fetchone()[0]
        kept = conn.execute("SELECT COUNT(*) FROM traces").fetchone()[0]
        conn.close()
        assert in_use <= budget, in_use
        assert billed == 6001
        assert 0 < kept < 6001  # the oldest traces went first
    finally:
        ledger.close()
