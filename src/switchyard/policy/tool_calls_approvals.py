"""Tool results and their approvals: the `tool_results` stage's checks.

Owns finding every tool result a conversation carries (`tool_results`, at most
MAX_TOOL_RESULTS), which of them need an approval (`approvals_needed`), which are
brought for the first time (`new_results`) and the `x-switchyard-approval` header's
tokens. The approvals themselves (`ApprovalStore`: issued, single-use, expiring) are
state/approvals.py's. The rules are told in policy/tool_calls.py's docstring.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from switchyard.errors import InvalidHeader, InvalidRequest, TooManyToolResults
from switchyard.policy.tool_calls_governor import (
    APPROVAL_CALL_PREFIX,
    ToolPolicy,
    _obj,
    args_digest,
    canonical_arguments,
)

# The most tool results (tool and function messages) a request's history may carry
# where they are checked: each costs a look-up, and one left unchecked would be a
# way past the gate, so a longer history is refused (400), never checked in part.
MAX_TOOL_RESULTS = 256
# The call id an approval of a legacy `function` result names: such a result has no
# id of its own, only the function's name.
FUNCTION_RESULT_PREFIX = "function:"


@dataclass(frozen=True, slots=True)
class ToolResult:
    """One tool result anywhere in a conversation: a `tool` message (its call id) or
    a legacy `function` message (no id; `call_id` is None)."""

    index: int  # its position in `messages`
    call_id: str | None
    # Every tool name the conversation gives it: the message's own `name`, the
    # assistant tool calls with its id, or (legacy) the `function_call` it answers.
    names: frozenset[str]
    trailing: bool  # after the last assistant message: brought by this request
    # The (tool, arguments) digest (`args_digest`) of every assistant tool call of the
    # history with its id that states arguments: what the conversation claims was
    # called under it.
    digests: frozenset[str] = frozenset()


@dataclass(frozen=True, slots=True)
class NeededApproval:
    """A result the request may forward only with an approval for `approval_id`."""

    approval_id: str  # the call id the approval must name
    tool: str  # for the reason given to the client and the trace
    index: int  # the (first) message it was found in
    # A call id, which names one call: an approval already consumed for it (an
    # earlier turn of the same conversation) still covers it. A legacy function
    # result has no such identity, so it never is covered by an earlier approval.
    reusable: bool


def _name(value: Any) -> str | None:
    return value if isinstance(value, str) and value else None


def _called(messages: list[Any]) -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """(call id → the names, call id → the (tool, arguments) digests) every assistant
    message of the history gives that call."""
    called: dict[str, set[str]] = {}
    digests: dict[str, set[str]] = {}
    for m in messages:
        if isinstance(m, dict) and m.get("role") == "assistant":
            calls = m.get("tool_calls")
            for call in calls if isinstance(calls, list) else []:
                if isinstance(call, dict) and isinstance(call.get("id"), str):
                    fn = _obj(call.get("function"))
                    name = _name(fn.get("name"))
                    called.setdefault(call["id"], set()).update([name] if name else [])
                    stated = _stated(fn.get("arguments"))
                    if stated is not None:
                        digests.setdefault(call["id"], set()).add(args_digest(name or "", stated))
    return called, digests


def _stated(arguments: Any) -> Any:
    """The arguments a history's tool call states, or None where it states none (absent,
    empty, or `{}`): such a call claims nothing about what ran, so there is nothing to
    compare with the task's record (the model reads no other recipient or amount)."""
    if arguments is None or arguments == "" or arguments == {}:
        return None
    if isinstance(arguments, str) and canonical_arguments(arguments) == b"{}":
        return None
    return arguments


def approval_scope_refusal(call_id: str, recorded: str | None, given: Iterable[str]) -> str | None:
    """Why an approval of `call_id` does not cover the call as it is given now, or None.

    The one rule for every path that consumes or reuses an approval (the /mcp service and
    the `tool_results` stage): an approval covers the call that was proposed under its id,
    as the task's record of it says (`ToolCallNote.args`, the digest of its tool and
    canonical arguments: `recorded`); a call or a history that gives the id another tool
    or other arguments (`given`: their digests) is not covered. Without a record of the
    id (outside a task, or an id the gateway never relayed) there is nothing to compare:
    the approval names the call id alone."""
    if recorded is None:
        return None
    if any(d != recorded for d in given):
        return (
            f"the approval of '{call_id}' covers the call proposed under that id; "
            "this one gives it another tool or other arguments"
        )
    return None


def tool_results(messages: list[dict[str, Any]] | None) -> list[ToolResult]:
    """Every tool result of the conversation, wherever it sits and whatever role
    carries it: the client writes the whole history, so a result placed before an
    assistant turn is as much its word as one at the end. More than
    MAX_TOOL_RESULTS, a `tool` message without a call id or a `function` message
    without a name is a 400 (a result that cannot be told apart cannot be checked)."""
    if messages is None:
        return []
    last = max(
        (i for i, m in enumerate(messages) if isinstance(m, dict) and m.get("role") == "assistant"),
        default=-1,
    )
    called, digests = _called(messages)
    answered: str | None = None  # the function_call of the latest assistant message
    out: list[ToolResult] = []
    for i, m in enumerate(messages):
        role = m.get("role") if isinstance(m, dict) else None
        if role == "assistant":
            answered = _name(_obj(m.get("function_call")).get("name"))
        if role not in ("tool", "function"):
            continue
        if len(out) == MAX_TOOL_RESULTS:
            raise TooManyToolResults(
                f"at most {MAX_TOOL_RESULTS} tool results (tool and function messages) per request",
                param="messages",
            )
        own = _name(m.get("name"))
        if role == "tool":
            cid = _name(m.get("tool_call_id"))
            if cid is None:
                raise InvalidRequest(
                    f"'messages[{i}].tool_call_id' must name the tool call it answers",
                    param=f"messages[{i}].tool_call_id",
                )
            names = called.get(cid, set()) | ({own} if own else set())
            given = frozenset(digests.get(cid, ()))
            out.append(ToolResult(i, cid, frozenset(names), i > last, given))
            continue
        if own is None:
            raise InvalidRequest(
                f"'messages[{i}].name' is required for role 'function'",
                param=f"messages[{i}].name",
            )
        names = {own} | ({answered} if answered else set())
        out.append(ToolResult(i, None, frozenset(names), i > last))
    return out


def approvals_needed(
    results: list[ToolResult], policy: ToolPolicy, noted: Mapping[str, str]
) -> list[NeededApproval]:
    """The results that need an approval, in message order: a result for a
    `call_sya_` id, or one that any name the conversation or the task's record
    (`noted`: call id → the tool the gateway relayed) gives it requires approval.
    A call id needs one approval however often its result appears; each legacy
    function result needs its own (see NeededApproval.reusable)."""
    names: dict[str, set[str]] = {}
    first: dict[str, int] = {}
    out: list[NeededApproval] = []
    for r in results:
        if r.call_id is None:
            gated = sorted(n for n in r.names if policy.requires_approval(n))
            if gated:
                fn = FUNCTION_RESULT_PREFIX + gated[0]
                out.append(NeededApproval(fn, gated[0], r.index, False))
            continue
        first.setdefault(r.call_id, r.index)
        names.setdefault(r.call_id, set()).update(r.names)
    for cid, given in names.items():
        tool = noted.get(cid)
        gated = sorted(
            n for n in given | ({tool} if tool else set()) if policy.requires_approval(n)
        )
        if gated or cid.startswith(APPROVAL_CALL_PREFIX):
            what = gated[0] if gated else tool or "a tool that requires approval"
            # An id that looks like a function result's never reuses an approval: one
            # consumed for `function:<name>` covers no later result.
            reusable = not cid.startswith(FUNCTION_RESULT_PREFIX)
            out.append(NeededApproval(cid, what, first[cid], reusable))
    return sorted(out, key=lambda n: n.index)


def new_results(results: list[ToolResult], counts: Mapping[str, int]) -> list[str]:
    """The call ids whose results this request brings for the first time, to count
    for its task: each after the last assistant message (brought now; one brought
    again is a duplicate) and each earlier one whose call the task's record knows
    with no result yet (`counts`: call id → results so far), however the history
    ordered it. A legacy function result has no id to count."""
    return [
        r.call_id
        for r in results
        if r.call_id is not None and (r.trailing or counts.get(r.call_id) == 0)
    ]


MAX_APPROVALS_PER_REQUEST = 16


def approval_tokens(value: str | None) -> list[str]:
    """`x-switchyard-approval: TOKEN[, TOKEN...]`, bounded."""
    if not value:
        return []
    from switchyard.policy.headers import approval_token

    parts = [p.strip() for p in value.split(",") if p.strip()]
    if len(value) > 130 * MAX_APPROVALS_PER_REQUEST or len(parts) > MAX_APPROVALS_PER_REQUEST:
        raise InvalidHeader(
            f"header x-switchyard-approval: at most {MAX_APPROVALS_PER_REQUEST} tokens",
            param="x-switchyard-approval",
        )
    return [approval_token(p) for p in parts]
