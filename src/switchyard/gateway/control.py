"""The control plane of one gateway: starting and stopping its engines, tool servers
and background loops, readiness, retention, engine busy time, deployment weights
(canaries, promote / rollback) and agent task cancels.

`ControlPlane` is the half of `Gateway` (switchyard.gateway) that acts on the components
once they are built; the composition root builds them (the factories beside this module)
and this class names what it uses of them.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sqlite3
import time
from typing import Any

from switchyard.config import Settings
from switchyard.decide import encoder_build
from switchyard.decide.balance import Balancer
from switchyard.decide.cache import ResponseCache
from switchyard.decide.candidate import CandidateCheck
from switchyard.embed import EmbeddingService
from switchyard.engines.registry import Deployment, Registry
from switchyard.errors import InvalidRequest, ModelNotFound
from switchyard.execute.executor import Executor
from switchyard.gateway.semantic import build_router
from switchyard.media.process import MediaProcessor
from switchyard.observe.cost import record_busy
from switchyard.observe.metrics import Metrics
from switchyard.observe.otel import Tracing
from switchyard.observe.responses import ResponseStore, enforce_response_retention
from switchyard.observe.store import Store
from switchyard.observe.traces import enforce_disk, enforce_retention
from switchyard.observe.weights import REFRESH_S as WEIGHTS_REFRESH_S
from switchyard.observe.weights import read_weights, write_weights
from switchyard.policy.keys import KeyStore, NotFound
from switchyard.policy.limits import Limiter
from switchyard.policy.tasks import Running, TaskStore

log = logging.getLogger("switchyard")
BUSY_FLUSH_S = 10.0  # how often engine busy time goes to the store (observe/cost.py)


class ControlPlane:
    """Start, stop, readiness and the operations on a running gateway (admin API)."""

    # Built by the composition root (Gateway.__init__).
    settings: Settings
    registry: Registry
    revisions: dict[str, Any]
    _busy_flushed: dict[str, float]
    embedder: EmbeddingService | None
    store: Store
    keys: KeyStore
    responses: ResponseStore
    limiter: Limiter
    metrics: Metrics | None
    tracing: Tracing | None
    executor: Executor
    balancers: dict[str, Balancer]
    cache: ResponseCache | None
    router: Any
    dev_key: str | None
    tasks: TaskStore
    running: Running
    media: MediaProcessor | None
    candidates: CandidateCheck | None
    mcp: Any

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
        self.router = await build_router(self.settings, self.embedder)

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
