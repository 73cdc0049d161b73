"""`switchyard bench overhead --scenario workers`: the realistic gateway served by
`serve --workers N`, measured in the same rounds as the floor and one process
(bench/workers.py)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pytest

from switchyard.bench import workers
from switchyard.bench.overhead import render, summarize, target_names
from switchyard.cli import build_parser


def _args(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["bench", "overhead", *argv])


def _runs(rps: dict[str, float]) -> list[dict[str, Any]]:
    """One round in which every scenario gives each target these req/s (p50 1 ms)."""
    return [
        {
            "round": 1,
            "scenario": f"{'stream' if stream else 'non-stream'} c={c}",
            "target": target,
            "rps": value,
            "p50_ms": 1.0,
            "p99_ms": 3.0,
            "non_2xx": 0,
            "socket_errors": 0,
        }
        for target, value in rps.items()
        for stream in (False, True)
        for c in (1, 32)
    ]


def test_one_process_and_n_workers_are_measured_side_by_side() -> None:
    assert target_names(_args("--scenario", "realistic", "workers", "--no-native")) == (
        "direct",
        "floor",
        "sy-realistic",
        "sy-workers",
    )
    assert _args().workers == workers.DEFAULT_WORKERS == 2
    # Not on by default.
    assert workers.TARGET not in target_names(_args())


def test_the_issue_50_target_is_judged_at_c32_against_the_floor_and_one_process() -> None:
    rps = {"direct": 9000.0, "floor": 4000.0, "sy-realistic": 1500.0, "sy-workers": 4200.0}
    summary = summarize(_runs(rps), tuple(rps))
    got = {r["scenario"]: r for r in workers.ratios(summary)}
    assert set(got) == {"non-stream c=32", "stream c=32"}
    assert got["stream c=32"]["rps_ratio"] == pytest.approx(1.05)
    assert got["stream c=32"]["verdict"] == "PASS"
    assert got["stream c=32"]["rps_over_one_process"] == pytest.approx(2.8)
    # Judged against the floor like every Switchyard target, by the usual 0.70.
    c32 = {s["scenario"]: s for s in summary}["non-stream c=32"]
    assert c32["checks"][workers.TARGET]["verdict"] == "PASS"

    text = render(summary, argparse.Namespace(duration=1, rounds=1, workers=3))
    assert "3 workers (sy-workers) at c=32, req/s / floor >= 1.0 (#50):" in text
    assert "req/s sy-workers/floor 1.05  [PASS]; 2.80x sy-realistic's (one process)" in text

    slower = summarize(_runs(rps | {"sy-workers": 3000.0}), tuple(rps))
    assert {r["verdict"] for r in workers.ratios(slower)} == {"MISS"}


def test_one_worker_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    args = _args("--scenario", "workers", "--workers", "1")
    assert args.func(args) == 2
    assert "--workers: at least 2" in capsys.readouterr().err


def test_a_real_run_measures_the_workers_target(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The smallest real run: two workers over one control plane, one round of one
    second; every request served, the whole gateway's CPU counted, what ran recorded."""
    out = tmp_path / "result.json"
    args = _args(
        "--scenario", "workers", "--workers", "2", "--duration", "1", "--rounds", "1",
        "--warmup", "1", "--tokens", "4", "--out", str(out),
    )  # fmt: skip
    assert args.func(args) == 0
    printed = capsys.readouterr().out
    assert "2 workers (sy-workers) at c=32" in printed
    assert "CPU us/req by process, sy-workers: workers" in printed
    result = json.loads(out.read_text())
    runs = [r for r in result["runs"] if r["target"] == workers.TARGET]
    assert len(runs) == 4  # stream or not, at c=1 and c=32
    for r in runs:
        assert r["requests"] > 0 and r["non_2xx"] == 0 and r["socket_errors"] == 0
        assert r["cpu_us_per_req"] is not None and r["cpu_us_per_req"] > 0
        # Split by process: the workers serve, the control plane and the writer are
        # counted beside them, and the split adds up to the whole tree.
        split = r["cpu_us_per_req_by_process"]
        assert {"workers", "control plane", "ledger writer"} <= set(split), split
        assert split["workers"] > 0
        assert sum(split.values()) == pytest.approx(r["cpu_us_per_req"], rel=1e-6)
    shape = result["workload"]["workers"]
    assert shape["workers"] == 2 and shape["limiter"] == workers.LIMITER
    assert shape["tenant_limits"]["budget_usd"] == 1_000_000
    assert "--workers 2" in result["workload"]["targets"][workers.TARGET]
    assert workers.TARGET in result["workload"]["criteria"]["judged_against_floor"]
    assert [r["scenario"] for r in result["workers_ratios"]] == ["non-stream c=32", "stream c=32"]
    for s in result["summary"]:
        assert s["checks"][workers.TARGET]["cpu_ratio"] is not None


def test_a_gateway_with_workers_is_ready_only_once_each_one_listens() -> None:
    """Each worker has its own SO_REUSEPORT listener: the count of listening sockets on
    the port is what tells the bench every worker can take connections."""
    import socket

    from switchyard.bench.harness import listening, readyz

    socks = []
    try:
        for _ in range(2):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            s.bind(("127.0.0.1", socks[0].getsockname()[1] if socks else 0))
            socks.append(s)
        port = socks[0].getsockname()[1]
        assert listening(port) == 0  # bound, not listening (as the supervisor's own)
        for s in socks:
            s.listen()
        assert listening(port) == 2
        assert not readyz(port, listeners=3)
    finally:
        for s in socks:
            s.close()
