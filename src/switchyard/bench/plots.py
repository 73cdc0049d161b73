"""PNG plots of a result: latency CDFs, latency over time, and sweep curves.

A CDF shows the whole distribution a percentile table flattens; latency over time shows
queue growth (an open-loop run past capacity climbs) and warm-up effects; the sweep plot
shows where throughput stops following the offered load and goodput falls away. Drawn
from the result JSON alone, with the non-interactive Agg backend (no display needed).
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # after choosing the backend


def _ok(point: dict[str, Any]) -> list[dict[str, Any]]:
    return [r for r in point["records"] if r["ok"] and not r["warmup"]]


def _itl(r: dict[str, Any]) -> list[float]:
    c = r["chunk_s"]
    return [(b - a) * 1000 for a, b in itertools.pairwise(c)]


def _cdf(ax: Any, values: list[float], label: str) -> None:
    if not values:
        return
    xs = sorted(values)
    ys = [(i + 1) / len(xs) for i in range(len(xs))]
    ax.step(xs, ys, where="post", label=label)


def latency_cdfs(result: dict[str, Any], path: Path) -> Path:
    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    panels = (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl", "ITL per chunk"), ("e2e_ms", "E2E"))
    for ax, (key, title) in zip(axes.flat, panels, strict=True):
        for p in result["points"]:
            recs = _ok(p)
            if key == "itl":
                values = [g for r in recs for g in _itl(r)]
            else:
                values = [r[key] for r in recs if r[key] is not None]
            _cdf(ax, values, p["label"])
        ax.set_title(f"{title} CDF")
        ax.set_xlabel("ms")
        ax.set_ylabel("fraction of requests" if key != "itl" else "fraction of gaps")
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize="small")
    return _save(fig, path)


def latency_over_time(result: dict[str, Any], path: Path) -> Path:
    fig, axes = plt.subplots(2, 1, figsize=(11, 8), sharex=True)
    for key, ax, title in (("ttft_ms", axes[0], "TTFT"), ("e2e_ms", axes[1], "E2E")):
        for p in result["points"]:
            recs = [r for r in p["records"] if not r["warmup"]]
            ok = [(r["sent_s"], r[key]) for r in recs if r["ok"] and r[key] is not None]
            if ok:
                ax.scatter(*zip(*ok, strict=True), s=8, label=p["label"])
            bad = [(r["sent_s"], r["e2e_ms"]) for r in recs if not r["ok"] and r["e2e_ms"]]
            if bad and key == "e2e_ms":
                ax.scatter(*zip(*bad, strict=True), s=20, marker="x", color="red", label="failed")
        ax.set_title(f"{title} by send time")
        ax.set_ylabel("ms")
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize="small")
    axes[1].set_xlabel("send time (s since the point's start)")
    return _save(fig, path)


def sweep(result: dict[str, Any], path: Path) -> Path:
    points = result["points"]
    open_loop = points[0]["mode"] == "open"
    xs = [p["rate"] if open_loop else p["concurrency"] for p in points]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 5))
    s = [p["summary"] for p in points]
    ax1.plot(xs, [v["request_throughput"] or 0 for v in s], marker="o", label="throughput")
    ax1.plot(xs, [v["goodput"] or 0 for v in s], marker="s", label="goodput")
    if open_loop:
        ax1.plot(xs, xs, linestyle=":", color="gray", label="offered")
    ax1.set_ylabel("requests/s")
    for q in ("p50", "p99"):
        ax2.plot(xs, [v["e2e_ms"][q] or 0 for v in s], marker="o", label=f"E2E {q}")
        ax2.plot(xs, [v["ttft_ms"][q] or 0 for v in s], marker="^", label=f"TTFT {q}")
    ax2.set_ylabel("ms")
    for ax in (ax1, ax2):
        ax.set_xlabel("offered rate (req/s)" if open_loop else "concurrency")
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    return _save(fig, path)


def task_cdf(result: dict[str, Any], path: Path) -> Path:
    fig, ax = plt.subplots(figsize=(8, 5))
    for p in result["points"]:
        tasks = [t for t in p["tasks"] if t["ok"] and not t["warmup"]]
        _cdf(ax, [t["e2e_ms"] for t in tasks], f"{p['label']} task E2E")
        _cdf(ax, [t["critical_path_ms"] for t in tasks], f"{p['label']} critical path")
    ax.set_title("Agent task CDF")
    ax.set_xlabel("ms")
    ax.set_ylabel("fraction of tasks")
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize="small")
    return _save(fig, path)


def write_all(result: dict[str, Any], out_dir: Path) -> list[Path]:
    """Every plot that applies to this result; returns the files written."""
    files = [
        latency_cdfs(result, out_dir / "latency_cdf.png"),
        latency_over_time(result, out_dir / "latency_over_time.png"),
    ]
    if len(result["points"]) > 1:
        files.append(sweep(result, out_dir / "sweep.png"))
    if any(p.get("tasks") for p in result["points"]):
        files.append(task_cdf(result, out_dir / "task_cdf.png"))
    return files


def _save(fig: Any, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
