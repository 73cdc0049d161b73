"""Agent-task analysis: what one task's requests cost, and what made it take as long as it did.

An agent task is every request that carried the same `x-task-id`. Its wall time is rarely
the sum of its calls: some steps run in parallel, some wait on others, and the gaps
between steps are the agent's own work. To say where the time went we rebuild the step
graph and walk its critical path.

Definitions (all times are milliseconds relative to the task's first `received_at`):

* A step is one request id. Its interval is `[start_ms, end_ms]`, where `end_ms` is
  `start_ms + duration_ms`. When `duration_ms` is missing (a record cut short) the latest
  timing the record does have stands in for it, else 0, so a step never ends before it
  starts.
* `gateway_ms = duration_ms - queue_ms - upstream_ms`, never below 0; a missing
  component counts as 0.
* Dependencies. A record that names parents (`x-parent-request-id`) depends on those of
  them that are steps of this task and started before it (same start: earlier in the
  step order). Any other parent is ignored; the "started before" rule is what breaks
  cycles. A record with no usable parent gets inferred ones (`inferred=True`): the
  steps that ended at or before it started (within `TOLERANCE_MS`), less each one that
  another of them started after (it precedes this step through that one), but never
  less the one that ended last. So a chain of N steps lists N - 1 links, not N²/2, and
  the critical path is what every earlier step would give. Steps that overlap depend
  on neither; they ran in parallel.
* Critical path. Start at the step that ends last; repeatedly move to the dependency of
  the current step that ends latest, until a step has no dependency. Ties go to the step
  that started earliest, then to the smaller request id. The path is reported first to
  last, and `critical_path_ms` runs from the first step's start to the last step's end:
  the steps' durations plus the gaps between them. It equals `e2e_ms` when the path's
  first step opened the task.

Pure: no I/O, so the admin API and the CLI can share it and tests can feed it dicts.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from switchyard.outcomes import Task, refusal

# `received_at` is wall-clock and `duration_ms` is measured on a monotonic clock, both
# rounded; a step that seems to start a hair before its predecessor ends still waited on it.
TOLERANCE_MS = 1.0

_TIMING_KEYS = (
    "duration_ms",
    "upstream_ms",
    "client_first_byte_ms",
    "upstream_first_byte_ms",
    "queue_ms",
)


@dataclass(slots=True)
class _Step:
    """One request of the task, placed on the task's clock."""

    request_id: str
    record: dict[str, Any]
    start_ms: float
    duration_ms: float
    index: int = 0
    parents: list[_Step] = field(default_factory=list)
    inferred: bool = False

    @property
    def end_ms(self) -> float:
        return self.start_ms + self.duration_ms

    def order_key(self) -> tuple[float, str]:
        """Start order; the request id keeps equal starts deterministic."""
        return (round(self.start_ms, 3), self.request_id)

    def latest_key(self) -> tuple[float, float, str]:
        """Smallest for the step that ends latest, then started earliest, then by id."""
        return (-round(self.end_ms, 3), round(self.start_ms, 3), self.request_id)


def analyze_task(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Summarise one task's trace records: totals, the step graph and its critical path.

    Raises ValueError for an empty list, a record without `request_id` or `received_at`,
    or records from more than one task. See the module docstring for the definitions.
    """
    if not records:
        raise ValueError("a task needs at least one trace record")
    task_id = _task_id(records)
    t0 = min(_received_at(r) for r in records)
    steps = _build_steps(records, t0)
    _link(steps)
    path = _critical_path(steps)
    on_path = {s.request_id for s in path}
    e2e_ms = max(s.end_ms for s in steps)
    return {
        "task_id": task_id,
        "started_at": t0,
        "ended_at": t0 + e2e_ms / 1000,
        "e2e_ms": _r(e2e_ms),
        "llm_calls": sum(1 for r in records if _kind(r) == "model"),
        "tool_calls": sum(1 for r in records if _kind(r) == "tool"),
        "steps_executed": len(steps),
        "steps_planned": _planned(records),
        **_totals(records),
        "steps": [_step_dict(s, s.request_id in on_path) for s in steps],
        "critical_path": [s.request_id for s in path],
        "critical_path_ms": _r(path[-1].end_ms - path[0].start_ms),
        "time_by_kind": _time_by_kind(path),
        "governance": governance(records, steps, t0),
    }


def _decisions(record: dict[str, Any], stage: str) -> list[dict[str, Any]]:
    return [d for d in record.get("decisions") or [] if d.get("stage") == stage]


def governance(records: list[dict[str, Any]], steps: list[_Step], t0: float) -> dict[str, Any]:
    """What the task's policy did, from its requests' decisions (policy/tasks.py,
    policy/tool_calls.py): budget and use, refusals by cause, the deadline and the
    goodput against it, what a cancel stopped and what came after it, and each
    step's tool calls with their class, idempotency key and what was done to them.

    * `used`: the latest `task` decision's account (reservations included).
    * `refused`: refused calls by cause (a budget field, `deadline`, `cancelled`).
    * `cancelled_at`: the earliest moment a call was stopped or refused by a cancel.
    * `after_cancel`: calls that arrived after it (`refused`, or `ran` where a
      process had not yet heard of it) and those that `ended_after` it.
    * `goodput`: steps that ended `ok` by the deadline, of all steps (none when the
      task had no deadline).
    """
    budget: dict[str, Any] = {}
    used: dict[str, Any] = {}
    latest = -1.0
    deadline_at: float | None = None
    refused: Counter[str] = Counter()
    stopped: list[str] = []
    cancel_marks: list[float] = []
    tool_calls: list[dict[str, Any]] = []
    duplicates: list[dict[str, Any]] = []
    approvals: list[dict[str, Any]] = []
    for r in records:
        rid = str(r.get("request_id"))
        for d in _decisions(r, "task"):
            ev = d.get("evidence") or {}
            outcome = str(d.get("outcome") or "")
            if ev.get("budget") is not None and float(d.get("started_at") or 0) >= latest:
                latest = float(d.get("started_at") or 0)
                budget, used = ev["budget"], ev.get("used") or {}
            if ev.get("deadline_at") is not None:
                deadline_at = float(ev["deadline_at"])
            cause = refusal(outcome)
            if cause is not None:
                refused[cause] += 1
                if cause == "cancelled":
                    cancel_marks.append(float(ev.get("cancelled_at") or d.get("started_at") or 0))
            elif outcome == Task.STOPPED:
                stopped.append(rid)
                cancel_marks.append(float(d.get("started_at") or 0))
        for d in _decisions(r, "tool_calls"):
            for call in (d.get("evidence") or {}).get("calls") or []:
                tool_calls.append({"request_id": rid, **call})
        for d in _decisions(r, "tool_results"):
            ev = d.get("evidence") or {}
            duplicates += [{"request_id": rid, **x} for x in ev.get("duplicates") or []]
            approvals += [{"request_id": rid, **x} for x in ev.get("approved") or []]
    cancelled_at = min(cancel_marks) if cancel_marks else None
    after: dict[str, Any] | None = None
    if cancelled_at is not None:
        arrived = [r for r in records if _received_at(r) > cancelled_at]
        after = {
            "refused": sum(
                1
                for r in arrived
                if any(
                    refusal(str(d.get("outcome") or "")) == "cancelled"
                    for d in _decisions(r, "task")
                )
            ),
            "ran": [
                str(r["request_id"])
                for r in arrived
                if not any(
                    refusal(str(d.get("outcome") or "")) is not None for d in _decisions(r, "task")
                )
            ],
            "ended_after": [
                s.request_id
                for s in steps
                if t0 + s.end_ms / 1000 > cancelled_at and t0 + s.start_ms / 1000 <= cancelled_at
            ],
        }
    goodput = None
    if deadline_at is not None:
        good = sum(
            1
            for s in steps
            if s.record.get("status") == "ok" and t0 + s.end_ms / 1000 <= deadline_at
        )
        goodput = {
            "deadline_at": deadline_at,
            "ok_by_deadline": good,
            "steps": len(steps),
            "ratio": round(good / len(steps), 4) if steps else 0.0,
        }
    return {
        "budget": budget,
        "used": used,
        "refused": dict(sorted(refused.items())),
        "refused_by_budget": sum(
            n for cause, n in refused.items() if cause in ("calls", "tokens", "cost_usd", "wall_s")
        ),
        "deadline_at": deadline_at,
        "goodput": goodput,
        "cancelled_at": cancelled_at,
        "stopped": stopped,
        "after_cancel": after,
        "tool_calls": tool_calls,
        "side_effects": [
            c
            for c in tool_calls
            if c.get("class") == "side_effect" and c.get("action") != "blocked"
        ],
        "duplicate_results": duplicates,
        "approvals": approvals,
    }


def _task_id(records: list[dict[str, Any]]) -> str | None:
    """The shared task id; mixing tasks is a caller bug we would rather surface."""
    ids = {r.get("task_id") for r in records} - {None}
    if len(ids) > 1:
        raise ValueError(f"records belong to several tasks: {sorted(map(str, ids))}")
    return str(ids.pop()) if ids else None


def _received_at(record: dict[str, Any]) -> float:
    value = record.get("received_at")
    if value is None:
        raise ValueError(f"trace record {record.get('request_id')!r} has no received_at")
    return float(value)


def _num(value: Any) -> float:
    """A timing or count that may be missing; missing counts as 0."""
    return 0.0 if value is None else float(value)


def _r(ms: float) -> float:
    """Microsecond rounding: epoch-second floats carry noise below that."""
    return round(ms, 3)


def _timings(record: dict[str, Any]) -> dict[str, Any]:
    return record.get("timings") or {}


def _duration_ms(record: dict[str, Any]) -> float:
    """The request's duration, or the latest timing it has when the duration is missing."""
    t = _timings(record)
    if t.get("duration_ms") is not None:
        return max(0.0, float(t["duration_ms"]))
    known = [float(t[k]) for k in _TIMING_KEYS if t.get(k) is not None]
    return max([0.0, *known])


def _build_steps(records: list[dict[str, Any]], t0: float) -> list[_Step]:
    """One step per request id, in start order.

    The trace store keeps one record per request id; should a list hold two, the one
    that ends last wins, since it is the one the task waited for.
    """
    by_id: dict[str, _Step] = {}
    for record in records:
        rid = record.get("request_id")
        if not rid:
            raise ValueError("a trace record has no request_id")
        step = _Step(
            request_id=str(rid),
            record=record,
            # In whole microseconds: a float's noise (epoch seconds hold ~0.2 us) must
            # not decide whether a step ended within TOLERANCE_MS of another's start.
            start_ms=round((_received_at(record) - t0) * 1000, 3),
            duration_ms=_duration_ms(record),
        )
        kept = by_id.get(step.request_id)
        if kept is None or step.end_ms > kept.end_ms:
            by_id[step.request_id] = step
    steps = sorted(by_id.values(), key=_Step.order_key)
    for i, step in enumerate(steps):
        step.index = i
    return steps


def _named_parents(record: dict[str, Any]) -> list[str]:
    """Parent ids as recorded; a raw comma-separated header value is accepted too."""
    raw = record.get("parent_request_ids") or []
    if isinstance(raw, str):
        raw = raw.split(",")
    return [str(p).strip() for p in raw if str(p).strip()]


def _link(steps: list[_Step]) -> None:
    """Give each step its dependencies: named ones that are valid, else inferred ones."""
    by_id = {s.request_id: s for s in steps}
    for step in steps:
        named = {p: by_id[p] for p in _named_parents(step.record) if p in by_id}
        valid = sorted((p for p in named.values() if p.index < step.index), key=_Step.order_key)
        if valid:
            step.parents = valid
            continue
        step.inferred = True
        step.parents = _direct(
            [s for s in steps[: step.index] if s.end_ms <= step.start_ms + TOLERANCE_MS]
        )


def _direct(before: list[_Step]) -> list[_Step]:
    """Of the steps that ended before a step started, those no other of them started
    after (within TOLERANCE_MS), and the one that ended last (the critical path's
    next step); in their order."""
    if len(before) < 2:
        return before
    last = min(before, key=_Step.latest_key)
    # The latest start among the others of each: the latest of all, or for its own
    # step the second latest.
    by_start = sorted(before, key=lambda s: s.start_ms)
    first, second = by_start[-1], by_start[-2]
    return [
        s
        for s in before
        if s is last
        or (second.start_ms if s is first else first.start_ms) < s.end_ms - TOLERANCE_MS
    ]


def _critical_path(steps: list[_Step]) -> list[_Step]:
    """Walk back from the step that ends last along the latest-ending dependencies.

    Parents always sit earlier in the start order, so the walk terminates.
    """
    current = min(steps, key=_Step.latest_key)
    path = [current]
    while current.parents:
        current = min(current.parents, key=_Step.latest_key)
        path.append(current)
    path.reverse()
    return path


def _planned(records: list[dict[str, Any]]) -> int | None:
    """The largest plan any step announced: plans tend to grow as the agent learns."""
    planned = [int(r["planned_steps"]) for r in records if r.get("planned_steps") is not None]
    return max(planned) if planned else None


def _totals(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Usage counted over every record: each one was a call someone paid for."""
    statuses = Counter(str(r.get("status") or "unknown") for r in records)
    return {
        "input_tokens": sum(int(r.get("input_tokens") or 0) for r in records),
        "output_tokens": sum(int(r.get("output_tokens") or 0) for r in records),
        "cost_usd": round(sum(_num(r.get("cost_usd")) for r in records), 9),
        # The ledger's hits are "hit-exact" and "hit-semantic" (CacheOutcome).
        "cache_hits": sum(1 for r in records if str(r.get("cache") or "").startswith("hit-")),
        "retries": sum(max(0, int(r.get("attempts") or 0) - 1) for r in records),
        "fallbacks": sum(1 for r in records if r.get("fallback_from")),
        "statuses": dict(sorted(statuses.items())),
    }


def _kind(record: dict[str, Any]) -> str:
    """`tool` for an MCP tool call through /mcp (mcp_service/), else `model`."""
    return "tool" if record.get("endpoint") == "tools.call" else "model"


def _time_by_kind(path: list[_Step]) -> dict[str, float]:
    """The critical path's time split: model queue, model, tool, and the gaps between
    steps (the client's own work, orchestration, network)."""
    out = {"model_queue_ms": 0.0, "model_ms": 0.0, "tool_ms": 0.0}
    for step in path:
        if _kind(step.record) == "tool":
            out["tool_ms"] += step.duration_ms
            continue
        queue_ms = min(step.duration_ms, _num(_timings(step.record).get("queue_ms")))
        out["model_queue_ms"] += queue_ms
        out["model_ms"] += step.duration_ms - queue_ms
    span = path[-1].end_ms - path[0].start_ms
    gap = max(0.0, span - sum(s.duration_ms for s in path))
    return {**{k: _r(v) for k, v in out.items()}, "gap_ms": _r(gap)}


def _step_dict(step: _Step, on_critical_path: bool) -> dict[str, Any]:
    t = _timings(step.record)
    queue_ms = _num(t.get("queue_ms"))
    upstream_ms = _num(t.get("upstream_ms"))
    return {
        "request_id": step.request_id,
        "kind": _kind(step.record),
        "model": step.record.get("model"),
        "status": step.record.get("status"),
        "start_ms": _r(step.start_ms),
        "end_ms": _r(step.end_ms),
        "duration_ms": _r(step.duration_ms),
        "queue_ms": _r(queue_ms),
        "upstream_ms": _r(upstream_ms),
        "gateway_ms": _r(max(0.0, step.duration_ms - queue_ms - upstream_ms)),
        "parents": [p.request_id for p in step.parents],
        "inferred": step.inferred,
        "on_critical_path": on_critical_path,
    }
