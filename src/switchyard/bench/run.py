"""`switchyard bench run`: drive an OpenAI-compatible endpoint and report what it did.

Works against any endpoint (Switchyard or a model server directly), so the gateway and
the direct path are measured the same way. One run is one or more load points (a sweep
over rates or concurrencies), each with its own records and summary; everything lands in
one JSON result, with plots next to it. See docs/benchmarks/index.md for the definitions.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import orjson
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from switchyard.bench import agent, load, media, report, tokens, workloads
from switchyard.bench.metrics import RequestRecord, Slo, parse_slo, summarize


def _numbers(kind: type[float] | type[int]) -> Callable[[str], list[Any]]:
    def parse(text: str) -> list[Any]:
        try:
            values = [kind(v) for v in text.split(",") if v.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r}: comma-separated numbers") from None
        if not values or any(v <= 0 for v in values):
            raise argparse.ArgumentTypeError(f"{text!r}: positive numbers")
        return values

    return parse


def add_run_arguments(p: argparse.ArgumentParser) -> None:
    t = p.add_argument_group("target")
    t.add_argument(
        "--endpoint", default=None, help="base URL, e.g. http://127.0.0.1:8000 (required)"
    )
    t.add_argument("--model", default=None, help="(required)")
    t.add_argument(
        "--api-key", default=None, help="default: $SWITCHYARD_API_KEY, else $OPENAI_API_KEY"
    )
    t.add_argument("--api", choices=("chat", "completions"), default="chat")
    t.add_argument("--header", action="append", default=[], help="extra 'Name: value' header")
    t.add_argument("--timeout", type=float, default=300.0, help="seconds per request")
    t.add_argument(
        "--no-usage", action="store_true", help="do not send stream_options.include_usage"
    )
    ld = p.add_argument_group("load")
    mode = ld.add_mutually_exclusive_group()
    mode.add_argument("--concurrency", type=_numbers(int), help="closed loop: N or N1,N2,...")
    mode.add_argument("--rate", type=_numbers(float), help="open loop req/s (tasks/s): R or R1,R2")
    ld.add_argument("--arrival", choices=("poisson", "gamma", "constant"), default="poisson")
    ld.add_argument("--burstiness", type=float, default=1.0, help="gamma shape; 1 = Poisson")
    ld.add_argument(
        "--ramp-up", type=float, default=0.0, help="seconds; requests in it are warm-up"
    )
    stop = ld.add_mutually_exclusive_group()
    stop.add_argument("--num-requests", type=int, help="measured requests (tasks) per point")
    stop.add_argument("--duration", type=float, help="measured seconds per point")
    ld.add_argument("--warmup", type=int, default=0, help="requests (tasks) excluded first")
    w = p.add_argument_group("workload (synthetic unless a file is given)")
    src = w.add_mutually_exclusive_group()
    src.add_argument("--prompts", help="JSONL: {prompt|messages, max_tokens?} per line")
    src.add_argument("--sharegpt", help="ShareGPT-format JSON")
    src.add_argument("--agent-tasks", help="YAML/JSON task graphs (steps, depends_on)")
    w.add_argument(
        "--mcp-url",
        default=None,
        help="with --agent-tasks: where tool steps go as MCP tools/call (default: "
        "ENDPOINT/mcp, the gateway's MCP endpoint)",
    )
    w.add_argument(
        "--schedulers",
        default=None,
        metavar="fcfs,task_aware",
        help="with --agent-tasks FILE holding a 'scheduling:' section: start the scripted "
        "upstream and a gateway per scheduler and send each the same arrivals "
        "(bench/scheduling.py; --endpoint and --model are not used; --duration overrides "
        "the file's measured seconds per point)",
    )
    w.add_argument(
        "--interactive-priority",
        choices=("interactive", "standard", "batch"),
        default=None,
        help="with --schedulers: auth on, the tasks with a standard key and the "
        "interactive calls with a key of this class (default: auth off, all standard)",
    )
    w.add_argument("--input-len", type=int, default=128, help="synthetic prompt tokens")
    w.add_argument("--output-len", type=int, default=64, help="max_tokens (files: default)")
    w.add_argument("--len-dist", choices=("fixed", "uniform", "normal"), default="fixed")
    w.add_argument("--len-spread", type=float, default=0.25, help="relative spread of lengths")
    w.add_argument("--seed", type=int, default=0)
    w.add_argument("--temperature", type=float, default=0.0)
    w.add_argument("--top-p", type=float, default=None)
    w.add_argument("--ignore-eos", action="store_true", help="send ignore_eos (vLLM extension)")
    w.add_argument(
        "--images",
        type=int,
        default=0,
        help="image parts per request (a vision model's media stage)",
    )
    w.add_argument("--image-size", choices=("512", "4k"), default="512")
    o = p.add_argument_group("output")
    o.add_argument(
        "--goodput", nargs="+", default=[], metavar="NAME:MS", help="ttft: tpot: e2e: task:"
    )
    o.add_argument("--out", default=None, help="result folder (default bench-results/<time>)")
    o.add_argument("--label", default=None, help="free text stored with the result")
    o.add_argument("--no-plots", action="store_true")
    o.add_argument("--quiet", action="store_true", help="no progress bar or table")
    p.set_defaults(func=run)


@dataclass(slots=True)
class Point:
    """One load point of a run: closed loop at `concurrency` or open loop at `rate`."""

    mode: str
    value: float

    @property
    def label(self) -> str:
        return f"rate={self.value:g}/s" if self.mode == "open" else f"c={self.value:g}"


def _target(args: argparse.Namespace) -> load.Target:
    headers = {}
    for h in args.header:
        name, sep, value = h.partition(":")
        if not sep:
            raise ValueError(f"--header {h!r}: use 'Name: value'")
        headers[name.strip()] = value.strip()
    sampling: dict[str, Any] = {"temperature": args.temperature}
    if args.top_p is not None:
        sampling["top_p"] = args.top_p
    if args.ignore_eos:
        sampling["ignore_eos"] = True
    key = args.api_key or os.environ.get("SWITCHYARD_API_KEY") or os.environ.get("OPENAI_API_KEY")
    return load.Target(
        endpoint=args.endpoint,
        model=args.model,
        api_key=key,
        api=args.api,
        timeout_s=args.timeout,
        include_usage=not args.no_usage,
        sampling=sampling,
        headers=headers,
    )


def _workload(args: argparse.Namespace) -> workloads.Workload | list[agent.TaskGraph]:
    if args.agent_tasks:
        return agent.load_graphs(args.agent_tasks, args.output_len)
    work: workloads.Workload
    if args.prompts:
        work = workloads.load_jsonl(args.prompts, args.output_len, args.seed)
    elif args.sharegpt:
        work = workloads.load_sharegpt(args.sharegpt, args.output_len, args.seed)
    else:
        work = workloads.Synthetic(
            args.input_len, args.output_len, args.len_dist, args.len_spread, args.seed
        )
    if args.images:
        w, h = media.SIZES[args.image_size]
        work = workloads.WithImages(work, args.images, media.make_image(w, h), args.image_size)
    return work


def _describe(
    work: workloads.Workload | list[agent.TaskGraph], args: argparse.Namespace
) -> dict[str, Any]:
    if isinstance(work, list):
        return {
            "kind": "agent",
            "path": args.agent_tasks,
            "tasks": [
                {
                    "name": g.name,
                    "steps": [s.id for s in g.steps],
                    "tool_steps": [s.id for s in g.steps if s.tool is not None],
                    "edges": sum(len(s.depends_on) for s in g.steps),
                }
                for g in work
            ],
        }
    return work.describe()


async def run_point(
    point: Point,
    target: load.Target,
    work: workloads.Workload | list[agent.TaskGraph],
    args: argparse.Namespace,
    slo: Slo,
    progress: Progress | None = None,
) -> dict[str, Any]:
    """Run one load point; return its result dict (summary, records, tasks)."""
    clock = load.Clock()
    records: list[RequestRecord] = []
    tasks: list[agent.TaskRecord] = []
    tag = uuid.uuid4().hex[:8]
    counter = iter(range(sys.maxsize))
    num = args.num_requests
    total = None if num is None else num + args.warmup
    pregen = [work.next() for _ in range(total)] if total and not isinstance(work, list) else []
    bar = progress.add_task(point.label, total=total) if progress else None

    async def job(i: int, scheduled: float | None, warm: bool) -> None:
        if isinstance(work, list):
            graph = work[i % len(work)]
            task = agent.TaskRecord(
                f"bench-{tag}-{i}", graph.name, i, warm, scheduled, len(graph.steps)
            )
            tasks.append(task)
            await agent.run_task(client, graph, task, lambda: next(counter), mcp)
            records.extend(task.records.values())
        else:
            spec = pregen[i] if i < len(pregen) else work.next()
            rec = RequestRecord(
                next(counter), f"bench-{uuid.uuid4().hex[:16]}", 0.0, scheduled, warmup=warm
            )
            records.append(rec)
            await client.send(spec, rec)
        if progress is not None and bar is not None:
            progress.advance(bar)

    cpu0, wall0 = time.process_time(), time.perf_counter()
    async with load.Client(target, clock) as client:
        mcp = None
        if isinstance(work, list) and any(s.tool for g in work for s in g.steps):
            url = args.mcp_url or target.endpoint.rstrip("/") + "/mcp"
            mcp = agent.McpSession(client, url)
        if point.mode == "open":
            schedule = load.arrivals(
                point.value, _arrival(args), args.burstiness, args.seed, args.ramp_up
            )
            await load.open_loop(
                job, schedule, clock, args.warmup, num, args.duration, args.ramp_up
            )
        else:
            await load.closed_loop(
                job, int(point.value), clock, args.warmup, num, args.duration, args.ramp_up
            )
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    records.sort(key=lambda r: r.index)
    tokens.fill_missing(records)
    out: dict[str, Any] = {
        "label": point.label,
        "mode": point.mode,
        "rate": point.value if point.mode == "open" else None,
        "concurrency": int(point.value) if point.mode == "closed" else None,
        "t0_unix": clock.unix0,
        "harness": _harness(cpu, wall, len(records)),
        "summary": summarize(records, slo),
        "tasks_summary": agent.summarize_tasks(tasks, slo) if isinstance(work, list) else None,
        "records": [r.to_json() for r in records],
        "tasks": [t.to_json() for t in tasks],
    }
    out["warnings"] = report.warnings(out)
    return out


def _harness(cpu_s: float, wall_s: float, requests: int) -> dict[str, float | None]:
    """The harness's own cost. `ceiling_rps` extrapolates its CPU per request to one
    full core: past it, the harness (not the server) sets the pace."""
    per_req = cpu_s * 1000 / requests if requests else None
    return {
        "cpu_s": cpu_s,
        "wall_s": wall_s,
        "cpu_util": cpu_s / wall_s if wall_s > 0 else None,
        "cpu_ms_per_request": per_req,
        "ceiling_rps": 1000 / per_req if per_req else None,
    }


def _arrival(args: argparse.Namespace) -> str:
    """The effective arrival process: a burstiness other than 1 makes Poisson gamma."""
    if args.arrival == "poisson" and args.burstiness != 1.0:
        return "gamma"
    return str(args.arrival)


def _points(args: argparse.Namespace) -> list[Point]:
    if args.rate:
        return [Point("open", r) for r in args.rate]
    return [Point("closed", c) for c in (args.concurrency or [1])]


async def run_all(args: argparse.Namespace, console: Console | None = None) -> dict[str, Any]:
    """Run every point of the sweep in order and assemble the result (no files)."""
    if args.num_requests is None and args.duration is None:
        args.num_requests = 100
    target, work, slo = _target(args), _workload(args), parse_slo(args.goodput)
    points = _points(args)
    progress = None
    if console is not None and not args.quiet:
        progress = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=console,
            transient=True,
            refresh_per_second=4,  # rendering holds the GIL; keep it off the send path
        )
    results = []
    if progress is not None:
        with progress:
            for pt in points:
                results.append(await run_point(pt, target, work, args, slo, progress))
    else:
        for pt in points:
            results.append(await run_point(pt, target, work, args, slo))
    base = {
        "label": args.label,
        "endpoint": args.endpoint,
        "model": args.model,
        "api": args.api,
        "workload": _describe(work, args),
        "sampling": {**target.sampling, "max_tokens": "per request (see records)"},
        "load": {
            "mode": points[0].mode,
            "arrival": _arrival(args) if points[0].mode == "open" else "closed-loop",
            "burstiness": args.burstiness if points[0].mode == "open" else None,
            "rates": [p.value for p in points] if points[0].mode == "open" else None,
            "concurrencies": [int(p.value) for p in points] if points[0].mode == "closed" else None,
            "num_requests": args.num_requests,
            "duration_s": args.duration,
            "warmup_requests": args.warmup,
            "ramp_up_s": args.ramp_up,
            "timeout_s": args.timeout,
            "include_usage": target.include_usage,
            "extra_headers": sorted(target.headers),
        },
        "goodput_slo": slo.as_dict(),
    }
    return {
        "metadata": report.metadata(base, results, tokens.load_error()),
        "points": results,
    }


def write_result(result: dict[str, Any], out_dir: Path, plots: bool) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "result.json"
    path.write_bytes(orjson.dumps(result, option=orjson.OPT_INDENT_2))
    files = [path]
    if plots:
        from switchyard.bench import plots as plotting  # matplotlib: imported only when used

        files += plotting.write_all(result, out_dir)
    return files


def run_schedulers(args: argparse.Namespace, console: Console) -> int:
    from switchyard.bench import scheduling
    from switchyard.bench.harness import StartError

    if not args.agent_tasks:
        console.print("[red]bench run:[/] --schedulers needs --agent-tasks FILE")
        return 2
    say = None if args.quiet else (lambda line: console.print(line))
    try:
        result = scheduling.run_schedulers(
            args.agent_tasks, args.schedulers, args.duration, say, args.interactive_priority
        )
    except (ValueError, OSError, KeyError, StartError) as exc:
        console.print(f"[red]bench run:[/] {exc}")
        return 2
    result["label"] = args.label
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    out_dir = Path(args.out or f"bench-results/{stamp}")
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "result.json"
    path.write_bytes(orjson.dumps(result, option=orjson.OPT_INDENT_2))
    table = "\n".join(scheduling.table(result))
    (out_dir / "table.md").write_text(table + "\n")
    if not args.no_plots:
        console.print(f"wrote {scheduling.plot(result, out_dir / 'scheduling.png')}")
    if not args.quiet:
        print(table)
    console.print(f"wrote {path}")
    return 0


def run(args: argparse.Namespace) -> int:
    console = Console(stderr=True)
    if args.schedulers:
        return run_schedulers(args, console)
    if not args.endpoint or not args.model:
        console.print("[red]bench run:[/] --endpoint and --model are required")
        return 2
    try:
        result = asyncio.run(run_all(args, console))
    except (ValueError, OSError) as exc:
        console.print(f"[red]bench run:[/] {exc}")
        return 2
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    out_dir = Path(args.out or f"bench-results/{stamp}")
    files = write_result(result, out_dir, not args.no_plots)
    if not args.quiet:
        report.print_summary(result, Console())
    for f in files:
        console.print(f"wrote {f}")
    completed = sum(p["summary"]["completed"] for p in result["points"])
    return 0 if completed else 1


def main(argv: list[str] | None = None) -> int:
    """`python -m switchyard.bench.run ...`, the same as `switchyard bench run ...`."""
    ap = argparse.ArgumentParser(prog="switchyard bench run", description=__doc__)
    add_run_arguments(ap)
    args = ap.parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    raise SystemExit(main())
