"""Retry decisions: which errors are retried, how long to wait, and the retry budget.

Backoff is exponential with full jitter (a random wait in [0, min(max, base·2^n)]),
raised to the upstream's Retry-After when it sent one. The retry budget caps retries
per deployment at `ratio` of recent first attempts (plus a small floor), so during an
outage retries cannot multiply the load on a struggling upstream.
"""

from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass, field

from switchyard.config import Resilience, RetryBudgetConfig
from switchyard.errors import SwitchyardError


def retry_class(exc: BaseException) -> str | None:
    return exc.retry_class if isinstance(exc, SwitchyardError) else None


def is_retryable(exc: BaseException, cfg: Resilience) -> bool:
    cls = retry_class(exc)
    return cls is not None and cls in cfg.retry_on


def backoff_s(
    retry_number: int, cfg: Resilience, retry_after_s: float | None, rng: random.Random
) -> float:
    """Wait before retry number `retry_number` (1-based)."""
    cap = min(cfg.backoff_max_s, cfg.backoff_base_s * (2 ** (retry_number - 1)))
    wait = rng.uniform(0.0, cap)
    if retry_after_s is not None:
        wait = max(wait, retry_after_s)
    return wait


@dataclass
class RetryBudget:
    cfg: RetryBudgetConfig
    _firsts: deque[float] = field(default_factory=deque)
    _retries: deque[float] = field(default_factory=deque)
    denied: int = 0
    _window_s: float = field(init=False)  # cfg.window_s, read per request (a plain attribute)

    def __post_init__(self) -> None:
        self._window_s = self.cfg.window_s

    def _trim(self, now: float) -> None:
        for q in (self._firsts, self._retries):
            while q and q[0] <= now - self._window_s:
                q.popleft()

    def first_attempt(self, now: float) -> None:
        self._trim(now)
        self._firsts.append(now)

    def allowance(self, now: float) -> float:
        self._trim(now)
        return self.cfg.min_retries + self.cfg.ratio * len(self._firsts)

    def try_spend(self, now: float) -> bool:
        """Take one retry from the budget, or refuse (and count the refusal)."""
        if len(self._retries) + 1 > self.allowance(now):
            self.denied += 1
            return False
        self._retries.append(now)
        return True
