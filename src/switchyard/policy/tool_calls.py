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
  can refuse to run it twice. A streamed side-effecting call is held until its
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
  its own approval for the call id `function:<name>`. In a task, the results brought
  for the first time are counted (those after the last assistant message, and any
  earlier one whose call the task's record shows no result for); a result for a call
  that already had one is flagged as a duplicate side effect.
"""

from __future__ import annotations

import hashlib
import secrets
import sqlite3
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson

from switchyard.config import ToolsConfig
from switchyard.decide.tools import _denial
from switchyard.errors import InvalidHeader, InvalidRequest, TooManyToolResults
from switchyard.outcomes import Kind, Tagged, ToolCalls, tagged
from switchyard.pipeline import ReplyPart, RequestContext
from switchyard.policy.tasks import ToolCallNote
from switchyard.reply import reply_object
from switchyard.request import Generation

KEYED_PREFIX = "call_sy_"
# The id prefix of a call to a tool that requires_approval: its result needs an
# approval whatever tool the conversation the client sends back names for the id.
APPROVAL_CALL_PREFIX = "call_sya_"


def _obj(value: Any) -> dict[str, Any]:
    """`value` when it is a JSON object, else an empty one (replies are the upstream's)."""
    return value if isinstance(value, dict) else {}


class ToolPolicy:
    """The registry and permission rules of `tools` in the config."""

    def __init__(self, cfg: ToolsConfig) -> None:
        self.cfg = cfg
        self.specs = {t.name: t for t in cfg.registry}
        self.block = cfg.on_forbidden_call == "block"
        self.approvals = any(t.requires_approval for t in cfg.registry)

    def tool_class(self, name: str) -> str:
        spec = self.specs.get(name)
        return spec.tool_class if spec is not None else self.cfg.default_class

    def requires_approval(self, name: str) -> bool:
        spec = self.specs.get(name)
        return spec is not None and spec.requires_approval

    def keyed(self, name: str, cls: str) -> bool:
        """Whether a call gets an idempotency key as its id (and, streamed, is held
        until complete): a side effect, or a tool that requires approval."""
        return cls == "side_effect" or (self.approvals and self.requires_approval(name))

    def refusal(self, name: str | None, tenant: str | None) -> str | None:
        """Why the tenant may not have this tool run, or None."""
        why = _denial(name, tenant, self.cfg)
        if why is not None:
            return why
        spec = self.specs.get(name or "")
        allowed = spec.allowed_tenants if spec is not None else ["*"]
        if "*" not in allowed and tenant not in allowed:
            return f"not in tools.registry[{name!r}].allowed_tenants"
        return None


def canonical_arguments(arguments: Any) -> bytes:
    """The arguments as canonical JSON (sorted keys); a string that is not JSON as is."""
    if isinstance(arguments, str):
        try:
            arguments = orjson.loads(arguments)
        except orjson.JSONDecodeError:
            return arguments.encode("utf-8", "replace")
    return orjson.dumps(arguments, option=orjson.OPT_SORT_KEYS)


def lineage(parents: tuple[str, ...], req: Generation) -> bytes:
    """What identifies a generation step: its parents and the conversation it was
    asked with (the same for a retry or a replay of the step)."""
    convo = req.messages if req.messages is not None else req.prompt
    digest = hashlib.blake2b(
        orjson.dumps(convo, option=orjson.OPT_SORT_KEYS), digest_size=16
    ).digest()
    return ",".join(parents).encode() + b"|" + digest


def args_digest(name: str, arguments: Any) -> str:
    """What identifies a call's tool and arguments (canonical JSON), without them."""
    return hashlib.blake2b(
        name.encode() + b"\0" + canonical_arguments(arguments), digest_size=16
    ).hexdigest()


def idempotency_key(tenant: str, task: str | None, step: bytes, name: str, arguments: Any) -> str:
    h = hashlib.blake2b(digest_size=16)
    for part in (tenant.encode(), (task or "").encode(), step, name.encode()):
        h.update(len(part).to_bytes(4, "big"))
        h.update(part)
    h.update(canonical_arguments(arguments))
    return h.hexdigest()


@dataclass(slots=True)
class ToolOutcome:
    """What governance did to one request's tool calls, for its decision and task."""

    calls: list[dict[str, Any]] = field(default_factory=list)  # evidence, one per call
    notes: list[ToolCallNote] = field(default_factory=list)  # for the task's record
    blocked: int = 0
    flagged: int = 0

    @property
    def outcome(self) -> Tagged | ToolCalls:
        if self.blocked:
            return tagged(Kind.BLOCKED, self.blocked)
        if self.flagged:
            return tagged(Kind.FLAGGED, self.flagged)
        return ToolCalls.OK

    def reason(self) -> str:
        n = len(self.calls)
        if self.blocked:
            return f"{self.blocked} of {n} tool call(s) removed: the tenant may not use them"
        if self.flagged:
            return f"{self.flagged} of {n} tool call(s) the tenant may not use were relayed (flag)"
        return f"{n} tool call(s) checked; all permitted"


class ToolGovernor:
    """Checks one request's tool calls (see the module docstring)."""

    def __init__(
        self,
        policy: ToolPolicy,
        tenant: str,
        task: str | None,
        request_id: str,
        parents: tuple[str, ...],
        request: Generation,
    ) -> None:
        self.policy = policy
        self.tenant = tenant
        self.task = task
        self.request_id = request_id
        self._parents = parents
        self._request = request
        self._step: bytes | None = None
        self.result = ToolOutcome()

    def _key(self, name: str, arguments: Any) -> str:
        if self._step is None:
            self._step = lineage(self._parents, self._request)
        return idempotency_key(self.tenant, self.task, self._step, name, arguments)

    def check(self, call_id: Any, name: Any) -> tuple[bool, str]:
        """(relay it, its class) for a call named `name`; records it."""
        name = name if isinstance(name, str) and name else None
        why = self.policy.refusal(name, self.tenant)
        cls = self.policy.tool_class(name or "")
        entry: dict[str, Any] = {"name": name or "?", "class": cls}
        if why is not None:
            entry["action"] = "blocked" if self.policy.block else "flagged"
            entry["reason"] = why
            if self.policy.block:
                self.result.blocked += 1
            else:
                self.result.flagged += 1
        else:
            entry["action"] = "relayed"
        self.result.calls.append(entry)
        return why is None or not self.policy.block, cls

    def keyed(self, call: dict[str, Any], cls: str) -> dict[str, Any]:
        """The call as relayed: a side-effecting one with its idempotency key as id."""
        fn = _obj(call.get("function"))
        name = str(fn.get("name") or "")
        entry = self.result.calls[-1]
        call_id = call.get("id")
        key = None
        if self.policy.keyed(name, cls):
            key = self._key(name, fn.get("arguments", ""))
            approval = self.policy.approvals and self.policy.requires_approval(name)
            call_id = (APPROVAL_CALL_PREFIX if approval else KEYED_PREFIX) + key
            call = {**call, "id": call_id}
            entry["idempotency_key"] = key
        entry["id"] = call_id
        if self.task is not None:  # what the task keeps of its calls
            digest = args_digest(name, fn.get("arguments", "")) if key is not None else None
            note = ToolCallNote(str(call_id or ""), name, cls, self.request_id, key, args=digest)
            self.result.notes.append(note)
        return call

    def govern_reply(self, obj: dict[str, Any]) -> dict[str, Any]:
        """A non-streamed completion with its tool calls governed."""
        choices = []
        for c in obj.get("choices") or []:
            message = _obj(c.get("message")) if isinstance(c, dict) else {}
            calls = message.get("tool_calls")
            if not isinstance(calls, list) or not calls:
                choices.append(c)
                continue
            kept = []
            for call in calls:
                if not isinstance(call, dict):
                    continue
                fn = _obj(call.get("function"))
                relay, cls = self.check(call.get("id"), fn.get("name"))
                if relay:
                    kept.append(self.keyed(call, cls))
            message = dict(message)
            c = dict(c)
            if kept:
                message["tool_calls"] = kept
            else:
                message.pop("tool_calls", None)
                if message.get("content") is None:
                    message["content"] = ""
                if c.get("finish_reason") == "tool_calls":
                    c["finish_reason"] = "stop"
            c["message"] = message
            choices.append(c)
        return {**obj, "choices": choices}


@dataclass(slots=True)
class _Call:
    """One streamed tool call (by choice and the upstream's index)."""

    relay: bool
    cls: str
    index: int  # as relayed (calls removed before it do not leave gaps)
    held: dict[str, Any] | None = None  # a side-effecting call, assembled until complete
    arguments: list[str] = field(default_factory=list)


class StreamToolGate:
    """Governs the tool calls of a stream, chunk by chunk: a forbidden call is dropped
    from its first delta on (block), a side-effecting one is held until the choice
    finishes and then relayed whole with its key, a read-only one passes as it came."""

    def __init__(self, governor: ToolGovernor) -> None:
        self.governor = governor
        self._calls: dict[tuple[int, int], _Call] = {}
        self._next: dict[int, int] = {}  # choice → next relayed index

    def feed(self, obj: dict[str, Any]) -> list[dict[str, Any]]:
        """The chunks to relay in place of `obj` (none, it, or held calls then it)."""
        out_choices = []
        before: list[dict[str, Any]] = []
        changed = False
        for c in obj.get("choices") or []:
            if not isinstance(c, dict):
                out_choices.append(c)
                continue
            ci = c.get("index", 0) if isinstance(c.get("index"), int) else 0
            delta = _obj(c.get("delta"))
            calls = delta.get("tool_calls")
            if isinstance(calls, list):
                relayed = [d for d in (self._delta(ci, d) for d in calls) if d is not None]
                # A delta relayed as it came (a permitted read-only call, no removed
                # call before it) leaves the chunk as it is: its bytes pass unchanged.
                same = len(relayed) == len(calls) and all(
                    a is b for a, b in zip(relayed, calls, strict=True)
                )
                if not same:
                    changed = True
                    delta = dict(delta)
                    if relayed:
                        delta["tool_calls"] = relayed
                    else:
                        delta.pop("tool_calls")
                    c = {**c, "delta": delta}
            if c.get("finish_reason") is not None:
                held = self._release(ci)
                if held:
                    before.append(self._chunk(obj, ci, held))
                if c.get("finish_reason") == "tool_calls" and not self._relayed_any(ci):
                    c = {**c, "finish_reason": "stop"}
                    changed = True
            if calls is not None and not (
                _obj(c.get("delta")) or c.get("finish_reason") is not None
            ):
                changed = True
                continue  # nothing left of this choice's chunk
            out_choices.append(c)
        if not changed and not before:
            return [obj]
        out = before
        if out_choices or not obj.get("choices"):
            out.append({**obj, "choices": out_choices})
        return out

    def flush(self, template: dict[str, Any]) -> list[dict[str, Any]]:
        """Held calls of choices that never finished (the stream ended first)."""
        return [
            self._chunk(template, ci, held)
            for ci in sorted({ci for ci, _ in self._calls})
            if (held := self._release(ci))
        ]

    def _delta(self, ci: int, d: Any) -> dict[str, Any] | None:
        if not isinstance(d, dict):
            return None
        ui = d.get("index", 0) if isinstance(d.get("index"), int) else 0
        call = self._calls.get((ci, ui))
        fn = _obj(d.get("function"))
        if call is None:
            relay, cls = self.governor.check(d.get("id"), fn.get("name"))
            index = self._next.get(ci, 0)
            if relay:
                self._next[ci] = index + 1
            call = self._calls[(ci, ui)] = _Call(relay, cls, index)
            name = fn.get("name")
            if relay and self.governor.policy.keyed(name if isinstance(name, str) else "", cls):
                call.held = {
                    "index": index,
                    "id": d.get("id"),
                    "type": d.get("type", "function"),
                    "function": {"name": fn.get("name"), "arguments": ""},
                }
            elif relay:
                self.governor.keyed({"id": d.get("id"), "function": fn}, cls)
        if not call.relay:
            return None
        if call.held is not None:
            if isinstance(fn.get("arguments"), str):
                call.arguments.append(fn["arguments"])
            return None
        return d if ui == call.index else {**d, "index": call.index}

    def _release(self, ci: int) -> list[dict[str, Any]]:
        held = []
        for (c, _), call in sorted(self._calls.items()):
            if c != ci or call.held is None:
                continue
            whole = call.held
            whole["function"]["arguments"] = "".join(call.arguments)
            held.append(self.governor.keyed(whole, call.cls))
            call.held = None
        return held

    def _relayed_any(self, ci: int) -> bool:
        return self._next.get(ci, 0) > 0

    @staticmethod
    def _chunk(template: dict[str, Any], ci: int, calls: list[dict[str, Any]]) -> dict[str, Any]:
        base = {k: v for k, v in template.items() if k in ("id", "object", "created", "model")}
        base.setdefault("object", "chat.completion.chunk")
        return {
            **base,
            "choices": [{"index": ci, "delta": {"tool_calls": calls}, "finish_reason": None}],
        }


# The most tool results (tool and function messages) a request's history may carry
# where they are checked: each costs a look-up, and one left unchecked would be a
# way past the gate, so a longer history is refused (400), never checked in part.
MAX_TOOL_RESULTS = 256
# The call id an approval of a legacy `function` result names: such a result has no
# id of its own, only the function's name.
FUNCTION_RESULT_PREFIX = "function:"


def record_tool_calls(ctx: RequestContext, result: ToolOutcome, t: float) -> None:
    """The tool_calls decision of a reply, and what the task keeps of its calls."""
    ctx.tools_blocked = result.blocked
    ctx.tool_notes = result.notes
    ctx.record("tool_calls", result.outcome, result.reason(), t, {"calls": result.calls})


class ToolGate(ReplyPart):
    """The tools stage's reply part: the tool calls a model proposes are checked
    against the policy, in a whole reply and in a stream alike (see the module
    docstring); only replies that mention tool calls are read."""

    __slots__ = ("_ctx", "_gate", "_governor", "_policy", "_t", "_template")

    def __init__(self, ctx: RequestContext, policy: ToolPolicy) -> None:
        self._ctx = ctx
        self._policy = policy
        self._governor: ToolGovernor | None = None  # made once a reply mentions calls
        self._gate: StreamToolGate | None = None  # made at the first chunk with calls
        self._t = 0.0
        self._template: dict[str, Any] | None = None

    def _governed(self) -> ToolGovernor:
        governor = self._governor
        if governor is None:
            ctx = self._ctx
            sent = ctx.wire[0] if ctx.wire is not None else ctx.request
            assert isinstance(sent, Generation)
            governor = self._governor = ToolGovernor(
                self._policy,
                ctx.principal.tenant_id,
                ctx.input.task_id,
                ctx.input.request_id,
                ctx.input.parent_request_ids,
                sent,
            )
        return governor

    def wants(self, body: bytes) -> bool:
        return b'"tool_calls"' in body

    async def whole(self, obj: dict[str, Any]) -> dict[str, Any]:
        t = time.perf_counter()
        governor = self._governed()
        governed = governor.govern_reply(obj)
        result = governor.result
        if not result.calls:
            return obj
        record_tool_calls(self._ctx, result, t)
        return governed

    def event(self, data: bytes) -> list[bytes] | None:
        if b'"tool_calls"' not in data:
            return None
        gate = self._gate
        if gate is None:
            gate = self._gate = StreamToolGate(self._governed())
            self._t = time.perf_counter()
        obj = reply_object(data)
        if obj is None:
            return None
        self._template = obj
        out = gate.feed(obj)
        if len(out) == 1 and out[0] is obj:  # relayed as it came
            return None
        return [orjson.dumps(o) for o in out]

    def end(self, ok: bool) -> list[bytes]:
        gate = self._gate
        if gate is None or not ok:
            return []
        held = [orjson.dumps(h) for h in gate.flush(self._template or {})]  # never finished
        result = self._governed().result
        if result.calls:
            record_tool_calls(self._ctx, result, self._t)
        return held


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


def _called(messages: list[Any]) -> dict[str, set[str]]:
    """call id → the names every assistant message of the history gives that call."""
    called: dict[str, set[str]] = {}
    for m in messages:
        if isinstance(m, dict) and m.get("role") == "assistant":
            calls = m.get("tool_calls")
            for call in calls if isinstance(calls, list) else []:
                if isinstance(call, dict) and isinstance(call.get("id"), str):
                    name = _name(_obj(call.get("function")).get("name"))
                    called.setdefault(call["id"], set()).update([name] if name else [])
    return called


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
    called = _called(messages)
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
            out.append(ToolResult(i, cid, frozenset(names), i > last))
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


APPROVAL_PREFIX = "apr-sy-"


def _hash(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


class ApprovalStore:
    """Approvals of tool calls, in the gateway's database (table `approvals`): a token
    is shown once and kept as a hash, scoped to (tenant, task, call id), single-use
    and expiring. The CLI and the admin API issue them; the gateway consumes them."""

    def __init__(self, conn: sqlite3.Connection) -> None:
        self.conn = conn
        self._lock = threading.Lock()

    def issue(
        self,
        tenant: str,
        task_id: str | None,
        call_id: str,
        approver: str,
        ttl_s: float,
        now: float | None = None,
    ) -> dict[str, Any]:
        from switchyard.policy.headers import ID_PATTERN

        now = time.time() if now is None else now
        for name, value, longest in (
            ("tenant", tenant, 63),
            ("call_id", call_id, 128),
            ("approver", approver, 128),
        ):
            if not isinstance(value, str) or not value or len(value) > longest:
                raise InvalidRequest(f"'{name}' must be 1 to {longest} characters", param=name)
        if task_id is not None and not (isinstance(task_id, str) and ID_PATTERN.fullmatch(task_id)):
            raise InvalidRequest("'task_id' must be a task id", param="task_id")
        if (
            not isinstance(ttl_s, int | float)
            or isinstance(ttl_s, bool)
            or not 0 < ttl_s <= 30 * 86400
        ):
            raise InvalidRequest("'ttl_s' must be seconds in (0, 2592000]", param="ttl_s")
        token = APPROVAL_PREFIX + secrets.token_urlsafe(24)
        with self._lock:
            self.conn.execute(
                "INSERT INTO approvals (token_hash, tenant_id, task_id, call_id, approver,"
                " created_at, expires_at) VALUES (?,?,?,?,?,?,?)",
                (_hash(token), tenant, task_id, call_id, approver, now, now + ttl_s),
            )
        return {
            "object": "approval",
            "token": token,
            "tenant": tenant,
            "task_id": task_id,
            "call_id": call_id,
            "approver": approver,
            "expires_at": now + ttl_s,
        }

    def consume(
        self,
        token: str,
        tenant: str,
        task_id: str | None,
        call_id: str,
        request_id: str,
        now: float | None = None,
    ) -> tuple[str | None, str | None]:
        """(approver, None) when the token approves this call (and is now used), else
        (None, why)."""
        now = time.time() if now is None else now
        with self._lock:
            row = self.conn.execute(
                "SELECT tenant_id, task_id, call_id, approver, expires_at, used_at"
                " FROM approvals WHERE token_hash = ?",
                (_hash(token),),
            ).fetchone()
            if row is None:
                return None, "unknown approval token"
            r_tenant, r_task, r_call, approver, expires_at, used_at = tuple(row)
            if (
                r_tenant != tenant
                or r_call != call_id
                or (r_task is not None and r_task != task_id)
            ):
                return None, "the approval is for another tenant, task or call"
            if used_at is not None:
                return None, "the approval was already used"
            if expires_at <= now:
                return None, "the approval has expired"
            cur = self.conn.execute(
                "UPDATE approvals SET used_at = ?, used_by = ? WHERE token_hash = ? AND used_at IS NULL",
                (now, request_id, _hash(token)),
            )
            if cur.rowcount != 1:  # another process used it meanwhile
                return None, "the approval was already used"
        return str(approver), None

    def consumed(self, tenant: str, task_id: str | None, call_ids: Sequence[str]) -> set[str]:
        """The call ids among `call_ids` for which an approval that `consume` would
        have taken for this tenant and task was already used: a call approved once
        stays approved for the later turns of its conversation, which carry its
        result as history. A task-wide approval (task None) counts in any task, as
        in `consume`."""
        ids = list(dict.fromkeys(call_ids))
        found: set[str] = set()
        for start in range(0, len(ids), MAX_TOOL_RESULTS):
            chunk = ids[start : start + MAX_TOOL_RESULTS]
            marks = ",".join("?" * len(chunk))
            with self._lock:
                rows = self.conn.execute(
                    "SELECT DISTINCT call_id FROM approvals WHERE tenant_id = ?"
                    " AND used_at IS NOT NULL AND (task_id IS NULL OR task_id = ?)"
                    f" AND call_id IN ({marks})",
                    (tenant, task_id, *chunk),
                ).fetchall()
            found.update(str(row[0]) for row in rows)
        return found
