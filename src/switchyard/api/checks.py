"""Named shape checks the protocol codecs share (api/messages_codec.py,
api/responses_codec.py): each raises the 400 naming the member it found wrong, its
name bounded (a hostile member name is never echoed whole). `past_int64` is the one rule
for integers no 64-bit integer holds (Messages' tool_use input, MCP's tool arguments)."""

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
