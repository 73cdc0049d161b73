"""Asyncio helpers the layers share."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping
from typing import TypeVar

from switchyard.errors import ClientDisconnected

T = TypeVar("T")
Receive = Callable[[], Awaitable[Mapping[str, object]]]  # an ASGI request's `receive`
LEFT = "the client hung up before its answer came"  # (`unless_gone`'s, on the driver's wait)


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


async def unless_gone(work: Awaitable[T], receive: Receive | None, what: str) -> T:
    """`await work` in this task, or ClientDisconnected(`what`) once the caller hangs up
    first (`receive`: its ASGI `receive`, the body read; None: not watched): this task
    is cancelled, so `work` gives back what it held (an upstream call closes its
    connection: the engine stops) before this raises. One watching task and no task
    for `work` (`until_gone` makes both), for a wait every whole reply has."""
    if receive is None:
        return await work
    current = asyncio.current_task()
    assert current is not None
    state = [False, False]  # [over, the caller hung up]

    def left(watch: asyncio.Future[None]) -> None:
        if state[0] or watch.cancelled():
            return  # `work` ended first (a callback already scheduled runs too late)
        watch.exception()  # retrieved: a watch that failed means the caller is gone too
        state[1] = True
        current.cancel(what)

    watch = asyncio.ensure_future(hung_up(receive))
    watch.add_done_callback(left)
    try:
        return await work
    except asyncio.CancelledError:
        if not state[1]:
            raise  # shutdown, a task's cancel: not ours
        current.uncancel()
        raise ClientDisconnected(what) from None
    finally:
        state[0] = True
        watch.cancel()
