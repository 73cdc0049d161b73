"""Relaying an upstream SSE stream to the client.

Events pass through as bytes; only events that mention usage are parsed. The usage
chunk that the gateway asked for on the client's behalf is dropped unless the client
asked for it too. If the upstream breaks after the first byte, the client receives an
SSE error event and no `[DONE]`: a truncated stream is never a silent success.
Closing the generator (client gone) closes the upstream connection, so the engine
stops generating.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import orjson
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from switchyard.engines.upstream import UpstreamStream
from switchyard.errors import SwitchyardError, TaskCancelled, UpstreamError
from switchyard.pipeline import RequestContext, Status
from switchyard.policy.tool_calls import StreamToolGate, ToolGovernor
from switchyard.service import record_tool_calls

DONE = b"data: [DONE]\n\n"


def error_event(exc: SwitchyardError) -> bytes:
    return b"data: " + orjson.dumps(exc.body()) + b"\n\n"


def _restore_event(data: bytes, restorer: Any) -> bytes:
    """Put raw values back into a chunk's generated text (mask_upstream mode); a
    placeholder split across chunks is held back until it is complete."""
    try:
        obj = orjson.loads(data)
    except orjson.JSONDecodeError:
        return data
    for c in obj.get("choices") or []:
        delta = c.get("delta") or {}
        if isinstance(delta.get("content"), str):
            delta["content"] = restorer.feed(delta["content"])
        elif isinstance(c.get("text"), str):
            c["text"] = restorer.feed(c["text"])
    return orjson.dumps(obj)


def _data(event: bytes) -> bytes | None:
    """The data of one SSE event; None for comments and events without data."""
    if event.startswith(b"data:") and b"\n" not in event:
        return event[5:].strip()
    parts = [line[5:].strip() for line in event.split(b"\n") if line.startswith(b"data:")]
    return b"\n".join(parts) if parts else None


def _tail_event(tail: str) -> bytes:
    """A held-back partial placeholder that never completed, sent as plain text."""
    chunk = {
        "object": "chat.completion.chunk",
        "choices": [{"index": 0, "delta": {"content": tail}, "finish_reason": None}],
    }
    return b"data: " + orjson.dumps(chunk) + b"\n\n"


def _governed(gate: StreamToolGate, data: bytes) -> tuple[list[bytes], dict[str, Any] | None]:
    """A chunk that carries tool calls, as the tool gate relays it: (data of each
    chunk, the parsed chunk as a template for held calls)."""
    try:
        obj = orjson.loads(data)
    except orjson.JSONDecodeError:
        return [data], None
    if not isinstance(obj, dict):
        return [data], None
    out = gate.feed(obj)
    if len(out) == 1 and out[0] is obj:  # relayed as it came
        return [data], obj
    return [orjson.dumps(o) for o in out], obj


async def relay(
    ctx: RequestContext, stream: UpstreamStream, governor: ToolGovernor | None = None
) -> AsyncIterator[bytes]:
    done = False
    gate: StreamToolGate | None = None  # made at the first chunk with tool calls
    gate_t = 0.0
    template: dict[str, Any] | None = None
    last = 0.0
    pii = ctx.pii
    restorer = pii.session.restore_stream() if pii is not None and pii.restore else None
    cs = ctx.cache_state
    collected = cs.collected if cs is not None else None  # events kept for the cache
    ctx.status = Status.STREAMING
    # Closed explicitly below: an async generator left suspended after [DONE] would be
    # finalised by the event loop's hook instead (a cross-thread wake-up and a task
    # per request).
    upstream_events = stream.events()
    try:
        async for events in upstream_events:
            out = []
            for event in events:
                data = _data(event)
                if data is None:
                    continue
                if data == b"[DONE]":
                    done = True
                    break
                if collected is not None:
                    collected.append(data)
                if b'"usage"' in data:
                    obj = orjson.loads(data)
                    usage = obj.get("usage")
                    if usage:
                        ctx.run.usage = usage
                        if not ctx.include_usage and not obj.get("choices"):
                            continue  # asked for by the gateway, not by the client
                if governor is not None and b'"tool_calls"' in data:
                    if gate is None:
                        gate, gate_t = StreamToolGate(governor), time.perf_counter()
                    governed, parsed = _governed(gate, data)
                    template = parsed or template
                    if collected is not None:  # the cache keeps what the client got
                        collected.pop()
                        collected.extend(governed)
                    for piece in governed:
                        if restorer is not None:
                            piece = _restore_event(piece, restorer)
                        out.append(b"data: " + piece + b"\n\n")
                    continue
                if restorer is not None:
                    data = _restore_event(data, restorer)
                out.append(b"data: " + data + b"\n\n")
            if done and gate is not None:
                for held in gate.flush(template or {}):  # calls whose choice never finished
                    out.append(b"data: " + orjson.dumps(held) + b"\n\n")
                if gate.governor.result.calls:
                    record_tool_calls(ctx, gate.governor.result, gate_t)
            ctx.run.chunks += len(out)
            if done:
                # The end goes out in the same write as the last events.
                if restorer is not None:
                    tail = restorer.flush()
                    if tail:
                        out.append(_tail_event(tail))
                ctx.status = Status.OK
                out.append(DONE)
            if out:
                now = time.perf_counter()
                if ctx.timings.client_first_byte is None:
                    ctx.timings.client_first_byte = now
                else:
                    ctx.run.chunk_gaps.append(now - last)
                last = now
                yield b"".join(out)
            if done:
                break
        if not done:
            raise UpstreamError("the upstream ended the stream before it was complete")
    except SwitchyardError as exc:
        ctx.status = Status.INCOMPLETE
        ctx.error_code = exc.code  # what the client was told, in the ledger too
        yield error_event(exc)
    except asyncio.CancelledError:
        if not ctx.cancelled:
            raise  # the client left, or shutdown
        # The task was cancelled (DELETE /v1/tasks/{id}): the client is told so, and
        # the upstream is closed below, so the engine stops generating.
        stopped = _task_stopped(ctx)
        yield error_event(stopped)
    finally:
        if ctx.status == Status.STREAMING:
            ctx.status = Status.CANCELLED  # the client left before the end
        ctx.timings.ended = time.perf_counter()
        await upstream_events.aclose()
        stream.close(complete=done)


def _task_stopped(ctx: RequestContext) -> TaskCancelled:
    """Take back the cancellation that stopped this stream for its task's cancel."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        task.uncancel()
    ctx.status = Status.CANCELLED
    ctx.error_code = TaskCancelled.code
    ctx.record(
        "task", "stopped", "the task was cancelled while this call streamed", time.perf_counter()
    )
    return TaskCancelled(f"the task '{ctx.input.task_id}' was cancelled while this call streamed")


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
    ) -> None:
        super().__init__(content, media_type=media_type, headers=headers)
        self._relay = content
        self._on_close = on_close
        self._ctx = ctx

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
                stopped = _task_stopped(ctx)
                with contextlib.suppress(Exception):
                    await send(
                        {
                            "type": "http.response.body",
                            "body": error_event(stopped),
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


def replay(obj: dict[str, Any], include_usage: bool, chunk_chars: int = 24) -> AsyncIterator[bytes]:
    """A cached chat.completion replayed as the SSE stream a client expects."""

    async def events() -> AsyncIterator[bytes]:
        base = {
            "id": obj.get("id"),
            "object": "chat.completion.chunk",
            "created": obj.get("created"),
            "model": obj.get("model"),
        }
        choice = (obj.get("choices") or [{}])[0]
        text = (choice.get("message") or {}).get("content") or choice.get("text") or ""
        first = {
            **base,
            "choices": [
                {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
            ],
        }
        yield b"data: " + orjson.dumps(first) + b"\n\n"
        for i in range(0, len(text), chunk_chars):
            piece = {
                **base,
                "choices": [
                    {
                        "index": 0,
                        "delta": {"content": text[i : i + chunk_chars]},
                        "finish_reason": None,
                    }
                ],
            }
            yield b"data: " + orjson.dumps(piece) + b"\n\n"
        last: dict[str, Any] = {
            **base,
            "choices": [
                {"index": 0, "delta": {}, "finish_reason": choice.get("finish_reason") or "stop"}
            ],
        }
        yield b"data: " + orjson.dumps(last) + b"\n\n"
        if include_usage:
            tail: dict[str, Any] = {**base, "choices": [], "usage": obj.get("usage")}
            yield b"data: " + orjson.dumps(tail) + b"\n\n"
        yield DONE

    return events()
