"""Agent-task workloads: a small graph of dependent model calls, run as one unit of load.

What a user of an agent waits for is the task, not one call: independent steps run in
parallel, dependent ones add up, and a step that needs its predecessor's answer cannot
start on the predecessor's first token. So a step here starts only when all its parents
have finished, its prompt can quote their outputs (`{step_id}`), and steps without a
path between them run concurrently.

Each request carries `x-task-id`, its own `x-request-id` and the ids of its parents in
`x-parent-request-id`, so the gateway's task trace (observe/tasks.py) describes the same
graph. The harness computes its own view from its own timestamps:

* task E2E: from the task's first send to its last step's end;
* critical path: from the step that ended last, repeatedly step back to the parent that
  ended last (ties: earlier start, then step id); `critical_path_ms` is the sum of the
  path's request E2Es, so `task E2E - critical_path_ms` is time spent between calls;
* a task is good when every planned step ran and succeeded and, if `task:MS` is given,
  its E2E is within it.
"""

from __future__ import annotations

import asyncio
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from switchyard.bench.load import Client
from switchyard.bench.metrics import RequestRecord, Slo, stats
from switchyard.bench.workloads import RequestSpec

PLACEHOLDER = re.compile(r"\{([A-Za-z0-9_.\-]+)\}")


@dataclass(frozen=True, slots=True)
class Step:
    id: str
    prompt: str
    depends_on: tuple[str, ...] = ()
    max_tokens: int = 64
    headers: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class TaskGraph:
    """Steps in an order where every step comes after its parents."""

    name: str
    steps: tuple[Step, ...]


def _order(name: str, steps: list[Step]) -> tuple[Step, ...]:
    """Topological order; rejects unknown parents, cycles and placeholders that name a
    step that is not an ancestor (its output would not exist yet)."""
    by_id = {s.id: s for s in steps}
    if len(by_id) != len(steps):
        raise ValueError(f"task {name!r}: step ids must be unique")
    for s in steps:
        for p in s.depends_on:
            if p not in by_id:
                raise ValueError(f"task {name!r}: step {s.id!r} depends on unknown {p!r}")
    ordered: list[Step] = []
    ancestors: dict[str, set[str]] = {}
    pending = list(steps)
    while pending:
        ready = [s for s in pending if all(p in ancestors for p in s.depends_on)]
        if not ready:
            raise ValueError(f"task {name!r}: the steps form a cycle")
        for s in ready:
            ancestors[s.id] = set(s.depends_on).union(*(ancestors[p] for p in s.depends_on))
            for ref in PLACEHOLDER.findall(s.prompt):
                if ref in by_id and ref not in ancestors[s.id]:
                    raise ValueError(
                        f"task {name!r}: step {s.id!r} quotes {{{ref}}}, which is not "
                        "one of its ancestors"
                    )
            ordered.append(s)
            pending.remove(s)
    return tuple(ordered)


def parse_graphs(data: Any, default_name: str, default_max_tokens: int = 64) -> list[TaskGraph]:
    """`{steps: [...]}` (one task) or `{tasks: [{name, steps}, ...]}`."""
    if not isinstance(data, dict):
        raise ValueError("an agent task file holds a mapping with 'steps' or 'tasks'")
    raw_tasks = data.get("tasks") or [{"name": data.get("name", default_name), **data}]
    graphs = []
    for i, t in enumerate(raw_tasks):
        name = str(t.get("name") or f"{default_name}-{i}")
        steps = [
            Step(
                id=str(s["id"]),
                prompt=str(s["prompt"]),
                depends_on=tuple(str(p) for p in s.get("depends_on") or ()),
                max_tokens=int(s.get("max_tokens") or default_max_tokens),
                headers={str(k): str(v) for k, v in (s.get("headers") or {}).items()},
            )
            for s in t.get("steps") or []
        ]
        if not steps:
            raise ValueError(f"task {name!r} has no steps")
        graphs.append(TaskGraph(name, _order(name, steps)))
    return graphs


def load_graphs(path: str, default_max_tokens: int = 64) -> list[TaskGraph]:
    """Read a YAML or JSON task file (JSON is YAML)."""
    return parse_graphs(yaml.safe_load(Path(path).read_text()), Path(path).stem, default_max_tokens)


def fill(prompt: str, outputs: dict[str, str]) -> str:
    """Replace `{step_id}` by that step's output; other braces stay as they are."""
    return PLACEHOLDER.sub(lambda m: outputs.get(m.group(1), m.group(0)), prompt)


@dataclass(slots=True)
class TaskRecord:
    """One executed task: its steps' records and the harness's view of its timing."""

    task_id: str
    name: str
    index: int
    warmup: bool
    scheduled_s: float | None
    steps_planned: int
    records: dict[str, RequestRecord] = field(default_factory=dict)  # by step id
    parents: dict[str, tuple[str, ...]] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return len(self.records) == self.steps_planned and all(r.ok for r in self.records.values())

    @property
    def start_s(self) -> float | None:
        return min((r.sent_s for r in self.records.values()), default=None)

    @property
    def end_s(self) -> float | None:
        return max((r.end_s for r in self.records.values() if r.end_s is not None), default=None)

    @property
    def e2e_ms(self) -> float | None:
        start, end = self.start_s, self.end_s
        return None if start is None or end is None else (end - start) * 1000

    def critical_path(self) -> tuple[list[str], float]:
        """Step ids first to last, and the sum of their E2Es in ms."""
        done = {k: r for k, r in self.records.items() if r.end_s is not None}
        if not done:
            return [], 0.0

        def latest(ids: list[str]) -> str:
            return min(ids, key=lambda k: (-(done[k].end_s or 0.0), done[k].sent_s, k))

        path = [latest(list(done))]
        while parents := [p for p in self.parents.get(path[-1], ()) if p in done]:
            path.append(latest(parents))
        path.reverse()
        return path, sum(done[k].e2e_ms or 0.0 for k in path)

    def to_json(self) -> dict[str, Any]:
        path, path_ms = self.critical_path()
        return {
            "task_id": self.task_id,
            "name": self.name,
            "index": self.index,
            "warmup": self.warmup,
            "ok": self.ok,
            "scheduled_s": self.scheduled_s,
            "start_s": self.start_s,
            "end_s": self.end_s,
            "e2e_ms": self.e2e_ms,
            "steps_planned": self.steps_planned,
            "steps_executed": len(self.records),
            "critical_path": path,
            "critical_path_ms": path_ms,
            "steps": {k: r.request_id for k, r in self.records.items()},
        }


async def run_task(
    client: Client,
    graph: TaskGraph,
    task: TaskRecord,
    next_index: Callable[[], int],
) -> None:
    """Run every step once its parents are done; a failed parent skips its dependents."""
    futures: dict[str, asyncio.Future[RequestRecord | None]] = {}
    outputs: dict[str, str] = {}

    async def run_step(step: Step) -> RequestRecord | None:
        parents = [await futures[p] for p in step.depends_on]
        if any(p is None or not p.ok for p in parents):
            return None
        rec = RequestRecord(
            index=next_index(),
            request_id=f"bench-{uuid.uuid4().hex[:16]}",
            sent_s=0.0,
            # Root steps go out at the task's scheduled time, so their send lag is the
            # harness's; later steps wait on their parents by design.
            scheduled_s=None if step.depends_on else task.scheduled_s,
            warmup=task.warmup,
            task_id=task.task_id,
            step_id=step.id,
            parent_request_ids=[p.request_id for p in parents if p is not None],
        )
        headers = {"x-task-id": task.task_id, "x-task-planned-steps": str(task.steps_planned)}
        if rec.parent_request_ids:
            headers["x-parent-request-id"] = ",".join(rec.parent_request_ids)
        spec = RequestSpec(
            [{"role": "user", "content": fill(step.prompt, outputs)}], step.max_tokens
        )
        task.records[step.id] = rec
        await client.send(spec, rec, headers | step.headers)
        outputs[step.id] = rec.text
        return rec

    for step in graph.steps:  # parents first, so their futures exist
        task.parents[step.id] = step.depends_on
        futures[step.id] = asyncio.ensure_future(run_step(step))
    await asyncio.gather(*futures.values())


def summarize_tasks(tasks: list[TaskRecord], slo: Slo) -> dict[str, Any]:
    """Task-level summary of one load point; warm-up tasks are left out."""
    measured = [t for t in tasks if not t.warmup]
    ok = [t for t in measured if t.ok]
    starts = [s for t in measured if (s := t.start_s) is not None]
    ends = [e for t in measured if (e := t.end_s) is not None]
    window = max(ends) - min(starts) if starts and ends else 0.0
    good = [t for t in ok if slo.task_ms is None or (t.e2e_ms or 0.0) <= slo.task_ms]
    return {
        "tasks": len(measured),
        "completed": len(ok),
        "failed": len(measured) - len(ok),
        "duration_s": window,
        "task_throughput": len(ok) / window if window > 0 else None,
        "tasks_within_slo": len(good),
        "tasks_within_slo_per_s": len(good) / window if window > 0 else None,
        "steps_planned": sum(t.steps_planned for t in measured),
        "steps_executed": sum(len(t.records) for t in measured),
        "task_e2e_ms": stats([t.e2e_ms for t in ok if t.e2e_ms is not None]),
        "critical_path_ms": stats([t.critical_path()[1] for t in ok]),
    }
