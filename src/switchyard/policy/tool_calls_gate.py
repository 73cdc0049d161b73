"""The tools stage's reply part: the tool calls a model proposes, gated in the reply.

Owns `ToolGate` (a whole JSON reply and a stream, event by event) and the stream's
gate (`StreamToolGate`): a forbidden call is dropped from its first delta on, a
keyed one is held until complete and relayed whole with its key. The checks
themselves are the governor's (tool_calls_governor.py).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import orjson

from switchyard.pipeline import ReplyPart, RequestContext
from switchyard.policy.tool_calls_governor import ToolGovernor, ToolOutcome, ToolPolicy, _obj
from switchyard.reply import reply_object
from switchyard.request import Generation


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
            held.append(self.governor.keyed(whole, call.cls, ci))
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


def record_tool_calls(ctx: RequestContext, result: ToolOutcome, t: float) -> None:
    """The tool_calls decision of a reply, and what the task keeps of its calls."""
    ctx.tools_blocked = result.blocked
    ctx.tool_notes = result.notes
    ctx.record("tool_calls", result.outcome, result.reason(), t, {"calls": result.calls})


class ToolGate(ReplyPart):
    """The tools stage's reply part: the tool calls a model proposes are checked
    against the policy, in a whole reply and in a stream alike (see
    policy/tool_calls.py's docstring); only replies that mention tool calls are read."""

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
