"""`MemoryLimiter`: the limits of one gateway process, in memory (state/limits.py
tells the rules).
"""

from __future__ import annotations

import math
import time
from collections import defaultdict, deque
from dataclasses import dataclass, field

from switchyard.state.limits import (
    WINDOW_S,
    Ask,
    Period,
    ScopeLimits,
    Verdict,
    period_key,
    period_reset_s,
)

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
        if not self.buckets:
            return 0.0
        left = self.buckets[0][2] + WINDOW_S - now
        return left if left > 0.0 else 0.0

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
        # A scope's state is made the first time it is asked for.
        self._scopes: defaultdict[str, _ScopeState] = defaultdict(_ScopeState)
        self._held: set[str] = set()  # reservations not yet settled

    def seed_spent(self, scope: str, period: Period, usd: float, now: float | None = None) -> None:
        now = time.time() if now is None else now
        self._scopes[scope].spent.setdefault(period_key(period, now), usd)

    async def reserve(
        self, scopes: list[ScopeLimits], ask: Ask, now: float | None = None
    ) -> Verdict:
        now = time.time() if now is None else now
        verdict = Verdict(allowed=True)
        state = verdict.state
        refusal: tuple[str, str, float] | None = None
        # Each scope's state and budget period, found once for both passes below.
        found: list[tuple[ScopeLimits, _ScopeState, str | None]] = []
        # Check every scope first (no awaits: atomic within the event loop) ...
        for lim in scopes:
            st = self._scopes[lim.scope]
            requests = st.requests
            tokens = st.tokens
            requests.expire(now)
            tokens.expire(now)
            info: dict[str, float] = {}
            # Floors as conditionals: max() costs several times more, per scope per request.
            rpm = lim.rpm
            if rpm is not None:
                left = rpm - requests.total
                info["limit_requests"] = rpm
                info["remaining_requests"] = left if left > 0 else 0
                info["reset_requests_s"] = requests.reset_s(now)
                if refusal is None and requests.total + 1 > rpm:
                    refusal = (lim.scope, "rpm", requests.retry_after(now, 1, rpm))
            tpm = lim.tpm
            if tpm is not None:
                left = tpm - tokens.total
                info["limit_tokens"] = tpm
                info["remaining_tokens"] = left if left > 0 else 0
                info["reset_tokens_s"] = tokens.reset_s(now)
                if refusal is None and tokens.total + ask.tokens > tpm:
                    if ask.tokens > tpm:
                        refusal = (lim.scope, "tpm", math.inf)
                    else:
                        refusal = (lim.scope, "tpm", tokens.retry_after(now, ask.tokens, tpm))
            if (
                lim.max_concurrency is not None
                and refusal is None
                and st.in_flight + 1 > lim.max_concurrency
            ):
                refusal = (lim.scope, "concurrency", 1.0)
            period = None
            if lim.budget_usd is not None:
                period = period_key(lim.budget_period, now)
                spent = st.spent.get(period, 0.0)
                left = lim.budget_usd - spent
                info["budget_remaining_usd"] = left if left > 0.0 else 0.0
                if refusal is None and spent + ask.cost_usd > lim.budget_usd + 1e-12:
                    refusal = (lim.scope, "budget", period_reset_s(lim.budget_period, now))
            state[lim.scope] = info
            found.append((lim, st, period))
        if refusal is not None:
            verdict.allowed = False
            verdict.scope, verdict.limit, verdict.retry_after_s = refusal
            return verdict
        # ... then hold everything.
        self._held.add(ask.request_id)
        for lim, st, period in found:
            if lim.rpm is not None:
                st.requests.add(now, 1.0)
                state[lim.scope]["remaining_requests"] -= 1
            if lim.tpm is not None:
                st.tokens.add(now, float(ask.tokens), ask.request_id)
                info = state[lim.scope]
                left = info["remaining_tokens"] - ask.tokens
                info["remaining_tokens"] = left if left > 0 else 0
            if lim.max_concurrency is not None:
                st.in_flight += 1
            if period is not None:
                st.spent[period] = st.spent.get(period, 0.0) + ask.cost_usd
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
            st = self._scopes[lim.scope]
            if lim.tpm is not None:
                st.tokens.adjust(ask.request_id, float(tokens))
            if lim.max_concurrency is not None and st.in_flight > 0:
                st.in_flight -= 1
            if lim.budget_usd is not None:
                k = period_key(lim.budget_period, now)
                spent = st.spent.get(k, 0.0) - ask.cost_usd + cost_usd
                st.spent[k] = spent if spent > 0.0 else 0.0
