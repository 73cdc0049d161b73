"""Reading request bodies: size-limited before anything is parsed."""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
from starlette.requests import ClientDisconnect, Request

from switchyard.errors import InvalidRequest, PayloadTooLarge, RequestTimeout


def header_map(request: Request) -> dict[str, str]:
    """The request's headers as a plain dict (lower-case names; the first of repeated
    names wins, as with Starlette's `Headers.get`). A request reads a handful of
    headers; one dict makes each read a hash lookup instead of a scan."""
    out: dict[str, str] = {}
    for name, value in request.scope["headers"]:
        key = name.decode("latin-1")
        if key not in out:
            out[key] = value.decode("latin-1")
    return out


async def read_json(
    request: Request, max_bytes: int, timeout_s: float = 30.0, max_depth: int = 64
) -> Any:
    """The parsed JSON body; 413 past `max_bytes` (checked before reading), 408 if it
    does not arrive in `timeout_s`, 400 if not JSON or nested deeper than `max_depth`."""
    return parse_json(await read_body(request, max_bytes, None, timeout_s), max_depth)


async def read_body(
    request: Request, max_bytes: int, declared: str | None = None, timeout_s: float = 30.0
) -> bytes:
    """The raw body; 413 past `max_bytes`, checked before reading when the length is
    declared (`declared` is the Content-Length header when the caller has it), else
    counted as it arrives and stopped at the limit; 408 `request_timeout` when it has
    not all arrived within `timeout_s` (a stalled client must not hold its slot).

    Read straight from the ASGI channel: a body that arrives in one message (nearly
    every request) is taken as it is, with none of the async generator and joins of
    Starlette's `Request.body`."""
    if declared is None:
        declared = request.headers.get("content-length")
    if declared is not None:
        if not (declared.isascii() and declared.isdigit()):
            raise InvalidRequest("invalid Content-Length header", param="content-length")
        size = int(declared)
        if size > max_bytes:
            raise PayloadTooLarge(f"request body is {size} bytes; the limit is {max_bytes} bytes")
    receive = request.receive
    # uvicorn buffers the body on the request's cycle: once all of it is there
    # (`more_body` false), the read below cannot wait, so it needs no watch. That is
    # nearly every request; anything else (other servers, a body still arriving) is
    # watched.
    watch = task = None
    if getattr(getattr(receive, "__self__", None), "more_body", True) is not False:
        loop = asyncio.get_running_loop()
        watch = _WATCH[0]
        if watch is None or watch.loop is not loop:  # one loop per process, nearly always
            watch = _WATCH[0] = BodyWatch(loop)
        task = asyncio.current_task()
        assert task is not None
        watch.reading[task] = loop.time() + timeout_s
        if watch.timer is None:
            watch.timer = loop.call_later(watch.interval_s, watch.sweep)
    chunks: list[bytes] = []
    total = 0
    try:
        while True:
            message = await receive()
            if message["type"] != "http.request":  # http.disconnect: the client left
                raise ClientDisconnect()
            chunk = message.get("body", b"")
            total += len(chunk)
            if total > max_bytes:
                raise PayloadTooLarge(f"request body exceeds the limit of {max_bytes} bytes")
            if not message.get("more_body", False):
                if not chunks:
                    return chunk
                chunks.append(chunk)
                return b"".join(chunks)
            chunks.append(chunk)
    except asyncio.CancelledError:
        if watch is None or task not in watch.expired:
            raise
        assert task is not None
        task.uncancel()
        raise RequestTimeout(f"the request body did not arrive within {timeout_s:.1f}s") from None
    finally:
        if watch is not None and task is not None and watch.reading.pop(task, None) is None:
            watch.expired.discard(task)


class BodyWatch:
    """Ends body reads that outlive their time, with one timer for all of them.

    `asyncio.timeout` around every read cost ~3.5 us per request (a timer handle, a
    context manager, a heap push and pop) for what nearly every request never needs:
    its body is already there. Here a read registers in a dict (`read_body`), and a
    sweep every `interval_s`, scheduled only while reads are registered, cancels
    those past their time; the reader turns that cancellation into 408 (up to
    `interval_s` late)."""

    interval_s = 0.25

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.reading: dict[asyncio.Task[Any], float] = {}  # task -> loop.time() deadline
        self.expired: set[asyncio.Task[Any]] = set()  # cancelled by a sweep
        self.timer: asyncio.TimerHandle | None = None

    def sweep(self) -> None:
        self.timer = None
        now = self.loop.time()
        for task, deadline in list(self.reading.items()):
            if deadline <= now:
                del self.reading[task]
                self.expired.add(task)
                task.cancel()
        if self.reading:
            self.timer = self.loop.call_later(self.interval_s, self.sweep)


_WATCH: list[BodyWatch | None] = [None]  # the running loop's


def too_deep(obj: Any, limit: int) -> bool:
    """Whether objects and arrays nest deeper than `limit` (the top level is 1)."""
    stack = [(obj, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > limit:
            return True
        children = node.values() if isinstance(node, dict) else node
        for child in children:
            if isinstance(child, dict | list):
                stack.append((child, depth + 1))
    return False


def parse_json(raw: bytes, max_depth: int = 64) -> Any:
    """The parsed body; 400 if it is empty, not JSON, or nested deeper than
    `max_depth` (orjson cannot write back what nests past ~250 levels: such a body
    would fail later, in the upstream call or the ledger)."""
    if not raw:
        raise InvalidRequest("the request body is empty; send a JSON object")
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError:
        # orjson's message has positions and internals: the client gets a stable one.
        raise InvalidRequest("the request body is not valid JSON") from None
    # Only a body with that many brackets can nest that deep: most skip the walk.
    if (
        isinstance(body, dict | list)
        and raw.count(b"{") + raw.count(b"[") > max_depth
        and too_deep(body, max_depth)
    ):
        raise InvalidRequest(f"the request body is nested deeper than {max_depth} levels")
    return body
