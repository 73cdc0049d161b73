"""Circuit breaker per deployment, with half-open probes.

closed → open after `failures` consecutive failures, or a failure rate of at least
`failure_rate` over the last `window_s` once `min_requests` were seen. open → after
`cooldown_s`, half-open: at most `half_open_probes` requests go through at a time;
one success closes the breaker, one failure opens it again for another cooldown.
While open, no request reaches the deployment. Time comes in as a parameter.

With several processes (state/breakers_redis.py), the failure-rate rule counts the
outcomes the others reported in their windows (`others`) with its own.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any, Literal

from switchyard.config import BreakerConfig

State = Literal["closed", "open", "half_open"]


@dataclass
class CircuitBreaker:
    name: str
    cfg: BreakerConfig
    state: State = "closed"
    consecutive_failures: int = 0
    opened_at: float = 0.0
    probes_in_flight: int = 0
    opens: int = 0
    _outcomes: deque[tuple[float, bool]] = field(default_factory=deque)
    _window_s: float = field(init=False)  # cfg.window_s, read per request (a plain attribute)
    # Outcomes and failures the other processes saw in their windows, as last shared.
    others: tuple[int, int] = (0, 0)

    def __post_init__(self) -> None:
        self._window_s = self.cfg.window_s

    def _trim(self, now: float) -> None:
        while self._outcomes and self._outcomes[0][0] <= now - self._window_s:
            self._outcomes.popleft()

    def retry_after_s(self, now: float) -> float:
        return max(0.0, self.opened_at + self.cfg.cooldown_s - now) if self.state == "open" else 0.0

    def refusal(self, now: float) -> str | None:
        """Why `allow` would refuse a request now, or None; takes no probe slot."""
        if self.state == "open" and now - self.opened_at < self.cfg.cooldown_s:
            return f"circuit open for another {self.retry_after_s(now):.1f}s"
        if self.state == "half_open" and self.probes_in_flight >= self.cfg.half_open_probes:
            return "circuit half-open and its probe slots are taken"
        return None

    def allow(self, now: float) -> tuple[bool, str]:
        """May a request go to this deployment now? Reserves a probe slot when half-open;
        the caller must then report `record(success)`."""
        if self.state == "open":
            if now - self.opened_at < self.cfg.cooldown_s:
                return False, f"circuit open for another {self.retry_after_s(now):.1f}s"
            self.state = "half_open"
            self.probes_in_flight = 0
        if self.state == "half_open":
            if self.probes_in_flight >= self.cfg.half_open_probes:
                return False, "circuit half-open and its probe slots are taken"
            self.probes_in_flight += 1
            return True, "half-open probe"
        return True, "circuit closed"

    def record(self, success: bool, now: float) -> None:
        if self.state == "half_open":
            self.probes_in_flight = max(0, self.probes_in_flight - 1)
            if success:
                self._close()
            else:
                self._open(now)
            return
        self._trim(now)
        self._outcomes.append((now, success))
        if success:
            self.consecutive_failures = 0
            return
        self.consecutive_failures += 1
        if self.state == "closed" and self._should_open():
            self._open(now)

    def release_probe(self) -> None:
        """A probe ended without a verdict (e.g. the client left): free its slot."""
        if self.state == "half_open":
            self.probes_in_flight = max(0, self.probes_in_flight - 1)

    def _should_open(self) -> bool:
        if self.consecutive_failures >= self.cfg.failures:
            return True
        return self._rate_exceeded()

    def _rate_exceeded(self) -> bool:
        """The failure-rate rule over this process's window and the others' counts."""
        n = len(self._outcomes) + self.others[0]
        if n >= self.cfg.min_requests:
            failed = sum(1 for _, ok in self._outcomes if not ok) + self.others[1]
            return failed / n >= self.cfg.failure_rate
        return False

    def window(self, now: float) -> tuple[int, int]:
        """This process's outcomes and failures in the window (what it shares)."""
        self._trim(now)
        return len(self._outcomes), sum(1 for _, ok in self._outcomes if not ok)

    def adopt_others(self, outcomes: int, failures: int, now: float) -> bool:
        """The other processes' counts in their windows; opens (True) when the
        failure-rate rule over all of them now says so (judged at each refresh, as a
        failure elsewhere is not an event here)."""
        self.others = (outcomes, failures)
        self._trim(now)
        if self.state == "closed" and self._rate_exceeded():
            self._open(now)
            return True
        return False

    def trip(self, now: float) -> None:
        """Open now on evidence from outside this breaker (failures other processes
        counted: see shared_breaker.py). Only a closed breaker trips."""
        if self.state == "closed":
            self._open(now)

    def adopt_open(self, opened_at: float) -> None:
        """Another process opened this deployment's breaker at `opened_at` (our clock)."""
        if self.state == "closed":  # the shared key lives only for the cooldown
            self.state = "open"
            self.opened_at = opened_at
            self.opens += 1
            self.probes_in_flight = 0

    def _open(self, now: float) -> None:
        self.state = "open"
        self.opened_at = now
        self.opens += 1
        self.probes_in_flight = 0

    def _close(self) -> None:
        self.state = "closed"
        self.consecutive_failures = 0
        self._outcomes.clear()

    def describe(self, now: float) -> dict[str, Any]:
        return {
            "state": self.state,
            "consecutive_failures": self.consecutive_failures,
            "opens": self.opens,
            "retry_after_s": round(self.retry_after_s(now), 3),
        }
