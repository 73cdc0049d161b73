"""Policy stages: authorize, admit (key and tenant limits), PII masking, deployment
limits and the deployment's queue.

Each stage's `static` is the one place that says when it decides the same for every
request of a View (pipeline.View); `work` handles the rest (see pipeline.Stage).
"""

from __future__ import annotations

import inspect
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from switchyard.config import AdapterConfig, ModelConfig, Price, Settings
from switchyard.errors import (
    AdapterNotAllowed,
    ApprovalRequired,
    EngineNotReady,
    InvalidRequest,
    SwitchyardError,
    TaskBudgetExceeded,
    TaskCancelled,
    TaskDeadlineExceeded,
)
from switchyard.pipeline import PiiState, RequestContext, Stage, Verdict, View
from switchyard.policy import headers as request_headers
from switchyard.policy.admission import Admission, DeploymentGate
from switchyard.policy.admit import (
    PromptOverhead,
    cost_usd,
    deployment_scope,
    estimate_prompt_tokens,
    max_output_tokens,
    principal_scopes,
    rate_headers,
    refusal,
)
from switchyard.policy.auth import authorize_model
from switchyard.policy.limits import (
    Ask,
    Limiter,
    LimiterUnavailable,
    ScopeLimits,
    period_key,
    period_start,
)
from switchyard.policy.pii import MaskingError, PiiMasker, mask_body
from switchyard.policy.tasks import (
    Running,
    TaskAdmission,
    TaskBudget,
    TaskFirst,
    TaskHold,
    TaskStore,
)
from switchyard.policy.tool_calls import (
    APPROVAL_CALL_PREFIX,
    ToolPolicy,
    approval_tokens,
    called_tool,
    new_results,
)

log = logging.getLogger("switchyard")

NO_LIMITS = Verdict("skip", "no limits apply")
NO_WAIT = "waited 0.0 ms for a slot"

# What was spent by a scope ("key_id" | "tenant_id", id) since a unix time: the ledger.
SpentSince = Callable[[str, str, float], Awaitable[float]]


class PiiFailure(SwitchyardError):
    status = 500
    type = "server_error"
    code = "pii_masking_failed"


class Authorize(Stage):
    """The key may use the model. `named` holds the models this pipeline serves, with
    the evidence recorded for each (built once, shared by every request)."""

    name = "authorize"
    UNKNOWN = Verdict("skip", "unknown model; selection will refuse it")

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
            a: Verdict("allowed", "the key may use this model", e) for a, e in self._named.items()
        }

    def static(self, view: View) -> Verdict | None:
        allowed = self._allowed.get(view.alias or "")
        if allowed is None:
            # Unknown models are 404 for everyone; no need to reveal key scopes.
            return self.UNKNOWN
        if not view.principal.may_use(view.alias):
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
        ctx.record(self.name, "allowed", "the key may use this model", t, self._named[ctx.alias])


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
        self._spent_since = spent_since
        self.counters = counters
        self._seeded: set[tuple[str, str]] = set()

    async def reserve(
        self,
        ctx: RequestContext,
        scopes: list[ScopeLimits],
        stage: str,
        estimate: tuple[int, int, Price | None],
    ) -> None:
        t = time.perf_counter()
        prompt, out, price = estimate
        ctx.prompt_estimate = prompt
        ctx.max_tokens = out
        ask = Ask(
            f"{ctx.input.request_id}#{stage}",  # one reservation per request and stage
            prompt + out,
            cost_usd(price, prompt, out) if price else 0.0,
        )
        try:
            await self._seed_budgets(scopes)
            verdict = await self.limiter.reserve(scopes, ask)
        except LimiterUnavailable as exc:
            if self.on_failure == "fail_open":
                self.counters["limiter_fail_open"] += 1
                log.warning("limiter unavailable, admitting (fail_open): %s", exc)
                ctx.record(stage, "admit:fail_open", f"limiter unavailable: {exc}", t)
                return
            self.counters["limiter_fail_closed"] += 1
            ctx.record(stage, "reject:limiter_unavailable", f"limiter unavailable: {exc}", t)
            raise EngineNotReady(
                "rate limiter unavailable; refusing (fail_closed)", code="limiter_unavailable"
            ) from None
        ctx.admission.rate_headers.update(rate_headers(verdict))
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
        ctx.admission.reservations.append((scopes, ask))
        ctx.record(stage, "admitted", "within every limit", t, evidence)

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


# A request's (prompt tokens, output tokens, price) for its reservation.
Estimate = Callable[[RequestContext], tuple[int, int, Price | None]]


def generation_estimate(
    models: Mapping[str, ModelConfig], default_max_tokens: int, overhead: PromptOverhead
) -> Estimate:
    """(prompt tokens, output tokens, price) of a chat or completion request; the
    prompt includes the model's learned overhead (its template)."""

    def estimate(ctx: RequestContext) -> tuple[int, int, Price | None]:
        model = models.get(ctx.alias or "")
        return (
            estimate_prompt_tokens(ctx.body) + overhead.get(ctx.alias or ""),
            max_output_tokens(ctx.body, default_max_tokens),
            model.price if model is not None else None,
        )

    return estimate


class _Reserving(Stage):
    """A stage that reserves against limiter scopes through the shared Reserver."""

    def __init__(self, reserver: Reserver, estimate: Estimate) -> None:
        self._reserver = reserver
        self._estimate = estimate

    def _reserve(self, ctx: RequestContext, scopes: list[ScopeLimits]) -> Awaitable[None]:
        return self._reserver.reserve(ctx, scopes, self.name, self._estimate(ctx))


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
    """A slot at the deployment's gate (models[].limits.max_concurrency and queue).
    Most requests find a free slot: that path decides without a coroutine."""

    name = "queue"

    def __init__(self, gates: Mapping[str, DeploymentGate]) -> None:
        self._gates = gates

    def work(self, ctx: RequestContext) -> Awaitable[None] | None:
        assert ctx.model is not None
        t = time.perf_counter()
        gate = self._gates[ctx.model.alias]
        adm = gate.try_acquire()
        if adm is None:
            return self._wait_for_slot(ctx, gate, t)
        self._admitted(ctx, gate, adm, t)
        return None

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
        ctx.admission.gate = gate
        ctx.admission.queue_ms = adm.waited_s * 1000
        waited = adm.waited_s != 0
        ctx.record(
            "queue",
            "waited" if waited else "admitted",
            f"waited {adm.waited_s * 1000:.1f} ms for a slot" if waited else NO_WAIT,
            t,
            {
                "in_flight": adm.in_flight,
                "queued": adm.queued,
                "max_concurrency": gate.max_concurrency,
            },
        )


class Pii(Stage):
    """Mask PII once; the masked text is what cache keys, embeddings and traces see."""

    name = "pii"
    NOTHING_STORED = Verdict("skip", "observe_only and no cache or router: no text is stored")

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
        restore = bool(found) and mode == "mask_upstream"
        ctx.pii = PiiState(session, masked, restore, found)
        if restore:
            ctx.body = masked  # the upstream sees placeholders; the reply is restored
        outcome = ("masked" if mode == "mask_upstream" else "observed") if found else "clean"
        ctx.record("pii", outcome, f"{sum(found.values())} PII value(s) found", t, evidence)


class Task(Stage):
    """The request's agent task (`x-task-id`): refused once the task is cancelled or
    past its deadline, or when its estimate does not fit what the task's budget has
    left; otherwise reserved against that budget, its deadline cut to the task's, and
    counted among the task's calls in flight (so a cancel can stop it)."""

    name = "task"
    NO_TASK = Verdict("skip", "no x-task-id")

    def __init__(
        self, settings: Settings, store: TaskStore, running: Running, estimate: Estimate
    ) -> None:
        self._default = TaskBudget.of(settings.tasks.budget)
        self._fail_open = settings.policy.on_limiter_failure == "fail_open"
        self._asked: dict[str, TaskBudget] = {}  # x-task-budget values, parsed
        self._store = store
        self._running = running
        self._estimate = estimate

    def static(self, view: View) -> Verdict | None:
        return None if view.in_task else self.NO_TASK

    def work(self, ctx: RequestContext) -> Awaitable[None]:
        return self._admit(ctx)

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
            ctx.record(self.name, "reject:invalid_header", exc.message, t)
            raise
        key = (ctx.principal.tenant_id, task_id)
        prompt, out, price = self._estimate(ctx)
        cost = cost_usd(price, prompt, out) if price else 0.0
        now = time.time()
        rid = ctx.input.request_id
        try:
            adm = await self._store.admit(key, first, rid, prompt + out, cost, now)
        except LimiterUnavailable as exc:
            if self._fail_open:
                log.warning("task state unavailable, admitting (fail_open): %s", exc)
                ctx.record(self.name, "admit:fail_open", f"task state unavailable: {exc}", t)
                return
            ctx.record(self.name, "reject:unavailable", f"task state unavailable: {exc}", t)
            raise EngineNotReady(
                "task state unavailable; refusing (fail_closed)", code="task_state_unavailable"
            ) from None
        evidence = adm.evidence(now)
        refused = adm.refused
        if refused is not None:
            ctx.record(self.name, f"reject:{refused}", _task_refusal_reason(refused), t, evidence)
            raise _task_error(task_id, refused, adm)
        ctx.task = TaskHold(key, rid)
        if adm.deployments:
            ctx.task_deployments = adm.deployments
        self._running.add(key, ctx)
        if adm.deadline_at is not None:
            cut = ctx.timings.received + (adm.deadline_at - ctx.input.received_at)
            if cut < ctx.deadline:
                ctx.deadline = cut
                evidence["deadline_cut"] = True
        ctx.record(self.name, "admitted", "within the task's budget and deadline", t, evidence)


def _task_refusal_reason(refused: str) -> str:
    if refused == "cancelled":
        return "the task was cancelled"
    if refused == "deadline":
        return "the task's deadline has passed"
    return f"the task's {refused} budget is spent"


def _task_error(task_id: str, refused: str, adm: TaskAdmission) -> SwitchyardError:
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


class ToolResults(Stage):
    """The tool results a chat request brings for the first time (policy/tool_calls):
    each needs an approval when its tool `requires_approval`; in a task, each is
    counted, and one whose call already had a result is a duplicate side effect."""

    name = "tool_results"
    NONE = Verdict("skip", "no tool results to check")

    def __init__(self, policy: ToolPolicy, store: TaskStore, consume: ConsumeApproval) -> None:
        self._policy = policy
        self._store = store
        self._consume = consume

    def static(self, view: View) -> Verdict | None:
        if view.endpoint != "chat.completions":
            return self.NONE
        if not view.in_task and not self._policy.approvals:
            return self.NONE
        return None

    def work(self, ctx: RequestContext) -> Awaitable[None] | None:
        ids = new_results(ctx.body)
        if not ids:
            ctx.record(self.name, "skip", "no new tool results", time.perf_counter())
            return None
        return self._check(ctx, ids[:256])

    async def _check(self, ctx: RequestContext, ids: list[str]) -> None:
        t = time.perf_counter()
        tenant = ctx.principal.tenant_id
        task = ctx.input.task_id
        key = (tenant, task) if task is not None else None
        need: list[tuple[str, str]] = []
        for cid in ids:
            note = await self._store.tool_call(key, cid) if key is not None else None
            tool = note.tool if note is not None else called_tool(ctx.body, cid)
            if cid.startswith(APPROVAL_CALL_PREFIX) or (
                tool is not None and self._policy.requires_approval(tool)
            ):
                need.append((cid, tool or "a tool that requires approval"))
        approved: list[dict[str, Any]] = []
        if need:
            try:
                tokens = approval_tokens(ctx.input.headers.get("x-switchyard-approval"))
            except InvalidRequest as exc:
                ctx.record(self.name, "reject:invalid_header", exc.message, t)
                raise
            for cid, tool in need:
                approver, why = None, "no approval was presented"
                for token in tokens:
                    approver, why_not = await self._consume(
                        token, tenant, task, cid, ctx.input.request_id
                    )
                    if approver is not None:
                        tokens.remove(token)
                        break
                    why = why_not or why
                if approver is None:
                    ctx.record(
                        self.name,
                        "reject:approval_required",
                        f"the result of {cid} ({tool}) needs an approval: {why}",
                        t,
                        {"call_id": cid, "tool": tool, "approved": approved},
                    )
                    raise ApprovalRequired(
                        f"the result of the tool call '{cid}' ({tool}) needs an approval "
                        f"(x-switchyard-approval): {why}",
                        param="x-switchyard-approval",
                    )
                approved.append({"call_id": cid, "tool": tool, "approver": approver})
        notes = await self._store.note_results(key, ids) if key is not None else {}
        duplicates = [
            {"call_id": cid, "tool": n.tool, "class": n.tool_class, "results": n.results}
            for cid, n in notes.items()
            if n.results > 1
        ]
        evidence = {"results": len(ids), "known": len(notes), "approved": approved}
        if duplicates:
            evidence["duplicates"] = duplicates
            ctx.record(
                self.name,
                f"duplicate:{len(duplicates)}",
                f"{len(duplicates)} tool result(s) for calls that already had one: "
                "a side effect may have run twice",
                t,
                evidence,
            )
            return
        ctx.record(self.name, "ok", f"{len(ids)} new tool result(s)", t, evidence)
