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

This module builds on the process and HTTP helpers of `overhead.py`; only `overhead.run`
calls into it, and only with `--policy`.
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import yaml

from switchyard.bench.overhead import (
    CHAT_PATH,
    Child,
    StartError,
    _child_env,
    _version,
    chat_body,
    config_yaml,
    free_port,
    gateway_env,
    http,
    smoke,
    spawn,
    wait_ready,
    wrk_script,
)

BASELINE = "switchyard"  # the policy-off target every policy target is compared with
MEMORY_TARGET = "sy-policy"
REDIS_TARGET = "sy-policy-redis"
POLICY_TARGETS = (MEMORY_TARGET, REDIS_TARGET)
TENANT = "bench"
# High enough that no request in any run is refused: the bench measures the cost of
# checking limits, not the effect of hitting them. Each request reserves about 20 tokens.
TENANT_LIMITS: dict[str, int | float] = {
    "rpm": 100_000_000,
    "tpm": 1_000_000_000,
    "max_concurrency": 100_000,
    "budget_usd": 1_000_000,
}
AUTH_ON = {"mode": "keys", "bootstrap_dev_key": False}
DESCRIPTIONS = {
    MEMORY_TARGET: "switchyard serve, auth keys, key+tenant limits and budget in the "
    "in-process MemoryLimiter, SQLite usage ledger",
    REDIS_TARGET: "as sy-policy, with storage.redis_url: RedisLimiter on a local redis-server",
}


@dataclass(frozen=True, slots=True)
class PolicyTarget:
    """A started policy gateway: its chat URL and the wrk scripts that carry its key."""

    name: str
    url: str
    scripts: dict[bool, Path]


# --- configuration and keys -------------------------------------------------------------


def policy_config(base_yaml: str, db_path: Path, redis_url: str | None) -> str:
    """The policy-off config with auth on and its own storage.

    Derived from the policy-off YAML rather than written anew, so the model config is the
    same by construction and only auth and storage differ.
    """
    cfg: dict[str, Any] = yaml.safe_load(base_yaml)
    cfg["auth"] = dict(AUTH_ON)
    storage: dict[str, str] = {"sqlite_path": str(db_path)}
    if redis_url is not None:
        storage["redis_url"] = redis_url
    cfg["storage"] = storage
    return yaml.safe_dump(cfg, sort_keys=False)


def _cli(argv: list[str], timeout_s: float) -> dict[str, Any]:
    """Run `python -m switchyard ARGV` and return its JSON output.

    The bench goes through the CLI, not `KeyStore`, so it exercises what an operator does.
    """
    cmd = [sys.executable, "-m", "switchyard", *argv]
    try:
        done = subprocess.run(
            cmd,
            capture_output=True,
            text=True,
            timeout=timeout_s,
            env=_child_env(),
            stdin=subprocess.DEVNULL,
        )
    except subprocess.TimeoutExpired:
        raise StartError(f"`switchyard {' '.join(argv[:2])}` took over {timeout_s:.0f} s") from None
    if done.returncode != 0:
        raise StartError(
            f"`switchyard {' '.join(argv[:2])}` exited {done.returncode}: {done.stderr.strip()}"
        )
    try:
        out: dict[str, Any] = json.loads(done.stdout)
    except json.JSONDecodeError:
        raise StartError(
            f"`switchyard {' '.join(argv[:2])}` printed no JSON: {done.stdout!r}"
        ) from None
    return out


def create_key(db_path: Path, timeout_s: float) -> str:
    """Create the bench tenant and one key in `db_path`; return the plaintext key.

    The key sets no limits of its own, so the tenant's apply: one scope with rpm, tpm,
    concurrency and budget, all far above what the bench can reach.
    """
    limits = [
        arg for name, v in TENANT_LIMITS.items() for arg in (f"--{name.replace('_', '-')}", str(v))
    ]
    _cli(["tenants", "create", TENANT, *limits, "--db", str(db_path)], timeout_s)
    key = _cli(["keys", "create", "--tenant", TENANT, "--db", str(db_path)], timeout_s).get("key")
    if not isinstance(key, str) or not key:
        raise StartError("`switchyard keys create` printed no key")
    return key


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


def auth_script(body: bytes, key: str) -> str:
    """The overhead bench's wrk script plus the Bearer key the policy gateways require."""
    return wrk_script(body) + f'wrk.headers["Authorization"] = "Bearer {key}"\n'


def write_scripts(workdir: Path, name: str, key: str, max_tokens: int) -> dict[bool, Path]:
    scripts: dict[bool, Path] = {}
    for stream in (False, True):
        scripts[stream] = workdir / f"{name}-{'chat-stream' if stream else 'chat'}.lua"
        scripts[stream].write_text(auth_script(chat_body(stream, max_tokens), key))
    return scripts


def check_policy_on(name: str, url: str, key: str, max_tokens: int) -> None:
    """Before measuring: a request without a key must be refused (else policy is off and
    the target measures nothing new), and with the key it must be served."""
    status, body = http("POST", url, chat_body(False, max_tokens))
    if status != 401:
        raise StartError(f"{name}: a request without a key answered {status}, not 401: {body!r}")
    smoke(name, url, max_tokens, headers={"Authorization": f"Bearer {key}"})


def _launch(
    name: str, workdir: Path, upstream_port: int, redis_url: str | None, timeout_s: float
) -> tuple[Child, int, str]:
    """Create the tenant and key in a fresh SQLite file, then start that gateway."""
    db = workdir / f"{name}.db"
    key = create_key(db, timeout_s)
    port = free_port()
    cfg = workdir / f"{name}.yaml"
    cfg.write_text(policy_config(config_yaml(port, upstream_port, db), db, redis_url))
    argv = [sys.executable, "-m", "switchyard", "serve", "--config", str(cfg), "--port", str(port)]
    return spawn(name, argv, workdir, env=gateway_env()), port, key


def _readyz(port: int) -> bool:
    return http("GET", f"http://127.0.0.1:{port}/readyz")[0] == 200


def start_policy_targets(
    workdir: Path,
    urls: dict[str, str],
    args: argparse.Namespace,
    children: list[Child],
) -> list[PolicyTarget]:
    """Start redis and both policy gateways against the upstream already serving `urls`.

    Started children are appended to `children` at once, so the caller stops them
    whatever happens here.
    """
    upstream_port = urlsplit(urls["direct"]).port
    assert upstream_port is not None
    redis_url, _ = start_redis(args.redis_server, workdir, args.startup_timeout, children)
    launched: list[tuple[str, Child, int, str]] = []
    for name, redis in ((MEMORY_TARGET, None), (REDIS_TARGET, redis_url)):
        child, port, key = _launch(name, workdir, upstream_port, redis, args.startup_timeout)
        children.append(child)
        launched.append((name, child, port, key))
    targets: list[PolicyTarget] = []
    for name, child, port, key in launched:
        wait_ready(child, partial(_readyz, port), args.startup_timeout)
        url = f"http://127.0.0.1:{port}{CHAT_PATH}"
        check_policy_on(name, url, key, args.tokens)
        targets.append(PolicyTarget(name, url, write_scripts(workdir, name, key, args.tokens)))
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
    machine["versions"]["redis"] = _version("redis")
    machine["redis_server"] = redis_server_version(redis_binary)
