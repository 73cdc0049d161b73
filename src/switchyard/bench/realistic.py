"""`switchyard bench overhead --scenario realistic` (on by default): Switchyard with a real key.

The `switchyard` target runs with auth off, and the `--policy` targets' key sets no
limits of its own, so neither pays what a production request pays. `sy-realistic`
serves the same model config (derived from the same YAML) as operators run it:

- auth on, a Bearer key on every request, the key with rpm 1,000,000 of its own;
- under a tenant with rpm 1,000,000, tpm 1,000,000,000, max_concurrency 1,000 and a
  daily budget of $1,000,000, held in the in-process limiter;
- the usage ledger, and decision traces stored under the default trace policy
  (`observe` left at its defaults: traces on, `traces_sample_ok` 1.0).

The limits are far above what a bench run reaches, so no request is refused (a non-2xx
answer fails the run: it would measure a refusal, not the cost of the checks), yet every
request reserves and settles on both the key's and the tenant's scopes.

`overhead.summarize` judges this target against the floor with the same targets as
`switchyard` (added p50 at c=1 at most 1.5x the floor's, req/s at c=32 at least 0.70x);
this module starts it, checks it really is what it claims, and describes it. The
`workers` scenario (bench/workers.py) starts the same gateway under another name with
`serve --workers N` through the same functions, so both are one config, key and check.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from switchyard.bench.harness import (
    AUTH_ON,
    Child,
    KeyedGateway,
    LimitValue,
    check_auth_on,
    expect_rows,
    prepare_keyed_gateway,
    readyz,
    start_gateway,
    wait_ready,
    write_scripts,
)

TARGET = "sy-realistic"
TENANT = "realistic"
TENANT_LIMITS: dict[str, LimitValue] = {
    "rpm": 1_000_000,
    "tpm": 1_000_000_000,
    "max_concurrency": 1_000,
    "budget_usd": 1_000_000,
    "budget_period": "day",
}
KEY_LIMITS: dict[str, LimitValue] = {"rpm": 1_000_000}
DESCRIPTION = (
    "switchyard serve, auth keys, a key with rpm 1e6 under a tenant with rpm 1e6, "
    "tpm 1e9, max_concurrency 1000 and a $1e6 daily budget (in-process limiter), "
    "SQLite usage ledger, decision traces under the default trace policy"
)


@dataclass(frozen=True, slots=True)
class RealisticTarget:
    """The started gateway: its chat URL, the wrk scripts carrying its key, its SQLite
    file, and the key (other endpoints of the same gateway are measured with it)."""

    name: str
    url: str
    scripts: dict[bool, Path]
    db: Path
    key: str


def prepare(
    workdir: Path, upstream_port: int, timeout_s: float, name: str = TARGET
) -> KeyedGateway:
    """Create the tenant and key (through the CLI) in a fresh SQLite file under `workdir`
    and write the gateway's config, for the target `name`; nothing is started yet."""
    return prepare_keyed_gateway(
        name,
        workdir,
        upstream_port,
        TENANT,
        TENANT_LIMITS,
        timeout_s,
        key_limits=KEY_LIMITS,
    )


def check_realistic(gw: KeyedGateway, max_tokens: int) -> None:
    """Refused without its key, served with it, and the smoke requests' usage rows and
    decision traces reach its SQLite file: else it is not the realistic target."""
    check_auth_on(gw.name, gw.url, gw.key, max_tokens)
    expect_rows(gw.name, gw.db, "usage", "usage rows")
    expect_rows(gw.name, gw.db, "traces", "decision trace rows (traces should be on)")


def start_realistic_target(
    workdir: Path,
    urls: dict[str, str],
    args: argparse.Namespace,
    children: list[Child],
    name: str = TARGET,
    workers: int = 1,
) -> RealisticTarget:
    """Start the realistic gateway, as the target `name` with `workers` processes,
    against the upstream already serving `urls["direct"]`; with several workers it is
    ready once every one of them listens.

    The started child is appended to `children` at once, so the caller stops it
    whatever happens here.
    """
    upstream_port = urlsplit(urls["direct"]).port
    assert upstream_port is not None
    gw = prepare(workdir, upstream_port, args.startup_timeout, name)
    child = start_gateway(gw.name, gw.config, gw.port, workdir, workers)
    children.append(child)
    wait_ready(child, partial(readyz, gw.port, workers), args.startup_timeout)
    check_realistic(gw, args.tokens)
    return RealisticTarget(
        gw.name, gw.url, write_scripts(workdir, gw.name, gw.key, args.tokens), gw.db, gw.key
    )


# --- results ----------------------------------------------------------------------------


def errors(summary: list[dict[str, Any]], target: str = TARGET) -> int:
    """Non-2xx and socket errors of a realistic target, over all scenarios and rounds."""
    return sum(int(s["targets"][target]["errors"]) for s in summary)


def check_errors(summary: list[dict[str, Any]], target: str = TARGET) -> int:
    """1 when a realistic target had errors: a refused request is not the cost of the
    checks, so the run fails (the results file is still written); else 0."""
    n = errors(summary, target)
    if n:
        print(
            f"switchyard: bench overhead: {target} had {n} non-2xx or socket errors; "
            "its numbers are not the cost of a realistic key",
            file=sys.stderr,
        )
    return 1 if n else 0


def workload(target: str, limiter: str) -> dict[str, Any]:
    """What a realistic target serves, for the JSON result's workload."""
    return {
        "target": target,
        "auth": AUTH_ON,
        "tenant": TENANT,
        "tenant_limits": TENANT_LIMITS,
        "key_limits": KEY_LIMITS,
        "observe": "defaults: metrics on, decision traces on (default trace policy)",
        "limiter": limiter,
    }


def record(result: dict[str, Any]) -> None:
    """Add what the realistic target was to the JSON result."""
    result["workload"]["targets"][TARGET] = DESCRIPTION
    result["workload"]["realistic"] = workload(TARGET, "in-process")
