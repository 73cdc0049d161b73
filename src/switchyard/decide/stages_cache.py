"""The cache's decision stages: embed the last user message once, look the request up
in its cache partition, and on the way out store a good reply (`CacheStore`).

`CachePlanner` works out once per request whether it may use the cache, and its keys, for
both stages. The public face is decide/stages.py, which re-exports these names.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import orjson

from switchyard import outcomes
from switchyard.config import Settings
from switchyard.decide.cache import CacheKeys, ResponseCache, cache_keys
from switchyard.decide.cacheability import Cacheability, assemble, cacheability, storable_reply
from switchyard.decide.candidate import CandidateCheck
from switchyard.decide.risk import RiskClassifier
from switchyard.decide.verify import same_question
from switchyard.embed import EmbeddingService
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
from switchyard.reply import first_choice
from switchyard.request import Generation

if TYPE_CHECKING:
    from switchyard.engines.registry import Deployment

_MISS = outcomes.Cache.MISS  # bound once: read through its class per request costs more


def last_user_text(req: Generation) -> str:
    for m in reversed(req.messages or ()):
        if m.get("role") == "user":
            c = m.get("content")
            if isinstance(c, list):
                return "\n".join(str(p.get("text", "")) for p in c if isinstance(p, dict))
            return str(c or "")
    return ""


def data_version(configured: str | None, asked: str | None) -> str | None:
    """The data version a request's answers are keyed by: the operator's
    (`cache.data_version`) and the client's (`x-switchyard-data-version`) together, so
    a header naming the version an operator retired never reaches its answers again. A
    header holds no line break: the two never run into each other."""
    if not asked:
        return configured
    return asked if configured is None else f"{configured}\n{asked}"


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
        # A routed alias's (`auto`) answers come from any route's model, and the route
        # stage authorizes the model it chose after the cache: a key looks them up only
        # when it may use every model a route names.
        router = settings.router
        self._routed = frozenset(router.routed_aliases) if router.enabled else frozenset()
        self._route_models = tuple(dict.fromkeys(r.model for r in router.routes))
        # A LoRA adapter is served as a model of its own over its base's config (and
        # revision): its answers are the adapter's weights', keyed by them too.
        self._adapters = {
            a.name: f"+lora:{a.name}@{a.revision}:{a.sha256[:16] if a.sha256 else a.path}"
            for a in settings.adapters
        }

    def revision(self, alias: str) -> str:
        """The revision `alias`'s answers are keyed by: its configured one (an
        RL-managed alias's: the one active now, so an activation never serves the old
        weights' answers; an adapter's: its base's with the adapter's name, revision
        and weights); a routed alias's: the routing policy's version with every route
        model's revision, so a route model's new weights are never served old answers
        through the routed alias."""
        if alias not in self._models:
            routes = ",".join(f"{m}={self._own(m)}" for m in self._route_models)
            return f"router:{self._router_version}[{routes}]"
        return self._own(alias)

    def _own(self, alias: str) -> str:
        model = self._models.get(alias)
        revision = model.revision if model is not None else ""
        manager = self._revisions.get(alias) if self._revisions else None
        if manager is not None and manager.active is not None:
            revision = manager.active.revision
        return revision + self._adapters.get(alias, "")

    def answered(self, dep: Deployment) -> str:
        """The revision a deployment's answers are keyed by (`revision`'s terms)."""
        adapter = dep.adapter
        suffix = self._adapters.get(adapter.name, "") if adapter is not None else ""
        return dep.model.revision + suffix

    def foreign(self, ctx: RequestContext, keys: CacheKeys) -> str | None:
        """Why a fresh reply is not the answer its keys stand for (so it is not stored),
        or None: a fallback model, or a revision other than the keyed one (a canary,
        another deployment's) answered, or a limit shrank the output cap the client
        asked for (the partition keys the cap asked, not the one sent)."""
        dep = ctx.deployment
        if ctx.run.fallback_from is not None:
            answered = dep.alias if dep is not None else "another model"
            return f"a fallback answered ({ctx.run.fallback_from} -> {answered})"
        if dep is not None:
            alias = ctx.alias or ""
            # A routed alias's keys name the router's policy; the routed model answered.
            keyed = keys.revision if alias == keys.model else self.revision(alias)
            answered = self.answered(dep)
            if answered != keyed:
                return f"revision {answered} answered; the partition keys {keyed}"
        cost = ctx.cost
        # policy/cost.py `plan` sets None, default and window from the request and the
        # model alone; any other reason is a limit's shrink (budget, tpm, a task's).
        if cost is not None and cost.reason not in (None, "default", "window"):
            return f"the output cap shrank to {cost.cap} tokens ({cost.reason})"
        return None

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
        alias = ctx.alias or ""
        if ctx.pin is not None and (verdict.lookup or verdict.store):
            # Selection checks the pin (may the key pin, does the revision exist): a hit
            # would end the request before it, and the partition keys the alias's own.
            verdict = replace(
                verdict,
                lookup=False,
                store=False,
                reason="a pinned revision is not cached (selection checks the pin)",
            )
        elif verdict.lookup and alias in self._routed:
            may_use = ctx.principal.may_use
            if not all(may_use(m) for m in self._route_models):
                verdict = replace(
                    verdict,
                    lookup=False,
                    reason="routed: this key may not use every model the router may choose",
                )
        if verdict.lookup or verdict.store:
            revision = self.revision(alias)
            scope = f"key:{ctx.principal.key_id}" if cfg.scope == "key" else f"tenant:{tenant}"
            keys = cache_keys(
                ctx.masked(),
                ctx.input.endpoint,
                scope,
                tenant,
                alias,
                revision,
                ctx.input.headers.get("x-switchyard-locale")
                or ctx.input.headers.get("accept-language"),
                data_version(cfg.data_version, ctx.input.headers.get("x-switchyard-data-version")),
                request_headers.cache_tags(ctx.input.headers.get("x-switchyard-cache-tags")),
            )
            risk = self._risk.classify(keys.query, alias, keys.tags)
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
                and verdict.max_age is None  # the entry may be too old to serve
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
        vecs, _, path = await embedder.embed_traced([query], ctx.principal.tenant_id)
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
                moved = thresholds.observe(
                    keys.partition, verdict.threshold, cs.similarity, agreement
                )
                evidence["partition_threshold"] = moved
                if moved["change"] != "none" and cache.share is not None:  # every process's
                    await cache.share.threshold_moved(
                        keys.partition, thresholds.raised(keys.partition)
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
        why = self._planner.foreign(ctx, cs.store_keys) or storable_reply(masked)
        if why is not None:
            ctx.record("cache_store", outcomes.CacheStore.SKIP, why, t)
            return
        keys = cs.store_keys
        dep = ctx.deployment
        if dep is not None:  # what answered: a hit names it, an invalidation finds it
            keys = replace(keys, answered_model=dep.alias, answered_revision=dep.model.revision)
        entry = cache.store(keys, orjson.dumps(masked), ctx.vector, self._cfg.ttl_s)
        stored: dict[str, Any] = {"partition": keys.partition[:12]}
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
        why = "no entry in the partition passed"
        if entry is not None and verdict.max_age is not None:
            age = time.time() - entry.created
            if age > verdict.max_age:  # the client accepts none this old: a fresh one
                evidence["age_s"] = round(age, 3)
                why = f"the entry is older than Cache-Control max-age={verdict.max_age:g}"
                entry = None
        if entry is None:
            ctx.cache = CacheOutcome.MISS
            ctx.record("cache", _MISS, why, t, evidence)
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
    """Choice 0's text (reply.first_choice: wherever it sits in `choices`)."""
    c = first_choice(obj)
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
        obj = assemble(self._events, self._ctx.input.endpoint) if ok else None
        return None if obj is None else self._stage.remember(self._ctx, obj)
