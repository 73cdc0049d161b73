"""Wiring: the components of one gateway and the stage sequences over them.

This is the one place where components meet (no module-level state elsewhere): it
builds them, orders the stages (policy/stages.py, decide/stages.py) into pipelines
and hands both to the request service (service.py), which runs every request. The
rest is the control plane: starting and stopping engines, readiness, retention.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sqlite3
import time
from collections.abc import Callable, Mapping
from typing import Any

from switchyard.config import Price, Settings, store_target
from switchyard.decide import encoder_build
from switchyard.decide.balance import Balancer
from switchyard.decide.cache import ResponseCache
from switchyard.decide.candidate import CandidateCheck
from switchyard.decide.candidate import from_config as candidate_check
from switchyard.decide.placement import Placer
from switchyard.decide.shadow_threshold import PartitionThresholds
from switchyard.decide.stages import (
    Cache,
    CachePlanner,
    Embed,
    Place,
    Residency,
    Route,
    Select,
    Tools,
)
from switchyard.embed import EmbeddingService
from switchyard.engines import lora_train
from switchyard.engines.pool import EnginePool
from switchyard.engines.registry import Deployment, Registry, others_at
from switchyard.errors import InvalidRequest, ModelNotFound
from switchyard.execute.embeddings import Embeddings
from switchyard.execute.executor import Executor
from switchyard.execute.idempotent import Idempotent
from switchyard.media.process import MediaProcessor
from switchyard.media.stage import Media
from switchyard.observe.cost import record_busy
from switchyard.observe.metrics import Metrics, tenant_key
from switchyard.observe.otel import build_tracing
from switchyard.observe.responses import Sealer, enforce_response_retention, instance_name
from switchyard.observe.store import MemoryStore, SqliteStore, Store
from switchyard.observe.traces import enforce_disk, enforce_retention
from switchyard.observe.weights import REFRESH_S as WEIGHTS_REFRESH_S
from switchyard.observe.weights import read_weights, write_weights
from switchyard.pipeline import Pipeline
from switchyard.policy.admission import DeploymentGate
from switchyard.policy.auth import Authenticator
from switchyard.policy.cost import PromptOverhead
from switchyard.policy.keys import Limits, NotFound
from switchyard.policy.limits import Limiter, MemoryLimiter
from switchyard.policy.pii import PiiMasker
from switchyard.policy.stages import (
    Admit,
    Authorize,
    ConsumeApproval,
    ConsumedApprovals,
    DeploymentLimits,
    Pii,
    Queue,
    Reserver,
    Task,
    ToolResults,
    Window,
    embedding_estimate,
    generation_estimate,
)
from switchyard.policy.tasks import MemoryTaskStore, Running, TaskStore
from switchyard.policy.tool_calls import ToolPolicy
from switchyard.service import Pipelines, RequestService
from switchyard.settle import Settler

log = logging.getLogger("switchyard")
BUSY_FLUSH_S = 10.0  # how often engine busy time goes to the store (observe/cost.py)


async def _no_approvals(*_: Any) -> tuple[str | None, str | None]:
    return None, "no approval store"


def build_pipelines(
    s: Settings,
    deployments: Mapping[str, Deployment],
    reserver: Reserver,
    gates: Mapping[str, DeploymentGate],
    masker: PiiMasker,
    cache: ResponseCache | None,
    embedder: EmbeddingService | None,
    router: Callable[[], Any],
    register_block: Callable[[list[Any]], str] | None = None,
    media: MediaProcessor | None = None,
    metrics: Metrics | None = None,
    pool: EnginePool | None = None,
    balancers: Mapping[str, Balancer] | None = None,
    tasks: TaskStore | None = None,
    running: Running | None = None,
    consume_approval: ConsumeApproval | None = None,
    placers: Mapping[str, Placer] | None = None,
    overhead: PromptOverhead | None = None,
    revisions: Mapping[str, Any] | None = None,
    consumed_approvals: ConsumedApprovals | None = None,
    check: CandidateCheck | None = None,
    on_canary_cut: Callable[[str, Deployment, str], None] | None = None,
) -> Pipelines:
    """The stages, in order (DESIGN.md: the request pipeline). Evidence that is the
    same for every request of a model is built once and shared (recorded evidence
    is never changed afterwards)."""
    models = {m.alias: m for m in s.served_models()}
    named = {m.alias: {"model": m.alias} for m in s.models}
    overhead = overhead or PromptOverhead(s.policy.prompt_overhead_tokens)
    estimate = generation_estimate(models)
    planner = CachePlanner(s, revisions)
    t = s.tasks
    tasks = tasks or MemoryTaskStore(t.max_tasks, t.idle_ttl_s, t.max_tool_calls)
    running = running or Running()
    embed_estimate = embedding_estimate(Price(input=s.embeddings.price, output=0.0))
    # The checks a semantic candidate must pass (decide/candidate.py), loaded once (the
    # gateway passes its own, which a background build may complete: encoder_build.py).
    if check is None and cache is not None and s.cache.semantic:
        check = candidate_check(s.cache, s.embeddings)
    if cache is not None:
        cache.checks = check.describe() if check is not None else "exact hits only"
    generation = Pipeline(
        [
            # First: it reads the body (the size of what is asked), so the static
            # stages after it fold into one block.
            Window(s, models, overhead),
            Authorize(named, {a.name: a for a in s.adapters}),
            ToolResults(
                ToolPolicy(s.tools), tasks, consume_approval or _no_approvals, consumed_approvals
            ),
            Task(s, tasks, running, estimate),
            Admit(reserver, estimate),
            Pii(s, masker, cache is not None),
            Embed(s, embedder, cache, planner, router),
            Cache(s, cache, planner, check, embedder),
            Route(s, router, named),
            Tools(s, embedder, ToolPolicy(s.tools) if s.tools.check_outputs else None),
            Select(
                deployments,
                balancers,
                tasks,
                placers,
                metrics.placed if metrics else None,
                metrics,
                on_canary_cut,
            ),
            *([Media(media, metrics)] if media is not None else []),
            DeploymentLimits(reserver, estimate),
            Queue(gates),
            *([Residency(pool, revisions)] if pool is not None else []),
            Place(),
        ],
        models,
        # An alias with several deployments has none fixed: its stages look at the
        # one select chose for each request.
        {a: d for a, d in deployments.items() if a not in (balancers or {})},
        register_block,
    )
    alias = s.embeddings.alias
    embeddings = Pipeline(
        [
            Authorize({alias: {"model": alias}}),
            Task(s, tasks, running, embed_estimate),
            Admit(reserver, embed_estimate),
        ]
    )
    return Pipelines(generation, embeddings)


class Gateway:
    def __init__(self, settings: Settings) -> None:
        # Demonstration adapters named by `demo:NAME` are trained on first use (cached).
        settings = lora_train.resolve(settings)
        self.settings = settings
        self.registry = Registry(settings)
        # RL-managed models' revision managers (filled by _build_rollouts): the
        # pipeline sends their chat and completions to the active revision.
        self.revisions: dict[str, Any] = {}
        self._busy_flushed: dict[str, float] = {}  # engine -> busy seconds stored
        self.models = {m.alias: m for m in settings.served_models()}
        self.embedder = (
            EmbeddingService(settings.embeddings, idle=lambda: self.service.active <= 1)
            if settings.embeddings.enabled
            else None
        )
        self.store_target = store_target(settings)
        d = settings.tenants_defaults
        defaults = Limits(d.rpm, d.tpm, d.max_concurrency, d.budget.usd, d.budget.period)
        flush_s = settings.observe.ledger_flush_ms / 1000
        # Stored responses (observe/responses.py): sealed with the configured key or the
        # home's key file (a bad one stops the start here), owned by host:port.
        sealer = Sealer.from_settings(settings)
        owner = instance_name(settings.server.port)
        kept_days = settings.responses.retention_days
        self.store: Store = (
            MemoryStore(
                defaults,
                settings.idempotency.ttl_s,
                flush_s,
                sealer=sealer,
                owner=owner,
                response_retention_days=kept_days,
            )
            if settings.storage.backend == "memory"
            else SqliteStore(
                self.store_target,
                defaults,
                settings.idempotency.ttl_s,
                flush_s,
                int(settings.observe.max_disk_mb * 1024 * 1024),
                sealer=sealer,
                owner=owner,
                response_retention_days=kept_days,
            )
        )
        self.keys = self.store.keys
        self.responses = self.store.responses
        self.ledger = self.store.ledger
        self.idempotency = self.store.idempotency
        self.auth = Authenticator(self.store.verify_key, settings.auth.key_cache_s)
        self.limiter: Limiter
        if settings.storage.redis_url:
            from switchyard.policy.redis_limits import RedisLimiter

            self.limiter = RedisLimiter(
                settings.storage.redis_url, timeout_s=settings.storage.redis_timeout_s
            )
        else:
            self.limiter = MemoryLimiter()
        obs = settings.observe
        self.metrics = (
            Metrics(obs.metrics_tenant_label, tenant_key(settings)) if obs.metrics else None
        )
        if self.metrics is not None:
            self.registry.pool.on_event = self.metrics.engine_event
            self.registry.pool.on_memory = self.metrics.engine_memory_mb
            self.registry.pool.on_adapter = self.metrics.adapter_event
        if self.metrics is not None:  # aliases that may label a refused request
            self.metrics.known_models = frozenset(
                [m.alias for m in settings.models] + [settings.embeddings.alias]
            )
        self.tracing = build_tracing(
            obs.otel.exporter, obs.otel.endpoint, obs.otel.path, obs.otel.service_name
        )
        self.executor = Executor(settings, self.registry, self.tracing)
        # An alias with several deployments picks one per request (decide/balance.py).
        self.balancers = {
            alias: Balancer(alias, deps, deps[0].model.balance, self.executor.breakers)
            for alias, deps in self.registry.replicas.items()
        }
        self.executor.balancers = self.balancers  # fallbacks and failover balance too
        # Edge or cloud per request among an alias's deployments (decide/placement.py).
        self.placers = {
            m.alias: Placer(m.alias, m.placement)
            for m in settings.models
            if m.placement is not None and m.alias in self.balancers
        }
        if self.metrics is not None:
            self.metrics.watch_deployments(
                [d for b in self.balancers.values() for d in b.deployments]
            )
        c = settings.cache
        self.cache = (
            ResponseCache(c.max_entries, c.max_bytes, dimensions=self._embedding_dimensions)
            if c.enabled
            else None
        )
        if self.cache is not None:  # moved by shadow comparisons (decide/shadow_threshold.py)
            self.cache.thresholds = PartitionThresholds(c.shadow_feedback)
        if self.cache is not None and c.shared and settings.storage.redis_url:
            from switchyard.decide.shared_cache import SharedCache

            self.cache.share = SharedCache(
                self.cache, settings.storage.redis_url, settings.storage.redis_timeout_s
            )
        self.pii = PiiMasker()
        # Learned per model, for the reservations (policy/cost.py).
        self.overhead = PromptOverhead(settings.policy.prompt_overhead_tokens)
        self.executor.redact = self.pii.mask
        self.router: Any = None  # set once built (start), when routing is enabled
        self.gates = {
            m.alias: DeploymentGate(
                m.alias,
                m.limits.max_concurrency,
                m.limits.queue,
                settings.scheduling.policy,
                settings.scheduling.aging_s,
                settings.scheduling.admit_headroom,
            )
            for m in settings.models
        }
        for alias, gate in self.gates.items():  # other clients' load on its engines
            deps = self.registry.replicas.get(alias) or [self.registry.deployments[alias]]
            gate.others = others_at(deps, _in_flight(gate))
        for a in settings.adapters:  # an adapter runs in its base's slots
            self.gates[a.name] = self.gates[a.base]
        self.counters: dict[str, int] = {"limiter_fail_open": 0, "limiter_fail_closed": 0}
        self.dev_key: str | None = None
        t = settings.tasks
        self.tasks: TaskStore
        if settings.storage.redis_url:  # one task state for every gateway process
            from switchyard.policy.redis_tasks import RedisTaskStore

            self.tasks = RedisTaskStore(
                settings.storage.redis_url,
                timeout_s=settings.storage.redis_timeout_s,
                idle_ttl_s=t.idle_ttl_s,
                max_calls=t.max_tool_calls,
                max_tasks=t.max_tasks,
            )
        else:
            self.tasks = MemoryTaskStore(t.max_tasks, t.idle_ttl_s, t.max_tool_calls)
        self.running = Running()  # the tasks' calls in flight here
        # Image preprocessing, when any model takes images (its threads start lazily).
        vision = any(m.capabilities.supports_vision for m in settings.models)
        self.media = MediaProcessor(settings.media) if vision else None
        self.candidates = (
            candidate_check(c, settings.embeddings)
            if self.cache is not None and c.semantic
            else None
        )
        pipelines = build_pipelines(
            settings,
            self.registry.deployments,
            Reserver(self.limiter, settings, self.store.spent_since, self.counters),
            self.gates,
            self.pii,
            self.cache,
            self.embedder,
            lambda: self.router,  # built after start
            self.ledger.block_id,
            self.media,
            self.metrics,
            self.registry.pool,
            self.balancers,
            self.tasks,
            self.running,
            self.store.consume_approval,
            self.placers,
            self.overhead,
            self.revisions,
            consumed_approvals=self.store.consumed_approvals,
            check=self.candidates,
            on_canary_cut=self._canary_cut,
        )
        self.service = RequestService(
            settings,
            self.auth,
            pipelines,
            self.executor,
            Settler(settings, self.ledger, self.metrics, self.tracing, self.overhead),
            Idempotent(self.idempotency, self.pii, pipelines.generation),
            Embeddings(settings, self.embedder),
            self.tracing,
            rl_aliases=self.revisions,
        )
        self.rollouts = self._build_rollouts(settings)
        self.mcp = self._build_mcp(settings)
        self.started_at = time.time()

    def _build_mcp(self, settings: Settings) -> Any:
        """The MCP tool gateway (mcp.servers): the servers and the governed tool calls."""
        if not settings.mcp.servers:
            return None
        from switchyard.engines.mcp_servers import McpServers
        from switchyard.mcp_service import McpToolService

        return McpToolService(
            settings,
            McpServers(settings.mcp.servers),
            self.store.tool_calls,
            self.store.consume_approval,
            self.tasks,
            self.running,
            self.ledger,
            self.pii.mask,
            self.metrics,
            self.tracing,
            Reserver(self.limiter, settings, self.store.spent_since, self.counters),
        )

    def _build_rollouts(self, settings: Settings) -> Any:
        """RL serving (rl.models): a revision manager per model, and the rollout service."""
        from switchyard.engines.revisions import RevisionManager
        from switchyard.rollouts import RolloutService

        if not settings.rl.models:
            return None
        by_alias = {m.alias: m for m in settings.models}
        for alias, rl_model in settings.rl.models.items():
            manager = RevisionManager(
                by_alias[alias],
                rl_model,
                settings.rl,
                settings.engines.max_crash_restarts,
                self._persist_revision,
            )
            if self.metrics is not None:
                manager.on_change = self.metrics.revision_event
            self.revisions[alias] = manager
        return RolloutService(
            settings,
            self.service,
            Reserver(self.limiter, settings, self.store.spent_since, self.counters),
            self.revisions,
            self._store_rollouts if settings.rl.store else None,
            self.pii.mask,
            self.pii.contains_pii,
        )

    async def _persist_revision(self, row: dict[str, Any]) -> None:
        from switchyard.observe.rollouts import write_revision

        def write() -> None:
            with self.store.connection() as conn:
                write_revision(conn, row)

        await asyncio.to_thread(write)

    async def _store_rollouts(self, records: list[dict[str, Any]]) -> None:
        from switchyard.observe.rollouts import write_rollouts

        def write() -> None:
            with self.store.connection() as conn:
                write_rollouts(conn, records)

        await asyncio.to_thread(write)

    async def _boot_revisions(self) -> None:
        from switchyard.observe.rollouts import read_revisions

        def read() -> list[dict[str, Any]]:
            with self.store.connection() as conn:
                return read_revisions(conn)

        stored = await asyncio.to_thread(read)
        for alias, manager in self.revisions.items():
            try:
                await manager.boot([r for r in stored if r["alias"] == alias])
            except Exception:
                log.exception("the revisions of %s could not be brought up", alias)

    def _embedding_dimensions(self) -> int | None:
        return self.embedder.dimensions if self.embedder is not None else None

    # -- lifecycle (control plane) ------------------------------------------
    def start(self) -> None:
        """Start engines and models in the background; /readyz reports progress."""
        if self.settings.auth.mode == "disabled":
            log.warning(
                "AUTH IS DISABLED (auth.mode: disabled): anyone who can reach this port may "
                "call every model without limits. Use this for local experiments only."
            )
        elif self.settings.auth.bootstrap_dev_key and self.keys.count_tenants() == 0:
            self.keys.create_tenant("dev")
            self.dev_key = self.keys.create_key("dev", name="first-run development key")["key"]
        self.registry.start()
        if self.mcp is not None:
            self.mcp.servers.start()
        try:  # what this instance had in flight when it stopped: failed, saying why
            self.responses.fail_orphans()
        except sqlite3.Error as exc:  # the database is down: they stay as they were
            log.error("could not mark the responses in flight at the last stop: %s", exc)
        if self.revisions:
            self._revisions_task = asyncio.create_task(self._boot_revisions())
        listen = getattr(self.tasks, "listen", None)
        if listen is not None:  # cancels made through other gateway processes
            self._cancels = asyncio.create_task(listen(self.running.stop))
        if self.cache is not None and self.cache.share is not None:
            self._cache_events = asyncio.create_task(self.cache.share.listen())
        if self.embedder is not None:
            self.embedder.start()
        self._retention = asyncio.create_task(self._retention_loop())
        self._busy_task = asyncio.create_task(self._busy_loop())
        if self.balancers:
            self.refresh_weights()
            self._weights_task = asyncio.create_task(self._weights_loop())
        if self.settings.router.enabled:
            self._router_task = asyncio.create_task(self._build_router())
        self._encoder_task = encoder_build.start(
            self.candidates,
            self.settings.cache,
            self.settings.embeddings,
            lambda: self.readiness()[0],
            self._describe_checks,
            os.cpu_count() or 1,
        )

    def _describe_checks(self, text: str) -> None:
        if self.cache is not None:
            self.cache.checks = text

    async def _build_router(self) -> None:
        """Embed the route examples once the embedding model is loaded."""
        from switchyard.decide.router import Router

        if self.embedder is None:
            log.error("router.enabled needs embeddings.enabled; routing uses the default route")
            return
        while self.embedder.state == "loading":
            await asyncio.sleep(0.1)
        if not self.embedder.ready:
            log.error("router disabled: the embedding model failed to load")
            return
        embedder = self.embedder
        loop = asyncio.get_running_loop()
        self.router = await loop.run_in_executor(
            None, lambda: Router(self.settings.router, lambda texts: embedder.encode(texts)[0])
        )
        log.info("router ready: %d routes", len(self.settings.router.routes))

    async def _retention_loop(self) -> None:
        obs = self.settings.observe
        loop = asyncio.get_running_loop()
        while True:
            try:
                if self.settings.storage.backend == "memory":  # no disk to wait for
                    n = self.enforce_retention()
                else:
                    n = await loop.run_in_executor(None, self.enforce_retention)
                if n:
                    log.info("retention removed %d records (traces, rollouts, stored responses)", n)
            except Exception as exc:  # retention must never take the gateway down
                log.warning("retention failed: %s", exc)
            if self.embedder is not None:
                await loop.run_in_executor(None, self.embedder.mark_in_use)
            await asyncio.sleep(obs.retention_interval_s)

    async def _busy_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(BUSY_FLUSH_S)
            try:
                await loop.run_in_executor(None, self.flush_busy)
            except Exception as exc:  # a missed flush is added to the next one
                log.warning("could not record engine busy time: %s", exc)

    def flush_busy(self) -> None:
        """Store each local engine's busy seconds since the last flush (cost report)."""
        now, wall = time.monotonic(), time.time()
        deltas = []
        for e in self.registry.managed():
            total = e.busy_now(now)
            delta = total - self._busy_flushed.get(e.alias, 0.0)
            if delta > 0:
                deltas.append((e.alias, total, delta))
        if not deltas:
            return
        with self.store.connection() as conn:
            conn.execute("BEGIN IMMEDIATE")
            try:
                for alias, _, delta in deltas:
                    record_busy(conn, alias, wall, delta)
                conn.execute("COMMIT")
            except BaseException:
                conn.execute("ROLLBACK")
                raise
        for alias, total, _ in deltas:
            self._busy_flushed[alias] = total

    def enforce_retention(self, now: float | None = None) -> int:
        obs = self.settings.observe
        with self.store.connection() as conn:
            n = enforce_retention(conn, obs.traces_retention_days, obs.traces_max_rows, now)
            if self.settings.rl.models:
                from switchyard.observe.rollouts import enforce_rollout_retention

                n += enforce_rollout_retention(conn, self.settings.rl.retention_days, now)
            n += enforce_response_retention(conn, self.settings.responses.retention_days, now)
            if self.mcp is not None:  # finished tool calls' records, with their results
                n += self.mcp.records.forget_before(
                    conn, (now or time.time()) - obs.traces_retention_days * 86400
                )
            if self.settings.storage.backend == "memory":
                return n
            return n + enforce_disk(conn, int(obs.max_disk_mb * 1024 * 1024))

    # -- deployment weights (canaries, promote / rollback) --------------------------
    async def cancel_task(self, tenant: str, task_id: str) -> dict[str, Any]:
        """Cancel a tenant's task: its later calls get 409 task_cancelled, its calls in
        flight here are stopped (their upstream connections closed). What was running,
        what was stopped and which side-effecting tool calls were emitted without a
        result yet."""
        key = (tenant, task_id)
        running = self.running.running(key)
        state = await self.tasks.cancel(key, time.time())
        if state is None and not running:
            raise NotFound(f"no task '{task_id}' is known for this tenant")
        stopped = self.running.stop(key)
        log.info("task %s of %s cancelled; stopped %d call(s)", task_id, tenant, len(stopped))
        calls = state["tool_calls"] if state is not None else []
        return {
            "object": "task.cancelled",
            "task_id": task_id,
            "tenant": tenant,
            "cancelled": True,
            "cancelled_at": state["cancelled_at"] if state is not None else time.time(),
            "running": running,
            "stopped": stopped,
            "unconfirmed_side_effects": [
                c for c in calls if c["class"] == "side_effect" and c["results"] == 0
            ],
            "budget": state["budget"] if state is not None else {},
            "used": state["used"] if state is not None else {},
        }

    async def describe_task(self, tenant: str, task_id: str) -> dict[str, Any]:
        """The live state of a tenant's task (budget, use, deadline, tool calls)."""
        state = await self.tasks.describe((tenant, task_id))
        running = self.running.running((tenant, task_id))
        if state is None and not running:
            raise NotFound(f"no task '{task_id}' is known for this tenant")
        return {
            "object": "task",
            **(state or {"tenant": tenant, "task_id": task_id}),
            "running": running,
        }

    def refresh_weights(self) -> None:
        """Apply the weights stored by any process (observe/weights.py)."""
        with self.store.connection() as conn:
            stored = read_weights(conn)
        for alias, rows in stored.items():
            b = self.balancers.get(alias)
            if b is not None:
                changed = b.set_weights({n: r["weight"] for n, r in rows.items()})
                for name, w in changed.items():
                    log.info(
                        "deployment %s: weight %g (%s)",
                        name,
                        w,
                        rows[name.split("/")[-1]]["reason"],
                    )

    async def _weights_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(WEIGHTS_REFRESH_S)
            try:
                await loop.run_in_executor(None, self.refresh_weights)
            except Exception as exc:  # a locked or missing table must not stop the gateway
                log.warning("reading deployment weights failed: %s", exc)

    def set_weights(self, alias: str, weights: dict[str, float], reason: str) -> dict[str, float]:
        """Set and store an alias's weights (admin API); returns them all, by name."""
        b = self.balancers.get(alias)
        if b is None:
            raise ModelNotFound(f"the model '{alias}' has no deployments to weigh")
        names = {d.replica.name for d in b.deployments if d.replica is not None}
        unknown = sorted(set(weights) - names)
        if unknown:
            raise InvalidRequest(
                f"unknown deployments of '{alias}': {', '.join(unknown)} "
                f"(it has: {', '.join(sorted(names))})",
                param="weights",
            )
        if not any(w > 0 for w in {**b.weights(), **weights}.values()):
            raise InvalidRequest(
                "at least one deployment must keep a positive weight", param="weights"
            )
        with self.store.connection() as conn:
            write_weights(conn, alias, weights, reason)
        b.set_weights(weights)
        log.warning("model %s: weights %s (%s)", alias, weights, reason)
        return b.weights()

    def _canary_cut(self, alias: str, dep: Deployment, why: str) -> None:
        log.error("model %s: %s", alias, why)
        if self.metrics is not None:
            self.metrics.canary_cuts.labels(alias, dep.name).inc()
        short = dep.replica.name if dep.replica is not None else dep.name

        def store() -> None:
            with self.store.connection() as conn:
                write_weights(conn, alias, {short: 0.0}, why)

        task = asyncio.get_running_loop().run_in_executor(None, store)
        task.add_done_callback(_log_failure)

    async def stop(self) -> None:
        for name in (
            "_retention",
            "_weights_task",
            "_cancels",
            "_busy_task",
            "_cache_events",
            "_encoder_task",
        ):
            task = getattr(self, name, None)
            if task is not None:
                task.cancel()
        build = getattr(self, "_encoder_task", None)
        if build is not None:  # it kills its child process when cancelled
            await asyncio.gather(build, return_exceptions=True)
        try:
            self.flush_busy()
        except Exception as exc:
            log.warning("could not record engine busy time: %s", exc)
        await self.registry.stop()
        if self.mcp is not None:
            await self.mcp.servers.stop()
        boot = getattr(self, "_revisions_task", None)
        if boot is not None:
            boot.cancel()
        await asyncio.gather(*(m.stop() for m in self.revisions.values()), return_exceptions=True)
        if self.embedder is not None:
            await self.embedder.stop()
        close = getattr(self.limiter, "close", None)
        if close is not None:
            await close()
        if self.executor.shared is not None:
            await self.executor.shared.close()
        if self.cache is not None and self.cache.share is not None:
            await self.cache.share.close()
        await self.tasks.close()
        await self.responses.drain()  # stored responses written behind their replies
        self.store.close()
        if self.media is not None:
            self.media.close()
        if self.tracing is not None:
            self.tracing.shutdown()

    def readiness(self) -> tuple[bool, dict[str, Any]]:
        """Ready when every required model (models[].required, default all) can serve,
        the embedding model is loaded and the router (if on) is built."""
        now = time.monotonic()
        models = {}
        ready = True
        for alias, d in self.registry.deployments.items():
            deps = self.registry.replicas.get(alias)
            if deps is not None:  # several deployments: serviceable while one is
                each = {}
                for r in deps:
                    each[r.replica.name if r.replica else r.name] = {
                        **r.describe(),
                        "breaker": self.executor.breakers[r.name].describe(now),
                    }
                up = any(r.ready or r.loadable for r in deps)
                models[alias] = {
                    "kind": "deployments",
                    "ready": up,
                    "strategy": d.model.balance.strategy,
                    "required": d.model.required,
                    "deployments": each,
                }
                if d.model.required and not up:
                    ready = False
                continue
            models[alias] = d.describe()
            models[alias]["breaker"] = self.executor.breakers[alias].describe(now)
            if d.model.required and not (d.ready or d.loadable):
                ready = False
        for alias, manager in self.revisions.items():
            active = manager.active
            up = active is not None and active.engine is not None and active.engine.ready
            models[f"{alias} (rollouts)"] = {
                "kind": "rl",
                "ready": up,
                "active_revision": active.revision if active is not None else None,
            }
            ready = ready and up
        if self.embedder is not None:
            models[self.settings.embeddings.alias] = self.embedder.describe()
            ready = ready and self.embedder.ready
        if self.mcp is not None:  # reported; a tool server down fails only its own calls
            for name, server in self.mcp.servers.describe().items():
                models[f"mcp:{name}"] = server
        if self.settings.router.enabled:
            models["router"] = {
                "ready": self.router is not None,
                "policy_version": self.settings.router.policy_version,
            }
            ready = ready and self.router is not None
        return ready, models

    def startup_settled(self) -> bool:
        """Every model has an outcome: ready, or failed and no longer restarted; so
        what start produced can be told to the user (cli's banner)."""
        for d in self.registry.every():
            if d.engine is not None and not (d.ready or d.failed or d.loadable):
                return False
        if self.embedder is not None and self.embedder.state in ("loading", "stopped"):
            return False
        if self.settings.router.enabled and self.router is None:
            return self.embedder is not None and not self.embedder.ready
        return True

    def failed_models(self) -> dict[str, str]:
        """Models that cannot serve, with the reason in plain words."""
        out: dict[str, str] = {}
        for d in self.registry.every():
            if d.failed and d.engine is not None and d.adapter is None:
                out[d.name] = d.engine.reason or d.engine.last_error or "unknown"
        if self.embedder is not None and self.embedder.state == "failed":
            out[self.settings.embeddings.alias] = self.embedder.last_error or "unknown"
        return out


def _log_failure(fut: Any) -> None:
    exc = fut.exception()
    if exc is not None:
        log.error("storing a deployment weight failed: %s", exc)


def _in_flight(gate: DeploymentGate) -> Callable[[], int]:
    """The requests holding `gate`'s slots now."""
    return lambda: gate.in_flight
