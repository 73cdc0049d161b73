"""Prometheus metrics, exposed as text at /metrics.

Label sets are bounded: model aliases, tenants (created by an admin), statuses,
error classes — never request ids. The tenant label is the tenant id, a keyed hash of
it, or absent (`observe.metrics_tenant_label`): ids name customers, and /metrics may
be read by more people than the tenant list. With several worker processes, set
PROMETHEUS_MULTIPROC_DIR and each process writes its values there; /metrics then
aggregates them (prometheus_client's multiprocess mode).

The parts beside it: the tenant label (metrics_tenant.py), the batching of updates
between folds (metrics_batch.py) and the deployments' scrape-time gauges
(metrics_live.py). Their names used elsewhere are imported from here.
"""

from __future__ import annotations

import asyncio
import logging
import os
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
    multiprocess,
)

from switchyard.observe.metrics_batch import Shape, _Batch, _Children, _Common
from switchyard.observe.metrics_batch import observe_many as observe_many
from switchyard.observe.metrics_live import _LiveCollector
from switchyard.observe.metrics_tenant import NO_TENANT, TenantLabel, hashed_tenant
from switchyard.observe.metrics_tenant import tenant_key as tenant_key
from switchyard.outcomes import Kind, Retry, parse
from switchyard.pipeline import RequestContext

log = logging.getLogger("switchyard.metrics")

# 1 ms to 60 s: covers a cached answer and a long CPU generation alike.
LATENCY_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
)
BREAKER_VALUE = {"closed": 0, "half_open": 1, "open": 2}
REJECTION_CODES = {
    "rate_limit_rpm": "rpm",
    "rate_limit_tpm": "tpm",
    "tokens_exceed_limit": "tpm",
    "rate_limit_concurrency": "concurrency",
    "insufficient_quota": "budget",
    "queue_full": "queue_full",
    "deadline_exceeded": "deadline",
    "deadline_unreachable": "deadline_unreachable",  # scheduling.policy: task_aware
    "overloaded": "overloaded",
    "limiter_unavailable": "limiter_unavailable",
}


def _first_attempt_success(ctx: RequestContext, status: str) -> bool:
    """A request that succeeded on its first attempt at the model it asked for: it
    went through every stage, made one attempt and was refused nothing."""
    return (
        status == "ok"
        and ctx.run.attempts == 1
        and ctx.run.fallback_from is None
        and ctx.error_code is None
    )


class Metrics:
    def __init__(
        self,
        tenant_label: TenantLabel = "id",
        tenant_key: bytes | None = None,
        known_models: frozenset[str] = frozenset(),
    ) -> None:
        """`known_models`: the configured aliases, the only ones that may label a
        request refused before its model was resolved (the rest are "unknown")."""
        if tenant_label == "hashed" and not tenant_key:
            raise ValueError("the hashed tenant label needs a key")
        self.tenant_mode: TenantLabel = tenant_label
        self._tenant_key = tenant_key or b""
        self._tenant_labels: dict[str, tuple[str, ...]] = {}
        tenant = [] if tenant_label == "off" else ["tenant"]
        self.multiprocess = bool(os.environ.get("PROMETHEUS_MULTIPROC_DIR"))
        # In multiprocess mode values live in files; otherwise in our own registry.
        self.registry = CollectorRegistry(auto_describe=True)
        reg = None if self.multiprocess else self.registry

        def hist(name: str, doc: str) -> Histogram:
            return Histogram(name, doc, ["model"], buckets=LATENCY_BUCKETS, registry=reg)

        self.requests = Counter(
            "switchyard_requests", "Finished requests", ["model", *tenant, "status"], registry=reg
        )
        self.e2e = hist("switchyard_request_duration_seconds", "End-to-end time in the gateway")
        self.ttft = hist("switchyard_ttft_seconds", "Time to the first byte sent to the client")
        self.itl = hist("switchyard_inter_chunk_seconds", "Time between streamed chunks")
        self.queue = hist("switchyard_queue_seconds", "Time waiting for a deployment slot")
        self.attempts = Counter(
            "switchyard_upstream_attempts",
            "Upstream attempts by outcome",
            ["model", "outcome"],
            registry=reg,
        )
        self.success = Counter(
            "switchyard_success",
            "Successful requests by how they succeeded (first_attempt, retry, fallback)",
            ["model", "after"],
            registry=reg,
        )
        self.retries = Counter("switchyard_retries", "Retries taken", ["model"], registry=reg)
        # MCP tool calls through /mcp (mcp_service/), by server and namespaced tool.
        self.tool_calls = Counter(
            "switchyard_tool_calls",
            "MCP tool calls by server, tool and status",
            ["server", "tool", "status"],
            registry=reg,
        )
        self.tool_duration = Histogram(
            "switchyard_tool_call_duration_seconds",
            "MCP tool call time in the gateway, tool included",
            ["server", "tool"],
            buckets=LATENCY_BUCKETS,
            registry=reg,
        )
        self.fallbacks = Counter(
            "switchyard_fallbacks", "Fallbacks taken", ["from_model", "to_model"], registry=reg
        )
        self.breaker = Gauge(
            "switchyard_breaker_state",
            "Circuit breaker: 0 closed, 1 half-open, 2 open",
            ["model"],
            registry=reg,
            multiprocess_mode="max",
        )
        self.rejections = Counter(
            "switchyard_rejections", "Requests refused by policy", ["kind"], registry=reg
        )
        self.tokens = Counter("switchyard_tokens", "Tokens", ["model", "direction"], registry=reg)
        self.cost = Counter("switchyard_cost_usd", "Cost in USD", ["model", *tenant], registry=reg)
        self.cache = Counter("switchyard_cache", "Cache lookups", ["result"], registry=reg)
        self.routes = Counter(
            "switchyard_route_decisions", "Route decisions", ["route"], registry=reg
        )
        self.media_stage = Histogram(
            "switchyard_media_stage_seconds",
            "Image preprocessing time per step (fetch, decode, resize, encode)",
            ["stage"],
            buckets=LATENCY_BUCKETS,
            registry=reg,
        )
        self.media_refusals = Counter(
            "switchyard_media_refusals",
            "Image parts refused, by error code",
            ["code"],
            registry=reg,
        )
        self.ledger_dropped = Counter(
            "switchyard_ledger_rows_dropped",
            "Usage rows lost: not serialisable even after repair, or a stalled writer",
            registry=reg,
        )
        self.ledger_repaired = Counter(
            "switchyard_ledger_rows_repaired",
            "Usage rows written with an unserialisable field replaced (logged)",
            registry=reg,
        )
        # The residency pool (engines/pool.py).
        self.engine_loads = Counter(
            "switchyard_engine_loads", "Local model loads by the pool", ["model"], registry=reg
        )
        self.engine_evictions = Counter(
            "switchyard_engine_evictions",
            "Local models unloaded to make room (LRU) or after their idle TTL",
            ["model", "reason"],
            registry=reg,
        )
        self.engine_cold_start = Histogram(
            "switchyard_engine_cold_start_seconds",
            "Time from starting a local model to its first real answer",
            ["model"],
            buckets=(0.25, 0.5, 1, 2, 4, 8, 15, 30, 60, 120),
            registry=reg,
        )
        # Several deployments of an alias (decide/balance.py): how often each was
        # chosen; in flight and the latency EWMAs are read from the balancers at scrape.
        self.deployment_selected = Counter(
            "switchyard_deployment_selected",
            "Requests sent to each deployment of an alias with several",
            ["model", "deployment"],
            registry=reg,
        )
        self.canary_cuts = Counter(
            "switchyard_canary_cuts",
            "Canary deployments cut to weight 0 by the canary guard",
            ["model", "deployment"],
            registry=reg,
        )
        self.placements = Counter(
            "switchyard_placements",
            "Placement decisions (models[].placement) by mode and reason",
            ["model", "mode", "reason"],
            registry=reg,
        )
        self.placement_changes = Counter(
            "switchyard_placement_mode_changes",
            "Device conditions entered or ended (hysteresis), by condition",
            ["model", "condition", "to"],
            registry=reg,
        )
        self.placement_error = Histogram(
            "switchyard_placement_estimate_error_seconds",
            "Observed end-to-end time minus placement's estimate for the chosen location",
            ["model", "location"],
            buckets=(-5, -1, -0.25, -0.05, -0.01, 0, 0.01, 0.05, 0.25, 1, 5),
            registry=reg,
        )
        self.adapter_events = Counter(
            "switchyard_adapter_events",
            "Adapter residency: loads (cold to loaded), evictions (LRU, max_adapters) and "
            "promotions (warm to active)",
            ["model", "adapter", "event"],
            registry=reg,
        )
        self.revision_events = Counter(
            "switchyard_revision_events",
            "RL revision state changes (prepared, loaded, validated, active, draining, "
            "retired, rejected)",
            ["model", "state"],
            registry=reg,
        )
        self.engine_resident = Gauge(
            "switchyard_engine_resident",
            "1 while the local model is loaded",
            ["model"],
            registry=reg,
            multiprocess_mode="max",
        )
        self.engine_memory = Gauge(
            "switchyard_engine_memory_bytes",
            "Resident memory of the local model's engine process (measured)",
            ["model"],
            registry=reg,
            multiprocess_mode="max",
        )
        self._ledger_seen = (0, 0)
        self.ledger_queued = Gauge(
            "switchyard_ledger_queued_bytes",
            "Serialised ledger batches waiting for the writer process (in memory)",
            registry=reg,
            multiprocess_mode="max",
        )
        # Requests whose client hung up (mid-body, mid-stream): their own count, so
        # they neither look like gateway errors nor hide in them.
        self.client_disconnects = Counter(
            "switchyard_client_disconnects",
            "Requests that ended because the client closed its connection, by endpoint",
            ["endpoint"],
            registry=reg,
        )

        self._requests = _Children(self.requests)
        self._e2e = _Children(self.e2e)
        self._ttft = _Children(self.ttft)
        self._itl = _Children(self.itl)
        self._queue = _Children(self.queue)
        self._attempts = _Children(self.attempts)
        self._success = _Children(self.success)
        self._tokens = _Children(self.tokens)
        self._cost = _Children(self.cost)
        self._cache = _Children(self.cache)
        self._retries = _Children(self.retries)
        self._routes = _Children(self.routes)
        self._fallbacks = _Children(self.fallbacks)
        self._rejections = _Children(self.rejections)
        self.fold_s = 0.02

        self.known_models = known_models  # configured aliases
        self._first_attempt: dict[tuple[str, str, str, str | None], Shape] = {}
        self._common: dict[tuple[str, str, str | None, str | None], _Common] = {}
        self._pending: list[tuple[RequestContext, str, int, int, float]] = []
        self._fold_loop: asyncio.AbstractEventLoop | None = None
        self._fold_due = False  # something is waiting for the scheduled fold

    def tenant_labels(self, tenant_id: str) -> tuple[str, ...]:
        """The tenant's values in the `tenant` label: (id,), (keyed hash,) or () when the
        label is off. Computed once per tenant (the hash is not free per request)."""
        got = self._tenant_labels.get(tenant_id)
        if got is None:
            if self.tenant_mode == "off":
                got = ()
            elif self.tenant_mode == "id" or tenant_id == NO_TENANT:
                got = (tenant_id,)
            else:
                got = (hashed_tenant(self._tenant_key, tenant_id),)
            if len(self._tenant_labels) >= 65536:  # bounded: tenants are admin-created
                self._tenant_labels.clear()
            self._tenant_labels[tenant_id] = got
        return got

    def tenant_label(self, tenant_id: str) -> str | None:
        """What /metrics calls this tenant (None: no tenant label), for an admin who
        must find a hashed tenant's series."""
        labels = self.tenant_labels(tenant_id)
        return labels[0] if labels else None

    def engine_event(self, event: str, model: str, seconds: float | None) -> None:
        """The pool's load / evict / unload events (EnginePool.on_event)."""
        if event == "load":
            self.engine_loads.labels(model).inc()
            if seconds is not None:
                self.engine_cold_start.labels(model).observe(seconds)
            self.engine_resident.labels(model).set(1)
        elif event in ("evict", "unload"):
            reason = "lru" if event == "evict" else "idle"
            self.engine_evictions.labels(model, reason).inc()
            self.engine_resident.labels(model).set(0)

    def placed(self, model: str, placement: Any, changes: list[Any]) -> None:
        """A placement decision, and the device conditions it saw change."""
        self.placements.labels(model, placement.mode, placement.reason).inc()
        for c in changes:
            self.placement_changes.labels(
                model, c.condition, "active" if c.active else "ended"
            ).inc()

    def adapter_event(self, event: str, model: str, adapter: str, seconds: float | None) -> None:
        """The pool's adapter load / evict / promote events (EnginePool.on_adapter)."""
        self.adapter_events.labels(model, adapter, event).inc()

    def revision_event(self, rev: Any, state: str) -> None:
        """A revision's state change (engines/revisions.py)."""
        self.revision_events.labels(rev.alias, state).inc()

    def client_disconnected(self, endpoint: str) -> None:
        """A request whose client left before its end (`endpoint` is the gateway's
        own name for the route, never client text: the label set stays bounded)."""
        self.client_disconnects.labels(endpoint).inc()

    def engine_memory_mb(self, model: str, mb: float | None) -> None:
        if mb is not None:
            self.engine_memory.labels(model).set(mb * 1024 * 1024)

    def watch_deployments(self, deployments: list[Any]) -> None:
        """Gauges of each balanced deployment's live state, read at scrape time (in
        one process; the multiprocess mode has no callbacks)."""
        if self.multiprocess or not deployments:
            return
        self.registry.register(_LiveCollector(deployments))

    def observe(self, ctx: RequestContext, status: str, inp: int, out: int, cost: float) -> None:
        """Record one finished request. Under an event loop it is folded into the
        metrics within `fold_s` (with whatever else finished meanwhile) and always
        before a scrape, so a request that has just finished pays for none of it."""
        if ctx.admission.balanced is not None:
            dep = ctx.admission.balanced[1]
            self.deployment_selected.labels(dep.alias, dep.name).inc()
        common = self._common_of(ctx, status)
        if common is None:
            self._pending.append((ctx, status, inp, out, cost))
        else:  # the common request: its values go straight into its shape's lists
            common.n += 1
            t = ctx.timings
            if t.ended is not None:
                common.e2e.append(t.ended - t.received)
            if t.client_first_byte is not None:
                common.ttft.append(t.client_first_byte - t.received)
            if ctx.admission.queue_ms is not None:
                common.queue.append(ctx.admission.queue_ms / 1000)
            common.inp += inp
            common.out += out
            common.cost += cost
            if ctx.run.chunk_gaps:
                common.itl.extend(ctx.run.chunk_gaps)
        scheduled = self._fold_loop
        if self._fold_due and scheduled is not None and not scheduled.is_closed():
            return  # a fold is already scheduled (no loop lookup: it costs a syscall)
        self._fold_due = True
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            self.fold()
            return
        self._fold_loop = loop
        loop.call_later(self.fold_s, self.fold)

    def fold(self) -> None:
        """Apply every queued observation."""
        pending, self._pending = self._pending, []
        self._fold_due = False
        batch = _Batch()
        for common in self._common.values():
            if common.n:
                common.fold_into(batch, self)
        for args in pending:
            try:
                self._observe(batch, *args)
            except Exception:  # one bad record must not cost the others theirs
                log.exception("could not record metrics of %s", args[0].input.request_id)
        batch.apply()

    def _observe(
        self, b: _Batch, ctx: RequestContext, status: str, inp: int, out: int, cost: float
    ) -> None:
        if ctx.deployment is not None:
            model = ctx.deployment.alias
        elif ctx.alias is not None and ctx.alias in self.known_models:  # refused early
            model = ctx.alias
        else:
            model = "unknown"  # never label with a client-supplied, unknown name
        tenant = ctx.principal.tenant_id if ctx.principal is not None else NO_TENANT
        t = ctx.timings
        incs = self.first_attempt_shape(ctx, model, tenant, status) or self.scanned_shape(
            ctx, model, tenant, status
        )
        b.shape(incs)
        if t.ended is not None:
            b.observe(self._e2e, (model,), t.ended - t.received)
        if t.client_first_byte is not None:
            b.observe(self._ttft, (model,), t.client_first_byte - t.received)
        if ctx.admission.queue_ms is not None:
            b.observe(self._queue, (model,), ctx.admission.queue_ms / 1000)
        if inp:
            b.inc(self._tokens, (model, "input"), inp)
        if out:
            b.inc(self._tokens, (model, "output"), out)
        if cost:
            b.inc(self._cost, (model, *self.tenant_labels(tenant)), cost)
        if ctx.run.chunk_gaps:
            itl = (ctx.deployment.alias if ctx.deployment is not None else "unknown",)
            for gap in ctx.run.chunk_gaps:
                b.observe(self._itl, itl, gap)

    def _common_of(self, ctx: RequestContext, status: str) -> _Common | None:
        """The accumulator of a first-attempt success (see `first_attempt_shape`), or
        None for any other request."""
        dep = ctx.deployment
        if dep is None or not _first_attempt_success(ctx, status):
            return None
        tenant = ctx.principal.tenant_id if ctx.principal is not None else NO_TENANT
        key = (dep.alias, tenant, ctx.route, ctx.cache)
        common = self._common.get(key)
        if common is None:
            shape = self.first_attempt_shape(ctx, dep.alias, tenant, status)
            assert shape is not None
            if len(self._common) >= 4096:  # bounded: aliases x tenants x routes
                self.fold()
                self._common.clear()
            common = self._common[key] = _Common(shape, dep.alias, self.tenant_labels(tenant))
        return common

    def first_attempt_shape(
        self, ctx: RequestContext, model: str, tenant: str, status: str
    ) -> Shape | None:
        """The counters of the common request, one that succeeded on its first attempt
        at the model it asked for, without reading its decisions: such a request went
        through every stage (one route decision), made one attempt (ok, no retry) and
        was refused nothing. None for any other request."""
        if ctx.deployment is None or not _first_attempt_success(ctx, status):
            return None
        route = "explicit" if ctx.route is None else f"route:{ctx.route}"
        key = (model, tenant, route, ctx.cache)
        shape = self._first_attempt.get(key)
        if shape is None:
            incs = [
                (self._requests, (model, *self.tenant_labels(tenant), status)),
                (self._routes, (route,)),
                (self._attempts, (model, "ok")),
                (self._success, (model, "first_attempt")),
            ]
            if ctx.cache is not None:
                incs.append((self._cache, (ctx.cache,)))
            if len(self._first_attempt) >= 4096:  # bounded: aliases x tenants x routes
                self._first_attempt.clear()
            shape = self._first_attempt[key] = tuple(incs)
        return shape

    def scanned_shape(self, ctx: RequestContext, model: str, tenant: str, status: str) -> Shape:
        """Any request's counters, read from its decisions."""
        incs: list[tuple[_Children, tuple[str, ...]]] = [
            (self._requests, (model, *self.tenant_labels(tenant), status))
        ]
        retried = False
        for d in ctx.decisions:
            stage, outcome, evidence = d.stage, d.outcome, d.evidence
            if stage == "attempt":
                result, detail = parse(outcome)  # "ok", "engine_crashed", "error:<class>"
                if result != Kind.SKIP:
                    alias = (evidence or {}).get("alias", model)
                    incs.append(
                        (self._attempts, (str(alias), str(result) if detail is None else detail))
                    )
            elif stage == "retry" and outcome == Retry.BACKOFF:
                retried = True
                incs.append((self._retries, (model,)))
            elif stage == "route":
                incs.append((self._routes, (str(outcome),)))  # the value, not the enum
        if ctx.run.fallback_from is not None:
            incs.append((self._fallbacks, (ctx.run.fallback_from, model)))
        if status == "ok" and ctx.run.attempts:
            after = (
                "fallback" if ctx.run.fallback_from else ("retry" if retried else "first_attempt")
            )
            incs.append((self._success, (model, after)))
        kind = REJECTION_CODES.get(ctx.error_code or "")
        if kind is not None:
            incs.append((self._rejections, (kind,)))
        if ctx.cache is not None:
            incs.append((self._cache, (ctx.cache,)))
        return tuple(incs)

    def tool_call(self, server: str, tool: str, status: str, seconds: float) -> None:
        """One MCP tool call through /mcp (tool names are the configured servers' own)."""
        self.tool_calls.labels(server, tool, status).inc()
        self.tool_duration.labels(server, tool).observe(seconds)

    def set_breakers(self, states: dict[str, Any]) -> None:
        for model, state in states.items():
            self.breaker.labels(model).set(BREAKER_VALUE.get(state, 0))

    def set_ledger(self, dropped: int, repaired: int, queued_bytes: int = 0) -> None:
        """Bring the ledger's counters (kept by the ledger itself) up to date."""
        self.ledger_queued.set(queued_bytes)
        was_dropped, was_repaired = self._ledger_seen
        if dropped > was_dropped:
            self.ledger_dropped.inc(dropped - was_dropped)
        if repaired > was_repaired:
            self.ledger_repaired.inc(repaired - was_repaired)
        self._ledger_seen = (max(dropped, was_dropped), max(repaired, was_repaired))

    def exposition(self) -> bytes:
        self.fold()
        if self.multiprocess:
            registry = CollectorRegistry()
            multiprocess.MultiProcessCollector(registry)
            return bytes(generate_latest(registry))
        return bytes(generate_latest(self.registry))
