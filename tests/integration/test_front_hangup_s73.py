"""The engine front's watch on its caller (engines/front.py `until_disconnect`) when
the engine's answer arrives at the moment the handler's wait ends.

What the work hands back there is an engine's stream (`Relay`): an open streaming
connection to the engine and a hold on the engine in the residency pool (`Lease`).
The stream here is a real one (the scripted upstream, streaming slowly, stands for the
engine's server) and the hold a real hold of the pool of a registry that is never
started (no engine process: the hold is the pool's count, what eviction reads).

Defect this file finds (fails on the code before s73): when the handler is cancelled
(uvicorn cancels running handlers once its graceful shutdown time is over) as the
engine's answer arrives, `until_gone` had no `undo`, so the Relay was dropped: the pool
kept counting the request in flight (its engine never evictable again) and the
engine's stream stayed open, generating for nobody.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import aiohttp
import httpx

from support.gateways import local_model
from support.upstreams import Scripted
from switchyard.config import parse_settings
from switchyard.engines.front import Lease, Relay, until_disconnect
from switchyard.engines.llamacpp import ManagedLlamaCpp
from switchyard.engines.pool import EnginePool
from switchyard.engines.registry import Registry

STREAM = {
    "model": "scripted",
    "messages": [{"role": "user", "content": "Tell me a long story."}],
    "stream": True,
}
SLOW = {"x-scripted-fault": "slow:300"}  # 16 events, 300 ms apart: running for seconds


def _engine() -> tuple[EnginePool, ManagedLlamaCpp]:
    settings = parse_settings(
        {"models": [local_model("smol")], "embeddings": {"enabled": False}}, "test"
    )
    registry = Registry(settings)
    dep = registry.get("smol")
    assert dep is not None and dep.engine is not None
    return registry.pool, dep.engine


def _stats(scripted: Scripted) -> dict[str, Any]:
    stats: dict[str, Any] = httpx.get(scripted.url + "/stats").json()
    return stats


def _wait_closed(scripted: Scripted, aborted_before: int) -> dict[str, Any]:
    """The upstream's counts once it saw the stream closed (at most 5 s)."""
    deadline = time.monotonic() + 5
    while True:
        stats = _stats(scripted)
        if stats["open_streams"] == 0 and stats["aborted"] > aborted_before:
            return stats
        if time.monotonic() > deadline:
            return stats
        time.sleep(0.02)


async def _run(scripted: Scripted, cancel: bool) -> tuple[str, Relay, ManagedLlamaCpp]:
    """`until_disconnect` over a work that opens an engine stream and holds the engine;
    as the work hands its Relay back, the caller's `receive` reports `http.disconnect`
    and (with `cancel`) the handler running `until_disconnect` is cancelled. How the
    handler ended, the Relay, and the engine whose hold it carries."""
    pool, engine = _engine()
    gone = asyncio.Event()
    made: list[Relay] = []

    async def receive() -> dict[str, Any]:
        await gone.wait()
        return {"type": "http.disconnect"}

    async with aiohttp.ClientSession() as session:

        async def work() -> Relay:
            pool.hold(engine)  # what the pool's `hot` does for a loaded engine
            lease = Lease(pool, engine)
            upstream = await session.post(
                scripted.url + "/v1/chat/completions", json=STREAM, headers=SLOW
            )
            assert upstream.status == 200
            relay = Relay(upstream, lease, upstream.headers["content-type"], {})
            made.append(relay)
            gone.set()  # the caller hangs up ...
            if cancel:
                handler.cancel()  # ... and its handler is cancelled, as the answer arrives
            return relay

        handler = asyncio.ensure_future(until_disconnect(receive, work()))
        try:
            result = await handler
            ended = "returned" if result is made[0] else "returned something else"
        except asyncio.CancelledError:
            ended = "cancelled"
        relay = made[0]
        if ended == "returned":
            assert engine.in_flight == 1  # the caller's to close: EngineFront does
            await relay.close()
        await asyncio.sleep(0)
        return ended, relay, engine


def test_a_relay_that_arrives_as_the_handler_is_cancelled_is_given_back(
    scripted: Scripted,
) -> None:
    aborted = _stats(scripted)["aborted"]
    ended, relay, engine = asyncio.run(_run(scripted, cancel=True))
    assert ended == "cancelled"
    assert engine.in_flight == 0, "the engine's hold was dropped, never released"
    assert relay.lease is not None and not relay.lease.held
    assert relay.upstream.closed
    stats = _wait_closed(scripted, aborted)
    assert stats["open_streams"] == 0, "the engine's stream was left open"
    assert stats["aborted"] == aborted + 1  # closed before its end: generation stopped


def test_a_hang_up_as_the_answer_arrives_hands_the_relay_to_its_caller(
    scripted: Scripted,
) -> None:
    """Both at once, no cancel: the result is returned (not dropped, not a
    ClientDisconnected), and the caller's close gives everything back."""
    aborted = _stats(scripted)["aborted"]
    ended, relay, engine = asyncio.run(_run(scripted, cancel=False))
    assert ended == "returned"
    assert engine.in_flight == 0
    assert relay.lease is not None and not relay.lease.held and relay.upstream.closed
    stats = _wait_closed(scripted, aborted)
    assert stats["open_streams"] == 0
    assert stats["aborted"] == aborted + 1
