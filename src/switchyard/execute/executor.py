"""Execution: attempts, retries inside the deadline, breakers and fallbacks.

For the selected deployment and then each fallback in order, the executor checks
compatibility, readiness and the circuit breaker, then makes attempts: an attempt is
only started if it can finish inside the remaining deadline (minus the reserve kept
for fallbacks); retryable failures wait a jittered backoff (never past the deadline)
and spend from the deployment's retry budget; final errors (4xx) are returned at
once, with the upstream's meaning. Every attempt, wait and skip is a `Decision`.
Streams are retried only until the upstream's headers arrive: once the first byte
is on its way to the client, nothing is repeated.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable, Coroutine, Mapping
from typing import TYPE_CHECKING, Any

from msgspec import structs

from switchyard import outcomes
from switchyard.aio import LEFT, Waits
from switchyard.config import Settings
from switchyard.engines.registry import Deployment, Registry
from switchyard.engines.token_ids import LLAMACPP_NATIVE
from switchyard.engines.upstream import UpstreamReply, UpstreamStream
from switchyard.errors import (
    CircuitOpen,
    ClientDisconnected,
    EngineCrashed,
    EngineFailed,
    EngineNotReady,
    SwitchyardError,
    UpstreamError,
    UpstreamOverloaded,
    UpstreamTimeout,
)
from switchyard.execute.compat import incompatibility, request_needs
from switchyard.execute.retry import RetryBudget, backoff_s, is_retryable, retry_class
from switchyard.observe.otel import Tracing
from switchyard.pipeline import RequestContext
from switchyard.request import to_json
from switchyard.state.breakers import SharedBreakerState
from switchyard.state.breakers_memory import CircuitBreaker

if TYPE_CHECKING:  # the gateway sets these; only their types are named here
    from switchyard.decide.balance import Balancer
    from switchyard.policy.stages_admission import Reserver

PATHS = {"chat.completions": "/chat/completions", "completions": "/completions"}
_ATTEMPT_OK = outcomes.Attempt.OK  # bound once: every served request records it
_EXTENDED = outcomes.Retry.EXTENDED

# The classes of an attempt that reached the upstream and ended with no answer: it
# timed out (the gateway's timeouts, or the upstream's own 408 or 504) or its connection
# broke. Such a call may have generated (a non-streamed generation usually runs to its
# end on the upstream after the gateway leaves) and been billed: settle.py bills it its
# prompt and output cap, and a further call of the request first extends its
# reservation by as much (`Executor._covered`).
MAY_HAVE_GENERATED = frozenset({"timeout", "504", "broken"})
_NO_SPAN: tuple[None, dict[str, str]] = (
    None,
    {},
)  # tracing off: no span, no headers (never changed)


def upstream_payload(ctx: RequestContext, dep: Deployment) -> bytes:
    """The request as the upstream is sent it: the client's, with the upstream's
    model name and the output cap the request reserved (policy/cost.py: always sent,
    so the engine cannot write past it); streams always ask for usage. The client's
    own `priority` member (an engine scheduler's) never goes out: the deployment's
    engine is sent the gateway's class (`scheduling_policy: priority`), or nothing.

    When no stage replaced the request, its bytes are exactly it, and nothing needs
    changing but members to add, the client's bytes go out as they came, the members
    appended (no second serialization of a long agent prompt)."""
    wire = ctx.wire
    req = ctx.generation
    lora = dep.lora
    native_ids = dep.token_ids == "llamacpp" and req.return_token_ids is True
    cost = ctx.cost
    cap = None
    if cost is not None and (
        cost.sends_cap  # the gateway's cap: none was sent, or it shrank
        # a managed engine reads max_tokens, and the client sent only the newer name
        or (dep.engine is not None and req.max_tokens is None)
    ):
        cap = cost.cap
    priority = dep.sends_priority
    if (
        wire is not None
        and wire[0] is req
        and wire[1] is not None  # every member is in `req` as sent: none was null
        and lora is None
        and not native_ids
        and "priority" not in req.extra  # the client's own is dropped or replaced below
        and req.model == dep.upstream_model
        and (cap is None or (req.max_tokens is None and req.max_completion_tokens is None))
    ):
        tail = b"" if cap is None else b',"max_tokens":%d' % cap
        if priority:  # vLLM's priority policy: the gateway's class, never the client's
            tail += b',"priority":%d' % ctx.admission.priority
        asks_usage = ctx.stream and ctx.include_usage is not True
        if not (asks_usage and req.stream_options is not None):  # else rewritten below
            if asks_usage:
                tail += b',"stream_options":{"include_usage":true}'
            if not tail:
                return wire[1]
            # Append to the client's object: the body parsed as a JSON object, so its
            # last non-space byte is the closing brace; the members appended are not in
            # it (the request is exact: a member it lacks was never sent), so no key
            # is duplicated.
            return wire[1].rstrip()[:-1] + tail + b"}"
    changes: dict[str, Any] = {"model": dep.upstream_model}
    if cap is not None:
        if req.max_completion_tokens is not None:
            changes["max_completion_tokens"] = cap
        if (
            req.max_tokens is not None
            or req.max_completion_tokens is None
            or dep.engine is not None
        ):
            changes["max_tokens"] = cap  # a managed engine reads max_tokens
    if ctx.stream:
        # we account usage even when the client does not ask
        changes["stream_options"] = {**(req.stream_options or {}), "include_usage": True}
    extra = req.extra
    if lora is not None or native_ids or priority or "priority" in extra:
        extra = {**extra}
        # A client's own engine priority never goes upstream (a batch key would ask the
        # engine's scheduler to run it first): the gateway's class, or nothing.
        extra.pop("priority", None)
        if priority:
            extra["priority"] = ctx.admission.priority
        if lora is not None:
            extra["lora"] = lora()
        if native_ids:
            changes["return_token_ids"] = None
            extra.update(LLAMACPP_NATIVE)
    return to_json(structs.replace(req, extra=extra, **changes))


class Executor:
    def __init__(
        self,
        settings: Settings,
        registry: Registry,
        tracing: Tracing | None = None,
        seed: int | None = None,
        redact: Callable[[str], str] | None = None,
        shared: SharedBreakerState | None = None,
    ) -> None:
        self.registry = registry
        self.tracing = tracing
        # The breakers' windows shared with other gateway processes (state/choose.py
        # picks Redis when storage.redis_url is set), or None: this process's alone.
        self.shared = shared
        self.breakers = {
            m.alias: CircuitBreaker(m.alias, m.resilience.breaker) for m in settings.served_models()
        }
        self.budgets = {
            m.alias: RetryBudget(m.resilience.retry_budget) for m in settings.served_models()
        }
        for deps in registry.replicas.values():  # one breaker per deployment of an alias
            for d in deps:
                self.breakers[d.name] = CircuitBreaker(d.name, d.model.resilience.breaker)
                self.budgets[d.name] = RetryBudget(d.model.resilience.retry_budget)
        # The aliases with several deployments (set by the gateway): a fallback to one
        # is balanced among them, and a failed deployment fails over to another.
        self.balancers: Mapping[str, Balancer] = {}
        # Extends a request's reservation before a further upstream call that follows
        # one that may have been billed (set by the gateway: the admit stage's own);
        # None: nothing is extended (a further call goes ahead as before).
        self.reserver: Reserver | None = None
        self.rng = random.Random(seed)
        self.retries = 0
        self.fallbacks = 0
        # Masks PII in an upstream's error text before it is recorded (an upstream may
        # echo the prompt); the gateway sets its masker here.
        # PII masking of an upstream's error text before it is recorded.
        self.redact: Callable[[str], str] = redact or (lambda text: text)
        self.waits = Waits()  # the upstream waits, each ended by its client's hang-up

    # Plain functions returning the run's coroutine: one coroutine per request, not two.
    def execute(self, ctx: RequestContext) -> Coroutine[Any, Any, UpstreamReply]:
        """The whole reply, from the first deployment in the chain that gives one."""
        return self._run(ctx, False)

    def execute_stream(self, ctx: RequestContext) -> Coroutine[Any, Any, UpstreamStream]:
        """A stream whose headers arrived, from the first deployment that gives one."""
        return self._run(ctx, True)

    async def _run(self, ctx: RequestContext, stream: bool) -> Any:
        # The wait is watched: a client that hangs up cancels it, and the upstream call
        # closes (the engine stops generating); this coroutine itself, none around it.
        watch = self.waits.add(ctx.receive)
        try:
            primary = ctx.deployment
            assert primary is not None
            if (
                primary.alone
                and (ctx.principal is None or ctx.principal.regions is None)
                and primary.ready
            ):
                # A chain of one, no boundary to check, ready: what the loop below does,
                # without building the chain (its errors are raised as they are there).
                return await self._attempts(ctx, primary, stream, last_in_chain=True)
            pm = primary.model
            chain = [primary.alias, *pm.fallbacks]
            needs: dict[str, Any] | None = None  # computed only if a fallback is considered
            boundary = primary.model.data_boundary
            if ctx.principal is not None:
                boundary = ctx.principal.boundary(boundary)
            last: SwitchyardError | None = None
            tokens = ctx.max_tokens or 256
            # Placement kept the data on the device (privacy): so do failover and fallbacks.
            stay = "device" if ctx.placement is not None and ctx.placement.stay else None
            for idx, alias in enumerate(chain):
                balancer = self.balancers.get(alias)
                t = time.perf_counter()
                if idx == 0:
                    dep: Deployment | None = primary
                else:
                    dep = self.registry.get(alias)
                    assert dep is not None  # config validation guarantees it
                    if needs is None:
                        needs = request_needs(ctx.generation, ctx.prompt_estimate, ctx.max_tokens)
                    # Several deployments: their regions are the balancer's to check.
                    why = incompatibility(needs, dep.model, None if balancer else boundary)
                    if (
                        why is None
                        and ctx.principal is not None
                        and not ctx.principal.may_use(alias)
                    ):
                        why = "this key may not use it"
                    if why is None and stay and balancer is None and dep.location != stay:
                        why = "privacy: the request's data may not leave the device"
                    picked = None
                    if why is None and balancer is not None:
                        picked = balancer.failover(
                            set(), regions=boundary, tokens=tokens, location=stay
                        )
                        if picked is None:
                            why = (
                                "none of its deployments is eligible (failed, not ready, circuit "
                                "open, full, weight 0 or outside the allowed regions)"
                            )
                    if why is not None:
                        ctx.record(
                            "fallback",
                            outcomes.tagged(outcomes.Kind.SKIP, alias),
                            why,
                            t,
                            {"target": alias},
                        )
                        continue
                    evidence: dict[str, Any] = {"from": primary.alias, "to": alias}
                    if picked is not None and balancer is not None:
                        dep, reason, evidence["balance"] = picked
                        ctx.admission.balanced = (balancer, dep)
                        evidence["deployment"] = dep.name
                        evidence["reason"] = reason
                    ctx.record(
                        "fallback",
                        outcomes.tagged(outcomes.Kind.TRY, alias),
                        f"{chain[idx - 1]} failed: {last}",
                        t,
                        evidence,
                    )
                assert dep is not None
                # Another deployment of the alias when this one fails (balance.failover).
                left = balancer.cfg.failover if balancer is not None else 0
                tried = {dep.name}
                while True:
                    before = ctx.run.attempts
                    done, out = await self._try_at(
                        ctx,
                        dep,
                        stream,
                        idx == len(chain) - 1 and left == 0,
                        t,
                        boundary,
                        idx == 0,
                        last,
                    )
                    if done:
                        if idx > 0:
                            self.fallbacks += 1
                            ctx.run.fallback_from = primary.alias
                        if dep is not primary:
                            ctx.deployment = dep
                            ctx.model = dep.model
                        return out
                    last = out
                    if balancer is None:
                        break
                    _leave(ctx, dep, ctx.run.attempts > before)
                    if left <= 0:
                        break
                    left -= 1
                    t = time.perf_counter()
                    # A pinned request or a task's keeps its revision; others take any.
                    keep = balancer.versioned and (ctx.pin is not None or ctx.input.task_id)
                    picked = balancer.failover(
                        tried,
                        revision=dep.model.revision if keep else None,
                        regions=boundary,
                        tokens=tokens,
                        location=stay,
                    )
                    if picked is None:
                        ctx.record(
                            "failover",
                            outcomes.tagged(outcomes.Kind.NONE, alias),
                            f"{dep.name} failed and no other deployment of {alias} is eligible",
                            t,
                            {"tried": sorted(tried)},
                        )
                        break
                    failed = dep.name
                    dep, reason, evidence = picked
                    tried.add(dep.name)
                    ctx.admission.balanced = (balancer, dep)
                    evidence["from"] = failed
                    ctx.record(
                        "failover",
                        outcomes.tagged(outcomes.Kind.TRY, dep.name),
                        f"{failed} failed: {last}; {reason}",
                        t,
                        evidence,
                    )
            assert last is not None
            raise last
        except _NoRoom as stop:  # no further call: neither a retry nor a fallback
            raise stop.error from None
        except asyncio.CancelledError:
            if watch is None or not watch.gone:
                raise  # shutdown, a task's cancel: not the client's hang-up
            task = asyncio.current_task()
            if task is not None:
                task.uncancel()
            raise ClientDisconnected(LEFT) from None
        finally:
            if watch is not None:
                self.waits.end(watch)

    async def _try_at(
        self,
        ctx: RequestContext,
        dep: Deployment,
        stream: bool,
        last_in_chain: bool,
        t: float,
        boundary: list[str] | None,
        check_region: bool,
        last: SwitchyardError | None = None,
    ) -> tuple[bool, Any]:
        """(True, the result) from `dep`, or (False, the error) when the request may
        move on to another deployment; a final error (the request itself is wrong:
        another model will not fix it) is raised."""
        name = dep.name
        # Select refuses a model with no deployment inside the regions (403); this is
        # for a deployment it sent on when none was eligible (then a retry may do).
        if check_region and boundary is not None and dep.model.region not in boundary:
            why = f"region {dep.model.region!r} is outside the allowed {boundary}"
            ctx.record("attempt", outcomes.tagged(outcomes.Kind.SKIP, name), why, t)
            return False, EngineNotReady(
                f"the model '{dep.alias}' may not serve this tenant: {why}"
            )
        if dep.failed:
            assert dep.engine is not None
            why = dep.engine.reason or "it crashed at every start"
            ctx.record(
                "attempt", outcomes.tagged(outcomes.Kind.SKIP, name), f"engine failed: {why}", t
            )
            return False, EngineFailed(
                f"the model '{dep.alias}' failed to start and is not served: {why}"
            )
        if not dep.ready:
            state = dep.describe().get("state")
            ctx.record("attempt", outcomes.tagged(outcomes.Kind.SKIP, name), f"engine {state}", t)
            return False, EngineNotReady(
                f"the model '{dep.alias}' is not ready yet (engine state: {state}); retry shortly"
            )
        try:
            return True, await self._attempts(ctx, dep, stream, last_in_chain, last)
        except SwitchyardError as exc:
            if exc.retry_class is None and not isinstance(
                exc, EngineNotReady | UpstreamTimeout | EngineCrashed
            ):
                raise
            return False, exc

    async def _record(self, breaker: CircuitBreaker, success: bool) -> None:
        before = breaker.state
        local_failures = breaker.consecutive_failures
        breaker.record(success, time.monotonic())
        if self.shared is None:
            return
        if before == "closed" == breaker.state:  # the run of failures, counted by all
            if success:
                await self.shared.succeeded(breaker.name, local_failures)
            else:
                count = await self.shared.failed(breaker.name, breaker.cfg.window_s)
                if count >= breaker.cfg.failures:
                    breaker.trip(time.monotonic())
        if breaker.state == before:
            return
        if breaker.state == "open":
            await self.shared.opened(breaker.name, breaker.cfg.cooldown_s)
        elif breaker.state == "closed":
            await self.shared.closed(breaker.name)

    async def _attempts(
        self,
        ctx: RequestContext,
        dep: Deployment,
        stream: bool,
        last_in_chain: bool,
        last: SwitchyardError | None = None,
    ) -> Any:
        """Attempts at one deployment: `stream` (returns once the headers arrived) or
        `post` (the whole reply), with the request's payload and the remaining time.
        `last`: the error of the deployment the request comes from (a fallback's,
        a failover's), raised when the reservation cannot cover this one's call."""
        cfg = dep.model.resilience
        breaker = self.breakers[dep.name]
        budget = self.budgets[dep.name]
        reserve = 0.0 if last_in_chain else cfg.fallback_reserve_s
        retries = 0
        while True:
            t = time.perf_counter()
            if self.shared is not None:
                await self.shared.sync(self.breakers)
            now = time.monotonic()
            ok, why = breaker.allow(now)
            if not ok:
                ctx.record(
                    "attempt",
                    outcomes.tagged(outcomes.Kind.BREAKER_OPEN, dep.name),
                    why,
                    t,
                    breaker.describe(time.monotonic()),
                )
                raise CircuitOpen(
                    f"the model '{dep.alias}' is failing; its circuit is open",
                    retry_after_s=max(1, round(breaker.retry_after_s(time.monotonic()))),
                )
            remaining = ctx.remaining_s() - reserve
            if remaining < dep.min_attempt_s:
                breaker.release_probe()
                ctx.record(
                    "attempt",
                    outcomes.Attempt.SKIP_DEADLINE,
                    f"{remaining:.3f}s left is too little to start an attempt",
                    t,
                )
                raise UpstreamTimeout("the request deadline leaves no time for another attempt")
            if ctx.run.attempts and not stream and not await self._covered(ctx, dep, t):
                # (A request's first call passes on the first test alone.)
                breaker.release_probe()
                raise _NoRoom(last or UpstreamError("no further upstream call fits the budget"))
            if retries == 0:
                budget.first_attempt(now)
            ctx.run.attempts += 1
            ctx.timings.upstream_sent = t
            span, headers = (
                self.tracing.start_attempt(ctx, dep.alias, dep.label)
                if self.tracing is not None
                else _NO_SPAN
            )
            generation = dep.engine.generation if dep.engine is not None else 0
            try:
                call = dep.upstream.stream if stream else dep.upstream.post
                result = await call(
                    PATHS[ctx.input.endpoint],
                    upstream_payload(ctx, dep),
                    dep.model.timeouts,
                    remaining,
                    {**dep.headers, **headers} if dep.headers is not None else headers or None,
                )
            except SwitchyardError as exc:
                Tracing.end_attempt(span, exc.code)
                cls = retry_class(exc)
                # A 4xx means the upstream is healthy and the request is wrong; a 503
                # with Retry-After, that it is healthy and full (neither counts).
                if not isinstance(exc, UpstreamOverloaded):
                    await self._record(breaker, cls is None)
                ctx.record(
                    "attempt",
                    outcomes.tagged(outcomes.Kind.ERROR, cls or exc.code),
                    self.redact(exc.detail or exc.message)[:1000],
                    t,
                    {
                        "upstream": dep.label,
                        "alias": dep.alias,
                        "attempt": ctx.run.attempts,
                        "class": cls,
                        "status": exc.status,
                    },
                )
                if (
                    dep.engine is not None
                    and cls in ("connect", "broken")
                    and await dep.engine.exited_since(generation)
                ):
                    # The local worker died under this request: the same prompt may
                    # crash it again, so it is not retried there.
                    ctx.record(
                        "attempt",
                        outcomes.Attempt.ENGINE_CRASHED,
                        f"the worker of {dep.alias} died during this attempt; "
                        "not retried on the same engine",
                        time.perf_counter(),
                        {"alias": dep.alias, "last_error": dep.engine.last_error},
                    )
                    raise EngineCrashed(
                        f"the local engine of '{dep.alias}' crashed while serving this "
                        "request; it is restarting"
                    ) from None
                if not is_retryable(exc, cfg) or retries >= cfg.retries:
                    raise
                # The deadline first: a retry that cannot happen costs no retry budget.
                wait = backoff_s(retries + 1, cfg, exc.retry_after_s, self.rng)
                if wait + cfg.min_attempt_s > ctx.remaining_s() - reserve:
                    ctx.record(
                        "retry",
                        outcomes.Retry.SKIP_DEADLINE,
                        f"a {wait:.3f}s backoff would pass the deadline",
                        time.perf_counter(),
                    )
                    raise
                # The reservation next: a call that may have been billed is paid for
                # before another is made (and a retry refused here spends no budget).
                if (
                    cls in MAY_HAVE_GENERATED
                    and not stream
                    and not await self._covered(ctx, dep, time.perf_counter())
                ):
                    raise _NoRoom(exc) from None
                if not budget.try_spend(time.monotonic()):
                    ctx.record(
                        "retry",
                        outcomes.Retry.DENIED_BUDGET,
                        "retry budget of the deployment is spent",
                        time.perf_counter(),
                        {"allowance": budget.allowance(time.monotonic())},
                    )
                    raise
                ctx.record(
                    "retry",
                    outcomes.Retry.BACKOFF,
                    f"waiting {wait * 1000:.0f} ms before retry {retries + 1}",
                    time.perf_counter(),
                    {"wait_s": round(wait, 4), "retry_after_s": exc.retry_after_s},
                )
                self.retries += 1
                await asyncio.sleep(wait)
                retries += 1
                last = exc
                continue
            except asyncio.CancelledError:
                Tracing.end_attempt(span, "cancelled")
                breaker.release_probe()
                raise
            if span is not None:
                Tracing.end_attempt(span, None)
            if self.shared is None:  # no shared breaker state: nothing to await
                breaker.record(True, time.monotonic())
            else:
                await self._record(breaker, True)
            ctx.timings.upstream_first_byte = time.perf_counter()
            ctx.record(
                "attempt",
                _ATTEMPT_OK,
                f"served by {dep.label}",
                t,
                {"upstream": dep.label, "alias": dep.alias, "attempt": ctx.run.attempts},
            )
            return result

    async def _covered(self, ctx: RequestContext, dep: Deployment, t: float) -> bool:
        """Whether the request's reservation covers one more upstream call of a
        non-streamed request. It reserved one call's worth (one prompt and the output
        cap of each sequence, at its chain's dearest price); each call so far that may
        have been billed (`MAY_HAVE_GENERATED`) uses one, and each extension
        (`retry` `extended`) adds one. When they are all used, the reservation is
        extended by one more (`Reserver.extend`, recorded `retry` `extended`), or,
        when that does not fit, the call is refused (`retry` `denied:budget`: the
        request ends with the error it has). Calls that never reached an upstream
        (refused connection, breaker open, a 4xx other than 408) use nothing."""
        reserver = self.reserver
        if reserver is None:
            return True
        billed = extended = 0
        for d in ctx.decisions:
            if d.stage == "attempt":
                ev = d.evidence
                if ev is not None and ev.get("class") in MAY_HAVE_GENERATED and "attempt" in ev:
                    billed += 1
            elif d.stage == "retry" and d.outcome == _EXTENDED:
                extended += 1
        if extended >= billed:
            return True
        ok, evidence = await reserver.extend(ctx)
        if ok:
            if evidence is not None:
                evidence["calls_reserved"] = extended + 2
                ctx.record(
                    "retry",
                    _EXTENDED,
                    f"the reservation was extended by one more call before {dep.name}: "
                    f"{billed} call(s) so far may have been billed",
                    t,
                    evidence,
                )
            return True
        assert evidence is not None
        evidence["calls_billed"] = billed
        evidence["next"] = dep.name
        why = (
            f"{evidence['limit']} limit of {evidence['scope']}"
            if "limit" in evidence
            else "the limiter is unavailable (fail_closed)"
            if "limiter" in evidence
            else "the task state is unavailable (fail_closed)"
        )
        ctx.record(
            "retry",
            outcomes.Retry.DENIED_BUDGET,
            f"the reservation could not be extended for another call ({why}); "
            f"{billed} call(s) so far may have been billed",
            t,
            evidence,
        )
        return False


class _NoRoom(Exception):
    """No further upstream call fits the request's reservation (`Executor._covered`):
    the request ends with `error`, the last call's, trying no fallback."""

    def __init__(self, error: SwitchyardError) -> None:
        super().__init__(error.message)
        self.error = error


def _leave(ctx: RequestContext, dep: Deployment, attempted: bool) -> None:
    """The request moves on from a balanced deployment: it is settled there at the
    request's end as a failure (for its canary guard, if an attempt was made)."""
    held = ctx.admission.balanced
    if held is not None and held[1] is dep:
        ctx.admission.left.append((held[0], dep, attempted))
        ctx.admission.balanced = None
