"""Command line: `switchyard serve`, `switchyard bench ...`."""

# One module per command group: serve (serve, ray-config, check-config), keys (tenants,
# keys), models, approvals, records (trace, cost, rollouts), evaluate (determinism, route),
# cache, bench. Each adds its commands' parsers; the admin commands call the same
# in-process functions as the admin API, so they work without a running gateway.

from __future__ import annotations

import argparse
import os
import sys

from switchyard.cli import approvals, bench, cache, evaluate, keys, models, records, serve
from switchyard.config import ConfigError
from switchyard.state.sql_pg import StoreUnavailable

__all__ = ["build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    """Every command, in the order `switchyard --help` and the CLI reference list them."""
    ap = argparse.ArgumentParser(prog="switchyard", description=__doc__)
    sub = ap.add_subparsers(dest="command", required=True)
    serve.add_serve(sub)
    serve.add_ray_config(sub)
    serve.add_check_config(sub)
    keys.add_tenants(sub)
    models.add_models(sub)
    keys.add_keys(sub)
    records.add_trace(sub)
    records.add_cost(sub)
    approvals.add_approve(sub)
    records.add_rollouts(sub)
    evaluate.add_determinism(sub)
    cache.add_cache(sub)
    evaluate.add_route(sub)
    bench.add_bench(sub)
    return ap


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except ConfigError as exc:  # a bad config fails here, naming the key, for every command
        print(f"switchyard: {exc}", file=sys.stderr)
        return 2
    except StoreUnavailable as exc:  # the database cannot be reached: said, not a traceback
        print(f"switchyard: {exc}", file=sys.stderr)
        return 1
