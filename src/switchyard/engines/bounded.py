"""Reading a whole HTTP reply (aiohttp) within a bound: the one rule for every reply the
gateway reads whole from a process it does not trust to be well-behaved (an engine, a
tool server, an engine's load endpoint, the control plane), so a broken or hostile
peer cannot make it hold an unbounded body in memory."""

from __future__ import annotations

import aiohttp


async def read_bounded(resp: aiohttp.ClientResponse, limit: int) -> bytes | None:
    """`resp`'s whole body, or None once it is over `limit` bytes: refused by its
    declared length before any of it is read, else counted as it arrives (a declared
    length within the bound is not what stops the read: the bytes are)."""
    declared = resp.content_length
    if declared is not None and declared > limit:
        return None
    body = bytearray()
    async for chunk in resp.content.iter_any():
        body += chunk
        if len(body) > limit:
            return None
    return bytes(body)
