"""`switchyard bench cache-shared`: how fast a cache entry stored by one gateway process
becomes searchable in another, and what sharing costs the storing request.

A real `redis-server` on loopback and two processes, each with its own `ResponseCache`
and `SharedCache` (state/cache_redis.py), as two gateway replicas have:

- the *reader* holds `--entries` entries (random unit vectors in ONE partition, the
  worst case for adding to its index) and listens;
- the *writer* stores `--stores` entries at `--rate` per second, then makes
  `--invalidations` invalidations (one tagged entry each, removed by tag).

Reported: the reader's creation-to-searchable delay of each store and the delay of
each invalidation (p50/p99/max; one host, so one clock), and the writer's cost per
store: local store alone vs local store + the shared write (SET + PUBLISH, one round
trip), with a Redis PING measured in the same run as the baseline round trip.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import shutil
import subprocess
import tempfile
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import numpy as np

from switchyard.bench.harness import free_port, machine_info
from switchyard.bench.policy import redis_server_argv
from switchyard.decide.cache import CacheKeys, ResponseCache, cache_keys
from switchyard.request import Generation
from switchyard.state.cache_redis import SharedCache

DIM = 384


def _keys(text: str, tag: str | None = None) -> CacheKeys:
    body = Generation(model="m", messages=[{"role": "user", "content": text}], temperature=0)
    k = cache_keys(body, "chat.completions", "tenant:t", "t", "m", "r", None, None)
    return CacheKeys(k.partition, k.exact, k.query, (tag,) if tag else (), k.tenant, k.model)


def _unit(rng: np.random.Generator, n: int) -> np.ndarray:
    v = rng.standard_normal((n, DIM)).astype(np.float32)
    return v / np.linalg.norm(v, axis=1, keepdims=True)


def _reader(url: str, entries: int, conn: Connection) -> None:
    async def main() -> None:
        cache = ResponseCache(entries + 100_000, 1 << 40)
        share = SharedCache(cache, url, 2.0)
        listener = asyncio.create_task(share.listen())
        await share.subscribed.wait()  # (a resync drops local entries Redis lacks)
        vecs = _unit(np.random.default_rng(1), entries)
        for i in range(entries):
            cache.store(_keys(f"held {i}"), b"{}", vecs[i], 3600)
        conn.send("ready")
        await asyncio.get_running_loop().run_in_executor(None, conn.recv)
        conn.send({"store": list(share.lags), "invalidation": list(share.inv_lags)})
        listener.cancel()
        await share.close()

    asyncio.run(main())


def _stats(xs: list[float]) -> dict[str, float | int | None]:
    if not xs:
        return {"n": 0, "p50_ms": None, "p99_ms": None, "max_ms": None}
    a = np.asarray(xs) * 1000
    return {
        "n": len(xs),
        "p50_ms": round(float(np.percentile(a, 50)), 3),
        "p99_ms": round(float(np.percentile(a, 99)), 3),
        "max_ms": round(float(a.max()), 3),
    }


async def _writer(url: str, args: argparse.Namespace) -> dict[str, Any]:
    cache = ResponseCache(args.stores + args.invalidations + 10, 1 << 40)
    share = SharedCache(cache, url, 2.0)
    rng = np.random.default_rng(2)
    vecs = _unit(rng, args.stores + args.invalidations)
    body = b'{"choices": [{"message": {"content": "' + b"x" * 400 + b'"}}]}'
    ping, local, shared = [], [], []
    for _ in range(200):
        t = time.perf_counter()
        await share._redis.ping()
        ping.append(time.perf_counter() - t)
    gap = 1.0 / args.rate
    for i in range(args.stores):
        t = time.perf_counter()
        entry = cache.store(_keys(f"new {i}"), body, vecs[i], 3600)
        t1 = time.perf_counter()
        await share.put(entry, vecs[i])
        t2 = time.perf_counter()
        local.append(t1 - t)
        shared.append(t2 - t)
        await asyncio.sleep(max(0.0, gap - (t2 - t)))
    for j in range(args.invalidations):
        k = _keys(f"doomed {j}", tag=f"inv{j}")
        v = vecs[args.stores + j]
        await share.put(cache.store(k, body, v, 3600), v)
        await asyncio.sleep(0.02)
        cache.invalidate(tag=f"inv{j}")
        await share.invalidate({"tag": f"inv{j}"}, dry_run=False)
        await asyncio.sleep(0.05)
    await share.close()
    return {
        "redis_ping": _stats(ping),
        "store_local": _stats(local),
        "store_local_plus_shared": _stats(shared),
        "errors": share.errors,
    }


def run(args: argparse.Namespace) -> int:
    binary = shutil.which("redis-server")
    if binary is None:
        print("redis-server not found (make sysdeps installs it)")
        return 2
    port = free_port()
    redis = subprocess.Popen(
        redis_server_argv(binary, port, Path(tempfile.mkdtemp(prefix="redis-"))),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"redis://127.0.0.1:{port}/0"
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    reader = ctx.Process(target=_reader, args=(url, args.entries, child))
    try:
        time.sleep(0.3)
        reader.start()
        if not parent.poll(600) or parent.recv() != "ready":
            print("the reader process did not get ready")
            return 1
        writer = asyncio.run(_writer(url, args))
        time.sleep(0.5)  # the last events arrive
        parent.send("report")
        seen = parent.recv()
    finally:
        if reader.is_alive():
            reader.join(10)
        if reader.is_alive():
            reader.kill()
        redis.terminate()
        redis.wait(10)
    version = subprocess.run([binary, "--version"], capture_output=True, text=True).stdout
    result: dict[str, Any] = {
        "benchmark": "cache-shared",
        "machine": machine_info(""),
        "versions": {"redis_server": version.strip()},
        "workload": {
            "reader_entries": args.entries,
            "stores": args.stores,
            "rate_per_s": args.rate,
            "invalidations": args.invalidations,
            "dimensions": DIM,
            "body_bytes": 445,
        },
        "propagation": {
            "store": _stats(seen["store"]),
            "invalidation": _stats(seen["invalidation"]),
        },
        "writer": writer,
    }
    ping = writer["redis_ping"]["p50_ms"] or 0.0
    added = (writer["store_local_plus_shared"]["p50_ms"] or 0.0) - (
        writer["store_local"]["p50_ms"] or 0.0
    )
    result["writer"]["added_p50_ms"] = round(added, 3)
    result["writer"]["added_p50_in_pings"] = round(added / ping, 2) if ping else None
    print(json.dumps(result, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))
    return 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--entries", type=int, default=100_000, help="entries the reader holds")
    p.add_argument("--stores", type=int, default=2000)
    p.add_argument("--rate", type=float, default=200.0, help="stores per second")
    p.add_argument("--invalidations", type=int, default=100)
    p.add_argument("--out")
    p.set_defaults(func=run)
