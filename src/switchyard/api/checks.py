"""Named shape checks the protocol codecs share (api/messages_codec.py,
api/responses_codec.py): each raises the 400 naming the member it found wrong, its
name bounded (a hostile member name is never echoed whole)."""

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
