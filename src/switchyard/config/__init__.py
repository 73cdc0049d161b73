"""Typed settings, loaded from one YAML file and validated at start.

One module per group of sections (`server`, `observe`, `policy`, `router`, `cache`,
`tools`, `tasks`, `engines`, `resilience`, `deployments`, `models`, `adapters`,
`embeddings`, `media`, `cost`, `ray`, `rl`), the root `Settings` and its loading in
`settings`, and the rules that hold one section against another in `checks`. A bad
config fails at load with a message that names the key and what is wrong (`ConfigError`),
never at the first request. Secrets are referenced by environment variable name; an
inline secret is refused. Every public name is importable from `switchyard.config`.
"""

from switchyard.config.adapters import DEMO_ADAPTERS, DEMO_PREFIX, AdapterConfig
from switchyard.config.base import ALIAS_PATTERN, ConfigError
from switchyard.config.cache import (
    CacheConfig,
    CacheOverride,
    CacheRisk,
    RiskClass,
    RiskPolicy,
    ShadowFeedback,
)
from switchyard.config.cost import CostConfig
from switchyard.config.deployments import (
    DEPLOYMENT_NAME,
    BalanceConfig,
    CanaryGuard,
    DeploymentConfig,
    Hysteresis,
    PlacementConfig,
)
from switchyard.config.embeddings import EmbeddingsConfig
from switchyard.config.engines import (
    AnthropicEngine,
    Engine,
    EnginesConfig,
    LlamaCppEngine,
    ManagedEngine,
    OpenAIEngine,
    UpstreamEngine,
    VllmEngine,
)
from switchyard.config.media import MediaConfig, MediaFetchConfig
from switchyard.config.models import Capabilities, MediaOverride, ModelConfig, ModelLimits, Price
from switchyard.config.observe import ObserveConfig, OtelConfig
from switchyard.config.policy import (
    BudgetConfig,
    PiiConfig,
    PolicyConfig,
    TenantDefaults,
    ValidationConfig,
)
from switchyard.config.process import SINGLE, ProcessRole
from switchyard.config.ray import RayConfig, RayEngineScaling
from switchyard.config.resilience import (
    RETRY_CLASSES,
    BreakerConfig,
    Resilience,
    RetryBudgetConfig,
    Timeouts,
)
from switchyard.config.rl import RlConfig, RlModel, RlValidationPrompt
from switchyard.config.router import RouteConfig, RouterConfig
from switchyard.config.server import (
    AuthConfig,
    IdempotencyConfig,
    ResponsesConfig,
    ServerConfig,
    StorageConfig,
)
from switchyard.config.settings import (
    DEFAULT_CONFIG,
    Settings,
    load_settings,
    parse_settings,
    store_target,
)
from switchyard.config.tasks import SchedulingConfig, TaskBudgetConfig, TasksConfig
from switchyard.config.tools import (
    MCP_SERVER_NAME,
    McpConfig,
    McpServerConfig,
    ToolClass,
    ToolsConfig,
    ToolSpec,
)

__all__ = [
    "ALIAS_PATTERN",
    "DEFAULT_CONFIG",
    "DEMO_ADAPTERS",
    "DEMO_PREFIX",
    "DEPLOYMENT_NAME",
    "MCP_SERVER_NAME",
    "RETRY_CLASSES",
    "SINGLE",
    "AdapterConfig",
    "AnthropicEngine",
    "AuthConfig",
    "BalanceConfig",
    "BreakerConfig",
    "BudgetConfig",
    "CacheConfig",
    "CacheOverride",
    "CacheRisk",
    "CanaryGuard",
    "Capabilities",
    "ConfigError",
    "CostConfig",
    "DeploymentConfig",
    "EmbeddingsConfig",
    "Engine",
    "EnginesConfig",
    "Hysteresis",
    "IdempotencyConfig",
    "LlamaCppEngine",
    "ManagedEngine",
    "McpConfig",
    "McpServerConfig",
    "MediaConfig",
    "MediaFetchConfig",
    "MediaOverride",
    "ModelConfig",
    "ModelLimits",
    "ObserveConfig",
    "OpenAIEngine",
    "OtelConfig",
    "PiiConfig",
    "PlacementConfig",
    "PolicyConfig",
    "Price",
    "ProcessRole",
    "RayConfig",
    "RayEngineScaling",
    "Resilience",
    "ResponsesConfig",
    "RetryBudgetConfig",
    "RiskClass",
    "RiskPolicy",
    "RlConfig",
    "RlModel",
    "RlValidationPrompt",
    "RouteConfig",
    "RouterConfig",
    "SchedulingConfig",
    "ServerConfig",
    "Settings",
    "ShadowFeedback",
    "StorageConfig",
    "TaskBudgetConfig",
    "TasksConfig",
    "TenantDefaults",
    "Timeouts",
    "ToolClass",
    "ToolSpec",
    "ToolsConfig",
    "UpstreamEngine",
    "ValidationConfig",
    "VllmEngine",
    "load_settings",
    "parse_settings",
    "store_target",
]
