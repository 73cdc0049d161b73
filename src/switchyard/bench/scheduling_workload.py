"""The scheduling bench's workload: the `scheduling:` section of a bench file, read and
checked (`load_workload`), its task graph with each step's output length and deadline,
and the capacity arithmetic the loads are stated in (`Workload.task_rate`).

Running it against the gateways is `scheduling.py`'s.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import yaml

from switchyard.bench import agent

LENGTH = re.compile(r"\[\[tokens:(\d{1,5})\]\]")


@dataclass(frozen=True, slots=True)
class Workload:
    """The `scheduling:` section of the file, and its task graph."""

    graph: agent.TaskGraph
    seed: int
    concurrency: int
    service_ms: float
    token_ms: float
    max_concurrency: int
    queue: int
    resilience: dict[str, Any]
    loads: tuple[float, ...]
    warmup_s: float
    duration_s: float
    max_tokens: int
    deadline_s: float
    interactive_per_task: float
    interactive_tokens: int
    interactive_timeout_s: float
    interactive_slo_ms: float
    # Not in the file: `--interactive-priority` runs the gateways with auth on, the tasks
    # with a standard key and the interactive calls with a key of this class.
    interactive_priority: str | None = None
    # `upstream.kind: llama-server`: its slots, threads and context, and the times as
    # multiples of what `calibrate` measures (service_ms, token_ms and the absolute times
    # above are set from the measurement).
    upstream_kind: str = "scripted"
    threads: int = 2
    ctx: int = 4096
    deadline_x: float | None = None
    timeout_x: float | None = None
    slo_x: float | None = None
    calibration: dict[str, Any] | None = None

    @property
    def real(self) -> bool:
        return self.upstream_kind == "llama-server"

    def critical_path_s(self) -> float:
        """Service seconds along the task graph's longest chain of dependent steps."""
        done: dict[str, float] = {}
        for st in self.graph.steps:  # parents first
            start = max((done[p] for p in st.depends_on), default=0.0)
            done[st.id] = start + self.service_s(step_tokens(st))
        return max(done.values(), default=0.0)

    def service_s(self, tokens: int) -> float:
        return (self.service_ms + self.token_ms * tokens) / 1000

    @property
    def task_work_s(self) -> float:
        """Slot-seconds one task holds: the sum of its steps' service times."""
        return sum(self.service_s(step_tokens(s)) for s in self.graph.steps)

    @property
    def interactive_work_s(self) -> float:
        return self.service_s(self.interactive_tokens)

    def task_rate(self, load: float) -> float:
        """Tasks per second offering `load` times the capacity (interactive included)."""
        per_task = self.task_work_s + self.interactive_per_task * self.interactive_work_s
        return load * self.concurrency / per_task

    def describe(self) -> dict[str, Any]:
        return {
            "kind": "scheduling",
            "task": {
                "name": self.graph.name,
                "steps": {s.id: step_tokens(s) for s in self.graph.steps},
                "edges": {s.id: list(s.depends_on) for s in self.graph.steps if s.depends_on},
                "deadline_s": round(self.deadline_s, 3),
                "critical_path_s": round(self.critical_path_s(), 3),
                "work_s": round(self.task_work_s, 3),
            },
            "upstream": {
                "kind": self.upstream_kind,
                "concurrency": self.concurrency,
                "service_ms": round(self.service_ms, 3),
                "token_ms": round(self.token_ms, 4),
                "calibration": self.calibration,
            },
            "gateway": {
                "max_concurrency": self.max_concurrency,
                "queue": self.queue,
                "resilience": self.resilience,
            },
            "interactive": {
                "per_task": self.interactive_per_task,
                "tokens": self.interactive_tokens,
                "timeout_s": round(self.interactive_timeout_s, 3),
                "slo_ms": round(self.interactive_slo_ms, 1),
                "work_s": round(self.interactive_work_s, 3),
                "priority": self.interactive_priority,
            },
            "loads": list(self.loads),
            "task_rates_per_s": {str(x): round(self.task_rate(x), 4) for x in self.loads},
            "seed": self.seed,
            "warmup_s": self.warmup_s,
            "duration_s": self.duration_s,
            "max_tokens": self.max_tokens,
        }


def step_tokens(step: agent.Step) -> int:
    m = LENGTH.search(step.prompt)
    if m is None:
        raise ValueError(f"step {step.id!r}: its prompt needs [[tokens:K]] (its output length)")
    return int(m.group(1))


def load_workload(
    path: str, duration_s: float | None = None, interactive_priority: str | None = None
) -> Workload:
    data = yaml.safe_load(Path(path).read_text())
    if not isinstance(data, dict) or not isinstance(data.get("scheduling"), dict):
        raise ValueError(f"{path}: --schedulers needs a 'scheduling:' section (see examples/bench)")
    s = data["scheduling"]
    graphs = agent.parse_graphs(data, Path(path).stem)
    if len(graphs) != 1:
        raise ValueError(f"{path}: --schedulers takes one task graph")
    up, gw, task, inter = s["upstream"], s["gateway"], s["task"], s["interactive"]
    kind = str(up.get("kind", "scripted"))
    if kind not in ("scripted", "llama-server"):
        raise ValueError(f"{path}: upstream.kind is scripted or llama-server, not {kind!r}")
    real = kind == "llama-server"
    w = Workload(
        graph=graphs[0],
        seed=int(s.get("seed", 0)),
        concurrency=int(up["parallel"] if real else up["concurrency"]),
        service_ms=0.0 if real else float(up["service_ms"]),
        token_ms=0.0 if real else float(up["token_ms"]),
        max_concurrency=int(gw["max_concurrency"]),
        queue=int(gw["queue"]),
        resilience=dict(gw.get("resilience") or {}),
        loads=tuple(float(x) for x in s["loads"]),
        warmup_s=float(s.get("warmup_s", 0.0)),
        duration_s=float(duration_s if duration_s is not None else s["duration_s"]),
        max_tokens=int(s["max_tokens"]),
        deadline_s=0.0 if real else float(task["deadline_s"]),
        interactive_per_task=float(inter["per_task"]),
        interactive_tokens=int(inter["tokens"]),
        interactive_timeout_s=0.0 if real else float(inter["timeout_s"]),
        interactive_slo_ms=0.0 if real else float(inter["slo_ms"]),
        interactive_priority=interactive_priority,
        upstream_kind=kind,
        threads=int(up.get("threads", 2)),
        ctx=int(up.get("ctx", 4096)),
        deadline_x=float(task["deadline_x"]) if real else None,
        timeout_x=float(inter["timeout_x"]) if real else None,
        slo_x=float(inter["slo_x"]) if real else None,
    )
    for st in w.graph.steps:
        step_tokens(st)
    return w if w.real else with_times(w)


def with_times(w: Workload) -> Workload:
    """The steps with their task deadline and their `max_tokens`: the cap for the
    scripted upstream, the step's own length (with `ignore_eos`) for a real engine."""
    timeout = {"x-task-timeout": f"{w.deadline_s:.3f}".rstrip("0").rstrip(".")}
    steps = tuple(
        replace(
            st,
            max_tokens=step_tokens(st) if w.real else w.max_tokens,
            headers=st.headers | timeout,
        )
        for st in w.graph.steps
    )
    return replace(w, graph=agent.TaskGraph(w.graph.name, steps))
