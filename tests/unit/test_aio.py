"""aio.Waits: a wait for an upstream, ended by its caller's hang-up."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Mapping
from typing import Any

from switchyard.aio import LEFT, WATCH_AFTER_S, Waits


class Caller:
    """An ASGI `receive` whose caller hangs up when told (`gone.set()`)."""

    def __init__(self) -> None:
        self.gone = asyncio.Event()

    async def receive(self) -> Mapping[str, object]:
        await self.gone.wait()
        return {"type": "http.disconnect"}


async def _waited(waits: Waits, caller: Caller, work: Awaitable[Any]) -> tuple[str, bool]:
    """How a waiter (the executor) uses `Waits`: (how the wait ended, `gone`)."""
    watch = waits.add(caller.receive)
    assert watch is not None
    try:
        await work
        return "answered", watch.gone
    except asyncio.CancelledError as exc:
        return f"cancelled: {exc.args[0] if exc.args else ''}", watch.gone
    finally:
        waits.end(watch)


def test_the_wait_is_cancelled_once_the_caller_hangs_up() -> None:
    async def main() -> tuple[tuple[str, bool], list[str]]:
        caller, waits = Caller(), Waits()
        ended: list[str] = []

        async def work() -> None:
            try:
                await asyncio.sleep(30)
            except asyncio.CancelledError:
                ended.append("given back")  # an upstream call closes its connection here
                raise

        asyncio.get_running_loop().call_later(0.05, caller.gone.set)
        got = await _waited(waits, caller, work())
        task = asyncio.current_task()
        assert task is not None
        task.uncancel()  # what the executor does before it raises ClientDisconnected
        return got, ended

    assert asyncio.run(main()) == ((f"cancelled: {LEFT}", True), ["given back"])


def test_a_caller_that_stays_gets_the_result_and_no_late_cancel() -> None:
    async def main() -> tuple[tuple[str, bool], int]:
        caller, waits = Caller(), Waits()
        got = await _waited(waits, caller, asyncio.sleep(WATCH_AFTER_S * 3))  # watched
        caller.gone.set()  # the exchange ends after the answer: nothing is cancelled
        await asyncio.sleep(WATCH_AFTER_S * 3)
        task = asyncio.current_task()
        assert task is not None
        return got, task.cancelling()

    assert asyncio.run(main()) == (("answered", False), 0)


def test_another_cancellation_is_not_the_callers() -> None:
    async def main() -> tuple[str, bool]:
        caller, waits = Caller(), Waits()
        inner = asyncio.ensure_future(_waited(waits, caller, asyncio.sleep(30)))
        await asyncio.sleep(WATCH_AFTER_S * 3)
        inner.cancel("shutdown")
        return await inner

    assert asyncio.run(main()) == ("cancelled: shutdown", False)


def test_no_watch_without_a_receive() -> None:
    async def main() -> bool:
        return Waits().add(None) is None

    assert asyncio.run(main())


def test_a_short_wait_starts_no_watch() -> None:
    """Most waits end before WATCH_AFTER_S: no watching task is started for them (the
    sweeper runs beside them while any wait is open); a longer one gets one."""

    async def main() -> tuple[int, int]:
        caller, waits = Caller(), Waits()
        seen: list[int] = []

        async def work(wait: float) -> None:
            await asyncio.sleep(wait)
            seen.append(len(asyncio.all_tasks()))  # this one, the sweeper, any watch

        await _waited(waits, caller, work(0.01))
        await _waited(waits, caller, work(WATCH_AFTER_S * 3))
        return seen[0], seen[1]

    assert asyncio.run(main()) == (2, 3)
