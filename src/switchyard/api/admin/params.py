"""What the admin routes share: their JSON reply, query parameters read with bounds,
and a JSON object body that names only the fields a route takes.

Every admin answer goes through `as_json`, which keeps credentials in URLs out of it:
an upstream configured as `https://user:secret@host/v1?key=...` is recorded as
written (a usage row's and a trace's `upstream`, a selection's and an attempt's
evidence), and the answer shows `https://***@host/v1?key=***`. It is also never
stored by a cache (`Cache-Control: no-store`: a created key or approval token is
shown once) nor read as anything but JSON (`X-Content-Type-Options: nosniff`)."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any, TypeVar

import orjson
from starlette.requests import Request
from starlette.responses import Response

from switchyard.api.body import read_json
from switchyard.engines.urls import without_credentials
from switchyard.errors import InvalidRequest
from switchyard.state.keys import MAX_INT  # what SQLite stores: a larger one fails the write
from switchyard.state.sql import on_io
from switchyard.state.store import MemoryLedger, MemoryStore

MAX_BODY_BYTES = 65536
T = TypeVar("T")

# The admin API's own thread for the stores' synchronous calls (keys, approvals, tool
# calls): a write that waits on a locked database (another process's transaction,
# SQLite's 10 s busy timeout) waits there, not on the event loop, which every tenant's
# requests share; one thread, so admin writes keep their order.
_ADMIN_IO = ThreadPoolExecutor(1, thread_name_prefix="switchyard-admin")


async def off_loop(what: str, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """`fn(*args, **kwargs)` on the admin API's thread; a database that cannot be
    reached or is locked past its timeout is 503 `store_unavailable` naming `what`,
    never a 500 with the driver's text (state/sql.py `on_io`)."""
    return await on_io(_ADMIN_IO, what, partial(fn, *args, **kwargs))


# The admin API's reads of the ledger and traces (usage rows, the cost report, request
# and task traces): threads of their own, so a read that waits (a table another session
# holds locked, a report over many rows) holds up neither the event loop nor an admin
# write behind it (a key's revoke).
_ADMIN_READS = ThreadPoolExecutor(2, thread_name_prefix="switchyard-admin-read")


async def read_off_loop(
    what: str, source: object, fn: Callable[..., T], *args: Any, **kwargs: Any
) -> T:
    """`fn(*args, **kwargs)`, a read of `source` (the store or the ledger it reads), on
    the admin API's read threads; in the caller when `source` is in memory (nothing
    else can lock it, and its pending rows are the event loop's to flush). A database
    that cannot be reached or stays locked past its timeout is 503 `store_unavailable`
    naming `what` (state/sql.py `on_io`)."""
    if isinstance(source, MemoryStore | MemoryLedger):
        return fn(*args, **kwargs)
    return await on_io(_ADMIN_READS, what, partial(fn, *args, **kwargs))


def as_json(obj: Any, status: int = 200) -> Response:
    return Response(
        without_credentials(orjson.dumps(obj)),
        status_code=status,
        media_type="application/json",
        headers={"Cache-Control": "no-store", "X-Content-Type-Options": "nosniff"},
    )


def query_number(q: Any, name: str, default: float | None = None) -> float | None:
    """The finite number `?name=` gives (its first 32 characters), or `default`."""
    if name not in q:
        return default
    try:
        value = float(q[name][:32])
    except ValueError:
        raise InvalidRequest(f"'{name}' must be a number", param=name) from None
    if value != value or value in (float("inf"), float("-inf")):
        raise InvalidRequest(f"'{name}' must be a finite number", param=name)
    return value


def query_limit(q: Any, default: int = 100, most: int = 10_000) -> int:
    """`?limit=`, from 1 to `most`."""
    n = query_number(q, "limit", default)
    assert n is not None
    return max(1, min(int(n), most))


def query_text(q: Any, name: str) -> str | None:
    """`?name=` cut to 256 characters, None when absent or empty."""
    value = q.get(name)
    return None if value in (None, "") else str(value)[:256]


async def read_fields(request: Request, allowed: tuple[str, ...]) -> dict[str, Any]:
    """The body, a JSON object of `allowed` fields; an unknown field is refused by
    name."""
    body = await read_json(request, MAX_BODY_BYTES)
    if not isinstance(body, dict):
        raise InvalidRequest("the request body must be a JSON object")
    unknown = sorted(set(body) - set(allowed))
    if unknown:  # named within a bound: a hostile name is never echoed whole
        raise InvalidRequest(f"unknown field '{unknown[0][:64]}'", param=unknown[0][:64])
    for name, value in body.items():  # refused here, not a failed write (a 500) later
        if isinstance(value, int) and not isinstance(value, bool) and abs(value) > MAX_INT:
            raise InvalidRequest(f"'{name}' is out of range", param=name)
    return body
