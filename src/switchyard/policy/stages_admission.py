"""The reserving stages: the request's cost shape (window), then its reservation
against the key's and tenant's limits (admit) and the deployment's own (deployment_limits),
through the one Reserver they share; and the estimates a reservation is made from.

Each stage's `static` is the one place that says when it decides the same for every
request of a View (pipeline.View); `work` handles the rest (see pipeline.Stage).
"""

from __future__ import annotations

import inspect
import logging
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from switchyard import outcomes
from switchyard.config import ModelConfig, Price, Settings
from switchyard.errors import ContextLengthExceeded, InvalidRequest, LimiterDown
from switchyard.pipeline import RequestContext, Stage, Verdict, View
from switchyard.policy.admit import (
    FullWindows,
    cost_usd,
    deployment_scope,
    principal_scopes,
    rate_headers,
    refusal,
)
from switchyard.policy.cost import Cost, PromptOverhead, choice_limit, effective_window, plan
from switchyard.request import Embedding
from switchyard.state.limits import (
    Ask,
    Billing,
    Limiter,
    LimiterUnavailable,
    ScopeLimits,
    period_key,
    period_start,
    spend_scopes,
)
from switchyard.state.limits import Verdict as LimitVerdict

if TYPE_CHECKING:
    from switchyard.policy.tasks import TaskHold

log = logging.getLogger("switchyard")

NO_LIMITS = Verdict(outcomes.Admit.SKIP, "no limits apply")
# The outcomes every admitted request records, bound once: reading an enum member
# through its class costs a metaclass lookup each time, on the request's path.
_ADMITTED = outcomes.Admit.ADMITTED
_WINDOW_OK = outcomes.Window.OK

# What was spent by a scope ("key_id" | "tenant_id", id) since a unix time: the ledger.
SpentSince = Callable[[str, str, float], Awaitable[float]]


class Reserver:
    """Reserves a request's tokens and cost against limiter scopes and records the
    verdict; shared by the stages that reserve (admit, deployment_limits).
    `estimate(ctx)` is the request's (prompt tokens, output tokens, price)."""

    def __init__(
        self,
        limiter: Limiter,
        settings: Settings,
        spent_since: SpentSince,
        counters: dict[str, int],
        full: FullWindows | None = None,
    ) -> None:
        self.limiter = limiter
        # The rpm windows its refusals found full (the gateway's, shared: service.py
        # refuses a request of such a scope before reading its body).
        self.full = full if full is not None else FullWindows()
        self.on_failure = settings.policy.on_limiter_failure
        self.min_output = settings.policy.min_output_tokens
        self._spent_since = spent_since
        self.counters = counters
        self._seeded: set[tuple[str, str]] = set()
        # A worker of `serve --workers N`: its holds carry their usage row's facts.
        self._billed = bool(getattr(limiter, "owned", False))

    async def reserve(
        self,
        ctx: RequestContext,
        scopes: list[ScopeLimits],
        stage: str,
        estimate: tuple[int, int, Price | None],
        fixed_usd: float | None = None,
    ) -> None:
        """Reserve `estimate` (prompt tokens, output cap, the model's price), or, with
        `fixed_usd`, that many dollars (a price per call: a tool's)."""
        t = time.perf_counter()
        prompt, out, price = estimate
        ctx.prompt_estimate = prompt
        ctx.max_tokens = out
        if fixed_usd is None:
            fixed_usd = cost_usd(price, prompt, out) if price else 0.0
        ask = Ask(
            f"{ctx.input.request_id}#{stage}",  # one reservation per request and stage
            prompt + out,
            fixed_usd,
            self._billing(ctx, prompt) if self._billed else None,
        )
        shrunk: dict[str, Any] | None = None
        try:
            await self._seed_budgets(scopes)
            verdict = await self.limiter.reserve(scopes, ask)
            cost = ctx.cost
            # Less left than the cap: the cap shrinks to what fits (again if a
            # concurrent request took some of it meanwhile), down to a minimal answer.
            for _ in range(3):
                if verdict.allowed or cost is None or verdict.limit not in ("budget", "tpm"):
                    break
                cap = _fit(cost, verdict, price)
                if cap < minimal_answer(cost, self.min_output):
                    break
                if shrunk is None:
                    shrunk = {"from": cost.cap}
                shrunk.update({"to": cap, "by": f"{verdict.limit}:{verdict.scope}"})
                cost.shrink(cap, verdict.limit or "budget")
                ctx.max_tokens = cost.cap
                ask = Ask(ask.request_id, cost.tokens, cost.usd(price), ask.billing)
                verdict = await self.limiter.reserve(scopes, ask)
        except LimiterUnavailable as exc:
            if self.on_failure == "fail_open":
                self.counters["limiter_fail_open"] += 1
                log.warning("limiter unavailable, admitting (fail_open): %s", exc)
                ctx.record(stage, outcomes.Admit.FAIL_OPEN, f"limiter unavailable: {exc}", t)
                return
            self.counters["limiter_fail_closed"] += 1
            ctx.record(
                stage,
                outcomes.Admit.REJECT_LIMITER_UNAVAILABLE,
                f"limiter unavailable: {exc}",
                t,
            )
            raise LimiterDown("rate limiter unavailable; refusing (fail_closed)") from None
        ctx.admission.rate_headers.update(rate_headers(verdict))
        evidence: dict[str, Any] = {
            "reserved_tokens": ask.tokens,
            "reserved_usd": ask.cost_usd,
            "scopes": verdict.state,
        }
        if shrunk is not None:
            evidence["cap_shrunk"] = shrunk
        if not verdict.allowed:
            self.full.note(verdict, scopes, time.time())
            ctx.record(
                stage,
                outcomes.reject(str(verdict.limit)),
                f"{verdict.limit} limit of {verdict.scope}",
                t,
                evidence,
            )
            raise refusal(verdict)
        ctx.admission.reservations.append((scopes, ask, stage))
        if shrunk is not None:
            reason = f"within every limit once the output cap shrank to {shrunk['to']} tokens"
            ctx.record(stage, outcomes.Admit.ADMITTED_CAP_SHRUNK, reason, t, evidence)
            return
        ctx.record(stage, _ADMITTED, "within every limit", t, evidence)

    @staticmethod
    def _billing(ctx: RequestContext, prompt: int) -> Billing:
        """The request's usage row should its process die holding the reservation."""
        i, p = ctx.input, ctx.principal
        tenant, key = (p.tenant_id, p.key_id) if p is not None else (None, None)
        return Billing(
            i.request_id, i.client_request_id, i.task_id, tenant, key, i.called, ctx.alias,
            i.received_at, prompt, ctx.stream,
        )  # fmt: skip

    async def extend(self, ctx: RequestContext) -> tuple[bool, dict[str, Any] | None]:
        """Hold one more upstream call's worth of what the request reserved, before a
        further call (a retry, a fallback, a failover) that follows one that may have
        been billed (execute/executor.py): for each stage that reserved, its first hold
        again (one prompt and the output cap of each sequence, at the price it was
        reserved at: its chain's dearest), in that stage's scopes, as a hold of its own
        (`{reservation}+{n}`) limited to what a call uses (`spend_scopes`: tpm and
        budget; the request is counted in rpm and holds its slot already). All or
        nothing: a stage that refuses gives back what the others took. Each hold joins
        `ctx.admission.reservations` as it is taken, so the request's release settles
        it (`settle`: at 0; the request's whole charge goes to its first hold) even if
        the request is cancelled meanwhile.

        Then, for a request of a task (`ctx.task`), the same in the task's budget
        (`_extend_task`): one more call's tokens and cost as the task admitted it,
        added to the request's hold there (its settle replaces the whole of it by what
        was used); a task that cannot hold it refuses the call, and what the limiter
        took is given back.

        (True, evidence) when held; (True, None) when there is nothing to hold (no
        reservation, no tpm or budget, no task budget) or the limiter is unreachable
        under fail_open; (False, evidence) when a scope or the task's budget has no
        room, or the limiter or the task state is unreachable under fail_closed."""
        held = ctx.admission.reservations
        firsts: dict[str, tuple[list[ScopeLimits], Ask]] = {}
        counts: dict[str, int] = {}
        for scopes, ask, stage in held:
            counts[stage] = counts.get(stage, 0) + 1
            firsts.setdefault(stage, (scopes, ask))
        made: list[tuple[list[ScopeLimits], Ask, str]] = []
        evidence: dict[str, Any] | None = None
        try:
            for stage, (scopes, ask) in firsts.items():
                spend = spend_scopes(scopes)
                if not spend or (ask.tokens <= 0 and ask.cost_usd <= 0.0):
                    continue
                more = Ask(
                    f"{ask.request_id}+{counts[stage]}", ask.tokens, ask.cost_usd, ask.billing
                )
                verdict = await self.limiter.reserve(spend, more)
                if not verdict.allowed:
                    await self._give_back(ctx, made)
                    return False, {
                        "reservation": "not extended",
                        "stage": stage,
                        "scope": verdict.scope,
                        "limit": verdict.limit,
                        "needed_tokens": more.tokens,
                        "needed_usd": more.cost_usd,
                        "scopes": verdict.state,
                    }
                entry = (spend, more, stage)
                held.append(entry)
                made.append(entry)
                if evidence is None:
                    evidence = {"reserved_tokens": more.tokens, "reserved_usd": more.cost_usd}
                evidence.setdefault("holds", []).append(more.request_id)
        except LimiterUnavailable as exc:
            if self.on_failure == "fail_open":
                self.counters["limiter_fail_open"] += 1
                log.warning("limiter unavailable, a further call goes ahead (fail_open): %s", exc)
                return True, None
            self.counters["limiter_fail_closed"] += 1
            await self._give_back(ctx, made)
            return False, {"reservation": "not extended", "limiter": f"unavailable: {exc}"}
        hold = ctx.task
        if hold is None or hold.store is None or (hold.tokens <= 0 and hold.cost_usd <= 0.0):
            return True, evidence
        ok, task = await self._extend_task(ctx, hold)
        if not ok:
            await self._give_back(ctx, made)
            assert task is not None
            return False, task
        if task is not None:
            if evidence is None:
                evidence = {"reserved_tokens": hold.tokens, "reserved_usd": hold.cost_usd}
            evidence["task"] = task
        return True, evidence

    async def _extend_task(
        self, ctx: RequestContext, hold: TaskHold
    ) -> tuple[bool, dict[str, Any] | None]:
        """`extend` in the request's task: (True, the task's evidence) when held, (True,
        None) when there is nothing to hold (the task's state or the request's hold
        there is gone) or the task state is unreachable under fail_open, (False, the
        refusal's evidence) when its budget has no room (naming it: `task` `tokens` or
        `cost_usd`) or the task state is unreachable under fail_closed."""
        assert hold.store is not None
        n = hold.extended + 1
        now = time.time()
        try:
            adm = await hold.store.extend(
                hold.key, hold.request_id, n, hold.tokens, hold.cost_usd, now
            )
        except LimiterUnavailable as exc:
            if self.on_failure == "fail_open":
                log.warning(
                    "task state unavailable, a further call goes ahead (fail_open): %s", exc
                )
                return True, None
            return False, {"reservation": "not extended", "task_state": f"unavailable: {exc}"}
        if adm is None:
            return True, None
        scope = f"task:{hold.key[1]}"
        if not adm.allowed:
            return False, {
                "reservation": "not extended",
                "stage": "task",
                "scope": scope,
                "limit": adm.refused,
                "needed_tokens": hold.tokens,
                "needed_usd": hold.cost_usd,
                "task": adm.evidence(now),
            }
        hold.extended = n
        return True, {
            "scope": scope,
            "reserved_tokens": hold.tokens,
            "reserved_usd": hold.cost_usd,
            "extensions": n,
            "used": adm.evidence(now)["used"],
            "remaining": adm.remaining(),
        }

    async def _give_back(
        self, ctx: RequestContext, made: list[tuple[list[ScopeLimits], Ask, str]]
    ) -> None:
        """Settle unused the holds `extend` took before a refusal; one the limiter
        cannot settle now stays with the request, whose release settles it."""
        for entry in made:
            try:
                await self.limiter.settle(entry[0], entry[1], 0, 0.0)
            except LimiterUnavailable:
                continue
            ctx.admission.reservations.remove(entry)

    def settle(self, ctx: RequestContext, stage: str) -> Awaitable[None] | None:
        """Settle what `stage` reserved for the request with what it was charged
        (`ctx.run`): the whole charge on its first hold, 0 on each one `extend` added
        (so the limiter keeps exactly what was charged, and every extension is given
        back); None when it reserved nothing."""
        run = ctx.run
        mine: list[Awaitable[None]] = []
        for scopes, ask, by in ctx.admission.reservations:
            if by != stage:
                continue
            if mine:  # a further call's hold (`extend`): the charge is on the first
                mine.append(self.limiter.settle(scopes, ask, 0, 0.0))
            else:
                mine.append(
                    self.limiter.settle(scopes, ask, run.tokens_in + run.tokens_out, run.cost_usd)
                )
        if not mine:
            return None
        return mine[0] if len(mine) == 1 else self._all(mine)

    @staticmethod
    async def _all(mine: Sequence[Awaitable[None]]) -> None:
        """Each, in order; one that fails keeps none of the others from settling."""
        error: Exception | None = None
        for pending in mine:
            try:
                await pending
            except Exception as exc:
                error = error or exc
        if error is not None:
            raise error

    async def _seed_budgets(self, scopes: list[ScopeLimits]) -> None:
        """Budgets survive restarts: the first time a scope is seen in a period, its
        spend so far is read back from the ledger (off the event loop)."""
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
                spent = await self._spent_since(column, ident, period_start(s.budget_period, now))
                seeded = self.limiter.seed_spent(s.scope, s.budget_period, spent, now)
                if inspect.isawaitable(seeded):
                    await seeded
            self._seeded.add(mark)


def minimal_answer(cost: Cost, min_output: int) -> int:
    """The smallest cap worth sending: `policy.min_output_tokens`, or the client's own
    cap when that is smaller."""
    return min(min_output, cost.asked) if cost.asked is not None else min_output


def _fit(cost: Cost, verdict: LimitVerdict, price: Price | None) -> int:
    """The largest cap that fits what every scope of a refused verdict has left."""
    tokens = [i["remaining_tokens"] for i in verdict.state.values() if "remaining_tokens" in i]
    usd = [i["budget_remaining_usd"] for i in verdict.state.values() if "budget_remaining_usd" in i]
    return cost.fit(min(tokens) if tokens else None, min(usd) if usd else None, price)


# A request's (prompt tokens, output tokens, price) for its reservation.
Estimate = Callable[[RequestContext], tuple[int, int, Price | None]]


def chain_price(models: Mapping[str, ModelConfig], alias: str) -> Price | None:
    """The price a request for `alias` is reserved at: the dearest, per input and per
    output token, of the model and its fallbacks, any of which may serve it and be
    billed (settle.py bills the one that did); None when none of them is priced."""
    model = models.get(alias)
    if model is None:
        return None
    prices = [
        m.price
        for m in (model, *(models.get(a) for a in model.fallbacks))
        if m is not None and m.price is not None
    ]
    if not prices:
        return None
    if len(prices) == 1:
        return prices[0]
    return Price(input=max(p.input for p in prices), output=max(p.output for p in prices))


def generation_estimate(
    models: Mapping[str, ModelConfig], routed: Mapping[str, Sequence[str]] | None = None
) -> Estimate:
    """(prompt tokens, output tokens, price) of a chat or completion request: its cost
    shape (ctx.cost, set by the window stage) at the price of its model's chain
    (`chain_price`: a fallback dearer than its primary is reserved for). A routed
    alias (`routed`: it -> its routes' models) is reserved before the route is taken,
    so at the dearest chain of any model a route may choose."""
    prices = {alias: chain_price(models, alias) for alias in models}
    for alias, targets in (routed or {}).items():
        chains = [p for t in targets if (p := chain_price(models, t)) is not None]
        if chains:
            prices[alias] = Price(
                input=max(p.input for p in chains), output=max(p.output for p in chains)
            )

    def estimate(ctx: RequestContext) -> tuple[int, int, Price | None]:
        cost = ctx.cost
        assert cost is not None  # the window stage runs first
        return cost.prompt, cost.output, prices.get(ctx.alias or "")

    return estimate


def embedding_estimate(price: Price, most: Callable[[], int | None]) -> Estimate:
    """(input tokens, 0, price) of an embeddings request, an upper bound of what it is
    billed: a tokenizer makes at most about one token a character (CJK text does; at
    ≈3 characters a token, Latin text would be reserved a third of it), plus the two
    it adds to each input, and no input more than the model reads (`most()`, once
    the model is loaded; its codec takes texts only)."""

    def estimate(ctx: RequestContext) -> tuple[int, int, Price | None]:
        req = ctx.request
        assert isinstance(req, Embedding)
        cut = most()
        if cut is None:
            tokens = sum(len(x) + 2 for x in req.texts)
        else:
            tokens = sum(min(len(x) + 2, cut) for x in req.texts)
        return tokens, 0, price

    return estimate


class Window(Stage):
    """The request's cost shape (policy/cost.py): its prompt, counted high for the
    reservations and low for this check, its sequences and the output cap it will be
    sent with. Refused with 400 `context_length_exceeded` only when the prompt's lower
    bound is past the model's effective context window, and with 400 naming `n` when
    it asks for more choices than the model's llama-server engines have slots
    (`choice_limit`: the engine would refuse it, naming nothing)."""

    name = "window"

    def __init__(
        self, settings: Settings, models: Mapping[str, ModelConfig], overhead: PromptOverhead
    ) -> None:
        self._windows = {a: effective_window(m) for a, m in models.items()}
        self._choices = {
            a: most for a, m in models.items() if (most := choice_limit(m, models)) is not None
        }
        self._default = settings.policy.default_max_tokens
        self._images = settings.policy.image_tokens
        self._overhead = overhead

    def work(self, ctx: RequestContext) -> None:
        t = time.perf_counter()
        alias = ctx.alias or ""
        wire = ctx.wire
        req = ctx.generation
        raw = wire[1] if wire is not None and wire[0] is req else None
        raw_len = len(raw) if raw is not None else None
        window = self._windows.get(alias)
        cost = plan(req, raw_len, alias, window, self._default, self._images, self._overhead)
        evidence = {
            "prompt_tokens": cost.prompt,
            "prompt_lower_bound": cost.lower,
            "window": window,
            "sequences": cost.sequences,
            "cap": cost.cap,
            "cap_asked": cost.asked,
        }
        if window is not None and cost.lower > window:
            ctx.record(
                self.name,
                outcomes.Window.REJECT_CONTEXT_LENGTH,
                f"the prompt has at least {cost.lower} tokens; the window is {window}",
                t,
                evidence,
            )
            raise ContextLengthExceeded(
                f"this model's maximum context length is {window} tokens; the prompt has at "
                f"least {cost.lower} tokens",
                param="messages" if req.messages is not None else "prompt",
            )
        most = self._choices.get(alias)
        if most is not None and req.n is not None and req.n > most:
            ctx.record(
                self.name,
                outcomes.reject(InvalidRequest.code),
                f"n is {req.n}; the model's engine makes at most {most} choices at once",
                t,
                {**evidence, "n": req.n, "most_choices": most},
            )
            raise InvalidRequest(
                f"this model makes at most {most} choices at once (one a slot of its "
                f"engine); 'n' is {req.n}",
                param="n",
            )
        ctx.cost = cost
        ctx.max_tokens = cost.cap
        ctx.record(
            self.name, _WINDOW_OK, f"output capped at {cost.cap} tokens per sequence", t, evidence
        )


class _Reserving(Stage):
    """A stage that reserves against limiter scopes through the shared Reserver."""

    def __init__(self, reserver: Reserver, estimate: Estimate) -> None:
        self._reserver = reserver
        self._estimate = estimate

    def _reserve(self, ctx: RequestContext, scopes: list[ScopeLimits]) -> Awaitable[None]:
        return self._reserver.reserve(ctx, scopes, self.name, self._estimate(ctx))

    def release(self, ctx: RequestContext) -> Awaitable[None] | None:
        """Settle this stage's reservations with what the request used."""
        if not ctx.admission.reservations:
            return None
        return self._reserver.settle(ctx, self.name)


class Admit(_Reserving):
    """The key's and the tenant's limits: rpm, tpm, concurrency, budget."""

    name = "admit"

    def __init__(self, reserver: Reserver, estimate: Estimate) -> None:
        super().__init__(reserver, estimate)
        # The scopes of each principal seen lately (a principal is immutable; the one
        # object is kept, so its id stays its own while cached).
        self._scopes: dict[int, tuple[Any, list[ScopeLimits]]] = {}

    def static(self, view: View) -> Verdict | None:
        return NO_LIMITS if not principal_scopes(view.principal) else None

    def work(self, ctx: RequestContext) -> Awaitable[None]:
        p = ctx.principal
        held = self._scopes.get(id(p))
        if held is None or held[0] is not p:
            if len(self._scopes) >= 4096:
                self._scopes.clear()
            held = self._scopes[id(p)] = (p, principal_scopes(p))
        return self._reserve(ctx, held[1])


class DeploymentLimits(_Reserving):
    """The deployment's own rpm and tpm (models[].limits)."""

    name = "deployment_limits"

    def static(self, view: View) -> Verdict | None:
        if view.model is None:  # selection refuses an unknown model before this
            return None
        return NO_LIMITS if not deployment_scope(view.model) else None

    def work(self, ctx: RequestContext) -> Awaitable[None]:
        assert ctx.model is not None
        return self._reserve(ctx, deployment_scope(ctx.model))
