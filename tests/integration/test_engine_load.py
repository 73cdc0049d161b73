"""Engines' own load (engines/load.py, #48): read from a real llama-server and from a
scripted upstream speaking vLLM's /metrics format, at a bounded rate, aged out when
stale, and weighed by the balancer of a real gateway beside its own counts."""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Iterator
from typing import Any

import aiohttp
import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from support.gateways import start_gateway
from support.procs import Proc, free_port, wait_http
from support.upstreams import Scripted
from switchyard.config import LlamaCppEngine
from switchyard.engines.assets import smollm2_gguf_path
from switchyard.engines.llamacpp import llama_server_binary
from switchyard.engines.load import EngineLoad, LoadWatch, parse_metrics


def _vllm_page(running: float, waiting: float, kv: float, hits: float, queries: float) -> str:
    """A page as vLLM's server writes it: each figure per engine core, with labels."""
    out = []
    for name, kind, value in (
        ("num_requests_running", "gauge", running),
        ("num_requests_waiting", "gauge", waiting),
        ("kv_cache_usage_perc", "gauge", kv),
        ("prefix_cache_queries", "counter", queries),
        ("prefix_cache_hits", "counter", hits),
    ):
        out.append(f"# HELP vllm:{name} figure\n# TYPE vllm:{name} {kind}")
        total = "_total" if kind == "counter" else ""
        for engine in ("0", "1"):
            labels = f'{{engine="{engine}",model_name="m"}}'
            out.append(f"vllm:{name}{total}{labels} {value}")
            if kind == "counter":
                out.append(f"vllm:{name}_created{labels} 1.7e9")
    return "\n".join(out) + "\n"


@settings(max_examples=80, deadline=None)
@given(
    st.integers(0, 10_000),
    st.integers(0, 10_000),
    st.floats(0, 1),
    st.integers(0, 10**6),
    st.integers(0, 10**6),
)
def test_a_vllm_page_sums_its_engine_cores(
    running: int, waiting: int, kv: float, hits: int, extra: int
) -> None:
    got = parse_metrics("vllm", _vllm_page(running, waiting, kv, hits, hits + extra))
    assert got["running"] == 2 * running and got["waiting"] == 2 * waiting
    assert got["kv_usage"] == pytest.approx(min(1.0, 2 * kv))
    if hits + extra:
        assert got["prefix_hit_rate"] == pytest.approx(hits / (hits + extra))
    else:
        assert got["prefix_hit_rate"] is None


def test_a_page_without_the_figures_reports_none() -> None:
    assert parse_metrics("vllm", "# TYPE other gauge\nother 3\n") == {
        "running": None,
        "waiting": None,
        "kv_usage": None,
        "prefix_hit_rate": None,
    }


@pytest.fixture(scope="module")
def llama_server() -> Iterator[str]:
    port = free_port()
    binary = llama_server_binary(LlamaCppEngine(kind="llamacpp"))
    proc = Proc(
        [
            binary,
            "-m",
            smollm2_gguf_path(),
            "--port",
            str(port),
            "--metrics",
            "--slots",
            "-np",
            "2",
            "-c",
            "1024",
        ],
        "llama-server",
    )
    url = f"http://127.0.0.1:{port}"
    wait_http(url + "/health", proc, timeout_s=120)
    yield url
    proc.stop()


def test_a_real_llama_server_is_read_and_its_reading_ages_out(llama_server: str) -> None:
    load = EngineLoad("llamacpp", lambda: llama_server, stale_s=0.5)
    watch = LoadWatch([load], interval_s=1.0)

    async def read_once() -> None:
        async with aiohttp.ClientSession() as session:
            watch._session = session
            await watch.read(load)
        watch._session = None

    asyncio.run(read_once())
    now = time.monotonic()
    assert load.error is None and load.fresh(now)
    assert load.slots == 2 and load.running == 0 and load.waiting == 0
    assert not load.fresh(now + 0.6)  # past stale_s: no longer used


def test_an_engine_that_stops_answering_keeps_an_error_and_goes_stale() -> None:
    port = free_port()  # nothing listens
    load = EngineLoad("vllm", lambda: f"http://127.0.0.1:{port}", stale_s=0.2)
    watch = LoadWatch([load], interval_s=0.05)

    async def run() -> None:
        watch.start()
        await asyncio.sleep(0.3)
        await watch.stop()

    asyncio.run(run())
    assert load.error is not None and load.read_at == 0.0
    assert not load.fresh(time.monotonic())


# -- the balancer of a real gateway, over two upstreams reporting their load --------------


def _gateway(a: Scripted, b: Scripted, strategy: str) -> Any:
    deployments = [
        {
            "name": name,
            "engine": {"kind": "openai", "base_url": s.url + "/v1", "load_metrics": "vllm"},
        }
        for name, s in (("a", a), ("b", b))
    ]
    return start_gateway(
        {
            "models": [
                {
                    "alias": "chat",
                    "deployments": deployments,
                    "balance": {"strategy": strategy, "affinity": False, "probe": 0.0},
                }
            ],
            "engines": {"state_interval_s": 0.2, "state_stale_s": 1.0},
            "embeddings": {"enabled": False},
        }
    )


def _load(s: Scripted, **figures: float) -> None:
    r = httpx.put(s.url + "/control/load", json=figures, timeout=5)
    assert r.status_code == 200, r.text


def _served(gw: Any, n: int) -> tuple[collections.Counter[str], dict[str, Any]]:
    """Which deployment served each of `n` requests, and the evidence of the last
    one's selection."""
    counts: collections.Counter[str] = collections.Counter()
    rid = ""
    for _ in range(n):
        r = httpx.post(
            gw.url + "/v1/chat/completions",
            json={
                "model": "chat",
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 4,
            },
            headers={"Authorization": f"Bearer {gw.key}"},
            timeout=30,
        )
        assert r.status_code == 200, r.text
        counts[r.headers["x-switchyard-upstream"].removeprefix("chat/")] += 1
        rid = r.headers["x-request-id"]
    step = next(d for d in gw.trace(rid)["decisions"] if d["stage"] == "select")
    return counts, step["evidence"]


@pytest.mark.parametrize("strategy", ["least_outstanding", "latency"])
def test_requests_go_around_an_engine_that_other_clients_keep_busy(
    two: tuple[Scripted, Scripted], strategy: str
) -> None:
    a, b = two
    _load(a, running=4, waiting=40)  # busy with someone else's requests
    _load(b, running=0, waiting=0)
    gw = _gateway(a, b, strategy)
    try:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:  # both engines read once
            load = httpx.get(gw.url + "/admin/engines", headers=gw.admin).json()["load"]
            if all(v["fresh"] for v in load.values()) and len(load) == 2:
                break
            time.sleep(0.1)
        assert load["chat/a"]["waiting"] == 40 and load["chat/b"]["waiting"] == 0
        if strategy == "latency":  # both measured, so neither is probed as unmeasured
            _served(gw, 8)
        counts, evidence = _served(gw, 12)
        assert counts == {"b": 12}, counts
        assert evidence["candidates"]["chat/a"]["engine"]["waiting"] == 40
        _load(a, running=0, waiting=0)
        _load(b, running=4, waiting=40)
        time.sleep(0.6)  # read again
        counts, _ = _served(gw, 12)
        assert counts == {"a": 12}, counts
    finally:
        gw.proc.stop()
