"""The Ray Serve config for a Switchyard config: what `serve run` / `serve deploy`
accept and what a KubeRay RayService embeds as `spec.serveConfigV2`.

One application per piece, so each gets its own HTTP route on Serve's proxy:

- `switchyard` at `/`: the gateway deployment (`ray.gateway_replicas` replicas);
- `engine-{alias}` at `/engines/{alias}` for each local model (llama.cpp or vLLM): its
  engine deployment, autoscaled between `ray.engines.min_replicas` and `max_replicas`.

The deployment options live in the app builders (ray_app.py), read from the same
Switchyard config, so this file and `switchyard serve --ray` cannot disagree; the
config below repeats them only so that an operator sees them and may override them.
Imports nothing from Ray: it runs where Ray is not installed.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from typing import Any

from switchyard.config import LlamaCppEngine, Settings, VllmEngine

GATEWAY_APP = "switchyard"
GATEWAY_DEPLOYMENT = "Gateway"
ENGINE_DEPLOYMENT = "Engine"

# The gateway replicas' credential at the engine applications, which Serve's proxy would
# otherwise open to anyone who reaches it: derived from the admin key (every node has
# it), so no second secret is needed, and sent as the engines' bearer key.
ENGINE_TOKEN_ENV = "SWITCHYARD_ENGINE_TOKEN"


def engine_token(settings: Settings) -> str:
    env = settings.auth.admin_key_env
    admin = os.environ.get(env)
    if not admin:
        raise RuntimeError(
            f"under Ray, {env} must be set on every node: it keys the admin API and the "
            "gateway's credential at the engine deployments"
        )
    return hmac.new(admin.encode(), b"switchyard-engine", hashlib.sha256).hexdigest()


def engine_app_name(alias: str) -> str:
    return f"engine-{alias}"


# Where the engine applications are, each at `/{alias}` under it: the engine front's
# layout (engines/front.py), as the gateway replicas' settings name them.
ENGINES_ROUTE = "/engines"


def engine_route(alias: str) -> str:
    return f"{ENGINES_ROUTE}/{alias}"


def local_aliases(settings: Settings) -> list[str]:
    return [m.alias for m in settings.models if isinstance(m.engine, LlamaCppEngine | VllmEngine)]


def autoscaling(settings: Settings) -> dict[str, Any]:
    e = settings.ray.engines
    out: dict[str, Any] = {
        "min_replicas": e.min_replicas,
        "max_replicas": e.max_replicas,
        "target_ongoing_requests": e.target_ongoing_requests,
        "upscale_delay_s": e.upscale_delay_s,
        "downscale_delay_s": e.downscale_delay_s,
    }
    if e.initial_replicas is not None:
        out["initial_replicas"] = e.initial_replicas
    return out


def engine_options(settings: Settings) -> dict[str, Any]:
    e = settings.ray.engines
    actor: dict[str, Any] = {"num_cpus": e.num_cpus}
    if e.num_gpus:
        actor["num_gpus"] = e.num_gpus
    return {
        "autoscaling_config": autoscaling(settings),
        "max_ongoing_requests": e.max_ongoing_requests,
        # Beyond the replicas and this queue (while a new replica loads, say): 503
        # with Retry-After at once, never an unbounded wait.
        "max_queued_requests": e.max_queued_requests,
        "backpressure_config": {"status_code": 503, "retry_after_s": e.retry_after_s},
        "ray_actor_options": actor,
        # The first real answer (weights loaded, a generation through the API) is the
        # replica's start; the health check is a real request too.
        "health_check_period_s": 10.0,
        "health_check_timeout_s": 30.0,
        "graceful_shutdown_timeout_s": 20.0,
    }


def gateway_options(settings: Settings) -> dict[str, Any]:
    return {
        "num_replicas": settings.ray.gateway_replicas,
        "ray_actor_options": {"num_cpus": settings.ray.gateway_num_cpus},
        "max_ongoing_requests": 1000,
        "health_check_period_s": 5.0,
    }


def serve_config(settings: Settings, args: dict[str, Any]) -> dict[str, Any]:
    """The Serve config (ServeDeploySchema's shape). `args` reaches every app builder:
    {"config": path} for a file every node has, or {"settings": {...}} inline."""
    apps: list[dict[str, Any]] = [
        {
            "name": GATEWAY_APP,
            "route_prefix": "/",
            "import_path": "switchyard.scale.ray_app:gateway_app",
            "args": dict(args),
            "deployments": [{"name": GATEWAY_DEPLOYMENT, **gateway_options(settings)}],
        }
    ]
    for alias in local_aliases(settings):
        apps.append(
            {
                "name": engine_app_name(alias),
                "route_prefix": engine_route(alias),
                "import_path": "switchyard.scale.ray_app:engine_app",
                "args": {**args, "alias": alias},
                "deployments": [{"name": ENGINE_DEPLOYMENT, **engine_options(settings)}],
            }
        )
    return {
        "proxy_location": "EveryNode",
        "http_options": {"host": settings.ray.host, "port": settings.ray.port},
        "applications": apps,
    }
