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

from switchyard.config import LlamaCppEngine, ModelConfig, OpenAIEngine, Settings
from switchyard.engines.llamacpp import ManagedLlamaCpp
from switchyard.engines.upstream import OpenAIUpstream


@dataclass(slots=True)
class Deployment:
    model: ModelConfig
    upstream: OpenAIUpstream
    engine: ManagedLlamaCpp | None = None
    fixed_label: str | None = None  # an external upstream's label never changes
    # (label, its response headers encoded), kept by the API layer (api/openai.py)
    encoded_headers: tuple[str, list[tuple[bytes, bytes]]] | None = None
    # Read several times per request; the model's config never changes.
    alias: str = field(init=False)
    upstream_model: str = field(init=False)  # the model name the upstream is sent
    # One deployment to try and no data boundary to check: the executor's short path.
    alone: bool = field(init=False)
    min_attempt_s: float = field(init=False)  # resilience.min_attempt_s

    def __post_init__(self) -> None:
        self.alias = self.model.alias
        spec = self.model.engine
        model = spec.model if isinstance(spec, OpenAIEngine) else None
        self.upstream_model = model or self.model.alias
        self.alone = not self.model.fallbacks and self.model.data_boundary is None
        self.min_attempt_s = self.model.resilience.min_attempt_s

    @property
    def ready(self) -> bool:
        return self.engine.ready if self.engine is not None else True

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
            return f"llamacpp:{self.engine.base_url.removesuffix('/v1')}"
        return self.upstream.base_url

    def describe(self) -> dict[str, Any]:
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
        for m in settings.models:
            spec = m.engine
            if isinstance(spec, LlamaCppEngine):
                engine = ManagedLlamaCpp(m.alias, spec, settings.engines.max_crash_restarts)
                upstream = OpenAIUpstream(
                    f"llamacpp:{m.alias}", _engine_url(engine), max_connections=64
                )
                self.deployments[m.alias] = Deployment(m, upstream, engine)
            else:
                url = spec.base_url
                upstream = OpenAIUpstream(
                    url, _fixed_url(url), spec.api_key(), spec.max_connections
                )
                self.deployments[m.alias] = Deployment(m, upstream, fixed_label=url)

    def get(self, alias: str) -> Deployment | None:
        return self.deployments.get(alias)

    def managed(self) -> list[ManagedLlamaCpp]:
        return [d.engine for d in self.deployments.values() if d.engine is not None]

    def start(self) -> None:
        for e in self.managed():
            e.start()

    async def stop(self) -> None:
        await asyncio.gather(*(e.stop() for e in self.managed()), return_exceptions=True)
        await asyncio.gather(
            *(d.upstream.close() for d in self.deployments.values()), return_exceptions=True
        )
