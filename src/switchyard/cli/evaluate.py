"""Offline checks of a model and of the router: `switchyard determinism` and
`switchyard route eval`."""

from __future__ import annotations

import argparse
import json
import sys

from switchyard.config import load_settings


def cmd_determinism(args: argparse.Namespace) -> int:
    """determinism --model M --prompts FILE: the same prompts alone, in batches of
    several sizes and orders, and after an engine restart (engines/determinism.py)."""
    import asyncio

    from switchyard.engines.determinism import render, run

    settings = load_settings(args.config)
    model = next((m for m in settings.models if m.alias == args.model), None)
    if model is None:
        print(f"switchyard: no model '{args.model}' in the config", file=sys.stderr)
        return 2
    with open(args.prompts) as f:
        prompts = [
            json.loads(line) if line.lstrip().startswith("{") else {"prompt": line.rstrip("\n")}
            for line in f
            if line.strip()
        ]
    report = asyncio.run(run(model, prompts, args.max_tokens, args.seed, args.batches))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)
    print(json.dumps(report, indent=2) if args.json else render(report))
    return 0 if report["equal_all"] else 1


def add_determinism(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    de = sub.add_parser(
        "determinism", help="is a local model's output the same alone, batched and restarted?"
    )
    de.add_argument(
        "--model", required=True, help="a llamacpp (server runtime) or vllm model of the config"
    )
    de.add_argument("--prompts", required=True, help="a text file (a prompt per line) or JSONL")
    de.add_argument("--max-tokens", type=int, default=32)
    de.add_argument("--seed", type=int, default=1234)
    de.add_argument("--batches", default="1,2,4", help="batch sizes to run each prompt in")
    de.add_argument("--out", help="write the JSON report here too")
    de.add_argument("--json", action="store_true")
    de.add_argument("--config")
    de.set_defaults(func=cmd_determinism)


def add_route(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    route = sub.add_parser("route", help="semantic routing")
    rsub = route.add_subparsers(dest="route_command", required=True)
    from switchyard.decide.route_eval import add_arguments as add_route_eval

    add_route_eval(rsub.add_parser("eval", help="evaluate the router on a labelled JSONL file"))
