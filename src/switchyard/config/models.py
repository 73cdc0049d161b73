"""One model alias clients may name: its engine or deployments, what it can do, its price, limits,
timeouts, resilience and fallbacks."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from switchyard.config.base import ALIAS_PATTERN, Strict
from switchyard.config.deployments import (
    BalanceConfig,
    CanaryGuard,
    DeploymentConfig,
    PlacementConfig,
)
from switchyard.config.engines import AnthropicEngine, Engine
from switchyard.config.resilience import Resilience, Timeouts


class Capabilities(Strict):
    context_window: int = Field(4096, gt=0)
    """The model's context window, in tokens: output caps are bounded by what it leaves after the
    prompt, and a fallback needs prompt plus `max_tokens` to fit."""
    supports_tools: bool = False
    """The model handles `tools`; a fallback without it is skipped for requests that carry tools."""
    supports_json_schema: bool = False
    """The model honours `response_format` json_schema / json_object; a fallback without it is
    skipped for such requests."""
    supports_streaming: bool = True
    """The model can stream; without it a `stream: true` request is refused with 400 and such a
    fallback skipped."""
    supports_vision: bool = False
    """The model takes image parts (processed by the `media` settings); other models refuse them
    with 400."""
    supports_token_ids: bool = False
    """An external (`openai`-kind) upstream that honours vLLM's `return_token_ids`; local engines
    say it themselves."""


class Price(Strict):
    """USD per million tokens."""

    input: float = Field(0.0, ge=0)
    """USD per million input (prompt) tokens."""
    output: float = Field(0.0, ge=0)
    """USD per million output (completion) tokens."""


class ModelLimits(Strict):
    """Per-deployment admission: concurrency cap, wait queue and rate limits."""

    max_concurrency: int | None = Field(None, ge=1)
    """Requests running at once; more wait in `queue`. null = no cap."""
    queue: int = Field(64, ge=0)
    """Requests that may wait, in FIFO order, for a `max_concurrency` slot; one more is answered 429
    `queue_full` at once."""
    rpm: int | None = Field(None, ge=1)
    """Requests per minute admitted to the model, all tenants together; null = unlimited."""
    tpm: int | None = Field(None, ge=1)
    """Tokens per minute admitted to the model (prompt estimate plus output cap), all tenants
    together; null = unlimited."""


class MediaOverride(Strict):
    """A model's own image settings (media.max_side, format, quality when unset)."""

    max_side: int | None = Field(None, ge=16)
    """This model's longest image side after resizing, in pixels; null = `media.max_side`."""
    format: Literal["jpeg", "png", "webp"] | None = None
    """This model's image format; null = `media.format`."""
    quality: int | None = Field(None, ge=1, le=100)
    """This model's encoder quality (jpeg, webp); null = `media.quality`."""


class ModelConfig(Strict):
    alias: str = Field(pattern=ALIAS_PATTERN)
    """The name clients send as `model`; unique across models, adapters and
    `router.routed_aliases`."""
    revision: str = "unversioned"
    """Free-text revision of the model's weights, reported in `x-switchyard-revision` and part of
    cache partitions; adapters' `base_revision` must equal it."""
    engine: Engine
    """What serves the model, chosen by `kind`: `llamacpp` or `vllm` (a managed local engine),
    `openai` (an OpenAI-compatible server) or `anthropic` (a Messages-API server). With
    `deployments` it defaults to the first one's."""
    deployments: list[DeploymentConfig] = []
    """Several deployments of this alias, balanced by `balance`; `engine` is then the first
    one's."""
    balance: BalanceConfig = BalanceConfig()
    """How a request picks one of the `deployments`."""
    canary_guard: CanaryGuard | None = None
    """Cuts a canary deployment's weight to 0 when it passes a bound; null = no guard. Needs a
    deployment with `canary: true`."""
    placement: PlacementConfig | None = None
    """Edge or cloud per request among the deployments (their `location`); null = no placement.
    Needs `deployments`."""
    capabilities: Capabilities = Capabilities()
    """What the model can do; requests and fallbacks are checked against it."""
    media: MediaOverride = MediaOverride()
    """A vision model's own image settings, in place of `media.*`."""
    region: str = "local"
    """Where the model runs, a free label checked against `data_boundary` and tenants'
    `labels.regions`."""
    price: Price = Price()
    """USD per million input and output tokens, for costs, budgets and the usage ledger."""
    timeouts: Timeouts = Timeouts()
    """Timeouts of each attempt to the upstream."""
    limits: ModelLimits = ModelLimits()
    """Admission to the model: concurrency cap, wait queue and rate limits."""
    resilience: Resilience = Resilience()
    """Retries, backoff, circuit breaker and retry budget."""
    fallbacks: list[str] = []
    """Model aliases tried in order when this model fails with a retryable error; a fallback that
    cannot serve the request is skipped."""
    data_boundary: list[str] | None = None
    """Regions this alias's requests may be sent to (the primary and any fallback); null = no
    data-boundary restriction."""
    required: bool = True
    """/readyz is 503 while a required model is not ready; a model with `required: false` may fail
    (or still load) and the gateway reports ready without it."""

    @model_validator(mode="before")
    @classmethod
    def _first_deployment_engine(cls, data: Any) -> Any:
        if isinstance(data, dict) and "engine" not in data:
            deps = data.get("deployments")
            if (
                isinstance(deps, list)
                and deps
                and isinstance(deps[0], dict)
                and "engine" in deps[0]
            ):
                data = {**data, "engine": deps[0]["engine"]}
        return data

    @model_validator(mode="after")
    def _anthropic_capabilities(self) -> ModelConfig:
        """What an `anthropic` upstream cannot be said to do: the translation has no
        `response_format` and no token ids, so a fallback check that trusted such a
        capability would send it requests it must refuse."""
        if any(isinstance(e, AnthropicEngine) for e in self.engines()):
            cap = self.capabilities
            for name, on in (
                ("supports_json_schema", cap.supports_json_schema),
                ("supports_token_ids", cap.supports_token_ids),
            ):
                if on:
                    raise ValueError(
                        f"capabilities.{name}: an anthropic engine cannot honour it (the "
                        "Messages API translation has no response_format or token ids); "
                        "leave it false"
                    )
        return self

    def engines(self) -> list[Engine]:
        """The model's engine and each deployment's."""
        return [self.engine, *(d.engine for d in self.deployments)]

    @model_validator(mode="after")
    def _deployment_names(self) -> ModelConfig:
        names = [d.name for d in self.deployments]
        for name in names:
            if names.count(name) > 1:
                raise ValueError(f"deployments: duplicate name {name!r}")
        if self.deployments and not any(d.weight > 0 for d in self.deployments):
            raise ValueError("deployments: every weight is 0; one must be positive")
        if self.canary_guard is not None and not any(d.canary for d in self.deployments):
            raise ValueError("canary_guard: no deployment is a canary (deployments[].canary)")
        p = self.placement
        if p is not None:
            if not self.deployments:
                raise ValueError("placement: needs deployments (each with its location)")
            for name, h, low_bad in (
                ("thermal_c", p.thermal_c, False),
                ("battery_pct", p.battery_pct, True),
                ("memory_pct", p.memory_pct, False),
            ):
                if (h.exit >= h.enter) if not low_bad else (h.exit <= h.enter):
                    side = "above" if low_bad else "below"
                    raise ValueError(f"placement.{name}: exit must be {side} enter (hysteresis)")
            if p.degraded_deployment is not None:
                d = next((d for d in self.deployments if d.name == p.degraded_deployment), None)
                if d is None or d.where != "device":
                    raise ValueError(
                        f"placement.degraded_deployment: {p.degraded_deployment!r} is not a "
                        "device deployment of this alias"
                    )
        return self

    def regions(self) -> list[str]:
        """The regions its deployments run in (its own `region` without deployments)."""
        return [d.region or self.region for d in self.deployments] or [self.region]

    def replica(self, d: DeploymentConfig) -> ModelConfig:
        """This model's config as deployment `d` serves it."""
        return self.model_copy(
            update={
                "engine": d.engine,
                "revision": d.revision or self.revision,
                "region": d.region or self.region,
                "deployments": [],
            }
        )
