"""Reading request bodies: size-limited before anything is parsed."""

from __future__ import annotations

from typing import Any

import orjson
from starlette.requests import ClientDisconnect, Request

from switchyard.errors import InvalidRequest, PayloadTooLarge


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


async def read_json(request: Request, max_bytes: int) -> Any:
    """The parsed JSON body; 413 past `max_bytes` (checked before reading), 400 if not JSON."""
    return parse_json(await read_body(request, max_bytes))


async def read_body(request: Request, max_bytes: int, declared: str | None = None) -> bytes:
    """The raw body; 413 past `max_bytes`, checked before reading when the length is
    declared (`declared` is the Content-Length header when the caller has it), else
    counted as it arrives and stopped at the limit.

    Read straight from the ASGI channel: a body that arrives in one message (nearly
    every request) is taken as it is, with none of the async generator and joins of
    Starlette's `Request.body`."""
    if declared is None:
        declared = request.headers.get("content-length")
    if declared is not None:
        try:
            size = int(declared)
        except ValueError:
            raise InvalidRequest("invalid Content-Length header") from None
        if size > max_bytes:
            raise PayloadTooLarge(f"request body is {size} bytes; the limit is {max_bytes} bytes")
    receive = request.receive
    chunks: list[bytes] = []
    total = 0
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


def parse_json(raw: bytes) -> Any:
    """The parsed body; 400 if it is empty or not JSON."""
    if not raw:
        raise InvalidRequest("the request body is empty; send a JSON object")
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise InvalidRequest(f"the request body is not valid JSON: {exc}") from None
