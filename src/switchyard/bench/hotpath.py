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

With `--protocols`, the same request on each client protocol, streamed and not, on
the realistic key: chat completions (`realistic`, `chat-stream`), the Responses API
stored as its default (`responses`, `responses-stream`) and Anthropic Messages
(`messages`, `messages-stream`), with bench/protocols.py's bodies; the upstream answers
a stream as the scripted upstream does (a chunk per token, each its own read, then the
finish, the usage and `[DONE]`). What each protocol costs beyond chat is its ratio to
the chat target of its kind, in instructions.

Beside them, one stage timed on its own: the duplicate-key check every JSON body
passes (api/body.py), on a realistic agent chat body rather than the driven tiny one
(bench/hotpath_stages.py). The targets' table is bench/hotpath_targets.py.

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

import orjson

from switchyard.bench.governed import TOOL_CALLS
from switchyard.bench.harness import CHAT_PATH, MODEL, chat_body
from switchyard.bench.hotpath_stages import AGENT_CHAT as AGENT_CHAT  # tests read it here
from switchyard.bench.hotpath_stages import duplicate_key_check_us
from switchyard.bench.hotpath_targets import CHAT_OF, MODELS, PROTOCOL_TARGETS, PROTOCOLS, TARGETS
from switchyard.bench.realistic import KEY_LIMITS, TENANT, TENANT_LIMITS
from switchyard.bench.scripted_upstream import WORDS
from switchyard.engines.upstream import UpstreamReply

METRICS_FOLD_EVERY = 64

App = Callable[[dict[str, Any], Any, Any], Awaitable[None]]


def _reply(tokens: int, finish: str = "length") -> bytes:
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
                "finish_reason": finish,
            }
        ],
        "usage": {"prompt_tokens": 9, "completion_tokens": tokens, "total_tokens": 9 + tokens},
    }
    return json.dumps(body, separators=(",", ":")).encode()


def _tool_reply(tokens: int) -> bytes:
    """The governed mode's reply: the two tool calls bench/governed.py's upstream makes."""
    body = json.loads(_reply(tokens))
    body["choices"][0]["message"] = {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": f"call_{i}",
                "type": "function",
                "function": {"name": name, "arguments": '{"q": "x"}'},
            }
            for i, name in enumerate(TOOL_CALLS.split(","))
        ],
    }
    body["choices"][0]["finish_reason"] = "tool_calls"
    return json.dumps(body, separators=(",", ":")).encode()


def _stream_reads(tokens: int) -> list[list[bytes]]:
    """A streamed reply as the gateway's upstream client hands it over (the data of
    each network read's events): a chunk per token as the scripted upstream sends
    them, each its own read, the finish chunk, then the usage chunk and `[DONE]`
    together (bench overhead's upstream writes those two at once)."""

    def chunk(choices: list[dict[str, Any]], **extra: Any) -> bytes:
        return orjson.dumps(
            {
                "id": "chatcmpl-hotpath",
                "object": "chat.completion.chunk",
                "created": 1,
                "model": MODEL,
                "choices": choices,
                **extra,
            }
        )

    reads = []
    for i in range(tokens):
        word = WORDS[i % len(WORDS)]
        delta = {"role": "assistant", "content": word} if i == 0 else {"content": word}
        reads.append(
            [chunk([{"index": 0, "delta": delta, "logprobs": None, "finish_reason": None}])]
        )
    reads.append([chunk([{"index": 0, "delta": {}, "logprobs": None, "finish_reason": "stop"}])])
    usage = {"prompt_tokens": 9, "completion_tokens": tokens, "total_tokens": 9 + tokens}
    reads.append([chunk([], usage=usage), b"[DONE]"])
    return reads


class _InstantStream:
    """An upstream stream whose reads are all there at once (engines/upstream.py's
    UpstreamStream, less the socket)."""

    headers = {"content-type": "text/event-stream"}

    def __init__(self, reads: list[list[bytes]]) -> None:
        self._reads = reads

    async def data(self) -> Any:
        for read in self._reads:
            yield read

    def close(self, complete: bool = False) -> None:
        pass


class Driver:
    """Calls an ASGI app as uvicorn would for one keep-alive client, and checks that
    every request was answered 200 (a broken path must not look fast)."""

    def __init__(self, body: bytes, path: str = CHAT_PATH) -> None:
        self.body = body
        self.path = path
        self.headers = [
            (b"host", b"127.0.0.1:8000"),
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
        ]
        self.statuses: dict[int, int] = {}
        # When set, every reply must contain it in one of its body writes (the governed
        # mode: the side-effecting call's idempotency key; a stream: its last event),
        # so a path that skips the work fails.
        self.expect: bytes | None = None
        self.missing = 0
        self._seen = False
        self._received = False
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
            "path": self.path,
            "raw_path": self.path.encode(),
            "query_string": b"",
            "headers": self.headers,
            "state": {},
        }

    async def receive(self) -> dict[str, Any]:
        if self._received:  # as uvicorn: nothing more until the client leaves
            await asyncio.get_running_loop().create_future()
        self._received = True
        return {"type": "http.request", "body": self.body, "more_body": False}

    async def send(self, message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            status = int(message["status"])
            self.statuses[status] = self.statuses.get(status, 0) + 1
        elif self.expect is not None and self.expect in message.get("body", b""):
            self._seen = True

    async def drive(self, app: App, n: int) -> None:
        for i in range(n):
            if self.on_each is not None:
                self.on_each(i)
            self._seen = self._received = False
            await app(self.scope(), self.receive, self.send)
            if self.expect is not None and not self._seen:
                self.missing += 1
            await asyncio.sleep(0)  # let the loop run what the request scheduled

    def check(self) -> None:
        bad = {s: c for s, c in self.statuses.items() if s != 200}
        if bad:
            raise RuntimeError(f"requests were not answered 200: {bad}")
        if self.missing:
            raise RuntimeError(f"{self.missing} replies lacked {self.expect!r}")


async def _switchyard_app(
    workdir: Path,
    reply: bytes,
    realistic: bool = False,
    tools: dict[str, Any] | None = None,
    model: dict[str, Any] | None = None,
    stream_tokens: int = 16,
) -> tuple[App, Any]:
    """Switchyard with auth off, or (`realistic`) with auth on and a key under the
    realistic scenario's limits (bench/realistic.py); its key is `gw.bench_key`.
    `tools` is its `tools` config (the governed mode's); `model` adds to the model's
    config (the placement mode's deployments). A streamed request is answered with
    `stream_tokens` tokens (`_stream_reads`)."""
    from switchyard.api.app import create_app
    from switchyard.config import parse_settings

    raw: dict[str, Any] = {
        "models": [
            {
                "alias": MODEL,
                "revision": "scripted-v1",
                "engine": {"kind": "openai", "base_url": "http://127.0.0.1:9/v1"},
                **(model or {}),
            }
        ],
        "embeddings": {"enabled": False},
        "auth": {"mode": "keys" if realistic else "disabled", "bootstrap_dev_key": False},
        "storage": {"sqlite_path": str(workdir / "hotpath.db")},
    }
    if tools is not None:
        raw["tools"] = tools
    settings = parse_settings(raw, "hotpath")
    app = create_app(settings)
    gw = app.state.gateway
    gw.start()
    gw.bench_key = None
    if realistic:
        gw.keys.create_tenant(TENANT, **TENANT_LIMITS)
        gw.bench_key = gw.keys.create_key(TENANT, **KEY_LIMITS)["key"]

    async def instant(*_args: Any, **_kwargs: Any) -> UpstreamReply:
        return UpstreamReply(200, reply, {"content-type": "application/json"})

    async def instant_stream(*_args: Any, **_kwargs: Any) -> _InstantStream:
        return _InstantStream(reads)

    reads = _stream_reads(stream_tokens)
    for dep in gw.registry.every():
        dep.upstream.post = instant
        dep.upstream.stream = instant_stream
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


async def _started(
    target: str, workdir: Path, tokens: int, protocols: bool = False
) -> tuple[App, Any, Driver]:
    """The target's app and a driver for it (its key and headers set). `protocols`:
    the protocols mode's request (its upstream finishes with `stop`, as bench
    overhead's does, so a Responses reply is `completed`)."""
    realistic, tools, headers, calls = TARGETS[target]
    protocols = protocols or (target in PROTOCOLS and target != "realistic")
    reply = _tool_reply(tokens) if calls else _reply(tokens, "stop" if protocols else "length")
    app, gw = await _switchyard_app(workdir, reply, realistic, tools, MODELS.get(target), tokens)
    path, body, stream, expect = PROTOCOLS[target] if protocols else PROTOCOLS["realistic"]
    driver = Driver(body(stream, tokens), path)
    driver.expect = expect
    if gw.bench_key is not None:
        if path == "/v1/messages":
            headers = {**headers, "x-api-key": gw.bench_key, "anthropic-version": "2023-06-01"}
        else:
            driver.headers.append((b"authorization", f"Bearer {gw.bench_key}".encode()))
    driver.headers += [(k.encode(), v.encode()) for k, v in headers.items()]
    driver.on_each = _folds(gw)
    if target == "governed":
        driver.expect = b'"id":"call_sy_'
    return app, gw, driver


async def _switchyard_us(args: argparse.Namespace, target: str) -> list[float]:
    with tempfile.TemporaryDirectory() as tmp:
        app, gw, driver = await _started(target, Path(tmp), args.tokens, args.protocols)
        try:
            return await _measure(app, driver, args.requests, args.blocks)
        finally:
            await gw.stop()


def _targets(args: argparse.Namespace) -> list[str]:
    if args.protocols:
        return PROTOCOL_TARGETS
    if args.placement:
        return ["balanced", "placed"]
    return ["gov-off", "governed"] if args.governed else ["switchyard", "realistic"]


async def _timed(args: argparse.Namespace) -> dict[str, Any]:
    reply, body = _reply(args.tokens), chat_body(False, args.tokens)
    out: dict[str, Any] = {}
    for target in _targets(args):
        us = await _switchyard_us(args, target)
        out[f"{target}_us"] = {"min": min(us), "median": statistics.median(us), "blocks": us}
    floor = await _measure(_floor_app(reply), Driver(body), args.requests, args.blocks)
    out["floor_us"] = {"min": min(floor), "median": statistics.median(floor), "blocks": floor}
    return out


async def _counted(target: str, requests: int, tokens: int, protocols: bool = False) -> None:
    """The body of one callgrind run: start the target, then answer `requests`."""
    if target == "floor":
        driver = Driver(chat_body(False, tokens))
        await driver.drive(_floor_app(_reply(tokens)), requests)
    else:
        with tempfile.TemporaryDirectory() as tmp:
            app, gw, driver = await _started(target, Path(tmp), tokens, protocols)
            try:
                await driver.drive(app, requests)
            finally:
                await gw.stop()
    driver.check()


def _callgrind_total(
    valgrind: str, target: str, requests: int, tokens: int, tmp: Path, protocols: bool = False
) -> int:
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
        *(["--protocols"] if protocols else []),
    ]
    env = {
        **os.environ,
        "PYTHONHASHSEED": "0",  # same dict layouts in every run
        # One BLAS thread: an idle OpenBLAS worker (numpy is imported) spins for a
        # while after each use, adding ±20k instructions a request at random.
        "OPENBLAS_NUM_THREADS": "1",
        "OMP_NUM_THREADS": "1",
    }
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
        for target in (*_targets(args), "floor"):
            low = _callgrind_total(valgrind, target, n, args.tokens, Path(tmp), args.protocols)
            high = _callgrind_total(valgrind, target, 2 * n, args.tokens, Path(tmp), args.protocols)
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
    parser.add_argument(
        "--governed",
        action="store_true",
        help="measure bench overhead's governed scenario instead: the realistic key with a "
        "tool-call reply, tool checks off (gov-off) vs a tool registry and a task budget "
        "on every request (governed)",
    )
    parser.add_argument(
        "--placement",
        action="store_true",
        help="measure placement instead: the realistic key on two deployments of one alias, "
        "balanced without (balanced) and with a placement policy (placed)",
    )
    parser.add_argument(
        "--protocols",
        action="store_true",
        help="measure the client protocols instead: the realistic key's request as chat "
        "completions, Responses (stored) and Messages, each streamed and not; each one's "
        "ratio to the chat target of its kind",
    )
    parser.add_argument("--out", default=None, help="result file (default bench-results/...)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    timed = asyncio.run(_timed(args))
    # Stages timed on their own, outside the driven apps.
    stages = {"duplicate_key_check_us": duplicate_key_check_us(args.requests, args.blocks)}
    counted = _instructions(args) if args.instructions else None
    fl = timed["floor_us"]
    notes = {
        "switchyard": "(auth off)",
        "realistic": "(a key under the realistic scenario's limits, traces on)",
        "gov-off": "(realistic key, tool-call reply, tool checks off, no task)",
        "governed": "(realistic key, tool-call reply, tool registry, task budget)",
        "balanced": "(realistic key, two deployments, least outstanding)",
        "placed": "(the same with a placement policy: device state, estimates)",
        "chat-stream": "(realistic key, chat completions, streamed)",
        "responses": "(realistic key, /v1/responses, stored)",
        "responses-stream": "(realistic key, /v1/responses, stored, streamed)",
        "messages": "(realistic key, /v1/messages)",
        "messages-stream": "(realistic key, /v1/messages, streamed)",
    }
    lines = [
        f"hot path, {args.requests} requests per app, in one process, no network "
        f"(CPU us per request, min / median of {args.blocks} blocks)"
    ]
    for target in _targets(args):
        t = timed[f"{target}_us"]
        lines.append(f"  {target:<16} {t['min']:8.1f} / {t['median']:8.1f}   {notes[target]}")
    lines.append(f"  {'floor':<16} {fl['min']:8.1f} / {fl['median']:8.1f}")
    first = _targets(args)[0]
    lines.append(
        f"  {first}'s own work (min - min): {timed[first + '_us']['min'] - fl['min']:.1f} us"
    )
    dup = stages["duplicate_key_check_us"]
    lines.append(
        f"  duplicate-key check: {dup['min']:.2f} / {dup['median']:.2f} us per request "
        f"on a {dup['body_bytes']}-byte agent chat body (orjson's parse of it: "
        f"{dup['parse_min']:.2f} us)"
    )
    if args.governed or args.placement:
        a, b = _targets(args)
        on, off = timed[f"{b}_us"]["min"], timed[f"{a}_us"]["min"]
        lines.append(f"  {b} / {a} (min): {on / off:.2f}x")
    if args.protocols:
        for target in PROTOCOL_TARGETS:
            base = CHAT_OF[target]
            if target != base:
                on, off = timed[f"{target}_us"]["min"], timed[f"{base}_us"]["min"]
                lines.append(f"  {target} / {base} (min): {on / off:.2f}x")
    if counted is not None:
        parts = [f"{t} {counted[t]:,}" for t in (*_targets(args), "floor")]
        lines.append("  instructions per request: " + ", ".join(parts))
        if args.protocols:
            for target in PROTOCOL_TARGETS:
                base = CHAT_OF[target]
                if target != base:
                    ratio = counted[target] / counted[base]
                    lines.append(f"  {target} / {base} (instructions): {ratio:.3f}x")
        if args.governed or args.placement:
            a, b = _targets(args)
            lines.append(f"  {b} / {a} (instructions): {counted[b] / counted[a]:.3f}x")
    print("\n".join(lines))
    result = {
        "bench": "hotpath",
        "when": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": {
            "cpu_count": os.cpu_count(),
            "python": platform.python_version(),
            "kernel": platform.release(),
        },
        "workload": {
            "requests": args.requests,
            "blocks": args.blocks,
            "tokens": args.tokens,
            "targets": _targets(args),
        },
        "timed": timed,
        "stages": stages,
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
    ap.add_argument("--count-run", choices=(*TARGETS, "floor"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.count_run:
        asyncio.run(_counted(args.count_run, args.requests, args.tokens, args.protocols))
        return 0
    return run(args)


if __name__ == "__main__":
    raise SystemExit(main())
