"""`switchyard bench overhead --observe`: what metrics, decision traces and OpenTelemetry cost.

The plain overhead bench runs Switchyard with the observe defaults: Prometheus metrics on
and a decision trace per request written to SQLite with the usage row. With `--observe`
two more Switchyard targets join the same interleaved rounds, serving the same model
config (derived from the same YAML, so only `observe` and the SQLite file differ):

- `sy-obs-off`: `observe: {metrics: false, traces: false}`, the gateway with no
  observability beyond the usage ledger (which is not optional);
- `sy-otel`: the defaults plus `observe.otel` exporting every span (request, stages,
  upstream attempts) as JSON lines to a file in the bench's scratch directory.

Two ratios per scenario, each against a target measured in the same rounds:
`switchyard / sy-obs-off` is the cost of metrics + decision traces, `sy-otel / switchyard`
the extra cost of OpenTelemetry export on top of them. Each is given for req/s and for
the added p50 (the target's p50 minus direct's).

Before measuring, each target is checked to really have what it claims: /metrics is
served or refused, trace rows are or are not written, spans reach the file.

This module builds on the process and HTTP helpers of `harness.py`; only `overhead.run`
calls into it, and only with `--observe`.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import yaml

from switchyard.bench.harness import (
    CHAT_PATH,
    Child,
    StartError,
    admin_headers,
    config_yaml,
    count_rows,
    expect_rows,
    free_port,
    http,
    package_version,
    readyz,
    smoke,
    start_gateway,
    wait_for,
    wait_ready,
)

BASELINE = "switchyard"  # observe defaults: metrics and decision traces on, no OTel
OFF_TARGET = "sy-obs-off"
OTEL_TARGET = "sy-otel"
OBSERVE_TARGETS = (OFF_TARGET, OTEL_TARGET)
SPANS_FILE = "spans.jsonl"
# (numerator, denominator, what the ratio measures)
RATIOS = (
    (BASELINE, OFF_TARGET, "metrics + decision traces"),
    (OTEL_TARGET, BASELINE, "OpenTelemetry export, on top of metrics + traces"),
)
DESCRIPTIONS = {
    OFF_TARGET: "as switchyard, with observe: {metrics: false, traces: false}",
    OTEL_TARGET: "as switchyard, with observe.otel exporting spans as JSON lines to a file",
}


@dataclass(frozen=True, slots=True)
class ObserveTarget:
    name: str
    url: str
    db: Path


# --- configuration ----------------------------------------------------------------------


def observe_section(name: str, workdir: Path) -> dict[str, Any]:
    if name == OFF_TARGET:
        return {"metrics": False, "traces": False}
    if name == OTEL_TARGET:
        return {"otel": {"exporter": "file", "path": str(workdir / SPANS_FILE)}}
    raise ValueError(name)


def observe_config(base_yaml: str, db_path: Path, observe: dict[str, Any]) -> str:
    """The baseline config with `observe` set and its own SQLite file.

    Derived from the baseline YAML rather than written anew, so the model config is the
    same by construction.
    """
    cfg: dict[str, Any] = yaml.safe_load(base_yaml)
    cfg["observe"] = observe
    cfg["storage"] = {"sqlite_path": str(db_path)}
    return yaml.safe_dump(cfg, sort_keys=False)


# --- checks -----------------------------------------------------------------------------


def check_observe(name: str, url: str, db: Path, workdir: Path, max_tokens: int) -> None:
    """Serve one plain and one streaming request, then check the target's observability
    is what its config says, so the ratios compare what they claim to."""
    smoke(name, url, max_tokens)
    base = url.removesuffix(CHAT_PATH)
    metrics_status, body = http("GET", base + "/metrics", headers=admin_headers())
    expect_rows(name, db, "usage", "usage rows")
    traces = count_rows(db, "traces")
    if name == OFF_TARGET:
        if metrics_status != 404:
            raise StartError(f"{name}: /metrics answered {metrics_status}, not 404 (metrics off)")
        if traces:
            raise StartError(f"{name}: {traces} trace rows written with traces off")
        return
    if metrics_status != 200 or b"switchyard_requests_total" not in body:
        raise StartError(f"{name}: /metrics answered {metrics_status}: {body[:300]!r}")
    expect_rows(name, db, "traces", "decision trace rows")
    if name == OTEL_TARGET:
        spans = workdir / SPANS_FILE
        if not wait_for(lambda: spans.exists() and spans.stat().st_size > 0):
            raise StartError(f"{name}: no spans written to {spans}")


# --- gateways ---------------------------------------------------------------------------


def start_observe_targets(
    workdir: Path,
    urls: dict[str, str],
    args: argparse.Namespace,
    children: list[Child],
) -> list[ObserveTarget]:
    """Start both observe gateways against the upstream already serving `urls`, and
    check the baseline's observability too (it is the reference for both ratios).

    Started children are appended to `children` at once, so the caller stops them
    whatever happens here.
    """
    upstream_port = urlsplit(urls["direct"]).port
    assert upstream_port is not None
    launched: list[tuple[str, Child, int, Path]] = []
    for name in OBSERVE_TARGETS:
        port = free_port()
        db = workdir / f"{name}.db"
        cfg = workdir / f"{name}.yaml"
        base = config_yaml(port, upstream_port, db)
        cfg.write_text(observe_config(base, db, observe_section(name, workdir)))
        child = start_gateway(name, cfg, port, workdir)
        children.append(child)
        launched.append((name, child, port, db))
    targets: list[ObserveTarget] = []
    for name, child, port, db in launched:
        wait_ready(child, partial(readyz, port), args.startup_timeout)
        url = f"http://127.0.0.1:{port}{CHAT_PATH}"
        check_observe(name, url, db, workdir, args.tokens)
        targets.append(ObserveTarget(name, url, db))
    check_observe(BASELINE, urls[BASELINE], _baseline_db(workdir), workdir, args.tokens)
    return targets


def _baseline_db(workdir: Path) -> Path:
    """Where `overhead.start_targets` put the baseline's SQLite file."""
    env_path = os.environ.get("SWITCHYARD_SQLITE_PATH")
    return Path(env_path) if env_path else workdir / "switchyard.db"


def spans_written(workdir: Path) -> dict[str, int]:
    """How many spans sy-otel exported (lines of the JSON-lines file) and its size."""
    path = workdir / SPANS_FILE
    lines = size = 0
    with contextlib.suppress(OSError), path.open("rb") as fh:
        while chunk := fh.read(1 << 20):
            lines += chunk.count(b"\n")
            size += len(chunk)
    return {"spans": lines, "bytes": size}


# --- results ----------------------------------------------------------------------------


def _ratio(num: float | None, den: float | None) -> float | None:
    if num is None or den is None or den <= 0:
        return None
    return num / den


def annotate(summary: list[dict[str, Any]]) -> None:
    """Add, under "observe", each observe target's added p50 and the two ratios to every
    scenario of `summary`."""
    for s in summary:
        med = s["targets"]
        added = {
            name: med[name]["p50_ms"] - med["direct"]["p50_ms"]
            for name in (BASELINE, *OBSERVE_TARGETS)
        }
        ratios: dict[str, dict[str, Any]] = {}
        for num, den, what in RATIOS:
            ratios[f"{num} / {den}"] = {
                "measures": what,
                "rps": _ratio(med[num]["rps"], med[den]["rps"]),
                "added_p50": _ratio(added[num], added[den]),
            }
        s["observe"] = {
            "baseline": BASELINE,
            "targets": {name: {"added_p50_ms": added[name]} for name in OBSERVE_TARGETS},
            "ratios": ratios,
        }


def _num(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}"


def lines(s: dict[str, Any]) -> list[str]:
    """One line per ratio, for the rendered table."""
    return [
        f"{'':<16}{key}: req/s {_num(r['rps'])}, added p50 {_num(r['added_p50'])}"
        f"  ({r['measures']})"
        for key, r in s["observe"]["ratios"].items()
    ]


def errors(summary: list[dict[str, Any]]) -> dict[str, int]:
    """Non-2xx and socket errors per observe target, over all scenarios and rounds."""
    return {
        name: sum(int(s["targets"][name]["errors"]) for s in summary) for name in OBSERVE_TARGETS
    }


def check_errors(summary: list[dict[str, Any]]) -> int:
    """1 when an observe target had errors: an error answer is not the cost of observing
    it, so the run fails (the results file is still written); else 0."""
    bad = {name: n for name, n in errors(summary).items() if n}
    for name, n in bad.items():
        print(
            f"switchyard: bench overhead: {name} had {n} non-2xx or socket errors; "
            "its numbers are not the cost of observability",
            file=sys.stderr,
        )
    return 1 if bad else 0


def record(result: dict[str, Any], spans: dict[str, int] | None) -> None:
    """Add what the observe targets were to the JSON result."""
    workload = result["workload"]
    workload["targets"].update(DESCRIPTIONS)
    workload["observe"] = {
        "baseline": BASELINE,
        "baseline_observe": "defaults: metrics on, decision traces on, otel none",
        "configs": {
            OFF_TARGET: observe_section(OFF_TARGET, Path("<workdir>")),
            OTEL_TARGET: observe_section(OTEL_TARGET, Path("<workdir>")),
        },
        "ratios": {f"{num} / {den}": what for num, den, what in RATIOS},
        "otel_spans_written": spans,
    }
    result["machine"]["versions"].update(
        {d: package_version(d) for d in ("prometheus-client", "opentelemetry-sdk")}
    )
