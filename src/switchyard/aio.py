"""Asyncio helpers the layers share."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping
from typing import TypeVar

from switchyard.errors import ClientDisconnected

T = TypeVar("T")
Receive = Callable[[], Awaitable[Mapping[str, object]]]  # an ASGI request's `receive`


async def hung_up(receive: Receive) -> None:
    """Returns once an ASGI request's caller has hung up (or its exchange is over).
    Call only once its body has been read."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def until_gone(work: Awaitable[T], gone: Awaitable[object], what: str) -> T:
    """`work`'s result, or ClientDisconnected(`what`) once `gone` (the caller hung up)
    returns first: `work` is cancelled and awaited, so what it held is given back
    before this returns. A cancellation of this one cancels both and goes on."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(gone)
    try:
        await asyncio.wait((task, watch), return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
            await asyncio.wait((task,))  # its ending, without raising what ended it
    if watch.done() and not watch.cancelled():
        watch.exception()  # retrieved: a watch that failed means the caller is gone too
    if task.cancelled():
        raise ClientDisconnected(what)
    return task.result()
