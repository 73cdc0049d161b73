"""Policy stages: authorize, admit (key and tenant limits), PII masking, deployment
limits and the deployment's queue.

Each stage's `static` is the one place that says when it decides the same for every
request of a View (pipeline.View); `work` handles the rest (see pipeline.Stage).
"""

from __future__ import annotations

import inspect
import logging
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

from switchyard import outcomes
from switchyard.config import AdapterConfig, ModelConfig, Price, Settings
from switchyard.errors import (
    AdapterNotAllowed,
    ApprovalRequired,
    ContextLengthExceeded,
    InvalidHeader,
    InvalidRequest,
    LimiterDown,
    PiiDetected,
    PiiFailure,
    SwitchyardError,
    TaskBudgetExceeded,
    TaskCancelled,
    TaskDeadlineExceeded,
    TaskStateUnavailable,
)
from switchyard.pipeline import (
    CacheOutcome,
    PiiState,
    ReplyPart,
    RequestContext,
    Stage,
    Status,
    Verdict,
    View,
)
from switchyard.policy import headers as request_headers
from switchyard.policy.admission import (
    PRIORITIES,
    STANDARD,
    Admission,
    DeploymentGate,
    Priority,
    SlotAsk,
)
from switchyard.policy.admit import (
    cost_usd,
    deployment_scope,
    principal_scopes,
    rate_headers,
    refusal,
)
from switchyard.policy.auth import authorize_model
from switchyard.policy.cost import Cost, PromptOverhead, effective_window, plan
from switchyard.policy.limits import (
    Ask,
    Limiter,
    LimiterUnavailable,
    ScopeLimits,
    period_key,
    period_start,
)
from switchyard.policy.limits import Verdict as LimitVerdict
from switchyard.policy.pii import MaskingError, PiiMasker, mask_request
from switchyard.policy.pii_reply import PiiRestore, request_session
from switchyard.policy.tasks import (
    Running,
    TaskAdmission,
    TaskBudget,
    TaskFirst,
    TaskHold,
    TaskStore,
    ToolCallNote,
)
from switchyard.policy.tool_calls import (
    NeededApproval,
    ToolPolicy,
    ToolResult,
    approval_tokens,
    approvals_needed,
    new_results,
    tool_results,
)
from switchyard.request import Embedding

log = logging.getLogger("switchyard")

NO_LIMITS = Verdict(outcomes.Admit.SKIP, "no limits apply")
NO_WAIT = "waited 0.0 ms for a slot"
# The outcomes every admitted request records, bound once: reading an enum member
# through its class costs a metaclass lookup each time, on the request's path.
_ADMITTED = outcomes.Admit.ADMITTED
_WINDOW_OK = outcomes.Window.OK
_QUEUE_ADMITTED = outcomes.Queue.ADMITTED

# What was spent by a scope ("key_id" | "tenant_id", id) since a unix time: the ledger.
SpentSince = Callable[[str, str, float], Awaitable[float]]


class Authorize(Stage):
    """The key may use the model. `named` holds the models this pipeline serves, with
    the evidence recorded for each (built once, shared by every request)."""

    name = "authorize"
    UNKNOWN = Verdict(outcomes.Authorize.SKIP, "unknown model; selection will refuse it")

    def __init__(
        self,
        named: Mapping[str, dict[str, Any]],
        adapters: Mapping[str, AdapterConfig] | None = None,
    ) -> None:
        self._named = dict(named)
        self._adapters = dict(adapters or {})
        for name, a in self._adapters.items():
            self._named[name] = {"model": name, "adapter": name, "base": a.base}
        self._allowed = {
            a: Verdict(outcomes.Authorize.ALLOWED, "the key may use this model", e)
            for a, e in self._named.items()
        }

    def static(self, view: View) -> Verdict | None:
        allowed = self._allowed.get(view.alias or "")
        if allowed is None:
            # Unknown models are 404 for everyone; no need to reveal key scopes.
            return self.UNKNOWN
        if not view.principal.may_use(view.alias or ""):
            return None
        adapter = self._adapters.get(view.alias or "")
        if adapter is not None and view.principal.adapter_refusal(
            adapter.name, adapter.allowed_tenants
        ):
            return None
        return allowed

    def work(self, ctx: RequestContext) -> None:
        assert ctx.alias is not None
        t = time.perf_counter()
        authorize_model(ctx.principal, ctx.alias)  # raises: static let this through
        adapter = self._adapters.get(ctx.alias)
        if adapter is not None:
            why = ctx.principal.adapter_refusal(adapter.name, adapter.allowed_tenants)
            if why is not None:
                raise AdapterNotAllowed(why, param="model")
        ctx.record(
            self.name,
            outcomes.Authorize.ALLOWED,
            "the key may use this model",
            t,
            self._named[ctx.alias],
        )


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
    ) -> None:
        self.limiter = limiter
        self.on_failure = settings.policy.on_limiter_failure
        self.min_output = settings.policy.min_output_tokens
        self._spent_since = spent_since
        self.counters = counters
        self._seeded: set[tuple[str, str]] = set()

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
                ask = Ask(ask.request_id, cost.tokens, cost.usd(price))
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

    def settle(self, ctx: RequestContext, stage: str) -> Awaitable[None] | None:
        """Settle what `stage` reserved for the request with what it was charged
        (`ctx.run`); None when it reserved nothing."""
        run = ctx.run
        tokens = run.tokens_in + run.tokens_out
        mine = [
            self.limiter.settle(scopes, ask, tokens, run.cost_usd)
            for scopes, ask, by in ctx.admission.reservations
            if by == stage
        ]
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


def generation_estimate(models: Mapping[str, ModelConfig]) -> Estimate:
    """(prompt tokens, output tokens, price) of a chat or completion request: its cost
    shape (ctx.cost, set by the window stage) at the model's price."""

    def estimate(ctx: RequestContext) -> tuple[int, int, Price | None]:
        model = models.get(ctx.alias or "")
        cost = ctx.cost
        assert cost is not None  # the window stage runs first
        return cost.prompt, cost.output, model.price if model is not None else None

    return estimate


def embedding_estimate(price: Price) -> Estimate:
    """(input tokens, 0, price) of an embeddings request, leaning high as the chat
    estimate does: ≈3 characters per token of text (its codec takes texts only)."""

    def estimate(ctx: RequestContext) -> tuple[int, int, Price | None]:
        req = ctx.request
        assert isinstance(req, Embedding)
        tokens = sum(len(x) // 3 + 1 for x in req.texts)
        return tokens, 0, price

    return estimate


class Window(Stage):
    """The request's cost shape (policy/cost.py): its prompt, counted high for the
    reservations and low for this check, its sequences and the output cap it will be
    sent with. Refused with 400 `context_length_exceeded` only when the prompt's lower
    bound is past the model's effective context window."""

    name = "window"

    def __init__(
        self, settings: Settings, models: Mapping[str, ModelConfig], overhead: PromptOverhead
    ) -> None:
        self._windows = {a: effective_window(m) for a, m in models.items()}
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


class Queue(Stage):
    """A slot at the deployment's gate (models[].limits.max_concurrency and queue), in
    the order `scheduling.policy` sets (policy/admission.py). Most requests find a free
    slot: that path decides without a coroutine. The request's class is its principal's
    (the lower of its tenant's and its key's), or lower when `x-switchyard-priority` asks
    for it (a request never raises its own)."""

    name = "queue"
    CLASSES = tuple(Priority)

    def __init__(self, gates: Mapping[str, DeploymentGate]) -> None:
        self._gates = gates
        # request id -> (when its slot was granted, its ask): what the gate learns from
        self._held: dict[str, tuple[float, SlotAsk]] = {}

    def _ask(self, ctx: RequestContext) -> SlotAsk:
        raw = ctx.input.headers.get("x-switchyard-priority")
        given = ctx.principal.priority
        priority = self.CLASSES[given] if 0 <= given < len(self.CLASSES) else Priority.STANDARD
        if raw is not None:
            asked = PRIORITIES.get(raw.strip().lower())
            if asked is None:
                raise InvalidHeader(
                    "header x-switchyard-priority: one of interactive, standard, batch",
                    param="x-switchyard-priority",
                )
            priority = max(priority, asked)  # lower only: a larger value is a lower class
        hold = ctx.task
        if hold is None:
            return STANDARD if priority is Priority.STANDARD else SlotAsk(priority)
        return SlotAsk(priority, hold.key, hold.call, hold.planned)

    def work(self, ctx: RequestContext) -> Awaitable[None] | None:
        assert ctx.model is not None
        t = time.perf_counter()
        gate = self._gates[ctx.model.alias]
        try:
            ask = self._ask(ctx)
        except InvalidRequest as exc:
            ctx.record("queue", outcomes.Queue.REJECT_INVALID_HEADER, exc.message, t)
            raise
        adm = gate.try_acquire(ask, ctx.deadline)
        if adm is None:
            return self._wait_for_slot(ctx, gate, ask, t)
        self._admitted(ctx, gate, adm, ask, t)
        return None

    async def _wait_for_slot(
        self, ctx: RequestContext, gate: DeploymentGate, ask: SlotAsk, t: float
    ) -> None:
        try:
            adm = await gate.acquire(ctx.deadline, ask)
        except Exception as exc:
            evidence = {"in_flight": gate.in_flight, "queued": gate.queued}
            more = getattr(exc, "evidence", None)
            if isinstance(more, dict):
                evidence |= more
            code = exc.code if isinstance(exc, SwitchyardError) else "error"
            ctx.record("queue", outcomes.reject(code), str(exc), t, evidence)
            raise
        self._admitted(ctx, gate, adm, ask, t)

    def release(self, ctx: RequestContext) -> None:
        """Give the slot back; the gate learns the service time of an answered request."""
        gate = ctx.admission.gate
        if gate is None:  # kept on the request: its record names what it held
            return
        held = self._held.pop(ctx.input.request_id, None)
        run = ctx.run
        if held is not None and ctx.status == Status.OK and run.attempts > 0:
            gate.release(time.perf_counter() - held[0], run.tokens_out, held[1])
        else:
            gate.release()

    def _admitted(
        self, ctx: RequestContext, gate: DeploymentGate, adm: Admission, ask: SlotAsk, t: float
    ) -> None:
        ctx.admission.gate = gate
        ctx.admission.queue_ms = adm.waited_s * 1000
        ctx.admission.priority = ask.priority
        if gate.max_concurrency is not None:  # a model that can queue learns its service
            self._held[ctx.input.request_id] = (time.perf_counter(), ask)
        waited = adm.waited_s != 0
        evidence: dict[str, Any] = {
            "in_flight": adm.in_flight,
            "queued": adm.queued,
            "max_concurrency": gate.max_concurrency,
        }
        if adm.evidence is not None:
            evidence |= adm.evidence
        elif gate.task_aware:
            evidence["class"] = ask.priority.name.lower()
        ctx.record(
            "queue",
            outcomes.Queue.WAITED if waited else _QUEUE_ADMITTED,
            f"waited {adm.waited_s * 1000:.1f} ms for a slot" if waited else NO_WAIT,
            t,
            evidence,
        )


class Pii(Stage):
    """Mask PII once; the masked text is what cache keys, embeddings and traces see.
    On the way out, restore the request's own values wherever the reply carries
    placeholders (policy/pii_reply.py)."""

    name = "pii"
    NOTHING_STORED = Verdict(
        outcomes.Pii.SKIP, "observe_only and no cache or router: no text is stored"
    )

    def __init__(self, settings: Settings, masker: PiiMasker, cache_on: bool) -> None:
        self._mode = settings.pii.mode
        self._modes = dict(settings.pii.models)
        # Masked text feeds only the cache and the router; with neither, nothing here
        # stores or forwards request text, so there is nothing to mask.
        self._text_kept = cache_on or settings.router.enabled
        self._masker = masker
        # Aliases whose placement keeps PII on the device: found PII is needed there.
        self._placed = {
            m.alias
            for m in settings.models
            if m.placement is not None and m.placement.pii_stays_local
        }

    def static(self, view: View) -> Verdict | None:
        mode = self._modes.get(view.alias or "", self._mode)
        if mode == "observe_only" and not self._text_kept and view.alias not in self._placed:
            return self.NOTHING_STORED
        return None

    def work(self, ctx: RequestContext) -> None:
        t = time.perf_counter()
        mode = self._modes.get(ctx.alias or "", self._mode)
        session = self._masker.session()
        try:
            masked = mask_request(session, ctx.generation)
        except MaskingError as exc:
            ctx.record(
                "pii",
                outcomes.Pii.REJECT_MASKING_FAILED,
                f"masking failed: {type(exc).__name__}",
                t,
            )
            raise PiiFailure("PII masking failed; the request was refused (fail closed)") from None
        found = dict(session.found)
        evidence = {"mode": mode, "found": found}
        if found and mode == "block":
            ctx.record(
                "pii",
                outcomes.Pii.REJECT_PII_DETECTED,
                f"request contains {sorted(found)}",
                t,
                evidence,
            )
            raise PiiDetected(
                f"the request contains personal data ({', '.join(sorted(found))}) and this "
                "model does not accept it"
            )
        restore = bool(found) and mode == "mask_upstream"
        ctx.pii = PiiState(session, masked, restore, found)
        if restore:
            ctx.request = masked  # the upstream sees placeholders; the reply is restored
        outcome = (
            (outcomes.Pii.MASKED if mode == "mask_upstream" else outcomes.Pii.OBSERVED)
            if found
            else outcomes.Pii.CLEAN
        )
        ctx.record("pii", outcome, f"{sum(found.values())} PII value(s) found", t, evidence)

    def reply(self, ctx: RequestContext) -> ReplyPart | None:
        """Restoring, when the reply can carry this request's placeholders: the
        upstream saw them (mask_upstream), or the reply was stored masked (a cache hit,
        an idempotent replay)."""
        pii = ctx.pii
        if pii is not None:
            return PiiRestore(pii.session) if pii.restore or ctx.response is not None else None
        if ctx.cache is CacheOutcome.REPLAY:
            return PiiRestore(request_session(self._masker, ctx), only_marked=True)
        return None


class Task(Stage):
    """The request's agent task (`x-task-id`): refused once the task is cancelled or
    past its deadline, or when its estimate does not fit what the task's budget has
    left; otherwise reserved against that budget, its deadline cut to the task's, and
    counted among the task's calls in flight (so a cancel can stop it)."""

    name = "task"
    NO_TASK = Verdict(outcomes.Task.SKIP, "no x-task-id")

    def __init__(
        self, settings: Settings, store: TaskStore, running: Running, estimate: Estimate
    ) -> None:
        self._default = TaskBudget.of(settings.tasks.budget)
        self._fail_open = settings.policy.on_limiter_failure == "fail_open"
        self._min_output = settings.policy.min_output_tokens
        self._asked: dict[str, TaskBudget] = {}  # x-task-budget values, parsed
        self._store = store
        self._running = running
        self._estimate = estimate

    def static(self, view: View) -> Verdict | None:
        return None if view.in_task else self.NO_TASK

    def work(self, ctx: RequestContext) -> Awaitable[None]:
        return self._admit(ctx)

    def release(self, ctx: RequestContext) -> Awaitable[None] | None:
        """No longer among the task's calls in flight; the task is charged what the
        request used (and keeps the reply's tool calls)."""
        hold = ctx.task
        if hold is None:
            return None
        self._running.remove(hold.key, hold.request_id)
        return self._settle(ctx, hold)

    async def _settle(self, ctx: RequestContext, hold: TaskHold) -> None:
        run = ctx.run
        try:
            if ctx.tool_notes:
                await self._store.note_tool_calls(hold.key, ctx.tool_notes)
            called = run.attempts > 0 or ctx.cache is not None
            await self._store.settle(
                hold.key, hold.request_id, run.tokens_in + run.tokens_out, run.cost_usd, called
            )
        except Exception as exc:  # shared task state unreachable: logged, not lost
            log.warning("could not settle task of %s: %s", ctx.input.request_id, exc)

    def _first(self, ctx: RequestContext) -> TaskFirst:
        """What this request would set if it were the task's first (its headers are
        validated whether or not they take effect)."""
        h = ctx.input.headers
        budget = self._default
        p = ctx.principal
        if p is not None and p.task_budget is not None:
            budget = budget.lower(p.task_budget)
        raw = h.get("x-task-budget")
        if raw is not None:
            asked = self._asked.get(raw)
            if asked is None:  # agents send the same few values: parsed once each
                asked = TaskBudget.of(request_headers.task_budget(raw))
                if len(self._asked) >= 1024:
                    self._asked.clear()
                self._asked[raw] = asked
            budget = budget.lower(asked)
        timeout = h.get("x-task-timeout")
        deadline = h.get("x-task-deadline")
        return TaskFirst(
            budget,
            request_headers.task_timeout(timeout) if timeout is not None else None,
            request_headers.task_deadline(deadline) if deadline is not None else None,
        )

    async def _admit(self, ctx: RequestContext) -> None:
        t = time.perf_counter()
        task_id = ctx.input.task_id
        assert task_id is not None
        try:
            first = self._first(ctx)
        except InvalidRequest as exc:
            ctx.record(self.name, outcomes.Task.REJECT_INVALID_HEADER, exc.message, t)
            raise
        key = (ctx.principal.tenant_id, task_id)
        prompt, out, price = self._estimate(ctx)
        cost = cost_usd(price, prompt, out) if price else 0.0
        now = time.time()
        rid = ctx.input.request_id
        shrunk: dict[str, Any] | None = None
        try:
            adm = await self._store.admit(key, first, rid, prompt + out, cost, now)
            shape = ctx.cost
            # Less left in the task's budget than the cap: the cap shrinks to what fits.
            for _ in range(3):
                if adm.refused not in ("tokens", "cost_usd") or shape is None:
                    break
                left = adm.remaining()
                cap = shape.fit(left.get("tokens"), left.get("cost_usd"), price)
                if cap < minimal_answer(shape, self._min_output):
                    break
                if shrunk is None:
                    shrunk = {"from": shape.cap}
                shrunk.update({"to": cap, "by": f"task:{adm.refused}"})
                shape.shrink(cap, "task")
                ctx.max_tokens = shape.cap
                cost = shape.usd(price)
                adm = await self._store.admit(key, first, rid, shape.tokens, cost, now)
        except LimiterUnavailable as exc:
            if self._fail_open:
                log.warning("task state unavailable, admitting (fail_open): %s", exc)
                ctx.record(self.name, outcomes.Task.FAIL_OPEN, f"task state unavailable: {exc}", t)
                return
            ctx.record(
                self.name, outcomes.Task.REJECT_UNAVAILABLE, f"task state unavailable: {exc}", t
            )
            raise TaskStateUnavailable("task state unavailable; refusing (fail_closed)") from None
        evidence = adm.evidence(now)
        refused = adm.refused
        if refused is not None:
            ctx.record(
                self.name, outcomes.reject(refused), task_refusal_reason(refused), t, evidence
            )
            raise task_error(task_id, refused, adm)
        ctx.task = TaskHold(key, rid, int(adm.used["calls"]), ctx.input.planned_steps)
        if shrunk is not None:
            evidence["cap_shrunk"] = shrunk
        if adm.deployments:
            ctx.task_deployments = adm.deployments
        self._running.add(key, ctx)
        if adm.deadline_at is not None:
            cut = ctx.timings.received + (adm.deadline_at - ctx.input.received_at)
            if cut < ctx.deadline:
                ctx.deadline = cut
                evidence["deadline_cut"] = True
        ctx.record(
            self.name, outcomes.Task.ADMITTED, "within the task's budget and deadline", t, evidence
        )


def task_refusal_reason(refused: str) -> str:
    """A task's refusal in a decision's words (model and tool calls alike)."""
    if refused == "cancelled":
        return "the task was cancelled"
    if refused == "deadline":
        return "the task's deadline has passed"
    return f"the task's {refused} budget is spent"


def task_error(task_id: str, refused: str, adm: TaskAdmission) -> SwitchyardError:
    """The client's error for a task's refusal (model and tool calls alike)."""
    if refused == "cancelled":
        return TaskCancelled(f"the task '{task_id}' was cancelled; it takes no more calls")
    if refused == "deadline":
        return TaskDeadlineExceeded(
            f"the deadline of the task '{task_id}' has passed; the call was not sent upstream"
        )
    left = adm.remaining()
    if refused == "wall_s":
        what = f"its wall time of {adm.budget['wall_s']:g}s has passed"
    else:
        what = (
            f"its {refused} budget of {adm.budget[refused]:g} has {left.get(refused, 0.0):g} "
            "left, less than this call needs"
        )
    return TaskBudgetExceeded(
        f"task budget exceeded for the task '{task_id}': {what}",
        param=refused,
    )


# ApprovalStore.consume off the event loop: (token, tenant, task, call id, request id).
ConsumeApproval = Callable[
    [str, str, "str | None", str, str], Awaitable[tuple["str | None", "str | None"]]
]
# ApprovalStore.consumed off the event loop: (tenant, task, call ids) → those approved.
ConsumedApprovals = Callable[[str, "str | None", list[str]], Awaitable[set[str]]]


async def _none_consumed(*_: Any) -> set[str]:
    """Without an approval store nothing was approved: every result needs one now."""
    return set()


class ToolResults(Stage):
    """Every tool result a chat request carries (policy/tool_calls): each needs an
    approval when its call does (an earlier approval of the same call still holds);
    in a task, those brought for the first time are counted, and one whose call
    already had a result is a duplicate side effect."""

    name = "tool_results"
    NONE = Verdict(outcomes.ToolResults.SKIP, "no tool results to check")

    def __init__(
        self,
        policy: ToolPolicy,
        store: TaskStore,
        consume: ConsumeApproval,
        consumed: ConsumedApprovals | None = None,
    ) -> None:
        self._policy = policy
        self._store = store
        self._consume = consume
        self._consumed = consumed or _none_consumed

    def static(self, view: View) -> Verdict | None:
        if view.endpoint != "chat.completions":
            return self.NONE
        if not view.in_task and not self._policy.approvals:
            return self.NONE
        return None

    def work(self, ctx: RequestContext) -> Awaitable[None] | None:
        t = time.perf_counter()
        try:
            results = tool_results(ctx.generation.messages)
        except InvalidRequest as exc:
            ctx.record(self.name, outcomes.reject(exc.code), exc.message, t)
            raise
        if not results:
            ctx.record(self.name, outcomes.ToolResults.SKIP, "no tool results", t)
            return None
        return self._check(ctx, results, t)

    async def _check(self, ctx: RequestContext, results: list[ToolResult], t: float) -> None:
        task = ctx.input.task_id
        key = (ctx.principal.tenant_id, task) if task is not None else None
        notes: dict[str, ToolCallNote] = {}
        if key is not None:  # the gateway's own record of the task's calls
            for cid in dict.fromkeys(r.call_id for r in results if r.call_id is not None):
                note = await self._store.tool_call(key, cid)
                if note is not None:
                    notes[cid] = note
        counts = {cid: n.results for cid, n in notes.items()}  # before this request's
        needed = approvals_needed(results, self._policy, {c: n.tool for c, n in notes.items()})
        approved, reused = await self._approve(ctx, needed, t) if needed else ([], [])
        ids = new_results(results, counts)
        noted = await self._store.note_results(key, ids) if key is not None and ids else {}
        duplicates = [
            {"call_id": cid, "tool": n.tool, "class": n.tool_class, "results": n.results}
            for cid, n in noted.items()
            if n.results > 1
        ]
        evidence: dict[str, Any] = {
            "results": len(ids),
            "checked": len(results),
            "known": len(noted),
            "approved": approved,
        }
        if reused:
            evidence["approved_before"] = reused
        if duplicates:
            evidence["duplicates"] = duplicates
            ctx.record(
                self.name,
                outcomes.tagged(outcomes.Kind.DUPLICATE, len(duplicates)),
                f"{len(duplicates)} tool result(s) for calls that already had one: "
                "a side effect may have run twice",
                t,
                evidence,
            )
            return
        ctx.record(
            self.name, outcomes.ToolResults.OK, f"{len(ids)} new tool result(s)", t, evidence
        )

    async def _approve(
        self, ctx: RequestContext, needed: list[NeededApproval], t: float
    ) -> tuple[list[dict[str, Any]], list[str]]:
        """(approvals consumed now, call ids an earlier approval covers), or raise
        ApprovalRequired for the first result that has neither."""
        tenant = ctx.principal.tenant_id
        task = ctx.input.task_id
        reusable = [n.approval_id for n in needed if n.reusable]
        before = await self._consumed(tenant, task, reusable) if reusable else set()
        reused = [n.approval_id for n in needed if n.reusable and n.approval_id in before]
        pending = [n for n in needed if not (n.reusable and n.approval_id in before)]
        approved: list[dict[str, Any]] = []
        if not pending:
            return approved, reused
        try:
            tokens = approval_tokens(ctx.input.headers.get("x-switchyard-approval"))
        except InvalidRequest as exc:
            ctx.record(self.name, outcomes.ToolResults.REJECT_INVALID_HEADER, exc.message, t)
            raise
        for n in pending:
            approver, why = None, "no approval was presented"
            for token in tokens:
                approver, why_not = await self._consume(
                    token, tenant, task, n.approval_id, ctx.input.request_id
                )
                if approver is not None:
                    tokens.remove(token)
                    break
                why = why_not or why
            if approver is None:
                ctx.record(
                    self.name,
                    outcomes.ToolResults.REJECT_APPROVAL_REQUIRED,
                    f"the result of {n.approval_id} ({n.tool}) needs an approval: {why}",
                    t,
                    {"call_id": n.approval_id, "tool": n.tool, "approved": approved},
                )
                raise ApprovalRequired(
                    f"the result of the tool call '{n.approval_id}' ({n.tool}) needs an "
                    f"approval (x-switchyard-approval): {why}",
                    param="x-switchyard-approval",
                )
            approved.append({"call_id": n.approval_id, "tool": n.tool, "approver": approver})
        return approved, reused
