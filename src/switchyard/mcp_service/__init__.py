"""Governed MCP tool calls: what `/mcp` does between a client's `tools/call` and the tool.

The model choosing a tool is not permission to run it (policy/tool_calls.py governs what
a model *proposes*); here the call is about to *run*, so, in order, before anything
reaches the tool server:

1. the tool exists and the tenant may have it run (`tools.allow`/`deny`/`tenant_allow`,
   the registry's `allowed_tenants`): else an error, and `tools/list` never shows it;
2. the task (`x-task-id`) admits it: neither cancelled nor past its deadline, and one
   of its `tool_calls` and the tool's price (`mcp.servers[].tool_prices`, against
   `cost_usd`) are reserved, or the call is refused naming the budget that ran out. A
   tool call may be a task's first step (its `x-task-budget`, `x-task-timeout` and
   `x-task-deadline` then set the task's rules, as a model call's do). The deadline
   caps the call's timeout, as does the server's `timeout_s`. When the call ends, a
   call that was never sent gives its reservation back; one that was sent is charged
   its price; a repeat answered with the stored result counts as a tool call, at no
   price;
3. a side-effecting call (the registry's class, else `tools.default_class`) or one
   that `requires_approval` is identified by its call id (`_meta.call_id`, else the
   header `x-switchyard-call-id`) and claimed in the shared store
   (state/tool_calls.py): a repeat gets the first one's result, a concurrent repeat
   waits for it, a call in doubt is refused. With `mcp.require_call_id`, a side
   effect without an id is refused;
4. a tool that `requires_approval` needs an approval token for that call id
   (`x-switchyard-approval`, or `_meta.approval`), consumed once (ApprovalStore); in a
   task the approval covers only the tool and arguments the task's record gives the
   id (`approval_scope_refusal`). A stored result answers the task it ran in; a repeat
   from another task needs an approval of its own first;
5. the server's circuit breaker (state/breakers_memory.py, config `mcp.servers[].breaker`)
   lets it through: while it is open after repeated failures (timeouts, lost
   connections, server errors), calls fail at once, unsent (`tool_circuit_open`);
   after the cool-down one probe goes through;
6. the call is forwarded (engines/mcp_servers.py). A timeout, a lost connection or a
   server error after sending leaves a side effect `in_doubt`; a read-only call that
   lost its connection or met a server error is tried once more;
7. a result larger than `mcp.max_result_bytes` is neither passed on nor stored: the
   client gets `tool_result_too_large`, and a recorded side effect is `too_large` —
   it ran, so it is done (never in doubt, never re-run), with no result for repeats.

Each call is a step of its task (its result's `_meta` names its request id,
`switchyard/request_id`, for the client's next step to name as a parent): a usage row (endpoint `tools.call`, model = the
namespaced tool, status, duration, the tool's price when it was sent) and a trace whose decisions carry the tool's
PII-masked arguments and result, so the task's analysis sees the tool's time.

This module decides (steps 1 to 4, and the breaker's refusal before anything is spent);
mcp_service/calls.py forwards, records a claimed call's outcome and maps results and
errors (steps 5 to 7).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

import orjson

from switchyard import outcomes
from switchyard.config import Settings
from switchyard.engines.mcp_servers import McpServers
from switchyard.errors import (
    ApprovalRequired,
    CallIdRequired,
    InvalidCallId,
    SwitchyardError,
    TaskStateUnavailable,
    ToolNotAllowed,
    ToolServerUnavailable,
    UnknownTool,
)
from switchyard.identity import Principal, TaskBudget
from switchyard.mcp_service.calls import (
    _CLAIM_REASONS,
    MAX_EXCERPT,
    REQUEST_ID,
    Answer,
    Forward,
    McpCalls,
    Spend,
    Unmasked,
    _circuit_open,
    _claim_error,
    _with_request_id,
)
from switchyard.pipeline import RequestContext, RequestInput, Timings, new_request_id
from switchyard.policy.admit import principal_scopes
from switchyard.policy.headers import CREDENTIAL_SHAPED, ID_PATTERN
from switchyard.policy.pii_secrets import credential_shaped
from switchyard.policy.stages import Reserver, task_error, task_refusal_reason
from switchyard.policy.tasks import Running
from switchyard.policy.tool_calls import ToolPolicy, approval_scope_refusal, args_digest
from switchyard.request import Generation
from switchyard.state.breakers_memory import CircuitBreaker
from switchyard.state.ledger_rows import Finished
from switchyard.state.limits import LimiterUnavailable
from switchyard.state.tasks import TaskFirst, TaskStore
from switchyard.state.tool_calls import ToolCallRecords

# The face: what callers import from here, the parts' names included (mcp_service/calls.py).
__all__ = [
    "ENDPOINT",
    "MAX_CALL_ID",
    "MAX_EXCERPT",
    "REPLY_ROOM",
    "REQUEST_ID",
    "STALE_MARGIN_S",
    "UNKNOWN_TOOL",
    "Answer",
    "Caller",
    "ConsumeApproval",
    "Forward",
    "McpToolService",
    "Spend",
    "Unmasked",
]

log = logging.getLogger("switchyard.mcp")
ENDPOINT = "tools.call"
MAX_CALL_ID = 128
MAX_TOOL_NAME = 200  # characters of a tool's name looked up (a longer one names none)
# What the ledger and the trace name a call of a tool that does not exist: the client's
# name for it is free text (it may carry anything, PII included) and is not kept.
UNKNOWN_TOOL = "(unknown tool)"
# A call still `in_flight` this long past its server's timeout lost its owner (a gateway
# that stopped mid-call): it is in doubt.
STALE_MARGIN_S = 60.0
REPLY_ROOM = 64 * 1024  # bytes of a tool server's reply beyond mcp.max_result_bytes

ConsumeApproval = Callable[
    [str, str, str | None, str, str], Awaitable[tuple[str | None, str | None]]
]


@dataclass(frozen=True, slots=True)
class Caller:
    """Who calls and what the HTTP request said, each value bounded where it was read
    (api/mcp.py)."""

    principal: Principal
    task_id: str | None = None
    call_id: str | None = None  # x-switchyard-call-id
    approvals: tuple[str, ...] = ()  # x-switchyard-approval
    timeout_s: float | None = None  # x-request-timeout
    parents: tuple[str, ...] = ()  # x-parent-request-id
    traceparent: str | None = None  # W3C trace context, for the OpenTelemetry span
    # What this call sets if it is its task's first step: x-task-budget (may only lower
    # the tenant's and key's), x-task-timeout, x-task-deadline (unix seconds).
    task_budget: TaskBudget | None = None
    task_timeout_s: float | None = None
    task_deadline_at: float | None = None
    # Writes the client's reply: given, a result is handed to it once the call's limits
    # and task are settled, and the call's trace, usage row and metrics are recorded
    # after it, so their work (the PII masking of the excerpts among it) is off the
    # client's wait (api/mcp.py's hot path). Without it (and for a refusal or a
    # failure) they are recorded before the call returns.
    answer: Answer | None = None


def _call_id(value: Any, where: str) -> str:
    """A client's call id, kept in tool-call records and traces as sent: bounded, and
    never a credential or personal number by its shape (refused, never stored)."""
    if isinstance(value, str) and len(value) <= MAX_CALL_ID and ID_PATTERN.fullmatch(value):
        if not credential_shaped(value):
            return value
        raise InvalidCallId(f"{where} {CREDENTIAL_SHAPED}", param=where)
    raise InvalidCallId(
        f"{where} must be 1 to {MAX_CALL_ID} characters of A-Z a-z 0-9 . _ : -", param=where
    )


class McpToolService(McpCalls):
    """The tool half of agent tasks (see the module docstring)."""

    def __init__(
        self,
        settings: Settings,
        servers: McpServers,
        records: ToolCallRecords,
        consume_approval: ConsumeApproval,
        tasks: TaskStore,
        running: Running,
        ledger: Any,
        mask: Callable[[str], str],
        metrics: Any = None,
        tracing: Any = None,
        reserver: Reserver | None = None,
    ) -> None:
        """`reserver`: the key's and tenant's limits (rpm, concurrency, budget), each
        call reserving as one request (no tokens, no cost), as a model call does."""
        self.settings = settings
        self.reserver = reserver
        self.servers = servers
        self.policy = ToolPolicy(settings.tools)
        self.records = records
        self.consume_approval = consume_approval
        self.tasks = tasks
        self.running = running
        self.ledger = ledger
        self.mask = mask
        self.metrics = metrics
        self.tracing = tracing
        self._default_budget = TaskBudget.of(settings.tasks.budget)
        for server in servers.servers.values():  # shown by the server's describe()
            server.breaker = CircuitBreaker(server.name, server.cfg.breaker)
            # A reply is read up to the result limit and room for its JSON-RPC envelope;
            # past that the result would be refused anyway (engines/mcp_forward.py).
            server.max_reply_bytes = settings.mcp.max_result_bytes + REPLY_ROOM

    # -- tools/list ----------------------------------------------------------
    def list_tools(self, principal: Principal) -> list[dict[str, Any]]:
        """The tools this tenant may have run, by their namespaced names."""
        tenant = principal.tenant_id
        return [t for t in self.servers.catalog() if self.policy.refusal(t["name"], tenant) is None]

    # -- tools/call ----------------------------------------------------------
    async def call(
        self,
        who: Caller,
        name: str,
        arguments: Mapping[str, Any] | None,
        meta: Mapping[str, Any] | None,
        check: Callable[[], None] | None = None,
    ) -> dict[str, Any]:
        """The CallToolResult (as JSON) of a governed call, handed to `who.answer` when
        there is one (see Caller); raises a SwitchyardError. `check`: the wire's bounds
        of the name and arguments, run first (a SwitchyardError: the call is refused
        before anything is reserved, and recorded as every refusal is)."""
        answer = who.answer
        found = self.servers.resolve(name) if len(name) <= MAX_TOOL_NAME else None
        known = found is not None and found[1] in found[0].tools
        ctx = self._context(who, name if known else UNKNOWN_TOOL)
        status = "error"
        later = False  # the records wait for `answer`
        reserver = self.reserver
        spend = Spend()
        # The tool's price counts against the key's and tenant's budget_usd as against
        # the task's: reserved before anything reaches the tool, settled with what was
        # charged (the price if the call was sent, else nothing).
        price = float(found[0].cfg.tool_prices.get(found[1], 0.0)) if known and found else 0.0
        try:
            if check is not None:
                t = time.perf_counter()
                try:
                    check()
                except SwitchyardError as exc:
                    ctx.record("validate", outcomes.reject(exc.code), exc.message, t)
                    raise
            scopes = principal_scopes(who.principal) if reserver is not None else []
            if reserver is not None and scopes:  # before anything reaches the tool
                await reserver.reserve(ctx, scopes, "admit", (0, 0, None), fixed_usd=price)
            args, extra = dict(arguments or {}), dict(meta or {})
            result = await self._call(ctx, who, name, args, extra, spend)
            spend.answered = True
            status = "tool_error" if result.get("isError") else "ok"
            reply = _with_request_id(result, ctx.input.request_id)
            later = answer is not None
        except SwitchyardError as exc:
            ctx.error_code = exc.code
            raise
        except asyncio.CancelledError:
            ctx.error_code = "cancelled"
            raise
        finally:
            ctx.run.cost_usd = spend.cost  # what the limits below settle with
            if reserver is not None:
                pending = reserver.settle(ctx, "admit")
                if pending is not None:
                    await asyncio.shield(pending)
            if spend.task is not None:
                await asyncio.shield(self._settle_task(ctx, spend))
            ctx.timings.ended = time.perf_counter()
            ctx.finished = True
            if not later:
                self._record(ctx, name if known else None, status, spend.cost)
        if answer is not None:
            try:
                await answer(reply)
            finally:
                self._record(ctx, name if known else None, status, spend.cost)
        return reply

    def _record(self, ctx: RequestContext, tool: str | None, status: str, cost: float) -> None:
        """The call's usage row, trace and metrics (`tool`: None for an unknown one), its
        excerpts masked first: nothing of them is kept unmasked."""
        decisions = ctx.decisions
        for i, d in enumerate(decisions):
            ev = d.evidence
            if ev is not None and any(type(v) is Unmasked for v in ev.values()):
                decisions[i].evidence = {
                    k: v.masked(self.mask) if type(v) is Unmasked else v for k, v in ev.items()
                }
        self.ledger.record(Finished(ctx, status, 0, 0, cost))
        if self.tracing is not None:
            self.tracing.finish(ctx, status, 0, 0, time.time_ns())
        ended = ctx.timings.ended
        if self.metrics is not None and tool is not None and ended is not None:
            self.metrics.tool_call(
                tool.partition("__")[0], tool, status, ended - ctx.timings.received
            )

    def _context(self, who: Caller, name: str) -> RequestContext:
        now = time.perf_counter()
        inp = RequestInput(
            new_request_id(),
            ENDPOINT,
            time.time(),
            task_id=who.task_id,
            parent_request_ids=who.parents,
        )
        ctx = RequestContext(inp, Generation(model=name), Timings(now), now + 3600.0)
        ctx.principal = who.principal
        ctx.alias = name
        if self.tracing is not None:
            parent = {"traceparent": who.traceparent} if who.traceparent else {}
            self.tracing.start_request(ctx, parent, time.time_ns())
        return ctx

    async def _call(
        self,
        ctx: RequestContext,
        who: Caller,
        name: str,
        arguments: dict[str, Any],
        meta: dict[str, Any],
        spend: Spend,
    ) -> dict[str, Any]:
        t = time.perf_counter()
        tenant = who.principal.tenant_id
        found = self.servers.resolve(name)
        why = self.policy.refusal(name, tenant)
        if found is None or found[1] not in found[0].tools:
            ctx.record("tool_auth", outcomes.ToolAuth.REJECT_UNKNOWN, "no such tool", t)
            raise UnknownTool(f"unknown tool '{name}'", param="name")
        if why is not None:
            ctx.record("tool_auth", outcomes.ToolAuth.REJECT_FORBIDDEN, why, t, {"tool": name})
            raise ToolNotAllowed(f"this key may not run the tool '{name}'", param="name")
        server, tool = found
        cls = self.policy.tool_class(name)
        approval = self.policy.requires_approval(name)
        ctx.record(
            "tool_auth",
            outcomes.ToolAuth.OK,
            "the tenant may run it",
            t,
            {"tool": name, "class": cls},
        )

        open_for = server.breaker.refusal(time.monotonic())
        if open_for is not None:  # before the budget, a claim or an approval is spent
            raise _circuit_open(ctx, server, open_for, t, {"server": server.name, "tool": tool})
        if server.state != "ready":  # nor on a call that could not be sent
            why = f"the tool server '{server.name}' is {server.state}"
            ctx.record("tool_exec", outcomes.ToolExec.UNAVAILABLE, why, t, {"server": server.name})
            raise ToolServerUnavailable(f"the tool server '{server.name}' is unavailable")
        spend.price = float(server.cfg.tool_prices.get(tool, 0.0))
        timeout = await self._admit_task(ctx, who, spend, server.cfg.timeout_s)
        keyed = cls == "side_effect" or approval
        digest = args_digest(name, arguments) if keyed else ""  # only a keyed call's is read
        call_id = await self._identify(ctx, who, meta, keyed, name, digest)
        if keyed and call_id is None:
            if approval:
                raise ApprovalRequired(
                    f"the tool '{name}' requires an approval: send the call id in "
                    "_meta.call_id or x-switchyard-call-id, with an approval token for it "
                    "(x-switchyard-approval) issued by an operator (POST /admin/approvals)"
                )
            if self.settings.mcp.require_call_id:
                raise CallIdRequired(
                    f"the tool '{name}' has side effects: send its call id in _meta.call_id "
                    "or x-switchyard-call-id (mcp.require_call_id)",
                    param="_meta.call_id",
                )
        evidence: dict[str, Any] = {
            "server": server.name,
            "tool": tool,
            "class": cls,
            "call_id": call_id,
            "arguments": Unmasked(orjson.dumps(arguments).decode()),
        }
        if spend.price:
            evidence["price_usd"] = spend.price
        call = Forward(ctx, server, tool, arguments, timeout, evidence, spend)
        if not keyed or call_id is None:
            ctx.record(
                "tool_once", outcomes.ToolOnce.SKIP, "read-only or unidentified: not recorded", t
            )
            return await self._run(call, retry=not keyed)

        t = time.perf_counter()
        wait_until = time.perf_counter() + min(timeout, self.settings.mcp.wait_s)
        claim = await self.records.claim(
            tenant,
            call_id,
            who.task_id,
            name,
            digest,
            ctx.input.request_id,
            wait_until,
            stale_after_s=server.cfg.timeout_s + STALE_MARGIN_S,
        )
        if claim.state != "owner":
            ctx.record(
                "tool_once",
                outcomes.ToolOnce(claim.state),
                _CLAIM_REASONS.get(claim.state, claim.state),
                t,
                {"call_id": call_id, "ran_in": claim.request_id},
            )
            if claim.state == "done" and claim.result is not None:
                # A stored result answers the task it ran in (whose approval it
                # consumed); another task's repeat needs an approval of its own.
                if approval and claim.task != who.task_id:
                    await self._approve(ctx, who, meta, name, call_id, digest)
                spend.answered = True
                return claim.result
            raise _claim_error(claim.state, call_id)
        ctx.record(
            "tool_once",
            outcomes.ToolOnce.OWNER,
            "first request with this call id: runs it",
            t,
            {"call_id": call_id},
        )
        try:
            if approval:
                await self._approve(ctx, who, meta, name, call_id, digest)
        except BaseException:
            await self.records.release(tenant, call_id)
            raise
        return await self._run_once(call, call_id)

    async def _admit_task(
        self, ctx: RequestContext, who: Caller, spend: Spend, server_s: float
    ) -> float:
        """The call's timeout: the server's, capped by x-request-timeout and the task's
        deadline. In a task, the call is admitted first (one of its `tool_calls` and the
        tool's price reserved) or refused: cancelled, past its deadline, or the budget
        that ran out named."""
        timeout = server_s if who.timeout_s is None else min(server_s, who.timeout_s)
        if who.task_id is None:
            return timeout
        t = time.perf_counter()
        p = who.principal
        budget = self._default_budget
        if p.task_budget is not None:
            budget = budget.lower(p.task_budget)
        if who.task_budget is not None:
            budget = budget.lower(who.task_budget)
        first = TaskFirst(budget, who.task_timeout_s, who.task_deadline_at)
        key = (p.tenant_id, who.task_id)
        now = time.time()
        rid = ctx.input.request_id
        try:
            adm = await self.tasks.admit(key, first, rid, 0, spend.price, now, tool=True)
        except LimiterUnavailable:
            if self.settings.policy.on_limiter_failure == "fail_open":
                log.warning("task state unavailable, admitting a tool call (fail_open)")
                ctx.record("task", outcomes.Task.FAIL_OPEN, "task state unavailable", t)
                return timeout
            ctx.record("task", outcomes.Task.REJECT_UNAVAILABLE, "task state unavailable", t)
            raise TaskStateUnavailable("task state unavailable; refusing (fail_closed)") from None
        evidence = adm.evidence(now)
        if adm.refused is not None:
            reason = task_refusal_reason(adm.refused)
            ctx.record("task", outcomes.reject(adm.refused), reason, t, evidence)
            raise task_error(who.task_id, adm.refused, adm)
        spend.task = key
        if adm.deadline_at is not None:
            timeout = min(timeout, adm.deadline_at - now)
        evidence["timeout_s"] = round(timeout, 3)
        ctx.record(
            "task", outcomes.Task.ADMITTED, "within the task's budget and deadline", t, evidence
        )
        return timeout

    async def _settle_task(self, ctx: RequestContext, spend: Spend) -> None:
        """The task keeps the call (and its price, when it was sent), or has it back."""
        assert spend.task is not None
        called = spend.sent or spend.answered
        try:
            await self.tasks.settle(spend.task, ctx.input.request_id, 0, spend.cost, called)
        except LimiterUnavailable:
            log.warning("could not settle the task of tool call %s", ctx.input.request_id)

    async def _identify(
        self,
        ctx: RequestContext,
        who: Caller,
        meta: dict[str, Any],
        keyed: bool,
        name: str,
        digest: str,
    ) -> str | None:
        """The call's id: `_meta.call_id`, else `x-switchyard-call-id`, else (a keyed
        call in a task, from a client that sends no ids, such as the OpenAI Agents SDK)
        the id of the task's latest proposed call of this tool with these arguments."""
        value = meta.get("call_id")
        if value is not None:
            return _call_id(value, "_meta.call_id")
        if who.call_id is not None or not keyed or who.task_id is None:
            return who.call_id
        t = time.perf_counter()
        try:
            task = await self.tasks.describe((who.principal.tenant_id, who.task_id))
        except LimiterUnavailable:
            task = None
        for note in reversed((task or {}).get("tool_calls") or []):
            if note.get("tool") == name and note.get("args_digest") == digest:
                ctx.record(
                    "tool_call_id",
                    outcomes.ToolCallId.MATCHED,
                    "the task's proposed call of this tool with these arguments",
                    t,
                    {"call_id": note["call_id"], "proposed_in": note.get("request_id")},
                )
                return str(note["call_id"])
        return None

    async def _approve(
        self,
        ctx: RequestContext,
        who: Caller,
        meta: dict[str, Any],
        name: str,
        call_id: str,
        digest: str,
    ) -> None:
        """Consume an approval of `call_id` for this call, or raise ApprovalRequired. In a
        task, an approval covers the tool and arguments the task's record gives the call
        id (`approval_scope_refusal`): a call that names the id with another tool or other
        arguments is refused before any token is spent."""
        t = time.perf_counter()
        why_not_scope = await self._out_of_scope(who, call_id, digest)
        if why_not_scope is not None:
            ctx.record(
                "approval",
                outcomes.Approval.REJECT_APPROVAL,
                why_not_scope,
                t,
                {"call_id": call_id},
            )
            raise ApprovalRequired(
                f"the tool '{name}' requires an approval for call '{call_id}' "
                f"({why_not_scope}): the task's record of the id names the call that was "
                "approved"
            )
        tokens = list(who.approvals)
        given = meta.get("approval")
        if isinstance(given, str) and 0 < len(given) <= 128:
            tokens.append(given)
        why = "no approval token was sent"
        for token in tokens[:16]:
            approver, why_not = await self.consume_approval(
                token, who.principal.tenant_id, who.task_id, call_id, ctx.input.request_id
            )
            if approver is not None:
                ctx.record(
                    "approval",
                    outcomes.Approval.APPROVED,
                    f"approved by {approver}",
                    t,
                    {"call_id": call_id, "approver": approver},
                )
                return
            why = why_not or why
        ctx.record("approval", outcomes.Approval.REJECT_APPROVAL, why, t, {"call_id": call_id})
        raise ApprovalRequired(
            f"the tool '{name}' requires an approval for call '{call_id}' ({why}): ask an "
            "operator for one (POST /admin/approvals or `switchyard approve`) and "
            "send it in the x-switchyard-approval header"
        )

    async def _out_of_scope(self, who: Caller, call_id: str, digest: str) -> str | None:
        """Why no approval of `call_id` covers this call (its tool and arguments are not
        those the task's record gives the id), or None. Task state unavailable: refused
        unless the policy fails open."""
        if who.task_id is None:
            return None
        try:
            note = await self.tasks.tool_call((who.principal.tenant_id, who.task_id), call_id)
        except LimiterUnavailable:
            if self.settings.policy.on_limiter_failure == "fail_open":
                return None
            return "the task's record of its calls is unavailable"
        return approval_scope_refusal(call_id, note.args if note is not None else None, [digest])
