"""Admission policy: tenants' default limits and budgets, output caps and token estimates, PII
handling, and checks of request bodies beyond their schema."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from switchyard.config.base import Strict


class BudgetConfig(Strict):
    usd: float | None = Field(None, ge=0)
    """Spend allowed per `period`, in USD; null = unlimited."""
    period: Literal["day", "month"] = "day"
    """The budget's period, a UTC calendar `day` or `month`; spend starts again at zero when it
    rolls over."""


class TenantDefaults(Strict):
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


class PolicyConfig(Strict):
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


class PiiConfig(Strict):
    mode: Literal["observe_only", "mask_upstream", "block"] = "observe_only"
    """`observe_only`: raw text goes upstream, only masked text is stored, embedded, logged;
    `mask_upstream`: masked text goes upstream and placeholders are restored in the reply; `block`:
    a request containing PII is refused (400 `pii_detected`)."""
    models: dict[str, Literal["observe_only", "mask_upstream", "block"]] = {}
    """Per-model PII mode (alias to `observe_only`, `mask_upstream` or `block`), in place of
    `mode`."""


class ValidationConfig(Strict):
    unknown_fields: Literal["pass", "reject"] = "pass"
    """Top-level request fields the gateway does not know: `pass` them to the upstream (engines take
    extras: top_k, return_token_ids, adapter fields) or `reject` them (400 naming the field)."""
