"""Named shape checks the protocol codecs share (api/messages_codec.py,
api/responses_codec.py): each raises the 400 naming the member it found wrong, its
name bounded (a hostile member name is never echoed whole). `past_int64` is the one rule
for integers no 64-bit integer holds (Messages' tool_use input, MCP's tool arguments);
`ToolPairs` the one rule for how a conversation's tool calls and outputs pair up."""

from __future__ import annotations

from typing import Any

from switchyard.errors import InvalidRequest

MAX_PARAM = 160  # characters of a member path an error names


def bad(message: str, param: str) -> InvalidRequest:
    return InvalidRequest(message, param=param[:MAX_PARAM])


def string(v: Any, where: str) -> str:
    """`v`, which must be a string."""
    if not isinstance(v, str):
        raise bad(f"'{where}' must be a string", where)
    return v


def no_extras(
    obj: dict[str, Any], allowed: frozenset[str], where: str, ignored: frozenset[str] = frozenset()
) -> None:
    """Refuse, by name, any member of `obj` outside `allowed` (`ignored` ones are
    accepted and not read: hints the protocol allows anywhere)."""
    for k in obj:
        if k not in allowed and k not in ignored:
            raise bad(f"'{where}.{k[:64]}' is not supported", f"{where}.{k[:64]}")


def number(body: dict[str, Any], name: str, low: float, high: float, integer: bool) -> None:
    """`body[name]`, when sent, is a number (an integer) from `low` to `high`."""
    v = body.get(name)
    if v is None:
        return
    if isinstance(v, bool) or not isinstance(v, int if integer else (int, float)):
        raise bad(f"'{name}' must be {'an integer' if integer else 'a number'}", name)
    if not low <= v <= high:
        raise bad(f"'{name}' must be between {low} and {high}", name)


def flag(body: dict[str, Any], name: str, default: bool) -> bool:
    """`body[name]` as a boolean, `default` when not sent."""
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise bad(f"'{name}' must be a boolean", name)
    return v


_INT64 = 2**63
_UINT64 = 2**64


def past_int64(value: Any) -> bool:
    """Whether a parsed JSON value holds an integer no 64-bit integer holds, which would
    reach its reader changed or not be written at all: a float that is integral with a
    magnitude of 2^63 or more (orjson reads such an integer as a float, which is
    re-encoded rounded; a float written as one, 1e19, is read alike and refused alike),
    or an integer outside what orjson writes (-2^63 to 2^64 - 1; other parsers read big
    integers whole). Walked without recursion, so any depth a parser reads is safe."""
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, dict):
            stack.extend(v.values())
        elif isinstance(v, list):
            stack.extend(v)
        elif isinstance(v, float):
            if v.is_integer() and abs(v) >= _INT64:
                return True
        elif isinstance(v, int) and not -_INT64 <= v < _UINT64:
            return True
    return False


class ToolPairs:
    """The one rule for a conversation's tool calls and their outputs, in either
    protocol (Responses items, Messages blocks; a chat engine refuses the chat
    messages either becomes otherwise): a group of calls (one assistant turn's) is
    answered, each call once, before the conversation goes on (another turn, or a call
    after the group's first output); an output answers a call of the group just
    before it; no call id is used twice. Fed in the conversation's order, each event
    with the member it names; raises the 400 naming that member. `call` and `output`
    are the protocol's words; `pending`: calls the conversation this input continues
    left unanswered (a stored response's; their `where` None, the 400 then naming
    the input's member that goes on without them)."""

    __slots__ = ("_answered", "_answering", "_call", "_open", "_output", "_seen")

    def __init__(
        self, call: str, output: str, pending: dict[str, str | None] | None = None
    ) -> None:
        self._call, self._output = call, output
        self._open: dict[str, str | None] = dict(pending or {})  # id -> where, this group
        self._answered: set[str] = set()
        self._answering = bool(self._open)  # a group's first output was given
        self._seen: dict[str, str | None] = dict(self._open)  # every call id -> where

    def call(self, call_id: str, where: str) -> None:
        if call_id in self._seen:
            first = self._seen[call_id] or "the response this one continues"
            raise bad(f"'{where}': the {self._call} id {call_id!r} is the id of {first} too", where)
        if self._answering:  # a call after outputs: the group before must be answered
            self.turn(where)
        self._open[call_id] = self._seen[call_id] = where

    def output(self, call_id: str, where: str) -> None:
        if call_id not in self._open:
            raise bad(
                f"'{where}': no {self._call} found for the {self._output} with id "
                f"{call_id!r}: each {self._output} answers a {self._call} just before it",
                where,
            )
        if call_id in self._answered:
            raise bad(f"'{where}': the {self._call} {call_id!r} is answered twice", where)
        self._answered.add(call_id)
        self._answering = True

    def turn(self, where: str, ends: bool = False) -> None:
        """The conversation goes on at `where` (`ends`: it ends there): every open call
        must have had its output."""
        for call_id, at in self._open.items():
            if call_id not in self._answered:
                named = at or where
                after = "at the end of the conversation" if ends else f"by {where}"
                raise bad(
                    f"'{named}': the {self._call} {call_id!r} has no {self._output} {after}",
                    named,
                )
        self._open, self._answered, self._answering = {}, set(), False
