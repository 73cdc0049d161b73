"""The scripted upstream's request bodies and whole replies outside its streams: reading
a body (and handing it to the router once more), what a prompt is billed, the tool calls
`PUT /control/tool_calls` sets, a whole JSON reply (cut in half under
`drop-mid-stream`) and the error replies in OpenAI's and Anthropic's shapes.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import orjson
from starlette.responses import Response, StreamingResponse
from starlette.types import Receive

from switchyard.bench import scripted_messages
from switchyard.bench.scripted_upstream_faults import HANG_S, Abort, error_body

IMAGE_TOKENS = 256  # what one image costs, whatever its encoding (as a vision engine bills)


def billed_prompt_tokens(raw: bytes, body: dict[str, Any]) -> int:
    """The prompt as billed: every byte of the body at 4 a token, except images, each
    billed at IMAGE_TOKENS."""
    size, images = len(raw), 0
    messages = body.get("messages")
    for m in messages if isinstance(messages, list) else []:
        content = m.get("content") if isinstance(m, dict) else None
        for part in content if isinstance(content, list) else []:
            if isinstance(part, dict) and part.get("type") == "image_url":
                images += 1
                size -= len(orjson.dumps(part))
    return max(1, max(0, size) // 4 + images * IMAGE_TOKENS)


def tool_call_list(body: Any) -> list[dict[str, Any]]:
    calls = body.get("calls") if isinstance(body, dict) else None
    if not isinstance(calls, list):
        raise ValueError("calls must be a list")
    out = []
    for c in calls:
        if not isinstance(c, dict) or not isinstance(c.get("name"), str):
            raise ValueError("each call needs a name")
        args = c.get("arguments", {})
        out.append(
            {
                "name": c["name"],
                "arguments": args if isinstance(args, str) else orjson.dumps(args).decode(),
            }
        )
    return out


def whole_reply(payload: bytes, abort: Abort | None) -> Response:
    """A whole JSON reply; cut in half under its full Content-Length with
    `drop-mid-stream` (`abort` set)."""
    if abort is not None:
        return StreamingResponse(
            _cut(payload, abort),
            media_type="application/json",
            headers={"content-length": str(len(payload))},
        )
    return Response(payload, media_type="application/json")


def messages_error(status: int, message: str) -> Response:
    body = scripted_messages.error_body(status, message)
    return Response(body, status_code=status, media_type="application/json")


def error_response(status: int, message: str) -> Response:
    return Response(error_body(status, message), status_code=status, media_type="application/json")


async def read_body(receive: Receive) -> bytes:
    chunks = []
    while True:
        message = await receive()
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(chunks)


def replay_body(raw: bytes) -> Receive:
    """A receive that hands the body already read to the app once more."""
    sent = False

    async def receive() -> Any:
        nonlocal sent
        if sent:
            await asyncio.sleep(HANG_S)
        sent = True
        return {"type": "http.request", "body": raw, "more_body": False}

    return receive


async def _cut(payload: bytes, abort: Abort) -> AsyncIterator[bytes]:
    """Half a JSON reply under the full Content-Length, then the connection drops."""
    yield payload[: len(payload) // 2]
    await abort()
