"""Who calls: the principal a request carries into every stage, its limits and its
task budget. At the bottom of the layering (it imports nothing of Switchyard), so the
request context (pipeline_context.py) and every stage can name these types."""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field
from typing import Any

BUDGET_FIELDS = ("calls", "tokens", "cost_usd", "wall_s", "tool_calls")
# Scheduling classes, highest first: a principal's class is its index here (what the
# deployment gates order waiters by, policy/admission.py's Priority).
PRIORITY_NAMES = ("interactive", "standard", "batch")
STANDARD = 1


@dataclass(frozen=True, slots=True)
class TaskBudget:
    """A task's limits; None = unlimited. `calls` counts model calls, `tool_calls` the
    tools/call requests through `/mcp` (mcp_service/); `cost_usd` both (a tool's
    price per call, `mcp.servers[].tool_prices`)."""

    calls: int | None = None
    tokens: int | None = None
    cost_usd: float | None = None
    wall_s: float | None = None
    tool_calls: int | None = None

    @classmethod
    def of(cls, values: Any) -> TaskBudget:
        """From a mapping (config, key store, parsed header) or None."""
        if not values:
            return cls()
        get = values.get if isinstance(values, dict) else lambda k: getattr(values, k, None)
        calls, tokens = get("calls"), get("tokens")
        cost, wall = get("cost_usd"), get("wall_s")
        tool_calls = get("tool_calls")
        return cls(
            int(calls) if calls is not None else None,
            int(tokens) if tokens is not None else None,
            float(cost) if cost is not None else None,
            float(wall) if wall is not None else None,
            int(tool_calls) if tool_calls is not None else None,
        )

    def lower(self, other: TaskBudget) -> TaskBudget:
        """Field by field, the smaller limit of the two (a client may only lower)."""

        def low(a: Any, b: Any) -> Any:
            return b if a is None else a if b is None else min(a, b)

        return TaskBudget(
            low(self.calls, other.calls),
            low(self.tokens, other.tokens),
            low(self.cost_usd, other.cost_usd),
            low(self.wall_s, other.wall_s),
            low(self.tool_calls, other.tool_calls),
        )

    def as_dict(self) -> dict[str, Any]:
        return {f: getattr(self, f) for f in BUDGET_FIELDS if getattr(self, f) is not None}

    @property
    def empty(self) -> bool:
        return (
            self.calls is None
            and self.tokens is None
            and self.cost_usd is None
            and self.tool_calls is None
        )


def model_allowed(patterns: list[str] | tuple[str, ...], alias: str) -> bool:
    for p in patterns:
        if p == "*" or p == alias:
            return True
        if ("*" in p or "?" in p or "[" in p) and fnmatch.fnmatchcase(alias, p):
            return True
    return False


@dataclass(frozen=True, slots=True)
class Limits:
    rpm: int | None = None
    tpm: int | None = None
    max_concurrency: int | None = None
    budget_usd: float | None = None
    budget_period: str = "day"


@dataclass(frozen=True, slots=True)
class Principal:
    """Who is calling: travels with the request into every later stage."""

    tenant_id: str
    key_id: str
    key_models: tuple[str, ...]
    tenant_models: tuple[str, ...]
    key_limits: Limits
    tenant_limits: Limits
    labels: dict[str, Any] = field(default_factory=dict)
    # Regions (data boundary) this tenant's requests may go to; None = anywhere.
    regions: tuple[str, ...] | None = None
    # The key's allowed_adapters (patterns): none unless the key names them.
    key_adapters: tuple[str, ...] = ()
    # Whether the key may pin a revision (`model: "alias@revision"`).
    may_pin_revisions: bool = False
    # Whether placement honours the key's x-switchyard-device-state / -network headers.
    may_report_device_state: bool = False
    # The tenant's and the key's task budget, combined .
    task_budget: TaskBudget | None = None
    # The scheduling class (index in PRIORITY_NAMES): the lower of the tenant's and the
    # key's; a request may lower its own (x-switchyard-priority), never raise it.
    priority: int = STANDARD
    # When the key expires (unix seconds; None: never): no cached answer outlives it.
    expires_at: float | None = None

    def may_use(self, alias: str) -> bool:
        return model_allowed(self.key_models, alias) and model_allowed(self.tenant_models, alias)

    def boundary(self, model_boundary: list[str] | None) -> list[str] | None:
        """The regions this caller's request to a model with `model_boundary` (its
        `data_boundary`) may go to, None for anywhere: the model's within the tenant's."""
        if self.regions is None:
            return model_boundary
        return [r for r in (model_boundary or self.regions) if r in self.regions]

    def reaches(self, model_boundary: list[str] | None, regions: list[str]) -> bool:
        """Whether a model running in `regions` (its deployments') has one this caller's
        requests may go to (`boundary`)."""
        allowed = self.boundary(model_boundary)
        return allowed is None or any(r in allowed for r in regions)

    def adapter_refusal(self, name: str, allowed_tenants: list[str]) -> str | None:
        """Why this caller may not use the adapter `name`, or None: the adapter must
        list its tenant (or "*") and the key's allowed_adapters must match it."""
        if self.tenant_id not in allowed_tenants and "*" not in allowed_tenants:
            return f"the adapter '{name}' is not available to this tenant"
        if not model_allowed(self.key_adapters, name):
            return f"this API key may not use the adapter '{name}' (its allowed_adapters)"
        return None


# Who calls when auth.mode is disabled: no key, no limits of its own.
ANONYMOUS = Principal(
    tenant_id="anonymous",
    key_id="none",
    key_models=("*",),
    tenant_models=("*",),
    key_limits=Limits(),
    tenant_limits=Limits(),
    key_adapters=("*",),  # auth disabled: adapters open to every tenant ("*") serve
    may_pin_revisions=True,
    may_report_device_state=True,  # auth disabled: local experiments report freely
)
