"""The overhead bench's verdict: the targets it judges, the thresholds it judges them by,
and the summary and table it prints.

`summarize` takes the wrk runs of every round and gives, per scenario, the medians per
target, each judged target's added p50 and req/s against the floor (ratios of medians and
each round's own), and PASS or MISS, and, when nginx was measured, what the native
proxy hop adds beside what the Python floor adds; `render` prints that as the table
`bench overhead` shows, with the blocks the workers, governed and protocols scenarios
add. Starting and driving the targets is `overhead.py`'s.
"""

from __future__ import annotations

import argparse
import statistics
from typing import Any

from switchyard.bench import governed, native, observe, protocols, realistic, workers
from switchyard.bench.harness import Scenario

TARGETS = ("direct", "floor", "switchyard")
CORE = "switchyard"
# The Switchyard targets each scenario adds; each is judged against the floor.
SCENARIOS = {
    "core": CORE,
    "realistic": realistic.TARGET,
    "protocols": protocols.RESPONSES,  # and protocols.MESSAGES: started with realistic's
    "workers": workers.TARGET,
    "governed": governed.TARGET,
}
CHECKED_TARGETS = (*SCENARIOS.values(), protocols.MESSAGES)
CONCURRENCIES = (1, 32)
LATENCY_RATIO_MAX = 1.5  # Switchyard added p50 / floor added p50, at concurrency 1
THROUGHPUT_RATIO_MIN = 0.70  # Switchyard req/s / floor req/s, at concurrency 32


def summarize(
    runs: list[dict[str, Any]], targets: tuple[str, ...] = TARGETS
) -> list[dict[str, Any]]:
    """Medians per scenario and target, the added latencies, the ratios and the verdicts.

    `targets` must include direct and floor. Every target of CHECKED_TARGETS among them
    (`switchyard`, `sy-realistic`) is judged against the floor, under "checks"; the
    top-level ratio and verdict fields are `switchyard`'s, when it was measured.
    """
    out: list[dict[str, Any]] = []
    scenarios = [Scenario(s, c) for s in (False, True) for c in CONCURRENCIES]
    checked = [t for t in targets if t in CHECKED_TARGETS]
    for sc in scenarios:
        med: dict[str, dict[str, Any]] = {}
        for target in targets:
            mine = [r for r in runs if r["scenario"] == sc.name and r["target"] == target]
            med[target] = {
                key: statistics.median(r[key] for r in mine) for key in ("rps", "p50_ms", "p99_ms")
            }
            med[target]["errors"] = sum(r["non_2xx"] + r["socket_errors"] for r in mine)
            cpu = [r["cpu_us_per_req"] for r in mine if r.get("cpu_us_per_req") is not None]
            med[target]["cpu_us_per_req"] = statistics.median(cpu) if cpu else None
            split = [
                r["cpu_us_per_req_by_process"] for r in mine if r.get("cpu_us_per_req_by_process")
            ]
            if split:  # each process role's median (0 in a run where it had no process)
                roles = sorted({role for x in split for role in x})
                med[target]["cpu_by_process"] = {
                    role: statistics.median(x.get(role, 0.0) for x in split) for role in roles
                }
            share = [r["loader_cpu_share"] for r in mine if r.get("loader_cpu_share") is not None]
            med[target]["loader_cpu_share"] = statistics.median(share) if share else None
        floor_added = med["floor"]["p50_ms"] - med["direct"]["p50_ms"]
        if sc.connections == 1:
            check = f"added p50 ratio <= {LATENCY_RATIO_MAX}"
        else:
            check = f"req/s ratio >= {THROUGHPUT_RATIO_MIN}"
        checks = {t: _judge(runs, sc, med, t) for t in checked}
        entry: dict[str, Any] = {
            "scenario": sc.name,
            "stream": sc.stream,
            "connections": sc.connections,
            "targets": med,
            "floor_added_p50_ms": floor_added,
            "check": check,
            "checks": checks,
        }
        if native.NGINX_PROXY in med:
            entry["native"] = _native(med)
        if CORE in checks:  # switchyard's, at the top level, as before there were two
            core = checks[CORE]
            entry |= {
                "switchyard_added_p50_ms": core["added_p50_ms"],
                "added_p50_ratio": core["added_p50_ratio"],
                "rps_ratio": core["rps_ratio"],
                "per_round": core["per_round"],
                "verdict": core["verdict"],
            }
        out.append(entry)
    return out


def _native(med: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The native proxy hop in one scenario: its added p50 over its own upstream and its
    CPU per request, and the Python floor's of each as a multiple of it. Its upstream is
    nginx-direct, or direct itself when every proxy calls the nginx instant upstream
    (`--native-upstream`)."""
    proxy, floor = med[native.NGINX_PROXY], med["floor"]
    upstream = native.NGINX_DIRECT if native.NGINX_DIRECT in med else "direct"
    added = proxy["p50_ms"] - med[upstream]["p50_ms"]
    floor_added = floor["p50_ms"] - med["direct"]["p50_ms"]
    cpu, floor_cpu = proxy.get("cpu_us_per_req"), floor.get("cpu_us_per_req")
    return {
        "upstream": upstream,
        "proxy_added_p50_ms": added,
        "proxy_cpu_us_per_req": cpu,
        "floor_added_p50_over_proxy": (
            floor_added / added if added > 0 and floor_added > 0 else None
        ),
        "floor_cpu_over_proxy": floor_cpu / cpu if floor_cpu is not None and cpu else None,
    }


def _judge(
    runs: list[dict[str, Any]], sc: Scenario, med: dict[str, dict[str, float]], target: str
) -> dict[str, Any]:
    """One Switchyard target against the floor in one scenario: its added p50, the two
    ratios of medians, each round's own ratios and the verdict of this scenario's check."""
    floor_added = med["floor"]["p50_ms"] - med["direct"]["p50_ms"]
    added = med[target]["p50_ms"] - med["direct"]["p50_ms"]
    lat_ratio = added / floor_added if floor_added > 0 else None
    rps_ratio = med[target]["rps"] / med["floor"]["rps"] if med["floor"]["rps"] > 0 else None
    mine, floor_cpu = med[target].get("cpu_us_per_req"), med["floor"].get("cpu_us_per_req")
    cpu_ratio = mine / floor_cpu if mine is not None and floor_cpu else None
    if sc.connections == 1:
        ok = lat_ratio is not None and lat_ratio <= LATENCY_RATIO_MAX
    else:
        ok = rps_ratio is not None and rps_ratio >= THROUGHPUT_RATIO_MIN
    return {
        "added_p50_ms": added,
        "added_p50_ratio": lat_ratio,
        "rps_ratio": rps_ratio,
        "cpu_ratio": cpu_ratio,
        "per_round": _per_round(runs, sc.name, target),
        "verdict": "PASS" if ok else "MISS",
    }


def _per_round(runs: list[dict[str, Any]], scenario: str, target: str) -> dict[str, list[float]]:
    """Each round's own ratios of `target` to the floor (a round's targets ran minutes
    apart at most, so drift of the machine between rounds cancels): the spread behind
    the medians' verdict."""
    lat: list[float] = []
    rps: list[float] = []
    for rnd in sorted({r["round"] for r in runs}):
        got = {r["target"]: r for r in runs if r["scenario"] == scenario and r["round"] == rnd}
        if not all(t in got for t in ("direct", "floor", target)):
            continue
        floor_added = got["floor"]["p50_ms"] - got["direct"]["p50_ms"]
        if floor_added > 0:
            lat.append((got[target]["p50_ms"] - got["direct"]["p50_ms"]) / floor_added)
        if got["floor"]["rps"] > 0:
            rps.append(got[target]["rps"] / got["floor"]["rps"])
    return {"added_p50_ratio": lat, "rps_ratio": rps}


def _spread(xs: list[float]) -> str:
    if not xs:
        return "n/a"
    return f"{min(xs):.2f}-{max(xs):.2f} (median {statistics.median(xs):.2f})"


def _num(value: float | None, fmt: str) -> str:
    return "n/a" if value is None else format(value, fmt)


def _added_p50(s: dict[str, Any], target: str) -> float | None:
    """A target's added p50 over direct, as `summarize` (and `policy.annotate`,
    `observe.annotate`) stored it."""
    if target in ("direct", native.NGINX_DIRECT):
        return None  # an upstream, not a hop
    if target == native.NGINX_PROXY:
        proxy_added: float = s["native"]["proxy_added_p50_ms"]
        return proxy_added  # over its own upstream
    if target == "floor":
        floor_value: float = s["floor_added_p50_ms"]
        return floor_value
    if target in s.get("checks", {}):
        checked_value: float = s["checks"][target]["added_p50_ms"]
        return checked_value
    if target not in s.get("observe", {}).get("targets", {}) and "policy" not in s:
        added: float = s["targets"][target]["p50_ms"] - s["targets"]["direct"]["p50_ms"]
        return added  # a baseline measured beside a judged target (sy-gov-off)
    section = "observe" if target in s.get("observe", {}).get("targets", {}) else "policy"
    policy_value: float | None = s[section]["targets"][target]["added_p50_ms"]
    return policy_value


def _policy_lines(s: dict[str, Any]) -> list[str]:
    """One line per policy target: its ratios against policy-off Switchyard."""
    return [
        f"{'':<16}{name} / {s['policy']['baseline']}: "
        f"req/s {_num(p['rps_ratio_vs_policy_off'], '.2f')}, "
        f"added p50 {_num(p['added_p50_ratio_vs_policy_off'], '.2f')}"
        for name, p in s["policy"]["targets"].items()
    ]


def _check_lines(s: dict[str, Any]) -> list[str]:
    """Two lines per target judged against the floor: the ratios of medians with the
    verdict, and each round's own ratios."""
    lines = []
    for target, c in s.get("checks", {}).items():
        lines.append(
            f"{'':<16}added p50 {target}/floor {_num(c['added_p50_ratio'], '.2f')}, "
            f"req/s {target}/floor {_num(c['rps_ratio'], '.2f')}, "
            f"CPU/req {target}/floor {_num(c.get('cpu_ratio'), '.2f')}  "
            f"[{s['check']}: {c['verdict']}]"
        )
        pr = c["per_round"]
        if pr["added_p50_ratio"] or pr["rps_ratio"]:
            lines.append(
                f"{'':<16}  per round: added p50 ratio {_spread(pr['added_p50_ratio'])}, "
                f"req/s ratio {_spread(pr['rps_ratio'])}"
            )
    return lines


def _native_line(n: dict[str, Any]) -> str:
    """What the nginx proxy hop adds, and the Python floor's as a multiple of it."""
    return (
        f"{'':<16}native hop: nginx-proxy adds {n['proxy_added_p50_ms']:.3f} ms p50 over "
        f"{n['upstream']}, CPU/req {_num(n['proxy_cpu_us_per_req'], '.0f')} us; the floor's "
        f"added p50 {_num(n['floor_added_p50_over_proxy'], '.1f')}x, "
        f"CPU/req {_num(n['floor_cpu_over_proxy'], '.1f')}x"
    )


def _process_lines(s: dict[str, Any], targets: tuple[str, ...]) -> list[str]:
    """Where a target's CPU per request went, process by process (largest first), for
    the targets that run more than one process."""
    lines = []
    for target in targets:
        split = s["targets"][target].get("cpu_by_process") or {}
        if len(split) > 1:
            parts = sorted(split.items(), key=lambda kv: -kv[1])
            lines.append(
                f"  CPU us/req by process, {target}: "
                + ", ".join(f"{role} {used:.0f}" for role, used in parts)
            )
    return lines


def render(summary: list[dict[str, Any]], args: argparse.Namespace) -> str:
    targets = tuple(summary[0]["targets"]) if summary else TARGETS
    tw = max(12, *(len(t) + 2 for t in targets))
    lines = [
        f"Switchyard overhead: wrk, {args.duration} s per run, {args.rounds} round(s), "
        "medians across rounds",
        "",
        f"{'scenario':<16}{'target':<{tw}}{'req/s':>10}{'p50 ms':>10}{'p99 ms':>10}"
        f"{'+p50 ms':>10}{'CPU us/req':>12}{'wrk CPU':>9}",
    ]
    if getattr(args, "native_upstream", False):
        lines.insert(
            1, "direct is the nginx instant upstream every proxy calls (--native-upstream)"
        )
    for s in summary:
        for i, target in enumerate(targets):
            t = s["targets"][target]
            added = _added_p50(s, target)
            errors = f"  errors: {int(t['errors'])}" if t["errors"] else ""
            share = t.get("loader_cpu_share")
            lines.append(
                f"{s['scenario'] if i == 0 else '':<16}{target:<{tw}}{t['rps']:>10.1f}"
                f"{t['p50_ms']:>10.3f}{t['p99_ms']:>10.3f}{_num(added, '.3f'):>10}"
                f"{_num(t.get('cpu_us_per_req'), '.0f'):>12}"
                f"{_num(None if share is None else share * 100, '.0f'):>8}%{errors}"
            )
        lines.extend(_process_lines(s, targets))
        lines.extend(_check_lines(s))
        if "native" in s:
            lines.append(_native_line(s["native"]))
        if "policy" in s:
            lines.extend(_policy_lines(s))
        if "observe" in s:
            lines.extend(observe.lines(s))
        lines.append("")
    lines.extend(workers.lines(summary, getattr(args, "workers", None)))
    lines.extend(governed.lines(summary))
    lines.extend(protocols.lines(summary))
    return "\n".join(lines)
