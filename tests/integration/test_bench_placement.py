"""`switchyard bench placement`: the trace through the policy and a live gateway."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from switchyard.bench.placement import simulate, trace


def test_hysteresis_changes_the_mode_less_often_over_the_same_trace() -> None:
    steps = trace(seed=3, seconds=1800)
    banded = simulate(steps, {"min_dwell_s": 30.0})
    bare = simulate(steps, {"min_dwell_s": 0.0, "thermal_c": {"enter": 85.0, "exit": 84.999}})
    assert banded["mode_changes"] < bare["mode_changes"]
    assert banded["privacy_violations"] == bare["privacy_violations"] == 0
    assert 0.0 < banded["local_share"] < 1.0  # both locations used over the trace


def test_the_bench_runs_end_to_end_and_writes_its_result(tmp_path: Path) -> None:
    out = tmp_path / "placement.json"
    done = subprocess.run(
        [
            *(sys.executable, "-m", "switchyard", "bench", "placement"),
            *("--seconds", "600", "--live-stride", "60", "--out", str(out)),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads(out.read_text())
    live = result["live"]
    assert live["requests"] == 10 and live["errors"] == 0, live
    assert live["privacy_violations"] == 0
    assert sum(live["placements"].values()) == 10
    assert Path(result["plot"]).stat().st_size > 0
    assert set(result["simulated"]) == {"hysteresis", "none"}
