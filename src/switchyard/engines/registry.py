"""The deployments the gateway can send to: one per configured model alias.

A deployment pairs a model's config with its upstream client and, for managed local
models, the engine supervisor. The registry owns their lifecycle (control plane);
the data plane only reads `ready` and `upstream`.
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from switchyard.config import (
    AdapterConfig,
    AnthropicEngine,
    DeploymentConfig,
    LlamaCppEngine,
    ModelConfig,
    OpenAIEngine,
    Settings,
    UpstreamEngine,
    VllmEngine,
)
from switchyard.engines.anthropic import AnthropicUpstream
from switchyard.engines.llamacpp import AdapterFile, ManagedLlamaCpp
from switchyard.engines.load import EngineLoad, LoadWatch
from switchyard.engines.pool import EnginePool
from switchyard.engines.token_ids import Support
from switchyard.engines.token_ids import support as token_ids_support
from switchyard.engines.upstream import OpenAIUpstream
from switchyard.engines.urls import shown_url
from switchyard.engines.vllm import ManagedVllm

# Ray Serve's proxy routes a request to a replica that has this model loaded.
MULTIPLEXED_MODEL_HEADER = "serve_multiplexed_model_id"


@dataclass(slots=True)
class Live:
    """A deployment's live state, for balancing (decide/balance.py): requests in
    flight, times chosen, and EWMAs of time to first token and per-token time."""

    in_flight: int = 0
    selected: int = 0
    ttft_s: float | None = None
    tpot_s: float | None = None
    last_sample: float = 0.0  # monotonic; 0 = never measured
    # The EWMAs as the decision evidence shows them (ms, rounded once per update)
    ttft_ms: float | None = None
    tpot_ms: float | None = None
    weight: float = 1.0  # its share now: the config's, or as set (stored) since
    # A canary's recent outcomes (monotonic time, ok, end-to-end ms) for its guard.
    outcomes: collections.deque[tuple[float, bool, float]] = field(
        default_factory=collections.deque
    )
    # Its engine's own reading (engines/load.py), shared by the deployments on one
    # engine; None when the engine is not read.
    engine: EngineLoad | None = None

    def engine_now(self, now: float) -> EngineLoad | None:
        """The engine's reading when it is fresh, else None (the gateway's own counts)."""
        load = self.engine
        return load if load is not None and load.fresh(now) else None

    def describe(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "in_flight": self.in_flight,
            "selected": self.selected,
            "ewma_ttft_ms": self.ttft_ms,
            "ewma_tpot_ms": self.tpot_ms,
            "weight": self.weight,
        }
        if self.engine is not None:
            out["engine_load"] = self.engine.describe(time.monotonic())
        return out


@dataclass(slots=True)
class Deployment:
    model: ModelConfig
    upstream: OpenAIUpstream
    engine: ManagedLlamaCpp | None = None
    fixed_label: str | None = None  # an external upstream's label never changes
    # A LoRA adapter served by the base model's engine: clients name it as the model.
    adapter: AdapterConfig | None = None
    # One of several deployments of the alias (models[].deployments[]), or None.
    replica: DeploymentConfig | None = None
    # (label, its response headers encoded), kept by the API layer (api/openai.py)
    encoded_headers: tuple[str, list[tuple[bytes, bytes]]] | None = None
    # Read several times per request; the model's config never changes.
    alias: str = field(init=False)
    upstream_model: str = field(init=False)  # the model name the upstream is sent
    # One deployment to try (no fallbacks, no failover to another deployment of the
    # alias) and no data boundary to check: the executor's short path.
    alone: bool = field(init=False)
    min_attempt_s: float = field(init=False)  # resilience.min_attempt_s
    # For an engine that loads adapters: the request's `lora` list (its adapter at
    # scale 1, or none for the base), set on every request; None for other engines.
    lora: Callable[[], list[dict[str, Any]]] | None = field(init=False)
    # Headers sent upstream with every request of this deployment, or None.
    headers: dict[str, str] | None = field(init=False)
    # How its engine gives `return_token_ids` (engines/token_ids.py), or None.
    token_ids: Support | None = field(init=False)
    # Its engine schedules by the request's `priority` field (vLLM's priority policy).
    sends_priority: bool = field(init=False)

    # "alias" for an alias's only deployment, "alias/name" for one of several: the
    # key of its breaker and retry budget.
    name: str = field(init=False)
    live: Live = field(init=False)
    location: str = field(init=False)  # "device" or "cloud", for placement

    def __post_init__(self) -> None:
        self.alias = self.model.alias
        self.name = self.alias if self.replica is None else f"{self.alias}/{self.replica.name}"
        self.live = Live(weight=self.replica.weight if self.replica is not None else 1.0)
        self.location = (
            self.replica.where
            if self.replica is not None
            else ("device" if self.engine is not None else "cloud")
        )
        spec = self.model.engine
        model = spec.model if isinstance(spec, UpstreamEngine) else None
        self.upstream_model = model or self.model.alias
        if self.engine is not None and self.adapter is None:
            self.upstream_model = self.engine.alias  # the name its server serves
        vllm = self.engine is not None and self.engine.kind == "vllm"
        if self.adapter is not None and not vllm:  # vLLM serves an adapter by its name
            self.upstream_model = self.adapter.base
        self.lora = None
        if self.engine is not None and self.engine.adapters and not vllm:
            self.lora = self._lora
        self.headers = None
        if self.adapter is not None and self.engine is None:
            # The base's engine runs elsewhere: an engine application under Ray Serve
            # (scale/ray_app.py) that applies the adapter named as the model, on a
            # replica Serve picks by this header (serve.multiplexed).
            self.upstream_model = self.adapter.name
            self.headers = {MULTIPLEXED_MODEL_HEADER: self.adapter.name}
        self.alone = (
            not self.model.fallbacks
            and self.model.data_boundary is None
            and (self.replica is None or self.model.balance.failover == 0)
        )
        self.min_attempt_s = self.model.resilience.min_attempt_s
        self.token_ids = token_ids_support(self.model)
        # vLLM's priority scheduler, managed or external: the request's class is sent
        priority_spec = isinstance(spec, VllmEngine | OpenAIEngine)
        self.sends_priority = (
            priority_spec and getattr(spec, "scheduling_policy", "fcfs") == "priority"
        )

    @property
    def ready(self) -> bool:
        if self.engine is None:
            return True
        if self.adapter is not None:
            return self.engine.ready and self.adapter.name in self.engine.adapter_ids
        return self.engine.ready

    @property
    def loadable(self) -> bool:
        """Not loaded, and the pool loads it on the first request (lazy or evicted;
        for an adapter, also a cold one in a running engine)."""
        if self.engine is None:
            return False
        if self.adapter is not None and self.engine.ready:
            return self.engine.adapter_state(self.adapter.name) in ("cold", "loading")
        return self.engine.cold

    @property
    def failed(self) -> bool:
        """The engine cannot start and is no longer restarted (reason in describe())."""
        return self.engine is not None and self.engine.failed

    @property
    def served_by(self) -> str:
        """What `x-switchyard-upstream` tells the client: the deployment's configured
        name ("alias", or "alias/deployment" for one of several). Never `label`: an
        upstream's URL is the operator's address book, not the client's business."""
        return self.name

    @property
    def label(self) -> str:
        """Where this request was served (an upstream's URL, a managed engine's kind
        and loopback address), for the operator's eyes only: traces, the ledger,
        spans, /readyz with the admin key. Clients get `served_by`."""
        if self.fixed_label is not None:
            return self.fixed_label
        if self.engine is not None:
            return f"{self.engine.kind}:{self.engine.base_url.removesuffix('/v1')}"
        return shown_url(self.upstream.base_url)  # never a credential in the URL

    def _lora(self) -> list[dict[str, Any]]:
        """The engine's adapters with their scales for this deployment's requests."""
        assert self.engine is not None
        return self.engine.lora_scales(self.adapter.name if self.adapter is not None else None)

    def adapter_id(self) -> int | None:
        """The adapter's id in the running engine (None: not loaded there)."""
        if self.adapter is None or self.engine is None:
            return None
        return self.engine.adapter_ids.get(self.adapter.name)

    def describe(self) -> dict[str, Any]:
        if self.adapter is not None and self.engine is not None:
            base = self.engine.describe()
            return {
                "kind": "adapter",
                "base": self.engine.alias,
                "base_revision": self.adapter.base_revision,
                "revision": self.adapter.revision,
                "state": base["adapters"][self.adapter.name]["state"],
                "engine_state": base["state"],
                "ready": self.ready,
                "error": base["adapters"][self.adapter.name]["error"],
                "required": False,
            }
        if self.engine is not None:
            out = self.engine.describe()
        else:
            kind = self.model.engine.kind
            out = {"kind": kind, "state": "external", "ready": True, "upstream": self.label}
        out["revision"] = self.model.revision
        out["required"] = self.model.required
        if self.replica is not None:
            out["deployment"] = self.replica.name
            out["region"] = self.model.region
            out["canary"] = self.replica.canary
            out["labels"] = self.replica.labels
            out.update(self.live.describe())
        return out


def others_at(deps: list[Deployment], own: Callable[[], int]) -> Callable[[], int]:
    """Other clients' requests at the engines of one alias's deployments: what the engines
    report running and waiting beyond `own()` (this gateway's requests holding the
    alias's slots). 0 while any of them is unread or stale: only a fresh picture of every
    engine says that capacity is taken."""

    def others() -> int:
        now = time.monotonic()
        loads: dict[int, EngineLoad] = {}
        for d in deps:
            load = d.live.engine_now(now)
            if load is None:
                return 0
            loads[id(load)] = load
        return max(0, sum(e.queued for e in loads.values()) - own())

    return others


def _engine_url(engine: ManagedLlamaCpp) -> Callable[[], str]:
    """A restarted worker listens on a new port; the client follows it."""
    return lambda: engine.base_url


def _fixed_url(url: str) -> Callable[[], str]:
    return lambda: url


@dataclass(frozen=True, slots=True)
class PoolEvents:
    """Who hears the residency pool's events (observe/metrics.py), given at
    construction: (event, alias, seconds) for "load", "evict", "unload"; (alias, MiB)
    as measured; (event, engine alias, adapter, seconds) for an adapter's "load",
    "evict", "promote"."""

    on_event: Callable[[str, str, float | None], None] | None = None
    on_memory: Callable[[str, float | None], None] | None = None
    on_adapter: Callable[[str, str, str, float | None], None] | None = None


class Registry:
    def __init__(self, settings: Settings, events: PoolEvents | None = None) -> None:
        # Per alias: its deployment (the first one, for an alias with several), and
        # every deployment of an alias with several (models[].deployments).
        self.deployments: dict[str, Deployment] = {}
        self.replicas: dict[str, list[Deployment]] = {}
        adapters: dict[str, list[AdapterConfig]] = {}
        for a in settings.adapters:
            adapters.setdefault(a.base, []).append(a)
        served = {m.alias: m for m in settings.served_models()}
        crash = settings.engines.max_crash_restarts
        for m in settings.models:
            if m.deployments:
                deps = [
                    _deployment(m.replica(d), f"{m.alias}/{d.name}", (), crash, d)
                    for d in m.deployments
                ]
                self.replicas[m.alias] = deps
                self.deployments[m.alias] = deps[0]
                continue
            mine = adapters.get(m.alias, [])
            files = tuple(AdapterFile(a.name, a.path, a.digest, a.revision) for a in mine)
            if m.alias in settings.rl.models and isinstance(m.engine, LlamaCppEngine | VllmEngine):
                # An RL-managed model's requests run on its active revision's engine
                # (engines/revisions.py); this one loads only for its adapters.
                spec = m.engine.model_copy(update={"lazy": True, "pinned": False})
                m = m.model_copy(update={"engine": spec})
            dep = _deployment(m, m.alias, files, crash, None)
            self.deployments[m.alias] = dep
            for a in mine:
                # The adapter is its own alias over the base's engine and client.
                am = served[a.name]
                self.deployments[a.name] = Deployment(am, dep.upstream, dep.engine, adapter=a)

        ev = events or PoolEvents()
        self.pool = EnginePool(
            {e.alias: e for e in self.managed()},
            settings.engines,
            ev.on_event,
            ev.on_memory,
            ev.on_adapter,
        )
        self.load_watch = LoadWatch(self._loads(settings), settings.engines.state_interval_s)

    def _loads(self, settings: Settings) -> list[EngineLoad]:
        """One reading per engine (deployments on one engine share its upstream client),
        attached to each deployment's live state; none when reading is off."""
        if settings.engines.state_interval_s <= 0:
            return []
        loads: dict[int, EngineLoad] = {}
        for d in self.every():
            kind = _load_kind(d)
            if kind is None:
                continue
            load = loads.get(id(d.upstream))
            if load is None:
                engine = d.engine
                load = loads[id(d.upstream)] = EngineLoad(
                    kind, _root(d.upstream), settings.engines.state_stale_s
                )
                if engine is not None:
                    load.up = _ready(engine)
            d.live.engine = load
        return list(loads.values())

    def every(self) -> list[Deployment]:
        """Every deployment: each alias's, and each of an alias with several."""
        out = [d for a, d in self.deployments.items() if a not in self.replicas]
        for deps in self.replicas.values():
            out.extend(deps)
        return out

    def get(self, alias: str) -> Deployment | None:
        return self.deployments.get(alias)

    def managed(self) -> list[ManagedLlamaCpp]:
        return [d.engine for d in self.every() if d.engine is not None and d.adapter is None]

    def start(self) -> None:
        self.pool.start()
        self.load_watch.start()

    async def stop(self) -> None:
        await self.load_watch.stop()
        await self.pool.stop()
        await asyncio.gather(*(e.stop() for e in self.managed()), return_exceptions=True)
        await asyncio.gather(*(d.upstream.close() for d in self.every()), return_exceptions=True)


def _load_kind(d: Deployment) -> str | None:
    """What `d`'s engine is, for reading its load (engines/load.py), or None."""
    if d.engine is not None:
        return d.engine.kind
    spec = d.model.engine
    if isinstance(spec, OpenAIEngine) and spec.load_metrics != "none":
        return spec.load_metrics
    return None


def _ready(engine: ManagedLlamaCpp) -> Callable[[], bool]:
    return lambda: bool(engine.ready)


def _root(upstream: OpenAIUpstream) -> Callable[[], str]:
    """The server's root URL now (its API base without /v1): a managed engine's moves
    when it restarts."""

    def root() -> str:
        base = upstream.base_url
        return base[:-3] if base.endswith("/v1") else base

    return root


def _deployment(
    m: ModelConfig,
    name: str,
    files: tuple[AdapterFile, ...],
    max_crash_restarts: int,
    replica: DeploymentConfig | None,
) -> Deployment:
    """A deployment of `m` on its engine: a managed one (named `name` in the pool and
    to its server) or an external upstream."""
    spec = m.engine
    if isinstance(spec, LlamaCppEngine | VllmEngine):
        kind = ManagedVllm if isinstance(spec, VllmEngine) else ManagedLlamaCpp
        engine = kind(name, spec, max_crash_restarts, adapters=files)
        upstream = OpenAIUpstream(f"{engine.kind}:{name}", _engine_url(engine), max_connections=64)
        return Deployment(m, upstream, engine, replica=replica)
    url = spec.base_url
    # Named in its errors by kind and deployment, as `x-switchyard-upstream` names it:
    # its address is the operator's (`fixed_label`: /readyz, the admin API), and an
    # upstream's error reaches the client.
    label = f"{spec.kind}:{name}"
    external = (
        AnthropicUpstream(label, url, spec.api_key(), spec.anthropic_version, spec.max_connections)
        if isinstance(spec, AnthropicEngine)
        else OpenAIUpstream(label, _fixed_url(url), spec.api_key(), spec.max_connections)
    )
    return Deployment(m, external, fixed_label=shown_url(url), replica=replica)
