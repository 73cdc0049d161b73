"""Command line: `switchyard serve`, `switchyard bench ...`."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from switchyard.config import ConfigError, Settings, load_settings


def _banner(settings: Settings, host: str, port: int) -> str:
    base = f"http://{host}:{port}"
    model = settings.models[0].alias
    return f"""
Switchyard is ready at {base}  (models: {", ".join(m.alias for m in settings.models)})

  curl {base}/v1/chat/completions -H 'Content-Type: application/json' \\
    -d '{{"model": "{model}", "messages": [{{"role": "user", "content": "Say hello"}}]}}'

  from openai import OpenAI
  client = OpenAI(base_url="{base}/v1", api_key="unused")
  r = client.chat.completions.create(model="{model}",
        messages=[{{"role": "user", "content": "Say hello"}}])
  print(r.choices[0].message.content)

  Health: {base}/healthz   Readiness: {base}/readyz
"""


def cmd_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from switchyard.api.app import create_app

    try:
        settings = load_settings(args.config)
    except ConfigError as exc:
        print(f"switchyard: {exc}", file=sys.stderr)
        return 2
    host = args.host or settings.server.host
    port = args.port if args.port is not None else settings.server.port
    logging.basicConfig(
        level=os.environ.get("SWITCHYARD_LOG_LEVEL", "INFO"),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    print(f"switchyard: starting on http://{host}:{port}; loading models (see /readyz)", flush=True)
    app = create_app(settings, on_ready=lambda: print(_banner(settings, host, port), flush=True))
    uvicorn.run(
        app,
        host=host,
        port=port,
        log_level="warning",
        access_log=False,
        timeout_graceful_shutdown=5,
    )
    return 0


def cmd_check_config(args: argparse.Namespace) -> int:
    try:
        settings = load_settings(args.config)
    except ConfigError as exc:
        print(f"switchyard: {exc}", file=sys.stderr)
        return 2
    print(f"ok: {len(settings.models)} model(s): {', '.join(m.alias for m in settings.models)}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="switchyard", description=__doc__)
    sub = ap.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="start the gateway")
    serve.add_argument("--config", help="YAML config; without it the embedded default is used")
    serve.add_argument("--host", default=None)
    serve.add_argument("--port", type=int, default=None)
    serve.set_defaults(func=cmd_serve)

    check = sub.add_parser("check-config", help="validate a config file and exit")
    check.add_argument("--config", required=True)
    check.set_defaults(func=cmd_check_config)

    bench = sub.add_parser("bench", help="benchmarks")
    bsub = bench.add_subparsers(dest="bench_command", required=True)
    from switchyard.bench.overhead import add_arguments as add_overhead

    add_overhead(bsub.add_parser("overhead", help="gateway overhead vs direct and a bare proxy"))
    return ap


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
