"""The deployments the gateway can send to: one per configured model alias.

A deployment pairs a model's config with its upstream client and, for managed local
models, the engine supervisor. The registry owns their lifecycle (control plane);
the data plane only reads `ready` and `upstream`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from switchyard.config import (
    AdapterConfig,
    LlamaCppEngine,
    ModelConfig,
    OpenAIEngine,
    Settings,
    VllmEngine,
)
from switchyard.engines.llamacpp import AdapterFile, ManagedLlamaCpp
from switchyard.engines.pool import EnginePool
from switchyard.engines.upstream import OpenAIUpstream
from switchyard.engines.vllm import ManagedVllm


@dataclass(slots=True)
class Deployment:
    model: ModelConfig
    upstream: OpenAIUpstream
    engine: ManagedLlamaCpp | None = None
    fixed_label: str | None = None  # an external upstream's label never changes
    # A LoRA adapter served by the base model's engine: clients name it as the model.
    adapter: AdapterConfig | None = None
    # (label, its response headers encoded), kept by the API layer (api/openai.py)
    encoded_headers: tuple[str, list[tuple[bytes, bytes]]] | None = None
    # Read several times per request; the model's config never changes.
    alias: str = field(init=False)
    upstream_model: str = field(init=False)  # the model name the upstream is sent
    # One deployment to try and no data boundary to check: the executor's short path.
    alone: bool = field(init=False)
    min_attempt_s: float = field(init=False)  # resilience.min_attempt_s
    # For an engine that loads adapters: the request's `lora` list (its adapter at
    # scale 1, or none for the base), set on every request; None for other engines.
    lora: Callable[[], list[dict[str, Any]]] | None = field(init=False)

    def __post_init__(self) -> None:
        self.alias = self.model.alias
        spec = self.model.engine
        model = spec.model if isinstance(spec, OpenAIEngine) else None
        self.upstream_model = model or self.model.alias
        vllm = self.engine is not None and self.engine.kind == "vllm"
        if self.adapter is not None and not vllm:  # vLLM serves an adapter by its name
            self.upstream_model = self.adapter.base
        self.lora = None
        if self.engine is not None and self.engine.adapters and not vllm:
            self.lora = self._lora
        self.alone = not self.model.fallbacks and self.model.data_boundary is None
        self.min_attempt_s = self.model.resilience.min_attempt_s

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
    def label(self) -> str:
        """What `x-switchyard-upstream` reports: where this request was served."""
        if self.fixed_label is not None:
            return self.fixed_label
        if self.engine is not None:
            return f"{self.engine.kind}:{self.engine.base_url.removesuffix('/v1')}"
        return self.upstream.base_url

    def _lora(self) -> list[dict[str, Any]]:
        """Every loaded adapter with its scale: 1 for this deployment's, 0 for the rest.
        Always the full list: llama-server applies an empty list as "every adapter at
        its global scale", which is 1 for an adapter loaded at start."""
        assert self.engine is not None
        ident = self.adapter_id()
        return [
            {"id": i, "scale": 1.0 if i == ident else 0.0}
            for i in sorted(self.engine.adapter_ids.values())
        ]

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
            out = {"kind": "openai", "state": "external", "ready": True, "upstream": self.label}
        out["revision"] = self.model.revision
        out["required"] = self.model.required
        return out


def _engine_url(engine: ManagedLlamaCpp) -> Callable[[], str]:
    """A restarted worker listens on a new port; the client follows it."""
    return lambda: engine.base_url


def _fixed_url(url: str) -> Callable[[], str]:
    return lambda: url


class Registry:
    def __init__(self, settings: Settings) -> None:
        self.deployments: dict[str, Deployment] = {}
        adapters: dict[str, list[AdapterConfig]] = {}
        for a in settings.adapters:
            adapters.setdefault(a.base, []).append(a)
        served = {m.alias: m for m in settings.served_models()}
        for m in settings.models:
            spec = m.engine
            if isinstance(spec, LlamaCppEngine | VllmEngine):
                mine = adapters.get(m.alias, [])
                files = tuple(AdapterFile(a.name, a.path, a.sha256, a.revision) for a in mine)
                kind = ManagedVllm if isinstance(spec, VllmEngine) else ManagedLlamaCpp
                engine = kind(m.alias, spec, settings.engines.max_crash_restarts, adapters=files)
                upstream = OpenAIUpstream(
                    f"{engine.kind}:{m.alias}", _engine_url(engine), max_connections=64
                )
                self.deployments[m.alias] = Deployment(m, upstream, engine)
                for a in mine:
                    # The adapter is its own alias over the base's engine and client.
                    am = served[a.name]
                    self.deployments[a.name] = Deployment(am, upstream, engine, adapter=a)
            else:
                url = spec.base_url
                upstream = OpenAIUpstream(
                    url, _fixed_url(url), spec.api_key(), spec.max_connections
                )
                self.deployments[m.alias] = Deployment(m, upstream, fixed_label=url)

        self.pool = EnginePool({e.alias: e for e in self.managed()}, settings.engines)

    def get(self, alias: str) -> Deployment | None:
        return self.deployments.get(alias)

    def managed(self) -> list[ManagedLlamaCpp]:
        return [
            d.engine
            for d in self.deployments.values()
            if d.engine is not None and d.adapter is None
        ]

    def start(self) -> None:
        self.pool.start()

    async def stop(self) -> None:
        await self.pool.stop()
        await asyncio.gather(*(e.stop() for e in self.managed()), return_exceptions=True)
        await asyncio.gather(
            *(d.upstream.close() for d in self.deployments.values()), return_exceptions=True
        )
