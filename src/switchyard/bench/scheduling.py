"""`switchyard bench run --agent-tasks FILE --schedulers fcfs,task_aware`: one overload
workload against each gateway scheduler, the same arrivals for each.

The file's `scheduling:` section fixes everything (examples/bench/scheduling.yaml): the
scripted upstream's capacity (concurrency, service time per request and per output
token), the gateway's queue, the loads as multiples of that capacity, the task deadline
and the share of interactive single calls. The run starts one scripted upstream and one
gateway per scheduler (child processes; `scheduling.policy` is the only difference in
their configs) and, per load, sends the same seeded Poisson arrivals to each in turn:

* tasks: the file's task graph (a step starts when its parents are done), every step
  with `x-task-timeout` = the deadline; a task is good when every step succeeded and its
  E2E (first send to last end) is within the deadline;
* interactive calls: single requests with their own `x-request-timeout`.

Capacity is known: slot-seconds per second = the upstream's concurrency; a task costs
the sum of its steps' service times, an interactive call its own; load L offers L times
the capacity.

`upstream: {kind: llama-server, parallel: P}` runs the same comparison against a real
llama-server (the embedded model's, one engine for both gateways, read by them through
its `/metrics`): its capacity is its P slots and the model's speed on this machine, so
the run first measures it (`calibrate`: P closed-loop clients sending the workload's own
requests straight to the engine, a + b x tokens fitted to their times) and states the
deadline, the interactive timeout and the SLO as multiples (`deadline_x`, `timeout_x`,
`slo_x`) of the loaded critical path and service time. A step's `[[tokens:K]]` is then
its `max_tokens`, with `ignore_eos`, so that it generates K tokens as the script would;
the gateways' estimates still learn lengths from answers, never from the cap. Per point it reports task goodput (good tasks per minute of arrivals),
task E2E p50/p95, interactive p95, refusals by (status, code) and wasted work (tokens
of the steps of tasks that were not good).

The file is read, and the capacity arithmetic done, in `bench/scheduling_workload.py`.
"""

from __future__ import annotations

import asyncio
import random
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from switchyard.bench import agent, load, tokens
from switchyard.bench.harness import (
    MODEL,
    Child,
    auth_config,
    config_yaml,
    free_port,
    http,
    readyz,
    sigterm_as_exit,
    spawn,
    start_gateway,
    stop_all,
    switchyard_cli,
    wait_for,
    wait_ready,
)
from switchyard.bench.metrics import RequestRecord, percentile
from switchyard.bench.scheduling_workload import Workload, load_workload, step_tokens, with_times
from switchyard.bench.workloads import RequestSpec

SCHEDULERS = ("fcfs", "task_aware")


CALIBRATE_S = 20.0  # closed-loop seconds per calibration


async def calibrate(w: Workload, engine_url: str, seconds: float = CALIBRATE_S) -> Workload:
    """Measure a real engine's service time at full load: `concurrency` clients send the
    workload's requests (every step's and the interactive call's, in turn, parents'
    outputs stood in by words of their length) straight to the engine for `seconds`;
    slot seconds = a + b x tokens, least squares. The deadline, interactive timeout and
    SLO are then the workload's multiples of the critical path and the call's time."""
    lengths = {st.id: step_tokens(st) for st in w.graph.steps}
    prompts = [
        (agent.fill(st.prompt, {k: "word " * n for k, n in lengths.items()}), lengths[st.id])
        for st in w.graph.steps
    ] + [(f"[[tokens:{w.interactive_tokens}]] A quick question.", w.interactive_tokens)]
    samples: list[tuple[int, float]] = []
    end = time.monotonic() + seconds

    async def client(session: aiohttp.ClientSession, offset: int) -> None:
        i = offset
        while time.monotonic() < end:
            prompt, n = prompts[i % len(prompts)]
            i += 1
            body = {
                "model": MODEL,
                "messages": [{"role": "user", "content": prompt}],
                "max_tokens": n,
                "ignore_eos": True,
                "temperature": 0,
            }
            t = time.perf_counter()
            async with session.post(engine_url + "/v1/chat/completions", json=body) as r:
                data = await r.json()
            if r.status != 200:
                raise RuntimeError(f"calibration: the engine answered {r.status}: {data}")
            samples.append((int(data["usage"]["completion_tokens"]), time.perf_counter() - t))

    timeout = aiohttp.ClientTimeout(total=max(60.0, seconds * 3))
    async with aiohttp.ClientSession(timeout=timeout) as session:
        await asyncio.gather(*(client(session, k) for k in range(w.concurrency)))
    a, b = fit_line(samples)
    measured = replace(w, service_ms=a * 1000, token_ms=b * 1000)
    assert w.deadline_x is not None and w.timeout_x is not None and w.slo_x is not None
    measured = replace(
        measured,
        deadline_s=w.deadline_x * measured.critical_path_s(),
        interactive_timeout_s=w.timeout_x * measured.interactive_work_s,
        interactive_slo_ms=w.slo_x * measured.interactive_work_s * 1000,
        calibration={
            "seconds": seconds,
            "requests": len(samples),
            "mean_tokens": round(sum(n for n, _ in samples) / max(1, len(samples)), 1),
        },
    )
    return with_times(measured)


def fit_line(samples: list[tuple[int, float]]) -> tuple[float, float]:
    """(a, b) of y = a + b x by least squares, both at least 0: a negative intercept
    (noise on a busy machine) refits the line through the origin, a negative slope
    (longer answers no slower) is the mean time; one length seen: (its mean, 0)."""
    if not samples:
        raise RuntimeError("calibration: no request was answered")
    n = len(samples)
    mx = sum(x for x, _ in samples) / n
    my = sum(y for _, y in samples) / n
    var = sum((x - mx) ** 2 for x, _ in samples)
    if var == 0:
        return my, 0.0
    b = sum((x - mx) * (y - my) for x, y in samples) / var
    if b <= 0:
        return my, 0.0
    a = my - b * mx
    if a < 0:
        return 0.0, sum(x * y for x, y in samples) / sum(x * x for x, _ in samples)
    return a, b


def schedule(w: Workload, load_x: float) -> list[tuple[float, str]]:
    """(send time s, "task" | "interactive"), sorted: seeded, so every scheduler gets the
    same arrivals at a load."""
    rng = random.Random(f"{w.seed}:{load_x}")
    end = w.warmup_s + w.duration_s
    out: list[tuple[float, str]] = []
    for kind, rate in (
        ("task", w.task_rate(load_x)),
        ("interactive", w.task_rate(load_x) * w.interactive_per_task),
    ):
        t = rng.expovariate(rate) if rate > 0 else end
        while t < end:
            out.append((t, kind))
            t += rng.expovariate(rate)
    out.sort()
    return out


async def run_point(
    target_: Target, w: Workload, arrivals: list[tuple[float, str]]
) -> tuple[list[agent.TaskRecord], list[RequestRecord]]:
    """Send the arrivals open-loop; every job runs to its end."""
    clock = load.Clock()
    target = load.Target(
        endpoint=target_.url,
        model=MODEL,
        api_key=target_.task_key,
        timeout_s=60.0,
        sampling={"temperature": 0, "ignore_eos": True} if w.real else {"temperature": 0},
    )
    tag = uuid.uuid4().hex[:8]
    counter = iter(range(sys.maxsize))
    tasks: list[agent.TaskRecord] = []
    singles: list[RequestRecord] = []
    prompt = f"[[tokens:{w.interactive_tokens}]] A quick question from a user."
    inter_headers = {"x-request-timeout": f"{w.interactive_timeout_s:g}"}
    if target_.interactive_key is not None:
        inter_headers["authorization"] = f"Bearer {target_.interactive_key}"

    async def job(client: load.Client, i: int, t: float, kind: str) -> None:
        warm = t < w.warmup_s
        if kind == "task":
            task = agent.TaskRecord(
                f"bench-{tag}-{i}", w.graph.name, i, warm, t, len(w.graph.steps)
            )
            tasks.append(task)
            await agent.run_task(client, w.graph, task, lambda: next(counter))
        else:
            rec = RequestRecord(
                next(counter), f"bench-{uuid.uuid4().hex[:16]}", 0.0, t, warmup=warm
            )
            singles.append(rec)
            cap = w.interactive_tokens if w.real else w.max_tokens
            spec = RequestSpec([{"role": "user", "content": prompt}], cap)
            await client.send(spec, rec, inter_headers)

    async with load.Client(target, clock) as client:
        running = []
        for i, (t, kind) in enumerate(arrivals):
            delay = t - clock.now()
            if delay > 0:
                await asyncio.sleep(delay)
            running.append(asyncio.ensure_future(job(client, i, t, kind)))
        await asyncio.gather(*running)
    records = [r for t in tasks for r in t.records.values()] + singles
    tokens.fill_missing(records)
    return tasks, singles


def _refusal(r: RequestRecord) -> str:
    return f"{r.status}:{r.error_code}" if r.status is not None else str(r.error)


def summarize(
    w: Workload, tasks: list[agent.TaskRecord], singles: list[RequestRecord]
) -> dict[str, Any]:
    measured = [t for t in tasks if not t.warmup]
    deadline_ms = w.deadline_s * 1000
    good = [t for t in measured if t.ok and (t.e2e_ms or 0.0) <= deadline_ms]
    done = [t.e2e_ms for t in measured if t.ok and t.e2e_ms is not None]
    refusals: dict[str, int] = {}
    wasted = 0
    good_ids = {t.task_id for t in good}
    for t in measured:
        for r in t.records.values():
            if not r.ok:
                refusals[_refusal(r)] = refusals.get(_refusal(r), 0) + 1
            elif t.task_id not in good_ids:
                wasted += (r.input_tokens or 0) + (r.output_tokens or 0)
    inter = [r for r in singles if not r.warmup]
    inter_ok = [r.e2e_ms for r in inter if r.ok and r.e2e_ms is not None]
    inter_refused: dict[str, int] = {}
    for r in inter:
        if not r.ok:
            inter_refused[_refusal(r)] = inter_refused.get(_refusal(r), 0) + 1
    minutes = w.duration_s / 60
    return {
        "tasks": len(measured),
        "tasks_good": len(good),
        "tasks_completed": len(done),
        "task_goodput_per_min": len(good) / minutes,
        "task_e2e_p50_ms": percentile(done, 50) if done else None,
        "task_e2e_p95_ms": percentile(done, 95) if done else None,
        "steps_sent": sum(len(t.records) for t in measured),
        "step_refusals": dict(sorted(refusals.items())),
        "wasted_tokens": wasted,
        "interactive": len(inter),
        "interactive_ok": len(inter_ok),
        "interactive_p50_ms": percentile(inter_ok, 50) if inter_ok else None,
        "interactive_p95_ms": percentile(inter_ok, 95) if inter_ok else None,
        "interactive_refusals": dict(sorted(inter_refused.items())),
    }


@dataclass(frozen=True, slots=True)
class Target:
    """A started gateway, and the keys of the tasks and the interactive calls (None: auth
    off)."""

    url: str
    task_key: str | None = None
    interactive_key: str | None = None
    engine_port: int | None = None  # the llama-server behind it, when real


def _gateway_config(w: Workload, policy: str, gw_port: int, up_port: int, db: Path) -> str:
    base = config_yaml(gw_port, up_port, db)
    if w.interactive_priority is not None:
        base = auth_config(base, db)
    cfg: dict[str, Any] = yaml.safe_load(base)
    if w.real:  # the engine's own load too, as a gateway in front of llama-server reads it
        cfg["models"][0]["engine"]["load_metrics"] = "llamacpp"
        cfg["models"][0]["revision"] = "smollm2"
    cfg["models"][0]["limits"] = {"max_concurrency": w.max_concurrency, "queue": w.queue}
    if w.resilience:
        cfg["models"][0]["resilience"] = w.resilience
    cfg["scheduling"] = {"policy": policy}
    return yaml.safe_dump(cfg, sort_keys=False)


def _upstream_ready(port: int) -> bool:
    try:
        return http("GET", f"http://127.0.0.1:{port}/health")[0] == 200
    except OSError:
        return False


def _keys(w: Workload, db: Path) -> tuple[str | None, str | None]:
    """With `interactive_priority`: a tenant of that class, a standard key for the tasks
    and a key of that class for the interactive calls (a key only lowers its tenant's)."""
    if w.interactive_priority is None:
        return None, None
    cls = w.interactive_priority
    where = ["--db", str(db)]
    switchyard_cli(["tenants", "create", "bench", "--priority", cls, *where], 60)
    keys = []
    for priority in ("standard", cls):
        made = switchyard_cli(
            ["keys", "create", "--tenant", "bench", "--priority", priority, *where], 60
        )
        keys.append(str(made["key"]))
    return keys[0], keys[1]


def start_engine(w: Workload, workdir: Path, children: list[Child]) -> int:
    """A llama-server with the embedded model, its slots and metrics on; its port."""
    from switchyard.config import LlamaCppEngine
    from switchyard.engines.assets import smollm2_gguf_path
    from switchyard.engines.llamacpp import llama_server_binary

    port = free_port()
    argv = [
        llama_server_binary(LlamaCppEngine(kind="llamacpp")), "-m", smollm2_gguf_path(),
        "--host", "127.0.0.1", "--port", str(port), "--metrics", "--slots",
        "-np", str(w.concurrency), "-c", str(w.ctx), "-t", str(w.threads),
    ]  # fmt: skip
    engine = spawn("llama-server", argv, workdir)
    children.append(engine)
    wait_ready(engine, partial(_upstream_ready, port), 180)
    return port


def start_targets(
    w: Workload, schedulers: list[str], workdir: Path, children: list[Child]
) -> dict[str, Target]:
    """A gateway per scheduler, each with its own scripted upstream, or all in front of
    one llama-server (`w.real`), by scheduler."""
    urls = {}
    engine_port = start_engine(w, workdir, children) if w.real else None
    for name in schedulers:
        gw_port = free_port()
        if engine_port is not None:
            up_port = engine_port
        else:
            up_port = free_port()
            argv = [
                sys.executable, "-m", "switchyard.bench.scripted_upstream",
                "--port", str(up_port), "--tokens", "4096",
                "--concurrency", str(w.concurrency),
                "--service-ms", f"{w.service_ms:g}", "--token-ms", f"{w.token_ms:g}",
            ]  # fmt: skip
            up = spawn(f"upstream-{name}", argv, workdir)
            children.append(up)
            wait_ready(up, partial(_upstream_ready, up_port), 30)
        config = workdir / f"gateway-{name}.yaml"
        db = workdir / f"{name}.db"
        task_key, interactive_key = _keys(w, db)
        config.write_text(_gateway_config(w, name, gw_port, up_port, db))
        gw = start_gateway(f"gateway-{name}", config, gw_port, workdir)
        children.append(gw)
        wait_ready(gw, partial(readyz, gw_port), 60)
        urls[name] = Target(
            f"http://127.0.0.1:{gw_port}", task_key, interactive_key, up_port if w.real else None
        )
    return urls


def parse_schedulers(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    bad = [n for n in names if n not in SCHEDULERS]
    if not names or bad:
        raise ValueError(
            f"--schedulers {text!r}: a comma-separated list of {', '.join(SCHEDULERS)}"
        )
    return names


async def _run_all(
    w: Workload, urls: dict[str, Target], progress: Any = None
) -> list[dict[str, Any]]:
    points = []
    for x in w.loads:
        arrivals = schedule(w, x)
        for name, url in urls.items():
            if progress is not None:
                progress(f"load {x:g}x, {name}: {len(arrivals)} arrivals")
            tasks, singles = await run_point(url, w, arrivals)
            points.append(
                {
                    "load": x,
                    "scheduler": name,
                    "task_rate_per_s": w.task_rate(x),
                    "arrivals": len(arrivals),
                    "summary": summarize(w, tasks, singles),
                    "tasks": [t.to_json() for t in tasks],
                    "interactive": [r.to_json() for r in singles],
                }
            )
            await asyncio.sleep(1.0)  # the gateway settles the point's last requests
    return points


def run_schedulers(
    path: str,
    schedulers: str,
    duration_s: float | None = None,
    progress: Any = None,
    interactive_priority: str | None = None,
) -> dict[str, Any]:
    """Start the targets, run every load against every scheduler, stop them."""
    w = load_workload(path, duration_s, interactive_priority)
    names = parse_schedulers(schedulers)
    children: list[Child] = []
    with tempfile.TemporaryDirectory(prefix="sy-sched-") as tmp, sigterm_as_exit():
        workdir = Path(tmp)
        try:
            urls = start_targets(w, names, workdir, children)
            port = next(iter(urls.values())).engine_port
            if port is not None:
                if progress is not None:
                    progress(f"measuring the engine's capacity ({CALIBRATE_S:g} s)")
                w = asyncio.run(calibrate(w, f"http://127.0.0.1:{port}"))
                if progress is not None:
                    progress(
                        f"service {w.service_ms:.0f} ms + {w.token_ms:.1f} ms/token per slot; "
                        f"deadline {w.deadline_s:.1f} s, interactive SLO {w.interactive_slo_ms:.0f} ms"
                    )
            points = asyncio.run(_run_all(w, urls, progress))
        finally:
            stop_all(children)
            wait_for(lambda: all(c.proc.poll() is not None for c in children), 10)
    return {"workload": {"path": path, **w.describe()}, "schedulers": names, "points": points}


def table(result: dict[str, Any]) -> list[str]:
    """The side-by-side summary, as Markdown table rows."""

    def ms(v: float | None) -> str:
        return "-" if v is None else f"{v:.0f}"

    head = (
        "| load | scheduler | tasks | good | goodput/min | task p50 ms | task p95 ms | "
        "interactive p95 ms (ok/sent) | refusals (steps; interactive) | wasted tokens |"
    )
    out = [head, "|" + "---|" * 10]
    for p in result["points"]:
        s = p["summary"]
        refused = ", ".join(f"{k} {v}" for k, v in s["step_refusals"].items()) or "none"
        inter = ", ".join(f"{k} {v}" for k, v in s["interactive_refusals"].items()) or "none"
        out.append(
            f"| {p['load']:g}x | {p['scheduler']} | {s['tasks']} | {s['tasks_good']} | "
            f"{s['task_goodput_per_min']:.1f} | {ms(s['task_e2e_p50_ms'])} | "
            f"{ms(s['task_e2e_p95_ms'])} | {ms(s['interactive_p95_ms'])} "
            f"({s['interactive_ok']}/{s['interactive']}) | {refused}; {inter} | "
            f"{s['wasted_tokens']} |"
        )
    return out


def plot(result: dict[str, Any], path: Path) -> Path:
    """Task goodput, task E2E p95 and interactive p95 per load, one line per scheduler."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = (
        ("task_goodput_per_min", "task goodput (tasks within deadline / min)"),
        ("task_e2e_p95_ms", "task E2E p95 (ms), completed tasks"),
        ("interactive_p95_ms", "interactive p95 (ms), answered calls"),
    )
    fig, axes = plt.subplots(1, len(panels), figsize=(15, 4.5))
    for ax, (metric, title) in zip(axes, panels, strict=True):
        for name in result["schedulers"]:
            pts = [p for p in result["points"] if p["scheduler"] == name]
            ys = [p["summary"][metric] for p in pts]
            ax.plot([p["load"] for p in pts], [float("nan") if y is None else y for y in ys],
                    marker="o", label=name)  # fmt: skip
        if metric == "task_e2e_p95_ms":
            ax.axhline(result["workload"]["task"]["deadline_s"] * 1000, ls="--", c="grey")
        if metric == "interactive_p95_ms":
            ax.axhline(result["workload"]["interactive"]["slo_ms"], ls="--", c="grey")
        ax.set_xlabel("offered load (x capacity)")
        ax.set_title(title, fontsize=10)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
