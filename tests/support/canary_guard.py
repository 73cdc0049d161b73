"""A gateway process's canary guard as the guard tests drive it: a real balancer over a
real registry's two deployments (a stable one and a canary), with its window shared
through a real Redis (state/guard_redis.py)."""

from __future__ import annotations

import time
from typing import Any

from switchyard.config import Settings
from switchyard.decide.balance import Balancer
from switchyard.engines.registry import Registry
from switchyard.state.breakers_memory import CircuitBreaker
from switchyard.state.guard_redis import SharedGuard

GUARD = {"max_error_rate": 0.25, "max_p95_ms": 500, "window_s": 300, "min_samples": 12}


def guard_settings(guard: dict[str, Any]) -> Settings:
    return Settings.model_validate(
        {
            "models": [
                {
                    "alias": "chat",
                    "revision": "r1",
                    "deployments": [
                        {"name": "stable", "engine": {"kind": "openai", "base_url": "http://s"}},
                        {
                            "name": "canary",
                            "revision": "r2",
                            "canary": True,
                            "weight": 0.5,
                            "engine": {"kind": "openai", "base_url": "http://c"},
                        },
                    ],
                    "canary_guard": guard,
                }
            ]
        }
    )


class Process:
    """One gateway process: its balancer (real deployments from a real registry), its
    shared window, and the cuts judged at an exchange (what the gateway stores).

    `wired`: as the gateway builds it (the balancer pokes the share, whose own loop
    exchanges); else the test drives the exchanges in rounds (`refresh`)."""

    def __init__(
        self, url: str, prefix: str, guard: dict[str, Any] = GUARD, wired: bool = False
    ) -> None:
        s = guard_settings(guard)
        deps = Registry(s).replicas["chat"]
        breakers = {d.name: CircuitBreaker(d.name, d.model.resilience.breaker) for d in deps}
        self.cuts: list[str] = []
        self.share = SharedGuard(url, 1.0, prefix=prefix, refresh_s=0.05)
        self.balancer = Balancer(
            "chat",
            deps,
            s.models[0].balance,
            breakers,
            guard_share=self.share if wired else None,
            on_cut=lambda alias, d, why: self.cuts.append(why),
        )
        if not wired:
            self.share.watch(self.balancer)
        self.canary = next(d for d in deps if d.replica is not None and d.replica.canary)
        self.key = self.share._key(self.canary.name)  # its hash in Redis

    def outcome(self, ok: bool, ms: float = 100.0) -> str | None:
        """A request's outcome at the canary; the cut's reason when it tipped it."""
        return self.balancer.guard_check(self.canary, ok, ms, time.monotonic())

    def outcomes(self, *oks: bool) -> None:
        for ok in oks:
            self.outcome(ok)

    async def refresh(self) -> None:
        await self.share.refresh(time.monotonic())

    @property
    def cut(self) -> bool:
        return self.canary.live.weight == 0.0
