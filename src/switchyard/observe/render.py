"""Plain-text views of traces for a terminal: one request's decisions, one task's steps.

Why plain text: the output is read in a terminal, pasted into issues and compared in
tests, so it has no colours and the same input always renders the same way. Lines keep
the record's own order (decisions as they happened, steps by start), never a hash order.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

_VALUE_MAX = 40  # one evidence value; longer ones are cut
_EVIDENCE_MAX = 120  # the whole evidence line
_STEP_HEAD = (
    f"  {'start':>9} {'dur':>8} {'queue':>7} {'upstr':>7} {'gatew':>7}  {'status':<10} step"
)


def render_request(record: Mapping[str, Any]) -> str:
    """One request as a header, its timings, then each decision with its evidence."""
    lines = [_request_header(record), _request_context(record), _timings_line(record)]
    decisions = list(record.get("decisions") or [])
    lines.append(f"decisions ({len(decisions)}):" if decisions else "decisions: none recorded")
    lines.extend(_decision_lines(decisions))
    return "\n".join(lines)


def render_task(analysis: Mapping[str, Any], records: list[dict[str, Any]]) -> str:
    """One task (an `analyze_task` result) as its numbers, its step tree, its critical path.

    `records` supply per-step detail the analysis leaves out (tokens, cache, retries).
    A step with several parents sits under the one that ended last, the one it waited
    for; other parents are listed as `also after` unless already above it in the tree.
    """
    by_id = {str(r.get("request_id")): r for r in records}
    lines = [*_task_header(analysis), "", "steps (* = on the critical path; times in ms):"]
    lines.append(_STEP_HEAD)
    lines.extend(_step_tree(list(analysis["steps"]), by_id))
    path = " -> ".join(analysis["critical_path"])
    lines.append("")
    lines.append(
        f"critical path: {path} "
        f"({_f(analysis['critical_path_ms'])} ms of {_f(analysis['e2e_ms'])} ms)"
    )
    split = analysis.get("time_by_kind")
    if split and analysis.get("tool_calls"):
        lines.append(
            "critical path by kind: "
            + ", ".join(
                f"{k.removesuffix('_ms').replace('_', ' ')} {_f(v)} ms" for k, v in split.items()
            )
        )
    lines.extend(_governance(analysis.get("governance") or {}))
    return "\n".join(lines)


def _governance(g: Mapping[str, Any]) -> list[str]:
    """The task's policy: budget and use, refusals, deadline, cancel, tool calls."""
    lines: list[str] = []
    if g.get("budget"):
        used = g.get("used") or {}
        parts = [
            f"{k} {_or_dash(used.get(k))}/{v}" for k, v in g["budget"].items() if k != "wall_s"
        ]
        if "wall_s" in g["budget"]:
            parts.append(f"wall_s {g['budget']['wall_s']}")
        lines.append("budget: " + ", ".join(parts))
    if g.get("refused"):
        lines.append(
            "refused: "
            + ", ".join(f"{k} {v}" for k, v in g["refused"].items())
            + f" ({g.get('refused_by_budget', 0)} by the budget)"
        )
    gp = g.get("goodput")
    if gp:
        lines.append(
            f"goodput: {gp['ok_by_deadline']} of {gp['steps']} steps ok by the task's deadline"
        )
    if g.get("cancelled_at") is not None:
        after = g.get("after_cancel") or {}
        lines.append(
            f"cancelled: stopped {', '.join(g.get('stopped') or []) or 'nothing'}; "
            f"after it {after.get('refused', 0)} refused, "
            f"{len(after.get('ran') or [])} ran, {len(after.get('ended_after') or [])} still ending"
        )
    calls = g.get("tool_calls") or []
    if calls:
        lines.append("tool calls:")
        for c in calls:
            key = f" key {c['idempotency_key'][:12]}" if c.get("idempotency_key") else ""
            lines.append(
                f"  {c.get('request_id')}: {c.get('name')} ({c.get('class')}) {c.get('action')}{key}"
            )
    for d in g.get("duplicate_results") or []:
        lines.append(f"duplicate result: {d.get('call_id')} ({d.get('tool')}) x{d.get('results')}")
    for a in g.get("approvals") or []:
        lines.append(f"approved: {a.get('call_id')} ({a.get('tool')}) by {a.get('approver')}")
    return ["", *lines] if lines else []


# -- request ---------------------------------------------------------------------------


def _f(value: Any, digits: int = 1) -> str:
    """A number for display; a missing one shows as `-`."""
    return "-" if value is None else f"{float(value):.{digits}f}"


def _or_dash(value: Any) -> str:
    return "-" if value is None or value == "" else str(value)


def _request_header(r: Mapping[str, Any]) -> str:
    model = _or_dash(r.get("model"))
    if r.get("revision"):
        model += f"@{r['revision']}"
    status = _or_dash(r.get("status"))
    if r.get("error_code"):
        status += f" ({r['error_code']})"
    duration = (r.get("timings") or {}).get("duration_ms")
    return (
        f"request {_or_dash(r.get('request_id'))}  {model} via {_or_dash(r.get('upstream'))}"
        f"  {status}  {_f(duration)} ms"
        f"  tokens {int(r.get('input_tokens') or 0)} in / {int(r.get('output_tokens') or 0)} out"
        f"  ${float(r.get('cost_usd') or 0):.6f}"
        f"  attempts {_or_dash(r.get('attempts'))}"
        f"  fallback {'from ' + str(r['fallback_from']) if r.get('fallback_from') else 'none'}"
    )


def _request_context(r: Mapping[str, Any]) -> str:
    parents = ",".join(r.get("parent_request_ids") or []) or "-"
    return (
        f"  task {_or_dash(r.get('task_id'))}  parents {parents}"
        f"  tenant {_or_dash(r.get('tenant_id'))}  key {_or_dash(r.get('key_id'))}"
        f"  endpoint {_or_dash(r.get('endpoint'))}  cache {_or_dash(r.get('cache'))}"
    )


def _timings_line(r: Mapping[str, Any]) -> str:
    t = r.get("timings") or {}
    parts = [
        ("queue", t.get("queue_ms")),
        ("upstream first byte", t.get("upstream_first_byte_ms")),
        ("client first byte", t.get("client_first_byte_ms")),
        ("upstream", t.get("upstream_ms")),
        ("gateway", _gateway_ms(t)),
        ("total", t.get("duration_ms")),
    ]
    return "  timings  " + " | ".join(f"{name} {_f(v)}" for name, v in parts) + "  (ms)"


def _gateway_ms(t: Mapping[str, Any]) -> float | None:
    """Time the gateway itself spent; unknown without a total duration."""
    if t.get("duration_ms") is None:
        return None
    spent = float(t["duration_ms"]) - float(t.get("queue_ms") or 0)
    return max(0.0, spent - float(t.get("upstream_ms") or 0))


def _decision_lines(decisions: list[Mapping[str, Any]]) -> list[str]:
    """Stage and outcome in aligned columns so a refusal stands out when scanning."""
    stage_w = max((len(str(d.get("stage", "?"))) for d in decisions), default=0)
    outcome_w = max((len(str(d.get("outcome", "?"))) for d in decisions), default=0)
    lines = []
    for d in decisions:
        lines.append(
            f"  {d.get('stage', '?')!s:<{stage_w}}  {d.get('outcome', '?')!s:<{outcome_w}}"
            f"  ({_f(d.get('duration_ms'), 2)} ms)  {_or_dash(d.get('reason'))}"
        )
        evidence = d.get("evidence")
        if evidence:
            lines.append(f"      {_evidence(evidence)}")
    return lines


def _cut(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _value(value: Any) -> str:
    if isinstance(value, str):
        return value
    if value is None or isinstance(value, bool | int | float):
        return json.dumps(value)
    return json.dumps(value, default=str, sort_keys=True, separators=(",", ":"))


def _evidence(evidence: Any) -> str:
    """`key=value` pairs in the recorder's order, each value and the line cut short."""
    if not isinstance(evidence, Mapping):
        return _cut(_value(evidence), _EVIDENCE_MAX)
    pairs = (f"{k}={_cut(_value(v), _VALUE_MAX)}" for k, v in evidence.items())
    return _cut("  ".join(pairs), _EVIDENCE_MAX)


# -- task ------------------------------------------------------------------------------


def _task_header(a: Mapping[str, Any]) -> list[str]:
    planned = a.get("steps_planned")
    plan = f"{a['steps_executed']} executed / {planned if planned is not None else '?'} planned"
    statuses = " ".join(f"{k}={v}" for k, v in (a.get("statuses") or {}).items()) or "-"
    return [
        f"task {_or_dash(a.get('task_id'))}  e2e {_f(a['e2e_ms'])} ms"
        f"  calls {a['llm_calls']}  steps {plan}",
        f"  tokens {a['input_tokens']} in / {a['output_tokens']} out"
        f"  ${float(a['cost_usd']):.6f}  cache hits {a['cache_hits']}"
        f"  retries {a['retries']}  fallbacks {a['fallbacks']}  statuses {statuses}",
    ]


def _latest_parent(step: Mapping[str, Any], by_id: Mapping[str, Mapping[str, Any]]) -> str | None:
    """The parent the step waited for: ends latest, then started earliest, then by id."""
    parents = [by_id[p] for p in step["parents"] if p in by_id]
    if not parents:
        return None
    best = min(parents, key=lambda p: (-p["end_ms"], p["start_ms"], p["request_id"]))
    return str(best["request_id"])


def _ancestors(rid: str, by_id: Mapping[str, Mapping[str, Any]]) -> set[str]:
    """Every step `rid` depends on, directly or not (parents precede children: no cycles)."""
    seen: set[str] = set()
    todo = [rid]
    while todo:
        for p in by_id[todo.pop()]["parents"]:
            if p in by_id and p not in seen:
                seen.add(p)
                todo.append(p)
    return seen


def _also_after(
    step: Mapping[str, Any], tree_parent: str | None, by_id: Mapping[str, Mapping[str, Any]]
) -> list[str]:
    """Parents not shown by the tree: neither the tree parent nor one of its ancestors."""
    if tree_parent is None:
        return []
    shown = {tree_parent, *_ancestors(tree_parent, by_id)}
    return [p for p in step["parents"] if p in by_id and p not in shown]


def _step_tree(
    steps: list[Mapping[str, Any]], records: Mapping[str, Mapping[str, Any]]
) -> list[str]:
    """Depth-first from the roots; siblings keep the analysis order (by start)."""
    by_id = {str(s["request_id"]): s for s in steps}
    children: dict[str | None, list[Mapping[str, Any]]] = {}
    tree_parent: dict[str, str | None] = {}
    for s in steps:
        tree_parent[s["request_id"]] = _latest_parent(s, by_id)
        children.setdefault(tree_parent[s["request_id"]], []).append(s)
    lines: list[str] = []
    todo = [(s, 0) for s in reversed(children.get(None, []))]
    while todo:
        step, depth = todo.pop()
        also = _also_after(step, tree_parent[step["request_id"]], by_id)
        lines.append(_step_line(step, depth, also, records.get(step["request_id"], {})))
        todo.extend((c, depth + 1) for c in reversed(children.get(step["request_id"], [])))
    return lines


def _step_line(
    step: Mapping[str, Any], depth: int, also: list[str], record: Mapping[str, Any]
) -> str:
    mark = "*" if step.get("on_critical_path") else " "
    branch = "   " * (depth - 1) + "`- " if depth else ""
    numbers = (
        f"{'+' + _f(step['start_ms']):>9} {_f(step['duration_ms']):>8}"
        f" {_f(step['queue_ms']):>7} {_f(step['upstream_ms']):>7} {_f(step['gateway_ms']):>7}"
    )
    what = _or_dash(step.get("model"))
    # An MCP tool call (/mcp) is marked as one: its tool, no tokens.
    tool = step.get("kind") == "tool"
    notes = [f"tool {what}"] if tool else [what, *_record_notes(record)]
    if step.get("inferred") and step["parents"]:
        notes.append("parents inferred")
    if also:
        notes.append("also after: " + ", ".join(also))
    status = _or_dash(step.get("status"))
    return f"{mark} {numbers}  {status:<10} {branch}{step['request_id']}  " + "  ".join(notes)


def _record_notes(record: Mapping[str, Any]) -> list[str]:
    """What the trace adds about a step: tokens, and anything unusual about how it ran."""
    if not record:
        return []
    notes = [f"{int(record.get('input_tokens') or 0)}/{int(record.get('output_tokens') or 0)} tok"]
    if record.get("cache"):
        notes.append(f"cache {record['cache']}")
    if int(record.get("attempts") or 1) > 1:
        notes.append(f"attempts {record['attempts']}")
    if record.get("fallback_from"):
        notes.append(f"fallback from {record['fallback_from']}")
    if record.get("error_code"):
        notes.append(f"error {record['error_code']}")
    return notes
