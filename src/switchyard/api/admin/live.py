"""/admin/live: the console's live view — the ledger over the last minutes and the
gateway's state now (breakers of models and tool servers, queues, engines, cache).

Of several workers (`serve --workers N`) any worker shows one gateway. What lives once
is read where it lives: the gates with a `max_concurrency` and the managed engines are
the control plane's (policy/admission_remote.py: `host_gates`; control/follow.py), as
are the tool servers and their breakers; the models' breakers are shared over Redis;
the ledger is the one writer's. What each worker counts of its own — requests in
flight, the gates without a limit — is this worker's now plus every other worker's
last report to the control plane, at most about a second old
(control/worker_live.py; `"workers"` says how many are counted). When the control
plane does not answer, `"control_plane": "unreachable"` says so and those counts are
this worker's alone (`"scope": "worker"`). The cache's stats are this worker's copy
of the shared entries; each engine's load is as this worker last read it.
"""

from __future__ import annotations

import time
from typing import Any, Protocol

from starlette.requests import Request
from starlette.responses import Response

from switchyard.api.admin.guard import Guard
from switchyard.api.admin.params import as_json, query_number
from switchyard.config import ProcessRole
from switchyard.control.worker_live import host_live, others
from switchyard.decide.cache import ResponseCache
from switchyard.engines.registry import Registry
from switchyard.execute.executor import Executor
from switchyard.policy.admission import DeploymentGate
from switchyard.policy.admission_remote import RemoteGate, host_gates
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
    role: ProcessRole

    def engines_report(self) -> dict[str, Any]: ...


MAX_TOOL_BREAKERS = 1024  # tool servers' breakers taken from a control plane's answer


def breaker_states(services: LiveServices, now: float) -> dict[str, str]:
    """Every breaker's state: each model deployment's by its name, then each MCP tool
    server's as `mcp:<server>` (the name /readyz gives it)."""
    out = {a: b.describe(now)["state"] for a, b in services.executor.breakers.items()}
    out.update(tool_breakers(services.mcp, now))
    return out


def tool_breakers(mcp: Any, now: float) -> dict[str, str]:
    """Each MCP tool server's breaker state as `mcp:<server>`; none without tool
    servers in this process (of several workers, they are the control plane's)."""
    if mcp is None:
        return {}
    return {
        f"mcp:{name}": server.breaker.describe(now)["state"]
        for name, server in mcp.servers.servers.items()
        if server.breaker is not None
    }


def _reported_breakers(host: dict[str, Any]) -> dict[str, str]:
    """The tool servers' breakers in the control plane's answer, read as untrusted:
    only `mcp:` names with a short state, at most MAX_TOOL_BREAKERS of them."""
    given = host.get("breakers")
    out: dict[str, str] = {}
    for name, state in (given if isinstance(given, dict) else {}).items():
        if len(out) >= MAX_TOOL_BREAKERS:
            break
        if name.startswith("mcp:") and len(name) <= 300 and isinstance(state, str):
            out[name] = state[:32]
    return out


def engine_rows(report: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Each engine's row of the live view from an engines report (of a worker, the
    control plane's, as it sent it): what is not shaped as a report is left out
    rather than failing the page."""
    engines = report.get("engines")
    rows: dict[str, dict[str, Any]] = {}
    for alias, e in (engines if isinstance(engines, dict) else {}).items():
        if not isinstance(e, dict):
            continue
        adapters = e.get("adapters")
        rows[alias] = {
            "state": e.get("state"),
            "in_flight": e.get("in_flight"),
            "memory_mb": e.get("memory_mb"),
            "adapters": {
                n: a.get("state")
                for n, a in (adapters if isinstance(adapters, dict) else {}).items()
                if isinstance(a, dict)
            },
        }
    return rows


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
        await s.service.settler.settled()
        window = query_number(request.query_params, "window_s", 60.0)
        assert window is not None
        window = min(max(window, 1.0), 3600.0)
        now_wall = time.time()
        out = s.ledger.read(live_summary, now_wall - window, now_wall + 1e-6)
        now = time.monotonic()
        out["breakers"] = breaker_states(s, now)
        host = None
        if s.role.worker:  # the other workers' counts and the tool servers' breakers
            host = await host_live(s.role.control_url, s.role.token)
        rest = others(host, s.role.index) if host is not None else None
        out["queues"], reached = await self.queues(rest)
        out["active_requests"] = s.service.active + sum(o["active_requests"] for o in rest or ())
        if host is not None:
            out["breakers"].update(_reported_breakers(host))
            out["workers"] = 1 + len(rest or ())
        reg = s.registry
        report = s.engines_report()  # of several workers: the control plane's
        out["engines"] = engine_rows(report)
        if not reached or "control_plane" in report or (s.role.worker and host is None):
            out["control_plane"] = "unreachable"
        out["engine_load"] = {  # what each engine last said of its own load
            d.name: d.live.engine.describe(now) for d in reg.every() if d.live.engine is not None
        }
        out["cache"] = s.cache.stats() if s.cache is not None else {"enabled": False}
        return as_json(out)

    async def queues(
        self, rest: list[dict[str, Any]] | None = None
    ) -> tuple[dict[str, dict[str, Any]], bool]:
        """Each gate's requests holding a slot and waiting for one, and whether the
        control plane answered. Of several workers, a gate with a `max_concurrency`
        counts every worker's (one GET to the control plane); if it does not answer,
        this worker's own slots and asks, marked so. A gate without a limit admits in
        each worker (policy/admission_remote.py): this worker's counts plus those in
        the other workers' reports (`rest`, as the control plane last heard them), or
        its own alone when there are none to add."""
        s = self.s
        if not s.role.worker:
            own = {n: {"in_flight": g.in_flight, "queued": g.queued} for n, g in s.gates.items()}
            return own, True
        remote = any(isinstance(g, RemoteGate) for g in s.gates.values())
        host = await host_gates(s.role.control_url, s.role.token) if remote else None
        out: dict[str, dict[str, Any]] = {}
        for name, g in s.gates.items():
            seen = host.get(name) if host is not None and isinstance(g, RemoteGate) else None
            if seen is not None:
                out[name] = {**seen, "scope": "gateway"}
            elif isinstance(g, RemoteGate):
                out[name] = {"in_flight": g.held, "queued": g.waiting, "scope": "worker"}
            elif rest is None:
                out[name] = {"in_flight": g.in_flight, "queued": g.queued, "scope": "worker"}
            else:
                theirs = [o["queues"][name] for o in rest if name in o["queues"]]
                out[name] = {
                    "in_flight": g.in_flight + sum(q["in_flight"] for q in theirs),
                    "queued": g.queued + sum(q["queued"] for q in theirs),
                    "scope": "gateway",
                }
        return out, host is not None or not remote
