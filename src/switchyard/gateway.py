"""Wiring: the components of one gateway and the stage sequence over them.

This is the one place where components meet (no module-level state elsewhere). Each
stage records its `Decision`; stages whose capability has not landed yet record a
`skip` with the reason, so every trace has the same shape from day one.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from switchyard.config import Settings
from switchyard.decide.select import select_deployment
from switchyard.embed import EmbeddingService
from switchyard.engines.registry import Registry
from switchyard.errors import InvalidRequest
from switchyard.pipeline import Pipeline, RequestContext, Timings, request_id_from

log = logging.getLogger("switchyard")


class Gateway:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.registry = Registry(settings)
        self.embedder = (
            EmbeddingService(settings.embeddings) if settings.embeddings.enabled else None
        )
        self.pipeline = Pipeline(
            [
                ("authenticate", self._authenticate),
                ("admit", self._admit),
                ("cache", self._cache),
                ("route", self._route),
                ("select", self._select),
                ("place", self._place),
            ]
        )
        self.started_at = time.time()

    # -- lifecycle (control plane) ------------------------------------------
    def start(self) -> None:
        """Start engines and models in the background; /readyz reports progress."""
        self.registry.start()
        if self.embedder is not None:
            self.embedder.start()

    async def stop(self) -> None:
        await self.registry.stop()
        if self.embedder is not None:
            await self.embedder.stop()

    def readiness(self) -> tuple[bool, dict[str, Any]]:
        models = {alias: d.describe() for alias, d in self.registry.deployments.items()}
        ready = all(m["ready"] for m in models.values())
        if self.embedder is not None:
            models[self.settings.embeddings.alias] = self.embedder.describe()
            ready = ready and self.embedder.ready
        return ready, models

    # -- request context ----------------------------------------------------
    def new_context(
        self, endpoint: str, body: dict[str, Any], headers: Any, received: float
    ) -> RequestContext:
        deadline_s = self.settings.server.default_deadline_s
        timeout = headers.get("x-request-timeout")
        if timeout is not None:
            try:
                asked = float(timeout)
            except ValueError:
                asked = -1.0
            if not 0 < asked < 86400:
                raise InvalidRequest(
                    "x-request-timeout must be a number of seconds greater than 0",
                    param="x-request-timeout",
                )
            deadline_s = min(deadline_s, asked)
        parents = headers.get("x-parent-request-id")
        return RequestContext(
            request_id=request_id_from(headers.get("x-request-id")),
            endpoint=endpoint,
            body=body,
            received_at=time.time(),
            timings=Timings(received=received),
            deadline=received + deadline_s,
            task_id=headers.get("x-task-id"),
            parent_request_ids=[p.strip() for p in parents.split(",") if p.strip()]
            if parents
            else [],
        )

    # -- stages ---------------------------------------------------------------
    async def _authenticate(self, ctx: RequestContext) -> None:
        ctx.record("authenticate", "skip", "auth.mode is disabled", time.perf_counter())

    async def _admit(self, ctx: RequestContext) -> None:
        ctx.record("admit", "skip", "no limits configured", time.perf_counter())

    async def _cache(self, ctx: RequestContext) -> None:
        ctx.record("cache", "skip", "cache not configured", time.perf_counter())

    async def _route(self, ctx: RequestContext) -> None:
        ctx.record(
            "route",
            "explicit",
            "the client named the model",
            time.perf_counter(),
            {"model": ctx.alias},
        )

    async def _select(self, ctx: RequestContext) -> None:
        t = time.perf_counter()
        assert ctx.alias is not None
        sel = select_deployment(ctx.alias, self.registry.deployments)
        ctx.deployment = sel.deployment
        ctx.model = sel.deployment.model
        ctx.record("select", sel.outcome, sel.reason, t, sel.evidence)

    async def _place(self, ctx: RequestContext) -> None:
        assert ctx.deployment is not None
        where = "local" if ctx.deployment.engine is not None else "remote"
        ctx.record(
            "place",
            where,
            f"the deployment runs {where}ly",
            time.perf_counter(),
            {"region": ctx.deployment.model.region},
        )
