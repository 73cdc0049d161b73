"""The tool_results stage: the tool results a chat request carries (policy/tool_calls.py),
each checked for the approval its call needs and, in a task, counted once.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from switchyard import outcomes
from switchyard.errors import ApprovalRequired, InvalidRequest
from switchyard.pipeline import RequestContext, Stage, Verdict, View
from switchyard.policy.tool_calls import (
    NeededApproval,
    ToolPolicy,
    ToolResult,
    approval_scope_refusal,
    approval_tokens,
    approvals_needed,
    new_results,
    tool_results,
)
from switchyard.state.tasks import TaskKey, TaskStore, ToolCallNote

log = logging.getLogger("switchyard")

# ApprovalStore.consume off the event loop: (token, tenant, task, call id, request id).
ConsumeApproval = Callable[
    [str, str, "str | None", str, str], Awaitable[tuple["str | None", "str | None"]]
]
# ApprovalStore.consumed off the event loop: (tenant, task, call ids) → those approved.
ConsumedApprovals = Callable[[str, "str | None", list[str]], Awaitable[set[str]]]
# ApprovalStore.give_back off the event loop: (tenant, request id, call ids) → how many.
GiveBackApprovals = Callable[[str, str, list[str]], Awaitable[int]]


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
        give_back: GiveBackApprovals | None = None,
    ) -> None:
        self._policy = policy
        self._store = store
        self._consume = consume
        self._consumed = consumed or _none_consumed
        self._give_back = give_back
        # request id → (tenant, the call ids whose approvals it consumed), until release.
        self._taken: dict[str, tuple[str, list[str]]] = {}
        # request id → (its task, the call ids whose results it counted), until release.
        self._counted: dict[str, tuple[TaskKey, list[str]]] = {}

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
        if needed and notes:
            self._in_scope(ctx, results, needed, notes, t)
        approved, reused = await self._approve(ctx, needed, t) if needed else ([], [])
        ids = new_results(results, counts)
        noted = await self._store.note_results(key, ids) if key is not None and ids else {}
        if noted:
            assert key is not None
            self._counted[ctx.input.request_id] = (key, list(noted))
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

    def _in_scope(
        self,
        ctx: RequestContext,
        results: list[ToolResult],
        needed: list[NeededApproval],
        notes: dict[str, ToolCallNote],
        t: float,
    ) -> None:
        """Raise ApprovalRequired when the history gives a call that needs an approval
        another tool or other arguments than the task's record of it: the approval,
        consumed now or before, covers the call that was proposed
        (`approval_scope_refusal`), not the one the history claims."""
        for n in needed:
            note = notes.get(n.approval_id)
            if note is None:
                continue
            given = [d for r in results if r.call_id == n.approval_id for d in r.digests]
            why = approval_scope_refusal(n.approval_id, note.args, given)
            if why is None:
                continue
            ctx.record(
                self.name,
                outcomes.ToolResults.REJECT_APPROVAL_REQUIRED,
                f"the result of {n.approval_id} ({n.tool}) needs an approval: {why}",
                t,
                {"call_id": n.approval_id, "tool": n.tool, "approved": []},
            )
            raise ApprovalRequired(
                f"the result of the tool call '{n.approval_id}' ({n.tool}) needs an "
                f"approval (x-switchyard-approval): {why}",
                param="x-switchyard-approval",
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
            if self._give_back is not None:
                taken = self._taken.setdefault(ctx.input.request_id, (tenant, []))
                taken[1].append(n.approval_id)
        return approved, reused

    def release(self, ctx: RequestContext) -> Awaitable[None] | None:
        """A request that never went upstream (refused after this stage: admission, a
        full queue; or refused here, after some of its approvals were consumed) gives
        back what it took: its approvals, which approved nothing yet (its retry presents
        them), and the results it counted, which reached no model (its retry is no
        duplicate)."""
        rid = ctx.input.request_id
        taken = self._taken.pop(rid, None) if self._taken else None
        counted = self._counted.pop(rid, None) if self._counted else None
        if (taken is None and counted is None) or ctx.run.attempts > 0:
            return None
        return self._return(rid, taken, counted)

    async def _return(
        self,
        rid: str,
        taken: tuple[str, list[str]] | None,
        counted: tuple[TaskKey, list[str]] | None,
    ) -> None:
        try:
            if taken is not None and self._give_back is not None:
                await self._give_back(taken[0], rid, taken[1])
            if counted is not None:
                await self._store.unnote_results(*counted)
        except Exception as exc:  # a store unreachable: logged; what it took stays taken
            log.warning("could not give back what %s took: %s", rid, exc)
