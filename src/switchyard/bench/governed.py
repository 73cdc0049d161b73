"""`switchyard bench overhead --scenario governed`: agent-task and tool-call governance on vs off.

In this scenario the scripted upstream answers every chat request with two tool calls
(`search`, read-only, and `create_ticket`, side-effecting), for every target of the
run alike (direct and floor included), and two more Switchyard targets join it, both
with the realistic target's key, limits, ledger and traces (bench/realistic.py):

- `sy-gov-off`: `tools.check_outputs: false`, and requests carry no task: what the
  realistic gateway costs with these replies when nothing governs them;
- `sy-governed`: a tool registry (search read-only, create_ticket side-effecting),
  output checks on, and every request carries `x-task-id` and `x-task-budget` (a
  budget far above what a run reaches): each request is admitted against its task's
  budget, its reply's tool calls are authorized, the side-effecting one gets its
  idempotency key, and the task keeps a note of it.

`sy-governed` is judged against the floor with the usual targets; `sy-gov-off` is its
baseline for the on/off ratios, reported beside them.
"""

from __future__ import annotations

import argparse
import json
from functools import partial
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import yaml

from switchyard.bench.harness import (
    Child,
    KeyedTarget,
    StartError,
    auth_script,
    chat_body,
    check_auth_on,
    http,
    prepare_keyed_gateway,
    readyz,
    start_gateway,
    wait_ready,
)
from switchyard.bench.realistic import KEY_LIMITS, TENANT, TENANT_LIMITS

TARGET = "sy-governed"
BASELINE = "sy-gov-off"
TARGETS = (BASELINE, TARGET)
TOOL_CALLS = "search,create_ticket"  # what the upstream's every chat reply calls
REGISTRY = [
    {"name": "search", "class": "read_only"},
    {"name": "create_ticket", "class": "side_effect"},
]
TASK_BUDGET = "calls=1000000000, tokens=1000000000000, cost_usd=100000000"
TASK_HEADERS = {"x-task-id": "bench-task", "x-task-budget": TASK_BUDGET}
DESCRIPTIONS = {
    BASELINE: "sy-realistic with tools.check_outputs false and no task header; the upstream "
    "answers with two tool calls",
    TARGET: "sy-realistic plus a tool registry, output checks on (authorization, idempotency "
    "key), and x-task-id / x-task-budget on every request (task admission and settle)",
}


def _config(path: Path, governed: bool) -> None:
    cfg: dict[str, Any] = yaml.safe_load(path.read_text())
    cfg["tools"] = {"registry": REGISTRY} if governed else {"check_outputs": False}
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))


def _scripts(workdir: Path, name: str, key: str, max_tokens: int) -> dict[bool, Path]:
    extra = ""
    if name == TARGET:
        extra = "".join(f'wrk.headers["{k}"] = "{v}"\n' for k, v in TASK_HEADERS.items())
    out: dict[bool, Path] = {}
    for stream in (False, True):
        out[stream] = workdir / f"{name}-{'chat-stream' if stream else 'chat'}.lua"
        out[stream].write_text(auth_script(chat_body(stream, max_tokens), key) + extra)
    return out


def start_governed_targets(
    workdir: Path, urls: dict[str, str], args: argparse.Namespace, children: list[Child]
) -> list[KeyedTarget]:
    """Start both gateways against the upstream serving `urls["direct"]`; each started
    child is appended to `children` at once."""
    upstream_port = urlsplit(urls["direct"]).port
    assert upstream_port is not None
    out = []
    for name in TARGETS:
        gw = prepare_keyed_gateway(
            name, workdir, upstream_port, TENANT, TENANT_LIMITS, args.startup_timeout, KEY_LIMITS
        )
        _config(gw.config, governed=name == TARGET)
        child = start_gateway(gw.name, gw.config, gw.port, workdir)
        children.append(child)
        wait_ready(child, partial(readyz, gw.port), args.startup_timeout)
        check_auth_on(gw.name, gw.url, gw.key, args.tokens)
        if name == TARGET:  # served within its task, its tool calls governed
            _check_governed(gw.url, gw.key, args.tokens)
        out.append(KeyedTarget(name, gw.url, _scripts(workdir, name, gw.key, args.tokens)))
    return out


def _check_governed(url: str, key: str, max_tokens: int) -> None:
    headers = {"Authorization": f"Bearer {key}", **TASK_HEADERS}
    status, body = http("POST", url, chat_body(False, max_tokens), headers=headers)
    reply = json.loads(body) if status == 200 else {}
    calls = (reply.get("choices") or [{}])[0].get("message", {}).get("tool_calls") or []
    ids = [c.get("id", "") for c in calls]
    if status != 200 or len(ids) != 2 or not ids[1].startswith("call_sy_"):
        raise StartError(f"{TARGET}: a governed request answered {status}: {body[:300]!r}")


def ratios(summary: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per scenario: governed vs off, as added p50 over the direct call and req/s."""
    out = []
    for s in summary:
        med = s["targets"]
        if TARGET not in med or BASELINE not in med:
            continue
        direct = med["direct"]["p50_ms"]
        on, off = med[TARGET], med[BASELINE]
        added_off = off["p50_ms"] - direct
        out.append(
            {
                "scenario": s["scenario"],
                "added_p50_ms_on": on["p50_ms"] - direct,
                "added_p50_ms_off": added_off,
                "added_p50_ratio_on_off": (on["p50_ms"] - direct) / added_off
                if added_off > 0
                else None,
                "rps_ratio_on_off": on["rps"] / off["rps"] if off["rps"] > 0 else None,
            }
        )
    return out


def lines(summary: list[dict[str, Any]]) -> list[str]:
    rows = ratios(summary)
    if not rows:
        return []
    out = ["", f"governance on ({TARGET}) vs off ({BASELINE}):"]
    for r in rows:
        lat = r["added_p50_ratio_on_off"]
        rps = r["rps_ratio_on_off"]
        out.append(
            f"  {r['scenario']:<15} added p50 {r['added_p50_ms_on']:.3f} vs "
            f"{r['added_p50_ms_off']:.3f} ms ({'-' if lat is None else f'{lat:.2f}x'}), "
            f"req/s {'-' if rps is None else f'{rps:.2f}x'}"
        )
    return out


def record(result: dict[str, Any], summary: list[dict[str, Any]]) -> None:
    result["workload"]["targets"].update(DESCRIPTIONS)
    result["workload"]["governed"] = {
        "upstream_tool_calls": TOOL_CALLS,
        "registry": REGISTRY,
        "task_budget": TASK_BUDGET,
    }
    result["governed_ratios"] = ratios(summary)
