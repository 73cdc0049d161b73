"""What an engine itself says about its load, read from it at a bounded rate.

The gateway's own counts (requests it has in flight, its latency EWMAs) see only its
own traffic. An engine that other clients also call, or that holds a long prompt in
its batch, is busier than those counts say. So the gateway reads each engine's own
figures — llama-server's `/metrics` (requests processing and deferred, prompt tokens
served from its cache) and `/slots` (its parallel slots), vLLM's `/metrics` (requests
running and waiting, KV-cache usage, prefix-cache hits) — every `engines.
state_interval_s`, all engines at once, each read bounded in time and size. A figure older
than `engines.state_stale_s` (an engine that stopped answering, or a gateway that
stopped reading) is not used: the balancer falls back to its own counts, never to an
old picture.

External upstreams are read when their config names what they run
(`engine.load_metrics: vllm | llamacpp`); managed engines always are.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson
from prometheus_client.parser import text_string_to_metric_families

from switchyard.engines.bounded import read_bounded

log = logging.getLogger("switchyard.engines")

MAX_BYTES = 1 << 20  # a metrics page larger than this is not read
# Lines of the figures read (every engine core's, every model's): a page with more is not
# parsed, so a hostile page costs the event loop a bounded time however it is written.
MAX_SERIES = 2000
MAX_COUNT = 1_000_000  # requests running or waiting: more is no engine's real figure

# The figures each kind reports, by metric name (a counter's without its `_total`): running, waiting, KV-cache usage (0-1), prefix-cache
# (hits, queries) or (cached prompt tokens, prompt tokens).
_VLLM = {
    "running": "vllm:num_requests_running",
    "waiting": "vllm:num_requests_waiting",
    "kv": ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
    "hits": ("vllm:prefix_cache_hits", "vllm:prefix_cache_queries"),
}
_LLAMACPP = {
    "running": "llamacpp:requests_processing",
    "waiting": "llamacpp:requests_deferred",
    "kv": ("llamacpp:kv_cache_usage_ratio",),
    "hits": ("llamacpp:prompt_tokens_cached", "llamacpp:prompt_tokens"),
}
KINDS = {"vllm": _VLLM, "llamacpp": _LLAMACPP}


@dataclass(slots=True)
class EngineLoad:
    """One engine's last reading (None: not reported, or not read yet)."""

    kind: str
    root: Callable[[], str]  # the engine's root URL now (its /metrics beside /v1)
    stale_s: float = 3.0  # engines.state_stale_s
    up: Callable[[], bool] = lambda: True  # a managed engine is read while it is ready
    running: int | None = None
    waiting: int | None = None
    kv_usage: float | None = None  # 0-1
    prefix_hit_rate: float | None = None  # since the engine started, 0-1
    slots: int | None = None  # llama-server's parallel slots
    read_at: float = 0.0  # monotonic; 0 = never read
    error: str | None = None  # why the last read failed

    def fresh(self, now: float) -> bool:
        """Read recently enough to be used (within `stale_s`)."""
        return self.read_at > 0 and now - self.read_at <= self.stale_s

    @property
    def queued(self) -> int:
        """Requests the engine has taken, running or waiting (all clients')."""
        return (self.running or 0) + (self.waiting or 0)

    def evidence(self) -> dict[str, Any]:
        """What a decision that used this reading shows of it."""
        return {
            "running": self.running,
            "waiting": self.waiting,
            "kv_cache_usage": self.kv_usage,
            "age_ms": round((time.monotonic() - self.read_at) * 1000),
        }

    def describe(self, now: float) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "running": self.running,
            "waiting": self.waiting,
            "kv_cache_usage": self.kv_usage,
            "prefix_cache_hit_rate": self.prefix_hit_rate,
            "slots": self.slots,
            "age_s": round(now - self.read_at, 3) if self.read_at else None,
            "fresh": self.fresh(now),
            "error": self.error,
        }


def parse_metrics(kind: str, text: str) -> dict[str, Any]:
    """The figures of a Prometheus text page (vLLM's or llama-server's): summed over
    the page's series (vLLM labels each by model and engine)."""
    names = KINDS[kind]
    wanted = tuple(n for v in names.values() for n in ((v,) if isinstance(v, str) else v))
    lines = [line for line in text.splitlines() if line.startswith(wanted)]
    if len(lines) > MAX_SERIES:
        raise ValueError(f"more than {MAX_SERIES} series of the figures read")
    sums: dict[str, float] = {}
    for family in text_string_to_metric_families("\n".join(lines) + "\n"):
        for sample in family.samples:  # by the sample's own name: a counter's less _total
            name = sample.name
            if name.endswith(("_created", "_bucket", "_count", "_sum")):
                continue
            name = name.removesuffix("_total")
            sums[name] = sums.get(name, 0.0) + float(sample.value)
    out: dict[str, Any] = {}
    for field in ("running", "waiting"):
        value = sums.get(str(names[field]))
        # a figure no engine reports (negative, NaN, infinite, huge) is not used
        out[field] = int(value) if value is not None and 0 <= value <= MAX_COUNT else None
    kv = next((sums[n] for n in names["kv"] if n in sums), None)
    out["kv_usage"] = min(1.0, max(0.0, kv)) if kv is not None else None
    hits, queries = (sums.get(n) for n in names["hits"])
    rate = hits / queries if hits is not None and queries else None
    out["prefix_hit_rate"] = rate if rate is not None and 0 <= rate <= 1 else None
    return out


def parse_slots(body: bytes) -> int | None:
    """llama-server's /slots: how many parallel slots it runs."""
    got = orjson.loads(body)
    return len(got) if isinstance(got, list) else None


class LoadWatch:
    """Reads every engine's load every `interval_s` (all at once, each bounded by
    half the interval) while the gateway runs."""

    def __init__(self, loads: Iterable[EngineLoad], interval_s: float) -> None:
        self.loads = list(loads)
        self.interval_s = interval_s
        self._task: asyncio.Task[None] | None = None
        self._session: aiohttp.ClientSession | None = None

    def start(self) -> None:
        if self.loads and self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def _run(self) -> None:
        timeout = aiohttp.ClientTimeout(total=max(0.05, self.interval_s / 2))
        self._session = aiohttp.ClientSession(timeout=timeout)
        while True:
            started = time.monotonic()
            await asyncio.gather(*(self.read(load) for load in self.loads if load.up()))
            await asyncio.sleep(max(0.0, self.interval_s - (time.monotonic() - started)))

    async def read(self, load: EngineLoad) -> None:
        """One reading of `load`'s engine; a failure is kept as its error (its figures
        then age out: `fresh`)."""
        assert self._session is not None
        try:
            root = load.root()
            text = await self._get(root + "/metrics")
            figures = parse_metrics(load.kind, text.decode("utf-8", "replace"))
            if load.kind == "llamacpp":
                slots = await self._get(root + "/slots")
                figures["slots"] = parse_slots(slots)
        except Exception as exc:  # any failure: the figures age out
            if load.error is None:
                log.warning("engine load of %s not read: %s", load.kind, exc)
            load.error = f"{type(exc).__name__}: {exc}"[:200]
            return
        for name, value in figures.items():
            setattr(load, name, value)
        load.error = None
        load.read_at = time.monotonic()

    async def _get(self, url: str) -> bytes:
        assert self._session is not None
        # Never followed elsewhere: an upstream's redirect must not make the gateway fetch
        # another address (an internal one) on its behalf.
        async with self._session.get(url, allow_redirects=False) as resp:
            if resp.status != 200:
                raise ValueError(f"HTTP {resp.status}")
            body = await read_bounded(resp, MAX_BYTES)
            if body is None:
                raise ValueError(f"more than {MAX_BYTES} bytes")
            return body
