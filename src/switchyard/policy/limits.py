"""Rate limits, concurrency and budgets: reserve at admission, settle at the end.

One reservation covers several scopes at once (the key, its tenant, the deployment)
and is all-or-nothing: a request refused by its tenant's limit consumes nothing from
its key's. Windows slide over the last 60 s (kept in 0.1 s buckets), not fixed windows, so a
burst straddling a minute boundary can never admit twice the limit.

Two backends share this interface: `MemoryLimiter` (one process) and `RedisLimiter`
(several gateway processes, atomic Lua scripts) in `policy/redis_limits.py`.
"""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

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


@dataclass(frozen=True, slots=True)
class Ask:
    """What one request asks for: a unique reservation id, reserved tokens and
    maximum cost. The id must be unique per reservation (client request ids are not)."""

    request_id: str
    tokens: int
    cost_usd: float


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


_PERIOD_KEYS: dict[tuple[str, int], str] = {}


def period_key(period: Period, now: float) -> str:
    """The budget period `now` falls in: "2026-12-01" (day) or "2026-12" (month),
    UTC; worked out once per day (it is asked for on every reservation)."""
    day = int(now // 86400)
    key = _PERIOD_KEYS.get((period, day))
    if key is None:
        t = time.gmtime(day * 86400)
        key = (
            f"{t.tm_year:04d}-{t.tm_mon:02d}"
            if period == "month"
            else f"{t.tm_year:04d}-{t.tm_mon:02d}-{t.tm_mday:02d}"
        )
        if len(_PERIOD_KEYS) > 64:
            _PERIOD_KEYS.clear()
        _PERIOD_KEYS[(period, day)] = key
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


BUCKET_S = 0.1  # a window is kept as the amounts of its 0.1 s intervals


class _Window:
    """The amounts of the last WINDOW_S seconds, kept per BUCKET_S interval (at most
    600 buckets, whatever the request rate: a log of every request held ~4 objects per
    request for a minute, which at thousands of requests a second was megabytes for
    the garbage collector to walk). Each bucket is [index, amount, first time, last
    time]; a bucket leaves the window once its last time has (so it never frees
    early); reservations still open are indexed by id, so settling one adjusts its
    bucket in O(1)."""

    __slots__ = ("buckets", "by_id", "total")

    def __init__(self) -> None:
        self.buckets: deque[list[float]] = deque()
        self.by_id: dict[str, tuple[list[float], float]] = {}
        self.total = 0.0

    def add(self, now: float, amount: float, rid: str | None = None) -> None:
        idx = float(now // BUCKET_S)
        buckets = self.buckets
        last = buckets[-1] if buckets else None
        if last is not None and last[0] == idx:
            last[1] += amount
            last[3] = now
        else:
            last = [idx, amount, now, now]
            buckets.append(last)
        self.total += amount
        if rid is not None:
            self.by_id[rid] = (last, amount)

    def expire(self, now: float) -> None:
        buckets = self.buckets
        cutoff = now - WINDOW_S
        while buckets and buckets[0][3] <= cutoff:
            self.total -= buckets.popleft()[1]
        if not buckets:
            self.total = 0.0  # no float drift left behind

    def retry_after(self, now: float, need: float, limit: float) -> float:
        """Seconds until enough of the window has expired to fit `need` more."""
        excess = self.total + need - limit
        freed = 0.0
        for _idx, amount, _first, last in self.buckets:
            freed += amount
            if freed >= excess:
                return max(0.001, last + WINDOW_S - now)
        return WINDOW_S

    def reset_s(self, now: float) -> float:
        return max(0.0, self.buckets[0][2] + WINDOW_S - now) if self.buckets else 0.0

    def adjust(self, rid: str, amount: float) -> None:
        """Replace a reservation's amount by the real one (once; then forgotten)."""
        held = self.by_id.pop(rid, None)
        if held is None:
            return
        bucket, reserved = held
        if self.buckets and self.buckets[0][0] <= bucket[0]:  # still in the window
            bucket[1] += amount - reserved
            self.total += amount - reserved


@dataclass
class _ScopeState:
    requests: _Window = field(default_factory=_Window)
    tokens: _Window = field(default_factory=_Window)
    in_flight: int = 0
    spent: dict[str, float] = field(default_factory=dict)  # period key → USD (incl. reserved)


class MemoryLimiter:
    """In-process limiter. Correct for one gateway process; state is lost on restart
    except budgets, which are seeded from the usage ledger via `seed_spent`."""

    def __init__(self) -> None:
        self._scopes: dict[str, _ScopeState] = {}
        self._held: set[str] = set()  # reservations not yet settled

    def _state(self, scope: str) -> _ScopeState:
        st = self._scopes.get(scope)
        if st is None:
            st = self._scopes[scope] = _ScopeState()
        return st

    def seed_spent(self, scope: str, period: Period, usd: float, now: float | None = None) -> None:
        now = time.time() if now is None else now
        self._state(scope).spent.setdefault(period_key(period, now), usd)

    async def reserve(
        self, scopes: list[ScopeLimits], ask: Ask, now: float | None = None
    ) -> Verdict:
        now = time.time() if now is None else now
        verdict = Verdict(allowed=True)
        refusal: tuple[str, str, float] | None = None
        # Check every scope first (no awaits: atomic within the event loop) ...
        for lim in scopes:
            st = self._state(lim.scope)
            st.requests.expire(now)
            st.tokens.expire(now)
            info: dict[str, float] = {}
            if lim.rpm is not None:
                info["limit_requests"] = lim.rpm
                info["remaining_requests"] = max(0, lim.rpm - st.requests.total)
                info["reset_requests_s"] = st.requests.reset_s(now)
                if refusal is None and st.requests.total + 1 > lim.rpm:
                    refusal = (lim.scope, "rpm", st.requests.retry_after(now, 1, lim.rpm))
            if lim.tpm is not None:
                info["limit_tokens"] = lim.tpm
                info["remaining_tokens"] = max(0, lim.tpm - st.tokens.total)
                info["reset_tokens_s"] = st.tokens.reset_s(now)
                if refusal is None and st.tokens.total + ask.tokens > lim.tpm:
                    if ask.tokens > lim.tpm:
                        refusal = (lim.scope, "tpm", math.inf)
                    else:
                        refusal = (
                            lim.scope,
                            "tpm",
                            st.tokens.retry_after(now, ask.tokens, lim.tpm),
                        )
            if (
                lim.max_concurrency is not None
                and refusal is None
                and st.in_flight + 1 > lim.max_concurrency
            ):
                refusal = (lim.scope, "concurrency", 1.0)
            if lim.budget_usd is not None:
                spent = st.spent.get(period_key(lim.budget_period, now), 0.0)
                info["budget_remaining_usd"] = max(0.0, lim.budget_usd - spent)
                if refusal is None and spent + ask.cost_usd > lim.budget_usd + 1e-12:
                    refusal = (lim.scope, "budget", period_reset_s(lim.budget_period, now))
            verdict.state[lim.scope] = info
        if refusal is not None:
            verdict.allowed = False
            verdict.scope, verdict.limit, verdict.retry_after_s = refusal
            return verdict
        # ... then hold everything.
        self._held.add(ask.request_id)
        for lim in scopes:
            st = self._state(lim.scope)
            if lim.rpm is not None:
                st.requests.add(now, 1.0)
                verdict.state[lim.scope]["remaining_requests"] -= 1
            if lim.tpm is not None:
                st.tokens.add(now, float(ask.tokens), ask.request_id)
                verdict.state[lim.scope]["remaining_tokens"] = max(
                    0, verdict.state[lim.scope]["remaining_tokens"] - ask.tokens
                )
            if lim.max_concurrency is not None:
                st.in_flight += 1
            if lim.budget_usd is not None:
                k = period_key(lim.budget_period, now)
                st.spent[k] = st.spent.get(k, 0.0) + ask.cost_usd
        return verdict

    async def settle(
        self,
        scopes: list[ScopeLimits],
        ask: Ask,
        tokens: int,
        cost_usd: float,
        now: float | None = None,
    ) -> None:
        now = time.time() if now is None else now
        if ask.request_id not in self._held:
            return  # never admitted, or already settled: nothing to release twice
        self._held.discard(ask.request_id)
        for lim in scopes:
            st = self._state(lim.scope)
            if lim.tpm is not None:
                st.tokens.adjust(ask.request_id, float(tokens))
            if lim.max_concurrency is not None:
                st.in_flight = max(0, st.in_flight - 1)
            if lim.budget_usd is not None:
                k = period_key(lim.budget_period, now)
                st.spent[k] = max(0.0, st.spent.get(k, 0.0) - ask.cost_usd + cost_usd)
