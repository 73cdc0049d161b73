"""Settling a request, once, whatever way it ended: what it used and costs, what its
stages give back (`Pipeline.unwind`, last stage first), then its record — metrics,
its OpenTelemetry span and its usage row with the decision trace.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, NoReturn

from switchyard import outcomes
from switchyard.config import Price, Settings
from switchyard.errors import ClientDisconnected, ModelNotFound, SwitchyardError, TaskCancelled
from switchyard.execute.executor import MAY_HAVE_GENERATED
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


_ATTEMPT_OK = outcomes.Attempt.OK
_ESTIMATED = outcomes.Settle.ESTIMATED
# Why a row's counts are estimated, as its `settle` `estimated` decision says.
_ESTIMATES = {
    "cut": "calls cut while the upstream had them are billed their prompt and output cap",
    "none": "the upstream reported no usage: what it used is estimated",
    "unusable": "the upstream's usage was unusable: what it used is estimated",
}


def cut_attempts(ctx: RequestContext) -> list[str | None]:
    """The upstream calls of a non-streamed request that may have generated what it
    was never shown, each by the alias it was sent to: those that reached the upstream
    and ended with no answer (timed out, its connection broke), and the one under way
    when the request was cancelled (its client hung up, its task was cancelled: such an
    attempt is counted in `run.attempts` and records nothing; None). A non-streamed
    generation usually runs to its end on the upstream after the gateway leaves, and
    is billed there: each is billed its prompt and output cap, and each after the
    first was paid for by an extension of the request's reservation before it was made
    (execute/executor.py `Executor._covered`). A call that never connected, or that the
    upstream answered with an error status, did not generate; a stream is billed the
    events it relayed (none here)."""
    run = ctx.run
    if ctx.stream or not run.attempts:
        return []
    cut: list[str | None] = []
    recorded = 0
    for d in ctx.decisions:
        evidence = d.evidence
        if d.stage != "attempt" or evidence is None or "attempt" not in evidence:
            continue  # a skip (breaker open, no time left, engine down) calls nothing
        recorded += 1
        if evidence.get("class") in MAY_HAVE_GENERATED:  # timed out, broke off
            cut.append(evidence.get("alias"))
    if recorded < run.attempts:
        cut.append(None)
    return cut


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
        prompt and output cap of each non-streamed call cut without usage; nothing for
        a request every upstream refused outright) and what that costs, on `ctx.run`
        for the releases and the record. A row whose counts are estimated records
        `settle` `estimated` in its trace."""
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
        # Calls cut before the one that answered (or all of them): each billed its
        # prompt and cap, at its model's price. Only a request that made more than
        # one call, or did not succeed, can have any (a served first call: no scan).
        cut: Sequence[str | None] = ()
        why = ""  # the row's counts are estimated: why (cut, none, unusable)
        calls = 0  # calls billed besides the cut ones
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
            if run.attempts > 1 and not ctx.stream:
                cut = cut_attempts(ctx)
                why = "cut" if cut else ""
            calls = 1
        elif run.attempts and ctx.input.endpoint != "embeddings" and not refused_outright(ctx):
            # Best effort for a broken stream: the prompt as it was estimated, a token
            # an event.
            inp = ctx.cost.prompt if ctx.cost is not None else ctx.prompt_estimate
            out = run.chunks
            answered = bool(usage) or ctx.status is Status.OK
            if not ctx.stream:
                if run.attempts > 1 or not answered:
                    cut = cut_attempts(ctx)
                if not answered:  # a reply without usage before the request failed
                    answered = any(
                        d.stage == "attempt" and d.outcome == _ATTEMPT_OK for d in ctx.decisions
                    )
            why = "cut" if cut else "unusable" if usage else "none"
            if answered:
                # A complete reply without usage, or counts no request could have
                # (negative, not integers, past any cap): never a refund, never
                # billions, never less than it may have written: the output it was let
                # use (the cap it was sent with, for each sequence asked), which its
                # reservation holds.
                cap = ctx.cost.output if ctx.cost is not None else ctx.max_tokens
                out = max(out, cap or 0)
                log.warning(
                    "the upstream of %s reported %s usage; billed the estimate (%d in, %d out)",
                    ctx.input.request_id,
                    "unusable" if usage else "no",
                    inp,
                    out,
                )
            elif cut:
                # Only calls cut while the upstream had them (the client hung up, a
                # timeout, a task's cancel: the upstream bills what it generated):
                # each is billed below.
                inp = out = 0
            calls = 1 if inp or out else 0
        else:
            inp = out = 0
        if ctx.model is not None:
            price = ctx.model.price
            if ctx.status is not _OK and (inp or out):  # (a served request: one check)
                price = self._dearest_tried(ctx, price)
            cost = cost_usd(price, inp, out)
            if cut:
                inp, out, cost = self._cut_calls(ctx, cut, inp, out, cost)
        elif ctx.input.endpoint == "embeddings" and ctx.alias == self._embed_alias:
            cost = cost_usd(self._embed_price, inp, 0)
        else:
            cost = 0.0
        run.tokens_in, run.tokens_out, run.cost_usd = inp, out, cost
        if why:
            ctx.record(
                "settle",
                _ESTIMATED,
                _ESTIMATES[why],
                time.perf_counter(),
                {
                    "input_tokens": inp,
                    "output_tokens": out,
                    "attempts_billed": len(cut) + calls,
                    "why": why,
                },
            )

    def _cut_calls(
        self, ctx: RequestContext, cut: Sequence[str | None], inp: int, out: int, cost: float
    ) -> tuple[int, int, float]:
        """`inp`, `out` and `cost` with each cut call's prompt and output cap (each
        sequence's) added, each at the price of the model it was sent to (the one
        under way when the request was cancelled: at the dearest tried). Each is in the
        model's chain, whose dearest price each call's reservation holds."""
        shape = ctx.cost
        prompt = shape.prompt if shape is not None else ctx.prompt_estimate
        cap = shape.output if shape is not None else ctx.max_tokens
        assert ctx.model is not None
        for alias in cut:
            price = self._prices.get(alias) if alias is not None else None
            if price is None:
                price = self._dearest_tried(ctx, ctx.model.price)
            inp += prompt
            out += cap
            cost += cost_usd(price, prompt, cap)
        # A cut call is the client's doing as often as the upstream's: INFO, so a key
        # that hangs up again and again cannot fill the warning log.
        log.info(
            "%d call(s) of %s cut without usage; billed the estimate (%d in, %d out in all)",
            len(cut),
            ctx.input.request_id,
            inp,
            out,
        )
        return inp, out, cost

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
