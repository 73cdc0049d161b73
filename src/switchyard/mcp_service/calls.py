"""Forwarding a governed MCP tool call and mapping what came back (mcp_service/__init__.py
decides whether it may run at all).

Owns the call's way to its tool server and back: the server's circuit breaker asked
and told (state/breakers_memory.py), the call forwarded in its request's own task, where a
task cancel can stop it, a read-only call tried once more, a claimed side effect's
outcome recorded for every repeat (state/tool_calls.py: done, too large, in doubt or
released), the result checked against `mcp.max_result_bytes` and excerpted for the
trace (masked when the trace is written: `Unmasked`), and the errors a client gets for
each ending (timeout, lost connection, server error, refusal, open breaker, a repeat's
claim state).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import orjson

from switchyard import outcomes
from switchyard.config import Settings
from switchyard.engines.mcp_servers import CallOutcome, ServerUnavailable, result_refusal
from switchyard.errors import (
    CallIdConflict,
    Conflict,
    SwitchyardError,
    TaskCancelled,
    ToolCallDone,
    ToolCallInDoubt,
    ToolCallInFlight,
    ToolCallRefused,
    ToolCircuitOpen,
    ToolResultTooLarge,
    ToolServerError,
    ToolServerUnavailable,
    ToolTimeout,
    UpstreamError,
)
from switchyard.pipeline import RequestContext
from switchyard.policy.pii import MaskingError
from switchyard.policy.tasks import Running
from switchyard.state.breakers_memory import CircuitBreaker
from switchyard.state.tasks import TaskKey
from switchyard.state.tool_calls import ToolCallRecords

MAX_EXCERPT = 2000  # characters of masked arguments and result kept in a trace
REQUEST_ID = "switchyard/request_id"  # in a result's `_meta` (and the call's, to the server)
WITHHELD = "(withheld: PII masking failed)"  # an excerpt's place when masking failed


# Hands a governed call's result to the client (the reply written) before the call is
# recorded (McpToolService.call).
Answer = Callable[[dict[str, Any]], Awaitable[None]]


class Unmasked:
    """A trace excerpt (the call's arguments or result as JSON) that is PII-masked and cut
    when the call's records are written, after the client has its answer: the raw text
    lives only in this process's memory until then, and is never written as it is."""

    __slots__ = ("_masked", "text")

    def __init__(self, text: str) -> None:
        # Masked before it is cut, with room past the cut, so a value cut in two is
        # never left half unmasked.
        self.text = text[: MAX_EXCERPT + 512]
        self._masked: str | None = None

    def masked(self, mask: Callable[[str], str]) -> str:
        if self._masked is None:
            try:
                self._masked = mask(self.text)[:MAX_EXCERPT]
            except MaskingError:  # fail closed: nothing of it is kept
                self._masked = WITHHELD
        return self._masked


@dataclass(slots=True)
class Spend:
    """What one tool call holds against its task until it ends: the task's key once
    admitted, the tool's price, and whether the call reached the server (its price is
    charged) or was answered (it counts as one of the task's tool calls)."""

    task: TaskKey | None = None
    price: float = 0.0
    sent: bool = False
    answered: bool = False

    @property
    def cost(self) -> float:
        return self.price if self.sent else 0.0


@dataclass(slots=True)
class Forward:
    """A governed call ready to go to its tool server: its request, the server and the
    tool's own name there, its arguments, timeout and the evidence its decisions show;
    `recorded`: a side effect claimed in the shared store (never run again)."""

    ctx: RequestContext
    server: Any
    tool: str
    arguments: dict[str, Any]
    timeout: float
    evidence: dict[str, Any]
    spend: Spend
    recorded: bool = False


class McpCalls:
    """The forwarding half of McpToolService (its base): the attributes below are set
    by its constructor."""

    settings: Settings
    records: ToolCallRecords
    running: Running
    mask: Callable[[str], str]

    async def _run_once(self, call: Forward, call_id: str) -> dict[str, Any]:
        """Run a claimed call and record its outcome for every repeat."""
        tenant = call.ctx.principal.tenant_id
        call.recorded = True
        try:
            result = await self._run(call, retry=False)
        except UpstreamError as exc:
            if isinstance(exc, ToolResultTooLarge):  # it ran: done, its result not kept
                await asyncio.shield(self.records.complete_too_large(tenant, call_id))
            else:  # it may have run
                await asyncio.shield(self.records.doubt(tenant, call_id))
            raise
        except (ToolCallInDoubt, TaskCancelled):
            await self.records.doubt(tenant, call_id)
            raise
        except asyncio.CancelledError:
            await asyncio.shield(self.records.doubt(tenant, call_id))
            raise
        except (ToolServerUnavailable, Conflict):  # refused before it was sent
            await self.records.release(tenant, call_id)
            raise
        except BaseException:  # anything else: it may have run, so never again
            await asyncio.shield(self.records.doubt(tenant, call_id))
            raise
        await self.records.complete(tenant, call_id, result)
        return result

    async def _run(self, call: Forward, retry: bool) -> dict[str, Any]:
        """Forward the call (a task cancel stops it), if the server's breaker lets it
        through; a read-only call that lost its connection or met a server error is
        tried once more (if the breaker still allows)."""
        ctx, server, tool, arguments = call.ctx, call.server, call.tool, call.arguments
        timeout, evidence, spend = call.timeout, call.evidence, call.spend
        key = (ctx.principal.tenant_id, ctx.input.task_id) if ctx.input.task_id else None
        meta = {REQUEST_ID: ctx.input.request_id}
        breaker: CircuitBreaker = server.breaker
        t = time.perf_counter()
        ok, why = breaker.allow(time.monotonic())
        if not ok:
            raise _circuit_open(ctx, server, why, t, evidence)
        # A timeout the caller set shorter than the server's own (x-request-timeout, the
        # task's deadline) says nothing of the server: it does not count against the
        # breaker every tenant shares.
        own_deadline = timeout < server.cfg.timeout_s

        async def attempt() -> CallOutcome:
            try:
                out = await server.call(tool, arguments, meta, timeout)
            except ServerUnavailable:
                breaker.release_probe()
                raise
            except BaseException:  # stopped mid-call: it may have been sent
                spend.sent = True
                breaker.release_probe()
                raise
            spend.sent = spend.sent or out.sent or out.result is not None
            if out.timed_out and own_deadline:
                breaker.release_probe()
            else:
                breaker.record(not out.failed, time.monotonic())
            return out

        # Run in this request's own task: a task cancel (Running.stop) cancels it while
        # the call is registered below, and is told apart here by `ctx.cancelled`.
        try:
            if key is not None:
                self.running.add(key, ctx)
            try:
                ctx.timings.upstream_sent = time.perf_counter()
                ctx.run.attempts = 1
                out = await attempt()
                # (a result, even one too large to pass on, is no failure to retry)
                again = retry and out.sent and out.failed and not out.timed_out
                # A priced call is sent at most once on its one price.
                if again and not spend.price and breaker.allow(time.monotonic())[0]:
                    ctx.run.attempts = 2
                    out = await attempt()
            finally:
                if key is not None:
                    self.running.remove(key, ctx.input.request_id)
        except ServerUnavailable as exc:
            ctx.record("tool_exec", outcomes.ToolExec.UNAVAILABLE, str(exc), t, evidence)
            raise ToolServerUnavailable(f"the tool server '{server.name}' is unavailable") from None
        except asyncio.CancelledError:
            me = asyncio.current_task()
            # Not (only) the task's cancel: the request itself is being stopped (the
            # client went away or cancelled; the tool server was told), and stays so.
            if not ctx.cancelled or me is None or me.uncancel() > 0:
                ctx.record(
                    "tool_exec", outcomes.ToolExec.CANCELLED, "the request was stopped", t, evidence
                )
                raise
            ctx.record(
                "tool_exec", outcomes.ToolExec.CANCELLED, "the task was cancelled", t, evidence
            )
            raise TaskCancelled(
                f"the task '{ctx.input.task_id}' was cancelled while the tool ran"
                + ("" if retry else "; its outcome is unknown and it will not be run again")
            ) from None
        ctx.timings.upstream_first_byte = time.perf_counter()
        full = f"{server.name}__{tool}"
        if out.result is not None:
            return self._result(call, out.result, full, t)
        if out.too_large or out.unpassable is not None:
            raise self._too_large(call, full, t, None, out.unpassable)
        code, said = out.error or (0, "")
        message = self.mask(said)  # the server's words: kept masked, never sent on
        evidence = {**evidence, "error": {"code": code, "message": message}}
        if not out.sent:
            ctx.record("tool_exec", outcomes.ToolExec.ERROR, message, t, evidence)
            raise ToolCallRefused(
                f"the tool server '{server.name}' refused the call (JSON-RPC error {code})"
            )
        ctx.record(
            "tool_exec",
            outcomes.ToolExec.FAILED if retry else outcomes.ToolExec.IN_DOUBT,
            message,
            t,
            evidence,
        )
        if out.timed_out:
            what = f"the tool '{full}' did not answer within {timeout:.3g} s"
        elif out.server_error:
            what = f"the tool server '{server.name}' failed with a server error during the call"
        else:
            what = f"the connection to the tool server '{server.name}' was lost during the call"
        if retry:  # read-only: nothing to be in doubt about
            if out.timed_out:
                raise ToolTimeout(what)
            if out.server_error:
                raise ToolServerError(what)
            raise ToolServerUnavailable(what)
        raise ToolCallInDoubt(
            f"{what}: its outcome is unknown, so it will not be run again (an operator "
            "resolves it: GET /admin/tool-calls)"
        )

    def _result(self, call: Forward, result: dict[str, Any], full: str, t: float) -> dict[str, Any]:
        """The tool's result for the client, or, past `mcp.max_result_bytes` or where
        it cannot be written as it came (engines/mcp_forward.py `result_refusal`: the
        servers check it, this is the last guard), an error (the result neither passed
        on nor stored; the trace keeps its size or the reason)."""
        ctx, evidence = call.ctx, call.evidence
        try:
            text = orjson.dumps(result)
        except TypeError:  # orjson.JSONEncodeError: too deep, an integer past 64 bits
            why = result_refusal(result) or "it cannot be written as JSON"
            raise self._too_large(call, full, t, None, why) from None
        if len(text) > self.settings.mcp.max_result_bytes:
            raise self._too_large(call, full, t, len(text))
        excerpt = Unmasked(text[: MAX_EXCERPT + 512].decode("utf-8", "replace"))
        evidence = {**evidence, "result": excerpt}
        outcome = outcomes.ToolExec.TOOL_ERROR if result.get("isError") else outcomes.ToolExec.OK
        ctx.record("tool_exec", outcome, f"ran on {call.server.name}", t, evidence)
        return dict(result)

    def _too_large(
        self, call: Forward, full: str, t: float, size: int | None, why: str | None = None
    ) -> ToolResultTooLarge:
        """The refusal of a result over `mcp.max_result_bytes` (`size`: its bytes; None:
        more than the gateway reads of a reply), or that cannot be passed on as it came
        (`why`: nested too deep, an integer past 64 bits), recorded in the trace: it ran."""
        limit = self.settings.mcp.max_result_bytes
        got = f"{size} bytes" if size is not None else "more bytes than it reads"
        evidence = {**call.evidence, "result_bytes": size, "max_result_bytes": limit}
        reason = f"ran on {call.server.name}; its result is over mcp.max_result_bytes"
        said = (
            f"the tool '{full}' answered with a result of {got}, more than this gateway "
            f"passes on (mcp.max_result_bytes: {limit})"
        )
        if why is not None:
            evidence = {**call.evidence, "result_refused": why}
            reason = f"ran on {call.server.name}; its result is not passed on: {why}"
            said = f"the tool '{full}' answered with a result this gateway does not pass on: {why}"
        call.ctx.record("tool_exec", outcomes.ToolExec.TOO_LARGE, reason, t, evidence)
        return ToolResultTooLarge(
            said
            + (
                "; the call ran, its result was not kept, and it will not be run again"
                if call.recorded
                else ""
            )
        )


def _with_request_id(result: dict[str, Any], request_id: str) -> dict[str, Any]:
    """The result as the client gets it: its `_meta` names this call's request id
    (`switchyard/request_id`), the id its trace and usage row have and a later step's
    `x-parent-request-id` names. The stored result of a side effect stays without it."""
    meta = result.get("_meta")
    return {**result, "_meta": {**(meta if isinstance(meta, dict) else {}), REQUEST_ID: request_id}}


def _circuit_open(
    ctx: RequestContext, server: Any, why: str, t: float, evidence: dict[str, Any]
) -> SwitchyardError:
    """The refusal of a call to a server whose breaker is open (recorded in the trace
    with the breaker's state): nothing was sent."""
    state = server.breaker.describe(time.monotonic())
    ctx.record(
        "tool_exec", outcomes.ToolExec.REJECT_CIRCUIT_OPEN, why, t, {**evidence, "breaker": state}
    )
    wait = max(1, round(state["retry_after_s"]))
    return ToolCircuitOpen(
        f"the tool server '{server.name}' keeps failing, so its circuit breaker is open: "
        f"the call was not sent; retry in about {wait} s",
        headers={"Retry-After": str(wait)},
    )


_CLAIM_REASONS = {
    "done": "a repeat: the stored result of the first run",
    "in_doubt": "the first run's outcome is unknown: not run again",
    "resolved_ran": "an operator recorded that the first run happened",
    "too_large": "the first run's result was too large to keep: not run again",
    "conflict": "the call id was used for another tool or other arguments",
    "in_flight": "the first run is still in flight",
}


def _claim_error(state: str, call_id: str) -> SwitchyardError:
    if state == "conflict":
        return CallIdConflict(
            f"the call id '{call_id}' was already used for another tool or other arguments",
            param="_meta.call_id",
        )
    if state == "in_flight":
        return ToolCallInFlight(
            f"the call '{call_id}' is still running; repeat it later to get its result"
        )
    if state == "too_large":
        return ToolResultTooLarge(
            f"the call '{call_id}' ran once already and its result was larger than this "
            "gateway passes on (mcp.max_result_bytes, or nested too deep), so it was not "
            "kept; it will not run again"
        )
    if state == "resolved_ran":
        return ToolCallDone(
            f"the call '{call_id}' ran once already (an operator's resolution); it has no "
            "stored result and will not run again"
        )
    return ToolCallInDoubt(
        f"the outcome of the call '{call_id}' is unknown (it timed out or lost its connection): "
        "it will not be run again until an operator resolves it"
    )
