"""Tools: which a tenant may use, what running each does, and the MCP tool servers behind
`/mcp`."""

from __future__ import annotations

import os
from typing import Literal

from pydantic import ConfigDict, Field, model_validator

from switchyard.config.base import Strict
from switchyard.config.resilience import BreakerConfig

ToolClass = Literal["read_only", "side_effect"]


class ToolSpec(Strict):
    """One tool the gateway knows: what running it does and who may have it run."""

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    name: str = Field(min_length=1, max_length=128)
    """The tool's function name, as requests and tool calls carry it; unique in the registry."""
    tool_class: ToolClass = Field("side_effect", alias="class")
    """`read_only`: running it changes nothing; `side_effect`: it does (sends, pays, writes), so its
    calls get idempotency keys. Written `class` in the config."""
    requires_approval: bool = False
    """A request carrying this tool's result must present an approval for that call
    (`x-switchyard-approval`), else 403 `approval_required`."""
    allowed_tenants: list[str] = ["*"]
    """Tenant ids that may have the tool run; `*` = every tenant."""


class ToolsConfig(Strict):
    shortlist_k: int | None = Field(None, ge=1)
    """Keep at most this many of a request's permitted tools, the most similar to the last user
    message; null = no shortlist. Shortlisting is not authorization."""
    allow: list[str] | None = None
    """Tool names any tenant may use; null = every tool not denied."""
    deny: list[str] = []
    """Tool names no tenant may use: removed from requests, and their calls in replies handled by
    `on_forbidden_call`."""
    tenant_allow: dict[str, list[str]] = {}
    """Per-tenant allow lists (tenant id to tool names): a listed tenant may use only its tools,
    besides `allow` and `deny`; other tenants are unaffected."""
    registry: list[ToolSpec] = []
    """Tools the gateway knows: their side-effect class, approval and tenants."""
    default_class: ToolClass = "side_effect"
    """The side-effect class of a tool the registry does not list."""
    on_forbidden_call: Literal["block", "flag"] = "block"
    """A tool call in a model's reply that the tenant may not use: removed (`block`) or relayed and
    recorded (`flag`); a decision either way."""
    check_outputs: bool = True
    """Check the tool calls in replies at all (authorization, idempotency keys); false trusts the
    upstream's tool calls as they come. Approvals apply either way. While on, a chat request's
    legacy `functions`/`function_call` are refused (the check reads `tool_calls`)."""
    approval_ttl_s: float = Field(3600.0, gt=0, le=30 * 86400)
    """Seconds an approval token stays valid after it is issued."""

    @model_validator(mode="after")
    def _unique_tools(self) -> ToolsConfig:
        seen: set[str] = set()
        for i, t in enumerate(self.registry):
            if t.name in seen:
                raise ValueError(f"tools.registry[{i}].name: duplicate tool {t.name!r}")
            seen.add(t.name)
        return self


MCP_SERVER_NAME = r"^[A-Za-z0-9][A-Za-z0-9-]{0,31}$"


class McpServerConfig(Strict):
    """One MCP tool server behind `/mcp`: remote (`url`, Streamable HTTP) or local
    (`command`, stdio, started and supervised by the gateway)."""

    name: str = Field(pattern=MCP_SERVER_NAME)
    """Its tools are named `<name>__<tool>` to clients, the registry and allow lists; letters,
    digits and `-` (no `_`, which would make names ambiguous), at most 32."""
    url: str | None = Field(None, pattern=r"^https?://", max_length=2048)
    """A Streamable HTTP MCP endpoint (`http://host:port/mcp`)."""
    command: list[str] | None = Field(None, min_length=1)
    """A stdio MCP server to start: the program and its arguments."""
    env: dict[str, str] = {}
    """Environment of a `command` server: variable to the name of a gateway environment
    variable holding its value (`{API_TOKEN: CRM_TOKEN}`); values never appear in the config,
    to clients or in logs."""
    headers_env: dict[str, str] = {}
    """Headers sent to a `url` server: header name to the name of a gateway environment
    variable holding its value (`{Authorization: CRM_AUTH}`)."""
    timeout_s: float = Field(30.0, gt=0, le=3600)
    """Seconds one tool call may take (capped by the task's and the request's deadline); past
    it a side-effecting call is recorded in doubt."""
    max_concurrency: int = Field(8, ge=1, le=1024)
    """Calls in flight to this server at once; more wait, up to their deadline."""
    restart_backoff_s: float = Field(0.5, gt=0, le=60)
    """First wait before reconnecting to (or restarting) a server that failed; doubles to 30 s."""
    breaker: BreakerConfig = Field(default_factory=BreakerConfig)
    """The server's circuit breaker: calls that time out, lose their connection or meet a
    server error (HTTP 5xx, JSON-RPC internal error) count as failures; while it is open, calls
    to the server's tools fail at once (`tool_circuit_open`) without being sent, and after
    `cooldown_s` one probe call goes through."""
    tool_prices: dict[str, float] = Field({}, max_length=1000)
    """USD per call of each of this server's tools, by the server's own tool name
    (`{send_sms: 0.0075}`): reserved against the task's `cost_usd` budget before the call is
    sent, charged when it is sent, and recorded on the call's usage row. Tools not listed cost
    nothing."""

    @model_validator(mode="after")
    def _one_transport(self) -> McpServerConfig:
        if (self.url is None) == (self.command is None):
            raise ValueError(f"mcp.servers[{self.name!r}]: give exactly one of url or command")
        for tool, price in self.tool_prices.items():
            if not 0 < len(tool) <= 128:
                raise ValueError(
                    f"mcp.servers[{self.name!r}].tool_prices: tool names are 1 to 128 characters"
                )
            if not 0 <= price <= 1000:
                raise ValueError(
                    f"mcp.servers[{self.name!r}].tool_prices[{tool!r}]: a price per call "
                    "from 0 to 1000 USD"
                )
        return self

    def credentials(self, names: dict[str, str]) -> dict[str, str]:
        """The values of the environment variables `names` refers to (missing ones left out)."""
        return {k: os.environ[v] for k, v in names.items() if v in os.environ}


class McpConfig(Strict):
    """The MCP tool gateway (`/mcp`): the tool servers behind it and how calls are governed."""

    servers: list[McpServerConfig] = []
    """Tool servers aggregated at `/mcp`; none = no `/mcp` endpoint."""
    require_call_id: bool = False
    """Refuse a side-effecting call that carries no call id (`_meta.call_id` or
    `x-switchyard-call-id`) and matches no call the task recorded."""
    wait_s: float = Field(30.0, gt=0, le=3600)
    """Longest a repeat of a call in flight waits for the first one's result."""
    max_result_bytes: int = Field(1_048_576, ge=1024, le=64 * 1_048_576)
    """Largest tool result (its CallToolResult as JSON) passed to the client and stored; a larger
    one is neither: the client gets `tool_result_too_large`, and a side-effecting call is recorded
    as done without a result (it ran: repeats are refused, never re-run)."""

    @model_validator(mode="after")
    def _unique_servers(self) -> McpConfig:
        names = [s.name for s in self.servers]
        if len(set(names)) != len(names):
            raise ValueError("mcp.servers: server names must be unique")
        return self
