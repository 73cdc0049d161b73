"""`switchyard bench cache`: what a cache decision costs, and what a hit saves.

Three measurements, each against a baseline taken in the same run:
1. Lookup latency — embedding the query + similarity search + verification, each
   part and the whole — with 10k and 100k entries in ONE partition (the worst case:
   partitions are usually small), p50/p99, for each embedding runtime. Entries carry
   random unit vectors: no entry is near the query, so the large-partition search
   always takes its slower, below-the-floor path (see `decide/cache.py`). Lookups run
   one at a time, each embedded both ways the gateway can: inline on the event loop
   (what a lone request gets by default) and through the batching worker thread.
2. Embedding throughput of the shared service with micro-batching (N concurrent
   callers) versus one text per forward pass, per runtime.
3. E2E of a hit versus a miss through a real gateway serving the embedded local model.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np

from switchyard.config import EmbeddingsConfig
from switchyard.decide.cache import CacheKeys, ResponseCache, cache_keys
from switchyard.decide.candidate import CandidateCheck
from switchyard.embed import EmbeddingService
from switchyard.request import Generation

QUERIES = [
    "How do I reset my password?",
    "What is the refund window for annual plans?",
    "Can I move my subscription to another account?",
    "Why was my card declined yesterday?",
    "How many seats does the team plan include?",
    "Where can I download last month's invoice?",
]


def _keys(text: str) -> CacheKeys:
    """Every benchmark entry and query lives in one partition: the worst case."""
    body = Generation(model="m", messages=[{"role": "user", "content": text}], temperature=0)
    return cache_keys(body, "chat.completions", "tenant:t", "t", "m", "r", None, None)


def _pct(xs: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(xs), q)) if xs else float("nan")


RUNTIMES = ("onnx-int8", "onnx", "torch")


class Callers:
    """The benchmark's embed callers in flight: what the gateway's count of requests in
    flight is to its embedding service. A lone caller may be embedded inline (the
    default config); `worker_only` measures the batching worker thread instead."""

    def __init__(self) -> None:
        self.n = 0
        self.worker_only = False

    def idle(self) -> bool:
        return not self.worker_only and self.n <= 1


async def _service(runtime: str, callers: Callers) -> EmbeddingService:
    # No memo: the passes ask the same texts again, and this measures the forward pass.
    cfg = EmbeddingsConfig.model_validate({"runtime": runtime, "memo_entries": 0})
    svc = EmbeddingService(cfg, callers.idle)
    svc.start()
    while svc.state == "loading":
        await asyncio.sleep(0.05)
    if not svc.ready:
        raise RuntimeError(f"embedding model ({runtime}) failed to load: {svc.last_error}")
    return svc


def filled_cache(n: int, seed: int = 0) -> ResponseCache:
    """n entries with random unit vectors, all in the one benchmark partition."""
    rng = np.random.default_rng(seed)
    cache = ResponseCache(max_entries=n + 10, max_bytes=1 << 40)
    vecs = rng.normal(size=(n, 384)).astype(np.float32)
    vecs /= np.linalg.norm(vecs, axis=1, keepdims=True)
    for i in range(n):
        cache.store(_keys(f"q{i}"), b"{}", vecs[i], ttl_s=3600)
    return cache


def _summary(xs: list[float]) -> dict[str, float]:
    return {"p50": _pct(xs, 50), "p99": _pct(xs, 99)}


async def lookup_latency(
    svc: EmbeddingService,
    callers: Callers,
    caches: dict[int, ResponseCache],
    lookups: int,
    path: str,
) -> list[dict[str, Any]]:
    """One cache decision = embed the query (through the service, as the gateway does)
    + search its partition + verify the best candidate; each part timed, and the whole.
    The verification is the shipped chain (decide/candidate.py: rules, pair model,
    cross-encoder), each of its checks timed on every lookup.
    One caller at a time: `path` "inline" is what the default config does then,
    "worker" forces the hop to the batching worker thread."""
    # Imported here: keeps `switchyard --help` light.
    from switchyard.config import CacheConfig
    from switchyard.decide.candidate import from_config
    from switchyard.decide.verify import _parse

    check = from_config(CacheConfig(), svc.cfg)
    if check.unavailable is not None:
        raise RuntimeError(check.unavailable)
    # Every check runs on every lookup, whatever the one before said: the worst case,
    # a candidate the cheaper checks let through to the cross-encoder.
    stages = [
        CandidateCheck(check.rules, None, None),
        CandidateCheck(False, check.model, None),
        CandidateCheck(False, None, check.encoder),
    ]
    callers.worker_only = path == "worker"
    for j in range(5):  # warm-up: first calls allocate
        await svc.embed([QUERIES[j % len(QUERIES)]])
    out = []
    for n, cache in caches.items():
        total, embed_ms, search_ms, verify_ms = [], [], [], []
        # Each pass asks the same texts: forget their parses, as a gateway has never
        # seen a new request's text before.
        _parse.cache_clear()
        inline = svc.inline
        for j in range(lookups):
            q = QUERIES[j % len(QUERIES)] + f" (variant {j})"
            keys = _keys(q)
            t0 = time.perf_counter()
            callers.n += 1
            try:
                vecs, _ = await svc.embed([q])
            finally:
                callers.n -= 1
            t1 = time.perf_counter()
            found = cache.nearest(keys, vecs[0])
            t2 = time.perf_counter()
            if found.entry is not None:
                for stage in stages:
                    stage(q, found.entry.keys.query, found.similarity or 0.0)
            t3 = time.perf_counter()
            total.append((t3 - t0) * 1000)
            embed_ms.append((t1 - t0) * 1000)
            search_ms.append((t2 - t1) * 1000)
            verify_ms.append((t3 - t2) * 1000)
        out.append(
            {
                "runtime": svc.runtime,
                "path": path,
                "inline_calls": svc.inline - inline,
                "entries": n,
                "lookups": lookups,
                "total_ms": _summary(total),
                "embed_ms": _summary(embed_ms),
                "search_ms": _summary(search_ms),
                "verify_ms": _summary(verify_ms),
            }
        )
    callers.worker_only = False
    return out


async def embed_throughput(
    svc: EmbeddingService, callers: Callers, n: int, concurrency: int
) -> dict[str, Any]:
    """Texts per second: one forward pass per text (the baseline) versus `concurrency`
    callers through the micro-batching service."""
    texts = [QUERIES[i % len(QUERIES)] + f" #{i}" for i in range(n)]
    loop = asyncio.get_running_loop()
    t0 = time.perf_counter()
    for t in texts:
        await loop.run_in_executor(None, svc.encode, [t])
    single = n / (time.perf_counter() - t0)
    sem = asyncio.Semaphore(concurrency)

    async def one(t: str) -> None:
        try:
            async with sem:
                await svc.embed([t])
        finally:
            callers.n -= 1

    batches = svc.batches
    t0 = time.perf_counter()
    callers.n += len(texts)  # a burst: every caller has arrived
    await asyncio.gather(*(one(t) for t in texts))
    batched = n / (time.perf_counter() - t0)
    return {
        "runtime": svc.runtime,
        "texts": n,
        "concurrency": concurrency,
        "single_per_s": single,
        "micro_batched_per_s": batched,
        "mean_batch": n / max(1, svc.batches - batches),
        "ratio": batched / single,
    }


def versions() -> dict[str, Any]:
    from importlib.metadata import PackageNotFoundError, version

    out: dict[str, Any] = {
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "cpu": _cpu_model(),
    }
    for pkg in ("numpy", "onnxruntime", "torch", "sentence-transformers", "faiss-cpu"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            out[pkg] = None
    return out


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def hit_vs_miss(prompts: int) -> dict[str, Any]:
    """A real gateway with the embedded local model: first ask (miss) vs repeat (hit)."""
    work = Path(tempfile.mkdtemp(prefix="switchyard-cache-bench-"))
    cfg = work / "config.yaml"
    port = 18931
    cfg.write_text(
        f"server: {{port: {port}}}\nauth: {{mode: disabled}}\n"
        f'storage: {{sqlite_path: "{work}/db.sqlite"}}\n'
        "models:\n  - alias: smollm2-135m\n    engine: {kind: llamacpp, ctx: 2048}\n"
        "cache: {enabled: true, threshold: 0.9}\n"
    )
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "switchyard", "serve", "--config", str(cfg)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=env,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(base + "/readyz", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                time.sleep(0.3)
        miss: list[tuple[float, str | None]] = []
        hit: list[tuple[float, str | None]] = []
        for i in range(prompts):
            body = json.dumps(
                {
                    "model": "smollm2-135m",
                    "temperature": 0,
                    "max_tokens": 48,
                    "messages": [
                        {"role": "user", "content": QUERIES[i % len(QUERIES)] + f" ({i})"}
                    ],
                }
            ).encode()
            for bucket in (miss, hit):
                req = urllib.request.Request(
                    base + "/v1/chat/completions",
                    data=body,
                    headers={"Content-Type": "application/json"},
                )
                t0 = time.perf_counter()
                with urllib.request.urlopen(req, timeout=120) as r:
                    r.read()
                    state = r.headers.get("x-switchyard-cache")
                bucket.append(((time.perf_counter() - t0) * 1000, state))
        return {
            "prompts": prompts,
            "max_tokens": 48,
            "miss_ms_p50": statistics.median(x for x, _ in miss),
            "hit_ms_p50": statistics.median(x for x, _ in hit),
            "hit_states": sorted({s or "none" for _, s in hit}),
        }
    finally:
        proc.terminate()
        proc.wait(20)


def run(args: argparse.Namespace) -> int:
    async def main() -> dict[str, Any]:
        caches = {n: filled_cache(n) for n in args.sizes}
        lookup: list[dict[str, Any]] = []
        embedding: list[dict[str, Any]] = []
        for runtime in args.runtimes:
            callers = Callers()
            svc = await _service(runtime, callers)
            try:
                for path in ("inline", "worker"):
                    lookup += await lookup_latency(svc, callers, caches, args.lookups, path)
                embedding.append(
                    await embed_throughput(svc, callers, args.embed_texts, args.concurrency)
                )
            finally:
                await svc.stop()
        return {"lookup": lookup, "embedding": embedding}

    result = asyncio.run(main())
    if not args.skip_e2e:
        result["hit_vs_miss"] = hit_vs_miss(args.prompts)
    result["machine"] = versions()
    for row in result["lookup"]:
        total, emb = row["total_ms"], row["embed_ms"]
        search, ver = row["search_ms"], row["verify_ms"]
        met = "meets" if total["p99"] <= 10.0 else "misses"
        print(
            f"lookup {row['runtime']:>9} {row['path']:>6} @ {row['entries']:>7} entries: total p50 "
            f"{total['p50']:.2f} p99 {total['p99']:.2f} ms ({met} p99 <= 10 ms) | embed "
            f"{emb['p50']:.2f}/{emb['p99']:.2f} search {search['p50']:.2f}/{search['p99']:.2f} "
            f"verify {ver['p50']:.2f}/{ver['p99']:.2f} (p50/p99 ms)"
        )
    for e in result["embedding"]:
        print(
            f"embedding {e['runtime']:>9}: {e['single_per_s']:.1f}/s one-by-one vs "
            f"{e['micro_batched_per_s']:.1f}/s micro-batched at concurrency "
            f"{e['concurrency']} (x{e['ratio']:.2f}, mean batch {e['mean_batch']:.1f})"
        )
    if "hit_vs_miss" in result:
        h = result["hit_vs_miss"]
        print(
            f"E2E local model: miss p50 {h['miss_ms_p50']:.1f} ms, hit p50 {h['hit_ms_p50']:.1f} ms "
            f"(x{h['miss_ms_p50'] / h['hit_ms_p50']:.1f}); hit headers {h['hit_states']}"
        )
    m = result["machine"]
    print(
        f"machine: {m['cpu']}, {m['cpus']} CPUs, python {m['python']}, onnxruntime "
        f"{m['onnxruntime']}, torch {m['torch']}, faiss {m['faiss-cpu']}, numpy {m['numpy']}"
    )
    out = Path(args.out or f"bench-results/cache-{time.strftime('%Y%m%d-%H%M%S')}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"results: {out}")
    return 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--sizes", type=lambda s: [int(x) for x in s.split(",")], default=[10_000, 100_000]
    )
    # 1000: a p99 over 200 samples is the 2nd-largest, one VM hiccup from moving.
    p.add_argument("--lookups", type=int, default=1000)
    p.add_argument(
        "--runtimes",
        type=lambda s: [x for x in s.split(",") if x],
        default=list(RUNTIMES),
        help="embedding runtimes to measure, comma-separated",
    )
    p.add_argument("--embed-texts", type=int, default=256)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--prompts", type=int, default=6)
    p.add_argument("--skip-e2e", action="store_true")
    p.add_argument("--out")
    p.set_defaults(func=run)
