"""`switchyard bench overhead --scenario workers`: the realistic gateway on every core.

`switchyard serve` in one process uses one core; `serve --workers N` runs N worker
processes on one port (each with its own `SO_REUSEPORT` listener) over one control
plane (scale/workers.py). The `sy-workers` target is the realistic target
(bench/realistic.py: the same config, tenant, key and checks, started by the same
functions) served with `--workers N` (`--workers`, 2 by default). The config names no
`storage.redis_url`, so the supervisor starts its private `redis-server` on a Unix
socket and every worker's limiter counts there; usage rows and traces go through the
one shared ledger writer into the target's SQLite file, which the start checks see.
Its workers, writer, control plane and Redis are all the supervisor's descendants, so
the run's CPU per request is the whole gateway's.

It runs in the same interleaved rounds as the other targets, so `--scenario realistic
workers` measures one process and N side by side, and is judged against the floor like
every Switchyard target. Beside that, this module reports issue #50's target: at c=32,
N workers serve at least the Python floor's req/s (and, with `sy-realistic` in the run,
how many times one process's). A miss is reported, not a failed run.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from switchyard.bench import realistic
from switchyard.bench.harness import Child

TARGET = "sy-workers"
DEFAULT_WORKERS = 2
LIMITER = "redis, private redis-server on a Unix socket"
RPS_RATIO_MIN = 1.0  # sy-workers req/s / floor req/s at concurrency 32 (#50)
CONNECTIONS = 32


def description(workers: int) -> str:
    """What the target is, for the JSON result's workload."""
    return (
        f"sy-realistic's config, tenant, key and checks served by `switchyard serve "
        f"--workers {workers}`: {workers} worker processes on one port (SO_REUSEPORT) over "
        f"one control plane, limits and budget in a private redis-server on a Unix socket, "
        f"usage rows and traces through one shared ledger writer into one SQLite file"
    )


def start_workers_target(
    workdir: Path, urls: dict[str, str], args: argparse.Namespace, children: list[Child]
) -> realistic.RealisticTarget:
    """Start the realistic gateway with `args.workers` workers against the upstream
    serving `urls["direct"]`, in a directory of its own (its private Redis and ledger
    sockets live beside its SQLite file); ready once every worker listens and the
    realistic checks pass. The started child is appended to `children` at once."""
    home = workdir / TARGET
    home.mkdir()
    return realistic.start_realistic_target(
        home, urls, args, children, name=TARGET, workers=args.workers
    )


def ratios(summary: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per scenario at c=32: sy-workers' req/s over the floor's with #50's verdict, and
    over one process's (`sy-realistic`) when that was measured."""
    out = []
    for s in summary:
        med = s["targets"]
        if s["connections"] != CONNECTIONS or TARGET not in med:
            continue
        mine, floor = med[TARGET]["rps"], med["floor"]["rps"]
        ratio = mine / floor if floor > 0 else None
        one = med.get(realistic.TARGET, {}).get("rps")
        out.append(
            {
                "scenario": s["scenario"],
                "rps_ratio": ratio,
                "verdict": "PASS" if ratio is not None and ratio >= RPS_RATIO_MIN else "MISS",
                "rps_over_one_process": mine / one if one else None,
            }
        )
    return out


def lines(summary: list[dict[str, Any]], workers: int | None) -> list[str]:
    """The report's #50 block: each c=32 scenario's ratio and verdict."""
    rows = ratios(summary)
    if not rows:
        return []
    n = f"{workers} workers" if workers else "workers"
    out = ["", f"{n} ({TARGET}) at c={CONNECTIONS}, req/s / floor >= {RPS_RATIO_MIN} (#50):"]
    for r in rows:
        ratio = "n/a" if r["rps_ratio"] is None else f"{r['rps_ratio']:.2f}"
        one = r["rps_over_one_process"]
        beside = "" if one is None else f"; {one:.2f}x {realistic.TARGET}'s (one process)"
        out.append(f"  {r['scenario']:<15} req/s {TARGET}/floor {ratio}  [{r['verdict']}]{beside}")
    return out


def record(result: dict[str, Any], summary: list[dict[str, Any]], workers: int) -> None:
    """Add what the target was, its worker count and limiter, and #50's ratios."""
    workload = result["workload"]
    workload["targets"][TARGET] = description(workers)
    workload["workers"] = realistic.workload(TARGET, LIMITER) | {
        "workers": workers,
        "rps_ratio_min_at_c32": RPS_RATIO_MIN,
    }
    result["workers_ratios"] = ratios(summary)
