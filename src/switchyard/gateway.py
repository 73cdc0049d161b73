"""Wiring: the components of one gateway and the stage sequence over them.

This is the one place where components meet (no module-level state elsewhere). Each
stage records its `Decision`; stages whose capability has not landed yet record a
`skip` with the reason, so every trace has the same shape from day one.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import random
import secrets
import time
from collections.abc import Awaitable, Mapping
from typing import Any

import orjson

from switchyard.config import Settings, sqlite_path
from switchyard.decide.cache import CacheKeys, ResponseCache, cache_keys
from switchyard.decide.cacheability import Cacheability, cacheability
from switchyard.decide.select import Selection, select_deployment
from switchyard.decide.tools import shortlist, tool_text
from switchyard.decide.verify import verify
from switchyard.embed import EmbeddingService
from switchyard.engines.registry import Deployment, Registry
from switchyard.errors import EngineNotReady, InvalidRequest, PermissionDenied, SwitchyardError
from switchyard.execute.executor import Executor
from switchyard.execute.idempotency import IdempotencyStore
from switchyard.observe.db import connect
from switchyard.observe.ledger import Finished, UsageLedger
from switchyard.observe.metrics import Metrics
from switchyard.observe.otel import build_tracing
from switchyard.observe.traces import BLOCK_STAGES, enforce_disk, enforce_retention
from switchyard.pipeline import Pipeline, RequestContext, RequestIds, Stage, Timings
from switchyard.policy import headers as request_headers
from switchyard.policy.admission import Admission, DeploymentGate
from switchyard.policy.admit import (
    cost_usd,
    deployment_scope,
    estimate_prompt_tokens,
    max_output_tokens,
    principal_scopes,
    rate_headers,
    refusal,
)
from switchyard.policy.auth import ANONYMOUS, Authenticator, authorize_model
from switchyard.policy.keys import KeyStore, Limits, Principal
from switchyard.policy.limits import (
    Ask,
    Limiter,
    LimiterUnavailable,
    MemoryLimiter,
    ScopeLimits,
    period_key,
    period_start,
)
from switchyard.policy.pii import MaskingError, PiiMasker, mask_body

log = logging.getLogger("switchyard")

_NO_WAIT = "waited 0.0 ms for a slot"
_QUEUE_AT = BLOCK_STAGES.index("queue")


class PiiFailure(SwitchyardError):
    status = 500
    type = "server_error"
    code = "pii_masking_failed"


def reply_usage(body: bytes) -> dict[str, Any] | None:
    """The `usage` object of a JSON reply, or None."""
    try:
        obj = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    usage = obj.get("usage") if isinstance(obj, dict) else None
    return usage if isinstance(usage, dict) else None


def last_user_text(body: dict[str, Any]) -> str:
    for m in reversed(body.get("messages") or []):
        if m.get("role") == "user":
            c = m.get("content")
            if isinstance(c, list):
                return "\n".join(str(p.get("text", "")) for p in c if isinstance(p, dict))
            return str(c or "")
    return ""


class Gateway:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.registry = Registry(settings)
        self.models = {m.alias: m for m in settings.models}  # Settings.model() scans
        self.embedder = (
            EmbeddingService(settings.embeddings, idle=lambda: self.active <= 1)
            if settings.embeddings.enabled
            else None
        )
        self.sqlite_path = sqlite_path(settings)
        d = settings.tenants_defaults
        self.keys = KeyStore(
            connect(self.sqlite_path),
            Limits(d.rpm, d.tpm, d.max_concurrency, d.budget.usd, d.budget.period),
        )
        self.auth = Authenticator(self.keys, settings.auth.key_cache_s)
        self.ledger = UsageLedger(self.sqlite_path, settings.observe.ledger_flush_ms / 1000)
        self.limiter: Limiter
        if settings.storage.redis_url:
            from switchyard.policy.redis_limits import RedisLimiter

            self.limiter = RedisLimiter(
                settings.storage.redis_url, timeout_s=settings.storage.redis_timeout_s
            )
        else:
            self.limiter = MemoryLimiter()
        obs = settings.observe
        self.metrics = Metrics() if obs.metrics else None
        if self.metrics is not None:  # aliases that may label a refused request
            self.metrics.known_models = frozenset(m.alias for m in settings.models)
        self.tracing = build_tracing(
            obs.otel.exporter, obs.otel.endpoint, obs.otel.path, obs.otel.service_name
        )
        self.executor = Executor(settings, self.registry, self.tracing)
        self.idempotency = IdempotencyStore(connect(self.sqlite_path), settings.idempotency.ttl_s)
        c = settings.cache
        self.cache = ResponseCache(c.max_entries, c.max_bytes) if c.enabled else None
        self.pii = PiiMasker()
        self.executor.redact = self.pii.mask
        self.router: Any = None  # set below when routing is enabled
        self.gates = {
            m.alias: DeploymentGate(m.alias, m.limits.max_concurrency, m.limits.queue)
            for m in settings.models
        }
        self.counters: dict[str, int] = {"limiter_fail_open": 0, "limiter_fail_closed": 0}
        self._seeded: set[tuple[str, str]] = set()
        self._selections: dict[Any, Selection] = {}
        # The one-step decision's (ledger block id, verdicts) per deployment state.
        self._plans: dict[tuple[str, bool, str], tuple[int, list[Any]]] = {}
        # Evidence that is the same for every request of a model, built once (recorded
        # evidence is never changed afterwards, so requests may share the dict).
        self._named: dict[str, dict[str, Any]] = {
            m.alias: {"model": m.alias} for m in settings.models
        }
        self._placed: dict[str, tuple[str, str, dict[str, Any]]] = {}
        # The authenticate verdict and evidence per (tenant, key, anonymous).
        self._authenticated: dict[tuple[str, str, bool], tuple[tuple[str, str], Any]] = {}
        self.dev_key: str | None = None
        content_stages: list[tuple[str, Stage]] = [
            ("pii", self._pii),
            ("embed", self._embed),
            ("cache", self._cache),
            ("route", self._route),
            ("tools", self._tools),
        ]
        if self._content_stages_inert():
            # Nothing in this configuration reads the request's content: record the
            # five verdicts at once (same reasons, same trace shape) instead of
            # running five stages that would each decide to skip.
            content_stages = [("pii..tools", self._inert_content_stages)]
        self.pipeline = Pipeline(
            [
                ("authorize", self._authorize),
                ("admit", self._admit),
                *content_stages,
                ("select", self._select),
                ("queue", self._queue),
                ("place", self._place),
            ]
        )
        # The common request in such a configuration (a known model, a key without
        # limits, a model without rate limits, a free slot) is decided in one step.
        self._at_once = self._content_stages_inert()
        # Config values read on every request, as plain attributes (an attribute of a
        # pydantic model costs ~4x one of a plain object).
        self._deadline_s = settings.server.default_deadline_s
        self._traces = settings.observe.traces
        self._sample_ok = settings.observe.traces_sample_ok
        self._slow_ms = settings.observe.traces_slow_ms
        self._sampler = random.Random()
        self._unlimited = {
            m.alias for m in settings.models if m.limits.rpm is None and m.limits.tpm is None
        }
        self.started_at = time.time()
        self.request_ids = RequestIds()
        self.pending_settles = 0  # answered requests whose settle runs after the response
        self.active = 0  # requests between new_context and finish

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
        if self.embedder is not None:
            self.embedder.start()
        self._retention = asyncio.create_task(self._retention_loop())
        if self.settings.router.enabled:
            self._router_task = asyncio.create_task(self._build_router())

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
                n = await loop.run_in_executor(None, self.enforce_retention)
                if n:
                    log.info("trace retention removed %d records", n)
            except Exception as exc:  # retention must never take the gateway down
                log.warning("trace retention failed: %s", exc)
            if self.embedder is not None:
                await loop.run_in_executor(None, self.embedder.mark_in_use)
            await asyncio.sleep(obs.retention_interval_s)

    def enforce_retention(self, now: float | None = None) -> int:
        obs = self.settings.observe
        conn = connect(self.sqlite_path)
        try:
            n = enforce_retention(conn, obs.traces_retention_days, obs.traces_max_rows, now)
            return n + enforce_disk(conn, int(obs.max_disk_mb * 1024 * 1024))
        finally:
            conn.close()

    async def stop(self) -> None:
        retention = getattr(self, "_retention", None)
        if retention is not None:
            retention.cancel()
        await self.registry.stop()
        if self.embedder is not None:
            await self.embedder.stop()
        close = getattr(self.limiter, "close", None)
        if close is not None:
            await close()
        if self.executor.shared is not None:
            await self.executor.shared.close()
        self.ledger.close()
        if self.tracing is not None:
            self.tracing.shutdown()

    def readiness(self) -> tuple[bool, dict[str, Any]]:
        """Ready when every required model (models[].required, default all) can serve,
        the embedding model is loaded and the router (if on) is built."""
        now = time.monotonic()
        models = {}
        ready = True
        for alias, d in self.registry.deployments.items():
            models[alias] = d.describe()
            models[alias]["breaker"] = self.executor.breakers[alias].describe(now)
            if d.model.required and not d.ready:
                ready = False
        if self.embedder is not None:
            models[self.settings.embeddings.alias] = self.embedder.describe()
            ready = ready and self.embedder.ready
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
        for d in self.registry.deployments.values():
            if d.engine is not None and not (d.ready or d.failed):
                return False
        if self.embedder is not None and self.embedder.state in ("loading", "stopped"):
            return False
        if self.settings.router.enabled and self.router is None:
            return self.embedder is not None and not self.embedder.ready
        return True

    def failed_models(self) -> dict[str, str]:
        """Models that cannot serve, with the reason in plain words."""
        out: dict[str, str] = {}
        for alias, d in self.registry.deployments.items():
            if d.failed and d.engine is not None:
                out[alias] = d.engine.reason or d.engine.last_error or "unknown"
        if self.embedder is not None and self.embedder.state == "failed":
            out[self.settings.embeddings.alias] = self.embedder.last_error or "unknown"
        return out

    # -- request context ----------------------------------------------------
    def authenticate(self, headers: Mapping[str, str]) -> Principal:
        if self.settings.auth.mode == "disabled":
            return ANONYMOUS
        return self.auth.authenticate(headers)

    def new_context(
        self, endpoint: str, headers: Mapping[str, str], received: float, principal: Principal
    ) -> RequestContext:
        # Every header read here is bounded here; a bad one is kept as the request's
        # header_error and refused once the request's handling starts (so it is
        # settled like any refusal, with its usage row and trace).
        parents: list[str]
        if request_headers.READ.isdisjoint(headers):  # nearly every request: none of them
            task, parents, client_id, planned, bad = None, [], None, None, None
        else:
            task, parents, client_id, planned, bad = request_headers.read(headers)
        # Positional, in field order: a 48-field dataclass matches keywords slowly.
        ctx = RequestContext(
            self.request_ids(),
            endpoint,
            {},
            time.time() - (time.perf_counter() - received),
            Timings(received),
            received + self._deadline_s,
            task,
            parents,
            principal,
            headers,
        )
        ctx.client_request_id = client_id
        ctx.planned_steps = planned
        ctx.header_error = bad
        if self.tracing is not None:
            self.tracing.start_request(
                ctx, headers, time.time_ns() - int((time.perf_counter() - received) * 1e9)
            )
        who = (principal.tenant_id, principal.key_id, principal is ANONYMOUS)
        authenticated = self._authenticated.get(who)
        if authenticated is None:
            authenticated = (
                ("skip", "auth.mode is disabled")
                if principal is ANONYMOUS
                else ("ok", "valid API key"),
                {"tenant": principal.tenant_id, "key": principal.key_id},
            )
            if len(self._authenticated) >= 4096:  # principals are re-read as keys change
                self._authenticated.clear()
            self._authenticated[who] = authenticated
        (outcome, reason), evidence = authenticated
        ctx.decisions.append(
            ("authenticate", outcome, reason, evidence, received, time.perf_counter())
        )
        self.active += 1
        return ctx

    def apply_request_timeout(self, ctx: RequestContext) -> None:
        """Shorten the deadline to the client's `x-request-timeout`. Called inside the
        request's handling, so a bad value is refused like any bad input: settled,
        with its usage row, trace and span."""
        timeout = ctx.headers.get("x-request-timeout") if ctx.headers is not None else None
        if timeout is None:
            return
        asked = request_headers.request_timeout(timeout)
        received = ctx.timings.received
        ctx.deadline = received + min(self.settings.server.default_deadline_s, asked)

    # -- stages ---------------------------------------------------------------
    def decide(self, ctx: RequestContext) -> Awaitable[None] | None:
        """Run the decision stages; None when they decided without waiting."""
        if self._at_once and self._decide_at_once(ctx):
            return None
        return self.pipeline.decide(ctx)

    def _decide_at_once(self, ctx: RequestContext) -> bool:
        """authorize → place in one step, when every stage can only decide what it
        decides for most requests: records the same verdicts, reasons and evidence as
        the stages would (tests/test_pipeline_plan.py checks this), all within one
        interval. Returns False, having changed nothing, when a stage could wait,
        refuse or decide otherwise; the stages then run one by one."""
        t = time.perf_counter()
        alias = ctx.alias
        assert alias is not None
        model = self.models.get(alias)
        dep = self.registry.deployments.get(alias)
        p = ctx.principal
        if model is None or dep is None or not p.may_use(alias):
            return False
        if alias not in self._unlimited or principal_scopes(p):
            return False
        gate = self.gates[alias]
        adm = gate.try_acquire()
        if adm is None:
            return False
        state = (alias, dep.ready, dep.label)  # all the verdicts depend on
        plan = self._plans.get(state)
        if plan is None:
            if len(self._plans) >= 256:  # an engine restarted many times
                self._plans.clear()
            plan = self._plans[state] = self._one_step_plan(alias, dep)
        block, verdicts = plan
        ctx.deployment = dep
        ctx.model = dep.model
        ctx.gate = gate
        ctx.queue_ms = 0.0
        queue = {
            "in_flight": adm.in_flight,
            "queued": adm.queued,
            "max_concurrency": gate.max_concurrency,
        }
        decisions = ctx.decisions
        start = len(decisions)
        ctx.block = (block, start)
        t1 = time.perf_counter()
        decisions += [
            (stage, outcome, reason, evidence, t, t1)
            for stage, outcome, reason, evidence in verdicts
        ]
        decisions[start + _QUEUE_AT] = ("queue", "admitted", _NO_WAIT, queue, t, t1)
        return True

    def _one_step_plan(self, alias: str, dep: Deployment) -> tuple[int, list[Any]]:
        """The verdicts (stage, outcome, reason, evidence) of the one-step decision for
        a deployment state, and their block id in the ledger (traces.BLOCK_STAGES).
        The queue's evidence (None here) is each request's own."""
        sel = self._selection(alias, dep)
        where, placed, region = self._placement(dep)
        named = self._named[alias]
        verdicts: list[Any] = [
            ("authorize", "allowed", "the key may use this model", named),
            ("admit", "skip", "no limits apply", None),
            *(v[:4] for v in self._inert_verdicts(alias, 0.0)),
            ("select", sel.outcome, sel.reason, sel.evidence),
            ("deployment_limits", "skip", "no limits apply", None),
            ("queue", "admitted", _NO_WAIT, None),  # each request's own evidence
            ("place", where, placed, region),
        ]
        assert [v[0] for v in verdicts] == list(BLOCK_STAGES)
        return self.ledger.block_id(verdicts), verdicts

    def _authorize(self, ctx: RequestContext) -> None:
        t = time.perf_counter()
        assert ctx.alias is not None
        if self.models.get(ctx.alias) is None:
            # Unknown models are 404 for everyone; no need to reveal key scopes.
            ctx.record("authorize", "skip", "unknown model; selection will refuse it", t)
            return
        authorize_model(ctx.principal, ctx.alias)
        ctx.record("authorize", "allowed", "the key may use this model", t, self._named[ctx.alias])

    async def _reserve(self, ctx: RequestContext, scopes: list[ScopeLimits], stage: str) -> None:
        t = time.perf_counter()
        if not scopes:
            ctx.record(stage, "skip", "no limits apply", t)
            return
        model = self.models.get(ctx.alias or "")
        price = model.price if model is not None else None
        prompt = estimate_prompt_tokens(ctx.body)
        out = max_output_tokens(ctx.body, self.settings.policy.default_max_tokens)
        ctx.prompt_estimate = prompt
        ctx.max_tokens = out
        ask = Ask(
            f"{ctx.request_id}#{secrets.token_hex(4)}",
            prompt + out,
            cost_usd(price, prompt, out) if price else 0.0,
        )
        try:
            await self._seed_budgets(scopes)
            verdict = await self.limiter.reserve(scopes, ask)
        except LimiterUnavailable as exc:
            if self.settings.policy.on_limiter_failure == "fail_open":
                self.counters["limiter_fail_open"] += 1
                log.warning("limiter unavailable, admitting (fail_open): %s", exc)
                ctx.record(stage, "admit:fail_open", f"limiter unavailable: {exc}", t)
                return
            self.counters["limiter_fail_closed"] += 1
            ctx.record(stage, "reject:limiter_unavailable", f"limiter unavailable: {exc}", t)
            raise EngineNotReady(
                "rate limiter unavailable; refusing (fail_closed)", code="limiter_unavailable"
            ) from None
        ctx.rate_headers.update(rate_headers(verdict))
        evidence: dict[str, Any] = {
            "reserved_tokens": ask.tokens,
            "reserved_usd": ask.cost_usd,
            "scopes": verdict.state,
        }
        if not verdict.allowed:
            ctx.record(
                stage,
                f"reject:{verdict.limit}",
                f"{verdict.limit} limit of {verdict.scope}",
                t,
                evidence,
            )
            raise refusal(verdict)
        ctx.reservations.append((scopes, ask))
        ctx.record(stage, "admitted", "within every limit", t, evidence)

    async def _seed_budgets(self, scopes: list[ScopeLimits]) -> None:
        """Budgets survive restarts: the first time a scope is seen in a period, its
        spend so far is read back from the ledger."""
        now = time.time()
        for s in scopes:
            if s.budget_usd is None:
                continue
            mark = (s.scope, period_key(s.budget_period, now))
            if mark in self._seeded:
                continue
            kind, _, ident = s.scope.partition(":")
            column = {"key": "key_id", "tenant": "tenant_id"}.get(kind)
            if column is not None:
                spent = self.ledger.spent_since(column, ident, period_start(s.budget_period, now))
                seeded = self.limiter.seed_spent(s.scope, s.budget_period, spent, now)
                if inspect.isawaitable(seeded):
                    await seeded
            self._seeded.add(mark)

    def _admit(self, ctx: RequestContext) -> Awaitable[None] | None:
        scopes = principal_scopes(ctx.principal)
        if not scopes:  # decided without waiting: no coroutine to run
            ctx.record("admit", "skip", "no limits apply", time.perf_counter())
            return None
        return self._reserve(ctx, scopes, "admit")

    def _content_stages_inert(self) -> bool:
        """True when pii, embed, cache, route and tools can only skip, whatever the
        request: no masking mode but observe_only, no cache, no router, no tool policy."""
        s = self.settings
        t = s.tools
        return (
            s.pii.mode == "observe_only"
            and all(m == "observe_only" for m in s.pii.models.values())
            and self.cache is None
            and not s.router.enabled
            and t.shortlist_k is None
            and t.allow is None
            and not t.deny
            and not t.tenant_allow
        )

    def _inert_content_stages(self, ctx: RequestContext) -> None:
        """The five verdicts, decided together at one instant (no stage ran)."""
        ctx.decisions += self._inert_verdicts(ctx.alias, time.perf_counter())

    def _inert_verdicts(self, alias: str | None, t: float) -> tuple[Any, ...]:
        named = self._named.get(alias or "") or {"model": alias}
        return (
            ("pii", "skip", "observe_only and no cache or router: no text is stored", None, t, t),
            ("embed", "skip", "no semantic cache or router for this request", None, t, t),
            ("cache", "skip", "cache not enabled", None, t, t),
            ("route", "explicit", "the client named the model", named, t, t),
            ("tools", "skip", "no tools, or no tool policy", None, t, t),
        )

    def _pii(self, ctx: RequestContext) -> None:
        """Mask PII once; the masked text is what cache keys, embeddings and traces see."""
        t = time.perf_counter()
        mode = self.settings.pii.models.get(ctx.alias or "", self.settings.pii.mode)
        if (
            mode == "observe_only"
            and self.cache is None
            and self.router is None
            and not self.settings.router.enabled
        ):
            # Masked text would feed only the cache and the router; nothing else here
            # stores or forwards request text, so there is nothing to mask.
            ctx.record("pii", "skip", "observe_only and no cache or router: no text is stored", t)
            return
        session = self.pii.session()
        try:
            masked = mask_body(session, ctx.body)
        except MaskingError as exc:
            ctx.record("pii", "reject:masking_failed", f"masking failed: {type(exc).__name__}", t)
            raise PiiFailure("PII masking failed; the request was refused (fail closed)") from None
        found = dict(session.found)
        evidence = {"mode": mode, "found": found}
        if found and mode == "block":
            ctx.record(
                "pii", "reject:pii_detected", f"request contains {sorted(found)}", t, evidence
            )
            raise InvalidRequest(
                f"the request contains personal data ({', '.join(sorted(found))}) and this "
                "model does not accept it",
                code="pii_detected",
            )
        ctx.pii = session
        ctx.masked_body = masked
        if found and mode == "mask_upstream":
            ctx.body = masked  # the upstream sees placeholders; the reply is restored
            ctx.restore_pii = True
        outcome = ("masked" if mode == "mask_upstream" else "observed") if found else "clean"
        ctx.record("pii", outcome, f"{sum(found.values())} PII value(s) found", t, evidence)

    async def _embed(self, ctx: RequestContext) -> None:
        """Embed the last user message once; the cache and the router share the vector."""
        t = time.perf_counter()
        wants = (self.cache is not None and self.settings.cache.semantic) or self.router is not None
        if not wants or ctx.endpoint != "chat.completions":
            ctx.record("embed", "skip", "no semantic cache or router for this request", t)
            return
        if self.embedder is None or not self.embedder.ready:
            ctx.record("embed", "skip", "embedding model not ready", t)
            return
        verdict, keys = self._cache_plan(ctx) if self.cache is not None else (None, None)
        if (
            self.cache is not None
            and verdict is not None
            and keys is not None
            and verdict.lookup
            and verdict.mode == "enforce"
            and self.cache.has_exact(keys, now=time.time() + 1.0)
        ):
            # The cache stage will answer with this entry (alive for at least another
            # second, so it cannot expire in between); nothing needs the vector.
            ctx.record("embed", "skip", "an exact cache entry answers this request", t)
            return
        query = last_user_text(ctx.masked_body or ctx.body)
        vecs, _, path = await self.embedder.embed_traced([query])
        ctx.vector = vecs[0]
        ctx.record(
            "embed", "ok", "embedded the last user message", t, {"chars": len(query), "path": path}
        )

    def _cache_plan(self, ctx: RequestContext) -> tuple[Cacheability, CacheKeys | None]:
        """Whether the request may use the cache, and its keys (None when it may
        neither look up nor store): worked out once, for the embed and cache stages."""
        if ctx.cache_plan is not None:
            plan: tuple[Cacheability, CacheKeys | None] = ctx.cache_plan
            return plan
        cfg = self.settings.cache
        tenant = ctx.principal.tenant_id
        verdict = cacheability(
            ctx.body, ctx.endpoint, ctx.headers.get("cache-control"), tenant, ctx.alias or "", cfg
        )
        keys = None
        if verdict.lookup or verdict.store:
            model = self.models.get(ctx.alias or "")
            revision = (
                model.revision
                if model is not None
                else f"router:{self.settings.router.policy_version}"
            )
            scope = f"key:{ctx.principal.key_id}" if cfg.scope == "key" else f"tenant:{tenant}"
            keys = cache_keys(
                ctx.masked_body or ctx.body,
                ctx.endpoint,
                scope,
                tenant,
                ctx.alias or "",
                revision,
                ctx.headers.get("x-switchyard-locale") or ctx.headers.get("accept-language"),
                ctx.headers.get("x-switchyard-data-version") or cfg.data_version,
                request_headers.cache_tags(ctx.headers.get("x-switchyard-cache-tags")),
            )
        ctx.cache_plan = (verdict, keys)
        return verdict, keys

    def _cache(self, ctx: RequestContext) -> None:
        t = time.perf_counter()
        if self.cache is None:
            ctx.record("cache", "skip", "cache not enabled", t)
            return
        cfg = self.settings.cache
        verdict, keys = self._cache_plan(ctx)
        if keys is None:
            ctx.cache = "bypass"
            ctx.record("cache", "bypass", verdict.reason, t)
            return
        ctx.cache_keys = keys if verdict.store else None
        if not verdict.lookup:
            ctx.cache = "bypass"
            ctx.record("cache", "bypass", verdict.reason, t, {"partition": keys.partition[:12]})
            return
        evidence: dict[str, Any] = {
            "partition": keys.partition[:12],
            "threshold": verdict.threshold,
            "mode": verdict.mode,
        }
        entry = self.cache.lookup_exact(keys)
        kind, sim = ("hit-exact", 1.0) if entry is not None else ("miss", None)
        if entry is None and cfg.semantic and ctx.vector is not None:
            found = self.cache.nearest(keys, ctx.vector)
            evidence["candidates"] = found.candidates
            if found.entry is not None and found.similarity is not None:
                sim = found.similarity
                evidence["best_similarity"] = round(sim, 4)
                if sim >= verdict.threshold:
                    ok, why = (
                        verify(keys.query, found.entry.keys.query)
                        if cfg.verify
                        else (True, "verifier off")
                    )
                    evidence["verifier"] = why
                    if ok:
                        entry, kind = found.entry, "hit-semantic"
                        self.cache.touch(entry)
                    else:
                        ctx.record("cache", "miss:veto", why, t, evidence)
                        ctx.cache = "miss"
                        return
        if entry is None:
            ctx.cache = "miss"
            ctx.record("cache", "miss", "no entry in the partition passed", t, evidence)
            return
        ctx.cache_similarity = sim
        if verdict.mode == "shadow":
            ctx.cache, ctx.shadow_entry = "shadow-hit", entry
            ctx.record(
                "cache",
                f"shadow:{kind}",
                "would have served a cached reply; calling the model",
                t,
                evidence,
            )
            return
        ctx.cache = kind
        ctx.cache_keys = None  # nothing new to store
        ctx.response = entry
        ctx.record("cache", kind, f"served from cache (similarity {sim:.3f})", t, evidence)

    def _route(self, ctx: RequestContext) -> None:
        t = time.perf_counter()
        rcfg = self.settings.router
        if not rcfg.enabled or ctx.alias not in rcfg.routed_aliases:
            ctx.record(
                "route",
                "explicit",
                "the client named the model",
                t,
                self._named.get(ctx.alias or "") or {"model": ctx.alias},
            )
            return
        requested = ctx.alias
        if self.router is None or ctx.vector is None:
            if rcfg.default_route is None:
                raise EngineNotReady(
                    "the router is not ready yet; retry shortly", code="router_not_ready"
                )
            route = next(r for r in rcfg.routes if r.name == rcfg.default_route)
            ctx.alias, ctx.route, ctx.route_score = route.model, route.name, None
            ctx.record(
                "route",
                f"route:{route.name}",
                "router not ready: default route",
                t,
                {"policy_version": rcfg.policy_version, "default": True},
            )
        else:
            text = last_user_text(ctx.masked_body or ctx.body)
            res = self.router.route(ctx.vector, text, ctx.prompt_estimate, ctx.principal.tenant_id)
            ctx.alias, ctx.route, ctx.route_score = res.model, res.route, res.score
            ctx.record("route", res.outcome, res.reason, t, res.evidence())
        if not ctx.principal.may_use(ctx.alias):
            raise PermissionDenied(
                f"the router chose '{ctx.alias}' for '{requested}', which this key may not use",
                param="model",
                code="model_not_allowed",
            )

    async def _tools(self, ctx: RequestContext) -> None:
        """Remove tools the tenant may not use, then shortlist the rest by similarity."""
        t = time.perf_counter()
        tools = ctx.body.get("tools")
        tcfg = self.settings.tools
        if not tools or (
            tcfg.shortlist_k is None
            and tcfg.allow is None
            and not tcfg.deny
            and not tcfg.tenant_allow
        ):
            ctx.record("tools", "skip", "no tools, or no tool policy", t)
            return
        vecs = None
        if ctx.vector is not None and self.embedder is not None and tcfg.shortlist_k is not None:
            texts = [tool_text(x) for x in tools]
            vecs, _ = await self.embedder.embed(texts)
        res = shortlist(tools, ctx.vector, vecs, tcfg.shortlist_k, ctx.principal.tenant_id, tcfg)
        ctx.body = {**ctx.body, "tools": res.kept}
        if ctx.masked_body is not None:
            ctx.masked_body = {**ctx.masked_body, "tools": res.kept}
        ctx.record("tools", res.outcome, res.reason, t, res.evidence())

    def _select(self, ctx: RequestContext) -> None:
        t = time.perf_counter()
        assert ctx.alias is not None
        sel = self._selection(ctx.alias, self.registry.deployments.get(ctx.alias))
        ctx.deployment = sel.deployment
        ctx.model = sel.deployment.model
        ctx.record("select", sel.outcome, sel.reason, t, sel.evidence)

    def _selection(self, alias: str, dep: Deployment | None) -> Selection:
        """The selection depends only on the alias and its deployment's state, so it is
        made once per state (its evidence is never changed after it is recorded)."""
        key = (alias, dep.ready, dep.label) if dep is not None else None
        sel = self._selections.get(key) if key is not None else None
        if sel is None:
            sel = select_deployment(alias, self.registry.deployments)
            if len(self._selections) >= 256:  # an engine restarted many times
                self._selections.clear()
            self._selections[key] = sel
        return sel

    def _queue(self, ctx: RequestContext) -> Awaitable[None] | None:
        """Deployment limits, then a slot at the deployment's gate. Most requests find
        no limits and a free slot: that path decides without a coroutine."""
        assert ctx.model is not None
        scopes = deployment_scope(ctx.model)
        if scopes:
            return self._queue_waiting(ctx, scopes)
        ctx.record("deployment_limits", "skip", "no limits apply", time.perf_counter())
        t = time.perf_counter()
        gate = self.gates[ctx.model.alias]
        adm = gate.try_acquire()
        if adm is None:
            return self._wait_for_slot(ctx, gate, t)
        self._admitted(ctx, gate, adm, t)
        return None

    async def _queue_waiting(self, ctx: RequestContext, scopes: list[ScopeLimits]) -> None:
        assert ctx.model is not None
        await self._reserve(ctx, scopes, "deployment_limits")
        t = time.perf_counter()
        gate = self.gates[ctx.model.alias]
        adm = gate.try_acquire()
        if adm is None:
            await self._wait_for_slot(ctx, gate, t)
        else:
            self._admitted(ctx, gate, adm, t)

    async def _wait_for_slot(self, ctx: RequestContext, gate: DeploymentGate, t: float) -> None:
        try:
            adm = await gate.acquire(ctx.deadline)
        except Exception as exc:
            ctx.record(
                "queue", "reject", str(exc), t, {"in_flight": gate.in_flight, "queued": gate.queued}
            )
            raise
        self._admitted(ctx, gate, adm, t)

    @staticmethod
    def _admitted(ctx: RequestContext, gate: DeploymentGate, adm: Admission, t: float) -> None:
        ctx.gate = gate
        ctx.queue_ms = adm.waited_s * 1000
        waited = adm.waited_s != 0
        ctx.record(
            "queue",
            "waited" if waited else "admitted",
            f"waited {adm.waited_s * 1000:.1f} ms for a slot" if waited else _NO_WAIT,
            t,
            {
                "in_flight": adm.in_flight,
                "queued": adm.queued,
                "max_concurrency": gate.max_concurrency,
            },
        )

    def _place(self, ctx: RequestContext) -> None:
        dep = ctx.deployment
        assert dep is not None
        where, reason, evidence = self._placement(dep)
        ctx.record("place", where, reason, time.perf_counter(), evidence)

    def _placement(self, dep: Deployment) -> tuple[str, str, dict[str, Any]]:
        placed = self._placed.get(dep.alias)
        if placed is None:
            where = "local" if dep.engine is not None else "remote"
            placed = (where, f"the deployment runs {where}ly", {"region": dep.model.region})
            self._placed[dep.alias] = placed
        return placed

    # -- settle -----------------------------------------------------------------
    def finish_after_response(self, ctx: RequestContext) -> Awaitable[None] | None:
        """Settle a request whose reply has been sent; counted in `pending_settles`
        until done. None when it was settled without waiting."""
        try:
            pending = self.finish_now(ctx)
        except BaseException:
            self.pending_settles -= 1
            raise
        if pending is None:
            self.pending_settles -= 1
            return None
        return self._settling(pending)

    async def _settling(self, pending: Awaitable[None]) -> None:
        try:
            await pending
        finally:
            self.pending_settles -= 1

    async def settled(self, timeout_s: float = 5.0) -> None:
        """Wait until every answered request has been settled (admin reads use this, so
        what a client has seen answered is visible in the ledger and traces)."""
        deadline = time.monotonic() + timeout_s
        while self.pending_settles > 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.005)
        await self.ledger.flush_async()

    async def finish(self, ctx: RequestContext) -> None:
        """Release what the request held, charge what it used, write its usage row.
        Runs exactly once per request, whatever way it ended."""
        pending = self.finish_now(ctx)
        if pending is not None:
            await pending

    def finish_now(self, ctx: RequestContext) -> Awaitable[None] | None:
        """`finish`, synchronously unless limiter reservations are to be settled (then
        the rest is in the returned awaitable)."""
        if ctx.finished:
            return None
        ctx.finished = True
        self.active -= 1
        if ctx.gate is not None:
            ctx.gate.release()
        if ctx.usage is None and ctx.reply_body is not None:
            ctx.usage = reply_usage(ctx.reply_body)
        usage = ctx.usage or {}
        if usage:
            inp = int(usage.get("prompt_tokens") or 0)
            out = int(usage.get("completion_tokens") or 0)
        elif ctx.attempts:
            # Best effort for a broken stream, the same whether limits applied (and so
            # estimated the prompt at admission) or not.
            inp = ctx.prompt_estimate or estimate_prompt_tokens(ctx.body)
            out = ctx.chunks
        else:
            inp = out = 0
        cost = cost_usd(ctx.model.price, inp, out) if ctx.model is not None else 0.0
        if ctx.reservations:
            return self._settle_reservations(ctx, inp, out, cost)
        self._finished(ctx, inp, out, cost)
        return None

    async def _settle_reservations(
        self, ctx: RequestContext, inp: int, out: int, cost: float
    ) -> None:
        for scopes, ask in ctx.reservations:
            try:
                await self.limiter.settle(scopes, ask, inp + out, cost)
            except LimiterUnavailable as exc:
                log.warning("could not settle %s: %s", ctx.request_id, exc)
        self._finished(ctx, inp, out, cost)

    def _finished(self, ctx: RequestContext, inp: int, out: int, cost: float) -> None:
        """Metrics, span and ledger row of a settled request."""
        t = ctx.timings
        if t.ended is None:
            t.ended = time.perf_counter()
        end = t.ended
        status = ctx.status if ctx.status not in ("pending", "streaming") else "error"
        if self.metrics is not None:
            self.metrics.observe(ctx, status, inp, out, cost)
        if self.tracing is not None:
            self.tracing.finish(
                ctx, status, inp, out, time.time_ns() - int((time.perf_counter() - end) * 1e9)
            )
        # Usage row and trace are built per batch, off this request's path.
        self.ledger.record(Finished(ctx, status, inp, out, cost, self._keep_trace(ctx, status)))

    def _keep_trace(self, ctx: RequestContext, status: str) -> bool:
        """The trace policy (observe.traces_sample_ok): what explains something is
        always kept; a plain success only as a sample."""
        if not self._traces:
            return False
        if self._sample_ok >= 1.0:
            return True
        t = ctx.timings
        plain = (
            status == "ok"
            and ctx.attempts <= 1
            and ctx.fallback_from is None
            and ctx.cache in (None, "miss", "bypass")
            and ctx.task_id is None
            and t.ended is not None
            and (t.ended - t.received) * 1000.0 < self._slow_ms
        )
        return not plain or self._sampler.random() < self._sample_ok
