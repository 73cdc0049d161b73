"""`switchyard bench ray`: what running on Ray Serve costs a request.

A local Ray (`ray start --head` on loopback) runs `switchyard serve --ray` with the
local model (2 gateway replicas, one engine replica: autoscaling pinned so the numbers
hold still), and, in the same run, `switchyard serve` on one machine with the same
model. Three targets, interleaved round by round:

- `engine-via-serve`: Serve's proxy -> the engine deployment -> llama-server (no gateway);
- `gateway-on-ray`: Serve's proxy -> a gateway replica -> Serve's proxy -> the engine
  deployment -> llama-server (the `--ray` path);
- `gateway-one-machine`: `switchyard serve` -> its own llama-server (the baseline).

Both gateways have a key with limits (rpm, tpm) and traces on. Reported per target:
p50 and p99 latency of sequential requests (`--max-tokens` each) and requests/s at
`--concurrency`, with ratios to the one-machine gateway. The result file records the
machine, versions and the workload.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import shutil
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

from switchyard.bench.harness import (
    Child,
    free_port,
    http,
    machine_info,
    spawn,
    stop_all,
    wait_ready,
)
from switchyard.config import load_settings
from switchyard.scale.serve_config import engine_token

ALIAS = "smollm2-135m"
ADMIN = "bench-admin-" + os.urandom(6).hex()
ADMIN_ENV = "SWITCHYARD_ADMIN_KEY"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--requests", type=int, default=30, help="sequential requests per target")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--seconds", type=float, default=8.0, help="per target, concurrent phase")
    p.add_argument("--max-tokens", type=int, default=4)
    p.add_argument("--out", default=None)
    p.set_defaults(func=run)


def _model() -> dict[str, Any]:
    return {
        "alias": ALIAS,
        "engine": {"kind": "llamacpp", "threads": 1, "ctx": 1024, "parallel": 4},
    }


def _config(db: Path) -> dict[str, Any]:
    """The Switchyard config both gateways share (the Ray one adds its `ray:`)."""
    return {
        "models": [_model()],
        "embeddings": {"enabled": False},
        "auth": {"bootstrap_dev_key": False},
        "storage": {"sqlite_path": str(db)},
    }


def _key(base: str) -> str:
    admin = {"Authorization": f"Bearer {ADMIN}"}
    tenant = {"id": "bench", "rpm": 1_000_000, "tpm": 1_000_000_000}
    status, _ = http("POST", base + "/admin/tenants", json.dumps(tenant).encode(), 30, admin)
    if status not in (201, 409):
        raise RuntimeError(f"creating the bench tenant at {base} answered {status}")
    status, body = http(
        "POST", base + "/admin/keys", json.dumps({"tenant_id": "bench"}).encode(), 30, admin
    )
    if status != 201:
        raise RuntimeError(f"creating the bench key at {base} answered {status}")
    return str(json.loads(body)["key"])


def _call(url: str, key: str | None, max_tokens: int) -> float:
    body = {
        "model": ALIAS,
        "messages": [{"role": "user", "content": "Name a colour."}],
        "max_tokens": max_tokens,
        "temperature": 0,
    }
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    t0 = time.perf_counter()
    status, _ = http("POST", url, json.dumps(body).encode(), 120, headers)
    if status != 200:
        raise RuntimeError(f"{url} answered {status}")
    return (time.perf_counter() - t0) * 1000


def _throughput(url: str, key: str | None, args: argparse.Namespace) -> float:
    stop = time.monotonic() + args.seconds

    def worker() -> int:
        n = 0
        while time.monotonic() < stop:
            _call(url, key, args.max_tokens)
            n += 1
        return n

    t0 = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(args.concurrency) as pool:
        done = sum(pool.map(lambda _: worker(), range(args.concurrency)))
    return done / (time.monotonic() - t0)


def _listening(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return round(xs[min(len(xs) - 1, int(q * len(xs)))], 2)


def run(args: argparse.Namespace) -> int:
    ray_bin = str(Path(sys.executable).with_name("ray"))
    if not Path(ray_bin).exists():
        print("switchyard: bench ray needs Ray Serve: pip install 'ray[serve]'", file=sys.stderr)
        return 2
    work = Path(tempfile.mkdtemp(prefix="sy-bray-", dir="/tmp"))
    gcs, proxy, local = free_port(), free_port(), free_port()
    env = {
        **{k: v for k, v in os.environ.items() if k != "SWITCHYARD_SQLITE_PATH"},
        "RAY_USAGE_STATS_ENABLED": "0",
        "SWITCHYARD_ADMIN_KEY": ADMIN,
        "HF_HUB_OFFLINE": "1",
        "RAY_ADDRESS": f"127.0.0.1:{gcs}",
    }
    ray_cfg, one_cfg = work / "ray.yaml", work / "one.yaml"
    ray_section = {
        "gateway_replicas": 2,
        "gateway_num_cpus": 0.5,
        "host": "127.0.0.1",
        "port": proxy,
        "engines": {"min_replicas": 1, "max_replicas": 1, "num_cpus": 1},
    }
    ray_cfg.write_text(yaml.safe_dump({**_config(work / "ray.db"), "ray": ray_section}))
    one_cfg.write_text(yaml.safe_dump(_config(work / "one.db")))
    children: list[Child] = []
    # In the foreground, as our child: stopping it stops this cluster only.
    start = [ray_bin, "start", "--head", "--block", "--port", str(gcs), "--num-cpus", "4"]
    start += ["--include-dashboard", "false", "--disable-usage-stats", "--temp-dir", str(work)]
    try:
        head = spawn("ray-head", start, work, env)
        children.append(head)
        wait_ready(head, lambda: _listening(gcs), 120)
        argv = [sys.executable, "-m", "switchyard", "serve"]
        on_ray = spawn("ray-serve", [*argv, "--ray", "--config", str(ray_cfg)], work, env)
        one = spawn(
            "one-machine", [*argv, "--config", str(one_cfg), "--port", str(local)], work, env
        )
        children += [on_ray, one]
        ray_base, one_base = f"http://127.0.0.1:{proxy}", f"http://127.0.0.1:{local}"
        wait_ready(one, lambda: http("GET", one_base + "/readyz")[0] == 200, 300)
        wait_ready(
            on_ray, lambda: "ready on Ray Serve" in on_ray.log.read_text(errors="replace"), 300
        )
        os.environ[ADMIN_ENV] = ADMIN  # the gateway's credential at the engine, as it has it
        token = engine_token(load_settings(ray_cfg))
        targets = {
            "engine-via-serve": (f"{ray_base}/engines/{ALIAS}/v1/chat/completions", token),
            "gateway-on-ray": (ray_base + "/v1/chat/completions", _key(ray_base)),
            "gateway-one-machine": (one_base + "/v1/chat/completions", _key(one_base)),
        }
        for url, key in targets.values():  # warm every path once
            for _ in range(3):
                _call(url, key, args.max_tokens)
        lat: dict[str, list[float]] = {t: [] for t in targets}
        rps: dict[str, list[float]] = {t: [] for t in targets}
        names = list(targets)
        for r in range(args.rounds):
            order = names[r % len(names) :] + names[: r % len(names)]
            for name in order:
                url, key = targets[name]
                lat[name] += [_call(url, key, args.max_tokens) for _ in range(args.requests)]
                rps[name].append(_throughput(url, key, args))
        base = "gateway-one-machine"
        b50, brps = statistics.median(lat[base]), statistics.median(rps[base])
        rows = []
        for name in names:
            p50 = statistics.median(lat[name])
            rows.append(
                {
                    "target": name,
                    "p50_ms": round(p50, 2),
                    "p99_ms": _pct(lat[name], 0.99),
                    "requests_per_s": round(statistics.median(rps[name]), 2),
                    "p50_vs_one_machine": round(p50 / b50, 3),
                    "rps_vs_one_machine": round(statistics.median(rps[name]) / brps, 3),
                }
            )
        result = {
            "bench": "ray",
            "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "machine": machine_info("wrk"),
            "workload": {
                "model": ALIAS,
                "max_tokens": args.max_tokens,
                "sequential_requests_per_round": args.requests,
                "rounds": args.rounds,
                "concurrency": args.concurrency,
                "concurrent_seconds": args.seconds,
                "gateway_replicas_on_ray": 2,
                "engine_replicas": 1,
                "keys": "rpm and tpm limits; traces on",
            },
            "results": rows,
        }
        print(f"{'target':<22}{'p50 ms':>9}{'p99 ms':>9}{'req/s':>8}{'p50 x':>8}{'rps x':>8}")
        for row in rows:
            print(
                f"{row['target']:<22}{row['p50_ms']:>9}{row['p99_ms']:>9}"
                f"{row['requests_per_s']:>8}{row['p50_vs_one_machine']:>8}"
                f"{row['rps_vs_one_machine']:>8}"
            )
        out = Path(args.out or f"bench-results/ray-{int(time.time())}.json")
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2))
        print(f"\nwritten: {out}")
        return 0
    finally:
        stop_all(children[::-1])  # the gateways first, the Ray head last
        shutil.rmtree(work, ignore_errors=True)
