"""Several deployments of one model alias: each deployment, how a request picks one (balance),
the canary guard, and edge-or-cloud placement."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from switchyard.config.base import Strict
from switchyard.config.engines import Engine, UpstreamEngine

DEPLOYMENT_NAME = r"^[a-z0-9][a-z0-9_.-]{0,31}$"


class DeploymentConfig(Strict):
    """One deployment of a model alias: its own engine (an upstream or a managed
    engine), revision, region, share of traffic and capacity."""

    name: str = Field(pattern=DEPLOYMENT_NAME)
    """Unique within the model; names the deployment in `x-switchyard-upstream`, traces, metrics,
    weight commands and pins (`alias@name`)."""
    engine: Engine
    """What serves this deployment: an upstream or a managed engine, as in `models[].engine`."""
    revision: str | None = None
    """This deployment's revision; null = the model's. Deployments of different revisions make a
    version alias."""
    region: str | None = None
    """This deployment's region; null = the model's. It must be inside the model's
    `data_boundary`."""
    weight: float = Field(1.0, ge=0)
    """Share of traffic in weighted picks (`weighted`, `least_outstanding`); 0 = never chosen. A
    weight stored at run time (promote, rollback, admin API) overrides it."""
    max_in_flight: int | None = Field(None, ge=1)
    """Requests in flight at once; a full deployment is skipped. null = no cap."""
    labels: dict[str, str] = {}
    """Free-form labels, reported with the deployment in /readyz and the admin API."""
    canary: bool = False
    """A canary: watched by the model's `canary_guard`, and given all the traffic or none by
    `switchyard models promote` / `rollback`."""
    location: Literal["device", "cloud"] | None = None
    """Where it runs, for `placement`: `device` or `cloud`; null = `device` for a managed engine,
    `cloud` for an upstream."""

    @property
    def where(self) -> str:
        if self.location is not None:
            return self.location
        return "cloud" if isinstance(self.engine, UpstreamEngine) else "device"


class Hysteresis(Strict):
    """A device condition with separate enter and exit thresholds: it starts at
    `enter` and ends only past `exit`, held for the placement's `min_dwell_s`."""

    enter: float
    """Reading at which the condition starts (at or past it: above for heat and memory, below for
    battery)."""
    exit: float
    """Reading past which the condition ends, held for `min_dwell_s`: below `enter` for heat and
    memory, above it for battery."""


class PlacementConfig(Strict):
    """Edge or cloud per request, among an alias's deployments (decide/placement.py)."""

    pii_stays_local: bool = True
    """A request with PII found by the pii stage (or `x-switchyard-data-boundary: device`) runs on
    the device or is refused (503 `placement_refused`), never sent to the cloud."""
    thermal_c: Hysteresis = Hysteresis(enter=85.0, exit=75.0)
    """CPU temperature, in degrees C, at which the device counts as hot. A device condition moves
    work to the cloud when privacy and the deadline allow, else degrades it."""
    battery_pct: Hysteresis = Hysteresis(enter=15.0, exit=25.0)
    """Battery level, in % while not charging, at which the device counts as low on battery."""
    memory_pct: Hysteresis = Hysteresis(enter=92.0, exit=85.0)
    """Memory used, in %, at which the device counts as under memory pressure."""
    min_dwell_s: float = Field(30.0, ge=0)
    """Seconds an exit must hold before a condition ends, and the least time between two changes, so
    a reading near a threshold does not flap the mode."""
    degraded_deployment: str | None = None
    """The device deployment used while degraded; null = the usual one."""
    degraded_max_tokens: int | None = Field(None, ge=1)
    """Output cap, in tokens, while degraded; null = no extra cap."""
    cloud_routes: list[str] = []
    """Routes (`router.routes[].name`) whose requests prefer the cloud (quality) when privacy and
    the deadline allow."""
    prior_ttft_ms: float = Field(200.0, gt=0)
    """Assumed time to first token, in milliseconds, of a deployment not measured yet."""
    prior_tpot_ms: float = Field(20.0, gt=0)
    """Assumed time per output token, in milliseconds, of a deployment not measured yet."""
    probe: float = Field(0.02, ge=0, le=0.5)
    """Share of requests sent to a location whose measurements are older than `stale_s`, so its
    estimate follows what it can do now; a location never measured gets the next request that may go
    there."""
    stale_s: float = Field(60.0, gt=0)
    """Seconds after which a location's measurements count as stale (see `probe`)."""


class CanaryGuard(Strict):
    """Cuts a canary deployment's weight to 0 when, over the last `window_s` with at
    least `min_samples` requests, its error rate or p95 latency passes its bound. With
    `storage.redis_url` the window holds every gateway process's requests (shared each
    0.25 s: state/guard_redis.py)."""

    max_error_rate: float = Field(0.05, ge=0, le=1)
    """Error share over `window_s` past which a canary's weight is cut to 0."""
    max_p95_ms: float | None = Field(None, gt=0)
    """p95 latency, in milliseconds, past which a canary's weight is cut to 0; null = no latency
    bound."""
    window_s: float = Field(300.0, gt=0)
    """Seconds of recent requests the bounds are judged over."""
    min_samples: int = Field(20, ge=1)
    """Requests within `window_s` before a canary is judged (with `storage.redis_url`, counted
    over every gateway process)."""


class BalanceConfig(Strict):
    """How a request picks one of its alias's deployments (decide/balance.py)."""

    strategy: Literal["weighted", "least_outstanding", "latency"] = "least_outstanding"
    """`weighted`: random by weight. `least_outstanding`: of two weighted random choices, the one
    with fewer requests in flight. `latency`: the lowest EWMA of time to first token plus per-token
    time, with a `probe` share."""
    affinity: bool = True
    """Requests of one agent task (x-task-id, per tenant) or session (prompt_cache_key,
    x-session-id, or the deprecated `user` field) stay on one deployment while it is eligible and
    not loaded past `affinity_load_factor`."""
    affinity_load_factor: float = Field(1.5, ge=1.0)
    """Most a deployment may hold, as a multiple of the average in flight (rounded up), and still
    keep a task's, session's or prefix's requests."""
    affinity_entries: int = Field(100_000, ge=1)
    """Tasks and sessions remembered for affinity (least recently used go first)."""
    ewma_alpha: float = Field(0.3, gt=0, le=1)
    """`latency`: the weight of a new sample in the EWMAs."""
    probe: float = Field(0.05, ge=0, le=0.5)
    """`latency`: the share of requests sent to a random other deployment, so a recovered one is
    measured again."""
    stale_s: float = Field(30.0, gt=0)
    """`latency`: seconds after which a deployment's EWMA is not trusted and that deployment is
    tried first."""
    prefix_affinity: bool = True
    """Requests whose prompts start alike go to the same deployment (consistent hashing with the
    `affinity_load_factor` bound), so the engine reuses the cached prefix."""
    prefix_chars: int = Field(1024, ge=1)
    """Characters of a prompt's start (roles and texts of its messages in order) hashed for prefix
    affinity."""
    prefix_min_chars: int = Field(1024, ge=1)
    """A prompt shorter than this many characters has no prefix affinity."""
    failover: int = Field(1, ge=0)
    """Other eligible deployments of the alias tried, when the chosen one fails with an error
    another may not have (cannot connect, timeout, 5xx, not ready, circuit open), before the model's
    fallbacks. 0: straight to the fallbacks."""
