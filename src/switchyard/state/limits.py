"""Rate limits, concurrency and budgets: the `Limiter` interface and its types.

One reservation covers several scopes at once (the key, its tenant, the deployment)
and is all-or-nothing: a request refused by its tenant's limit consumes nothing from
its key's. Windows slide over the last 60 s (kept in 0.1 s buckets), not fixed windows, so a
burst straddling a minute boundary can never admit twice the limit.

Two implementations share this interface: `MemoryLimiter` (one process,
state/limits_memory.py) and `RedisLimiter` (several gateway processes, atomic Lua
scripts, state/limits_redis.py).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple, Protocol

WINDOW_S = 60.0
Period = Literal["day", "month"]


class LimiterUnavailable(Exception):
    """The shared limiter state cannot be reached (e.g. Redis is down)."""


@dataclass(frozen=True, slots=True)
class ScopeLimits:
    """The limits of one scope, e.g. `key:key_ab12`, `tenant:acme`, `deployment:big`.

    None means unlimited. `budget_usd` applies per `budget_period` (UTC calendar day
    or month).
    """

    scope: str
    rpm: int | None = None
    tpm: int | None = None
    max_concurrency: int | None = None
    budget_usd: float | None = None
    budget_period: Period = "day"


class Billing(NamedTuple):
    """What the usage row of a request needs should its process die holding a
    reservation (`serve --workers N`: the supervisor writes that row, scale/workers.py).
    Given by the caller of `reserve` (policy/stages_admission.py `Reserver`); the
    limiter keeps it with the hold (`RedisLimiter` with an owner) and never reads it."""

    request_id: str  # the gateway's own: the usage row's key
    client_request_id: str | None
    task_id: str | None
    tenant_id: str | None
    key_id: str | None
    endpoint: str
    model: str | None  # the alias asked for
    received_at: float
    prompt_tokens: int  # of the reserved tokens; the rest is the output cap
    stream: bool


@dataclass(frozen=True, slots=True)
class Ask:
    """What one request asks for: a unique reservation id, reserved tokens and
    maximum cost. The id must be unique per reservation (client request ids are not).
    `billing`: given where a dead process's holds are billed (`Billing`)."""

    request_id: str
    tokens: int
    cost_usd: float
    billing: Billing | None = None


def spend_scopes(scopes: list[ScopeLimits]) -> list[ScopeLimits]:
    """The limits of `scopes` that count what an upstream call uses (tokens a minute,
    budget), without those that count requests (rpm, concurrency); scopes with
    neither are left out. What one more call of an admitted request holds: its request
    is counted in rpm and holds its concurrency slot already. Reserved and settled with
    `Limiter.reserve` and `Limiter.settle` like any hold (both limiters hold and settle
    only the limits a scope has), so a further call's hold is a reservation of its own,
    given back exactly by its settle."""
    return [
        ScopeLimits(s.scope, tpm=s.tpm, budget_usd=s.budget_usd, budget_period=s.budget_period)
        for s in scopes
        if s.tpm is not None or s.budget_usd is not None
    ]


@dataclass(frozen=True, slots=True)
class Held:
    """A hold whose process died before settling it, as `release_owner` found it: it
    stays charged at what it reserved (tokens and cost). `billing` is None for a hold
    recorded without it (by a release before billing was kept)."""

    reservation: str
    tokens: int
    cost_usd: float
    billing: Billing | None


@dataclass(slots=True)
class Verdict:
    allowed: bool
    # When refused: which scope and which limit ("rpm", "tpm", "concurrency", "budget").
    scope: str | None = None
    limit: str | None = None
    retry_after_s: float = 0.0
    # Per scope: {"limit_requests", "remaining_requests", "reset_requests_s",
    # "limit_tokens", "remaining_tokens", "reset_tokens_s", "budget_remaining_usd"}
    state: dict[str, dict[str, float]] = field(default_factory=dict)


class Limiter(Protocol):
    async def reserve(
        self, scopes: list[ScopeLimits], ask: Ask, now: float | None = None
    ) -> Verdict:
        """Admit `ask` against every scope or none; on admission everything is held."""
        ...

    def seed_spent(self, scope: str, period: Period, usd: float, now: float | None = None) -> Any:
        """Set a budget's spend so far (from the ledger) unless already known; may be
        a coroutine."""
        ...

    async def settle(
        self,
        scopes: list[ScopeLimits],
        ask: Ask,
        tokens: int,
        cost_usd: float,
        now: float | None = None,
    ) -> None:
        """The request ended: replace the reserved tokens and cost by the real ones and
        release its concurrency slot. Called exactly once per admitted request."""
        ...


# Per period, the day its key was last worked out for: (start, end, key).
_PERIOD_KEYS: dict[str, tuple[float, float, str]] = {}


def period_key(period: Period, now: float) -> str:
    """The budget period `now` falls in: "2026-12-01" (day) or "2026-12" (month),
    UTC; worked out once per day (it is asked for on every reservation, so the day
    asked for last is checked by comparison alone)."""
    last = _PERIOD_KEYS.get(period)
    if last is not None and last[0] <= now < last[1]:
        return last[2]
    day = int(now // 86400)
    t = time.gmtime(day * 86400)
    key = (
        f"{t.tm_year:04d}-{t.tm_mon:02d}"
        if period == "month"
        else f"{t.tm_year:04d}-{t.tm_mon:02d}-{t.tm_mday:02d}"
    )
    start = day * 86400.0
    _PERIOD_KEYS[period] = (start, start + 86400.0, key)
    return key


def period_start(period: Period, now: float) -> float:
    """Unix time when the current budget period began (UTC)."""
    t = time.gmtime(now)
    day = 1 if period == "month" else t.tm_mday
    return time.mktime((t.tm_year, t.tm_mon, day, 0, 0, 0, 0, 0, 0)) - time.timezone


def period_reset_s(period: Period, now: float) -> float:
    """Seconds until the budget period rolls over (UTC)."""
    t = time.gmtime(now)
    if period == "day":
        return 86400 - (t.tm_hour * 3600 + t.tm_min * 60 + t.tm_sec)
    year, month = (t.tm_year + 1, 1) if t.tm_mon == 12 else (t.tm_year, t.tm_mon + 1)
    nxt = time.mktime((year, month, 1, 0, 0, 0, 0, 0, 0)) - time.timezone
    return max(1.0, nxt - now)
