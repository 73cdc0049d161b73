"""What the process-level benches share: child processes, loopback HTTP, wrk, configs, keys.

`bench overhead` (with its policy, observe and realistic targets) and `bench soak` start
a scripted upstream and gateways as child processes, wait for them, check them with a
few requests, drive them with wrk and read wrk's report. Those helpers live here.

This module imports no other `switchyard.bench` module but its own part,
`harness_machine.py` (what a run used and ran on: CPU per process tree, the machine and
its versions), so every bench can build on it and the bench import graph runs one way
(`tests/unit/bench/test_bench_imports.py` checks both).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import signal
import socket
import sqlite3
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

import psutil
import yaml

import switchyard
from switchyard.bench.harness_machine import CpuSample as CpuSample
from switchyard.bench.harness_machine import cpu_sample as cpu_sample
from switchyard.bench.harness_machine import machine_info as machine_info
from switchyard.bench.harness_machine import package_version as package_version

MODEL = "scripted"
CHAT_PATH = "/v1/chat/completions"
UNIT_MS = {"us": 0.001, "ms": 1.0, "s": 1000.0, "m": 60_000.0, "h": 3_600_000.0}
# Auth on, and no first-run dev key: a keyed bench gateway serves only the key it was given.
AUTH_ON = {"mode": "keys", "bootstrap_dev_key": False}
ADMIN_ENV = "SWITCHYARD_ADMIN_KEY"
# The admin key of the gateways a bench starts (unless the environment has one): their
# /metrics answers it only.
BENCH_ADMIN_KEY = "bench-admin-" + secrets.token_hex(8)

LimitValue = int | float | str


class StartError(Exception):
    """A target did not come up or does not answer correctly; the message says which."""


@dataclass(frozen=True, slots=True)
class Scenario:
    """One wrk load shape: streamed or not, at a number of connections."""

    stream: bool
    connections: int

    @property
    def threads(self) -> int:
        return 1 if self.connections == 1 else 2

    @property
    def name(self) -> str:
        return f"{'stream' if self.stream else 'non-stream'} c={self.connections}"


@dataclass(frozen=True, slots=True)
class WrkResult:
    rps: float
    avg_ms: float
    p50_ms: float
    p75_ms: float
    p90_ms: float
    p99_ms: float
    requests: int
    non_2xx: int
    socket_errors: int


@dataclass(slots=True)
class Child:
    name: str
    proc: subprocess.Popen[bytes]
    log: Path


def chat_body(stream: bool, max_tokens: int) -> bytes:
    body: dict[str, Any] = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": max_tokens,
    }
    if stream:
        body["stream"] = True
    return json.dumps(body, separators=(",", ":")).encode()


# --- wrk ------------------------------------------------------------------------------


def wrk_script(body: bytes) -> str:
    """A wrk Lua script that POSTs `body` as JSON on every request."""
    quoted = body.decode().replace("\\", "\\\\").replace('"', '\\"')
    return (
        'wrk.method = "POST"\n'
        'wrk.headers["Content-Type"] = "application/json"\n'
        f'wrk.body = "{quoted}"\n'
    )


def auth_script(body: bytes, key: str) -> str:
    """`wrk_script` plus the Bearer key a gateway with auth on requires."""
    return wrk_script(body) + f'wrk.headers["Authorization"] = "Bearer {key}"\n'


def write_scripts(workdir: Path, name: str, key: str | None, max_tokens: int) -> dict[bool, Path]:
    """The wrk scripts of one target, by stream: with its Bearer key, or none."""
    scripts: dict[bool, Path] = {}
    for stream in (False, True):
        body = chat_body(stream, max_tokens)
        scripts[stream] = workdir / f"{name}-{'chat-stream' if stream else 'chat'}.lua"
        scripts[stream].write_text(wrk_script(body) if key is None else auth_script(body, key))
    return scripts


def _ms(value: str, unit: str) -> float:
    return float(value) * UNIT_MS[unit]


def parse_wrk(text: str) -> WrkResult:
    """Read wrk's `--latency` report. Raises ValueError when a needed line is missing."""
    rps = re.search(r"^Requests/sec:\s+([\d.]+)", text, re.M)
    avg = re.search(r"^\s+Latency\s+([\d.]+)(us|ms|s|m|h)\b", text, re.M)
    total = re.search(r"^\s+(\d+) requests in ", text, re.M)
    pct = {
        m.group(1): _ms(m.group(2), m.group(3))
        for m in re.finditer(r"^\s+(50|75|90|99)%\s+([\d.]+)(us|ms|s|m|h)\s*$", text, re.M)
    }
    if rps is None or avg is None or total is None or len(pct) != 4:
        raise ValueError(f"unexpected wrk output:\n{text}")
    non_2xx = re.search(r"Non-2xx or 3xx responses:\s+(\d+)", text)
    sock = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", text)
    return WrkResult(
        rps=float(rps.group(1)),
        avg_ms=_ms(avg.group(1), avg.group(2)),
        p50_ms=pct["50"],
        p75_ms=pct["75"],
        p90_ms=pct["90"],
        p99_ms=pct["99"],
        requests=int(total.group(1)),
        non_2xx=int(non_2xx.group(1)) if non_2xx else 0,
        socket_errors=sum(int(g) for g in sock.groups()) if sock else 0,
    )


def run_wrk(wrk: str, url: str, script: Path, scenario: Scenario, duration_s: int) -> WrkResult:
    cmd = [
        wrk,
        f"-t{scenario.threads}",
        f"-c{scenario.connections}",
        f"-d{duration_s}s",
        "--timeout",
        "10s",
        "--latency",
        "-s",
        str(script),
        url,
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=duration_s + 60)
    if done.returncode != 0:
        raise RuntimeError(f"wrk exited {done.returncode}: {done.stderr.strip()}")
    return parse_wrk(done.stdout)


# --- processes ------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def child_env() -> dict[str, str]:
    """The children import switchyard from the same place we did, installed or not, and
    share one admin key (`admin_headers`)."""
    env = dict(os.environ)
    env.setdefault(ADMIN_ENV, BENCH_ADMIN_KEY)
    src = str(Path(switchyard.__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH")) if p)
    return env


def admin_headers() -> dict[str, str]:
    """Authorization with the bench gateways' admin key (see `child_env`): what /metrics
    and the admin API answer."""
    return {"Authorization": f"Bearer {os.environ.get(ADMIN_ENV) or BENCH_ADMIN_KEY}"}


def gateway_env() -> dict[str, str]:
    """The children's environment without SWITCHYARD_SQLITE_PATH: it would override each
    bench gateway's own sqlite_path (its bench key, the trace checks)."""
    env = child_env()
    env.pop("SWITCHYARD_SQLITE_PATH", None)
    return env


def spawn(name: str, argv: list[str], logdir: Path, env: dict[str, str] | None = None) -> Child:
    log = logdir / f"{name}.log"
    with log.open("wb") as fh:
        proc = subprocess.Popen(
            argv,
            stdout=fh,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=child_env() if env is None else env,
        )
    return Child(name, proc, log)


def serve_argv(config: Path, port: int, workers: int = 1) -> list[str]:
    """`switchyard serve` with this config on this port, from the same interpreter;
    with `workers` > 1, as that many worker processes (`--workers`)."""
    return [
        sys.executable,
        "-m",
        "switchyard",
        "serve",
        "--config",
        str(config),
        "--port",
        str(port),
        *(["--workers", str(workers)] if workers > 1 else []),
    ]


def stop_all(children: list[Child]) -> None:
    """Terminate every child, then kill what has not exited after a grace period."""
    for c in children:
        if c.proc.poll() is None:
            c.proc.terminate()
    deadline = time.monotonic() + 8
    for c in children:
        try:
            c.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            c.proc.kill()
            c.proc.wait()


def log_tail(child: Child, lines: int = 30) -> str:
    try:
        text = child.log.read_text(errors="replace")
    except OSError:
        return "(no log)"
    return "\n".join(text.splitlines()[-lines:]) or "(empty log)"


@contextlib.contextmanager
def sigterm_as_exit() -> Iterator[None]:
    """Turn SIGTERM into SystemExit, so `finally` blocks stop the children."""

    def handler(signum: int, frame: FrameType | None) -> None:
        raise SystemExit(128 + signum)

    try:
        previous = signal.signal(signal.SIGTERM, handler)
    except ValueError:  # not the main thread: leave signals alone
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


# --- HTTP and readiness ---------------------------------------------------------------


def http(
    method: str,
    url: str,
    body: bytes | None = None,
    timeout_s: float = 10,
    headers: Mapping[str, str] | None = None,
) -> tuple[int, bytes]:
    """One HTTP call on loopback, bypassing any proxy from the environment.

    Returns (status, body); status 0 means no HTTP answer (refused, reset, timed out).
    """
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    req = urllib.request.Request(url, data=body, method=method)
    if body is not None:
        req.add_header("Content-Type", "application/json")
    for name, value in (headers or {}).items():
        req.add_header(name, value)
    try:
        with opener.open(req, timeout=timeout_s) as resp:
            return int(resp.status), bytes(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()
    except (urllib.error.URLError, OSError):
        return 0, b""


def readyz(port: int, listeners: int = 1) -> bool:
    """True when the gateway on loopback `port` answers GET /readyz with 200 and, for
    `listeners` > 1 (`serve --workers N`), that many sockets listen on the port: each
    worker has its own, and the kernel spreads a client's connections only over those
    listening when it connects, so a late worker would sit out a measured run."""
    if listeners > 1 and listening(port) < listeners:
        return False
    return http("GET", f"http://127.0.0.1:{port}/readyz")[0] == 200


def listening(port: int) -> int:
    """How many TCP sockets listen on `port` on this machine."""
    return sum(
        1
        for c in psutil.net_connections(kind="tcp")
        if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port
    )


def wait_ready(child: Child, ready: Callable[[], bool], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if child.proc.poll() is not None:
            raise StartError(
                f"{child.name} exited with code {child.proc.returncode} while starting:\n"
                f"{log_tail(child)}"
            )
        if ready():
            return
        time.sleep(0.2)
    raise StartError(f"{child.name} was not ready after {timeout_s:.0f} s:\n{log_tail(child)}")


def wait_for(pred: Callable[[], bool], timeout_s: float = 10.0) -> bool:
    """Poll `pred` until it holds or `timeout_s` passes; its last answer."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.1)
    return bool(pred())


def count_rows(db: Path, table: str) -> int:
    """Rows in `table` of the SQLite file `db`, read-only; 0 when it cannot be read."""
    try:
        with contextlib.closing(sqlite3.connect(f"file:{db}?mode=ro", uri=True)) as conn:
            row = conn.execute(f"SELECT count(*) FROM {table}").fetchone()
            return int(row[0])
    except sqlite3.Error:
        return 0


def expect_rows(name: str, db: Path, table: str, what: str, at_least: int = 2) -> None:
    """Wait until the ledger's writer process has committed `at_least` rows to `table`
    (the smoke requests'); StartError naming the target and `what` is missing."""
    if not wait_for(lambda: count_rows(db, table) >= at_least):
        raise StartError(f"{name}: no {what} in {db} after the smoke requests")


def smoke(name: str, url: str, max_tokens: int, headers: Mapping[str, str] | None = None) -> None:
    """One plain and one streaming request must succeed before a target is measured."""
    status, body = http("POST", url, chat_body(False, max_tokens), headers=headers)
    if status != 200 or b'"choices"' not in body:
        raise StartError(f"{name}: POST {url} answered {status}: {body[:500]!r}")
    status, body = http("POST", url, chat_body(True, max_tokens), headers=headers)
    if status != 200 or b"data: [DONE]" not in body:
        raise StartError(f"{name}: streaming POST {url} answered {status}: {body[:500]!r}")


def check_auth_on(name: str, url: str, key: str, max_tokens: int) -> None:
    """Before measuring a keyed gateway: a request without a key must be refused (else
    auth is off and the target measures nothing new), and with the key it is served."""
    status, body = http("POST", url, chat_body(False, max_tokens))
    if status != 401:
        raise StartError(f"{name}: a request without a key answered {status}, not 401: {body!r}")
    smoke(name, url, max_tokens, headers={"Authorization": f"Bearer {key}"})


# --- configs, tenants and keys --------------------------------------------------------


def config_yaml(switchyard_port: int, upstream_port: int, db_path: Path) -> str:
    """The bench gateway's config: one openai-kind model on the scripted upstream, auth off."""
    return (
        f"server: {{host: 127.0.0.1, port: {switchyard_port}}}\n"
        "models:\n"
        f"  - alias: {MODEL}\n"
        "    revision: scripted-v1\n"
        f'    engine: {{kind: openai, base_url: "http://127.0.0.1:{upstream_port}/v1"}}\n'
        "embeddings: {enabled: false}\n"
        # Policy off: this measures the gateway core against the floor.
        "auth: {mode: disabled}\n"
        f'storage: {{sqlite_path: "{db_path}"}}\n'
    )


def auth_config(base_yaml: str, db_path: Path, redis_url: str | None = None) -> str:
    """`base_yaml` (a `config_yaml`) with auth on and its own storage.

    Derived from the auth-off YAML rather than written anew, so the model config is the
    same by construction and only auth and storage differ.
    """
    cfg: dict[str, Any] = yaml.safe_load(base_yaml)
    cfg["auth"] = dict(AUTH_ON)
    storage: dict[str, str] = {"sqlite_path": str(db_path)}
    if redis_url is not None:
        storage["redis_url"] = redis_url
    cfg["storage"] = storage
    return yaml.safe_dump(cfg, sort_keys=False)


def switchyard_cli(argv: list[str], timeout_s: float) -> dict[str, Any]:
    """Run `python -m switchyard ARGV` and return its JSON output.

    The benches go through the CLI, not `KeyStore`, so they exercise what an operator does.
    """
    cmd = [sys.executable, "-m", "switchyard", *argv]
    what = f"`switchyard {' '.join(argv[:2])}`"
    try:
        done = subprocess.run(
            cmd,
            capture_output=True,
            text=True,
            timeout=timeout_s,
            env=child_env(),
            stdin=subprocess.DEVNULL,
        )
    except subprocess.TimeoutExpired:
        raise StartError(f"{what} took over {timeout_s:.0f} s") from None
    if done.returncode != 0:
        raise StartError(f"{what} exited {done.returncode}: {done.stderr.strip()}")
    try:
        out: dict[str, Any] = json.loads(done.stdout)
    except json.JSONDecodeError:
        raise StartError(f"{what} printed no JSON: {done.stdout!r}") from None
    return out


def limit_args(limits: Mapping[str, LimitValue]) -> list[str]:
    """CLI options for limits: {"max_concurrency": 8} -> ["--max-concurrency", "8"]."""
    return [arg for name, v in limits.items() for arg in (f"--{name.replace('_', '-')}", str(v))]


def create_tenant_key(
    db_path: Path,
    tenant: str,
    tenant_limits: Mapping[str, LimitValue],
    timeout_s: float,
    key_limits: Mapping[str, LimitValue] | None = None,
) -> str:
    """Create `tenant` with `tenant_limits` and one key with `key_limits` (none: the
    tenant's apply) in `db_path`, through the CLI; return the key's plaintext."""
    db = ["--db", str(db_path)]
    switchyard_cli(["tenants", "create", tenant, *limit_args(tenant_limits), *db], timeout_s)
    made = switchyard_cli(
        ["keys", "create", "--tenant", tenant, *limit_args(key_limits or {}), *db], timeout_s
    )
    key = made.get("key")
    if not isinstance(key, str) or not key:
        raise StartError("`switchyard keys create` printed no key")
    return key


@dataclass(frozen=True, slots=True)
class KeyedTarget:
    """A started gateway with a key: its chat URL and the wrk scripts that carry it."""

    name: str
    url: str
    scripts: dict[bool, Path]


@dataclass(frozen=True, slots=True)
class KeyedGateway:
    """A gateway ready to start: its config and SQLite file, with a tenant and key in it."""

    name: str
    port: int
    db: Path
    config: Path
    key: str

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}{CHAT_PATH}"


def prepare_keyed_gateway(
    name: str,
    workdir: Path,
    upstream_port: int,
    tenant: str,
    tenant_limits: Mapping[str, LimitValue],
    timeout_s: float,
    key_limits: Mapping[str, LimitValue] | None = None,
    redis_url: str | None = None,
) -> KeyedGateway:
    """Create the tenant and key in a fresh SQLite file and write the gateway's config
    (`config_yaml` with auth on); start it with `start_gateway`."""
    db = workdir / f"{name}.db"
    key = create_tenant_key(db, tenant, tenant_limits, timeout_s, key_limits)
    port = free_port()
    cfg = workdir / f"{name}.yaml"
    cfg.write_text(auth_config(config_yaml(port, upstream_port, db), db, redis_url))
    return KeyedGateway(name, port, db, cfg, key)


def start_gateway(name: str, config: Path, port: int, workdir: Path, workers: int = 1) -> Child:
    """Spawn `switchyard serve` (with `workers` > 1, `--workers`) with its own SQLite path
    honoured (see `gateway_env`)."""
    return spawn(name, serve_argv(config, port, workers), workdir, env=gateway_env())


# --- machine --------------------------------------------------------------------------
