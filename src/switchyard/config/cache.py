"""The response cache: its mode and checks, its risk classes (how far it may go for a kind of
request), shadow-mode threshold feedback, and per-model overrides."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from switchyard.config.base import Strict


class CacheOverride(Strict):
    mode: Literal["enforce", "shadow", "off"] | None = None
    """This model's cache mode: `enforce`, `shadow` or `off` (no lookup, no store); null =
    `cache.mode`."""
    threshold: float | None = Field(None, ge=-1, le=1)
    """This model's cosine similarity threshold; null = `cache.threshold`."""


RiskPolicy = Literal["semantic", "exact_only", "off"]


class RiskClass(Strict):
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


class CacheRisk(Strict):
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


class ShadowFeedback(Strict):
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


class CacheConfig(Strict):
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
    learns new and invalidated ones (state/cache_redis.py)."""
    models: dict[str, CacheOverride] = {}
    """Per-model overrides (alias to `mode`, `threshold`)."""
