"""Authorization and idempotency keys of the tool calls a model proposes.

Owns the `tools` policy (registry, permissions, which calls are keyed), the
idempotency key of a call (`call_sy_<key>`, `call_sya_<key>` for a tool that
requires approval; a later call of one tool with the same arguments in a reply's
choice keyed with its ordinal, so each call has an id of its own) and the governor
that checks one request's calls and records what it did (`ToolOutcome`), for a whole
reply here and for a stream through tool_calls_gate.py. The rules are told in
policy/tool_calls.py's docstring.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any

import orjson

from switchyard.config import ToolsConfig
from switchyard.outcomes import Kind, Tagged, ToolCalls, tagged
from switchyard.request import Generation
from switchyard.state.tasks import ToolCallNote

KEYED_PREFIX = "call_sy_"
# The id prefix of a call to a tool that requires_approval: its result needs an
# approval whatever tool the conversation the client sends back names for the id.
APPROVAL_CALL_PREFIX = "call_sya_"


def _denial(name: str | None, tenant: str | None, cfg: ToolsConfig) -> str | None:
    """Why the tenant may not use this tool, or None when it may."""
    if name is None:
        return "tool has no function name"
    if name in cfg.deny:
        return "denied by tools.deny"
    if cfg.allow is not None and name not in cfg.allow:
        return "not in tools.allow"
    if tenant is not None and tenant in cfg.tenant_allow and name not in cfg.tenant_allow[tenant]:
        return f"not in tools.tenant_allow[{tenant!r}]"
    return None


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


# The BLAKE2b personalization of the key of a reply's second (third, ...) call of one
# tool with the same arguments: a hash of its own, so no such key is the key of a
# first call, whatever the arguments' bytes.
_ORDINAL_PERSON = b"sy-call-ordinal"


def idempotency_key(
    tenant: str, task: str | None, step: bytes, name: str, arguments: Any, ordinal: int = 0
) -> str:
    """A call's idempotency key: BLAKE2b over (tenant, task, step, tool, canonical
    arguments) and, for the `ordinal`-th call (from 0) of one tool with the same
    arguments in one reply's choice, that ordinal: parallel identical calls (two dice
    rolled) are calls of their own, each with its own key, and a retried step that
    proposes the same calls gets the same keys in the same order."""
    h = hashlib.blake2b(digest_size=16, person=_ORDINAL_PERSON if ordinal else b"")
    parts = [tenant.encode(), (task or "").encode(), step, name.encode()]
    if ordinal:
        parts.append(str(ordinal).encode())
    for part in parts:
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
    """Checks one request's tool calls (see policy/tool_calls.py's docstring)."""

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
        # How many keyed calls of (choice, tool, canonical arguments) were keyed so far.
        self._keyed: dict[tuple[int, str, bytes], int] = {}
        self.result = ToolOutcome()

    def _key(self, choice: int, name: str, arguments: Any) -> str:
        if self._step is None:
            self._step = lineage(self._parents, self._request)
        same = (choice, name, canonical_arguments(arguments))
        ordinal = self._keyed.get(same, 0)
        self._keyed[same] = ordinal + 1
        return idempotency_key(self.tenant, self.task, self._step, name, arguments, ordinal)

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

    def keyed(self, call: dict[str, Any], cls: str, choice: int = 0) -> dict[str, Any]:
        """The call as relayed: a side-effecting one with its idempotency key as id.
        Called in the order of the calls of `choice` (the reply's choice index): the
        n-th identical call (tool and arguments) of a choice gets the key of ordinal n."""
        fn = _obj(call.get("function"))
        name = str(fn.get("name") or "")
        entry = self.result.calls[-1]
        call_id = call.get("id")
        key = None
        if self.policy.keyed(name, cls):
            key = self._key(choice, name, fn.get("arguments", ""))
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
            ci = c.get("index", 0) if isinstance(c.get("index"), int) else 0  # as a stream's
            kept = []
            for call in calls:
                if not isinstance(call, dict):
                    continue
                fn = _obj(call.get("function"))
                relay, cls = self.check(call.get("id"), fn.get("name"))
                if relay:
                    kept.append(self.keyed(call, cls, ci))
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
