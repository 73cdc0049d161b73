"""The deployment gate shared by workers (policy/admission_remote.py): real gates in a
control plane served on loopback (api/internal.py), asked by `RemoteGate`s as the
workers ask them."""

from __future__ import annotations

import asyncio
import math
import socket
import time
from collections.abc import Awaitable, Callable
from typing import cast

import pytest
import uvicorn
from hypothesis import given, settings
from hypothesis import strategies as st

from switchyard.api.admin.live import Live, LiveServices
from switchyard.api.internal import GateRoutes, internal_app
from switchyard.config import ProcessRole
from switchyard.errors import AuthenticationError, Overloaded, QueueFull
from switchyard.policy.admission import DeploymentGate, Priority, SlotAsk
from switchyard.policy.admission_remote import (
    Leases,
    RemoteGate,
    ask_from,
    ask_json,
    host_gates,
)

TOKEN = "t0ken"


class Plane:
    """A control plane's gates on a loopback port."""

    def __init__(self, max_concurrency: int = 2, queue: int = 64) -> None:
        self.gate = DeploymentGate("m", max_concurrency, queue, "fcfs")
        self.leases = Leases({"m": self.gate})
        self.server: uvicorn.Server | None = None
        self.url = ""

    async def __aenter__(self) -> Plane:
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        app = internal_app(GateRoutes(self.leases, TOKEN), None)
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
        self.task = asyncio.create_task(self.server.serve(sockets=[sock]))
        while not self.server.started:
            await asyncio.sleep(0.01)
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.should_exit = True
        await self.task

    def remote(self, worker: str, token: str = TOKEN) -> RemoteGate:
        return RemoteGate(self.gate, self.url, token, worker)


def _run(body: Callable[[Plane], Awaitable[None]], **plane: int) -> None:
    async def main() -> None:
        async with Plane(**plane) as p:
            await body(p)

    asyncio.run(main())


async def _settle() -> None:
    for _ in range(50):  # releases are sent without waiting: let them land
        await asyncio.sleep(0.01)


def test_two_workers_share_one_gate_and_its_queue_order() -> None:
    _run(_two_workers_share_one_gate_and_its_queue_order)


async def _two_workers_share_one_gate_and_its_queue_order(plane: Plane) -> None:
    a, b = plane.remote("w0-1"), plane.remote("w1-2")
    assert a.try_acquire() is None  # a slot is never granted locally
    await a.acquire(math.inf)
    await b.acquire(math.inf)
    assert plane.gate.in_flight == 2
    order: list[str] = []

    async def wait(g: RemoteGate, name: str) -> None:
        await g.acquire(math.inf)
        order.append(name)

    waiting = [asyncio.create_task(wait(b, "first")), None]
    while plane.gate.queued < 1:
        await asyncio.sleep(0.01)
    waiting[1] = asyncio.create_task(wait(a, "second"))
    while plane.gate.queued < 2:
        await asyncio.sleep(0.01)
    a.release(0.1, 10)
    await asyncio.wait_for(waiting[0], 5)  # type: ignore[arg-type]
    assert order == ["first"] and plane.gate.in_flight == 2
    b.release()
    await asyncio.wait_for(waiting[1], 5)  # type: ignore[arg-type]
    assert order == ["first", "second"]
    a.release()
    b.release()
    await _settle()
    assert plane.gate.in_flight == 0
    await a.close()
    await b.close()


def test_a_dead_workers_slots_and_waits_are_given_back() -> None:
    _run(_a_dead_workers_slots_and_waits_are_given_back)


async def _a_dead_workers_slots_and_waits_are_given_back(plane: Plane) -> None:
    dead, live = plane.remote("w0-1"), plane.remote("w1-2")
    await dead.acquire(math.inf)
    await dead.acquire(math.inf)
    waiter = asyncio.create_task(dead.acquire(math.inf))
    while plane.gate.queued < 1:
        await asyncio.sleep(0.01)
    assert plane.leases.held("w0-1") == 2
    assert plane.leases.release_worker("w0-1") == 2
    await _settle()  # its ended wait passes on the slot it was handed meanwhile
    assert plane.gate.queued == 0 and plane.gate.in_flight == 0
    await live.acquire(time.perf_counter() + 2)  # admitted at once
    assert plane.gate.in_flight == 1
    # The dead worker's last ask came back refused, holding nothing.
    with pytest.raises(Overloaded):  # its wait was ended for it
        await waiter
    assert plane.gate.in_flight == 1
    await dead.close()
    await live.close()


def test_a_cancelled_ask_holds_nothing() -> None:
    _run(_a_cancelled_ask_holds_nothing)


async def _a_cancelled_ask_holds_nothing(plane: Plane) -> None:
    a = plane.remote("w0-1")
    await a.acquire(math.inf)
    await a.acquire(math.inf)
    ask = asyncio.create_task(a.acquire(math.inf))
    while plane.gate.queued < 1:
        await asyncio.sleep(0.01)
    ask.cancel()
    with pytest.raises(asyncio.CancelledError):
        await ask
    await _settle()
    assert plane.gate.queued == 0 and plane.gate.in_flight == 2
    a.release()
    a.release()
    await _settle()
    assert plane.gate.in_flight == 0 and plane.leases.held("w0-1") == 0
    await a.close()


def test_refusals_come_back_as_the_gate_raised_them() -> None:
    _run(_refusals_come_back_as_the_gate_raised_them, max_concurrency=1, queue=1)


async def _refusals_come_back_as_the_gate_raised_them(p: Plane) -> None:
    a = p.remote("w0-1")
    await a.acquire(math.inf)
    waiting = asyncio.create_task(a.acquire(math.inf))
    while p.gate.queued < 1:
        await asyncio.sleep(0.01)
    with pytest.raises(QueueFull) as full:
        await a.acquire(math.inf)
    assert full.value.headers["Retry-After"] == "1"
    waiting.cancel()
    await asyncio.gather(waiting, return_exceptions=True)
    await a.close()


def test_the_control_plane_answers_its_token_only() -> None:
    _run(_the_control_plane_answers_its_token_only)


async def _the_control_plane_answers_its_token_only(plane: Plane) -> None:
    import aiohttp

    async with aiohttp.ClientSession() as s:
        r = await s.post(
            plane.url + "/gates/m/acquire",
            json={"worker": "w", "slot": "1", "remaining_s": 1},
            headers={"authorization": "Bearer nope"},
        )
        body = await r.json()
    assert r.status == AuthenticationError.status
    assert body["error"]["code"] == AuthenticationError.code
    assert plane.gate.in_flight == 0


def test_a_worker_reads_every_workers_counts_from_the_control_plane() -> None:
    _run(_a_worker_reads_every_workers_counts_from_the_control_plane)


async def _a_worker_reads_every_workers_counts_from_the_control_plane(plane: Plane) -> None:
    a, b = plane.remote("w0-1"), plane.remote("w1-2")
    await a.acquire(math.inf)
    await b.acquire(math.inf)
    waiting = asyncio.create_task(a.acquire(math.inf))
    while plane.gate.queued < 1:
        await asyncio.sleep(0.01)
    # Each worker sees its own slice; the control plane counts both.
    assert (a.held, a.waiting, b.held, b.waiting) == (1, 1, 1, 0)
    assert await host_gates(plane.url, TOKEN) == {"m": {"in_flight": 2, "queued": 1}}
    assert plane.leases.view() == {"m": {"in_flight": 2, "queued": 1, "limit": 2}}
    b.release()
    await waiting  # b's slot passes to a's waiting ask
    assert (a.held, a.waiting, b.held) == (2, 0, 0)
    assert await host_gates(plane.url, TOKEN) == {"m": {"in_flight": 2, "queued": 0}}
    await a.close()
    await b.close()


def test_the_gate_counts_answer_the_workers_token_only() -> None:
    _run(_the_gate_counts_answer_the_workers_token_only)


async def _the_gate_counts_answer_the_workers_token_only(plane: Plane) -> None:
    import aiohttp

    async with aiohttp.ClientSession() as s:
        for headers in ({}, {"authorization": "Bearer nope"}, {"authorization": "Basic x"}):
            r = await s.get(plane.url + "/gates", headers=headers)
            body = await r.json()
            assert r.status == AuthenticationError.status, headers
            assert body["error"]["code"] == AuthenticationError.code
            assert "m" not in body
    assert await host_gates(plane.url, "nope") is None


class WorkerSide:
    """What a worker's live view reads of its gateway: its role and its gates."""

    def __init__(self, plane: Plane, remote: RemoteGate) -> None:
        self.role = ProcessRole("worker", "w0-1", 0, plane.url, TOKEN)
        self.gates = {"m": remote, "open": DeploymentGate("open", None, 0, "fcfs")}


def test_a_workers_live_view_marks_its_own_counts_when_the_control_plane_is_away() -> None:
    async def main() -> None:
        async with Plane() as plane:
            a, b = plane.remote("w0-1"), plane.remote("w1-2")
            await a.acquire(math.inf)
            await b.acquire(math.inf)
            live = Live(cast(LiveServices, WorkerSide(plane, a)), lambda _: None)
            queues, reached = await live.queues()
            assert reached
            assert queues["m"] == {"in_flight": 2, "queued": 0, "scope": "gateway"}
            assert queues["open"] == {"in_flight": 0, "queued": 0, "scope": "worker"}
        # The control plane is gone: this worker's own slot, said to be its own.
        queues, reached = await live.queues()
        assert not reached
        assert queues["m"] == {"in_flight": 1, "queued": 0, "scope": "worker"}
        await a.close()
        await b.close()

    asyncio.run(main())


def test_a_control_plane_that_does_not_answer_gives_no_counts_in_time() -> None:
    async def main() -> None:
        silent = socket.socket()  # accepts connections (its backlog), never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        closed = socket.socket()  # nobody listens here
        closed.bind(("127.0.0.1", 0))
        for sock in (silent, closed):
            url = f"http://127.0.0.1:{sock.getsockname()[1]}"
            started = time.monotonic()
            assert await host_gates(url, TOKEN, timeout_s=0.3) is None
            assert time.monotonic() - started < 5  # bounded by the timeout, not hung
        silent.close()
        closed.close()

    asyncio.run(main())


@settings(max_examples=60, deadline=None)
@given(
    st.sampled_from(list(Priority)),
    st.one_of(st.none(), st.tuples(st.text(max_size=300), st.text(max_size=300))),
    st.one_of(st.none(), st.integers(1, 10**6)),
    st.one_of(st.none(), st.integers(1, 10**6)),
)
def test_a_slot_ask_survives_the_wire(
    priority: Priority, task: tuple[str, str] | None, step: int | None, planned: int | None
) -> None:
    ask = SlotAsk(priority, task, step, planned)
    back = ask_from(ask_json(ask))
    assert back.priority == ask.priority and back.step == step and back.planned == planned
    if task is None:
        assert back.task is None
    else:
        assert back.task == (task[0][:256], task[1][:256])


def test_a_malformed_ask_is_a_standard_single_call() -> None:
    for junk in (None, 3, "x", {"priority": 99, "task": ["a"], "step": "1"}):
        assert ask_from(junk) == SlotAsk()
