"""`switchyard bench balance`: choosing among several deployments of one alias.

Two measurements, each against a baseline taken in the same run:

- **selection cost**: `Balancer.choose` + `settled` in-process over 8 deployments, per
  strategy, with and without a task's affinity key, against the single-deployment
  selection (`select_deployment`) that every other alias uses;
- **prefix affinity**: two llama-server replicas behind two aliases, one with prefix
  affinity on and one off; streamed requests one at a time, cycling through 4 long
  system prompts fresh to each run: TTFT p50 on vs off (interleaved rounds);
- **skewed load**: one gateway (traces on) in front of 4 scripted upstreams, one of
  them 5x slower (`--delay-ms` vs 5 x that), with three aliases over the same four
  upstreams, one per strategy. Each alias takes `--requests` requests at
  `--concurrency` in interleaved rounds (the order rotates per round); reported: p50
  and p99 latency, and the share of requests the slow upstream got, with ratios to
  `weighted` (which ignores load and latency).

The result file records the machine, versions and the workload.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from switchyard.bench.harness import (
    Child,
    free_port,
    http,
    machine_info,
    spawn,
    start_gateway,
    stop_all,
    wait_ready,
)

STRATEGIES = ("weighted", "least_outstanding", "latency")


def _remote(i: int, url: str) -> dict[str, Any]:
    return {"name": f"d{i}", "engine": {"kind": "openai", "base_url": url}}


def selection_cost(n: int, deployments: int = 8) -> dict[str, Any]:
    """Per-request selection time in microseconds (p50, p99)."""
    from switchyard.config import Settings
    from switchyard.decide.balance import Balancer
    from switchyard.decide.select import select_deployment
    from switchyard.engines.registry import Registry
    from switchyard.state.breakers_memory import CircuitBreaker

    out: dict[str, Any] = {}

    def timed(fn: Any) -> dict[str, float]:
        samples = []
        for _ in range(n):
            t = time.perf_counter_ns()
            fn()
            samples.append((time.perf_counter_ns() - t) / 1000.0)
        samples.sort()
        return {"p50_us": samples[len(samples) // 2], "p99_us": samples[int(len(samples) * 0.99)]}

    single = Registry(
        Settings.model_validate(
            {"models": [{"alias": "one", "engine": {"kind": "openai", "base_url": "http://x"}}]}
        )
    )
    out["single_deployment"] = timed(lambda: select_deployment("one", single.deployments))
    for strategy in STRATEGIES:
        s = Settings.model_validate(
            {
                "models": [
                    {
                        "alias": "chat",
                        "deployments": [
                            _remote(i, f"http://d{i}.invalid") for i in range(deployments)
                        ],
                        "balance": {"strategy": strategy},
                    }
                ]
            }
        )
        deps = Registry(s).replicas["chat"]
        breakers = {d.name: CircuitBreaker(d.name, d.model.resilience.breaker) for d in deps}
        rng = random.Random(1)
        b = Balancer("chat", deps, s.models[0].balance, breakers, rng)
        for d in deps:  # measured once, so `latency` ranks instead of probing
            b.settled(d, 0.05 + rng.random() / 100, 0.01)

        def plain(b: Balancer = b) -> None:
            d, _, _ = b.choose(tokens=64)
            b.settled(d, 0.05, 0.01)

        keys = itertools.cycle([("task", f"task-{i}") for i in range(1000)])

        def sticky(b: Balancer = b, keys: Any = keys) -> None:
            d, _, _ = b.choose(tenant="t", affinity=next(keys), tokens=64)
            b.settled(d, 0.05, 0.01)

        out[strategy] = timed(plain)
        out[f"{strategy}+affinity"] = timed(sticky)
    base = out["single_deployment"]["p50_us"]
    out["ratio_p50_vs_single"] = {
        k: v["p50_us"] / base for k, v in out.items() if isinstance(v, dict) and "p50_us" in v
    }
    return out


async def _load(url: str, alias: str, n: int, concurrency: int) -> tuple[list[float], list[str]]:
    lat: list[float] = []
    ups: list[str] = []
    body = {"model": alias, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
    it = iter(range(n))

    async def worker(session: aiohttp.ClientSession) -> None:
        for _ in it:
            t = time.perf_counter()
            async with session.post(url, json=body) as r:
                await r.read()
                if r.status != 200:
                    raise RuntimeError(f"{alias}: HTTP {r.status}")
                ups.append(r.headers["x-switchyard-upstream"])
            lat.append((time.perf_counter() - t) * 1000.0)

    async with aiohttp.ClientSession() as session:
        await asyncio.gather(*(worker(session) for _ in range(concurrency)))
    return lat, ups


def _answers(url: str) -> Callable[[], bool]:
    return lambda: http("GET", url)[0] == 200


def _pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(len(s) * q))]


def run(args: argparse.Namespace) -> int:
    print(f"selection cost: {args.iterations} choices per strategy ...", flush=True)
    cost = selection_cost(args.iterations)
    work = Path(tempfile.mkdtemp(prefix="switchyard-bench-balance-"))
    children: list[Child] = []
    try:
        urls = []
        for i in range(4):
            port = free_port()
            up = spawn(
                f"upstream{i}",
                [sys.executable, "-m", "switchyard.bench.scripted_upstream", "--port", str(port)],
                work,
            )
            children.append(up)
            base = f"http://127.0.0.1:{port}"
            wait_ready(up, _answers(base + "/health"), 60)
            delay = args.delay_ms * (5 if i == 0 else 1)
            fault = json.dumps({"fault": f"delay:{delay:g}", "count": None}).encode()
            if http("PUT", base + "/control/fault", fault)[0] != 200:
                raise RuntimeError(f"upstream {i} refused its delay fault")
            urls.append(base + "/v1")
        engines = _start_llama_servers(work, children) if args.prefix_rounds else []
        port = free_port()
        cfg: dict[str, Any] = {
            "server": {"port": port},
            "storage": {"sqlite_path": str(work / "sy.db")},
            "auth": {"mode": "disabled"},
            "embeddings": {"enabled": False},
            "models": [
                {
                    "alias": f"via-{s}",
                    "deployments": [_remote(i, u) for i, u in enumerate(urls)],
                    "balance": {"strategy": s, "affinity": False},
                    "limits": {"max_concurrency": 256, "queue": 256},
                }
                for s in STRATEGIES
            ],
        }
        for on in (True, False):  # two aliases over the same two llama-servers
            cfg["models"].append(
                {
                    "alias": f"prefix-{'on' if on else 'off'}",
                    "deployments": [
                        {
                            "name": f"r{i}",
                            "engine": {"kind": "openai", "base_url": u, "model": "smol"},
                        }
                        for i, u in enumerate(engines)
                    ],
                    "balance": {"strategy": "least_outstanding", "prefix_affinity": on},
                }
            )
        if not engines:
            cfg["models"] = cfg["models"][: len(STRATEGIES)]
        path = work / "config.yaml"
        path.write_text(yaml.safe_dump(cfg))
        gw = start_gateway("gateway", path, port, work)
        children.append(gw)
        gw_base = f"http://127.0.0.1:{port}"
        wait_ready(gw, lambda: http("GET", gw_base + "/readyz")[0] == 200, 120)
        url = gw_base + "/v1/chat/completions"
        lat: dict[str, list[float]] = {s: [] for s in STRATEGIES}
        to_slow: dict[str, list[int]] = {s: [0, 0] for s in STRATEGIES}
        for s in STRATEGIES:  # warm-up: every deployment measured once
            asyncio.run(_load(url, f"via-{s}", 16, 4))
        order = list(STRATEGIES)
        for rnd in range(args.rounds):
            for s in order[rnd % 3 :] + order[: rnd % 3]:
                ls, ups = asyncio.run(_load(url, f"via-{s}", args.requests, args.concurrency))
                lat[s] += ls
                # x-switchyard-upstream names the deployment: d0 is the slow upstream.
                to_slow[s][0] += sum(1 for u in ups if u == f"via-{s}/d0")
                to_slow[s][1] += len(ups)
            print(f"  round {rnd + 1}/{args.rounds} done", flush=True)
        ttft: dict[str, list[float]] = {"on": [], "off": []}
        for rnd in range(args.prefix_rounds if engines else 0):
            for side in ("on", "off") if rnd % 2 == 0 else ("off", "on"):
                ttft[side] += asyncio.run(_prefix_ttft(url, f"prefix-{side}", f"{side}{rnd}"))
            print(f"  prefix round {rnd + 1}/{args.prefix_rounds} done", flush=True)
    finally:
        stop_all(children)
    skew = {
        s: {
            "p50_ms": statistics.median(lat[s]),
            "p95_ms": _pct(lat[s], 0.95),
            "p99_ms": _pct(lat[s], 0.99),
            "mean_ms": statistics.fmean(lat[s]),
            "slow_share": to_slow[s][0] / max(1, to_slow[s][1]),
        }
        for s in STRATEGIES
    }
    w = skew["weighted"]
    for s in STRATEGIES:
        for q in ("p50", "p95", "p99", "mean"):
            skew[s][f"{q}_vs_weighted"] = skew[s][f"{q}_ms"] / w[f"{q}_ms"]
    prefix: dict[str, Any] = {}
    if ttft["on"]:
        # A request that found its prefix cached is an order of magnitude faster than
        # one that prefilled it: "slow" = over 4x the fastest TTFT seen.
        fastest = min(ttft["on"] + ttft["off"])
        prefix = {
            side: {
                "p50_ms": statistics.median(v),
                "p90_ms": _pct(v, 0.9),
                "mean_ms": statistics.fmean(v),
                "prefilled_share": sum(1 for x in v if x > 4 * fastest) / len(v),
                "samples": v,
            }
            for side, v in ttft.items()
        }
        prefix["mean_on_vs_off"] = prefix["on"]["mean_ms"] / prefix["off"]["mean_ms"]
    out = {
        "benchmark": "balance",
        "workload": {
            "selection_iterations": args.iterations,
            "selection_deployments": 8,
            "upstreams": 4,
            "delay_ms": args.delay_ms,
            "slow_delay_ms": args.delay_ms * 5,
            "requests_per_round": args.requests,
            "concurrency": args.concurrency,
            "rounds": args.rounds,
            "gateway": "auth disabled, traces on, affinity off, 8 generated tokens",
            "prefix": {
                "rounds": args.prefix_rounds,
                "replicas": "2 llama-servers, SmolLM2-135M Q4_1, 2 slots, 1 thread each",
                "prefixes": PREFIXES,
                "requests_per_side_per_round": PREFIX_REQUESTS,
                "prefix_chars": len(_prefix_text("x", 0)),
                "streamed": True,
                "max_tokens": 2,
            },
        },
        "machine": machine_info("wrk"),
        "selection_us": cost,
        "skewed_load": skew,
        "prefix_affinity_ttft": prefix,
    }
    stamp = time.strftime("%Y%m%d-%H%M%S")
    dest = Path(args.out or f"bench-results/balance-{stamp}.json")
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_text(json.dumps(out, indent=2))
    print("\nselection cost per request (us): p50 / p99, p50 vs one deployment")
    for k, v in cost.items():
        if isinstance(v, dict) and "p50_us" in v:
            ratio = cost["ratio_p50_vs_single"][k]
            print(f"  {k:<28} {v['p50_us']:>7.1f} / {v['p99_us']:>7.1f}   {ratio:>5.1f}x")
    print(f"\nskewed load: 4 upstreams, one {args.delay_ms * 5:g} ms, three {args.delay_ms:g} ms")
    print(
        f"  {'strategy':<18} {'p50':>7} {'p95':>7} {'p99':>7} {'mean':>7} ms  "
        f"{'p95 / mean vs weighted':>22} {'to slow':>8}"
    )
    for s, v in skew.items():
        print(
            f"  {s:<18} {v['p50_ms']:>7.1f} {v['p95_ms']:>7.1f} {v['p99_ms']:>7.1f} "
            f"{v['mean_ms']:>7.1f}     {v['p95_vs_weighted']:>10.2f} / {v['mean_vs_weighted']:<9.2f} "
            f"{v['slow_share']:>8.1%}"
        )
    if prefix:
        on, off = prefix["on"], prefix["off"]
        print(f"\nTTFT on two llama-server replicas, {PREFIXES} long prefixes in turn:")
        for side, v in (("on", on), ("off", off)):
            print(
                f"  prefix affinity {side:<3}: mean {v['mean_ms']:.0f} ms, p50 "
                f"{v['p50_ms']:.0f}, p90 {v['p90_ms']:.0f}; prefilled "
                f"{v['prefilled_share']:.0%} of requests"
            )
        print(f"  mean on / off: {prefix['mean_on_vs_off']:.2f}x")
    print(f"\nwritten to {dest}")
    return 0


PREFIXES = 4
PREFIX_REQUESTS = 16


def _prefix_text(tag: str, i: int) -> str:
    """A long system prompt (about 600 tokens) unique to `tag` and `i`."""
    return f"[{tag}-{i}] You are the support assistant of a logistics platform. " + (
        "Answer in one sentence, cite the order number, never guess a date. " * 40
    )


def _start_llama_servers(work: Path, children: list[Child]) -> list[str]:
    from switchyard.config import LlamaCppEngine
    from switchyard.engines.assets import smollm2_gguf_path
    from switchyard.engines.llamacpp import llama_server_binary

    binary = llama_server_binary(LlamaCppEngine(kind="llamacpp"))
    urls = []
    for i in range(2):
        port = free_port()
        argv = [binary, "--model", smollm2_gguf_path(), "--port", str(port), "--host"]
        argv += ["127.0.0.1", "--alias", "smol", "--parallel", "2", "--ctx-size", "4096"]
        argv += ["--threads", "1", "--threads-batch", "1", "--no-webui", "--no-repack"]
        child = spawn(f"llama{i}", argv, work)
        children.append(child)
        wait_ready(child, _answers(f"http://127.0.0.1:{port}/health"), 120)
        urls.append(f"http://127.0.0.1:{port}/v1")
    return urls


async def _prefix_ttft(url: str, alias: str, tag: str) -> list[float]:
    """TTFT of PREFIX_REQUESTS streamed requests, one at a time, cycling through
    PREFIXES prefixes fresh to this call (no engine has them cached yet)."""
    out = []
    async with aiohttp.ClientSession() as session:
        for i in range(PREFIX_REQUESTS):
            body = {
                "model": alias,
                "messages": [
                    {"role": "system", "content": _prefix_text(tag, i % PREFIXES)},
                    {"role": "user", "content": f"Question {i}: where is order {1000 + i}?"},
                ],
                "max_tokens": 2,
                "stream": True,
            }
            t = time.perf_counter()
            first = None
            async with session.post(url, json=body) as r:
                if r.status != 200:
                    raise RuntimeError(f"{alias}: HTTP {r.status}")
                async for line in r.content:
                    if first is None and line.startswith(b"data: {"):
                        first = time.perf_counter()
            out.append(((first or time.perf_counter()) - t) * 1000.0)
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--iterations", type=int, default=20000, help="selection-cost samples")
    p.add_argument("--delay-ms", type=float, default=20.0, help="the fast upstreams' delay")
    p.add_argument("--requests", type=int, default=200, help="per strategy per round")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument(
        "--prefix-rounds", type=int, default=3, help="TTFT rounds with prefix affinity (0 = skip)"
    )
    p.add_argument("--out", default=None)
    p.set_defaults(func=run)
