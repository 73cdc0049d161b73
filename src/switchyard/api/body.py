"""Reading request bodies: size-limited before anything is parsed."""

from __future__ import annotations

from typing import Any

import orjson
from starlette.requests import Request

from switchyard.errors import InvalidRequest, PayloadTooLarge


async def read_json(request: Request, max_bytes: int) -> Any:
    """The parsed JSON body; 413 past `max_bytes` (checked before reading), 400 if not JSON."""
    declared = request.headers.get("content-length")
    if declared is not None:
        try:
            size = int(declared)
        except ValueError:
            raise InvalidRequest("invalid Content-Length header") from None
        if size > max_bytes:
            raise PayloadTooLarge(f"request body is {size} bytes; the limit is {max_bytes} bytes")
        raw = await request.body()
    else:  # chunked: count as it arrives and stop at the limit
        chunks, total = [], 0
        async for chunk in request.stream():
            total += len(chunk)
            if total > max_bytes:
                raise PayloadTooLarge(f"request body exceeds the limit of {max_bytes} bytes")
            chunks.append(chunk)
        raw = b"".join(chunks)
    if not raw:
        raise InvalidRequest("the request body is empty; send a JSON object")
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise InvalidRequest(f"the request body is not valid JSON: {exc}") from None
