"""The bench harness against real servers on loopback: open-loop honesty, queueing, CLI."""

from __future__ import annotations

import argparse
import asyncio
import http.server
import itertools
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest

from support.upstreams import Scripted, start_scripted
from switchyard.bench.compare import add_compare_arguments
from switchyard.bench.metrics import percentile
from switchyard.bench.run import add_run_arguments, run_all


def parse(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_run_arguments(p)
    return p.parse_args(list(argv))


def measured(result: dict[str, Any], point: int = 0) -> list[dict[str, Any]]:
    return [r for r in result["points"][point]["records"] if not r["warmup"]]


@pytest.fixture(scope="module")
def slow() -> Iterator[Scripted]:
    proc, s = start_scripted("--fault", "delay:300")
    yield s
    proc.stop()


def test_open_loop_keeps_its_schedule_against_a_slow_server(slow: Scripted) -> None:
    args = parse(
        "--endpoint", slow.url, "--model", "scripted", "--rate", "20", "--arrival", "constant",
        "--num-requests", "30", "--warmup", "2", "--input-len", "8", "--output-len", "4",
    )  # fmt: skip
    result = asyncio.run(asyncio.wait_for(run_all(args), 60))
    recs = measured(result)
    assert len(recs) == 30 and all(r["ok"] for r in recs), result["points"][0]["summary"]
    # The schedule: every 50 ms, warm-up included, measured ones after it.
    scheduled = [r["scheduled_s"] for r in recs]
    assert scheduled == pytest.approx([0.05 * (i + 2) for i in range(30)])
    lags = [r["lag_ms"] for r in recs]
    assert percentile(lags, 99) < 100, lags
    # Each request went out before the previous one came back (300 ms each): no
    # coordinated omission, so several were in flight at once.
    for prev, cur in itertools.pairwise(recs):
        assert cur["sent_s"] < prev["end_s"]
    in_flight = max(sum(1 for o in recs if o["sent_s"] <= r["sent_s"] < o["end_s"]) for r in recs)
    assert in_flight >= 4
    # Each took the server's 300 ms. The client stamps a send once its write returned,
    # a fraction of a millisecond after the server may have the request (a clean
    # clone's run measured 299.86 ms): 5 ms of slack, far below any lost delay.
    assert min(r["e2e_ms"] for r in recs) >= 295
    summary = result["points"][0]["summary"]
    assert summary["send_lag_ms"]["n"] == 30 and summary["warmup_requests"] == 2
    assert result["metadata"]["load"]["arrival"] == "constant"


SERVICE_S = 0.1


class SerialHandler(http.server.BaseHTTPRequestHandler):
    """One request at a time, 100 ms each: a server whose queue builds up."""

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("content-length", 0)))
        time.sleep(SERVICE_S)
        self.send_response(200)
        self.send_header("content-type", "text/event-stream")
        self.end_headers()
        chunk = {"choices": [{"delta": {"content": "hi"}}]}
        usage = {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 1}}
        for obj in (chunk, usage):
            self.wfile.write(b"data: " + orjson.dumps(obj) + b"\n\n")
        self.wfile.write(b"data: [DONE]\n\n")

    def log_message(self, format: str, *args: Any) -> None:
        pass


class SerialServer(http.server.HTTPServer):
    request_queue_size = 128  # connections wait in the kernel, not refused


def test_open_loop_latency_includes_server_queueing() -> None:
    server = SerialServer(("127.0.0.1", 0), SerialHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        n = 16
        args = parse(
            "--endpoint", f"http://127.0.0.1:{server.server_address[1]}", "--model", "m",
            "--rate", "20", "--arrival", "constant", "--num-requests", str(n),
        )  # fmt: skip
        result = asyncio.run(asyncio.wait_for(run_all(args), 60))
    finally:
        server.shutdown()
        server.server_close()
    recs = measured(result)
    assert all(r["ok"] for r in recs)
    assert percentile([r["lag_ms"] for r in recs], 99) < 100
    # Offered 20/s to a 10/s server: the server needs >= n * 100 ms, the last send is at
    # 0.75 s, so some request waited >= ~0.75 s; a closed loop would never see this.
    assert max(r["end_s"] for r in recs) >= n * SERVICE_S
    e2e = [r["e2e_ms"] for r in recs]
    assert max(e2e) >= 700 and min(e2e) >= SERVICE_S * 1000
    assert sum(e2e[-4:]) > 2 * sum(e2e[:4])  # the queue grew


def test_cli_writes_results_and_compare_reads_them(
    scripted: Scripted, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    base = ["--endpoint", scripted.url, "--model", "scripted", "--num-requests", "6", "--quiet"]
    a = parse(*base, "--concurrency", "1,2", "--out", str(tmp_path / "a"), "--label", "A")
    assert a.func(a) == 0
    # No usage from the server: counts come from the SmolLM2 tokenizer, and say so.
    b = parse(*base, "--concurrency", "1,2", "--out", str(tmp_path / "b"), "--no-usage")
    assert b.func(b) == 0
    ra = orjson.loads((tmp_path / "a" / "result.json").read_bytes())
    rb = orjson.loads((tmp_path / "b" / "result.json").read_bytes())
    meta = ra["metadata"]
    for key in ("endpoint", "model", "workload", "load", "machine", "software", "sampling"):
        assert meta[key], key
    assert meta["load"]["concurrencies"] == [1, 2] and len(ra["points"]) == 2
    assert meta["token_count_source"]["counts"] == {"server": 12}
    assert rb["metadata"]["token_count_source"]["counts"] == {"tokenizer": 12}
    assert all(r["output_tokens"] > 0 for p in rb["points"] for r in p["records"])
    for name in ("latency_cdf.png", "latency_over_time.png", "sweep.png"):
        assert (tmp_path / "a" / name).stat().st_size > 0
    capsys.readouterr()
    p = argparse.ArgumentParser()
    add_compare_arguments(p)
    c = p.parse_args([str(tmp_path / "a" / "result.json"), str(tmp_path / "b" / "result.json")])
    assert c.func(c) == 0
    out = capsys.readouterr().out
    assert "request_throughput" in out and "e2e_ms.p99" in out and "B/A" in out
    assert "differ in load" in out  # --no-usage changed the load section
