"""`switchyard bench ray`: what running on Ray Serve costs a request.

A local Ray (`ray start --head` on loopback) runs `switchyard serve --ray`, and, in the
same run, `switchyard serve` on one machine with the same config: the local model and
`instant`, a scripted upstream that answers at once (what the gateway itself costs).
Two phases, autoscaling pinned so the numbers hold still; targets interleaved round by
round within each:

1. 2 gateway replicas, 1 engine replica:
   - local model: `gateway-one-machine` (the baseline: `switchyard serve` -> its own
     llama-server), `engine-via-serve` (Serve's proxy -> the engine deployment ->
     llama-server, no gateway) and `gateway-on-ray` (Serve's proxy -> a gateway
     replica -> Serve's proxy -> the engine deployment -> llama-server);
   - instant upstream: `instant-one-machine` (the baseline), `instant-direct` (no
     gateway) and `instant-on-ray-2` (Serve's proxy -> 2 gateway replicas -> upstream);
   - aggregate completion tokens/s through Serve to the engine deployment.
2. 1 gateway replica, 2 engine replicas: the instant targets again with
   `instant-on-ray-1`, and the engine tokens/s with 2 replicas.

Both gateways have a key with limits (rpm, tpm) and traces on. Reported per target:
p50 and p99 latency of sequential requests (`--max-tokens` each) and requests/s at
`--concurrency`, with ratios to the phase's one-machine baseline. The result file
records the machine, versions and the workload.
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
INSTANT = "instant"  # the scripted upstream: what the gateway itself costs
ADMIN = "bench-admin-" + os.urandom(6).hex()
ADMIN_ENV = "SWITCHYARD_ADMIN_KEY"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--requests", type=int, default=30, help="sequential requests per target")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--seconds", type=float, default=8.0, help="per target, concurrent phase")
    p.add_argument("--max-tokens", type=int, default=4)
    p.add_argument("--tok-max-tokens", type=int, default=32, help="per request, the tokens/s phase")
    p.add_argument("--out", default=None)
    p.set_defaults(func=run)


def _model() -> dict[str, Any]:
    return {
        "alias": ALIAS,
        "engine": {"kind": "llamacpp", "threads": 1, "ctx": 1024, "parallel": 4},
    }


def _config(db: Path, instant_url: str) -> dict[str, Any]:
    """The Switchyard config both gateways share (the Ray one adds its `ray:`): the
    local model, and `instant`, the scripted upstream that answers at once."""
    return {
        "models": [
            _model(),
            {"alias": INSTANT, "engine": {"kind": "openai", "base_url": instant_url}},
        ],
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


def _call(url: str, key: str | None, max_tokens: int, model: str = ALIAS) -> float:
    return _request(url, key, max_tokens, model)[0]


def _request(url: str, key: str | None, max_tokens: int, model: str) -> tuple[float, int]:
    """(milliseconds, completion tokens) of one request."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": "Name a colour."}],
        "max_tokens": max_tokens,
        "temperature": 0,
    }
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    t0 = time.perf_counter()
    status, raw = http("POST", url, json.dumps(body).encode(), 120, headers)
    if status != 200:
        raise RuntimeError(f"{url} answered {status}")
    tokens = int((json.loads(raw).get("usage") or {}).get("completion_tokens") or 0)
    return (time.perf_counter() - t0) * 1000, tokens


def _throughput(
    url: str, key: str | None, args: argparse.Namespace, model: str = ALIAS, max_tokens: int = 0
) -> tuple[float, float]:
    """(requests/s, completion tokens/s) at args.concurrency for args.seconds."""
    stop = time.monotonic() + args.seconds

    def worker() -> tuple[int, int]:
        n = tokens = 0
        while time.monotonic() < stop:
            tokens += _request(url, key, max_tokens or args.max_tokens, model)[1]
            n += 1
        return n, tokens

    t0 = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(args.concurrency) as pool:
        done = list(pool.map(lambda _: worker(), range(args.concurrency)))
    took = time.monotonic() - t0
    return sum(n for n, _ in done) / took, sum(t for _, t in done) / took


def _listening(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return round(xs[min(len(xs) - 1, int(q * len(xs)))], 2)


Target = tuple[str, str | None, str]  # url, key, model


def _measure(
    targets: dict[str, Target], args: argparse.Namespace
) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Latency of sequential requests and req/s at concurrency, per target, in
    interleaved rounds (the order rotates each round)."""
    for url, key, model in targets.values():  # warm every path once
        for _ in range(3):
            _call(url, key, args.max_tokens, model)
    lat: dict[str, list[float]] = {t: [] for t in targets}
    rps: dict[str, list[float]] = {t: [] for t in targets}
    names = list(targets)
    for r in range(args.rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            url, key, model = targets[name]
            lat[name] += [_call(url, key, args.max_tokens, model) for _ in range(args.requests)]
            rps[name].append(_throughput(url, key, args, model)[0])
    return lat, rps


def _rows(
    lat: dict[str, list[float]], rps: dict[str, list[float]], base: str
) -> list[dict[str, Any]]:
    b50, brps = statistics.median(lat[base]), statistics.median(rps[base])
    rows = []
    for name in lat:
        p50, r = statistics.median(lat[name]), statistics.median(rps[name])
        rows.append(
            {
                "target": name,
                "p50_ms": round(p50, 2),
                "p99_ms": _pct(lat[name], 0.99),
                "requests_per_s": round(r, 2),
                "p50_vs_baseline": round(p50 / b50, 3),
                "rps_vs_baseline": round(r / brps, 3),
                "baseline": base,
            }
        )
    return rows


def _print(title: str, rows: list[dict[str, Any]]) -> None:
    print(f"\n{title} (ratios against {rows[0]['baseline']})")
    print(f"{'target':<22}{'p50 ms':>9}{'p99 ms':>9}{'req/s':>9}{'p50 x':>8}{'rps x':>8}")
    for row in rows:
        print(
            f"{row['target']:<22}{row['p50_ms']:>9}{row['p99_ms']:>9}"
            f"{row['requests_per_s']:>9}{row['p50_vs_baseline']:>8}{row['rps_vs_baseline']:>8}"
        )


def _tokens_per_s(url: str, token: str, args: argparse.Namespace) -> float:
    """Aggregate completion tokens/s through Serve's proxy to the engine deployment, at
    args.concurrency, median of args.rounds."""
    _call(url, token, args.tok_max_tokens)
    runs = [
        _throughput(url, token, args, ALIAS, args.tok_max_tokens)[1] for _ in range(args.rounds)
    ]
    return round(statistics.median(runs), 1)


def run(args: argparse.Namespace) -> int:
    ray_bin = str(Path(sys.executable).with_name("ray"))
    if not Path(ray_bin).exists():
        print("switchyard: bench ray needs Ray Serve: pip install 'ray[serve]'", file=sys.stderr)
        return 2
    work = Path(tempfile.mkdtemp(prefix="sy-bray-", dir="/tmp"))
    gcs, proxy, local, instant = free_port(), free_port(), free_port(), free_port()
    env = {
        **{k: v for k, v in os.environ.items() if k != "SWITCHYARD_SQLITE_PATH"},
        "RAY_USAGE_STATS_ENABLED": "0",
        "SWITCHYARD_ADMIN_KEY": ADMIN,
        "HF_HUB_OFFLINE": "1",
        "RAY_ADDRESS": f"127.0.0.1:{gcs}",
    }
    instant_url = f"http://127.0.0.1:{instant}/v1"
    one_cfg = work / "one.yaml"
    one_cfg.write_text(yaml.safe_dump(_config(work / "one.db", instant_url)))

    def ray_config(gateways: int, engines: int) -> Path:
        path = work / f"ray-{gateways}-{engines}.yaml"
        section = {
            "gateway_replicas": gateways,
            "gateway_num_cpus": 0.5,
            "host": "127.0.0.1",
            "port": proxy,
            "engines": {"min_replicas": engines, "max_replicas": engines, "num_cpus": 0.5},
        }
        path.write_text(yaml.safe_dump({**_config(work / "ray.db", instant_url), "ray": section}))
        return path

    children: list[Child] = []
    # In the foreground, as our child: stopping it stops this cluster only.
    start = [ray_bin, "start", "--head", "--block", "--port", str(gcs), "--num-cpus", "4"]
    start += ["--include-dashboard", "false", "--disable-usage-stats", "--temp-dir", str(work)]
    argv = [sys.executable, "-m", "switchyard", "serve"]
    ray_base, one_base = f"http://127.0.0.1:{proxy}", f"http://127.0.0.1:{local}"

    def on_ray(cfg: Path, name: str) -> Child:
        child = spawn(name, [*argv, "--ray", "--config", str(cfg)], work, env)
        children.append(child)
        wait_ready(
            child, lambda: "ready on Ray Serve" in child.log.read_text(errors="replace"), 300
        )
        return child

    try:
        head = spawn("ray-head", start, work, env)
        children.append(head)
        wait_ready(head, lambda: _listening(gcs), 120)
        scripted = [sys.executable, "-m", "switchyard.bench.scripted_upstream"]
        upstream = spawn("instant", [*scripted, "--port", str(instant)], work, env)
        one = spawn(
            "one-machine", [*argv, "--config", str(one_cfg), "--port", str(local)], work, env
        )
        children += [upstream, one]
        wait_ready(upstream, lambda: _listening(instant), 60)
        wait_ready(one, lambda: http("GET", one_base + "/readyz")[0] == 200, 300)
        os.environ[ADMIN_ENV] = ADMIN  # the gateway's credential at the engine, as it has it
        cfg2 = ray_config(2, 1)
        token = engine_token(load_settings(cfg2))
        engine_url = f"{ray_base}/engines/{ALIAS}/v1/chat/completions"
        one_key = _key(one_base)
        instant_direct: Target = (instant_url + "/chat/completions", None, INSTANT)
        instant_one: Target = (one_base + "/v1/chat/completions", one_key, INSTANT)

        # Phase 1: 2 gateway replicas, 1 engine replica.
        first = on_ray(cfg2, "ray-serve-2")
        ray_key = _key(ray_base)
        lat, rps = _measure(
            {
                "gateway-one-machine": (one_base + "/v1/chat/completions", one_key, ALIAS),
                "engine-via-serve": (engine_url, token, ALIAS),
                "gateway-on-ray": (ray_base + "/v1/chat/completions", ray_key, ALIAS),
            },
            args,
        )
        local_rows = _rows(lat, rps, "gateway-one-machine")

        def instant_rows_with(gateways: int, key: str) -> list[dict[str, Any]]:
            lat, rps = _measure(
                {
                    "instant-one-machine": instant_one,
                    "instant-direct": instant_direct,
                    f"instant-on-ray-{gateways}": (ray_base + "/v1/chat/completions", key, INSTANT),
                },
                args,
            )
            return _rows(lat, rps, "instant-one-machine")

        instant_rows = instant_rows_with(2, ray_key)
        tokens = {"engine_replicas_1": _tokens_per_s(engine_url, token, args)}
        stop_all([first])
        children.remove(first)

        # Phase 2: 1 gateway replica, 2 engine replicas.
        on_ray(ray_config(1, 2), "ray-serve-1")
        instant_rows_1 = instant_rows_with(1, _key(ray_base))
        tokens["engine_replicas_2"] = _tokens_per_s(engine_url, token, args)
        tokens["ratio_2_vs_1"] = round(tokens["engine_replicas_2"] / tokens["engine_replicas_1"], 3)

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
                "tokens_max_tokens": args.tok_max_tokens,
                "phases": [
                    {"gateway_replicas": 2, "engine_replicas": 1},
                    {"gateway_replicas": 1, "engine_replicas": 2},
                ],
                "engine_num_cpus": 0.5,
                "keys": "rpm and tpm limits; traces on",
            },
            "local_model": local_rows,
            "instant_2_gateway_replicas": instant_rows,
            "instant_1_gateway_replica": instant_rows_1,
            "engine_tokens_per_s": tokens,
        }
        _print("local model, 2 gateway replicas, 1 engine replica", local_rows)
        _print("instant upstream, 2 gateway replicas", instant_rows)
        _print("instant upstream, 1 gateway replica", instant_rows_1)
        print(
            f"\nengine tokens/s via Serve at c={args.concurrency}: 1 replica "
            f"{tokens['engine_replicas_1']}, 2 replicas {tokens['engine_replicas_2']} "
            f"({tokens['ratio_2_vs_1']}x)"
        )
        out = Path(args.out or f"bench-results/ray-{int(time.time())}.json")
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2))
        print(f"\nwritten: {out}")
        return 0
    finally:
        stop_all(children[::-1])  # the gateways first, the Ray head last
        shutil.rmtree(work, ignore_errors=True)
