"""`switchyard bench engines`: the engine pool measured through the gateway and directly.

One gateway (traces on, the default trace policy) serves SmolLM2-135M from one
llama-server with `--slots` slots, the project's two LoRA adapters on it
(switchyard.engines.lora_train, cached), and a second, lazy alias of the same file
whose idle TTL unloads it between cold samples. In interleaved rounds it measures:

- aggregate output tokens/s at each concurrency, through the gateway and directly
  against the engine's own port (the ratio is the gateway's cost; the c=4 / c=1 ratio
  is what continuous batching buys on this machine);
- time to first token of the lazy model cold (its load included) and warm;
- aggregate tokens/s at concurrency 4 with 0, 1 and 2 adapters in a mixed stream,
  against the base alone (llama.cpp does not batch requests for different adapters
  together: that is the cost shown);
- the cost of an adapter swap: a third alias with `max_adapters: 1` and two adapters,
  asked for each in turn (a cold adapter: llama-server drains and restarts with it,
  vLLM loads it at run time), against asking again with it loaded.

Every request generates `--tokens` tokens (end-of-sequence banned). The result file
records the machine, versions, the llama-server build and the workload.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import secrets
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from switchyard.bench.harness import (
    free_port,
    gateway_env,
    machine_info,
    serve_argv,
    spawn,
    stop_all,
    wait_ready,
)
from switchyard.engines.llamacpp import llama_server_binary

PHASES = ("throughput", "adapters", "ttft", "swap")
ADMIN_ENV = "SWITCHYARD_ADMIN_KEY"

NO_EOS = {"0": -100, "2": -100}
PROMPT = "Write a few sentences about rivers and the towns built on them."


def _body(model: str, tokens: int, stream: bool = False) -> dict[str, Any]:
    return {
        "model": model,
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": tokens,
        "temperature": 0.7,
        "logit_bias": NO_EOS,
        "stream": stream,
    }


async def _one(session: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> int:
    async with session.post(url, json=body) as r:
        data = await r.json(content_type=None)
        if r.status != 200:
            raise RuntimeError(f"{url}: HTTP {r.status}: {str(data)[:300]}")
        return int(data["usage"]["completion_tokens"])


async def _throughput(
    url: str, models: list[str], concurrency: int, per_worker: int, tokens: int
) -> float:
    """Aggregate output tokens/s of `concurrency` workers, each sending `per_worker`
    requests; worker i's requests cycle through `models` from position i."""
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout) as session:

        async def worker(i: int) -> int:
            n = 0
            for j in range(per_worker):
                n += await _one(session, url, _body(models[(i + j) % len(models)], tokens))
            return n

        t0 = time.perf_counter()
        total = sum(await asyncio.gather(*(worker(i) for i in range(concurrency))))
        return total / (time.perf_counter() - t0)


async def _ttft(url: str, model: str) -> float:
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        t0 = time.perf_counter()
        async with session.post(url, json=_body(model, 4, stream=True)) as r:
            if r.status != 200:
                raise RuntimeError(f"HTTP {r.status}: {(await r.text())[:300]}")
            async for line in r.content:
                if line.startswith(b"data: {") and b'"content"' in line:
                    return (time.perf_counter() - t0) * 1000.0
    raise RuntimeError("the stream ended without content")


async def _engine_state(base: str, alias: str) -> str:
    async with aiohttp.ClientSession() as s, s.get(base + "/readyz") as r:
        return str((await r.json())["models"][alias]["state"])


def _engine(kind: str, slots: int, **residency: Any) -> dict[str, Any]:
    if kind == "vllm":
        return {"kind": "vllm", "max_num_seqs": slots, "max_model_len": 1024, **residency}
    return {"kind": "llamacpp", "parallel": slots, "ctx": 512, **residency}


def _config(port: int, db: Path, slots: int, manifest: dict[str, Any], kind: str) -> dict[str, Any]:
    ad = manifest["adapters"]
    # llama.cpp takes the GGUF adapters, vLLM the same adapters as PEFT folders.
    path, digest = ("peft_path", "peft_sha256") if kind == "vllm" else ("path", "sha256")
    return {
        "server": {"port": port},
        "storage": {"sqlite_path": str(db)},
        "auth": {"mode": "disabled"},
        "embeddings": {"enabled": False},
        "engines": {"min_residency_s": 0},
        "models": [
            {"alias": "bench-smol", "revision": "r1", "engine": _engine(kind, slots, pinned=True)},
            {
                "alias": "bench-cold",
                "revision": "r1",
                "engine": _engine(kind, 1, lazy=True, idle_ttl_s=1),
            },
            {  # one adapter loaded at a time: asking for the other swaps them
                "alias": "bench-swap",
                "revision": "r1",
                "engine": _engine(kind, 2, pinned=True, max_adapters=1),
            },
        ],
        "adapters": [
            {
                "name": f"{prefix}-{name}",
                "base": base,
                "base_revision": "r1",
                "path": ad[name][path],
                "sha256": ad[name][digest],
                "allowed_tenants": ["*"],
            }
            for base, prefix in (("bench-smol", "bench"), ("bench-swap", "swap"))
            for name in ("pirate", "robot")
        ],
    }


async def _swaps(base: str, admin: dict[str, str], n: int) -> dict[str, list[float]]:
    """Latency of a request whose adapter is cold (the engine swaps it in for the
    other) against one whose adapter is loaded, and the swap itself (from the trace)."""
    url = base + "/v1/chat/completions"
    out: dict[str, list[float]] = {"swap_ms": [], "loaded_ms": [], "adapter_load_ms": []}
    async with aiohttp.ClientSession() as session:
        for i in range(n):
            model = "swap-pirate" if i % 2 else "swap-robot"
            for kind in ("swap_ms", "loaded_ms"):  # cold first, then the same again
                t = time.perf_counter()
                async with session.post(url, json=_body(model, 8)) as r:
                    await r.read()
                    rid = r.headers["x-request-id"]
                out[kind].append((time.perf_counter() - t) * 1000.0)
                if kind == "swap_ms":
                    out["adapter_load_ms"].append(await _load_ms(session, base, admin, rid))
    return out


async def _load_ms(
    session: aiohttp.ClientSession, base: str, admin: dict[str, str], rid: str
) -> float:
    deadline = time.monotonic() + 20  # the ledger commits the trace a moment later
    while True:
        async with session.get(f"{base}/admin/requests/{rid}", headers=admin) as r:
            if r.status == 200:
                trace = await r.json()
                break
        if time.monotonic() > deadline:
            raise RuntimeError(f"no trace for {rid}")
        await asyncio.sleep(0.1)
    d = next(d for d in trace["decisions"] if d["stage"] == "residency")
    if d["outcome"] != "adapter-load":
        raise RuntimeError(f"expected a swap, the residency decision was {d['outcome']}")
    return float(d["evidence"]["adapter_load_ms"])


def _build_info() -> dict[str, str]:
    from switchyard.config import LlamaCppEngine

    binary = Path(llama_server_binary(LlamaCppEngine(kind="llamacpp")))
    out: dict[str, str] = {"binary": str(binary)}
    for candidate in (binary.parent / "BUILD-INFO", binary.resolve().parent / "BUILD-INFO"):
        if candidate.exists():
            for line in candidate.read_text().splitlines():
                k, _, v = line.partition("=")
                out[k] = v
    return out


async def _measure(
    args: argparse.Namespace, base: str, direct: str, admin: dict[str, str]
) -> dict[str, Any]:
    gw_url, eng_url = base + "/v1/chat/completions", direct + "/v1/chat/completions"
    levels = args.concurrency
    tput: dict[str, dict[str, list[float]]] = {
        "gateway": {str(c): [] for c in levels},
        "direct": {str(c): [] for c in levels},
    }
    mixes = {
        "base alone": ["bench-smol"],
        "1 adapter + base": ["bench-smol", "bench-pirate"],
        "2 adapters + base": ["bench-smol", "bench-pirate", "bench-robot"],
    }
    mixed: dict[str, list[float]] = {k: [] for k in mixes}
    cold: list[float] = []
    warm: list[float] = []
    await _throughput(gw_url, ["bench-smol"], 2, 1, 8)  # warm both paths up
    phases = set(args.phases)
    out: dict[str, Any] = {"phases": sorted(phases)}
    # Three phases, each in interleaved rounds (the order flips or rotates per round),
    # so a slow moment of the machine falls on every side alike.
    for rnd in range(args.rounds if "throughput" in phases else 0):
        for c in levels:
            per = max(1, args.requests // c)
            order = [("gateway", gw_url), ("direct", eng_url)]
            if rnd % 2:
                order.reverse()
            for name, url in order:
                tput[name][str(c)].append(
                    await _throughput(url, ["bench-smol"], c, per, args.tokens)
                )
        print(f"  throughput round {rnd + 1}/{args.rounds} done", flush=True)
    names = list(mixes)
    for rnd in range(args.rounds if "adapters" in phases else 0):
        for name in names[rnd % len(names) :] + names[: rnd % len(names)]:
            per = max(1, args.requests // 4)
            mixed[name].append(await _throughput(gw_url, mixes[name], 4, per, args.tokens))
        print(f"  adapter round {rnd + 1}/{args.rounds} done", flush=True)
    cold_n = args.cold_samples or (1 if args.kind == "vllm" else args.rounds)
    for _ in range(cold_n if "ttft" in phases else 0):
        # Cold: wait until the idle TTL unloaded the lazy model, then ask it.
        deadline = time.monotonic() + 60
        while await _engine_state(base, "bench-cold") != "cold":
            if time.monotonic() > deadline:
                raise RuntimeError("bench-cold was not unloaded by its idle TTL")
            await asyncio.sleep(0.2)
        cold.append(await _ttft(gw_url, "bench-cold"))
        warm.append(await _ttft(gw_url, "bench-cold"))
    if cold:
        print("  cold/warm TTFT done", flush=True)
        out["ttft_ms"] = {
            "cold": {"p50": statistics.median(cold), "max": max(cold), "samples": cold},
            "warm": {"p50": statistics.median(warm), "max": max(warm), "samples": warm},
        }
    if "swap" in phases:
        swaps = await _swaps(base, admin, max(2, 2 * args.rounds))
        print("  adapter swaps done", flush=True)
        out["adapter_swap_ms"] = {
            **{f"{k}_p50": statistics.median(v) for k, v in swaps.items()},
            "samples": swaps,
        }
    if tput["gateway"][str(levels[0])]:
        med = {k: {c: statistics.median(v) for c, v in d.items()} for k, d in tput.items()}
        lo = str(levels[0])
        out["throughput_tok_s"] = tput
        out["median_tok_s"] = med
        out["gateway_vs_direct"] = {c: med["gateway"][c] / med["direct"][c] for c in med["gateway"]}
        out["batching_gain_vs_c1"] = {
            c: med["gateway"][c] / med["gateway"][lo] for c in med["gateway"]
        }
    if mixed["base alone"]:
        out["adapter_mix_tok_s"] = mixed
        out["adapter_mix_vs_base"] = {
            k: statistics.median(v) / statistics.median(mixed["base alone"])
            for k, v in mixed.items()
        }
    return out


def run(args: argparse.Namespace) -> int:
    from switchyard.engines.lora_train import train

    print("adapters: training or reusing the cached ones ...", flush=True)
    manifest = train()
    work = Path(tempfile.mkdtemp(prefix="switchyard-bench-engines-"))
    port = free_port()
    cfg = work / "config.yaml"
    cfg.write_text(yaml.safe_dump(_config(port, work / "sy.db", args.slots, manifest, args.kind)))
    admin_key = secrets.token_urlsafe(24)  # the swaps read their traces
    gw = spawn("gateway", serve_argv(cfg, port), work, env={**gateway_env(), ADMIN_ENV: admin_key})
    admin = {"Authorization": f"Bearer {admin_key}"}
    base = f"http://127.0.0.1:{port}"
    try:

        def ready() -> bool:
            try:
                import httpx

                return httpx.get(base + "/readyz", timeout=2).status_code == 200
            except Exception:
                return False

        wait_ready(gw, ready, 900)
        import httpx

        ready_info = httpx.get(base + "/readyz", headers=admin).json()  # addresses: admin's
        upstream = ready_info["models"]["bench-smol"]["upstream"]
        direct = upstream.removesuffix("/v1")
        print(f"gateway {base}, engine {direct}; {args.rounds} rounds", flush=True)
        result = asyncio.run(_measure(args, base, direct, admin))
    finally:
        stop_all([gw])
    out = {
        "benchmark": "engines",
        "workload": {
            "prompt": PROMPT,
            "tokens_per_request": args.tokens,
            "requests_per_point": args.requests,
            "concurrency": args.concurrency,
            "engine_kind": args.kind,
            "slots": args.slots,
            "rounds": args.rounds,
            "gateway": "auth disabled, traces on (default policy), one pinned base model",
            "adapters": {k: v["sha256"][:16] for k, v in manifest["adapters"].items()},
        },
        "machine": machine_info("wrk"),
        "llama_server": _build_info() if args.kind == "llamacpp" else None,
        **result,
    }
    stamp = time.strftime("%Y%m%d-%H%M%S")
    path = Path(args.out or f"bench-results/engines-{args.kind}-{stamp}.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=2))
    _print(out)
    print(f"\nwritten to {path}")
    return 0


def _print(out: dict[str, Any]) -> None:
    if "median_tok_s" in out:
        med = out["median_tok_s"]
        print("\naggregate output tok/s (median of rounds)")
        print(f"{'concurrency':>12} {'gateway':>10} {'direct':>10} {'gw/direct':>10} {'vs c=1':>8}")
        for c in med["gateway"]:
            g, d = med["gateway"][c], med["direct"][c]
            gain = out["batching_gain_vs_c1"][c]
            print(f"{c:>12} {g:>10.1f} {d:>10.1f} {g / d:>10.3f} {gain:>8.2f}")
    if "adapter_mix_tok_s" in out:
        print("\nconcurrency 4, mixed adapters (tok/s, ratio to base alone)")
        for k, v in out["adapter_mix_tok_s"].items():
            print(f"  {k:<20} {statistics.median(v):>8.1f}  {out['adapter_mix_vs_base'][k]:.3f}")
    if "ttft_ms" in out:
        t = out["ttft_ms"]
        print(
            f"\nTTFT of a lazy model: cold p50 {t['cold']['p50']:.0f} ms, warm p50 "
            f"{t['warm']['p50']:.0f} ms"
        )
    if "adapter_swap_ms" in out:
        sw = out["adapter_swap_ms"]
        print(
            f"adapter swap (max_adapters 1, 8 tokens): request p50 {sw['swap_ms_p50']:.0f} ms "
            f"(the load {sw['adapter_load_ms_p50']:.0f} ms) vs {sw['loaded_ms_p50']:.0f} ms "
            f"with the adapter loaded"
        )


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--tokens", type=int, default=64, help="generated per request")
    p.add_argument("--requests", type=int, default=16, help="requests per measured point")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 8])
    p.add_argument("--slots", type=int, default=4, help="slots (llama.cpp) or max_num_seqs (vLLM)")
    p.add_argument("--kind", choices=["llamacpp", "vllm"], default="llamacpp")
    p.add_argument("--cold-samples", type=int, default=None, help="default: rounds (vLLM: 1)")
    p.add_argument(
        "--phases",
        nargs="+",
        choices=PHASES,
        default=list(PHASES),
        help="which phases to run (default: all)",
    )
    p.add_argument("--out", default=None)
    p.set_defaults(func=run)
