"""/admin/live: the console's live view — the ledger over the last minutes and the
gateway's state now (breakers of models and tool servers, queues, engines, cache)."""

from __future__ import annotations

import time
from typing import Any, Protocol

from starlette.requests import Request
from starlette.responses import Response

from switchyard.api.admin.guard import Guard
from switchyard.api.admin.params import as_json, query_number
from switchyard.decide.cache import ResponseCache
from switchyard.engines.registry import Registry
from switchyard.execute.executor import Executor
from switchyard.policy.admission import DeploymentGate
from switchyard.service import RequestService
from switchyard.state.ledger_reads import live_summary


class LiveServices(Protocol):
    service: RequestService  # settled(), and the requests in flight
    ledger: Any  # UsageLedger or MemoryLedger (state/store.py: Ledger)
    executor: Executor  # the models' breakers
    gates: dict[str, DeploymentGate]
    registry: Registry
    cache: ResponseCache | None
    mcp: Any  # the MCP tool gateway (mcp_service/), None without tool servers


def breaker_states(services: LiveServices, now: float) -> dict[str, str]:
    """Every breaker's state: each model deployment's by its name, then each MCP tool
    server's as `mcp:<server>` (the name /readyz gives it)."""
    out = {a: b.describe(now)["state"] for a, b in services.executor.breakers.items()}
    mcp = services.mcp
    if mcp is not None:
        for name, server in mcp.servers.servers.items():
            if server.breaker is not None:
                out[f"mcp:{name}"] = server.breaker.describe(now)["state"]
    return out


class Live:
    """The live view."""

    def __init__(self, services: LiveServices, guard: Guard) -> None:
        self.s = services
        self.guard = guard

    async def live(self, request: Request) -> Response:
        """The live view: the ledger over the last ?window_s= (60, at most 3600) seconds,
        and the gateway's state now (breakers, queues, engines)."""
        self.guard(request)
        s = self.s
        await s.service.settled()
        window = query_number(request.query_params, "window_s", 60.0)
        assert window is not None
        window = min(max(window, 1.0), 3600.0)
        now_wall = time.time()
        out = s.ledger.read(live_summary, now_wall - window, now_wall + 1e-6)
        now = time.monotonic()
        out["breakers"] = breaker_states(s, now)
        out["queues"] = {
            name: {"in_flight": g.in_flight, "queued": g.queued} for name, g in s.gates.items()
        }
        out["active_requests"] = s.service.active
        reg = s.registry
        out["engines"] = {
            e.alias: {
                "state": e.describe()["state"],
                "in_flight": e.in_flight,
                "memory_mb": e.memory_mb,
                "adapters": {
                    n: a["state"] for n, a in (e.describe().get("adapters") or {}).items()
                },
            }
            for e in reg.managed()
        }
        out["engine_load"] = {  # what each engine last said of its own load
            d.name: d.live.engine.describe(now) for d in reg.every() if d.live.engine is not None
        }
        out["cache"] = s.cache.stats() if s.cache is not None else {"enabled": False}
        return as_json(out)
