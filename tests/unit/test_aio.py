"""aio.unless_gone: a whole reply's wait, ended by the caller's hang-up."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping

import pytest

from switchyard.aio import unless_gone
from switchyard.errors import ClientDisconnected


class Caller:
    """An ASGI `receive` whose caller hangs up when told (`leave`)."""

    def __init__(self) -> None:
        self.gone = asyncio.Event()

    async def receive(self) -> Mapping[str, object]:
        await self.gone.wait()
        return {"type": "http.disconnect"}


def test_the_work_is_cancelled_when_the_caller_hangs_up() -> None:
    async def main() -> tuple[str, int]:
        caller = Caller()
        ended: list[str] = []

        async def work() -> str:
            try:
                await asyncio.sleep(30)
            except asyncio.CancelledError:
                ended.append("given back")  # an upstream call closes its connection here
                raise
            return "answered"

        asyncio.get_running_loop().call_later(0.05, caller.gone.set)
        with pytest.raises(ClientDisconnected) as got:
            await unless_gone(work(), caller.receive, "left")
        assert got.value.message == "left"
        assert ended == ["given back"]
        task = asyncio.current_task()
        assert task is not None
        await asyncio.sleep(0)  # no cancellation is left pending on this task
        return "ok", task.cancelling()

    assert asyncio.run(main()) == ("ok", 0)


def test_a_caller_that_stays_gets_the_result_and_no_late_cancel() -> None:
    async def main() -> str:
        caller = Caller()

        async def work() -> str:
            await asyncio.sleep(0.01)
            return "answered"

        got = await unless_gone(work(), caller.receive, "left")
        caller.gone.set()  # the exchange ends after the answer: nothing is cancelled
        await asyncio.sleep(0.05)
        return got

    assert asyncio.run(main()) == "answered"


def test_another_cancellation_goes_on_as_it_came() -> None:
    async def main() -> None:
        caller = Caller()
        inner = asyncio.ensure_future(unless_gone(asyncio.sleep(30), caller.receive, "left"))
        await asyncio.sleep(0.01)
        inner.cancel("shutdown")
        with pytest.raises(asyncio.CancelledError):
            await inner

    asyncio.run(main())


def test_no_watch_without_a_receive() -> None:
    async def main() -> str:
        async def work() -> str:
            return "answered"

        return await unless_gone(work(), None, "left")

    assert asyncio.run(main()) == "answered"
