"""`switchyard bench hotpath`: the gateway's own work per request, without the network.

`bench overhead` measures what a client sees, but on a small shared machine its
ratios move by ±15 % from run to run, so a change of a few per cent cannot be seen
there. This bench isolates the part a change to Switchyard's request path can move:
both Switchyard and the bare floor proxy (`passthrough_proxy --bare`) are driven
straight through their ASGI apps in one process, with the upstream's reply handed
back at once (Switchyard's upstream client and the floor's aiohttp session are the
only things replaced), so what is left is each app's own per-request work: parsing,
the pipeline's decisions, the executor, the response, settling (usage row, trace,
metrics). Switchyard's result minus the floor's is what its decisions cost.

Two measures:
- CPU time per request (`time.process_time`), the minimum and median over blocks;
  the minimum is the one least disturbed by other work on the machine.
- With `--instructions`, the instructions executed per request, counted by
  valgrind's callgrind: two runs of N and 2N requests, so start-up cancels out.
  Instruction counts repeat to well under 1 % between runs, so a change of 2 % is
  visible. They are a proxy: a request in the real server runs slower per
  instruction (its code and data are out of the CPU caches between requests).

Timers are made count-based here (a ledger batch per 512 requests, a metrics fold
per 64), so every run does the same work in the same order.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from switchyard.bench.harness import CHAT_PATH, MODEL, chat_body
from switchyard.bench.realistic import KEY_LIMITS, TENANT, TENANT_LIMITS
from switchyard.engines.upstream import UpstreamReply

METRICS_FOLD_EVERY = 64

App = Callable[[dict[str, Any], Any, Any], Awaitable[None]]


def _reply(tokens: int) -> bytes:
    content = " ".join(["tok"] * tokens)
    body = {
        "id": "chatcmpl-hotpath",
        "object": "chat.completion",
        "created": 1,
        "model": MODEL,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": content},
                "finish_reason": "length",
            }
        ],
        "usage": {"prompt_tokens": 9, "completion_tokens": tokens, "total_tokens": 9 + tokens},
    }
    return json.dumps(body, separators=(",", ":")).encode()


class Driver:
    """Calls an ASGI app as uvicorn would for one keep-alive client, and checks that
    every request was answered 200 (a broken path must not look fast)."""

    def __init__(self, body: bytes) -> None:
        self.body = body
        self.headers = [
            (b"host", b"127.0.0.1:8000"),
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
        ]
        self.statuses: dict[int, int] = {}
        self.on_each: Callable[[int], None] | None = None
        # As uvicorn's request cycle, which `receive` is a method of: the whole body
        # has arrived (api/body.py reads it without a watch then).
        self.more_body = False

    def scope(self) -> dict[str, Any]:
        return {
            "type": "http",
            "asgi": {"version": "3.0", "spec_version": "2.4"},
            "http_version": "1.1",
            "server": ("127.0.0.1", 8000),
            "client": ("127.0.0.1", 40000),
            "scheme": "http",
            "method": "POST",
            "root_path": "",
            "path": CHAT_PATH,
            "raw_path": CHAT_PATH.encode(),
            "query_string": b"",
            "headers": self.headers,
            "state": {},
        }

    async def receive(self) -> dict[str, Any]:
        return {"type": "http.request", "body": self.body, "more_body": False}

    async def send(self, message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            status = int(message["status"])
            self.statuses[status] = self.statuses.get(status, 0) + 1

    async def drive(self, app: App, n: int) -> None:
        for i in range(n):
            if self.on_each is not None:
                self.on_each(i)
            await app(self.scope(), self.receive, self.send)
            await asyncio.sleep(0)  # let the loop run what the request scheduled

    def check(self) -> None:
        bad = {s: c for s, c in self.statuses.items() if s != 200}
        if bad:
            raise RuntimeError(f"requests were not answered 200: {bad}")


async def _switchyard_app(workdir: Path, reply: bytes, realistic: bool = False) -> tuple[App, Any]:
    """Switchyard with auth off, or (`realistic`) with auth on and a key under the
    realistic scenario's limits (bench/realistic.py); its key is `gw.bench_key`."""
    from switchyard.api.app import create_app
    from switchyard.config import parse_settings

    settings = parse_settings(
        {
            "models": [
                {
                    "alias": MODEL,
                    "revision": "scripted-v1",
                    "engine": {"kind": "openai", "base_url": "http://127.0.0.1:9/v1"},
                }
            ],
            "embeddings": {"enabled": False},
            "auth": {"mode": "keys" if realistic else "disabled", "bootstrap_dev_key": False},
            "storage": {"sqlite_path": str(workdir / "hotpath.db")},
        },
        "hotpath",
    )
    app = create_app(settings)
    gw = app.state.gateway
    gw.start()
    gw.bench_key = None
    if realistic:
        gw.keys.create_tenant(TENANT, **TENANT_LIMITS)
        gw.bench_key = gw.keys.create_key(TENANT, **KEY_LIMITS)["key"]

    async def instant(*_args: Any, **_kwargs: Any) -> UpstreamReply:
        return UpstreamReply(200, reply, {"content-type": "application/json"})

    for dep in gw.registry.deployments.values():
        dep.upstream.post = instant
    # Count-based batching, so every run does the same work in the same order.
    gw.ledger.flush_s = 1e9
    if gw.metrics is not None:
        gw.metrics.fold_s = 1e9
    gen0, gen1, gen2 = gc.get_threshold()
    gc.set_threshold(max(gen0, 7000), gen1, gen2)  # as the served app's lifespan does
    return app, gw


def _floor_app(reply: bytes) -> App:
    from switchyard.bench import passthrough_proxy

    class Reply:
        status = 200
        headers = {"Content-Type": "application/json"}

        async def read(self) -> bytes:
            return reply

        def release(self) -> None:
            pass

    class Session:
        async def post(self, *_args: Any, **_kwargs: Any) -> Reply:
            return Reply()

    app = passthrough_proxy.create_app("http://127.0.0.1:9/v1", bare=True)
    app.state.session = Session()
    return app


async def _measure(app: App, driver: Driver, requests: int, blocks: int) -> list[float]:
    """CPU microseconds per request of each block."""
    await driver.drive(app, max(200, requests // 10))  # warm-up
    gc.collect()
    per = max(1, requests // blocks)
    out = []
    for _ in range(blocks):
        t = time.process_time()
        await driver.drive(app, per)
        out.append((time.process_time() - t) / per * 1e6)
    driver.check()
    return out


def _folds(gw: Any) -> Callable[[int], None]:
    def each(i: int) -> None:
        if gw.metrics is not None and i % METRICS_FOLD_EVERY == METRICS_FOLD_EVERY - 1:
            gw.metrics.fold()

    return each


async def _switchyard_us(args: argparse.Namespace, realistic: bool) -> list[float]:
    reply, body = _reply(args.tokens), chat_body(False, args.tokens)
    with tempfile.TemporaryDirectory() as tmp:
        app, gw = await _switchyard_app(Path(tmp), reply, realistic)
        driver = Driver(body)
        if gw.bench_key is not None:
            driver.headers.append((b"authorization", f"Bearer {gw.bench_key}".encode()))
        driver.on_each = _folds(gw)
        try:
            return await _measure(app, driver, args.requests, args.blocks)
        finally:
            await gw.stop()


async def _timed(args: argparse.Namespace) -> dict[str, Any]:
    reply, body = _reply(args.tokens), chat_body(False, args.tokens)
    sy = await _switchyard_us(args, realistic=False)
    real = await _switchyard_us(args, realistic=True)
    floor = await _measure(_floor_app(reply), Driver(body), args.requests, args.blocks)
    return {
        "switchyard_us": {"min": min(sy), "median": statistics.median(sy), "blocks": sy},
        "realistic_us": {"min": min(real), "median": statistics.median(real), "blocks": real},
        "floor_us": {"min": min(floor), "median": statistics.median(floor), "blocks": floor},
    }


async def _counted(target: str, requests: int, tokens: int) -> None:
    """The body of one callgrind run: start the target, then answer `requests`."""
    reply, body = _reply(tokens), chat_body(False, tokens)
    driver = Driver(body)
    with tempfile.TemporaryDirectory() as tmp:
        if target == "switchyard":
            app, gw = await _switchyard_app(Path(tmp), reply)
            driver.on_each = _folds(gw)
            try:
                await driver.drive(app, requests)
            finally:
                await gw.stop()
        else:
            await driver.drive(_floor_app(reply), requests)
    driver.check()


def _callgrind_total(valgrind: str, target: str, requests: int, tokens: int, tmp: Path) -> int:
    out = tmp / f"cg-{target}-{requests}.out"
    cmd = [
        valgrind,
        "--tool=callgrind",
        f"--callgrind-out-file={out}",
        sys.executable,
        "-m",
        "switchyard.bench.hotpath",
        "--count-run",
        target,
        "--requests",
        str(requests),
        "--tokens",
        str(tokens),
    ]
    env = {**os.environ, "PYTHONHASHSEED": "0"}  # same dict layouts in every run
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=3600)
    if done.returncode != 0:
        raise RuntimeError(f"callgrind run failed ({done.returncode}):\n{done.stderr[-2000:]}")
    m = re.search(r"^(?:summary|totals):\s+(\d+)", out.read_text(), re.M)
    if m is None:
        raise RuntimeError(f"no instruction total in {out}")
    return int(m.group(1))


def _instructions(args: argparse.Namespace) -> dict[str, Any] | None:
    valgrind = shutil.which("valgrind")
    if valgrind is None:
        print("valgrind not found: instruction counts skipped", file=sys.stderr)
        return None
    n = args.count_requests
    out: dict[str, Any] = {"requests": [n, 2 * n]}
    with tempfile.TemporaryDirectory() as tmp:
        for target in ("switchyard", "floor"):
            low = _callgrind_total(valgrind, target, n, args.tokens, Path(tmp))
            high = _callgrind_total(valgrind, target, 2 * n, args.tokens, Path(tmp))
            out[target] = round((high - low) / n)
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--requests", type=int, default=20000, help="timed requests per app")
    parser.add_argument("--blocks", type=int, default=10, help="blocks to take min/median of")
    parser.add_argument("--tokens", type=int, default=16, help="tokens in the instant reply")
    parser.add_argument(
        "--instructions",
        action="store_true",
        help="also count instructions per request under valgrind's callgrind (slow: minutes)",
    )
    parser.add_argument(
        "--count-requests", type=int, default=1000, help="N for the callgrind runs (N and 2N)"
    )
    parser.add_argument("--out", default=None, help="result file (default bench-results/...)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    timed = asyncio.run(_timed(args))
    counted = _instructions(args) if args.instructions else None
    sy, real, fl = timed["switchyard_us"], timed["realistic_us"], timed["floor_us"]
    lines = [
        f"hot path, {args.requests} requests per app, in one process, no network "
        f"(CPU us per request, min / median of {args.blocks} blocks)",
        f"  switchyard  {sy['min']:8.1f} / {sy['median']:8.1f}   (auth off)",
        f"  realistic   {real['min']:8.1f} / {real['median']:8.1f}   (a key under the realistic "
        "scenario's limits, traces on)",
        f"  floor       {fl['min']:8.1f} / {fl['median']:8.1f}",
        f"  switchyard's own work (min - min): {sy['min'] - fl['min']:.1f} us",
    ]
    if counted is not None:
        lines.append(
            f"  instructions per request: switchyard {counted['switchyard']:,}, "
            f"floor {counted['floor']:,}, own {counted['switchyard'] - counted['floor']:,}"
        )
    print("\n".join(lines))
    result = {
        "bench": "hotpath",
        "when": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": {
            "cpu_count": os.cpu_count(),
            "python": platform.python_version(),
            "kernel": platform.release(),
        },
        "workload": {"requests": args.requests, "blocks": args.blocks, "tokens": args.tokens},
        "timed": timed,
        "instructions": counted,
    }
    out = Path(args.out or f"bench-results/hotpath-{time.strftime('%Y%m%d-%H%M%S')}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"results: {out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m switchyard.bench.hotpath")
    add_arguments(ap)
    ap.add_argument("--count-run", choices=("switchyard", "floor"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.count_run:
        asyncio.run(_counted(args.count_run, args.requests, args.tokens))
        return 0
    return run(args)


if __name__ == "__main__":
    raise SystemExit(main())
