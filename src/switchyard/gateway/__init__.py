"""Wiring: the components of one gateway and the stage sequences over them.

This is the one place where components meet (no module-level state elsewhere): it
builds them, orders the stages (policy/stages.py, decide/stages.py) into pipelines
and hands both to the request service (service.py), which runs every request. What
acts on the built components (start, stop, readiness, retention, weights, task
cancels) is the control plane, its own package (switchyard.control).

`Gateway.__init__` is the composition root. Each capability is built by a small
factory beside it, taking settings and what it depends on, in an order where each
collaborator exists before what takes it:

    pipelines.py      the stage pipelines (build_pipelines)
    deployments.py    balancers, placers and gates over the registry's deployments
    semantic.py       the embedding service, the response cache, its candidate checks
    tasks.py          the MCP tool gateway (over the agent task store)
    state/choose.py   the stores: memory, SQL or Redis, chosen from settings.storage
    rollouts.py       RL serving: revision managers and the rollout service
    observability.py  metrics (built first: the engine pool and the revision managers
                      take its hooks at construction) and tracing

The late bindings left, each set on a built object, and why:

    executor.balancers the balancers read the executor's breakers and the executor's
                       fallbacks balance through them (a cycle; deployments.py).
    cache.share        the shared cache (Redis) wraps the cache it shares: a true cycle.
    gate.others        the other clients' load on a gate's engines, which leaves out
                       the gate's own requests: it reads the built gate (a cycle).
    embedder idle      the embedder waits for quiet through the request service, which
                       is built after it over the cache that needs the embedder: a
                       lambda reads `self.service` when called.
    router             built after start, once the embedding model has loaded
                       (control/router.py); the pipelines read it through a lambda.
"""

from __future__ import annotations

import time

from switchyard.config import SINGLE, ProcessRole, Settings, store_target
from switchyard.control import BUSY_FLUSH_S, ControlPlane
from switchyard.engines import lora_train
from switchyard.engines.registry import Registry
from switchyard.execute.embeddings import Embeddings
from switchyard.execute.executor import Executor
from switchyard.execute.idempotent import Idempotent
from switchyard.gateway.deployments import (
    build_balancers,
    build_gates,
    build_guard_share,
    build_placers,
)
from switchyard.gateway.observability import build_metrics, build_tracing, engine_events
from switchyard.gateway.pipelines import build_pipelines
from switchyard.gateway.rollouts import build_revisions, build_rollouts
from switchyard.gateway.semantic import build_cache, build_candidates, build_embedder
from switchyard.gateway.tasks import build_mcp
from switchyard.media.process import MediaProcessor
from switchyard.policy.admit import FullWindows
from switchyard.policy.auth import Authenticator
from switchyard.policy.cost import PromptOverhead
from switchyard.policy.pii import PiiMasker
from switchyard.policy.stages import Reserver
from switchyard.policy.tasks import Running
from switchyard.service import RequestService
from switchyard.settle import Settler
from switchyard.state.choose import (
    build_key_changes,
    build_limiter,
    build_overhead_share,
    build_session_affinity,
    build_shared_breakers,
    build_store,
    build_tasks,
)

__all__ = ["BUSY_FLUSH_S", "Gateway", "build_pipelines"]


class Gateway(ControlPlane):
    """One gateway: its components, the request service over them, and the control
    plane (switchyard.control) that starts, stops and reports on them."""

    def __init__(self, settings: Settings, role: ProcessRole = SINGLE) -> None:
        # Demonstration adapters named by `demo:NAME` are trained on first use (cached).
        settings = lora_train.resolve(settings)
        super().__init__()
        self.settings = settings
        self.role = role  # one process, or the control plane or a worker of several
        self.metrics = build_metrics(settings)
        self.registry = Registry(settings, engine_events(self.metrics))
        self.models = {m.alias: m for m in settings.served_models()}
        # The embedder waits for quiet through the service built below (late bound).
        self.embedder = build_embedder(settings, idle=lambda: self.service.active <= 1)
        self.store_target = store_target(settings)
        self.store = build_store(settings, self.store_target, role)
        self.keys = self.store.keys
        self.responses = self.store.responses
        self.ledger = self.store.ledger
        self.idempotency = self.store.idempotency
        # With Redis, a key or tenant change made through any process applies in all.
        self.auth = Authenticator(
            self.store.verify_key,
            settings.auth.key_cache_s,
            build_key_changes(settings),
            disabled=settings.auth.mode == "disabled",
        )
        self.limiter = build_limiter(settings, role)
        self.tracing = build_tracing(settings)
        self.pii = PiiMasker()
        # The executor masks PII in an upstream's error text before it is recorded.
        self.executor = Executor(
            settings,
            self.registry,
            self.tracing,
            redact=self.pii.mask,
            shared=build_shared_breakers(settings),
        )
        # With Redis, each canary guard judges every process's outcomes; a cut judged
        # at an exchange is stored, logged and counted as a request's would be.
        self.guard_share = build_guard_share(settings)
        self.balancers = build_balancers(
            self.registry, self.executor, self.guard_share, self._canary_cut
        )
        self.placers = build_placers(settings, self.balancers)
        if self.metrics is not None:
            self.metrics.watch_deployments(
                [d for b in self.balancers.values() for d in b.deployments]
            )
        self.cache = build_cache(settings, self.embedder)
        # Learned per model, for the reservations (policy/cost.py).
        self.overhead = PromptOverhead(settings.policy.prompt_overhead_tokens)
        self.sessions = build_session_affinity(settings)  # with Redis: every process's
        self.overhead_share = build_overhead_share(settings)  # with Redis: every process's
        self.router = None  # set once built (start), when routing is enabled
        self.gates = build_gates(settings, self.registry, role)
        self.counters: dict[str, int] = {"limiter_fail_open": 0, "limiter_fail_closed": 0}
        self.dev_key = None
        self.tasks = build_tasks(settings, role)
        self.running = Running()  # the tasks' calls in flight here
        # Image preprocessing, when any model takes images (its threads start lazily).
        vision = any(m.capabilities.supports_vision for m in settings.models)
        self.media = MediaProcessor(settings.media) if vision else None
        self.candidates = build_candidates(settings, self.cache)
        # RL-managed models' revision managers: the pipeline sends their chat and
        # completions to the active revision.
        self.revisions = build_revisions(settings, self.metrics, self._persist_revision)
        # The rpm windows found full, shared by every reserver of this process: a
        # request of such a key or tenant is refused before its body is read.
        self.full = FullWindows()
        reserver = Reserver(
            self.limiter, settings, self.store.spent_since, self.counters, self.full
        )
        # A further upstream call after one that may have been billed extends the
        # request's reservation first (execute/executor.py `Executor._covered`).
        self.executor.reserver = reserver
        pipelines = build_pipelines(
            settings,
            self.registry.deployments,
            reserver,
            self.gates,
            self.pii,
            self.cache,
            self.embedder,
            lambda: self.router,  # built after start
            register_block=self.ledger.block_id,
            media=self.media,
            metrics=self.metrics,
            pool=self.registry.pool,
            balancers=self.balancers,
            tasks=self.tasks,
            running=self.running,
            consume_approval=self.store.consume_approval,
            placers=self.placers,
            overhead=self.overhead,
            revisions=self.revisions,
            consumed_approvals=self.store.consumed_approvals,
            give_back_approvals=self.store.give_back_approvals,
            check=self.candidates,
            on_canary_cut=self._canary_cut,
            sessions=self.sessions,
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
            full=self.full,
        )
        self.rollouts = build_rollouts(
            settings,
            self.service,
            Reserver(self.limiter, settings, self.store.spent_since, self.counters, self.full),
            self.revisions,
            self._store_rollouts if settings.rl.store else None,
            self.pii,
        )
        # Of several workers, the MCP endpoint and its tool servers are the control
        # plane's alone (a worker relays /mcp there: api/mcp_relay.py).
        self.mcp = (
            None
            if role.worker
            else build_mcp(
                settings,
                self.store,
                self.tasks,
                self.running,
                self.pii,
                self.metrics,
                self.tracing,
                Reserver(self.limiter, settings, self.store.spent_since, self.counters, self.full),
            )
        )
        self.started_at = time.time()

    def active_requests(self) -> int:
        return self.service.active
