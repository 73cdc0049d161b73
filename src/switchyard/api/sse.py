"""Server-sent events: the framing of a stream, and the response that carries it.

The stream's data comes from the request's lifecycle (reply.relay: the reply side,
usage, status); this module only frames it. If the upstream breaks after the first
byte, the client receives an SSE error event and no `[DONE]`: a truncated stream is
never a silent success. Closing the generator (client gone) closes the upstream
connection, so the engine stops generating.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Protocol

import msgspec
import orjson
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from switchyard.errors import SwitchyardError, UpstreamError
from switchyard.pipeline import RequestContext, Status
from switchyard.reply import DONE_DATA, ChatChunk, first_choice, read_chunk, read_typed

DONE = b"data: [DONE]\n\n"
# Looked at once per write: an enum member read off its class costs ten times a
# global's read on Python 3.11 (about 3k instructions each, callgrind).
_OK = Status.OK


def error_event(exc: SwitchyardError) -> bytes:
    return b"data: " + orjson.dumps(exc.body()) + b"\n\n"


async def frame(ctx: RequestContext, data: AsyncIterator[list[bytes]]) -> AsyncIterator[bytes]:
    """Each batch of data as one write of SSE events; `[DONE]` after the last once the
    stream completed, an error event in its place when it did not."""
    try:
        async for batch in data:
            out = b"".join([b"data: " + d + b"\n\n" for d in batch])
            yield out + DONE if ctx.status is _OK else out
    except SwitchyardError as exc:
        yield error_event(exc)
    finally:
        aclose = getattr(data, "aclose", None)
        if aclose is not None:
            await aclose()


class RelayResponse(StreamingResponse):
    """A streaming response that stops the moment the client disconnects.

    Starlette (ASGI spec 2.4) only notices a departed client when a send fails, and
    uvicorn drops sends to a closed connection silently, so the relay would read the
    upstream to the end for nobody. Listening for `http.disconnect` alongside the
    stream cancels the relay, whose `finally` closes the upstream connection.
    """

    def __init__(
        self,
        content: AsyncIterator[bytes],
        *,
        media_type: str,
        headers: dict[str, str],
        on_close: Callable[[], Awaitable[None]],
        ctx: RequestContext | None = None,
        error_event: Callable[[SwitchyardError], bytes] = error_event,
    ) -> None:
        super().__init__(content, media_type=media_type, headers=headers)
        self._relay = content
        self._on_close = on_close
        self._ctx = ctx
        self._error_event = error_event  # the protocol's own error event

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        # One watcher task on plain asyncio (an anyio task group per stream cost more
        # than the relay itself): on `http.disconnect` it cancels this task, but only
        # while the relay still runs, so settling below is never interrupted.
        task = asyncio.current_task()
        assert task is not None
        state = {"streaming": True, "gone": False}

        async def watch() -> None:
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    if state["streaming"]:
                        state["gone"] = True
                        task.cancel()
                    return

        watcher = asyncio.create_task(watch())
        try:
            await self.stream_response(send)
            state["streaming"] = False
        except asyncio.CancelledError:
            state["streaming"] = False
            ctx = self._ctx
            if ctx is not None and ctx.cancelled and not state["gone"]:
                # Its task's cancel landed while a write was under way (the relay
                # handles one that lands while it waits for the upstream).
                stopped = ctx.stopped_by_task()
                with contextlib.suppress(Exception):
                    await send(
                        {
                            "type": "http.response.body",
                            "body": self._error_event(stopped),
                            "more_body": False,
                        }
                    )
            elif not state["gone"]:
                raise  # cancelled from outside (shutdown): not ours to swallow
            else:
                task.uncancel()
        finally:
            state["streaming"] = False
            watcher.cancel()
            # Runs even if the relay never started (client gone before the first
            # byte), so the upstream is closed and the request is settled once.
            aclose = getattr(self._relay, "aclose", None)
            if aclose is not None:
                await aclose()
            await self._on_close()


class Translator(Protocol):
    """A protocol's stream events made from chat completion chunks (Messages,
    Responses): one state machine per stream, appending its events to the list of the
    write they go out in. One whose `chunk` also takes reply.TypedChunk says so with a
    true `typed` attribute (`translated` then reads the usual chunk typed)."""

    def chunk(self, chunk: ChatChunk, out: list[bytes]) -> None:
        """The events of one chat completion chunk."""
        ...

    def end(self, out: list[bytes]) -> None:
        """The events that close a complete stream."""
        ...

    def failed(self, exc: SwitchyardError, out: list[bytes]) -> None:
        """The events that end a broken stream (its error, in the protocol's shape)."""
        ...

    async def ended(self) -> None:
        """Run once the stream ended, complete or not, before its last write."""
        ...


async def translated(
    ctx: RequestContext, data: AsyncIterator[list[bytes]], events: Translator
) -> AsyncIterator[bytes]:
    """The relay's chat chunks (reply.relay, after the reply side) as the protocol's
    events, one write per batch: the closing events with the last batch once the stream
    completed, the protocol's error events in their place when it did not."""
    # A translator whose `chunk` takes reply.TypedChunk as well (a true `typed`:
    # Responses) is handed a chunk of the usual shape read straight into those structs
    # (reply.read_typed), any other as a ChatChunk: the same parts either way
    # (reply.typed_parts, property-tested).
    read: Callable[[bytes], Any] = read_typed if getattr(events, "typed", False) else read_chunk
    step: Callable[[Any, list[bytes]], None] = events.chunk
    unfinished = False  # the relay passed `[DONE]` on: choice 0 never finished
    try:
        async for batch in data:
            out: list[bytes] = []
            for d in batch:
                try:
                    c = read(d)
                except msgspec.ValidationError:  # not of the usual shape, or no object
                    try:
                        c = read_chunk(d)
                    except msgspec.ValidationError:
                        continue  # JSON, but not an object: not a chunk
                    except msgspec.DecodeError:
                        raise _unreadable(ctx) from None
                except msgspec.DecodeError:  # not JSON, or not UTF-8: its text is lost
                    if d == DONE_DATA:  # (not JSON: looked at here, nothing per chunk)
                        unfinished = True  # the relay's last data: the stream ends below
                        continue
                    raise _unreadable(ctx) from None
                step(c, out)
            if ctx.status is _OK:
                events.end(out)
                await events.ended()
            if out:
                yield b"".join(out)
        if ctx.status is not _OK:
            # The relay ended without raising, yet not complete: the upstream sent an
            # `error` object, then `[DONE]`, or `[DONE]` before choice 0 finished
            # (reply.relay relays either to a chat client as it came and records it
            # INCOMPLETE). A translated stream ends as broken. Checked once per
            # stream, after its last batch: nothing per chunk.
            if unfinished:
                raise UpstreamError("the upstream ended the stream before its answer finished")
            raise UpstreamError("the upstream broke off its answer with an error")
    except SwitchyardError as exc:
        tail: list[bytes] = []
        events.failed(exc, tail)
        await events.ended()
        yield b"".join(tail)
    finally:
        aclose = getattr(data, "aclose", None)
        if aclose is not None:
            await aclose()


def _unreadable(ctx: RequestContext) -> UpstreamError:
    """An event the translation cannot read (not JSON, not UTF-8): what it held cannot
    be passed on, so the stream ends as broken (its error events, an incomplete row),
    never as a success missing a piece."""
    exc = UpstreamError("the upstream sent a stream event that is not JSON")
    ctx.status = Status.INCOMPLETE
    ctx.error_code = exc.code
    return exc


async def replayed(chunks: list[ChatChunk], events: Translator) -> AsyncIterator[bytes]:
    """A cached reply's chunks (reply.stream_chunks) as the protocol's events."""
    out: list[bytes] = []
    for c in chunks:
        events.chunk(c, out)
    events.end(out)
    await events.ended()
    yield b"".join(out)


def replay(obj: dict[str, Any], include_usage: bool, chunk_chars: int = 24) -> AsyncIterator[bytes]:
    """A cached chat.completion, or text_completion, replayed as the SSE stream a
    client of its endpoint expects."""
    choice = first_choice(obj)
    completion = obj.get("object") == "text_completion" or (
        "text" in choice and "message" not in choice
    )

    def choice_of(delta: dict[str, Any], finish: str | None) -> dict[str, Any]:
        if completion:  # a completion's chunk carries its text, not a delta
            text = delta.get("content", "")
            return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        return {"index": 0, "delta": delta, "finish_reason": finish}

    async def events() -> AsyncIterator[bytes]:
        base = {
            "id": obj.get("id"),
            "object": "text_completion" if completion else "chat.completion.chunk",
            "created": obj.get("created"),
            "model": obj.get("model"),
        }
        message = choice.get("message") or {}
        text = message.get("content") or choice.get("text") or ""
        if not completion:
            first = {**base, "choices": [choice_of({"role": "assistant", "content": ""}, None)]}
            yield b"data: " + orjson.dumps(first) + b"\n\n"
            for name in ("reasoning_content", "reasoning"):  # a reasoning model's thought
                thought = message.get(name)
                if isinstance(thought, str):
                    for i in range(0, len(thought), chunk_chars):
                        delta = {name: thought[i : i + chunk_chars]}
                        piece = {**base, "choices": [choice_of(delta, None)]}
                        yield b"data: " + orjson.dumps(piece) + b"\n\n"
        for i in range(0, len(text), chunk_chars):
            piece = {**base, "choices": [choice_of({"content": text[i : i + chunk_chars]}, None)]}
            yield b"data: " + orjson.dumps(piece) + b"\n\n"
        finish = choice.get("finish_reason") or "stop"
        last: dict[str, Any] = {**base, "choices": [choice_of({}, finish)]}
        yield b"data: " + orjson.dumps(last) + b"\n\n"
        if include_usage:
            tail: dict[str, Any] = {**base, "choices": [], "usage": obj.get("usage")}
            yield b"data: " + orjson.dumps(tail) + b"\n\n"
        yield DONE

    return events()
