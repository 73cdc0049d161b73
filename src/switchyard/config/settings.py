"""The settings root, one field per section, and how a YAML file becomes `Settings`.

A bad config fails at load with a message that names the key and what is wrong
(`ConfigError`), never at the first request. Secrets are referenced by environment
variable name; an inline secret is refused. Rules that hold one section against another
live in `checks.py`.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import yaml
from pydantic import Field, ValidationError, model_validator

from switchyard.config.adapters import AdapterConfig
from switchyard.config.base import ConfigError, Strict
from switchyard.config.cache import CacheConfig
from switchyard.config.checks import check_settings
from switchyard.config.cost import CostConfig
from switchyard.config.embeddings import EmbeddingsConfig
from switchyard.config.engines import EnginesConfig
from switchyard.config.media import MediaConfig
from switchyard.config.models import ModelConfig
from switchyard.config.observe import ObserveConfig
from switchyard.config.policy import PiiConfig, PolicyConfig, TenantDefaults, ValidationConfig
from switchyard.config.ray import RayConfig
from switchyard.config.rl import RlConfig
from switchyard.config.router import RouterConfig
from switchyard.config.server import (
    AuthConfig,
    IdempotencyConfig,
    ResponsesConfig,
    ServerConfig,
    StorageConfig,
)
from switchyard.config.tasks import SchedulingConfig, TasksConfig
from switchyard.config.tools import McpConfig, ToolsConfig


class Settings(Strict):
    server: ServerConfig = ServerConfig()
    """The HTTP listener: address, size and time limits, the default deadline."""
    storage: StorageConfig = StorageConfig()
    """Where keys, tenants, the usage ledger, traces and idempotency live, and the Redis that
    gateway processes share."""
    auth: AuthConfig = AuthConfig()
    """API keys and the admin key."""
    tenants_defaults: TenantDefaults = TenantDefaults()
    """Limits for tenants that set none of their own."""
    policy: PolicyConfig = PolicyConfig()
    """Admission: output caps, token estimates, limiters without Redis."""
    idempotency: IdempotencyConfig = IdempotencyConfig()
    """Replies stored for requests with an `Idempotency-Key`."""
    responses: ResponsesConfig = ResponsesConfig()
    """Stored responses of the Responses API: their key, retention and background cap."""
    observe: ObserveConfig = ObserveConfig()
    """Metrics, decision traces, retention and OpenTelemetry."""
    router: RouterConfig = RouterConfig()
    """Semantic routing of requests for a routed alias (`auto`)."""
    cache: CacheConfig = CacheConfig()
    """The exact and semantic response cache (off by default)."""
    pii: PiiConfig = PiiConfig()
    """PII detection and masking."""
    media: MediaConfig = MediaConfig()
    """Image inputs: fetching, processing and caching."""
    tools: ToolsConfig = ToolsConfig()
    """Tool shortlisting, tool permissions and checks of the tool calls models return."""
    tasks: TasksConfig = TasksConfig()
    """Agent tasks (`x-task-id`) as a unit of policy: budgets and state bounds."""
    mcp: McpConfig = McpConfig()
    """The MCP tool gateway (`/mcp`): tool servers, and at-most-once side effects."""
    scheduling: SchedulingConfig = SchedulingConfig()
    """Model queues: task- and deadline-aware (the default) or first come, first served."""
    models: list[ModelConfig] = Field(min_length=1)
    """The models clients may name (at least one)."""
    engines: EnginesConfig = EnginesConfig()
    """Supervision and residency of managed engines, shared by every local model."""
    adapters: list[AdapterConfig] = []
    """LoRA adapters, each served as a model of its own over a local base model."""
    validation: ValidationConfig = ValidationConfig()
    """Checks of request bodies beyond their schema."""
    embeddings: EmbeddingsConfig = EmbeddingsConfig()
    """The local embedding model: /v1/embeddings, and the vectors the cache and the router use."""
    cost: CostConfig = CostConfig()
    """The build-vs-buy report (`switchyard cost`)."""
    ray: RayConfig = RayConfig()
    """`switchyard serve --ray`: the gateway and the local engines on Ray Serve."""
    rl: RlConfig = RlConfig()
    """Serving inside RL training: rollouts, revisions, the rollout store."""

    @model_validator(mode="after")
    def _cross_section_rules(self) -> Settings:
        check_settings(self)
        return self

    def model(self, alias: str) -> ModelConfig | None:
        for m in self.served_models():
            if m.alias == alias:
                return m
        return None

    def served_models(self) -> list[ModelConfig]:
        """Every alias a client may name: the models, then each adapter as a model of
        its own (its base's config under the adapter's name, with no fallbacks: a
        fallback would not apply the adapter)."""
        by_alias = {m.alias: m for m in self.models}
        return self.models + [
            by_alias[a.base].model_copy(
                update={"alias": a.name, "fallbacks": [], "required": False}
            )
            for a in self.adapters
        ]


DEFAULT_CONFIG: dict[str, Any] = {
    "models": [
        {
            "alias": "smollm2-135m",
            "revision": "smollm2-135m-instruct-q4_1",
            "engine": {"kind": "llamacpp", "gguf": "auto", "threads": 2, "ctx": 4096},
            "capabilities": {"context_window": 4096, "supports_streaming": True},
            "region": "local",
            "price": {"input": 0.0, "output": 0.0},
            "limits": {"max_concurrency": 4, "queue": 32},
        }
    ],
    "tenants_defaults": {"rpm": 600, "tpm": 200000, "max_concurrency": 16},
}


def _loc(loc: tuple[int | str, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part in ("llamacpp", "openai", "anthropic") and out.endswith("engine"):
            continue  # discriminator tag pydantic adds; not a key the user wrote
        else:
            out += f".{part}" if out else str(part)
    return out or "(top level)"


def parse_settings(data: Any, source: str = "config") -> Settings:
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: the top level must be a mapping of sections")
    try:
        return Settings.model_validate(data)
    except ValidationError as exc:
        lines = []
        for err in exc.errors():
            msg = str(err["msg"]).removeprefix("Value error, ")
            loc = tuple(err["loc"])
            # Cross-field checks name their keys in the message itself.
            lines.append(f"  {_loc(loc)}: {msg}" if loc else f"  {msg}")
        raise ConfigError(f"{source} is invalid:\n" + "\n".join(lines)) from None


def store_target(settings: Settings, override: str | None = None) -> str:
    """The database in use, a SQLite file or a PostgreSQL URI: an explicit override
    (CLI --db), then the SWITCHYARD_SQLITE_PATH environment variable, then
    storage.postgres_dsn, then storage.sqlite_path."""
    s = settings.storage
    return override or os.environ.get("SWITCHYARD_SQLITE_PATH") or s.postgres_dsn or s.sqlite_path


def load_settings(path: str | Path | None) -> Settings:
    """Load the YAML file at `path`, or the embedded default when `path` is None."""
    if path is None:
        return parse_settings(DEFAULT_CONFIG, "embedded default config")
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read config {p}: {exc.strerror}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{p} is not valid YAML: {exc}") from None
    return parse_settings(data, str(p))
