"""Agent-task workloads against the scripted upstream, with per-step delays as known
durations: parallel steps overlap, dependent steps wait, the critical path is the known one."""

from __future__ import annotations

import argparse
import asyncio
import itertools
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from support.gateways import Gateway, cheap_config, start_gateway
from support.paths import REPO
from support.procs import Proc, free_port, wait_http
from support.upstreams import Scripted
from switchyard.bench import agent, load
from switchyard.bench.metrics import Slo
from switchyard.bench.run import add_run_arguments, run_all

EXAMPLE = REPO / "examples" / "bench" / "agent_tasks.yaml"


def delay(ms: int) -> dict[str, str]:
    return {"x-scripted-fault": f"delay:{ms}"}


DIAMOND = {
    "name": "diamond",
    "steps": [
        {"id": "a", "prompt": "start", "headers": delay(100)},
        {"id": "b", "prompt": "long: {a}", "depends_on": ["a"], "headers": delay(400)},
        {"id": "c", "prompt": "short: {a}", "depends_on": ["a"], "headers": delay(100)},
        {"id": "d", "prompt": "join {b} | {c}", "depends_on": ["b", "c"], "headers": delay(100)},
    ],
}


def test_diamond_runs_parallel_steps_together_and_waits_for_parents(scripted: Scripted) -> None:
    graph = agent.parse_graphs(DIAMOND, "diamond")[0]

    async def go() -> list[agent.TaskRecord]:
        tasks = [agent.TaskRecord(f"t{i}", graph.name, i, False, 0.0, 4) for i in range(2)]
        counter = itertools.count()
        async with load.Client(load.Target(scripted.url, "scripted"), load.Clock()) as client:
            await asyncio.gather(
                *(agent.run_task(client, graph, t, lambda: next(counter)) for t in tasks)
            )
        return tasks

    tasks = asyncio.run(asyncio.wait_for(go(), 60))
    for task in tasks:
        assert task.ok, {k: r.error for k, r in task.records.items()}
        a, b, c, d = (task.records[k] for k in "abcd")
        assert all(r.end_s is not None for r in (a, b, c, d))
        assert a.end_s is not None and b.end_s is not None and c.end_s is not None
        # Dependent steps start only after their parents ended.
        assert a.end_s <= b.sent_s and a.end_s <= c.sent_s
        assert d.sent_s >= max(b.end_s, c.end_s)
        # Independent steps overlap in time.
        assert max(b.sent_s, c.sent_s) < min(b.end_s, c.end_s)
        assert (b.e2e_ms or 0) >= 400 and (c.e2e_ms or 0) >= 100
        path, path_ms = task.critical_path()
        assert path == ["a", "b", "d"]
        assert path_ms >= 600 and path_ms <= (task.e2e_ms or 0)
        # Parents' outputs are quoted, and parent ids travel with the request.
        assert a.text and a.text in b.prompt_text and c.text in d.prompt_text
        assert d.parent_request_ids == [b.request_id, c.request_id]
        assert d.task_id == task.task_id and a.parent_request_ids == []
    # The two tasks ran at the same time, not one after the other.
    t0, t1 = tasks
    assert (t0.start_s or 0) < (t1.end_s or 0) and (t1.start_s or 0) < (t0.end_s or 0)


def test_agent_workload_through_the_cli_summary(scripted: Scripted) -> None:
    p = argparse.ArgumentParser()
    add_run_arguments(p)
    args = p.parse_args(
        ["--endpoint", scripted.url, "--model", "scripted", "--agent-tasks", str(EXAMPLE),
         "--rate", "20", "--num-requests", "4", "--warmup", "1", "--goodput", "task:60000"]
    )  # fmt: skip
    result = asyncio.run(asyncio.wait_for(run_all(args), 60))
    point = result["points"][0]
    t = point["tasks_summary"]
    # Tasks alternate between the example's two graphs (4 and 2 steps); task 0 is warm-up.
    assert t["tasks"] == 4 and t["completed"] == 4 and t["failed"] == 0
    assert t["steps_planned"] == t["steps_executed"] == 2 + 4 + 2 + 4
    assert t["tasks_within_slo"] == 4 and t["tasks_within_slo_per_s"] > 0
    assert point["summary"]["requests"] == 12 and point["summary"]["warmup_requests"] == 4
    assert result["metadata"]["workload"]["kind"] == "agent"
    paths = {tuple(x["critical_path"]) for x in point["tasks"] if not x["warmup"]}
    assert ("classify", "reply") in paths
    assert any(p[0] == "plan" and p[-1] == "answer" and len(p) == 3 for p in paths)
    assert point["summary"]["send_lag_ms"]["n"] == 4  # root steps carry the schedule
    assert all(x["critical_path_ms"] <= x["e2e_ms"] + 1e-6 for x in point["tasks"])


def test_failed_parent_skips_its_dependents(scripted: Scripted) -> None:
    graph = agent.parse_graphs(
        {"steps": [
            {"id": "a", "prompt": "x", "headers": {"x-scripted-fault": "status:503"}},
            {"id": "b", "prompt": "{a}", "depends_on": ["a"]},
        ]},
        "t",
    )[0]  # fmt: skip
    task = agent.TaskRecord("t", "t", 0, False, None, 2)

    async def go() -> None:
        async with load.Client(load.Target(scripted.url, "scripted"), load.Clock()) as client:
            await agent.run_task(client, graph, task, lambda: 0)

    asyncio.run(asyncio.wait_for(go(), 30))
    assert not task.ok and list(task.records) == ["a"]
    assert task.records["a"].error == "http_503"
    summary = agent.summarize_tasks([task], Slo())
    assert summary["failed"] == 1 and summary["steps_executed"] == 1
    assert summary["steps_planned"] == 2


@pytest.mark.parametrize("bad", ["steps: [{id: a, prompt: '{b}'}, {id: b, prompt: x}]"])
def test_bad_task_file_is_rejected(tmp_path: Path, bad: str) -> None:
    f = tmp_path / "t.yaml"
    f.write_text(bad)
    with pytest.raises(ValueError, match="not one of its ancestors"):
        agent.load_graphs(str(f))


# -- tool steps: a real gateway, the bench's echo MCP server (official SDK), sockets ------

TOOLS_EXAMPLE = EXAMPLE.with_name("agent-tools.yaml")


@pytest.fixture(scope="module")
def tools_gateway(scripted: Scripted) -> Iterator[Gateway]:
    port = free_port()
    echo = Proc(
        [sys.executable, "-m", "switchyard.bench.mcp_echo_server", "--port", str(port)],
        "mcp-echo",
    )
    try:
        wait_http(f"http://127.0.0.1:{port}/mcp", echo, status=400)  # a GET with no session
        config = cheap_config(
            scripted,
            mcp={"servers": [{"name": "bench", "url": f"http://127.0.0.1:{port}/mcp"}]},
            tools={
                "registry": [
                    {"name": "bench__echo", "class": "read_only"},
                    {"name": "bench__pause", "class": "read_only"},
                    {"name": "bench__record", "class": "side_effect"},
                ]
            },
        )
        gw = start_gateway(config)
        try:
            deadline = time.monotonic() + 60
            while (
                not httpx.get(gw.url + "/readyz", headers=gw.admin)
                .json()["models"]
                .get("mcp:bench", {})
                .get("ready")
            ):
                assert time.monotonic() < deadline, gw.proc.output()[-3000:]
                time.sleep(0.2)
            yield gw
        finally:
            gw.proc.stop()
    finally:
        echo.stop()


def test_tool_steps_run_through_the_gateway_and_the_task_time_splits(
    tools_gateway: Gateway,
) -> None:
    gw = tools_gateway
    p = argparse.ArgumentParser()
    add_run_arguments(p)
    args = p.parse_args(
        ["--endpoint", gw.url, "--model", "cheap", "--api-key", str(gw.key),
         "--agent-tasks", str(TOOLS_EXAMPLE), "--concurrency", "2", "--num-requests", "4"]
    )  # fmt: skip
    result = asyncio.run(asyncio.wait_for(run_all(args), 90))
    point = result["points"][0]
    t = point["tasks_summary"]
    # The example's two graphs alternate: 5 steps (3 of them tools), then 2 (1 tool).
    assert t["completed"] == 4 and t["failed"] == 0, point["tasks"]
    assert t["steps_planned"] == t["steps_executed"] == 5 + 2 + 5 + 2
    assert t["tool_calls"]["n"] == 3 + 1 + 3 + 1 and t["tool_calls"]["failed"] == 0
    assert point["summary"]["requests"] == 2 + 1 + 2 + 1  # model calls only
    assert abs(sum(t["time_share"].values()) - 1) < 1e-6
    assert result["metadata"]["workload"]["tasks"][0]["tool_steps"] == ["weather", "news", "log"]
    for task in point["tasks"]:
        # The split adds up to the task's E2E, and the path's tools are on it.
        split = task["model_ms"] + task["tool_ms"] + task["gap_ms"]
        assert abs(split - task["e2e_ms"]) < 0.01, task
        assert task["model_ms"] > 0 and task["tool_ms"] > 0 and task["gap_ms"] >= 0
        tools = task["tool_steps"]
        assert all(x["ok"] and x["request_id"].startswith("req_") for x in tools.values())
        if task["name"] == "plan-lookup-answer":
            # The 40 ms lookup, not the echo, is on the critical path.
            assert task["critical_path"] == ["plan", "weather", "answer", "log"]
            assert task["tool_ms"] >= 40
        else:
            assert task["critical_path"] == ["fetch", "reply"] and task["tool_ms"] >= 20
    # The gateway's own view of one task: model and tool steps on one trace, the tool
    # step a parent of the model step that quoted it.
    task = next(x for x in point["tasks"] if x["name"] == "tool-first")
    deadline = time.monotonic() + 20
    while True:
        r = httpx.get(f"{gw.url}/admin/tasks/{task['task_id']}", headers=gw.admin)
        analysis = r.json().get("task") if r.status_code == 200 else None
        if (analysis and analysis["steps_executed"] == 2) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert analysis is not None, r.text
    kinds = {s["request_id"]: s["kind"] for s in analysis["steps"]}
    assert kinds[task["steps"]["fetch"]] == "tool" and kinds[task["steps"]["reply"]] == "model"
    assert analysis["time_by_kind"]["tool_ms"] > 0
