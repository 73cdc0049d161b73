"""`switchyard bench tools`: what a governed `tools/call` through Switchyard's `/mcp` adds
over calling the MCP server directly.

One MCP server (bench/mcp_echo_server.py, the official SDK over Streamable HTTP with JSON
replies) is called two ways in interleaved rounds, with the order rotated, so drift on
the machine hits both alike:

- `direct`: the server's own `/mcp`;
- `floor`: a proxy that only forwards (bench/mcp_floor_proxy.py, the same server stack
  and HTTP client as the gateway), the hop every Python proxy pays;
- `switchyard`: Switchyard's `/mcp` in front of it, governed: an API key under a tenant,
  the tool registry, per-call authorization, a usage row and a trace per call (PII-masked
  arguments and result), and, for the side-effecting tool, its at-most-once record in
  SQLite (a claim, then the stored result).

Each client holds its own MCP session (the 2025-11-25 handshake, then one POST per call,
keep-alive), `-c` of them at once, each calling as fast as answers come (closed loop).
Reported per target, tool and concurrency: p50 and p99 of the call's latency as the
client saw it, calls per second, and Switchyard's added p50 and p99 over direct (and the
floor's, so what is the hop and what the gateway's own can be told apart). Medians
across rounds. Target: added p50 at most 1 ms at concurrency 1 (the read-only tool).

Latency on a shared machine is noisy, so each row also has the CPU time per call of the
processes on the path (user + system, from the OS, children included): the gateway's
(`gateway_cpu_ms`, switchyard rows) and the tool server's (`tool_cpu_ms`). CPU time does
not wait for a busy core, so it compares runs on a loaded machine where latency cannot.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import psutil
import yaml

from switchyard.bench.harness import (
    StartError,
    admin_headers,
    free_port,
    machine_info,
    prepare_keyed_gateway,
    spawn,
    start_gateway,
    stop_all,
)

VERSION = "2025-11-25"
ACCEPT = "application/json, text/event-stream"
TOOLS = {"read_only": "echo", "side_effect": "record"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--calls", type=int, default=400, help="calls per target, round and c")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (medians)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--startup-timeout", type=float, default=60.0, help="seconds")
    parser.add_argument("--out", default=None, help="JSON result path")
    parser.set_defaults(func=main)


class McpClient:
    """One MCP session over plain HTTP (the load generator must cost the same per call
    for both targets, and little)."""

    def __init__(self, http: httpx.AsyncClient, url: str, key: str | None) -> None:
        self.http = http
        self.url = url
        self.headers = {"accept": ACCEPT, "content-type": "application/json"}
        if key is not None:
            self.headers["authorization"] = f"Bearer {key}"
        self.n = 0

    async def open(self) -> None:
        r = await self._post(
            "initialize",
            {
                "protocolVersion": VERSION,
                "capabilities": {},
                "clientInfo": {"name": "switchyard-bench", "version": "1"},
            },
        )
        sid = r.headers.get("mcp-session-id")
        if sid is None:
            raise StartError(f"{self.url}: no session id ({r.status_code})")
        self.headers["mcp-session-id"] = sid
        self.headers["mcp-protocol-version"] = VERSION
        note = {"jsonrpc": "2.0", "method": "notifications/initialized"}
        await self.http.post(self.url, content=json.dumps(note), headers=self.headers)

    async def close(self) -> None:
        """End the session (a key may hold only so many open on the gateway)."""
        if "mcp-session-id" in self.headers:
            await self.http.delete(self.url, headers=self.headers)

    async def _post(self, method: str, params: dict[str, Any]) -> httpx.Response:
        self.n += 1
        body = {"jsonrpc": "2.0", "id": self.n, "method": method, "params": params}
        r = await self.http.post(self.url, content=json.dumps(body), headers=self.headers)
        if r.status_code != 200 or b'"error"' in r.content[:200]:
            raise StartError(f"{self.url} {method}: {r.status_code} {r.text[:300]}")
        return r

    async def call(self, tool: str, text: str, meta: dict[str, Any] | None = None) -> float:
        params: dict[str, Any] = {"name": tool, "arguments": {"text": text}}
        if meta is not None:
            params["_meta"] = meta
        t = time.perf_counter()
        await self._post("tools/call", params)
        return time.perf_counter() - t


async def measure(url: str, key: str | None, tool: str, calls: int, c: int) -> dict[str, Any]:
    """`calls` calls by `c` clients at once; each side-effecting call has a fresh id."""
    limits = httpx.Limits(max_connections=c, max_keepalive_connections=c)
    async with httpx.AsyncClient(limits=limits, timeout=30) as http:
        clients = [McpClient(http, url, key) for _ in range(c)]
        await asyncio.gather(*(cl.open() for cl in clients))
        side = tool.endswith("record")
        for cl in clients:  # warm-up
            await cl.call(tool, "warm", {"call_id": uuid.uuid4().hex} if side else None)
        samples: list[float] = []

        async def worker(cl: McpClient, n: int) -> None:
            for _ in range(n):
                meta = {"call_id": "call_sy_" + uuid.uuid4().hex} if side else None
                samples.append(await cl.call(tool, "hello, bench", meta))

        t = time.perf_counter()
        await asyncio.gather(*(worker(cl, calls // c) for cl in clients))
        wall = time.perf_counter() - t
        await asyncio.gather(*(cl.close() for cl in clients))
    samples.sort()
    return {
        "n": len(samples),
        "p50_ms": 1000 * samples[len(samples) // 2],
        "p99_ms": 1000 * samples[min(len(samples) - 1, int(len(samples) * 0.99))],
        "calls_per_s": len(samples) / wall,
    }


def cpu_s(pid: int | None) -> float:
    """User + system CPU seconds of a process and its children (0 without a pid)."""
    if pid is None:
        return 0.0
    try:
        procs = [psutil.Process(pid)]
        procs += procs[0].children(recursive=True)
    except psutil.Error:
        return 0.0
    total = 0.0
    for p in procs:
        try:
            t = p.cpu_times()
        except psutil.Error:
            continue
        total += t.user + t.system
    return total


def _wait(pred: Any, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if pred():
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise StartError(f"{what} not ready after {timeout_s:.0f} s")


def main(args: argparse.Namespace) -> int:
    workdir = Path(tempfile.mkdtemp(prefix="sy-bench-tools-"))
    children = []
    try:
        tool_port = free_port()
        children.append(
            spawn(
                "mcp-echo",
                [
                    *(sys.executable, "-m", "switchyard.bench.mcp_echo_server"),
                    *("--port", str(tool_port)),
                ],
                workdir,
            )
        )
        direct = f"http://127.0.0.1:{tool_port}/mcp"
        tool_pid = children[0].proc.pid
        _wait(lambda: httpx.get(direct, timeout=1) is not None, 30, "the MCP server")
        floor_port = free_port()
        floor_argv = [sys.executable, "-m", "switchyard.bench.mcp_floor_proxy"]
        floor_argv += ["--port", str(floor_port), "--upstream", direct]
        children.append(spawn("mcp-floor", floor_argv, workdir))
        floor = f"http://127.0.0.1:{floor_port}/mcp"
        floor_pid = children[-1].proc.pid
        _wait(lambda: httpx.get(floor, timeout=1) is not None, 30, "the floor proxy")
        gw = prepare_keyed_gateway(
            "sy-tools", workdir, free_port(), "bench-tools", {}, args.startup_timeout
        )
        cfg = yaml.safe_load(gw.config.read_text())
        # Slots for every client at once: the path is measured, not the server's limit.
        slots = max(args.concurrency)
        cfg["mcp"] = {"servers": [{"name": "bench", "url": direct, "max_concurrency": slots}]}
        cfg["tools"] = {
            "registry": [
                {"name": "bench__echo", "class": "read_only"},
                {"name": "bench__record", "class": "side_effect"},
            ]
        }
        gw.config.write_text(yaml.safe_dump(cfg, sort_keys=False))
        children.append(start_gateway(gw.name, gw.config, gw.port, workdir))
        gateway_pid = children[-1].proc.pid
        base = f"http://127.0.0.1:{gw.port}"

        def tools_ready() -> bool:
            r = httpx.get(base + "/readyz", headers=admin_headers(), timeout=2)
            return bool(r.json()["models"].get("mcp:bench", {}).get("ready"))

        _wait(tools_ready, args.startup_timeout, "switchyard's tool server")
        targets = {
            "direct": (direct, None, ""),
            "floor": (floor, None, ""),
            "switchyard": (base + "/mcp", gw.key, "bench__"),
        }
        runs: dict[tuple[str, str, int], list[dict[str, Any]]] = {}
        order = list(targets)
        for r in range(args.rounds):
            for name in order[r % 3 :] + order[: r % 3]:
                url, key, prefix = targets[name]
                for cls, tool in TOOLS.items():
                    for c in args.concurrency:
                        gw0 = {"switchyard": cpu_s(gateway_pid), "floor": cpu_s(floor_pid)}
                        tool0 = cpu_s(tool_pid)
                        got = asyncio.run(measure(url, key, prefix + tool, args.calls, c))
                        n = max(1, got["n"])
                        got["tool_cpu_ms"] = 1000 * (cpu_s(tool_pid) - tool0) / n
                        if name != "direct":
                            pid = gateway_pid if name == "switchyard" else floor_pid
                            got["gateway_cpu_ms"] = 1000 * (cpu_s(pid) - gw0[name]) / n
                        runs.setdefault((name, cls, c), []).append(got)
        result = report(runs, args)
    except StartError as exc:
        print(f"bench tools: {exc}")
        for ch in children:
            print(f"--- {ch.name}:\n{ch.log.read_text(errors='replace')[-2000:]}")
        return 1
    finally:
        stop_all(children)
    print(render(result))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))
    return 0


def report(runs: dict[tuple[str, str, int], list[dict[str, Any]]], args: Any) -> dict[str, Any]:
    """Medians across rounds, and Switchyard's added latency over direct."""
    rows = []
    for (target, cls, c), got in sorted(runs.items()):
        rows.append(
            {
                "target": target,
                "tool_class": cls,
                "concurrency": c,
                "n": sum(g["n"] for g in got),
                **{
                    k: round(statistics.median(g[k] for g in got), 3)
                    for k in ("p50_ms", "p99_ms", "calls_per_s", "tool_cpu_ms", "gateway_cpu_ms")
                    if all(k in g for g in got)
                },
            }
        )
    by = {(r["target"], r["tool_class"], r["concurrency"]): r for r in rows}
    added = [
        {
            "target": target,
            "tool_class": cls,
            "concurrency": c,
            "added_p50_ms": round(by[(target, cls, c)]["p50_ms"] - d["p50_ms"], 3),
            "added_p99_ms": round(by[(target, cls, c)]["p99_ms"] - d["p99_ms"], 3),
        }
        for target in ("switchyard", "floor")
        for (t, cls, c), d in by.items()
        if t == "direct" and (target, cls, c) in by
    ]
    return {
        "bench": "tools",
        "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "calls": args.calls,
        "rounds": args.rounds,
        "rows": rows,
        "added": added,
        "target_added_p50_ms": 1.0,  # switchyard over direct
        "machine": machine_info("wrk"),
    }


def render(result: dict[str, Any]) -> str:
    lines = [
        "target      class        c   p50 ms   p99 ms   calls/s  tool cpu ms/call  hop cpu ms/call"
    ]
    for r in result["rows"]:
        gw_cpu = r.get("gateway_cpu_ms")
        lines.append(
            f"{r['target']:<11} {r['tool_class']:<11} {r['concurrency']:>3} "
            f"{r['p50_ms']:>8.3f} {r['p99_ms']:>8.3f} {r['calls_per_s']:>9.1f} "
            f"{r.get('tool_cpu_ms', 0.0):>17.3f} "
            + (f"{gw_cpu:>15.3f}" if gw_cpu is not None else f"{'-':>15}")
        )
    lines.append("added over direct (p50 / p99 ms):")
    for a in result["added"]:
        lines.append(
            f"  {a.get('target', 'switchyard'):<11} {a['tool_class']:<11} c={a['concurrency']:<3} "
            f"{a['added_p50_ms']:+.3f} / {a['added_p99_ms']:+.3f}"
        )
    return "\n".join(lines)
