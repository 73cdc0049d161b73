"""Decision stages: embed, cache, route, tools, select, residency, place.

Each stage's `static` is the one place that says when it decides the same for every
request of a View (pipeline.View); `work` handles the rest (see pipeline.Stage).
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import replace
from typing import Any

import orjson
from msgspec import structs

from switchyard import outcomes
from switchyard.config import Settings
from switchyard.decide.balance import Balancer, affinity_key, prompt_prefix
from switchyard.decide.cache import CacheKeys, ResponseCache, cache_keys
from switchyard.decide.cacheability import Cacheability, assemble, cacheability, storable_reply
from switchyard.decide.candidate import CandidateCheck
from switchyard.decide.placement import (
    Change,
    Placement,
    Placer,
    parse_device_state,
    parse_network,
    read_sensors,
)
from switchyard.decide.risk import RiskClassifier
from switchyard.decide.select import select_deployment
from switchyard.decide.tools import shortlist, tool_text
from switchyard.decide.verify import same_question
from switchyard.embed import EmbeddingService
from switchyard.engines.pool import BASE, EnginePool
from switchyard.engines.pool import Residency as EngineResidency
from switchyard.engines.registry import Deployment
from switchyard.errors import (
    InvalidRequest,
    ModelNotAllowed,
    ModelNotFound,
    PlacementRefused,
    RevisionPinNotAllowed,
    RouterNotReady,
    SwitchyardError,
)
from switchyard.pipeline import (
    CacheOutcome,
    CacheState,
    ReplyPart,
    RequestContext,
    Stage,
    Verdict,
    View,
)
from switchyard.policy import headers as request_headers
from switchyard.policy.pii_reply import at_rest
from switchyard.policy.tool_calls import ToolGate, ToolPolicy
from switchyard.request import Generation, to_json

_STORED = (CacheOutcome.HIT_EXACT, CacheOutcome.HIT_SEMANTIC, CacheOutcome.REPLAY)
_MISS = outcomes.Cache.MISS  # bound once: read through its class per request costs more


def last_user_text(req: Generation) -> str:
    for m in reversed(req.messages or ()):
        if m.get("role") == "user":
            c = m.get("content")
            if isinstance(c, list):
                return "\n".join(str(p.get("text", "")) for p in c if isinstance(p, dict))
            return str(c or "")
    return ""


class CachePlanner:
    """Whether a request may use the cache, and its keys: worked out once per request,
    for the embed and cache stages."""

    def __init__(self, settings: Settings, revisions: Mapping[str, Any] | None = None) -> None:
        self.cfg = settings.cache
        self._models = {m.alias: m for m in settings.served_models()}
        # RL-managed aliases (engines/revisions.py): their answers are keyed by the
        # revision active now, so an activation never serves the old weights' answers.
        self._revisions = revisions if revisions is not None else {}
        self._router_version = settings.router.policy_version
        self._risk = RiskClassifier(settings.cache.risk)

    def plan(self, ctx: RequestContext) -> tuple[Cacheability, CacheKeys | None]:
        state = ctx.cache_state
        if state is None:
            state = ctx.cache_state = CacheState()
        elif state.plan is not None:
            done: tuple[Cacheability, CacheKeys | None] = state.plan
            return done
        cfg = self.cfg
        tenant = ctx.principal.tenant_id
        verdict = cacheability(
            ctx.generation,
            ctx.input.endpoint,
            ctx.input.headers.get("cache-control"),
            tenant,
            ctx.alias or "",
            cfg,
        )
        keys = None
        if verdict.lookup or verdict.store:
            model = self._models.get(ctx.alias or "")
            revision = model.revision if model is not None else f"router:{self._router_version}"
            manager = self._revisions.get(ctx.alias or "") if self._revisions else None
            if manager is not None and manager.active is not None:
                revision = manager.active.revision
            scope = f"key:{ctx.principal.key_id}" if cfg.scope == "key" else f"tenant:{tenant}"
            keys = cache_keys(
                ctx.masked(),
                ctx.input.endpoint,
                scope,
                tenant,
                ctx.alias or "",
                revision,
                ctx.input.headers.get("x-switchyard-locale")
                or ctx.input.headers.get("accept-language"),
                ctx.input.headers.get("x-switchyard-data-version") or cfg.data_version,
                request_headers.cache_tags(ctx.input.headers.get("x-switchyard-cache-tags")),
            )
            risk = self._risk.classify(keys.query, ctx.alias or "", keys.tags)
            if risk.source is not None:
                why = f"risk {risk.source}" + (f" ({risk.matched!r})" if risk.matched else "")
                if risk.policy == "off":
                    verdict = replace(
                        verdict, lookup=False, store=False, reason=f"{why}: cache off", risk=risk
                    )
                    keys = None
                elif risk.policy == "exact_only":
                    verdict = replace(verdict, semantic=False, risk=risk)
        state.plan = (verdict, keys)
        return verdict, keys


class Embed(Stage):
    """Embed the last user message once; the cache and the router share the vector."""

    name = "embed"
    UNWANTED = Verdict(outcomes.Embed.SKIP, "no semantic cache or router for this request")

    def __init__(
        self,
        settings: Settings,
        embedder: EmbeddingService | None,
        cache: ResponseCache | None,
        planner: CachePlanner,
        router: Callable[[], Any],
    ) -> None:
        self._semantic = cache is not None and settings.cache.semantic
        self._routing = settings.router.enabled
        self._embedder = embedder
        self._cache = cache
        self._planner = planner
        self._router = router

    def static(self, view: View) -> Verdict | None:
        if not (self._semantic or self._routing) or view.endpoint != "chat.completions":
            return self.UNWANTED
        return None

    def work(self, ctx: RequestContext) -> Awaitable[None] | None:
        t = time.perf_counter()
        if not self._semantic and self._router() is None:  # the router is still building
            ctx.record(self.name, self.UNWANTED.outcome, self.UNWANTED.reason, t)
            return None
        embedder = self._embedder
        if embedder is None or not embedder.ready:
            ctx.record(self.name, outcomes.Embed.SKIP, "embedding model not ready", t)
            return None
        if self._cache is not None:
            verdict, keys = self._planner.plan(ctx)
            if (
                keys is not None
                and verdict.lookup
                and verdict.mode == "enforce"
                and self._cache.has_exact(keys, now=time.time() + 1.0)
            ):
                # The cache stage will answer with this entry (alive for at least another
                # second, so it cannot expire in between); nothing needs the vector.
                ctx.record(
                    self.name, outcomes.Embed.SKIP, "an exact cache entry answers this request", t
                )
                return None
            if not self._routing and (keys is None or not verdict.semantic):
                why = "no semantic lookup for this request"
                if verdict.risk is not None:
                    why += f" (risk {verdict.risk.source}: {verdict.risk.policy})"
                ctx.record(self.name, outcomes.Embed.SKIP, why, t)
                return None
        return self._embed(ctx, embedder, t)

    async def _embed(self, ctx: RequestContext, embedder: EmbeddingService, t: float) -> None:
        query = last_user_text(ctx.masked())
        vecs, _, path = await embedder.embed_traced([query])
        ctx.vector = vecs[0]
        ctx.record(
            self.name,
            outcomes.Embed.OK,
            "embedded the last user message",
            t,
            {"chars": len(query), "path": path},
        )


class Cache(Stage):
    """Exact, then semantic lookup in the request's partition (see decide/cache.py);
    on the way out, a good reply is stored (masked) and, in shadow mode, compared
    with the would-be hit (`CacheStore`)."""

    name = "cache"
    OFF = Verdict(outcomes.Cache.SKIP, "cache not enabled")

    def __init__(
        self,
        settings: Settings,
        cache: ResponseCache | None,
        planner: CachePlanner,
        check: CandidateCheck | None,
        embedder: EmbeddingService | None = None,
    ) -> None:
        self._cfg = settings.cache
        self._cache = cache
        self._planner = planner
        self._check = check  # decide/candidate.py: rules, pair model, cross-encoder
        self._embedder = embedder  # compares answers in shadow mode

    def static(self, view: View) -> Verdict | None:
        return self.OFF if self._cache is None else None

    def reply(self, ctx: RequestContext) -> ReplyPart | None:
        cs = ctx.cache_state
        if cs is None or not cs.wants_reply or self._cache is None:
            return None
        return CacheStore(self, ctx)

    async def remember(self, ctx: RequestContext, obj: dict[str, Any]) -> None:
        """Store a good reply (masked) and, in shadow mode, compare it with the would-be hit."""
        t = time.perf_counter()
        cs = ctx.cache_state
        cache = self._cache
        assert cs is not None and cache is not None  # CacheStore is made only then
        masked = at_rest(ctx.pii.session if ctx.pii is not None else None, obj)
        embedder = self._embedder
        if cs.shadow_entry is not None and embedder is not None and embedder.ready:
            cached = reply_text(orjson.loads(cs.shadow_entry.body))
            vecs, _ = await embedder.embed([cached, reply_text(masked)])
            agreement = float(vecs[0] @ vecs[1])
            evidence: dict[str, Any] = {
                "answer_similarity": round(agreement, 4),
                "prompt_similarity": cs.similarity,
            }
            thresholds = cache.thresholds
            verdict, keys = cs.plan if cs.plan is not None else (None, None)
            if (
                cs.shadow_semantic
                and thresholds is not None
                and cs.similarity is not None
                and verdict is not None
                and keys is not None
            ):
                # Live evidence moves the partition's threshold (decide/shadow_threshold.py).
                evidence["partition_threshold"] = thresholds.observe(
                    keys.partition, verdict.threshold, cs.similarity, agreement
                )
            ctx.record(
                "cache_shadow",
                outcomes.CacheShadow.COMPARED,
                f"cached vs fresh answer similarity {agreement:.3f}",
                t,
                evidence,
            )
        if cs.store_keys is None:
            return
        why = storable_reply(masked)
        if why is not None:
            ctx.record("cache_store", outcomes.CacheStore.SKIP, why, t)
            return
        entry = cache.store(cs.store_keys, orjson.dumps(masked), ctx.vector, self._cfg.ttl_s)
        stored: dict[str, Any] = {"partition": cs.store_keys.partition[:12]}
        if cache.share is not None:  # every gateway process learns it
            stored["shared"] = await cache.share.put(entry, ctx.vector)
        ctx.record(
            "cache_store", outcomes.CacheStore.STORED, "reply stored for later requests", t, stored
        )

    def work(self, ctx: RequestContext) -> None:
        t = time.perf_counter()
        cache = self._cache
        assert cache is not None
        cfg = self._cfg
        verdict, keys = self._planner.plan(ctx)
        state = ctx.cache_state
        assert state is not None  # the planner made it
        if keys is None:
            ctx.cache = CacheOutcome.BYPASS
            risk = verdict.risk
            ev = None if risk is None else {"risk": risk.source, "risk_policy": risk.policy}
            ctx.record("cache", outcomes.Cache.BYPASS, verdict.reason, t, ev)
            return
        state.store_keys = keys if verdict.store else None
        if not verdict.lookup:
            ctx.cache = CacheOutcome.BYPASS
            ctx.record(
                "cache",
                outcomes.Cache.BYPASS,
                verdict.reason,
                t,
                {"partition": keys.partition[:12]},
            )
            return
        threshold = verdict.threshold
        if cache.thresholds is not None:
            threshold = cache.thresholds.threshold(keys.partition, threshold)
        evidence: dict[str, Any] = {
            "partition": keys.partition[:12],
            "threshold": threshold,
            "mode": verdict.mode,
        }
        if threshold != verdict.threshold:  # shadow evidence raised it
            evidence["configured_threshold"] = verdict.threshold
        if verdict.risk is not None:
            evidence["risk"] = verdict.risk.source
            evidence["risk_policy"] = verdict.risk.policy
        entry = cache.lookup_exact(keys)
        kind, sim = (
            (CacheOutcome.HIT_EXACT, 1.0) if entry is not None else (CacheOutcome.MISS, None)
        )
        if entry is None and cfg.semantic and verdict.semantic and ctx.vector is not None:
            found = cache.nearest(keys, ctx.vector)
            evidence["candidates"] = found.candidates
            if found.entry is not None and found.similarity is not None:
                sim = found.similarity
                evidence["best_similarity"] = round(sim, 4)
                # Below the threshold, the request's own question misspelt is still put
                # to the checks: a typo can drop the cosine to 0.35 (decide/verify.py).
                admitted = sim >= threshold
                if not admitted and same_question(keys.query, found.entry.keys.query):
                    admitted = evidence["same_question"] = True
                if admitted:
                    check = self._check
                    ok, why = (
                        check(keys.query, found.entry.keys.query, sim)
                        if check is not None
                        else (True, "verifier off")
                    )
                    evidence["verifier"] = why
                    if ok:
                        entry, kind = found.entry, CacheOutcome.HIT_SEMANTIC
                        cache.touch(entry)
                    else:
                        ctx.record("cache", outcomes.Cache.MISS_VETO, why, t, evidence)
                        ctx.cache = CacheOutcome.MISS
                        return
        if entry is None:
            ctx.cache = CacheOutcome.MISS
            ctx.record("cache", _MISS, "no entry in the partition passed", t, evidence)
            return
        state.similarity = sim
        if verdict.mode == "shadow":
            ctx.cache, state.shadow_entry = CacheOutcome.SHADOW_HIT, entry
            state.shadow_semantic = kind == CacheOutcome.HIT_SEMANTIC
            ctx.record(
                "cache",
                outcomes.Cache.SHADOW_HIT_SEMANTIC
                if state.shadow_semantic
                else outcomes.Cache.SHADOW_HIT_EXACT,
                "would have served a cached reply; calling the model",
                t,
                evidence,
            )
            return
        ctx.cache = kind
        state.store_keys = None  # nothing new to store
        ctx.response = entry
        served = (
            outcomes.Cache.HIT_SEMANTIC
            if kind is CacheOutcome.HIT_SEMANTIC
            else outcomes.Cache.HIT_EXACT
        )
        ctx.record("cache", served, f"served from cache (similarity {sim:.3f})", t, evidence)


def reply_text(obj: dict[str, Any]) -> str:
    c = (obj.get("choices") or [{}])[0]
    return str((c.get("message") or {}).get("content") or c.get("text") or "")


class CacheStore(ReplyPart):
    """The cache's reply part: a whole reply is remembered as it passes; a stream's
    events are kept and, once it completed, assembled and remembered."""

    __slots__ = ("_ctx", "_events", "_stage")

    def __init__(self, stage: Cache, ctx: RequestContext) -> None:
        self._stage = stage
        self._ctx = ctx
        self._events: list[bytes] = []

    async def whole(self, obj: dict[str, Any]) -> dict[str, Any]:
        await self._stage.remember(self._ctx, obj)
        return obj

    def event(self, data: bytes) -> list[bytes] | None:
        self._events.append(data)
        return None

    def after(self, ok: bool) -> Awaitable[None] | None:
        obj = assemble(self._events) if ok else None
        return None if obj is None else self._stage.remember(self._ctx, obj)


class Route(Stage):
    """Semantic routing of the aliases the router owns (router.routed_aliases)."""

    name = "route"

    def __init__(
        self, settings: Settings, router: Callable[[], Any], named: Mapping[str, dict[str, Any]]
    ) -> None:
        self._cfg = settings.router
        self._router = router
        self._explicit = {
            a: Verdict(outcomes.Route.EXPLICIT, "the client named the model", e)
            for a, e in named.items()
        }

    def static(self, view: View) -> Verdict | None:
        if self._cfg.enabled and view.alias in self._cfg.routed_aliases:
            return None
        explicit = self._explicit.get(view.alias or "")
        return (
            explicit
            if explicit is not None
            else Verdict(
                outcomes.Route.EXPLICIT, "the client named the model", {"model": view.alias}
            )
        )

    def work(self, ctx: RequestContext) -> None:
        t = time.perf_counter()
        rcfg = self._cfg
        requested = ctx.alias
        router = self._router()
        if router is None or ctx.vector is None:
            if rcfg.default_route is None:
                raise RouterNotReady("the router is not ready yet; retry shortly")
            route = next(r for r in rcfg.routes if r.name == rcfg.default_route)
            ctx.alias, ctx.route, ctx.route_score = route.model, route.name, None
            ctx.record(
                "route",
                outcomes.tagged(outcomes.Kind.ROUTE, route.name),
                "router not ready: default route",
                t,
                {"policy_version": rcfg.policy_version, "default": True},
            )
        else:
            text = last_user_text(ctx.masked())
            res = router.route(ctx.vector, text, ctx.prompt_estimate, ctx.principal.tenant_id)
            ctx.alias, ctx.route, ctx.route_score = res.model, res.route, res.score
            ctx.record("route", res.outcome, res.reason, t, res.evidence())
        if not ctx.principal.may_use(ctx.alias):
            raise ModelNotAllowed(
                f"the router chose '{ctx.alias}' for '{requested}', which this key may not use",
                param="model",
            )


class Tools(Stage):
    """Remove tools the tenant may not use, then shortlist the rest by similarity."""

    name = "tools"
    NONE = Verdict(outcomes.Tools.SKIP, "no tools, or no tool policy")

    def __init__(
        self,
        settings: Settings,
        embedder: EmbeddingService | None,
        gate: ToolPolicy | None = None,
    ) -> None:
        self._cfg = settings.tools
        self._embedder = embedder
        self._gate = gate  # tools.check_outputs: the tool calls in replies are governed

    def reply(self, ctx: RequestContext) -> ReplyPart | None:
        """The tool calls of a fresh chat reply, governed (policy/tool_calls.py)."""
        policy = self._gate
        if policy is None or ctx.input.endpoint != "chat.completions" or ctx.cache in _STORED:
            return None
        return ToolGate(ctx, policy)

    def static(self, view: View) -> Verdict | None:
        c = self._cfg
        if c.shortlist_k is None and c.allow is None and not c.deny and not c.tenant_allow:
            return self.NONE
        return None

    def work(self, ctx: RequestContext) -> Awaitable[None] | None:
        if not ctx.generation.tools:
            ctx.record(self.name, self.NONE.outcome, self.NONE.reason, time.perf_counter())
            return None
        return self._shortlist(ctx)

    async def _shortlist(self, ctx: RequestContext) -> None:
        t = time.perf_counter()
        req = ctx.generation
        tools = req.tools
        assert tools is not None  # work() looked
        tcfg = self._cfg
        vecs = None
        if ctx.vector is not None and self._embedder is not None and tcfg.shortlist_k is not None:
            vecs, _ = await self._embedder.embed([tool_text(x) for x in tools])
        res = shortlist(tools, ctx.vector, vecs, tcfg.shortlist_k, ctx.principal.tenant_id, tcfg)
        ctx.request = structs.replace(req, tools=res.tools)
        if ctx.pii is not None:
            ctx.pii.masked = structs.replace(ctx.pii.masked, tools=res.tools)
        ctx.record("tools", res.outcome, res.reason, t, res.evidence())


class Select(Stage):
    """Which deployment serves the alias (decide/select.py)."""

    name = "select"

    def __init__(
        self,
        deployments: Mapping[str, Deployment],
        balancers: Mapping[str, Balancer] | None = None,
        tasks: Any = None,
        placers: Mapping[str, Placer] | None = None,
        on_place: Callable[[str, Placement, list[Change]], None] | None = None,
        metrics: Any = None,
        on_canary_cut: Callable[[str, Deployment, str], None] | None = None,
    ) -> None:
        self._deployments = deployments
        self._balancers = balancers or {}
        self._tasks = tasks  # the task store: a task's deployment, for every process
        self._placers = placers or {}  # aliases with a placement policy
        self._on_place = on_place  # metrics
        self._metrics = metrics  # observe/metrics.Metrics: placement's estimate error
        # (alias, deployment, why) when the canary guard cut a deployment (the gateway
        # stores the weight, logs and counts it)
        self._on_canary_cut = on_canary_cut

    def static(self, view: View) -> Verdict | None:
        if view.deployment is None or view.alias is None:
            return None  # work refuses it, or balances among several deployments
        if view.alias in self._balancers:
            return None
        sel = select_deployment(view.alias, self._deployments)
        dep = sel.deployment
        return Verdict(
            sel.outcome, sel.reason, sel.evidence, (("deployment", dep), ("model", dep.model))
        )

    def work(self, ctx: RequestContext) -> Awaitable[None] | None:
        t = time.perf_counter()
        balancer = self._balancers.get(ctx.alias or "")
        if balancer is not None:
            return self._balance(ctx, balancer, t)
        sel = select_deployment(ctx.alias or "", self._deployments)  # raises ModelNotFound
        ctx.deployment = sel.deployment
        ctx.model = sel.deployment.model
        ctx.record(self.name, sel.outcome, sel.reason, t, sel.evidence)
        return None

    def _balance(self, ctx: RequestContext, balancer: Balancer, t: float) -> Awaitable[None] | None:
        p = ctx.principal
        if ctx.pin is not None and p is not None and not p.may_pin_revisions:
            why = "this API key may not pin a revision (its may_pin_revisions is off)"
            ctx.record(self.name, outcomes.Select.REJECT, why, t, {"pin": ctx.pin})
            raise RevisionPinNotAllowed(why, param="model")
        boundary = balancer.deployments[0].model.data_boundary
        regions = p.regions if p is not None else None
        if regions is not None:
            boundary = [r for r in (boundary or regions) if r in regions]
        cfg = balancer.cfg
        prefix = (
            prompt_prefix(ctx.generation, cfg.prefix_min_chars, cfg.prefix_chars)
            if cfg.prefix_affinity
            else None
        )
        hold = ctx.task
        remembered = ctx.task_deployments.get(balancer.alias) if ctx.task_deployments else None
        affinity = affinity_key(ctx.input.task_id, ctx.generation, ctx.input.headers)
        if ctx.previous is not None:  # a Responses continuation: where its state is warm
            affinity, remembered = ("response", ctx.previous[0]), ctx.previous[1]
        placer = self._placers.get(balancer.alias)
        placed = self._place(ctx, balancer, placer, boundary) if placer is not None else None
        dep, reason, evidence = balancer.choose(
            tenant=p.tenant_id if p is not None else None,
            affinity=affinity,
            prefix=prefix,
            pin=ctx.pin,
            regions=boundary,
            tokens=ctx.max_tokens or 256,
            remembered=remembered,
            location=placed.location if placed is not None else None,
            only=placed.only if placed is not None else None,
        )
        if placed is not None and placed.stay and dep.location != "device":
            balancer.settled(dep, None, None)  # never sent: the data may not leave
            why = f"{placed.why}, and no device deployment is eligible now"
            ctx.record(self.name, outcomes.Select.REJECT_PLACEMENT, why, t, evidence)
            raise PlacementRefused(f"the request may not leave the device: {why}")
        ctx.admission.balanced = (balancer, dep)
        ctx.deployment = dep
        ctx.model = dep.model
        evidence["upstream"] = dep.label
        evidence["revision"] = dep.model.revision
        ctx.record(
            self.name, outcomes.tagged(outcomes.Kind.DEPLOYMENT, dep.name), reason, t, evidence
        )
        if hold is not None and self._tasks is not None and dep.name != remembered:
            # The task's deployment for this alias, for its later steps in any process.
            return self._tasks.set_deployment(hold.key, balancer.alias, dep.name)
        return None

    def release(self, ctx: RequestContext) -> None:
        """The balanced deployment is no longer in flight: it learns the request's
        latency, placement its estimate's error and the canary guard the outcome; each
        deployment the request left for another is settled as a failure."""
        adm = ctx.admission
        held = adm.balanced
        if held is not None:  # kept on the request: its metrics name the deployment
            balancer, dep = held
            tm = ctx.timings
            ttft = tpot = None
            if tm.upstream_sent is not None and tm.upstream_first_byte is not None:
                ttft = tm.upstream_first_byte - tm.upstream_sent
                n = ctx.run.chunks
                if n > 1:
                    tpot = ((tm.ended or time.perf_counter()) - tm.upstream_first_byte) / (n - 1)
            balancer.settled(dep, ttft, tpot)
            placed = ctx.placement
            if (
                placed is not None
                and placed.estimate_ms is not None
                and self._metrics is not None
                and ctx.error_code is None
            ):  # how far placement's estimate was from what the request took
                observed = (tm.ended or time.perf_counter()) - tm.received
                self._metrics.placement_error.labels(balancer.alias, placed.location).observe(
                    observed - placed.estimate_ms / 1000.0
                )
            if balancer.guard is not None:
                self._guard(ctx, balancer, dep, ctx.error_code is None)
        for balancer, dep, attempted in adm.left:  # failed over from these
            balancer.settled(dep, None, None)
            if attempted and balancer.guard is not None:
                self._guard(ctx, balancer, dep, False)

    def _guard(self, ctx: RequestContext, balancer: Balancer, dep: Deployment, ok: bool) -> None:
        """The request's outcome at `dep`, for its alias's canary guard."""
        t = time.perf_counter()
        e2e_ms = (t - ctx.timings.received) * 1000.0
        cut = balancer.guard_check(dep, ok, e2e_ms, time.monotonic())
        if cut is not None:
            ctx.record(
                "canary", outcomes.Canary.CUT, cut, t, {"deployment": dep.name, "weight": 0.0}
            )
            if self._on_canary_cut is not None:
                self._on_canary_cut(balancer.alias, dep, cut)

    def _place(
        self, ctx: RequestContext, balancer: Balancer, placer: Placer, regions: list[str] | None
    ) -> Placement | None:
        """Where the request runs (decide/placement.py): recorded as the `place` decision,
        with the device conditions it changed; the balancer then picks within it."""
        t = time.perf_counter()
        h = ctx.input.headers
        p = ctx.principal
        reports = p is None or p.may_report_device_state
        ignored = []
        raw_state = h.get("x-switchyard-device-state")
        raw_net = h.get("x-switchyard-network")
        state = parse_device_state(raw_state) if raw_state is not None and reports else None
        network = parse_network(raw_net) if raw_net is not None and reports else None
        if not reports:
            ignored = [n for n, v in (("device-state", raw_state), ("network", raw_net)) if v]
        if state is None:
            state = read_sensors()
        boundary = h.get("x-switchyard-data-boundary")
        private = None
        if boundary is not None:
            if boundary.strip().lower() != "device":
                raise InvalidRequest(
                    "header x-switchyard-data-boundary: the only value is 'device'",
                    param="x-switchyard-data-boundary",
                )
            private = "x-switchyard-data-boundary: device"
        elif placer.cfg.pii_stays_local and ctx.pii is not None and ctx.pii.found:
            private = f"PII found ({', '.join(sorted(ctx.pii.found))})"
        now = time.monotonic()
        changes = placer.observe(state, now)
        for c in changes:
            word = "entered" if c.active else "ended"
            ctx.record(
                "place",
                outcomes.tagged(
                    outcomes.Kind.ENTER if c.active else outcomes.Kind.EXIT, c.condition
                ),
                f"the device's {c.condition} condition {word}",
                t,
                {
                    "value": c.value,
                    "limits": getattr(placer.cfg, _LIMITS[c.condition]).model_dump(),
                },
            )
        eligible = balancer.eligible(regions, now)
        body_bytes = len(to_json(ctx.request)) if network is not None else 0
        placed = placer.decide(
            device=[d for d in eligible if d.location == "device"],
            cloud=[d for d in eligible if d.location == "cloud"],
            private=private,
            state=state,
            network=network,
            nbytes=body_bytes,
            tokens=ctx.max_tokens or 256,
            remaining_ms=ctx.remaining_s() * 1000.0,
            route=ctx.route,
        )
        if placed is None:
            return None
        evidence = {**placed.evidence, "reason": placed.reason}
        if ignored:
            evidence["ignored_headers"] = ignored  # this key may not report device state
        if placed.mode == outcomes.Place.REFUSED:
            ctx.record("place", outcomes.Place.REJECT_PRIVACY, placed.why, t, evidence)
            raise PlacementRefused(
                f"the request may not leave the device ({placed.why}) and no device "
                "deployment can serve it now"
            )
        cap = placed.max_tokens
        if cap is not None and (ctx.max_tokens == 0 or ctx.max_tokens > cap):
            req = ctx.generation
            if req.max_completion_tokens is not None:
                ctx.request = structs.replace(req, max_completion_tokens=cap)
            else:
                ctx.request = structs.replace(req, max_tokens=cap)
            ctx.max_tokens = cap
            evidence["max_tokens"] = cap
        ctx.placement = placed
        ctx.record("place", placed.mode, placed.why, t, evidence)
        if self._on_place is not None:
            self._on_place(balancer.alias, placed, changes)
        return placed


_LIMITS = {"thermal": "thermal_c", "battery": "battery_pct", "memory": "memory_pct"}


class Residency(Stage):
    """Whether the local model is loaded (`hot`) or is loaded for this request
    (`cold-load`: load time, what was evicted and why), and which adapter it applies
    (engines/pool.py). Holds the engine until the request is settled, so the pool never
    evicts an engine a request is using."""

    name = "residency"
    REMOTE = Verdict(outcomes.Residency.SKIP, "the deployment is not a local engine")

    def __init__(self, pool: EnginePool, revisions: Mapping[str, Any] | None = None) -> None:
        self._pool = pool
        # RL-managed aliases: their base requests go to the active revision's engine
        # (engines/revisions.py), under a lease that the activation barrier waits for.
        self._revisions = revisions if revisions is not None else {}

    def static(self, view: View) -> Verdict | None:
        dep = view.deployment
        if dep is None:
            return None  # select refused it
        return self.REMOTE if dep.engine is None else None

    def release(self, ctx: RequestContext) -> None:
        """The engine (and adapter) may be evicted again; the revision's lease ends."""
        adm = ctx.admission
        if adm.resident is not None:
            EnginePool.release(*adm.resident)
        if adm.lease is not None:
            adm.lease.release()

    def work(self, ctx: RequestContext) -> Awaitable[None] | None:
        dep = ctx.deployment
        assert dep is not None
        t = time.perf_counter()
        if dep.engine is None:  # a balanced deployment that is remote
            ctx.record(self.name, self.REMOTE.outcome, self.REMOTE.reason, t)
            return None
        if dep.adapter is None and self._revisions:
            manager = self._revisions.get(dep.alias)
            if manager is not None:
                self._revision(ctx, manager, t)
                return None
        now = self._pool.hot(dep.engine)
        if now is None:
            return self._load(ctx, dep, t)
        return self._held(ctx, dep, now, t)

    def _revision(self, ctx: RequestContext, manager: Any, t: float) -> None:
        """An RL-managed model: the request holds a lease on the active revision and is
        served by its engine; an activation lets it finish there."""
        try:
            lease = manager.lease()
        except SwitchyardError as exc:
            ctx.record(self.name, outcomes.Residency.REJECT, exc.message, t, {"active": None})
            raise
        rev = lease.rev
        if ctx.pin is not None and ctx.pin != rev.revision:
            lease.release()
            why = (
                f"the model '{manager.alias}' is RL-managed and answers with its active "
                f"revision only: '{rev.revision}', not '{ctx.pin[:64]}'"
            )
            ctx.record(
                self.name,
                outcomes.Residency.REJECT,
                why,
                t,
                {"pin": ctx.pin, "active": rev.revision},
            )
            raise ModelNotFound(why, param="model")
        ctx.admission.lease = lease
        dep = manager.deployment(rev)
        ctx.deployment = dep
        ctx.model = dep.model
        ctx.record(
            self.name,
            outcomes.tagged(outcomes.Kind.REVISION, rev.revision),
            f"RL-managed model: served by its active revision {rev.revision} ({rev.kind}), "
            "held until the request ends (an activation lets it finish there)",
            t,
            {
                "revision": rev.revision,
                "kind": rev.kind,
                "sha256": rev.sha256,
                "in_flight": rev.in_flight,
            },
        )

    async def _load(self, ctx: RequestContext, dep: Deployment, t: float) -> None:
        assert dep.engine is not None
        try:
            r = await self._pool.acquire(dep.engine, ctx.remaining_s())
        except SwitchyardError as exc:
            ctx.record(
                self.name,
                outcomes.Residency.REJECT,
                exc.message,
                t,
                {"state": dep.engine.state.value},
            )
            raise
        pending = self._held(ctx, dep, r, t)
        if pending is not None:
            await pending

    def _held(
        self, ctx: RequestContext, dep: Deployment, r: EngineResidency, t: float
    ) -> Awaitable[None] | None:
        """The engine is held for this request (`r`: how it came to be). Then its
        adapter, or its turn beside adapter requests: at once, or waited for."""
        engine = dep.engine
        assert engine is not None
        ctx.admission.resident = (engine, None)
        if dep.adapter is None and not engine.isolate_base:
            ctx.record(self.name, r.outcome, r.reason, t, r.evidence)
            return None
        name = BASE if dep.adapter is None else dep.adapter.name
        got = self._pool.adapter_now(engine, name)
        if got is None:
            return self._adapter(ctx, dep, r, t)
        self._record(ctx, dep, r, got, t)
        return None

    async def _adapter(
        self, ctx: RequestContext, dep: Deployment, r: EngineResidency, t: float
    ) -> None:
        """Wait for the adapter to be active for this request (or, for a base request
        kept apart from adapter requests, for its turn)."""
        engine, adapter = dep.engine, dep.adapter
        assert engine is not None
        name = BASE if adapter is None else adapter.name
        try:
            got = await self._pool.adapter(engine, name, ctx.remaining_s())
        except SwitchyardError as exc:
            if adapter is None:
                ctx.record(self.name, outcomes.Residency.REJECT, exc.message, t, r.evidence)
                raise
            ev = {**r.evidence, "adapter": name, "adapter_state": engine.adapter_state(name)}
            ctx.record(
                self.name, outcomes.Residency.REJECT, f"adapter {name}: {exc.message}", t, ev
            )
            raise
        self._record(ctx, dep, r, got, t)

    def _record(
        self,
        ctx: RequestContext,
        dep: Deployment,
        r: EngineResidency,
        got: dict[str, Any],
        t: float,
    ) -> None:
        """The adapter is active for this request (the pool counted it in use)."""
        engine, adapter = dep.engine, dep.adapter
        assert engine is not None
        outcome: outcomes.Residency = r.outcome
        reason, evidence = r.reason, {**r.evidence, **got}
        if adapter is None:  # a base request kept apart from adapter requests
            ctx.admission.resident = (engine, BASE)
            reason = (
                f"{reason}; kept apart from adapter requests "
                f"(engine.base_beside_adapters is false): {evidence['base_apart']}"
            )
            if "adapter_waited_ms" in evidence:
                reason += f" after waiting {evidence['adapter_waited_ms']:g} ms for them"
            ctx.record(self.name, outcome, reason, t, evidence)
            return
        ctx.admission.resident = (engine, adapter.name)
        action = evidence.get("adapter_action")
        if action == "loaded":
            outcome = outcomes.Residency.ADAPTER_LOAD
            reason = f"{reason}; the adapter was cold: loaded ({evidence['adapter_load']})"
            evicted = evidence.get("adapter_evicted") or []
            if evicted:
                reason += f", evicting {evicted[0]['adapter']} ({evicted[0]['reason']})"
        elif action == "promoted":
            if outcome is outcomes.Residency.HOT:
                outcome = outcomes.Residency.PROMOTE
            reason = f"{reason}; the adapter was warm: promoted to active"
        else:
            reason = f"{reason}; the adapter is active: joined the requests using it"
        if "adapter_waited_ms" in evidence:
            reason += f" after waiting {evidence['adapter_waited_ms']:g} ms for a slot"
        evidence = {
            **evidence,
            "adapter": adapter.name,
            "adapter_revision": adapter.revision,
            "adapter_id": dep.adapter_id(),
            "base": adapter.base,
            "base_revision": adapter.base_revision,
        }
        ctx.record(self.name, outcome, reason, t, evidence)


class Place(Stage):
    """Local (a managed engine) or remote (an upstream)."""

    name = "place"

    def static(self, view: View) -> Verdict | None:
        dep = view.deployment
        if dep is None:
            return None
        where = outcomes.Place.LOCAL if dep.engine is not None else outcomes.Place.REMOTE
        return Verdict(where, f"the deployment runs {where}ly", {"region": dep.model.region})

    def work(self, ctx: RequestContext) -> None:
        """A balanced deployment (static decides the others; select set one or refused)."""
        if ctx.placement is not None:
            return  # placement decided it before balancing (Select._place), recorded there
        dep = ctx.deployment
        assert dep is not None, f"place without a deployment for {ctx.alias!r}"
        t = time.perf_counter()
        local = dep.engine is not None
        ctx.record(
            self.name,
            outcomes.Place.LOCAL if local else outcomes.Place.REMOTE,
            "the deployment runs locally" if local else "the deployment runs remotely",
            t,
            {"region": dep.model.region},
        )
