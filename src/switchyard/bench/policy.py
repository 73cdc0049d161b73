"""`switchyard bench overhead --policy`: what authentication, limits, budgets and the ledger cost.

The plain overhead bench runs Switchyard with `auth: {mode: disabled}`, so it measures the
gateway core only. With `--policy` two more Switchyard targets join the same interleaved
rounds, serving the same model config with auth on:

- `sy-policy`: a Bearer key per request, the key and tenant scopes reserved and settled in
  the in-process `MemoryLimiter`, a usage-ledger row per request in its own SQLite file;
- `sy-policy-redis`: the same with `storage.redis_url` set, so the reservations run as Lua
  scripts on a local `redis-server` that the bench starts and stops itself.

The tenant is created beforehand with the CLI, with limits so high that no request is
ever refused: every request pays for the whole policy path, and a non-2xx answer means
the numbers are wrong, not slow. Ratios are against the policy-off `switchyard` target
measured in the same rounds, so machine drift cancels out.

This module builds on the process, key and HTTP helpers of `harness.py`; only
`overhead.run` calls into it, and only with `--policy`.
"""

from __future__ import annotations

import argparse
import socket
import subprocess
from functools import partial
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from switchyard.bench.harness import (
    AUTH_ON,
    Child,
    KeyedGateway,
    KeyedTarget,
    LimitValue,
    check_auth_on,
    create_tenant_key,
    free_port,
    package_version,
    prepare_keyed_gateway,
    readyz,
    spawn,
    start_gateway,
    wait_ready,
    write_scripts,
)

BASELINE = "switchyard"  # the policy-off target every policy target is compared with
MEMORY_TARGET = "sy-policy"
REDIS_TARGET = "sy-policy-redis"
POLICY_TARGETS = (MEMORY_TARGET, REDIS_TARGET)
TENANT = "bench"
# High enough that no request in any run is refused: the bench measures the cost of
# checking limits, not the effect of hitting them. Each request reserves about 20 tokens.
TENANT_LIMITS: dict[str, LimitValue] = {
    "rpm": 100_000_000,
    "tpm": 1_000_000_000,
    "max_concurrency": 100_000,
    "budget_usd": 1_000_000,
}
DESCRIPTIONS = {
    MEMORY_TARGET: "switchyard serve, auth keys, key+tenant limits and budget in the "
    "in-process MemoryLimiter, SQLite usage ledger",
    REDIS_TARGET: "as sy-policy, with storage.redis_url: RedisLimiter on a local redis-server",
}


# --- tenant and key ---------------------------------------------------------------------


def create_key(db_path: Path, timeout_s: float) -> str:
    """Create the bench tenant and one key in `db_path`; return the plaintext key.

    The key sets no limits of its own, so the tenant's apply: one scope with rpm, tpm,
    concurrency and budget, all far above what the bench can reach.
    """
    return create_tenant_key(db_path, TENANT, TENANT_LIMITS, timeout_s)


# --- redis ------------------------------------------------------------------------------


def redis_ping(port: int) -> bool:
    """True when a Redis server answers PING on loopback `port` (inline protocol)."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1) as s:
            s.sendall(b"PING\r\n")
            return s.recv(64).startswith(b"+PONG")
    except OSError:
        return False


def redis_server_argv(binary: str, port: int, workdir: Path | None = None) -> list[str]:
    """A throwaway redis-server: loopback only, no persistence (shared with the tests)."""
    argv = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
    if workdir is not None:  # nothing should be written, but never into the caller's cwd
        argv += ["--dir", str(workdir)]
    return argv


def start_redis(
    binary: str, workdir: Path, timeout_s: float, children: list[Child]
) -> tuple[str, Child]:
    """Start a throwaway redis-server (no persistence, loopback only); return its URL."""
    port = free_port()
    child = spawn(
        "redis",
        redis_server_argv(binary, port, workdir),
        workdir,
    )
    children.append(child)
    wait_ready(child, lambda: redis_ping(port), timeout_s)
    return f"redis://127.0.0.1:{port}/0", child


def redis_server_version(binary: str) -> str:
    try:
        done = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=10)
        return (done.stdout + done.stderr).strip().splitlines()[0]
    except (OSError, IndexError, subprocess.TimeoutExpired):
        return "unknown"


# --- gateways ---------------------------------------------------------------------------


def start_policy_targets(
    workdir: Path,
    urls: dict[str, str],
    args: argparse.Namespace,
    children: list[Child],
) -> list[KeyedTarget]:
    """Start redis and both policy gateways against the upstream already serving `urls`.

    Started children are appended to `children` at once, so the caller stops them
    whatever happens here.
    """
    upstream_port = urlsplit(urls["direct"]).port
    assert upstream_port is not None
    redis_url, _ = start_redis(args.redis_server, workdir, args.startup_timeout, children)
    launched: list[tuple[KeyedGateway, Child]] = []
    for name, redis in ((MEMORY_TARGET, None), (REDIS_TARGET, redis_url)):
        gw = prepare_keyed_gateway(
            name,
            workdir,
            upstream_port,
            TENANT,
            TENANT_LIMITS,
            args.startup_timeout,
            redis_url=redis,
        )
        child = start_gateway(name, gw.config, gw.port, workdir)
        children.append(child)
        launched.append((gw, child))
    targets: list[KeyedTarget] = []
    for gw, child in launched:
        wait_ready(child, partial(readyz, gw.port), args.startup_timeout)
        check_auth_on(gw.name, gw.url, gw.key, args.tokens)
        scripts = write_scripts(workdir, gw.name, gw.key, args.tokens)
        targets.append(KeyedTarget(gw.name, gw.url, scripts))
    return targets


# --- results ----------------------------------------------------------------------------


def _ratio(num: float, den: float) -> float | None:
    return num / den if den > 0 else None


def annotate(summary: list[dict[str, Any]]) -> None:
    """Add each policy target's added p50 and its ratios against policy-off Switchyard
    to every scenario of `summary`, under "policy"."""
    for s in summary:
        med = s["targets"]
        off_added = s["switchyard_added_p50_ms"]
        out: dict[str, dict[str, float | None]] = {}
        for name in POLICY_TARGETS:
            added = med[name]["p50_ms"] - med["direct"]["p50_ms"]
            out[name] = {
                "added_p50_ms": added,
                "rps_ratio_vs_policy_off": _ratio(med[name]["rps"], med[BASELINE]["rps"]),
                "added_p50_ratio_vs_policy_off": _ratio(added, off_added),
            }
        s["policy"] = {"baseline": BASELINE, "targets": out}


def errors(summary: list[dict[str, Any]]) -> dict[str, int]:
    """Non-2xx and socket errors per policy target, over all scenarios and rounds."""
    return {
        name: sum(int(s["targets"][name]["errors"]) for s in summary) for name in POLICY_TARGETS
    }


def record(result: dict[str, Any], redis_binary: str) -> None:
    """Add what the policy targets were and what they ran on to the JSON result."""
    workload = result["workload"]
    workload["targets"].update(DESCRIPTIONS)
    workload["policy"] = {
        "baseline": BASELINE,
        "auth": AUTH_ON,
        "tenant": TENANT,
        "tenant_limits": TENANT_LIMITS,
        "key_limits": "none (the tenant's apply)",
        "ratios": {
            "rps_ratio_vs_policy_off": "policy-on req/s / policy-off req/s",
            "added_p50_ratio_vs_policy_off": "policy-on added p50 / policy-off added p50",
        },
    }
    machine = result["machine"]
    machine["versions"]["redis"] = package_version("redis")
    machine["redis_server"] = redis_server_version(redis_binary)
