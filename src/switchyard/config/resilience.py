"""How one model's calls survive failures: attempt timeouts, retries and backoff, the circuit
breaker and the retry budget."""

from __future__ import annotations

from pydantic import Field, field_validator

from switchyard.config.base import Strict


class Timeouts(Strict):
    connect_s: float = Field(2.0, gt=0)
    """Seconds an attempt may take to connect to the upstream."""
    first_byte_s: float = Field(25.0, gt=0)
    """Seconds to the reply's first byte (the whole generation for a non-streaming call), and
    between two chunks of a stream."""
    total_s: float = Field(300.0, gt=0)
    """Seconds an attempt may take in all. Every timeout is also cut to the time left before the
    request's deadline."""


RETRY_CLASSES = ("connect", "timeout", "429", "500", "502", "503", "504", "broken")


class BreakerConfig(Strict):
    """Opens on `failures` consecutive failures, or a failure rate of at least
    `failure_rate` over `window_s` once `min_requests` were seen."""

    failures: int = Field(5, ge=1)
    """Consecutive failures that open the breaker (counted across gateway processes with
    `storage.redis_url`)."""
    failure_rate: float = Field(0.5, gt=0, le=1)
    """Share of failures over `window_s` (once `min_requests` were seen) that opens the breaker;
    with `storage.redis_url`, over the outcomes of every gateway process (shared each 0.25 s)."""
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


class RetryBudgetConfig(Strict):
    """Retries per deployment may not exceed `ratio` x first attempts over `window_s`
    (plus `min_retries`), so an outage does not multiply load."""

    ratio: float = Field(0.2, ge=0)
    """Retries allowed per first attempt over `window_s`."""
    window_s: float = Field(10.0, gt=0)
    """Seconds of the window retries and first attempts are counted over."""
    min_retries: int = Field(3, ge=0)
    """Retries allowed in a window on top of `ratio` x first attempts."""


class Resilience(Strict):
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
