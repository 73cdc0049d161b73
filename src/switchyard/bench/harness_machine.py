"""What a bench run used and ran on: CPU seconds per process tree (read from /proc)
and the machine, kernel and package versions recorded beside every result. A part of
`harness.py` (which re-exports it), at the very bottom of the bench import graph.
"""

from __future__ import annotations

import os
import platform
import resource
import subprocess
from collections.abc import Iterable
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any


@dataclass(frozen=True, slots=True)
class CpuSample:
    """CPU seconds (user + system) used so far: per process tree root, the same split by
    the role of each process in the tree (`parts`: root -> role -> seconds, see
    `process_role`), and by this process's waited-for children (the load generator,
    run to its end)."""

    trees: dict[int, float]
    waited: float
    parts: dict[int, dict[str, float]] = field(default_factory=dict)


# A gateway's processes by what their command line runs (`serve --workers N`'s workers,
# the usage ledger's writer); anything else is named by its executable (redis-server,
# llama-server, nginx ...).
_WORKER = b"switchyard.scale.worker"
_ROLES = ((_WORKER, "workers"), (b"ledger_writer", "ledger writer"))


def process_role(cmdline: bytes, comm: str, root: bool, has_workers: bool) -> str:
    """What one process of a measured tree is: the root is the gateway, or its control
    plane when it supervises workers; the others by their command line or name."""
    if root:
        return "control plane" if has_workers else "gateway"
    for marker, role in _ROLES:
        if marker in cmdline:
            return role
    return comm


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:  # gone since it was listed
        return b""


def cpu_sample(roots: Iterable[int]) -> CpuSample:
    """What each root process and its descendants have used, read from /proc: every
    live process of the tree, plus what its members' reaped children used (counted
    under the member's role)."""
    ticks = float(os.sysconf("SC_CLK_TCK"))
    comms: dict[int, str] = {}
    table: dict[int, tuple[int, int]] = {}  # pid -> (parent, ticks used incl. reaped)
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            raw = Path(f"/proc/{entry.name}/stat").read_bytes()
        except OSError:  # gone between the listing and the read
            continue
        close = raw.rindex(b")")
        fields = raw[close + 2 :].split()  # after the command name
        used = sum(int(f) for f in fields[11:15])  # utime stime cutime cstime
        pid = int(entry.name)
        table[pid] = (int(fields[1]), used)
        comms[pid] = raw[raw.index(b"(") + 1 : close].decode(errors="replace")
    kids: dict[int, list[int]] = {}
    for pid, (parent, _) in table.items():
        kids.setdefault(parent, []).append(pid)
    trees: dict[int, float] = {}
    parts: dict[int, dict[str, float]] = {}
    for root in roots:
        members, stack = [], [root]
        while stack:
            pid = stack.pop()
            if pid in table:
                members.append((pid, _cmdline(pid)))
                stack.extend(kids.get(pid, ()))
        has_workers = any(_WORKER in cmd for _, cmd in members)
        split: dict[str, float] = {}
        for pid, cmd in members:
            role = process_role(cmd, comms[pid], pid == root, has_workers)
            split[role] = split.get(role, 0.0) + table[pid][1] / ticks
        trees[root] = sum(table[pid][1] for pid, _ in members) / ticks
        parts[root] = split
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return CpuSample(trees, usage.ru_utime + usage.ru_stime, parts)


def package_version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "not installed"


def _proc_field(path: str, key: str) -> str | None:
    try:
        with open(path) as fh:
            for line in fh:
                name, _, value = line.partition(":")
                if name.strip() == key:
                    return value.strip()
    except OSError:
        pass
    return None


def machine_info(wrk: str) -> dict[str, Any]:
    """What the numbers depend on, so two result files can be compared honestly."""
    try:
        done = subprocess.run([wrk, "--version"], capture_output=True, text=True, timeout=10)
        wrk_version = (done.stdout + done.stderr).strip().splitlines()[0]
    except (OSError, IndexError, subprocess.TimeoutExpired):
        wrk_version = "unknown"
    return {
        "cpu_model": _proc_field("/proc/cpuinfo", "model name") or platform.processor(),
        "cpu_count": os.cpu_count(),
        "cpu_affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "memory_total": _proc_field("/proc/meminfo", "MemTotal"),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "versions": {
            d: package_version(d)
            for d in (
                "switchyard",
                "fastapi",
                "starlette",
                "uvicorn",
                "aiohttp",
                "uvloop",
                "httptools",
                "orjson",
            )
        },
        "wrk": wrk_version,
    }
