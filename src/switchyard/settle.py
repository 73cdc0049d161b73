"""Settling a request, once, whatever way it ended: what it used and costs, what its
stages give back (`Pipeline.unwind`, last stage first), then its record — metrics,
its OpenTelemetry span and its usage row with the decision trace.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, NoReturn

from switchyard import outcomes
from switchyard.config import Price, Settings
from switchyard.errors import ClientDisconnected, ModelNotFound, SwitchyardError, TaskCancelled
from switchyard.observe.metrics import Metrics
from switchyard.pipeline import CacheOutcome, Pipeline, RequestContext, Status
from switchyard.policy.admit import cost_usd
from switchyard.policy.cost import PromptOverhead
from switchyard.reply import cut_choices, reply_usage
from switchyard.request import UNKNOWN_MODEL
from switchyard.state.ledger import UsageLedger
from switchyard.state.ledger_rows import Finished
from switchyard.usage import counts

if TYPE_CHECKING:
    from switchyard.observe.otel import Tracing

log = logging.getLogger("switchyard")

# Statuses read on every request's path, bound once: reading an enum member through its
# class takes the enum metaclass's lookup hook each time (about ten times a global's).
_OK = Status.OK
_CANCELLED = Status.CANCELLED
_ERROR = Status.ERROR
_UNFINISHED = (Status.PENDING, Status.STREAMING)
_REPLAY = CacheOutcome.REPLAY


def mark_failed(ctx: RequestContext, exc: BaseException) -> None:
    """Mark a request that ended by an exception: its code, or internal_error. A
    client that hung up mid-body is cancelled, not an error (logged at INFO, no
    traceback): anyone with a key could otherwise fill the error log and rate."""
    if isinstance(exc, ClientDisconnected):
        ctx.status, ctx.error_code = Status.CANCELLED, exc.code
        log.info("request %s (%s): %s", ctx.input.request_id, ctx.input.called, exc.message)
        return
    code = exc.code if isinstance(exc, SwitchyardError) else "internal_error"
    ctx.status, ctx.error_code = Status.ERROR, code
    if isinstance(exc, ModelNotFound) and ctx.deployment is None:
        ctx.alias = UNKNOWN_MODEL  # the client's free text: told back, not recorded


# The message of a cancellation the client asked for (a background response's cancel):
# the request is recorded as cancelled, not as the gateway's error.
CLIENT_CANCEL = "cancelled by its client"


def raise_cancelled(ctx: RequestContext, exc: asyncio.CancelledError) -> NoReturn:
    """A cancelled request ends as 409 task_cancelled when its task's cancel stopped it
    (policy/tasks.Running.stop: recorded, the cancellation taken back); any other
    cancellation (the client left or cancelled it, shutdown) goes on."""
    if not ctx.cancelled:
        if exc.args and exc.args[0] == CLIENT_CANCEL:
            ctx.status, ctx.error_code = Status.CANCELLED, "cancelled"
        else:
            mark_failed(ctx, exc)
        raise exc
    task = asyncio.current_task()
    if task is not None:
        task.uncancel()
    ctx.record(
        "task",
        outcomes.Task.STOPPED,
        "the task was cancelled while this call ran",
        time.perf_counter(),
    )
    stopped = TaskCancelled(f"the task '{ctx.input.task_id}' was cancelled while this call ran")
    mark_failed(ctx, stopped)
    raise stopped from None


def client_left(ctx: RequestContext) -> bool:
    """Whether the request ended because its client went away (mid-body, mid-stream,
    mid-rollout), not because its task was cancelled."""
    return ctx.status is _CANCELLED and ctx.error_code != TaskCancelled.code


def proven_output(ctx: RequestContext) -> int:
    """The output tokens a reply proves were written, whatever its usage says: the cap
    it was sent with (per sequence) for each choice that ended with `length` (prompts
    and `n` make several; the window stage keeps each cap inside the context, so
    `length` means the cap was reached), never more choices than were asked for. A
    whole reply is read here; a stream's cut choices were noted as it was relayed
    (`run.cut`). 0 when there is no such reply, or no choice was cut."""
    run, cost = ctx.run, ctx.cost
    if cost is None or cost.sequences < 2:
        return 0  # one choice: its usage counts it
    body = run.reply_body
    if body is not None:
        if b'"length"' not in body:
            return 0  # none cut: most replies, no parse
        cut = cut_choices(body)
    elif run.cut is not None:
        cut = run.cut
    else:
        return 0
    return min(len(cut), cost.sequences) * cost.cap


def refused_outright(ctx: RequestContext) -> bool:
    """Whether every upstream call of a failed request was refused before any output:
    each attempt the executor recorded (its `attempt` decisions that carry the attempt's
    number) ended with a 4xx other than 408 (the upstream's answer that it did not take
    the request: past its context, a parameter it refuses, rate limited), and nothing
    was relayed. Such a request generated nothing and has no usage: it is billed
    nothing. Any other attempt (one that got a reply, timed out, broke off, a 5xx)
    may have generated, and keeps its estimate."""
    run = ctx.run
    if ctx.status is not _ERROR or run.chunks or not run.attempts:
        return False
    refused = 0
    for d in ctx.decisions:
        if d.stage != "attempt" or d.evidence is None or "attempt" not in d.evidence:
            continue  # a skip (breaker open, no time left, engine down) calls nothing
        status = d.evidence.get("status")
        if type(status) is not int or not 400 <= status < 500 or status == 408:
            return False
        refused += 1
    return refused == run.attempts


# The classes of an attempt that ended with no answer from an upstream that had the
# request (execute/executor.py records them in the attempt's evidence): it timed out
# (the gateway's timeouts, or the upstream's own 408 or 504) or its connection broke.
_UNANSWERED = frozenset({"timeout", "504", "broken"})
_ATTEMPT_OK = outcomes.Attempt.OK


def cut_unanswered(ctx: RequestContext) -> bool:
    """Whether a non-streamed request made an upstream call that may have generated
    what it was never shown: one that reached the upstream and ended with no answer
    (timed out, its connection broke, or it was under way when the request was
    cancelled: its client hung up, its task was cancelled; such an attempt records no
    decision, so it is one the executor counted in `run.attempts` and never recorded),
    or one whose reply came without usage. A non-streamed generation usually runs to
    its end on the upstream after the gateway leaves, and is billed there. A call that
    never connected (`connect`), or that the upstream answered with an error status,
    did not generate. A stream is billed the events it relayed (not here)."""
    run = ctx.run
    if ctx.stream or not run.attempts:
        return False
    recorded = 0
    for d in ctx.decisions:
        evidence = d.evidence
        if d.stage != "attempt" or evidence is None or "attempt" not in evidence:
            continue  # a skip (breaker open, no time left, engine down) calls nothing
        recorded += 1
        if d.outcome == _ATTEMPT_OK or evidence.get("class") in _UNANSWERED:
            return True
    return recorded < run.attempts


class Settler:
    """Charges, unwinds and records settled requests."""

    def __init__(
        self,
        settings: Settings,
        ledger: UsageLedger,
        metrics: Metrics | None,
        tracing: Tracing | None,
        overhead: PromptOverhead,
    ) -> None:
        s = settings
        self.ledger = ledger
        self.metrics = metrics
        self.tracing = tracing
        self.overhead = overhead  # prompt tokens beyond the estimate, learnt here
        # Config values read on every request, as plain attributes (an attribute of a
        # pydantic model costs ~4x one of a plain object).
        self._traces = s.observe.traces
        self._sample_ok = s.observe.traces_sample_ok
        self._slow_ms = s.observe.traces_slow_ms
        self._sampler = random.Random()
        self._embed_price = Price(input=s.embeddings.price, output=0.0)
        self._embed_alias = s.embeddings.alias
        # Each alias's price, for a failed request that fell back (`_dearest_tried`).
        self._prices = {m.alias: m.price for m in s.served_models()}
        self.pending = 0  # answered requests whose settle runs after the response

    def after_response(
        self,
        settle_now: Callable[[RequestContext], Awaitable[None] | None],
        ctx: RequestContext,
    ) -> Awaitable[None] | None:
        """`settle_now(ctx)` for a request whose reply has been sent; counted in
        `pending` until done. None when it was settled without waiting."""
        try:
            waiting = settle_now(ctx)
        except BaseException:
            self.pending -= 1
            raise
        if waiting is None:
            self.pending -= 1
            return None
        return self._settling(waiting)

    async def _settling(self, waiting: Awaitable[None]) -> None:
        try:
            await waiting
        finally:
            self.pending -= 1

    async def settled(self, timeout_s: float = 5.0) -> None:
        """Wait until every answered request has been settled and its row written
        (admin reads use this, so what a client has seen answered is visible in the
        ledger and traces)."""
        deadline = time.monotonic() + timeout_s
        while self.pending > 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.005)
        await self.ledger.flush_async()

    def settle(self, ctx: RequestContext, pipeline: Pipeline) -> Awaitable[None] | None:
        """Charge the request, unwind `pipeline`'s stages and record it; an awaitable
        only when a release must wait (a shared counter to settle)."""
        self._charge(ctx)
        waiting = pipeline.unwind(ctx)
        if waiting is None:
            self._record(ctx)
            return None
        return self._unwound(ctx, waiting)

    async def _unwound(self, ctx: RequestContext, waiting: list[Awaitable[None]]) -> None:
        """The releases that wait, in order; one that fails (shared state unreachable)
        is logged and does not keep the others, or the record, from happening."""
        try:
            for pending in waiting:
                try:
                    await pending
                except Exception as exc:
                    log.warning("could not settle %s: %s", ctx.input.request_id, exc)
        finally:
            self._record(ctx)

    def _charge(self, ctx: RequestContext) -> None:
        """What the request used (the upstream's usage; a broken stream's estimate; the
        output cap of a non-streamed call cut without usage; nothing for a request every
        upstream refused outright) and what that costs, on `ctx.run` for the releases
        and the record."""
        run = ctx.run
        if ctx.cache is _REPLAY:
            # An idempotent replay calls nothing: the stored reply's usage was billed
            # to the request that made it, never again (0 tokens, as a cache hit).
            run.tokens_in = run.tokens_out = 0
            run.cost_usd = 0.0
            return
        if run.usage is None and run.reply_body is not None:
            run.usage = reply_usage(run.reply_body)
        usage = run.usage
        counted = counts(usage) if usage else None
        if counted is not None:
            inp, out = counted
            shape = ctx.cost
            if inp and ctx.alias is not None and shape is not None:
                self.overhead.observe(ctx.alias, shape.base, inp)  # reservations lean high
                if shape.alias and shape.alias != ctx.alias:
                    # Routed (`auto`): its next prompts are estimated under the alias
                    # the client named, before any route is taken.
                    self.overhead.observe(shape.alias, shape.base, inp)
            proven = proven_output(ctx)
            if out < proven:
                # A count below what the reply shows (llama-server counts one choice
                # of several): never less than each choice cut at its cap wrote.
                log.warning(
                    "the upstream of %s reported %d output tokens for a reply that shows "
                    "%d; billed %d",
                    ctx.input.request_id,
                    out,
                    proven,
                    proven,
                )
                out = proven
        elif run.attempts and ctx.input.endpoint != "embeddings" and not refused_outright(ctx):
            # Best effort for a broken stream: the prompt as it was estimated, a token
            # an event.
            inp = ctx.cost.prompt if ctx.cost is not None else ctx.prompt_estimate
            out = run.chunks
            answered = usage or ctx.status is Status.OK
            if answered or cut_unanswered(ctx):
                # A complete reply without usage, or counts no request could have
                # (negative, not integers, past any cap), or a non-streamed call cut
                # while the upstream had it (the client hung up, a timeout, a task's
                # cancel: the upstream bills what it generated): never a refund, never
                # billions, never less than it may have written: the output it was let
                # use (the cap it was sent with, for each sequence asked), which its
                # reservation holds.
                cap = ctx.cost.output if ctx.cost is not None else ctx.max_tokens
                out = max(out, cap or 0)
                # A cut call is the client's doing as often as the upstream's: INFO,
                # so a key that hangs up again and again cannot fill the warning log.
                log.log(
                    logging.WARNING if answered else logging.INFO,
                    "the upstream of %s reported %s usage; billed the estimate (%d in, %d out)",
                    ctx.input.request_id,
                    "unusable" if usage else "no" if answered else "no (its call was cut)",
                    inp,
                    out,
                )
        else:
            inp = out = 0
        if ctx.model is not None:
            price = ctx.model.price
            if ctx.status is not _OK and (inp or out):  # (a served request: one check)
                price = self._dearest_tried(ctx, price)
            cost = cost_usd(price, inp, out)
        elif ctx.input.endpoint == "embeddings" and ctx.alias == self._embed_alias:
            cost = cost_usd(self._embed_price, inp, 0)
        else:
            cost = 0.0
        run.tokens_in, run.tokens_out, run.cost_usd = inp, out, cost

    def _dearest_tried(self, ctx: RequestContext, price: Price) -> Price:
        """The price a failed request is billed at: `price` (its model's), or, when
        it fell back, the dearest, per input and per output token, of it and each
        fallback tried (`fallback` decisions with a target), since any of them may
        have read the prompt and generated. Each is in the model's chain, whose
        dearest price its reservation holds (policy/stages_admission.chain_price)."""
        for d in ctx.decisions:
            evidence = d.evidence
            if d.stage != "fallback" or evidence is None or "to" not in evidence:
                continue  # not a fallback tried (a skip names its `target`)
            other = self._prices.get(evidence["to"])
            if other is not None and (other.input > price.input or other.output > price.output):
                price = Price(
                    input=max(price.input, other.input), output=max(price.output, other.output)
                )
        return price

    def _record(self, ctx: RequestContext) -> None:
        """Metrics, span and ledger row of a settled request."""
        t = ctx.timings
        if t.ended is None:
            t.ended = time.perf_counter()
        end = t.ended
        run = ctx.run
        inp, out, cost = run.tokens_in, run.tokens_out, run.cost_usd
        # A plain str from here on: metrics labels and the ledger take the value.
        status = str(ctx.status if ctx.status not in _UNFINISHED else _ERROR)
        if self.metrics is not None:
            self.metrics.observe(ctx, status, inp, out, cost)
            if client_left(ctx):
                self.metrics.client_disconnected(ctx.input.called)
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
            and ctx.run.attempts <= 1
            and ctx.run.fallback_from is None
            and ctx.cache in (None, CacheOutcome.MISS, CacheOutcome.BYPASS)
            and ctx.input.task_id is None
            and t.ended is not None
            and (t.ended - t.received) * 1000.0 < self._slow_ms
        )
        return not plain or self._sampler.random() < self._sample_ok
