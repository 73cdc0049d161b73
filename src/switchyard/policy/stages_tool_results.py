"""The tool_results stage: the tool results a chat request carries (policy/tool_calls.py),
each checked for the approval its call needs and, in a task, counted once.
"""

from __future__ import annotations

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
    approval_tokens,
    approvals_needed,
    new_results,
    tool_results,
)
from switchyard.state.tasks import TaskStore, ToolCallNote

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
