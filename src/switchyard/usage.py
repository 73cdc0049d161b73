"""Token counts an upstream reports, checked before anything bills them.

An upstream's `usage` is the gateway's input for money: a count that is negative, not
an integer, or past any real request (a hostile or broken engine) would refund a
budget, bill billions, or make settling fail and lose the request's row and release.
Every reader that bills or reports the counts (settle.py, the protocols' replies)
takes them through `counts`.

At the bottom of the layering: it imports nothing of Switchyard.
"""

from __future__ import annotations

from typing import Any

MAX_COUNT = 2**31 - 1  # the largest token count a request may ask for (max_tokens)


def counts(usage: Any) -> tuple[int, int] | None:
    """(prompt tokens, completion tokens) of a `usage` object, a missing or null count
    being 0; None when it is no object or a count is not an integer from 0 to
    `MAX_COUNT` (a bool is no count)."""
    if not isinstance(usage, dict):
        return None
    inp = usage.get("prompt_tokens")
    out = usage.get("completion_tokens")
    inp = 0 if inp is None else inp
    out = 0 if out is None else out
    if type(inp) is not int or type(out) is not int:
        return None
    if not (0 <= inp <= MAX_COUNT and 0 <= out <= MAX_COUNT):
        return None
    return inp, out
