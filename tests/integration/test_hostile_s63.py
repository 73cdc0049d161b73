"""Hostile input against this stop's new surfaces, over real servers.

- The canary guard's shared hash (state/guard_redis.py) in a real redis-server, written
  with what any writer of that Redis could put there: field names that are not UTF-8,
  counts that are negative, inconsistent, in another notation or absurdly long,
  timestamps that are NaN, infinite or far ahead, and far more fields than processes.
  A gateway must neither fail its exchange, nor cut on what it cannot parse, nor read
  an unbounded hash.
- The engine front's `/{name}/tokenize` (engines/front.py) over an engine that is not
  loaded: what is not a tokenize is refused before the engine is held (which would load
  it), in the OpenAI error shape; path tricks and names that are no engine get 401
  without the token and 404 with it.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import Any

from starlette.applications import Starlette
from starlette.routing import Mount

from support.canary_guard import Process
from support.gateways import local_model
from switchyard.config import parse_settings
from switchyard.engines.front import EngineFront, serve_front
from switchyard.engines.llamacpp_state import EngineState
from switchyard.engines.registry import Registry
from switchyard.state.guard_redis import MAX_REPORTS


def _prefix() -> str:
    return f"h{uuid.uuid4().hex[:8]}:"


def _garbage(now: float) -> dict[bytes, bytes]:
    """Reports no process of the gateway writes, each of which would cut a healthy
    canary if it were counted (99 errors, or more errors than requests)."""
    at = repr(now).encode()
    return {
        b"errors-over-n": b"0,99,0,0," + at,
        b"good-over-n": b"1,0,99,99," + at,
        b"nan-time": b"99,99,0,0,nan",
        b"inf-time": b"99,99,0,0,inf",
        b"future-time": b"99,99,0,0," + repr(now + 1e6).encode(),
        b"exponent": b"1e2,1e2,0,0," + at,
        b"underscores": b"9_9,9_9,0,0," + at,
        b"signed": b"+99,+99,0,0," + at,
        b"spaced": b" 99, 99,0,0," + at,
        b"five-counts": b"99,99,0,0,0," + at,
        b"long": b"9" * 5000 + b"," + b"9" * 5000 + b",0,0," + at,
        b"not-ascii": "٩٩,٩٩,0,0,".encode() + at,
        b"negative": b"-5,-99,0,0," + at,
    }


def test_a_field_name_that_is_not_utf8_neither_stops_the_exchange_nor_counts(
    redis_url: str,
) -> None:
    """Two processes, 6 outcomes each (half errors): together they pass `min_samples`
    and cut. A report under a name in bytes that are not UTF-8 is read like any other,
    not raised on."""

    async def go() -> tuple[list[bool], list[str]]:
        prefix = _prefix()
        a, b = Process(redis_url, prefix), Process(redis_url, prefix)
        await a.share._redis.hset(a.key, b"\xff\xfe", f"0,0,0,0,{time.time()!r}")
        a.outcomes(*(True, False) * 3)
        b.outcomes(*(True, False) * 3)
        for p in (a, b, a):
            await p.refresh()
        await a.share.close()
        await b.share.close()
        return [a.cut, b.cut], a.cuts + b.cuts

    cut, why = asyncio.run(go())
    assert cut == [True, True]
    assert len(why) == 2, why
    assert all("over 12 requests (6 of them in other gateway processes)" in w for w in why), why


def test_garbage_in_the_shared_hash_is_never_counted(redis_url: str) -> None:
    """A healthy canary (12 successes here) is not cut by reports it cannot take as a
    process's counts; a well-formed report beside them still counts."""

    async def go() -> tuple[bool, list[str], bool, list[str]]:
        p = Process(redis_url, _prefix())
        await p.share._redis.hset(p.key, mapping=_garbage(time.time()))
        p.outcomes(*[True] * 12)
        await p.refresh()
        healthy, healthy_cuts = p.cut, list(p.cuts)
        # One well-formed report of 12 errors: 12 of 24 fail, the canary is cut.
        await p.share._redis.hset(p.key, b"other", f"12,12,0,0,{time.time()!r}")
        await p.refresh()
        await p.share.close()
        return healthy, healthy_cuts, p.cut, p.cuts

    healthy, healthy_cuts, cut, cuts = asyncio.run(go())
    assert (healthy, healthy_cuts) == (False, [])
    assert cut
    assert "error rate 0.50 > 0.25 over 24 requests (12 of them in other" in cuts[0]


def test_a_flooded_hash_is_read_up_to_its_bound(redis_url: str) -> None:
    """Far more fields than any gateway has processes, each a well-formed report of one
    error: at most MAX_REPORTS of them are read, and a huge value is left unread."""

    async def go() -> list[str]:
        p = Process(redis_url, _prefix())
        r = p.share._redis
        at = repr(time.time())
        flood = {f"w{i}": f"1,1,0,0,{at}" for i in range(4 * MAX_REPORTS)}
        for i in range(0, len(flood), 1000):
            await r.hset(p.key, mapping=dict(list(flood.items())[i : i + 1000]))
        await r.hset(p.key, "huge", "1," * (1 << 20) + at)
        p.outcomes(True)
        await p.refresh()
        await p.share.close()
        return p.cuts

    cuts = asyncio.run(go())
    assert len(cuts) == 1
    others = int(cuts[0].split("(")[1].split(" of them")[0])
    assert 12 <= others <= MAX_REPORTS


def test_a_redis_that_lost_the_exchange_script_is_sent_it_again(redis_url: str) -> None:
    """The exchange runs a script by its digest: after Redis forgets its scripts (a
    restart, SCRIPT FLUSH) the next exchange loads it again and still shares."""

    async def go() -> list[str]:
        prefix = _prefix()
        a, b = Process(redis_url, prefix), Process(redis_url, prefix)
        a.outcomes(*(True, False) * 3)
        b.outcomes(*(True, False) * 3)
        await a.refresh()
        await a.share._redis.script_flush()
        await b.refresh()
        await a.share.close()
        await b.share.close()
        return b.cuts

    cuts = asyncio.run(go())
    assert len(cuts) == 1
    assert "over 12 requests (6 of them in other gateway processes)" in cuts[0]


TOKEN = "hostile-front-token"


async def _raw(
    port: int, method: str, path: str, headers: dict[str, str], body: bytes
) -> tuple[int, str]:
    """One HTTP/1.1 request with `path` sent as written (a client library would
    normalize its dot segments): the status and the error body's code."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    head = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
    writer.write(
        f"{method} {path} HTTP/1.1\r\nhost: x\r\ncontent-length: {len(body)}\r\n"
        f"connection: close\r\n{head}\r\n".encode()
        + body
    )
    raw = await asyncio.wait_for(reader.read(), 30)
    writer.close()
    status_line, _, rest = raw.partition(b"\r\n")
    payload = rest.split(b"\r\n\r\n", 1)[1]
    return int(status_line.split()[1]), json.loads(payload)["error"]["code"]


def _front(calls: list[tuple[str, str, dict[str, str], bytes]]) -> tuple[list[Any], EngineState]:
    """Each call's (status, error body) against a front over a cold engine, and the
    engine's state afterwards."""

    async def go() -> tuple[list[Any], EngineState]:
        registry = Registry(
            parse_settings(
                {"models": [local_model("smol", lazy=True)], "embeddings": {"enabled": False}},
                "test",
            )
        )
        registry.start()  # lazy: cold until a request holds it
        dep = registry.get("smol")
        assert dep is not None and dep.engine is not None
        app = EngineFront(registry, TOKEN)
        running = await serve_front(Starlette(routes=[Mount("/engines", app=app)]))
        out: list[Any] = []
        try:
            for method, path, headers, body in calls:
                out.append(await _raw(running.port, method, path, headers, body))
            return out, dep.engine.state
        finally:
            await app.close()
            await running.stop()
            await registry.stop()

    return asyncio.run(go())


AUTH = {"authorization": f"Bearer {TOKEN}"}


def test_what_is_no_tokenize_is_refused_before_the_engine_is_held() -> None:
    answers, state = _front(
        [
            ("POST", "/engines/smol/tokenize", AUTH, b"not json"),
            ("POST", "/engines/smol/tokenize", AUTH, b"[1, 2]"),
            ("POST", "/engines/smol/tokenize", AUTH, b'{"content": 5}'),
            ("GET", "/engines/smol/tokenize", AUTH, b""),
            ("DELETE", "/engines/smol/tokenize", AUTH, b""),
        ]
    )
    assert answers == [(400, "invalid_request")] * 3 + [(405, "method_not_allowed")] * 2
    assert state is EngineState.COLD  # nothing loaded it


def test_path_tricks_and_other_names_reach_no_engine() -> None:
    body = b'{"content": "hi"}'
    tricks = [
        "/engines/smol/../smol/tokenize",
        "/engines/smol/./tokenize",
        "/engines//smol/tokenize",
        "/engines/smol/v1/tokenize",
        "/engines/smol/v1/../tokenize",
        "/engines/tokenize",
        "/engines/nope/tokenize",
        "/engines/smol/tokenize/x",
    ]
    calls = [("POST", p, {}, body) for p in tricks] + [("POST", p, AUTH, body) for p in tricks]
    answers, state = _front(calls)
    assert answers[: len(tricks)] == [(401, "invalid_api_key")] * len(tricks)
    assert [status for status, _ in answers[len(tricks) :]] == [404] * len(tricks)
    assert state is EngineState.COLD
