"""A worker following its control plane (control/follow.py): whatever the control
plane's `/state/readiness` answers (not an object, not JSON, over the bound), the
worker's loop goes on and takes the next good report; nothing else is taken. Each
round also sends the worker's own counts (`/state/live/{index}`)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import orjson
import pytest
from aiohttp import web

from support.aiohttp_server import serving
from switchyard.control import follow
from switchyard.control.follow import ControlView

TOKEN = "t0ken"
GOOD = {"models": {"smol": {"ready": True}}, "engines": {"pool": {}, "engines": {}}}


ACTIVE = 2
REPORTS: list[Any] = []  # what the worker sent of its own counts, in order


def _view(url: str) -> ControlView:
    view = ControlView.__new__(ControlView)  # the mixin alone: its role, gates and count
    view.role = SimpleNamespace(control_url=url, token=TOKEN, worker=True, index=3)  # type: ignore[assignment]
    view.gates = {}
    view.active_requests = lambda: ACTIVE  # type: ignore[method-assign]
    return view


async def _follow(answers: list[bytes]) -> tuple[list[Any], bool]:
    """The worker's view after each answer in turn (read when its next request comes:
    the loop acts on one answer before it asks again), and whether it was still running."""
    seen: list[Any] = []
    done = asyncio.Event()
    view: ControlView | None = None

    async def readiness(request: web.Request) -> web.Response:
        assert request.headers["authorization"] == f"Bearer {TOKEN}"
        assert view is not None
        if len(seen) < len(answers) + 1:
            seen.append(view.control_view)  # after the answer before this request
        if len(seen) == len(answers) + 1:
            done.set()
        return web.Response(body=answers[min(len(seen), len(answers)) - 1])

    async def report(request: web.Request) -> web.Response:
        assert request.headers["authorization"] == f"Bearer {TOKEN}"
        REPORTS.append(orjson.loads(await request.read()))
        return web.Response(body=b'{"kept": true}')

    app = web.Application()
    app.router.add_get("/state/readiness", readiness)
    app.router.add_post("/state/live/3", report)
    async with serving(app) as url:
        view = _view(url)
        task = asyncio.create_task(view._follow_control())
        try:
            await asyncio.wait_for(done.wait(), 10)
            return seen[1:], not task.done()  # seen[0]: before any answer
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


@pytest.mark.parametrize(
    "bad",
    [b"[1, 2]", b'"models"', b"null", b"{not json", b'{"models": [1]}'],
    ids=["list", "string", "null", "not-json", "models-not-object"],
)
def test_a_report_that_is_not_one_is_no_answer_and_the_loop_goes_on(
    bad: bytes, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(follow, "FOLLOW_S", 0.02)
    seen, running = asyncio.run(_follow([bad, orjson.dumps(GOOD)]))
    assert seen == [None, GOOD["models"]]
    assert running


def test_a_report_over_the_bound_is_not_taken(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(follow, "FOLLOW_S", 0.02)
    monkeypatch.setattr(follow, "MAX_REPORT", 1024)
    big = orjson.dumps({"models": {f"m{i}": {"ready": True} for i in range(200)}})
    assert len(big) > 1024
    seen, running = asyncio.run(_follow([big, orjson.dumps(GOOD)]))
    assert seen == [None, GOOD["models"]]
    assert running


def test_each_round_sends_the_workers_own_counts(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(follow, "FOLLOW_S", 0.02)
    REPORTS.clear()
    asyncio.run(_follow([orjson.dumps(GOOD)] * 3))
    assert len(REPORTS) >= 3
    assert all(r == {"active_requests": ACTIVE, "queues": {}} for r in REPORTS)
