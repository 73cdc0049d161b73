"""`switchyard models weights | promote | rollback ALIAS`: a model's deployment weights
and its canary, stored where the gateway with this config reads them."""

from __future__ import annotations

import argparse
import json
import sys

from switchyard.cli._options import add_store_options
from switchyard.config import load_settings, store_target


def cmd_models(args: argparse.Namespace) -> int:
    """models weights | promote | rollback ALIAS: the deployment weights, stored where
    the gateway with this config reads them (it applies a change within seconds)."""
    from switchyard.config import ConfigError
    from switchyard.state.sql import connect
    from switchyard.state.weights import canary_weights, read_weights, write_weights

    try:
        settings = load_settings(getattr(args, "config", None))
    except ConfigError as exc:
        print(f"switchyard: {exc}", file=sys.stderr)
        return 2
    model = next((m for m in settings.models if m.alias == args.alias), None)
    if model is None or not model.deployments:
        print(f"switchyard: the model '{args.alias}' has no deployments", file=sys.stderr)
        return 1
    configured = {d.name: d.weight for d in model.deployments}
    canary = {d.name for d in model.deployments if d.canary}
    conn = connect(store_target(settings, args.db))
    try:
        if args.action in ("promote", "rollback"):
            if not canary:
                print(f"switchyard: the model '{args.alias}' has no canary", file=sys.stderr)
                return 1
            weights = canary_weights(args.action, configured, canary)
            write_weights(conn, args.alias, weights, f"{args.action} by the CLI")
        stored = read_weights(conn).get(args.alias, {})
    finally:
        conn.close()
    now = {n: stored[n]["weight"] if n in stored else w for n, w in configured.items()}
    out = {
        "model": args.alias,
        "weights": now,
        "config": configured,
        "canaries": sorted(canary),
        "stored": stored,
    }
    print(json.dumps(out, indent=2))
    return 0


def add_models(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    models = sub.add_parser(
        "models", help="deployment weights of a model: show, promote or roll back its canary"
    )
    msub = models.add_subparsers(dest="action", required=True)
    for action, what in (
        ("weights", "every deployment's weight now and in the config"),
        ("promote", "the canaries take all the traffic"),
        ("rollback", "the canaries take none; the others get their configured weight"),
    ):
        mp = msub.add_parser(action, help=what)
        mp.add_argument("alias")
        add_store_options(mp)
        mp.set_defaults(func=cmd_models)
