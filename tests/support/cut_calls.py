"""What the cut-call money tests share (tests/integration/test_money_s73.py,
test_money_retries_s73.py, test_money_tasks_s73.py): a price at which one call's cap
costs $0.50, and resilience under which calls may fail on purpose."""

from __future__ import annotations

from typing import Any

import httpx

from support.gateways import Gateway

PRICE = {"input": 0.0, "output": 1000.0}  # $0.001 an output token
CAP = 500  # a call's cap: $0.50 at PRICE
NO_STORE = {"Cache-Control": "no-store"}
# Timeouts fail these models' calls on purpose: no breaker opens, no retry budget runs
# out over a module.
STEADY: dict[str, Any] = {
    "backoff_base_s": 0.0,
    "breaker": {"failures": 1000, "min_requests": 1000},
    "retry_budget": {"min_retries": 1000},
}


def decisions(gw: Gateway, r: httpx.Response, stage: str) -> list[dict[str, Any]]:
    """The decisions of `stage` in the stored trace of the request `r` answered."""
    trace = gw.trace(r.headers["x-request-id"])
    return [d for d in trace["decisions"] if d["stage"] == stage]
