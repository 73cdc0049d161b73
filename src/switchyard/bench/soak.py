"""`switchyard bench soak`: the realistic configuration under steady load, over time.

Issue #17 found the SQLite file growing ~4.5 KB per request without bound and RSS rising
after warm-up. This runs the gateway as operators do (auth on, a key under a tenant
with rpm/tpm/concurrency/budget limits, usage rows and traces on) against the scripted
instant upstream, with wrk at a fixed connection count, in consecutive slices of
`--slice` seconds. After each slice it records req/s and p50/p99 (wrk), the RSS of the
gateway and its ledger writer, and the bytes the SQLite files take on disk and in use.
It reports bytes per request, RSS drift after the warm-up slices, whether the disk is
flat once retention (`--max-disk-mb`) is reached, and plots all three over time.

    switchyard bench soak --duration 300 --max-disk-mb 64
"""

from __future__ import annotations

import argparse
import json
import sqlite3
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

from switchyard.bench.harness import (
    CHAT_PATH,
    Child,
    Scenario,
    admin_headers,
    auth_config,
    config_yaml,
    free_port,
    gateway_env,
    http,
    machine_info,
    run_wrk,
    spawn,
    stop_all,
    wait_ready,
    write_scripts,
)
from switchyard.bench.policy import create_key


def _rss_kb(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def _children(pid: int) -> list[int]:
    out: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            out += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            continue
    return out


def _ledger_metrics(text: str) -> dict[str, float]:
    """The ledger's backlog (MB waiting for the writer) and rows dropped, from /metrics."""
    out = {"ledger_queued_mb": 0.0, "ledger_dropped": 0.0}
    for line in text.splitlines():
        if line.startswith("switchyard_ledger_queued_bytes "):
            out["ledger_queued_mb"] = round(float(line.split()[1]) / 1e6, 2)
        elif line.startswith("switchyard_ledger_rows_dropped_total "):
            out["ledger_dropped"] = float(line.split()[1])
    return out


def _disk(db: Path) -> tuple[int, int]:
    """(bytes of the SQLite files on disk, bytes of the main file in use)."""
    on_disk = sum(p.stat().st_size for p in db.parent.glob(db.name + "*") if p.is_file())
    try:
        conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=5)
        try:
            size = conn.execute("PRAGMA page_size").fetchone()[0]
            pages = conn.execute("PRAGMA page_count").fetchone()[0]
            free = conn.execute("PRAGMA freelist_count").fetchone()[0]
        finally:
            conn.close()
        return on_disk, (pages - free) * size
    except sqlite3.Error:
        return on_disk, 0


def run(args: argparse.Namespace) -> dict[str, Any]:
    workdir = Path(tempfile.mkdtemp(prefix="switchyard-soak-"))
    children: list[Child] = []
    try:
        up_port, sy_port = free_port(), free_port()
        upstream = spawn(
            "upstream",
            [sys.executable, "-m", "switchyard.bench.scripted_upstream", "--port", str(up_port)],
            workdir,
        )
        children.append(upstream)
        wait_ready(
            upstream,
            lambda: http("GET", f"http://127.0.0.1:{up_port}/health")[0] == 200,
            args.startup_timeout,
        )
        db = workdir / "soak.db"
        key = create_key(db, args.startup_timeout)
        cfg: dict[str, Any] = yaml.safe_load(auth_config(config_yaml(sy_port, up_port, db), db))
        cfg["observe"] = {
            "max_disk_mb": args.max_disk_mb,
            "retention_interval_s": args.retention_interval,
            "traces_sample_ok": args.traces_sample_ok,
        }
        (workdir / "soak.yaml").write_text(yaml.safe_dump(cfg))
        gateway = spawn(
            "switchyard",
            [sys.executable, "-m", "switchyard", "serve", "--config", str(workdir / "soak.yaml")],
            workdir,
            env=gateway_env(),
        )
        children.append(gateway)
        wait_ready(
            gateway,
            lambda: http("GET", f"http://127.0.0.1:{sy_port}/readyz")[0] == 200,
            args.startup_timeout,
        )
        script = write_scripts(workdir, "soak", key, 16)[False]
        url = f"http://127.0.0.1:{sy_port}{CHAT_PATH}"
        scenario = Scenario(stream=False, connections=args.connections)
        slices = []
        started = time.monotonic()
        requests = 0
        while time.monotonic() - started < args.duration:
            r = run_wrk(args.wrk, url, script, scenario, args.slice)
            requests += r.requests
            pids = [gateway.proc.pid, *_children(gateway.proc.pid)]
            _, text = http("GET", f"http://127.0.0.1:{sy_port}/metrics", headers=admin_headers())
            ledger = _ledger_metrics(text.decode("utf-8", "replace"))
            on_disk, in_use = _disk(db)
            slices.append(
                {
                    "t_s": round(time.monotonic() - started, 1),
                    "requests": requests,
                    "rps": r.rps,
                    "p50_ms": r.p50_ms,
                    "p99_ms": r.p99_ms,
                    "errors": r.non_2xx + r.socket_errors,
                    "rss_mib": round(sum(_rss_kb(p) for p in pids) / 1024, 1),
                    "rss_gateway_mib": round(_rss_kb(pids[0]) / 1024, 1),
                    "disk_mb": round(on_disk / 1e6, 2),
                    "in_use_mb": round(in_use / 1e6, 2),
                    **ledger,
                }
            )
            print(
                f"  t={slices[-1]['t_s']:>6}s  {r.rps:8.0f} req/s  p99 {r.p99_ms:6.2f} ms  "
                f"rss {slices[-1]['rss_mib']:7.1f} MiB  disk {slices[-1]['disk_mb']:8.2f} MB  "
                f"ledger backlog {slices[-1]['ledger_queued_mb']:6.2f} MB",
                flush=True,
            )
    finally:
        stop_all(children)
    return summarize(slices, args) | {"machine": machine_info(args.wrk), "slices": slices}


def summarize(slices: list[dict[str, Any]], args: argparse.Namespace) -> dict[str, Any]:
    warm = min(args.warmup_slices, max(0, len(slices) - 2))
    after = slices[warm:]
    # Bytes a request adds to the file's data, before retention first deletes: the
    # data in use over the requests served, up to the last slice of the leading run
    # still under the limit.
    limit_mb = args.max_disk_mb * 1.048576
    lead = slices[0]
    for s in slices:
        if s["in_use_mb"] >= 0.9 * limit_mb:
            break
        lead = s
    per_request = lead["in_use_mb"] * 1e6 / lead["requests"] if lead["requests"] else None
    rss = [s["rss_mib"] for s in after]
    base = rss[0]
    first_full = next((i for i, s in enumerate(slices) if s["in_use_mb"] >= 0.9 * limit_mb), None)
    since_full = [] if first_full is None else [s["disk_mb"] for s in slices[first_full:]]
    return {
        "benchmark": "soak",
        "workload": {
            "duration_s": args.duration,
            "slice_s": args.slice,
            "connections": args.connections,
            "warmup_slices": warm,
            "max_disk_mb": args.max_disk_mb,
            "traces_sample_ok": args.traces_sample_ok,
            "config": "auth on, tenant limits and budget, usage rows and traces on",
        },
        "requests": slices[-1]["requests"] if slices else 0,
        "errors": sum(s["errors"] for s in slices),
        "ledger_rows_dropped": slices[-1].get("ledger_dropped", 0.0) if slices else 0.0,
        "ledger_backlog_mb_max": max((s.get("ledger_queued_mb", 0.0) for s in slices), default=0.0),
        "bytes_per_request": None if per_request is None else round(per_request, 1),
        "rss_drift_after_warmup": round((max(rss) - base) / base, 4) if base else None,
        "rss_range_mib": [min(rss), max(rss)],
        "disk_limit_reached": first_full is not None,
        # The files' size from the first slice at the limit on: [least, most].
        "disk_after_limit_mb": [min(since_full), max(since_full)] if since_full else None,
        "p99_ms_median": statistics.median(s["p99_ms"] for s in after),
    }


def plot(result: dict[str, Any], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = result["slices"]
    t = [x["t_s"] for x in s]
    fig, axes = plt.subplots(3, 1, figsize=(8, 8), sharex=True)
    axes[0].plot(t, [x["rss_mib"] for x in s])
    axes[0].set_ylabel("RSS (MiB)")
    axes[1].plot(t, [x["disk_mb"] for x in s], label="on disk")
    axes[1].plot(t, [x["in_use_mb"] for x in s], label="in use")
    axes[1].axhline(result["workload"]["max_disk_mb"] * 1.048576, ls="--", c="gray")
    axes[1].set_ylabel("SQLite (MB)")
    axes[1].legend()
    axes[2].plot(t, [x["p50_ms"] for x in s], label="p50")
    axes[2].plot(t, [x["p99_ms"] for x in s], label="p99")
    axes[2].set_ylabel("latency (ms)")
    axes[2].set_xlabel("seconds")
    axes[2].legend()
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--duration", type=float, default=120.0, help="seconds of load in all")
    p.add_argument("--slice", type=int, default=10, help="seconds per wrk run (one sample)")
    p.add_argument("--warmup-slices", type=int, default=2, help="slices before drift counts")
    p.add_argument("--connections", type=int, default=8)
    p.add_argument("--max-disk-mb", type=float, default=64.0, help="observe.max_disk_mb")
    p.add_argument("--retention-interval", type=float, default=5.0, help="seconds")
    p.add_argument("--traces-sample-ok", type=float, default=1.0, help="observe.traces_sample_ok")
    p.add_argument("--wrk", default="wrk")
    p.add_argument("--startup-timeout", type=float, default=120.0)
    p.add_argument("--out", default="bench-results/soak")
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    result = run(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "result.json").write_text(json.dumps(result, indent=2))
    plot(result, out / "soak.png")
    keys = (
        "requests",
        "errors",
        "bytes_per_request",
        "rss_drift_after_warmup",
        "rss_range_mib",
        "disk_limit_reached",
        "disk_after_limit_mb",
        "p99_ms_median",
    )
    for k in keys:
        print(f"  {k}: {result[k]}")
    print(f"results: {out / 'result.json'}, plot: {out / 'soak.png'}")
    return 0 if result["errors"] == 0 else 1
