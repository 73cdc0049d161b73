"""Asyncio helpers the layers share."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping
from typing import TypeVar

from switchyard.errors import ClientDisconnected

T = TypeVar("T")
Receive = Callable[[], Awaitable[Mapping[str, object]]]  # an ASGI request's `receive`
LEFT = "the client hung up before its answer came"  # (`Waits`': the executor's wait)


async def hung_up(receive: Receive) -> None:
    """Returns once an ASGI request's caller has hung up (or its exchange is over).
    Call only once its body has been read."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def until_gone(
    work: Awaitable[T],
    gone: Awaitable[object],
    what: str,
    undo: Callable[[T], object] | None = None,
) -> T:
    """`work`'s result, or ClientDisconnected(`what`) once `gone` (the caller hung up)
    returns first: `work` is cancelled and awaited, so what it held is given back
    before this returns. A cancellation of this one cancels both and goes on; a result
    `work` had already come to then (its cancel came too late) is handed to `undo`, so
    what it took (a queue's slot) is given back rather than dropped."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(gone)
    try:
        await asyncio.wait((task, watch), return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        watch.cancel()
        if not task.done():
            task.cancel()
            await asyncio.wait((task,))  # its ending, without raising what ended it
        if not task.cancelled() and task.exception() is None and undo is not None:
            undo(task.result())
        raise
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


# How long a driver's wait runs before its caller is watched: a task to watch it costs
# about a tenth of a quick request's CPU, and most waits are over sooner; a client that
# hangs up before is noticed then (between one and two of these later).
WATCH_AFTER_S = 0.25


class Watch:
    """One wait of `Waits`: once started, it cancels the waiting task (`task`) when the
    caller hangs up (and says so: `gone`), unless the wait is `over` first."""

    __slots__ = ("gone", "over", "receive", "seen", "task", "watch")

    def __init__(self, task: asyncio.Task[object], receive: Receive) -> None:
        self.task, self.receive = task, receive
        self.watch: asyncio.Future[None] | None = None
        self.gone = self.over = self.seen = False

    def start(self) -> None:
        if not self.over and self.watch is None:
            self.watch = asyncio.ensure_future(hung_up(self.receive))
            self.watch.add_done_callback(self.left)

    def left(self, watch: asyncio.Future[None]) -> None:
        if self.over or watch.cancelled():
            return  # the wait ended first (a callback already scheduled runs too late)
        watch.exception()  # retrieved: a watch that failed means the caller is gone too
        self.gone = True
        self.task.cancel(LEFT)


class Waits:
    """Waits for an upstream, each ended by its caller's hang-up: `add` when one
    starts, `end` when it is over; a wait whose caller hung up has its task cancelled,
    and its `Watch` says `gone` (the waiter raises ClientDisconnected(LEFT) then,
    `uncancel`ing). A wait is watched once it has run WATCH_AFTER_S: one sweeper task
    (while any wait is open) starts a watch for each wait it finds a second time, so a
    quick wait costs two dict writes: no timer, no task and no coroutine around it."""

    __slots__ = ("_sweeper", "_waits")

    def __init__(self) -> None:
        self._waits: dict[int, Watch] = {}
        self._sweeper: asyncio.Task[None] | None = None

    def add(self, receive: Receive | None) -> Watch | None:
        """The running task's wait, watched (`receive`: its caller's ASGI `receive`, the
        body read; None: not watched, and None is returned)."""
        if receive is None:
            return None
        task = asyncio.current_task()
        assert task is not None
        w = Watch(task, receive)
        self._waits[id(w)] = w
        sweeper = self._sweeper
        if sweeper is None or sweeper.done():
            self._sweeper = asyncio.get_running_loop().create_task(self._sweep())
        return w

    def end(self, w: Watch) -> None:
        w.over = True
        del self._waits[id(w)]
        if w.watch is not None:
            w.watch.cancel()

    async def _sweep(self) -> None:
        waits = self._waits
        while waits:
            await asyncio.sleep(WATCH_AFTER_S)
            for w in list(waits.values()):
                if w.seen:
                    w.start()
                else:
                    w.seen = True
