"""Tool calls under governance: the model choosing a tool is not permission to run it.

Shortlisting (decide/tools.py) decides which tools are *offered*; this module checks
what the model *returns* and what the client sends back:

* **Authorization on model outputs.** Every tool call in a reply is checked against
  the tenant's permissions (`tools.deny`, `tools.allow`, `tools.tenant_allow` and the
  registry's `allowed_tenants`). A forbidden call is removed (`tools.on_forbidden_call:
  block`) or relayed and flagged (`flag`); either way it is a decision in the trace.
  When blocking removes every call of a choice, its `finish_reason` becomes "stop".
  A streamed call is checked when its name arrives, before any of it is relayed.
* **Idempotency keys for side effects.** A call to a `side_effect` tool (the
  registry's class, else `tools.default_class`) gets the id `call_sy_<key>`, where key
  is the first 32 hex digits of BLAKE2b over (tenant, task id, the step's lineage,
  tool name, canonical JSON of the arguments); the lineage is the step's
  `x-parent-request-id` list and a digest of the conversation it was asked with. A
  retried or replayed step therefore yields the same key, and whatever runs the tool
  can refuse to run it twice. A later call of the same tool with the same arguments in
  one choice of a reply is keyed with its ordinal (1, 2, ...) under a BLAKE2b
  personalization of its own, so each call has an id of its own, in the same order
  when the step is retried. A streamed side-effecting call is held until its
  arguments are complete and then relayed whole (its key needs them). A call to a
  tool that `requires_approval` is keyed the same way, with the prefix `call_sya_`.
* **Results and approvals** (the `tool_results` stage): every tool result a request
  carries is checked, wherever it sits in the history and whichever role carries it
  (`tool`, or a legacy `function` message), at most MAX_TOOL_RESULTS of them (more
  is a 400, never a partial check). A result needs an approval (`x-switchyard-approval`),
  issued by an operator, scoped to tenant, task and call, single-use and expiring
  (`ApprovalStore`), when its id has the prefix `call_sya_` (whatever tool the
  conversation names for it: outside a task the gateway keeps no note of its calls,
  and the client writes the history) or when any name given to it (its own `name`,
  the assistant tool calls with its id, the task's record of the call, the
  `function_call` a legacy result answers) is a tool that `requires_approval`. A
  call id needs its approval once: one already consumed for (tenant, call id) covers
  the later turns that carry the result as history. A legacy function result has no
  id, so it is matched by name: each one, in every request that carries it, needs
  its own approval for the call id `function:<name>`. An approval covers the call
  proposed under its id: in a task whose record has the call's (tool, arguments)
  digest, a history (or an /mcp call) that gives the id another tool or other
  arguments is refused (`approval_scope_refusal`, the one rule for every path that
  consumes or reuses an approval). In a task, the results brought
  for the first time are counted (those after the last assistant message, and any
  earlier one whose call the task's record shows no result for); a result for a call
  that already had one is flagged as a duplicate side effect.

The code is in three modules beside this one, which re-exports their names:
tool_calls_governor.py (the policy, idempotency keys, the governor of one request's
calls), tool_calls_gate.py (the reply part, whole replies and streams) and
tool_calls_approvals.py (tool results and their approvals); the approvals' store is
state/approvals.py.
"""

from __future__ import annotations

from switchyard.policy.tool_calls_approvals import (
    FUNCTION_RESULT_PREFIX,
    MAX_APPROVALS_PER_REQUEST,
    MAX_TOOL_RESULTS,
    NeededApproval,
    ToolResult,
    approval_scope_refusal,
    approval_tokens,
    approvals_needed,
    new_results,
    tool_results,
)
from switchyard.policy.tool_calls_gate import StreamToolGate, ToolGate, record_tool_calls
from switchyard.policy.tool_calls_governor import (
    APPROVAL_CALL_PREFIX,
    KEYED_PREFIX,
    ToolGovernor,
    ToolOutcome,
    ToolPolicy,
    args_digest,
    canonical_arguments,
    idempotency_key,
    lineage,
)

__all__ = [
    "APPROVAL_CALL_PREFIX",
    "FUNCTION_RESULT_PREFIX",
    "KEYED_PREFIX",
    "MAX_APPROVALS_PER_REQUEST",
    "MAX_TOOL_RESULTS",
    "NeededApproval",
    "StreamToolGate",
    "ToolGate",
    "ToolGovernor",
    "ToolOutcome",
    "ToolPolicy",
    "ToolResult",
    "approval_scope_refusal",
    "approval_tokens",
    "approvals_needed",
    "args_digest",
    "canonical_arguments",
    "idempotency_key",
    "lineage",
    "new_results",
    "record_tool_calls",
    "tool_results",
]
