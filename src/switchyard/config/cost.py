"""The build-vs-buy report's prices (`switchyard cost`)."""

from __future__ import annotations

from pydantic import Field

from switchyard.config.base import Strict
from switchyard.config.models import Price


class CostConfig(Strict):
    """The build-vs-buy report (`switchyard cost`, the console's cost page): what the
    traffic served by local engines costs self-hosted, against a managed API's prices
    for the same tokens. Both sides over the same window, in USD."""

    instance_usd_per_hour: float = Field(0.0, ge=0, le=1e6)
    """Self-hosted: USD per hour of one instance that runs the local engines."""
    instances: int = Field(1, ge=1, le=100_000)
    """Self-hosted: instances running the local engines (utilization is busy seconds over instances
    x the window)."""
    ops_usd_per_month: float = Field(0.0, ge=0, le=1e9)
    """Self-hosted: other costs per 730-hour month in USD (people, monitoring)."""
    managed: Price = Price()
    """A managed API's list prices, USD per million input and output tokens, for every model."""
    managed_models: dict[str, Price] = {}
    """Managed list prices per model alias, for a model whose comparable managed model is priced
    otherwise than `managed`."""
