"""Switchyard as a Ray Serve application.

- `gateway_app(args)`: the gateway, `ray.gateway_replicas` replicas behind Serve's
  HTTP proxy. Each replica runs the same ASGI app as `switchyard serve` (its lifespan
  starts the gateway: ledger writer, limits, breakers), with one change: every local
  model's engine is replaced by an OpenAI upstream at that model's engine application
  on Serve's proxy of the same node (`http://127.0.0.1:{ray.port}/engines/{alias}/v1`).
  So the gateway's decisions (limits, cache, routing, retries, breakers) stay exactly
  those of one machine, and shared state comes from `storage.redis_url` and
  `storage.postgres_dsn` as for several processes anywhere.
- `engine_app(args)`: one local model's engine, autoscaled by Serve on requests in
  flight. A replica supervises its own llama.cpp (or vLLM) server with the same
  supervisor as `switchyard serve` (portable build, crash named with its signal). It is
  started when the model has answered a real generation (the supervisor's warm-up),
  and Serve's health check sends it another real request every period. A request is
  answered by the engine front's rule (engines/front.py `answer`: token, routes, body
  bound, adapter, the residency pool's hold and its release), which also serves the
  local engines to the workers of `switchyard serve --workers N`.

Why HTTP through Serve's proxy between the two, not a deployment handle: the gateway
keeps one upstream client (timeouts, first-byte deadline, SSE relay, retry classes)
for every kind of upstream, and Serve's proxy is what counts requests in flight per
engine replica for autoscaling. The price is one loopback hop per request (measured in
`switchyard bench ray`, docs/benchmarks/2026-12-02-ray-serve.md).

The args of both builders: {"config": path} (a file every node has) or
{"settings": {...}} (the Switchyard config inline, as a KubeRay manifest carries it).
"""

from __future__ import annotations

import logging
import os
from typing import Any

import aiohttp
from ray import serve
from ray.serve import Application
from starlette.requests import Request
from starlette.responses import Response

from switchyard.config import (
    LlamaCppEngine,
    Settings,
    VllmEngine,
    load_settings,
    parse_settings,
)
from switchyard.engines.front import EngineTarget, answer, remote_engines, split_path
from switchyard.engines.llamacpp import AdapterFile
from switchyard.engines.pool import EnginePool
from switchyard.scale.serve_config import (
    ENGINE_DEPLOYMENT,
    ENGINE_TOKEN_ENV,
    ENGINES_ROUTE,
    GATEWAY_DEPLOYMENT,
    engine_options,
    engine_token,
    gateway_options,
)

log = logging.getLogger("switchyard.ray")


def settings_from(args: dict[str, Any]) -> Settings:
    if "settings" in args:
        return parse_settings(args["settings"], "the Serve app's args.settings")
    return load_settings(args.get("config"))


def gateway_settings(settings: Settings) -> Settings:
    """The gateway replicas' settings: local engines become the engine applications on
    Serve's proxy of the same node (one per model's own engine: scale/serve_config.py)."""
    engines = f"http://127.0.0.1:{settings.ray.port}{ENGINES_ROUTE}"
    return remote_engines(settings, engines, ENGINE_TOKEN_ENV, deployments=False)


@serve.deployment(name=GATEWAY_DEPLOYMENT)
@serve.ingress()
class GatewayDeployment:
    def __init__(self, args: dict[str, Any]) -> None:
        self.settings = gateway_settings(settings_from(args))
        os.environ[ENGINE_TOKEN_ENV] = engine_token(self.settings)

    def __serve_build_asgi_app__(self) -> Any:
        from switchyard.api.app import create_app

        replica = serve.get_replica_context().replica_id.unique_id
        return RequestIdAlias(create_app(self.settings), replica)


class RequestIdAlias:
    """Serve's proxy appends its own `X-Request-ID` to every response (a second value
    beside the gateway's `req_...`; clients that join them see "req_..., <uuid>"). The
    gateway's id is therefore also sent as `x-switchyard-request-id`, the one to quote
    in `x-parent-request-id` and trace lookups under Ray. `x-switchyard-gateway-replica`
    names the replica that answered. Lifespan and everything else pass through
    untouched."""

    def __init__(self, app: Any, replica: str = "") -> None:
        self.app = app
        self.router = getattr(app, "router", None)
        self.replica = (b"x-switchyard-gateway-replica", replica.encode()[:128])

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def aliased(message: Any) -> None:
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", []))
                for name, value in headers:
                    if name == b"x-request-id":
                        headers.append((b"x-switchyard-request-id", value))
                        break
                headers.append(self.replica)
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, aliased)


@serve.deployment(name=ENGINE_DEPLOYMENT)
class EngineDeployment:
    """One replica of one local model's engine (see the module doc)."""

    async def __init__(self, args: dict[str, Any]) -> None:  # type: ignore[misc]  # Serve awaits it
        from switchyard.engines import lora_train
        from switchyard.engines.llamacpp import ManagedLlamaCpp
        from switchyard.engines.vllm import ManagedVllm

        # Demonstration adapters: trained once per machine (a file lock), then cached.
        settings = lora_train.resolve(settings_from(args))
        alias = str(args["alias"])
        model = next((m for m in settings.models if m.alias == alias), None)
        if model is None or not isinstance(model.engine, LlamaCppEngine | VllmEngine):
            raise ValueError(f"no local model {alias!r} in the Switchyard config")
        kind = ManagedVllm if isinstance(model.engine, VllmEngine) else ManagedLlamaCpp
        self.alias = alias
        self.token = engine_token(settings).encode()
        files = tuple(
            AdapterFile(a.name, a.path, a.digest, a.revision)
            for a in settings.adapters
            if a.base == alias
        )
        self.engine = kind(alias, model.engine, settings.engines.max_crash_restarts, files)
        # Adapter residency in this replica follows the rules of one machine (at most
        # max_adapters loaded, max_active_adapters in use, a cold one loaded in place
        # of the least recently used idle one). Serve is told which adapters a replica
        # serves, and routes each adapter's requests to replicas that have it.
        pool = EnginePool({alias: self.engine}, settings.engines)

        async def known(name: str) -> str:
            """Serve's multiplexed load: the replica's engine loads the adapter itself,
            per request, through the residency pool. (A function, not a bound method:
            Serve keeps its per-replica model cache as an attribute of it.)"""
            return name

        self.multiplexed = serve.multiplexed(
            max_num_models_per_replica=max(1, model.engine.max_adapters)
        )(known)
        self.target = EngineTarget(
            self.engine, pool, model.timeouts.total_s, on_adapter=self.multiplexed
        )
        self.replica = serve.get_replica_context().replica_id.unique_id
        self.engine.start()
        if not await self.engine.wait_ready(model.engine.startup_timeout_s):
            reason = self.engine.reason or "not ready in time"
            await self.engine.stop()
            # Serve reports the replica as failed to start, with this message.
            raise RuntimeError(f"engine {alias} failed to start: {reason}")
        self.session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=5)
        )
        log.info("engine %s replica %s ready (pid %d)", alias, self.replica, os.getpid())

    async def check_health(self) -> None:
        """Serve's health check: the model answers a real one-token generation."""
        if self.engine.draining is not None:  # restarting to change its adapters
            return
        if not self.engine.ready:
            raise RuntimeError(f"engine {self.alias} is {self.engine.state}: {self.engine.reason}")
        body = {"prompt": "Hello", "max_tokens": 1, "temperature": 0}
        async with self.session.post(
            self.engine.base_url + "/completions",
            json=body,
            timeout=aiohttp.ClientTimeout(total=20),
        ) as r:
            if r.status != 200:
                raise RuntimeError(f"engine {self.alias} answered the health check with {r.status}")
            await r.read()

    async def __call__(self, request: Request) -> Response:
        """One request, by the engine front's rule (engines/front.py `answer`). Serve
        cancels this handler when its client hangs up; the hold is released then too."""
        _, route = split_path(request.url.path)
        return await answer(
            request,
            self.token,
            self.target,
            route,
            serve.get_multiplexed_model_id(),
            self.session,
            {"x-switchyard-engine-replica": self.replica},
        )

    async def __del__(self) -> None:
        session = getattr(self, "session", None)
        if session is not None:
            await session.close()
        await self.engine.stop()


def gateway_app(args: dict[str, Any]) -> Application:
    settings = settings_from(args)
    gateway_settings(settings)  # refuse what Ray cannot serve before any replica starts
    return GatewayDeployment.options(**gateway_options(settings)).bind(args)  # type: ignore[attr-defined]


def engine_app(args: dict[str, Any]) -> Application:
    settings = settings_from(args)
    return EngineDeployment.options(**engine_options(settings)).bind(args)  # type: ignore[attr-defined]
