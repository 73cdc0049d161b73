"""The result file's metadata, warnings, and the terminal summary table.

A number without its workload, load shape, machine and versions cannot be compared with
anything, so all of that travels in the result next to the per-request records.
"""

from __future__ import annotations

import os
import platform
import socket
import sys
from collections import Counter
from datetime import UTC, datetime
from importlib import metadata as importlib_metadata
from typing import Any

from rich.console import Console
from rich.table import Table

SCHEMA = "switchyard.bench.result/1"
PACKAGES = ("switchyard", "aiohttp", "orjson", "numpy", "rich", "matplotlib", "llama_cpp_python")
LAG_WARN_MS = 50.0
CPU_WARN = 0.9


def software() -> dict[str, str | None]:
    out: dict[str, str | None] = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            out[name] = importlib_metadata.version(name.replace("_", "-"))
        except importlib_metadata.PackageNotFoundError:
            out[name] = None
    return out


def machine() -> dict[str, Any]:
    return {
        "hostname": socket.gethostname(),
        "platform": platform.platform(),
        "machine": platform.machine(),
        "processor": platform.processor() or None,
        "cpu_count": os.cpu_count(),
        "affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
    }


def seen_headers(points: list[dict[str, Any]], name: str) -> list[str]:
    """Distinct values of a kept response header across all records (e.g. revisions)."""
    return sorted({v for p in points for r in p["records"] if (v := r["headers"].get(name))})


def metadata(
    base: dict[str, Any], points: list[dict[str, Any]], tokenizer_error: str | None
) -> dict[str, Any]:
    """Run metadata: what the caller describes (`base`) plus what the run observed."""
    sources = Counter[str]()
    for p in points:
        sources.update(p["summary"]["token_source"])
    token_note = {
        "server": "usage reported by the server (stream_options.include_usage)",
        "tokenizer": "SmolLM2 tokenizer from the shipped GGUF; prompts without chat template",
        "estimate": "no tokenizer: content events for output, chars/4 for input",
    }
    return {
        "schema": SCHEMA,
        "created_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "command": sys.argv,
        **base,
        "revisions": seen_headers(points, "x-switchyard-revision"),
        "served_models": seen_headers(points, "x-switchyard-model"),
        "upstreams": seen_headers(points, "x-switchyard-upstream"),
        "token_count_source": {
            "counts": dict(sources),
            "meaning": {k: v for k, v in token_note.items() if k in sources},
            "tokenizer_error": tokenizer_error,
        },
        "machine": machine(),
        "software": software(),
    }


def warnings(point: dict[str, Any]) -> list[str]:
    """What makes this point's numbers suspect, in words."""
    out = []
    s = point["summary"]
    lag = s["send_lag_ms"].get("p99")
    if lag is not None and lag > LAG_WARN_MS:
        out.append(
            f"p99 send lag {lag:.0f} ms: the harness fell behind its schedule, so the offered "
            "rate was lower than asked (see the harness ceiling in docs/benchmarks/index.md)"
        )
    cpu = point["harness"]["cpu_util"]
    if cpu is not None and cpu > CPU_WARN:
        out.append(f"the harness used {cpu:.0%} of a core: it may be the bottleneck")
    if s["failed"]:
        out.append(f"{s['failed']} of {s['requests']} requests failed: {s['errors']}")
    if set(s["token_source"]) - {"server"}:
        out.append(f"token counts not all from server usage: {s['token_source']}")
    return out


def _ms(v: Any) -> str:
    return "-" if v is None else f"{v:,.1f}"


def _rate(v: Any) -> str:
    return "-" if v is None else f"{v:,.2f}"


def flat_metrics(point: dict[str, Any]) -> dict[str, float | None]:
    """One flat name -> number view of a point, shared by the table and `bench compare`."""
    s, out = point["summary"], {}
    for key in ("requests", "completed", "failed", "error_rate", "duration_s"):
        out[key] = s[key]
    for key in ("request_throughput", "output_throughput", "total_token_throughput", "goodput"):
        out[key] = s[key]
    for metric in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms", "send_lag_ms"):
        for q in ("mean", "p50", "p90", "p95", "p99", "max"):
            out[f"{metric}.{q}"] = s[metric].get(q)
    t = point.get("tasks_summary")
    if t:
        for key in ("tasks", "completed", "failed", "task_throughput", "tasks_within_slo_per_s"):
            out[f"task.{key}"] = t[key]
        for metric in ("task_e2e_ms", "critical_path_ms"):
            for q in ("mean", "p50", "p95", "p99", "max"):
                out[f"task.{metric}.{q}"] = t[metric].get(q)
    return out


def _pct(stat: dict[str, Any], *qs: str) -> str:
    return " / ".join(_ms(stat.get(q)) for q in qs)


def _kv(d: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v}" for k, v in d.items()) or "-"


def _harness_cell(h: dict[str, Any]) -> str:
    if h.get("cpu_ms_per_request") is None:
        return "-"
    return f"{h['cpu_ms_per_request']:.2f} ms/req, {h['cpu_util']:.0%} of a core"


Row = tuple[str, Any]  # (name, point -> cell text)
ROWS: tuple[Row, ...] = (
    ("completed / failed", lambda p: f"{p['summary']['completed']} / {p['summary']['failed']}"),
    ("duration (s)", lambda p: _rate(p["summary"]["duration_s"])),
    ("requests/s", lambda p: _rate(p["summary"]["request_throughput"])),
    ("output tokens/s", lambda p: _rate(p["summary"]["output_throughput"])),
    ("total tokens/s", lambda p: _rate(p["summary"]["total_token_throughput"])),
    ("goodput (req/s)", lambda p: _rate(p["summary"]["goodput"])),
    ("TTFT p50 / p99 (ms)", lambda p: _pct(p["summary"]["ttft_ms"], "p50", "p99")),
    ("TPOT p50 / p99 (ms)", lambda p: _pct(p["summary"]["tpot_ms"], "p50", "p99")),
    ("ITL p50 / p99 (ms)", lambda p: _pct(p["summary"]["itl_ms"], "p50", "p99")),
    ("E2E p50 / p95 / p99 (ms)", lambda p: _pct(p["summary"]["e2e_ms"], "p50", "p95", "p99")),
    ("send lag p50 / p99 (ms)", lambda p: _pct(p["summary"]["send_lag_ms"], "p50", "p99")),
    ("errors", lambda p: _kv(p["summary"]["errors"])),
    ("token counts from", lambda p: _kv(p["summary"]["token_source"])),
    ("harness CPU", lambda p: _harness_cell(p["harness"])),
)
TASK_ROWS: tuple[Row, ...] = (
    (
        "tasks completed / failed",
        lambda p: f"{p['tasks_summary']['completed']} / {p['tasks_summary']['failed']}",
    ),
    (
        "task E2E p50 / p95 / p99 (ms)",
        lambda p: _pct(p["tasks_summary"]["task_e2e_ms"], "p50", "p95", "p99"),
    ),
    ("critical path p50 (ms)", lambda p: _pct(p["tasks_summary"]["critical_path_ms"], "p50")),
    ("tasks within SLO /s", lambda p: _rate(p["tasks_summary"]["tasks_within_slo_per_s"])),
)


def print_summary(result: dict[str, Any], console: Console) -> None:
    meta, points = result["metadata"], result["points"]
    title = f"{meta['model']} @ {meta['endpoint']} ({meta['workload']['kind']})"
    table = Table(title=title)
    table.add_column("metric", style="bold")
    for p in points:
        table.add_column(p["label"], justify="right")
    rows = list(ROWS) + (list(TASK_ROWS) if points and points[0].get("tasks_summary") else [])
    for name, fn in rows:
        table.add_row(name, *(fn(p) for p in points))
    console.print(table)
    for p in points:
        for w in p["warnings"]:
            console.print(f"[yellow]warning[/] {p['label']}: {w}")
