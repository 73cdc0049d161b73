"""The scripted upstream's faults: the spec a request names (`parse_fault`), the OpenAI
error body a status fault answers with, and the actions on the raw ASGI connection
(answer at once, wait for the client to leave, drop the connection).

The fault grammar and where a fault comes from are in `scripted_upstream.py`'s
docstring; `scripted_upstream_app.py` applies them before its router.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import orjson
from starlette.types import Receive, Send

FAULT_HEADER = b"x-scripted-fault"
HANG_S = 3600.0

Abort = Callable[[], Awaitable[None]]


@dataclass(frozen=True, slots=True)
class Fault:
    """A parsed fault: an optional delay, then at most one action."""

    delay_s: float = 0.0
    # "status", "echo", "hang", "drop-mid-stream", "close", "stream-error"
    action: str | None = None
    status: int = 0
    slow_s: float = 0.0  # between streamed events
    retry_after: str | None = None  # sent with a status answer


def parse_fault(spec: str) -> Fault:
    """Parse a fault spec such as `status:503` or `delay:100,drop-mid-stream`.

    Delays add up; a later action replaces an earlier one. Raises ValueError naming the part
    that is wrong, so a typo in a test fails loudly instead of silently not faulting.
    """
    delay_s = 0.0
    slow_s = 0.0
    action: str | None = None
    status = 0
    retry_after: str | None = None
    for part in (p.strip() for p in spec.split(",")):
        name, _, arg = part.partition(":")
        if name == "slow" and arg:
            try:
                slow_s = float(arg) / 1000.0
            except ValueError:
                raise ValueError(f"fault {part!r}: slow needs milliseconds") from None
        elif name == "delay" and arg:
            try:
                delay_s += float(arg) / 1000.0
            except ValueError:
                raise ValueError(f"fault {part!r}: delay needs milliseconds") from None
        elif name == "status" and arg:
            if not arg.isdigit() or not 100 <= int(arg) <= 599:
                raise ValueError(f"fault {part!r}: status needs an HTTP code 100-599")
            action, status = "status", int(arg)
        elif name == "busy" and arg:
            if not arg.isdigit():
                raise ValueError(f"fault {part!r}: busy needs whole seconds")
            action, status, retry_after = "status", 503, arg
        elif name == "stream-error" and arg:
            if not arg.isdigit() or not 400 <= int(arg) <= 599:
                raise ValueError(f"fault {part!r}: stream-error needs an HTTP error code 400-599")
            action, status = "stream-error", int(arg)
        elif name == "echo" and arg:  # an error whose message quotes the request
            if not arg.isdigit() or not 400 <= int(arg) <= 599:
                raise ValueError(f"fault {part!r}: echo needs an HTTP error code 400-599")
            action, status = "echo", int(arg)
        elif name in ("hang", "drop-mid-stream", "close") and not arg:
            action = name
        else:
            raise ValueError(
                f"unknown fault {part!r}; use status:<code>, busy:<s>, echo:<code>, "
                "stream-error:<code>, delay:<ms>, slow:<ms>, hang, drop-mid-stream or close"
            )
    return Fault(delay_s, action, status, slow_s, retry_after)


def _error_type(status: int) -> str:
    if status == 401:
        return "authentication_error"
    if status == 403:
        return "permission_error"
    if status == 404:
        return "not_found_error"
    if status == 429:
        return "rate_limit_error"
    return "server_error" if status >= 500 else "invalid_request_error"


def error_body(status: int, message: str) -> bytes:
    """An OpenAI-shaped error body, so clients parse it like a real upstream's."""
    err = {"message": message, "type": _error_type(status), "param": None, "code": None}
    return orjson.dumps({"error": err})


async def send_json(send: Send, status: int, body: bytes, extra: list[tuple[bytes, bytes]]) -> None:
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        *extra,
    ]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


async def wait_disconnect(receive: Receive, timeout_s: float) -> None:
    """Wait until the client is gone (or the timeout), consuming any request body."""
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(timeout_s):
            while (await receive())["type"] != "http.disconnect":
                pass


async def abort_connection(send: Send, receive: Receive) -> None:
    """Close the client connection, sending nothing more.

    ASGI has no message for "drop the connection", so this reaches the server's transport
    through its bound `send` (uvicorn's request cycle keeps it as `.transport`). Bytes
    already written still go out first. Under a server without that attribute we raise,
    and the server closes the socket itself (or answers 500 if nothing was sent yet).
    """
    transport = getattr(getattr(send, "__self__", None), "transport", None)
    if transport is None:
        raise ConnectionAbortedError("scripted fault: dropping the connection")
    transport.close()
    # Returning only once the server saw the close keeps it from logging the
    # unfinished response as an application error.
    await wait_disconnect(receive, 2.0)
