"""Decision stages: embed, cache, route, tools, select, residency, place.

Each stage's `static` is the one place that says when it decides the same for every
request of a View (pipeline.View); `work` handles the rest (see pipeline.Stage).

This module is the stages' public face and holds the request-shaping stages, route and
tools; the cache's stages (embed, cache and its reply part) live in stages_cache.py, and
where the request runs (select, residency, place) in stages_select.py.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from msgspec import structs

from switchyard import outcomes
from switchyard.config import Settings
from switchyard.decide.stages_cache import Cache as Cache
from switchyard.decide.stages_cache import CachePlanner as CachePlanner
from switchyard.decide.stages_cache import CacheStore as CacheStore
from switchyard.decide.stages_cache import Embed as Embed
from switchyard.decide.stages_cache import last_user_text
from switchyard.decide.stages_cache import reply_text as reply_text
from switchyard.decide.stages_select import Place as Place
from switchyard.decide.stages_select import Residency as Residency
from switchyard.decide.stages_select import Select as Select
from switchyard.decide.tools import shortlist, tool_name, tool_text
from switchyard.embed import EmbeddingService
from switchyard.errors import ModelNotAllowed, RouterNotReady, ToolNotAllowed
from switchyard.pipeline import CacheOutcome, ReplyPart, RequestContext, Stage, Verdict, View
from switchyard.policy.tool_calls import ToolGate, ToolPolicy
from switchyard.request import UNKNOWN_MODEL

_STORED = (CacheOutcome.HIT_EXACT, CacheOutcome.HIT_SEMANTIC, CacheOutcome.REPLAY)


class Route(Stage):
    """Semantic routing of the aliases the router owns (router.routed_aliases)."""

    name = "route"
    # A model there is none of (selection refuses it): its name is the client's free
    # text, not recorded (request.UNKNOWN_MODEL).
    UNKNOWN = Verdict(
        outcomes.Route.EXPLICIT, "the client named the model", {"model": UNKNOWN_MODEL}
    )

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
        return explicit if explicit is not None else self.UNKNOWN

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


def _forced(choice: Any) -> str | None:
    """The tool a `tool_choice` forces (`{"type": "function", "function": {"name"}}`)."""
    if isinstance(choice, dict):
        fn = choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        return name if isinstance(name, str) else None
    return None


def _tool_policy(settings: Settings) -> bool:
    """Whether a tool policy may remove a tool from a request (the Tools stage's work)."""
    c = settings.tools
    return not (
        c.shortlist_k is None
        and c.allow is None
        and not c.deny
        and not c.tenant_allow
        and all("*" in t.allowed_tenants for t in c.registry)
    )


def refuses_legacy(settings: Settings, endpoint: str) -> bool:
    """Whether `endpoint`'s codec refuses the deprecated `functions`/`function_call`:
    they would offer tools past the tool policy, which reads `tools`, and bring replies
    whose `function_call` passes the reply gate, which reads `tool_calls` (no key, no
    block); so they are refused wherever either governs (the gate: chat replies)."""
    gated = settings.tools.check_outputs and endpoint == "chat.completions"
    return gated or _tool_policy(settings)


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
        self._cfg = c = settings.tools
        self._embedder = embedder
        self._gate = gate  # tools.check_outputs: the tool calls in replies are governed
        # No tool is removed from a request: the stage folds (the legacy form, which
        # would pass both, is refused by the codec where either is on: refuses_legacy).
        self._policy = ToolPolicy(c)
        self._no_policy = not _tool_policy(settings)

    def reply(self, ctx: RequestContext) -> ReplyPart | None:
        """The tool calls of a fresh chat reply, governed (policy/tool_calls.py)."""
        policy = self._gate
        if policy is None or ctx.input.endpoint != "chat.completions" or ctx.cache in _STORED:
            return None
        return ToolGate(ctx, policy)

    def static(self, view: View) -> Verdict | None:
        return self.NONE if self._no_policy else None

    def work(self, ctx: RequestContext) -> Awaitable[None] | None:
        req = ctx.generation
        if not req.tools or self._no_policy:
            ctx.record(self.name, self.NONE.outcome, self.NONE.reason, time.perf_counter())
            return None
        return self._shortlist(ctx)

    async def _shortlist(self, ctx: RequestContext) -> None:
        t = time.perf_counter()
        req = ctx.generation
        tools = req.tools
        assert tools is not None  # work() looked
        tcfg = self._cfg
        choice = req.tool_choice
        forced = _forced(choice)
        vecs = None
        if ctx.vector is not None and self._embedder is not None and tcfg.shortlist_k is not None:
            vecs, _ = await self._embedder.embed(
                [tool_text(x) for x in tools], ctx.principal.tenant_id
            )
        res = shortlist(
            tools,
            ctx.vector,
            vecs,
            tcfg.shortlist_k,
            ctx.principal.tenant_id,
            self._policy,
            required=() if forced is None else (forced,),
        )
        ctx.record("tools", res.outcome, res.reason, t, res.evidence())
        kept = res.tools
        if forced is not None and forced not in {tool_name(x) for x in kept}:
            raise ToolNotAllowed(
                f"tool_choice forces the tool '{forced[:64]}', which this key may not use",
                param="tool_choice",
            )
        if not kept and choice == "required":
            raise ToolNotAllowed(
                "tool_choice requires a tool call, and this key may use none of the tools",
                param="tool_choice",
            )
        # No tool left: neither an empty `tools` (the OpenAI API refuses one) nor a
        # `tool_choice` goes upstream.
        fields: dict[str, Any] = {"tools": kept} if kept else {"tools": None, "tool_choice": None}
        ctx.request = structs.replace(req, **fields)
        if ctx.pii is not None:
            ctx.pii.masked = structs.replace(ctx.pii.masked, **fields)
