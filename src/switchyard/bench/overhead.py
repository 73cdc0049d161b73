"""`switchyard bench overhead`: what the gateway costs over a direct call and a bare proxy.

Three targets serve the same scripted upstream: the upstream itself (direct), a do-nothing
pass-through proxy on Switchyard's own stack (the floor), and Switchyard. The floor's added
latency is the price of any Python proxy hop; Switchyard's added latency beyond the floor is
what its decisions cost. wrk drives the load (a C client, so the load generator is not what
is measured), in interleaved rounds with the order rotated, so drift on the machine hits
every target alike; medians across rounds are reported.

Switchyard runs in the scenarios `--scenario` names, the first two by default:
- `core`: the `switchyard` target, auth off, observe defaults: the gateway core;
- `realistic`: the `sy-realistic` target, a key with limits under a tenant with limits and
  a daily budget, traces on; see `bench/realistic.py`;
- `workers`: the `sy-workers` target, the realistic gateway served by `serve --workers N`
  (`--workers`, default 2), its limiter in the private redis-server; see `bench/workers.py`;
- `governed` and `protocols`: see `bench/governed.py` and `bench/protocols.py`.
Each is judged against the floor with the same targets.

With `--policy`, two more Switchyard targets with authentication, limits, budget and
ledger on (in-process and Redis limiters) join the same rounds; see `bench/policy.py`.
With `--observe`, two more with metrics and traces off, and with OpenTelemetry export on;
see `bench/observe.py`. Both compare with the `core` target.

Targets: at concurrency 1, Switchyard's added p50 is at most 1.5x the floor's; at
concurrency 32, Switchyard serves at least 0.70x the floor's requests per second.

Beside the Python targets, two native ones (nginx from Debian, `bench/native.py`) run in
the same rounds unless `--no-native` or nginx is missing (then a line says they are
skipped): `nginx-direct`, an instant upstream answering the scripted upstream's bytes,
and `nginx-proxy`, nginx as a reverse proxy in front of it: what a proxy hop costs when
it is not Python. With `--native-upstream` the Python floor and every Switchyard target
call the nginx instant upstream instead of the scripted one, and `direct` is that
upstream, so what is measured is the proxy alone.

Processes, HTTP, wrk and configs come from `bench/harness.py`; the summary, the verdicts
and the table from `bench/overhead_report.py`. This module and that one are the only ones
that import the scenario modules (policy, observe, realistic, workers, ...), so the bench
import graph runs one way.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from switchyard.bench import governed, native, observe, policy, protocols, realistic, workers
from switchyard.bench.harness import (
    CHAT_PATH,
    MODEL,
    Child,
    CpuSample,
    Scenario,
    StartError,
    chat_body,
    config_yaml,
    cpu_sample,
    free_port,
    http,
    machine_info,
    readyz,
    run_wrk,
    serve_argv,
    sigterm_as_exit,
    smoke,
    spawn,
    stop_all,
    wait_ready,
    write_scripts,
)
from switchyard.bench.overhead_report import (
    CHECKED_TARGETS,
    CONCURRENCIES,
    CORE,
    LATENCY_RATIO_MAX,
    SCENARIOS,
    THROUGHPUT_RATIO_MIN,
    render,
    summarize,
)
from switchyard.bench.overhead_report import TARGETS as TARGETS  # tests read it here

DEFAULT_SCENARIOS = ("core", "realistic")
FLOORS = {
    "fastapi": "passthrough proxy (FastAPI + aiohttp)",
    "bare": "passthrough proxy (uvicorn + Starlette request/response from the ASGI call, "
    "no FastAPI stack, no proxy headers + aiohttp)",
}


# --- targets --------------------------------------------------------------------------


def scenarios_of(args: argparse.Namespace) -> tuple[str, ...]:
    """The `--scenario` names asked for, in SCENARIOS' order, each once."""
    asked = set(getattr(args, "scenario", None) or DEFAULT_SCENARIOS)
    return tuple(name for name in SCENARIOS if name in asked)


def native_upstream(args: argparse.Namespace) -> bool:
    """True when the Python targets call the nginx instant upstream (`direct` is it)."""
    return bool(getattr(args, "native_upstream", False))


def with_native(args: argparse.Namespace) -> bool:
    """True when the nginx targets are measured (`run` turns them off without nginx)."""
    return native_upstream(args) or not getattr(args, "no_native", True)


def target_names(args: argparse.Namespace) -> tuple[str, ...]:
    """Every target a run with these arguments measures, in the order it starts them."""
    names = ["direct"]
    if with_native(args):
        names += [native.NGINX_PROXY] if native_upstream(args) else list(native.TARGETS)
    names.append("floor")
    for s in scenarios_of(args):
        if s == "governed":
            names += [governed.BASELINE, governed.TARGET]
        elif s == "protocols":
            names += protocols.TARGETS
        else:
            names.append(SCENARIOS[s])
    if getattr(args, "policy", False):
        names += policy.POLICY_TARGETS
    if getattr(args, "observe", False):
        names += observe.OBSERVE_TARGETS
    return tuple(names)


def start_targets(
    workdir: Path,
    tokens: int,
    max_tokens: int,
    timeout_s: float,
    children: list[Child],
    bare_floor: bool = False,
    core: bool = True,
    tool_calls: str | None = None,
    nginx: str | None = None,
    on_native: bool = False,
) -> dict[str, str]:
    """Start upstream, (with `nginx`, the binary) the native targets, floor and (with
    `core`) Switchyard; return each target's chat URL once it works.

    `on_native`: the floor and Switchyard call the nginx instant upstream, which is then
    `direct`; the scripted upstream only lends it its replies and is stopped.
    Started children are appended to `children` as soon as they exist, so the caller can
    stop them whatever happens here.
    """
    py = sys.executable
    up_port, floor_port, sy_port = free_port(), free_port(), free_port()
    upstream = spawn(
        "upstream",
        [
            py,
            "-m",
            "switchyard.bench.scripted_upstream",
            "--host",
            "127.0.0.1",
            "--port",
            str(up_port),
            "--tokens",
            str(tokens),
            "--model-name",
            MODEL,
            *(["--tool-calls", tool_calls] if tool_calls else []),
        ],
        workdir,
    )
    children.append(upstream)
    up_base = f"http://127.0.0.1:{up_port}"
    wait_ready(upstream, lambda: http("GET", up_base + "/health")[0] == 200, timeout_s)
    urls = {"direct": up_base + CHAT_PATH}
    if nginx is not None:
        replies = native.capture_replies(up_base + CHAT_PATH, max_tokens)
        urls |= native.start_native(nginx, workdir, replies, max_tokens, timeout_s, children)
    if on_native:  # nothing calls the scripted upstream any more
        _retire(upstream, children)
        urls["direct"] = urls.pop(native.NGINX_DIRECT)
        instant = urlsplit(urls["direct"])
        assert instant.port is not None
        up_base, up_port = f"http://{instant.netloc}", instant.port

    floor = spawn(
        "floor",
        [
            py,
            "-m",
            "switchyard.bench.passthrough_proxy",
            "--host",
            "127.0.0.1",
            "--port",
            str(floor_port),
            "--upstream",
            up_base + "/v1",
            *(["--bare"] if bare_floor else []),
        ],
        workdir,
    )
    children.append(floor)
    urls["floor"] = f"http://127.0.0.1:{floor_port}{CHAT_PATH}"
    gateway = None
    if core:
        cfg = workdir / "switchyard.yaml"
        cfg.write_text(config_yaml(sy_port, up_port, workdir / "switchyard.db"))
        gateway = spawn(CORE, serve_argv(cfg, sy_port), workdir)
        children.append(gateway)
        urls[CORE] = f"http://127.0.0.1:{sy_port}{CHAT_PATH}"
    probe = chat_body(False, max_tokens)
    wait_ready(floor, lambda: http("POST", urls["floor"], probe)[0] == 200, timeout_s)
    if gateway is not None:
        wait_ready(gateway, lambda: readyz(sy_port), timeout_s)
    for name, url in urls.items():
        smoke(name, url, max_tokens)
    return urls


def _retire(child: Child, children: list[Child]) -> None:
    """Stop a child the run no longer needs and forget it."""
    children.remove(child)
    stop_all([child])


# --- measuring and reporting ----------------------------------------------------------


def rotated(items: tuple[str, ...], k: int) -> list[str]:
    k %= len(items)
    return list(items[k:] + items[:k])


def measure(
    args: argparse.Namespace,
    urls: dict[str, str],
    scripts: dict[str, dict[bool, Path]],
    pids: dict[str, int] | None = None,
) -> list[dict[str, Any]]:
    """Warm every target up, then run every scenario on every target, round by round.

    The targets are the keys of `urls`, in order; `scripts[target][stream]` is the wrk
    script for that target (targets that need a key get their own). `pids`: each
    target's root process (and "upstream": the upstream every Python target calls);
    each run then records the CPU its tree used per request (read from /proc: the
    gateway's workers, ledger writer and engines all count), that of the upstream it
    calls (`upstream_of`), and the load generator's share of the machine's CPU.
    """
    pids = pids or {}
    roots = sorted(set(pids.values()))
    cores = os.cpu_count() or 1
    targets = tuple(urls)
    width = max(10, *(len(t) for t in targets))
    for target in targets:
        for stream in (False, True):
            warm = Scenario(stream, max(CONCURRENCIES))
            run_wrk(args.wrk, urls[target], scripts[target][stream], warm, args.warmup)
    scenarios = [Scenario(s, c) for s in (False, True) for c in CONCURRENCIES]
    runs: list[dict[str, Any]] = []
    for rnd in range(args.rounds):
        for i, sc in enumerate(scenarios):
            for target in rotated(targets, rnd + i):
                script = scripts[target][sc.stream]
                before = cpu_sample(roots)
                res = run_wrk(args.wrk, urls[target], script, sc, args.duration)
                after = cpu_sample(roots)
                runs.append(
                    {
                        "round": rnd + 1,
                        "scenario": sc.name,
                        "stream": sc.stream,
                        "connections": sc.connections,
                        "threads": sc.threads,
                        "target": target,
                        **asdict(res),
                        **_cpu(
                            before,
                            after,
                            pids.get(target),
                            pids.get(upstream_of(target, pids)),
                            res.requests,
                            args.duration,
                            cores,
                        ),
                    }
                )
                errors = res.non_2xx + res.socket_errors
                print(
                    f"  round {rnd + 1}/{args.rounds}  {sc.name:<15} {target:<{width}} "
                    f"{res.rps:>9.1f} req/s  p50 {res.p50_ms:.3f} ms  p99 {res.p99_ms:.3f} ms"
                    + (f"  ERRORS {errors}" if errors else ""),
                    file=sys.stderr,
                    flush=True,
                )
    return runs


def upstream_of(target: str, pids: dict[str, int]) -> str:
    """The key in `pids` of the upstream `target` calls: nginx-proxy calls the nginx
    instant upstream (`direct` itself with `--native-upstream`), the others "upstream"
    (for direct, that is the target)."""
    if target == native.NGINX_PROXY and native.NGINX_DIRECT in pids:
        return native.NGINX_DIRECT
    return "upstream"


def _cpu(
    before: CpuSample,
    after: CpuSample,
    target_pid: int | None,
    upstream_pid: int | None,
    requests: int,
    duration_s: float,
    cores: int,
) -> dict[str, Any]:
    """One run's CPU per request: the target's process tree, its upstream's, and the load
    generator's share of the machine's CPU time."""

    def per_request(pid: int | None) -> float | None:
        if pid is None or requests <= 0:
            return None
        return (after.trees[pid] - before.trees[pid]) * 1e6 / requests

    by_process: dict[str, float] | None = None
    if target_pid is not None and requests > 0:
        was, now = before.parts.get(target_pid, {}), after.parts.get(target_pid, {})
        # A process that started during the run (a restarted worker) counts from zero.
        by_process = {
            role: (used - was.get(role, 0.0)) * 1e6 / requests for role, used in now.items()
        }
    return {
        "cpu_us_per_req": per_request(target_pid),
        "cpu_us_per_req_by_process": by_process,
        "upstream_cpu_us_per_req": per_request(upstream_pid),
        "loader_cpu_share": round((after.waited - before.waited) / (duration_s * cores), 4),
    }


def target_pids(children: list[Child], urls: dict[str, str]) -> dict[str, int]:
    """Each target's root process: the child started under its name (direct: the
    upstream, the nginx instant upstream when the scripted one was stopped for
    `--native-upstream`; the protocol targets: the realistic gateway they share), and
    "upstream"."""
    by_name = {c.name: c.proc.pid for c in children}
    upstream = by_name["upstream"] if "upstream" in by_name else by_name[native.NGINX_DIRECT]
    out = {"upstream": upstream, "direct": upstream}
    for target in urls:
        if target in by_name:
            out[target] = by_name[target]
        elif target in (protocols.RESPONSES, protocols.MESSAGES) and realistic.TARGET in by_name:
            out[target] = by_name[realistic.TARGET]
    return out


# --- the command ----------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--duration", type=int, default=5, help="seconds per wrk run")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (medians)")
    parser.add_argument("--warmup", type=int, default=1, help="seconds of warm-up per target")
    parser.add_argument("--tokens", type=int, default=16, help="tokens the upstream answers")
    parser.add_argument("--startup-timeout", type=float, default=120.0, help="seconds")
    parser.add_argument("--wrk", default="wrk", help="the wrk binary")
    parser.add_argument(
        "--floor",
        choices=sorted(FLOORS),
        default="bare",
        help="bare: the proxy serves its routes from the ASGI call, as Switchyard's model "
        "routes are served (like for like, the default); fastapi: they go through "
        "FastAPI's stack (the floor of runs before 2026-11-29's last round)",
    )
    parser.add_argument(
        "--scenario",
        nargs="+",
        choices=tuple(SCENARIOS),
        default=list(DEFAULT_SCENARIOS),
        help="the Switchyard targets judged against the floor (default: core and "
        "realistic): core (switchyard: auth off, the gateway core), realistic "
        "(sy-realistic: a key with rpm 1e6 under a tenant with rpm 1e6, tpm 1e9, "
        "max_concurrency 1000 and a $1e6 daily budget, traces on) and governed "
        "(sy-governed vs sy-gov-off: task budgets and tool-call checks on vs off, the "
        "upstream answering with tool calls for every target) and protocols (sy-messages "
        "and sy-responses: the realistic gateway on /v1/messages and /v1/responses, "
        "compared with sy-realistic's chat request; needs realistic) and workers "
        "(sy-workers: the realistic gateway served by `serve --workers N`, see --workers); "
        "--policy and --observe need core",
    )
    parser.add_argument(
        "--workers",
        type=int,
        default=workers.DEFAULT_WORKERS,
        help="worker processes of the sy-workers target (--scenario workers; at least 2: "
        "one process is sy-realistic)",
    )
    parser.add_argument("--out", default=None, help="JSON result path")
    parser.add_argument(
        "--policy",
        action="store_true",
        help="also measure Switchyard with auth, limits, budget and ledger on "
        "(sy-policy) and with a Redis limiter (sy-policy-redis)",
    )
    parser.add_argument(
        "--observe",
        action="store_true",
        help="also measure Switchyard with metrics and traces off (sy-obs-off) and with "
        "OpenTelemetry spans exported to a file (sy-otel)",
    )
    parser.add_argument(
        "--redis-server", default="redis-server", help="the redis-server binary (--policy)"
    )
    parser.add_argument("--nginx", default="nginx", help="the nginx binary of the native targets")
    parser.add_argument(
        "--no-native",
        action="store_true",
        help="leave out the native targets (nginx-direct: an nginx instant upstream; "
        "nginx-proxy: nginx as a reverse proxy in front of it)",
    )
    parser.add_argument(
        "--native-upstream",
        action="store_true",
        help="the floor and Switchyard call the nginx instant upstream instead of the "
        "scripted Python one, and direct is that upstream: the proxies alone are measured "
        "(not with --scenario governed, whose tool calls only the scripted upstream makes)",
    )
    parser.set_defaults(func=run)


def _start(
    args: argparse.Namespace, workdir: Path, children: list[Child]
) -> tuple[dict[str, str], dict[str, dict[bool, Path]]]:
    """Start every target; return each one's chat URL and its wrk scripts by stream."""
    plain = write_scripts(workdir, "plain", None, args.tokens)
    bare = getattr(args, "floor", "bare") == "bare"
    scenarios = scenarios_of(args)
    urls = start_targets(
        workdir,
        args.tokens,
        args.tokens,
        args.startup_timeout,
        children,
        bare_floor=bare,
        core="core" in scenarios,
        tool_calls=governed.TOOL_CALLS if "governed" in scenarios else None,
        nginx=args.nginx if with_native(args) else None,
        on_native=native_upstream(args),
    )
    scripts = {target: plain for target in urls}
    if "realistic" in scenarios:
        rt = realistic.start_realistic_target(workdir, urls, args, children)
        urls[rt.name] = rt.url
        scripts[rt.name] = rt.scripts
        if "protocols" in scenarios:  # the same gateway and key, on the other protocols
            for pt in protocols.start_protocol_targets(workdir, rt.url, rt.key, args.tokens):
                urls[pt.name] = pt.url
                scripts[pt.name] = pt.scripts
    if "workers" in scenarios:
        wt = workers.start_workers_target(workdir, urls, args, children)
        urls[wt.name] = wt.url
        scripts[wt.name] = wt.scripts
    if "governed" in scenarios:
        for gt in governed.start_governed_targets(workdir, urls, args, children):
            urls[gt.name] = gt.url
            scripts[gt.name] = gt.scripts
    if getattr(args, "policy", False):
        for pt in policy.start_policy_targets(workdir, urls, args, children):
            urls[pt.name] = pt.url
            scripts[pt.name] = pt.scripts
    if getattr(args, "observe", False):
        for ot in observe.start_observe_targets(workdir, urls, args, children):
            urls[ot.name] = ot.url
            scripts[ot.name] = plain
    assert tuple(urls) == target_names(args), (tuple(urls), target_names(args))
    return urls, scripts


def _result(
    args: argparse.Namespace,
    started: str,
    summary: list[dict[str, Any]],
    runs: list[dict[str, Any]],
) -> dict[str, Any]:
    return {
        "benchmark": "overhead",
        "started": started,
        "workload": {
            "duration_s": args.duration,
            "rounds": args.rounds,
            "warmup_s": args.warmup,
            "upstream_tokens": args.tokens,
            "concurrency": {
                str(c): {"threads": Scenario(False, c).threads, "connections": c}
                for c in CONCURRENCIES
            },
            "bodies": {
                "non_stream": chat_body(False, args.tokens).decode(),
                "stream": chat_body(True, args.tokens).decode(),
            },
            "scenarios": list(scenarios_of(args)),
            "native_upstream": native_upstream(args),
            "targets": {
                "direct": (
                    "nginx instant upstream (--native-upstream): "
                    + native.DESCRIPTIONS[native.NGINX_DIRECT]
                    if native_upstream(args)
                    else "scripted upstream"
                ),
                **{t: native.DESCRIPTIONS[t] for t in native.TARGETS if t in target_names(args)},
                "floor": FLOORS[getattr(args, "floor", "bare")],
                **(
                    {CORE: "switchyard serve, one openai-kind model, auth off"}
                    if "core" in scenarios_of(args)
                    else {}
                ),
            },
            "criteria": {
                "judged_against_floor": [t for t in CHECKED_TARGETS if t in target_names(args)],
                "added_p50_ratio_max_at_c1": LATENCY_RATIO_MAX,
                "rps_ratio_min_at_c32": THROUGHPUT_RATIO_MIN,
            },
        },
        "machine": machine_info(args.wrk)
        | ({"nginx": native.nginx_version(args.nginx)} if with_native(args) else {}),
        "summary": summary,
        "runs": runs,
    }


def _check_tools(args: argparse.Namespace) -> str | None:
    """Why the bench cannot run with these arguments, or None."""
    if args.duration < 1 or args.rounds < 1 or args.warmup < 1:
        return "--duration, --rounds and --warmup must be at least 1"
    if shutil.which(args.wrk) is None:
        return f"bench overhead needs wrk ({args.wrk!r} not found)"
    if args.policy and shutil.which(args.redis_server) is None:
        return f"bench overhead --policy needs redis-server ({args.redis_server!r} not found)"
    if "workers" in scenarios_of(args) and args.workers < 2:
        return "--workers: at least 2 (one process is the realistic target)"
    if "workers" in scenarios_of(args) and shutil.which("redis-server") is None:
        return (
            "bench overhead --scenario workers needs redis-server (the workers' private "
            "limiter store; `make sysdeps` installs it)"
        )
    if "protocols" in scenarios_of(args) and "realistic" not in scenarios_of(args):
        return "--scenario protocols compares with the realistic target: add --scenario realistic"
    if (args.policy or args.observe) and "core" not in scenarios_of(args):
        return "--policy and --observe compare with the core switchyard target: add --scenario core"
    if args.native_upstream and args.no_native:
        return "--native-upstream needs the native targets: drop --no-native"
    if args.native_upstream and "governed" in scenarios_of(args):
        return (
            "--native-upstream answers text only: --scenario governed needs the scripted upstream"
        )
    if args.native_upstream and shutil.which(args.nginx) is None:
        return f"bench overhead --native-upstream needs nginx ({args.nginx!r} not found)"
    return None


def _skip_native_without_nginx(args: argparse.Namespace) -> None:
    """Without nginx the native targets are left out, and a line says so."""
    if with_native(args) and shutil.which(args.nginx) is None:
        args.no_native = True
        print(
            f"switchyard: bench overhead: nginx not found ({args.nginx!r}): the native "
            f"targets ({', '.join(native.TARGETS)}) are skipped; `make sysdeps` installs it",
            file=sys.stderr,
        )


def run(args: argparse.Namespace) -> int:
    problem = _check_tools(args)
    if problem is not None:
        print(f"switchyard: {problem}", file=sys.stderr)
        return 2
    _skip_native_without_nginx(args)
    started = time.strftime("%Y%m%d-%H%M%S")
    out = Path(args.out or f"bench-results/overhead-{started}.json")
    children: list[Child] = []
    spans: dict[str, int] | None = None
    try:
        with sigterm_as_exit(), tempfile.TemporaryDirectory(prefix="sy-overhead-") as tmp:
            try:
                urls, scripts = _start(args, Path(tmp), children)
            except StartError as exc:
                print(f"switchyard: bench overhead: {exc}", file=sys.stderr)
                return 1
            print("targets ready; measuring", file=sys.stderr, flush=True)
            try:
                runs = measure(args, urls, scripts, target_pids(children, urls))
            except (RuntimeError, ValueError, subprocess.TimeoutExpired) as exc:
                print(f"switchyard: bench overhead: a wrk run failed: {exc}", file=sys.stderr)
                return 1
            if args.observe:
                spans = observe.spans_written(Path(tmp))
    except KeyboardInterrupt:
        print("switchyard: bench overhead interrupted", file=sys.stderr)
        return 130
    finally:
        stop_all(children)
    summary = summarize(runs, tuple(urls))
    if args.policy:
        policy.annotate(summary)
    if args.observe:
        observe.annotate(summary)
    print(render(summary, args))
    result = _result(args, started, summary, runs)
    with_realistic = realistic.TARGET in urls
    if with_realistic:
        realistic.record(result)
    if args.policy:
        policy.record(result, args.redis_server)
    if args.observe:
        observe.record(result, spans)
    if governed.TARGET in urls:
        governed.record(result, summary)
    if protocols.RESPONSES in urls:
        protocols.record(result, summary)
    if workers.TARGET in urls:
        workers.record(result, summary, args.workers)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"results: {out}")
    code = _policy_errors(policy.errors(summary)) if args.policy else 0
    if with_realistic:
        code = max(code, realistic.check_errors(summary))
    if workers.TARGET in urls:
        code = max(code, realistic.check_errors(summary, workers.TARGET))
    if args.observe:
        code = max(code, observe.check_errors(summary))
    return code


def _policy_errors(errors: dict[str, int]) -> int:
    """A policy target must never be refused: a non-2xx answer means it measured a refusal
    path, not the cost of policy, so the run fails (the results file is still written)."""
    bad = {name: n for name, n in errors.items() if n}
    for name, n in bad.items():
        print(
            f"switchyard: bench overhead: {name} had {n} non-2xx or socket errors; "
            "its numbers are not the cost of policy",
            file=sys.stderr,
        )
    return 1 if bad else 0
