"""`switchyard bench placement`: a synthetic device-and-network trace through the
placement policy (decide/placement.py), in process and through a live gateway.

The trace (seeded): an hour, one step per second, of a CPU temperature that ramps from
65 °C to 95 °C and back with noise (sd 1.5 °C), a round trip to the cloud that steps
from 20 ms to 400 ms for a quarter of the hour, and a battery that drains from 100 % to
8 % and then charges. Each step is one request of 16 output tokens with a 400 ms
deadline; a fifth of them carry PII.

1. **In process**, on a simulated clock: the shipped policy (enter 85 °C / exit 75 °C,
   30 s dwell) against the same policy without hysteresis (enter = exit, no dwell),
   fed the same readings. A latency model stands in for the engines: the device
   answers in 40 ms + 6 ms per token (1.8 times that while it is above 85 °C: thermal
   throttling), the cloud in 15 ms + 2 ms per token plus the round trip and the upload
   of the request; the balancer's EWMAs are fed what each request took. Reported: mode
   changes per hour, deadline attainment, privacy violations (a PII request placed in
   the cloud: must be 0), the share served on the device.
2. **Live**: a gateway with a device and a cloud deployment (two scripted upstreams,
   delays set to the same model, the cloud's changed as the trace's round trip
   changes), a key that may report device state, and a compressed replay of the trace
   (every `--live-stride`-th step, dwell scaled down with it): the placement header,
   the upstream that served, privacy violations and deadline attainment as a client
   sees them.

A plot over time (temperature, round trip, where each request ran) is written beside
the JSON result.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from switchyard.bench.harness import (
    Child,
    free_port,
    http,
    machine_info,
    spawn,
    start_gateway,
    stop_all,
    wait_ready,
)
from switchyard.config import PlacementConfig, Settings
from switchyard.decide.placement import DeviceState, Network, Placer
from switchyard.engines.registry import Registry

HOUR = 3600
TOKENS = 16
DEADLINE_MS = 400.0
PII_SHARE = 0.2
BODY_BYTES = 600


@dataclass(frozen=True, slots=True)
class Step:
    t: float
    temp_c: float
    rtt_ms: float
    battery: float
    charging: bool
    private: bool


def trace(seed: int, seconds: int = HOUR) -> list[Step]:
    rng = random.Random(seed)
    out = []
    for i in range(seconds):
        phase = i / seconds
        ramp = 65.0 + 30.0 * math.sin(math.pi * phase)  # 65 → 95 → 65
        rtt = 400.0 if 0.55 <= phase < 0.8 else 20.0
        charging = phase >= 0.85
        battery = (
            100.0 - 92.0 * min(phase, 0.85) / 0.85 if not charging else 8.0 + 200 * (phase - 0.85)
        )
        out.append(
            Step(
                float(i),
                ramp + rng.gauss(0.0, 1.5),
                rtt,
                min(100.0, battery),
                charging,
                rng.random() < PII_SHARE,
            )
        )
    return out


def device_ms(step: Step) -> float:
    throttle = 1.8 if step.temp_c >= 85.0 else 1.0
    return (40.0 + 6.0 * TOKENS) * throttle


def cloud_ms(step: Step) -> float:
    return 15.0 + 2.0 * TOKENS + step.rtt_ms + BODY_BYTES * 8.0 / 10_000.0  # 10 Mbit/s up


def _deployments(placement: dict[str, Any]) -> tuple[Any, PlacementConfig]:
    s = Settings.model_validate(
        {
            "models": [
                {
                    "alias": "assist",
                    "deployments": [
                        {"name": "dev", "location": "device", "engine": _engine("dev")},
                        {"name": "cloud", "location": "cloud", "engine": _engine("cloud")},
                    ],
                    "placement": placement,
                }
            ]
        }
    )
    assert s.models[0].placement is not None
    return Registry(s).replicas["assist"], s.models[0].placement


def _engine(name: str) -> dict[str, Any]:
    return {"kind": "openai", "base_url": f"http://{name}.invalid/v1"}


def simulate(steps: list[Step], placement: dict[str, Any]) -> dict[str, Any]:
    """The policy over the trace on a simulated clock (module docstring, part 1)."""
    deps, cfg = _deployments(placement)
    dev, cloud = deps
    placer = Placer("assist", cfg)
    changes = met = violations = local = 0
    where: list[float] = []
    alpha = 0.3
    for st in steps:
        state = DeviceState(st.temp_c, st.battery, st.charging, 50.0, "header")
        changes += len(placer.observe(state, st.t))
        p = placer.decide(
            device=[dev],
            cloud=[cloud],
            private="PII found" if st.private else None,
            state=state,
            network=Network(st.rtt_ms, 10_000.0),
            nbytes=BODY_BYTES,
            tokens=TOKENS,
            remaining_ms=DEADLINE_MS,
            route=None,
            now=st.t,
        )
        assert p is not None
        on_device = p.location == "device"
        took = device_ms(st) if on_device else cloud_ms(st)
        if p.mode == "degraded":
            took *= 0.5  # degraded: half the tokens (degraded_max_tokens)
        d = dev if on_device else cloud
        server = took if on_device else took - st.rtt_ms - BODY_BYTES * 8.0 / 10_000.0
        seconds = server / 1000.0
        d.live.ttft_s = (
            seconds if d.live.ttft_s is None else (1 - alpha) * d.live.ttft_s + alpha * seconds
        )
        d.live.tpot_s = 0.0
        d.live.last_sample = st.t
        met += took <= DEADLINE_MS
        violations += st.private and not on_device
        local += on_device
        # Where a request that could go either way ran (a private one is always on the device).
        where.append(
            math.nan if st.private else 0 if not on_device else 2 if p.mode == "degraded" else 1
        )
    n = len(steps)
    return {
        "mode_changes": changes,
        "mode_changes_per_hour": changes * HOUR / max(1, steps[-1].t - steps[0].t + 1),
        "deadline_attainment": met / n,
        "privacy_violations": violations,
        "local_share": local / n,
        "where": where,
    }


def _post(url: str, body: bytes, headers: dict[str, str]) -> tuple[int, dict[str, str], float]:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    req = urllib.request.Request(url, data=body, method="POST", headers=headers)
    req.add_header("Content-Type", "application/json")
    t = time.perf_counter()
    try:
        with opener.open(req, timeout=30) as resp:
            resp.read()
            return int(resp.status), dict(resp.headers), (time.perf_counter() - t) * 1000.0
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), (time.perf_counter() - t) * 1000.0


def live(steps: list[Step], stride: int, work: Path) -> dict[str, Any]:
    """The compressed replay through a real gateway (module docstring, part 2)."""
    children: list[Child] = []
    try:
        ups = {}
        for name in ("dev", "cloud"):
            port = free_port()
            child = spawn(
                f"upstream-{name}",
                [sys.executable, "-m", "switchyard.bench.scripted_upstream", "--port", str(port)],
                work,
            )
            children.append(child)
            base = f"http://127.0.0.1:{port}"
            wait_ready(child, lambda b=base: http("GET", b + "/health")[0] == 200, 60)  # type: ignore[misc]
            ups[name] = base
        port = free_port()
        dwell = 30.0 / stride
        cfg = {
            "server": {"port": port},
            "storage": {"sqlite_path": str(work / "sy.db")},
            "auth": {"mode": "disabled"},  # anonymous: may report device state
            "embeddings": {"enabled": False},
            "models": [
                {
                    "alias": "assist",
                    "deployments": [
                        {
                            "name": n,
                            "location": "device" if n == "dev" else "cloud",
                            "engine": {"kind": "openai", "base_url": u + "/v1"},
                        }
                        for n, u in ups.items()
                    ],
                    "balance": {"affinity": False, "prefix_affinity": False},
                    "placement": {"min_dwell_s": dwell, "degraded_max_tokens": TOKENS // 2},
                }
            ],
        }
        path = work / "config.yaml"
        path.write_text(yaml.safe_dump(cfg))
        gw = start_gateway("gateway", path, port, work)
        children.append(gw)
        base = f"http://127.0.0.1:{port}"
        wait_ready(gw, lambda: http("GET", base + "/readyz")[0] == 200, 120)

        def delay(name: str, ms: float) -> None:
            fault = json.dumps({"fault": f"delay:{ms:.0f}", "count": None}).encode()
            http("PUT", ups[name] + "/control/fault", fault)

        sent: list[dict[str, Any]] = []
        rtt = None
        t0 = time.monotonic()
        for st in steps[::stride]:
            if st.rtt_ms != rtt:
                rtt = st.rtt_ms
                delay("cloud", cloud_ms(st))
            delay("dev", device_ms(st))
            text = (
                "mail jane.doe@example.com the numbers" if st.private else "summarise the numbers"
            )
            body = json.dumps(
                {
                    "model": "assist",
                    "max_tokens": TOKENS,
                    "messages": [{"role": "user", "content": text}],
                }
            ).encode()
            headers = {
                "x-switchyard-device-state": (
                    f"temp_c={st.temp_c:.1f}, battery={st.battery:.0f}, "
                    f"charging={'true' if st.charging else 'false'}"
                ),
                "x-switchyard-network": f"rtt_ms={st.rtt_ms:.0f}, uplink_kbps=10000",
                "x-request-timeout": f"{DEADLINE_MS / 1000:g}",  # what placement must meet
            }
            status, h, ms = _post(base + "/v1/chat/completions", body, headers)
            lower = {k.lower(): v for k, v in h.items()}
            sent.append(
                {
                    "status": status,
                    "private": st.private,
                    "upstream": lower.get("x-switchyard-upstream", ""),
                    "placement": lower.get("x-switchyard-placement", ""),
                    "ms": ms,
                }
            )
            wait = t0 + (st.t / stride) - time.monotonic()  # the trace, compressed
            if wait > 0:
                time.sleep(wait)
        served = [r for r in sent if r["status"] == 200]
        # x-switchyard-upstream names the deployment ("assist/dev"), never its URL.
        on_dev = [r for r in served if r["upstream"] == "assist/dev"]
        return {
            "requests": len(sent),
            "timeouts": sum(1 for r in sent if r["status"] == 504),  # past the deadline
            "errors": sum(1 for r in sent if r["status"] not in (200, 504)),
            "privacy_violations": sum(
                1 for r in served if r["private"] and r["upstream"] == "assist/cloud"
            ),
            "local_share": len(on_dev) / max(1, len(served)),
            "deadline_attainment": sum(1 for r in served if r["ms"] <= DEADLINE_MS)
            / max(1, len(sent)),
            "placements": _count(r["placement"] for r in served),
            "min_dwell_s": dwell,
        }
    finally:
        stop_all(children)


def _count(values: Any) -> dict[str, int]:
    out: dict[str, int] = {}
    for v in values:
        out[v] = out.get(v, 0) + 1
    return dict(sorted(out.items()))


def _plot(steps: list[Step], sims: dict[str, dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ts = [s.t / 60 for s in steps]
    fig, ax = plt.subplots(3, 1, figsize=(10, 7), sharex=True)
    ax[0].plot(ts, [s.temp_c for s in steps], lw=0.6)
    ax[0].axhline(85, ls="--", c="r", lw=0.8)
    ax[0].axhline(75, ls=":", c="g", lw=0.8)
    ax[0].set_ylabel("CPU °C")
    ax[1].plot(ts, [s.rtt_ms for s in steps], lw=0.8)
    ax[1].set_ylabel("RTT ms")
    for name, sim in sims.items():
        ax[2].plot(ts, sim["where"], lw=0.6, label=name, drawstyle="steps-post")
    ax[2].set_yticks([0, 1, 2], ["cloud", "device", "degraded"])
    ax[2].set_ylabel("requests without PII")
    ax[2].set_xlabel("minutes")
    ax[2].legend(loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--seconds", type=int, default=HOUR, help="trace length (one step a second)")
    p.add_argument(
        "--live-stride", type=int, default=30, help="live replay: every Nth step, N times faster"
    )
    p.add_argument("--no-live", action="store_true", help="only the in-process simulation")
    p.add_argument("--out", default=None)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    steps = trace(args.seed, args.seconds)
    sims = {
        "hysteresis": simulate(steps, {"min_dwell_s": 30.0, "degraded_max_tokens": TOKENS // 2}),
        "none": simulate(
            steps,
            {
                "min_dwell_s": 0.0,
                "degraded_max_tokens": TOKENS // 2,
                "thermal_c": {"enter": 85.0, "exit": 84.999},
                "battery_pct": {"enter": 15.0, "exit": 15.001},
                "memory_pct": {"enter": 92.0, "exit": 91.999},
            },
        ),
    }
    print(f"placement over a {args.seconds} s trace (seed {args.seed}), in process:")
    for name, s in sims.items():
        print(
            f"  {name:<10} mode changes/h {s['mode_changes_per_hour']:7.1f}  deadline met "
            f"{s['deadline_attainment']:.3f}  on device {s['local_share']:.3f}  privacy "
            f"violations {s['privacy_violations']}"
        )
    live_result = None
    if not args.no_live:
        with tempfile.TemporaryDirectory(prefix="switchyard-bench-placement-") as tmp:
            live_result = live(steps, args.live_stride, Path(tmp))
        print(
            f"  live       {live_result['requests']} requests, errors {live_result['errors']}, "
            f"past the deadline {live_result['timeouts']}, "
            f"on device {live_result['local_share']:.3f}, deadline met "
            f"{live_result['deadline_attainment']:.3f}, privacy violations "
            f"{live_result['privacy_violations']}; {live_result['placements']}"
        )
    out = Path(args.out or f"bench-results/placement-{time.strftime('%Y%m%d-%H%M%S')}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    plot = out.with_suffix(".png")
    _plot(steps, sims, plot)
    result = {
        "bench": "placement",
        "when": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": machine_info("wrk"),
        "workload": {
            "seconds": args.seconds,
            "seed": args.seed,
            "tokens": TOKENS,
            "deadline_ms": DEADLINE_MS,
            "pii_share": PII_SHARE,
            "live_stride": args.live_stride,
        },
        "simulated": {
            k: {kk: vv for kk, vv in v.items() if kk != "where"} for k, v in sims.items()
        },
        "live": live_result,
        "plot": str(plot),
    }
    out.write_text(json.dumps(result, indent=2))
    print(f"results: {out} (plot {plot})")
    bad = sum(int(s["privacy_violations"]) for s in sims.values())
    if live_result is not None:
        bad += int(live_result["privacy_violations"])
    return 1 if bad else 0
