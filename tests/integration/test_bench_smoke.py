"""End to end: `bench run` against a real gateway serving the embedded SmolLM2 model."""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
import yaml

from support.gateways import Gateway, start_gateway
from switchyard.bench.run import add_run_arguments


@pytest.fixture(scope="module")
def gw() -> Iterator[Gateway]:
    g = start_gateway(None)
    yield g
    g.proc.stop()


def bench(gw: Gateway, out: Path, *extra: str) -> dict[str, Any]:
    p = argparse.ArgumentParser()
    add_run_arguments(p)
    args = p.parse_args(
        ["--endpoint", gw.url, "--model", "smollm2-135m", "--api-key", gw.key,
         "--out", str(out), "--quiet", "--timeout", "120", *extra]
    )  # fmt: skip
    assert args.func(args) == 0
    return dict(orjson.loads((out / "result.json").read_bytes()))


def test_smoke_run_writes_result_and_plots(gw: Gateway, tmp_path: Path) -> None:
    out = tmp_path / "run"
    result = bench(
        gw, out, "--concurrency", "2", "--num-requests", "4",
        "--input-len", "16", "--output-len", "8", "--goodput", "ttft:60000", "e2e:120000",
    )  # fmt: skip
    meta, point = result["metadata"], result["points"][0]
    assert meta["schema"] == "switchyard.bench.result/1"
    assert meta["revisions"] == ["smollm2-135m-instruct-q4_1"]  # x-switchyard-revision
    assert meta["token_count_source"]["counts"] == {"server": 4}
    s = point["summary"]
    assert s["requests"] == 4 and s["completed"] == 4, s["errors"]
    assert s["ttft_ms"]["n"] == 4 and s["e2e_ms"]["p50"] > 0
    assert all(0 < r["output_tokens"] <= 8 for r in point["records"])
    assert s["good_requests"] == 4 and s["request_throughput"] > 0
    for name in ("latency_cdf.png", "latency_over_time.png"):
        f = out / name
        assert f.stat().st_size > 1000 and f.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_agent_task_lines_up_with_the_gateway_trace(gw: Gateway, tmp_path: Path) -> None:
    graph = {  # small on purpose: the model is slow on a busy CPU
        "steps": [
            {"id": "a", "prompt": "Say one word.", "max_tokens": 2},
            {"id": "b", "prompt": "Repeat: {a}", "depends_on": ["a"], "max_tokens": 2},
            {"id": "c", "prompt": "{a} {b}", "depends_on": ["a", "b"], "max_tokens": 2},
        ]
    }
    tasks_file = tmp_path / "diamond.yaml"
    tasks_file.write_text(yaml.safe_dump(graph))
    result = bench(gw, tmp_path / "agent", "--agent-tasks", str(tasks_file), "--num-requests", "1")
    task = result["points"][0]["tasks"][0]
    assert task["ok"] and task["steps_executed"] == 3
    r = httpx.get(gw.url + f"/admin/tasks/{task['task_id']}", headers=gw.admin, timeout=30)
    assert r.status_code == 200, r.text
    trace = r.json()["task"]
    assert trace["llm_calls"] == 3 and trace["steps_planned"] == 3
    # The gateway saw the same graph: each request's parents are the harness's parents.
    harness = {x["request_id"]: x["parent_request_ids"] for x in result["points"][0]["records"]}
    gateway = {s["request_id"]: s["parents"] for s in trace["steps"]}
    assert {k: sorted(v) for k, v in gateway.items()} == {k: sorted(v) for k, v in harness.items()}
    assert all(not s["inferred"] for s in trace["steps"] if s["parents"])
