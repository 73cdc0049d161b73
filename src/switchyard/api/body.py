"""Reading request bodies: size-limited before anything is parsed."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import numpy as np
import orjson
from starlette.requests import Request
from starlette.types import Scope

from switchyard.api.checks import MAX_PARAM
from switchyard.errors import (
    ClientDisconnected,
    DuplicateJsonKey,
    InvalidHttpFraming,
    InvalidRequest,
    PayloadTooLarge,
    RequestTimeout,
    SwitchyardError,
    UnsupportedMediaType,
)
from switchyard.request import may_hold_wide_integer, wide_integer

# Set in the ASGI scope by the HTTP protocol (server.py) when a request's body
# framing broke while the app read it; the app then sees only `http.disconnect`.
BAD_FRAMING = "switchyard.bad_framing"


# The headers that carry a credential: two lines of one are two credentials, so
# neither may be heard alone (policy/auth.py refuses the request 401).
CREDENTIAL_HEADERS = frozenset({"authorization", "x-api-key"})

# The comma-separated lists the gateway reads (RFC 9110 5.3: their lines are one list,
# so a second line is heard, never dropped; each list's reader bounds the whole).
LIST_HEADERS = frozenset(
    {
        "cache-control",
        "accept-language",
        "content-encoding",
        "x-parent-request-id",
        "x-switchyard-cache-tags",
        "x-switchyard-approval",
        "x-switchyard-device-state",
        "x-switchyard-network",
        "x-task-budget",
    }
)

# The single-valued headers the gateway reads: sent on two lines with different values,
# which one counts is a guess (a proxy or the upstream may keep the other), so the
# request is refused 400 naming it (policy/headers.py); the same value twice is one.
SINGLE_HEADERS = frozenset(
    {
        "x-request-id",
        "x-client-request-id",
        "x-task-id",
        "x-task-planned-steps",
        "x-task-timeout",
        "x-task-deadline",
        "x-request-timeout",
        "idempotency-key",
        "traceparent",
        "x-session-id",
        "x-switchyard-priority",
        "x-switchyard-locale",
        "x-switchyard-data-version",
        "x-switchyard-data-boundary",
        "anthropic-version",
        "content-type",
        "mcp-session-id",
        "mcp-protocol-version",
    }
)


class HeaderMap(dict[str, str]):
    """`header_map`'s answer when a header came on two lines where that is refused:
    the headers' dict, naming a credential header sent twice (`repeated_credentials`,
    which policy/auth.py reads with `getattr`) and single-valued headers sent with two
    values (`conflicting`, which policy/headers.py reads). Any other request gets a
    plain dict, so the common request pays nothing for the check (a dict subclass's
    reads are not specialized)."""

    __slots__ = ("conflicting", "repeated_credentials")
    repeated_credentials: tuple[str, ...]
    conflicting: tuple[str, ...]


def header_map(scope: Scope) -> dict[str, str]:
    """The request's headers (its ASGI `scope`'s) as a plain dict (lower-case names).
    A list header (`LIST_HEADERS`: `Cache-Control`, `x-parent-request-id`, ...) sent on
    several lines is one comma-separated list (RFC 9110 5.3), so a `no-store` or a
    parent on a second line is heard. A credential header (`CREDENTIAL_HEADERS`) sent
    twice keeps its first line, never merged, and the dict is a `HeaderMap` naming it,
    so the second credential is refused (policy/auth.py), never ignored; so is a
    single-valued header the gateway reads (`SINGLE_HEADERS`) sent with two different
    values (policy/headers.py refuses it 400). Any other repeated name: the first line
    wins, as with Starlette's `Headers.get`. A request reads a handful of headers; one
    dict makes each read a hash lookup instead of a scan."""
    out: dict[str, str] = {}
    repeated: tuple[str, ...] = ()
    conflicting: tuple[str, ...] = ()
    for name, value in scope["headers"]:
        key = name.decode("latin-1")
        if key not in out:
            out[key] = value.decode("latin-1")
        elif key in LIST_HEADERS:
            out[key] += ", " + value.decode("latin-1")
        elif key in CREDENTIAL_HEADERS:
            if key not in repeated:
                repeated += (key,)
        elif (
            key in SINGLE_HEADERS and key not in conflicting and out[key] != value.decode("latin-1")
        ):
            conflicting += (key,)
    if repeated or conflicting:
        named = HeaderMap(out)
        named.repeated_credentials = repeated
        named.conflicting = conflicting
        return named
    return out


async def read_json(
    request: Request, max_bytes: int, timeout_s: float = 30.0, max_depth: int = 64
) -> Any:
    """The parsed JSON body; 413 past `max_bytes` (checked before reading), 408 if it
    does not arrive in `timeout_s`, 400 if not JSON or nested deeper than `max_depth`."""
    return parse_json(await read_body(request, max_bytes, None, timeout_s), max_depth)


def check_encoding(value: str | None) -> None:
    """415 `unsupported_media_type` naming `content-encoding` for a coded body (gzip,
    deflate, br, ...): the gateway reads bodies as sent and never inflates one, so a
    compressed body is refused before any of it is read, with words that say why
    (not "not valid JSON"), and a zip bomb costs nothing. `identity` is no coding."""
    if value is not None and value.strip().lower() not in ("identity", ""):
        raise UnsupportedMediaType(
            "Content-Encoding is not supported: send the request body uncompressed",
            param="content-encoding",
        )


class _Unread:
    """read_body's `encoding` when the caller did not read the header."""


_UNREAD = _Unread()


async def read_body(
    request: Request,
    max_bytes: int,
    declared: str | None = None,
    timeout_s: float = 30.0,
    encoding: str | _Unread | None = _UNREAD,
) -> bytes:
    """The raw body; 413 past `max_bytes`, checked before reading when the length is
    declared (`declared` is the Content-Length header when the caller has it), else
    counted as it arrives and stopped at the limit; 408 `request_timeout` when it has
    not all arrived within `timeout_s` (a stalled client must not hold its slot);
    `ClientDisconnected` when the client hangs up first (uvicorn also reports a body
    whose chunked framing breaks as a hang-up, after answering it 400 itself): a
    client's doing, which the caller records as cancelled, never as its own error.

    Read straight from the ASGI channel: a body that arrives in one message (nearly
    every request) is taken as it is, with none of the async generator and joins of
    Starlette's `Request.body`.

    A body with a `Content-Encoding` (`encoding`, the header when the caller has it) is
    refused 415 before it is read (`check_encoding`)."""
    if isinstance(encoding, _Unread):
        encoding = request.headers.get("content-encoding")
    check_encoding(encoding)
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
            if message["type"] != "http.request":  # http.disconnect
                raise _ended(request, total, declared)
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


def _ended(request: Request, received: int, declared: str | None) -> SwitchyardError:
    """What a body that stopped arriving was: a framing error the HTTP layer already
    answered 400 (server.py marks the scope), else a client that hung up."""
    if request.scope.get(BAD_FRAMING):
        return InvalidHttpFraming("the request body's chunked framing is not valid HTTP/1.1")
    return ClientDisconnected(
        f"the client left after {received} of {declared or 'unknown'} body bytes"
    )


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


# An opening bracket as +1, a closing one as -1 (an int8's 0xff), every other byte deleted.
_STEPS = bytes.maketrans(b"{[}]", b"\x01\x01\xff\xff")
_NOT_BRACKETS = bytes(sorted(set(range(256)) - set(b"{}[]")))


def too_deep(raw: bytes, limit: int) -> bool:
    """Whether the objects and arrays of the JSON text `raw` nest deeper than `limit`
    (the top level is 1); exact for JSON, a guess for other text.

    Read from the bytes at C speed, never by walking the parsed body in Python (that
    walk held the event loop ~200 ms for a 2 MB body of 60,000 small messages, before
    any limit could refuse the request): the strings go, each bracket becomes a step
    of +1 or -1, and the deepest point of their running sum is the depth.

    Strings: in JSON, backslashes occur only in strings, where they
    pair left to right as the escapes do; without the `\\\\` pairs, and then the
    escaped quotes, every quote left opens or closes a string, so every other piece
    between quotes is outside them."""
    if b"\\" in raw:
        raw = raw.replace(b"\\\\", b"").replace(b'\\"', b"")
    text = b"".join(raw.split(b'"')[::2])
    steps = np.frombuffer(text.translate(_STEPS, _NOT_BRACKETS), np.int8)
    return bool(steps.size) and int(np.cumsum(steps, dtype=np.int32).max()) > limit


def parse_json(raw: bytes, max_depth: int = 64) -> Any:
    """The parsed body; 400 if it is empty, not JSON, nested deeper than `max_depth`
    (orjson cannot write back what nests past ~250 levels: such a body would fail
    later, in the upstream call or the ledger), if any object in it repeats a key
    (`duplicate_key`: orjson keeps the last of them, so policy would check one value
    while an upstream that keeps the first, reading the client's bytes as sent,
    serves another), or if it holds an integer no 64-bit integer holds (orjson reads
    it as a float: a body written again sends it rounded, the client's bytes send
    another number than policy read; request.py `wide_integer`)."""
    if not raw:
        raise InvalidRequest("the request body is empty; send a JSON object")
    # Checked on the bytes, before they are parsed: a body of millions of nested
    # arrays is refused without orjson building them (~1 s for 8 MB, the event loop
    # held). Only a body with that many brackets can nest that deep: most skip it.
    # (On text that is not JSON the depth may be misread: a 400 either way.)
    if raw.count(b"{") + raw.count(b"[") > max_depth and too_deep(raw, max_depth):
        raise InvalidRequest(f"the request body is nested deeper than {max_depth} levels")
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError:
        # orjson's message has positions and internals: the client gets a stable one.
        raise InvalidRequest("the request body is not valid JSON") from None
    # orjson's writing of the body serves both checks: the colons it holds prove no key
    # repeats, and no float in it is an integer read past 64 bits (nearly every body:
    # a count and a C scan of bytes written at C speed, no Python walk).
    written = _written(body)
    if written is None or not _colons_match(raw, written):
        key = first_repeated_key(raw)
        if key is not None:
            raise _duplicate_key(key)
    if written is None or may_hold_wide_integer(written):
        wide = wide_integer(raw)
        if wide is not None:
            raise _wide_integer(*wide)
    return body


def _written(body: Any) -> bytes | None:
    try:
        return orjson.dumps(body)
    except orjson.JSONEncodeError:  # nests past orjson's writer: not provable here
        return None


def _wide_integer(where: str, literal: str) -> InvalidRequest:
    """The 400 for an integer past 64 bits: names where it is and shows its digits
    (bounded; digits and a sign only)."""
    where = json.dumps(where[:MAX_PARAM])[1:-1] or "body"  # ASCII, no control character
    shown = literal if len(literal) <= 40 else literal[:40] + "..."
    return InvalidRequest(
        f"'{where}' is the integer {shown}, past 64 bits (no 64-bit integer holds it): the "
        "gateway reads it as a float and would send it on rounded; send it as a string, "
        "or within -2^63 to 2^64 - 1",
        param=where,
    )


# `\u003a` in a JSON string is a colon once decoded (hex digits in either case).
_ESCAPED_COLONS = (b"\\u003a", b"\\u003A")


def repeated_key(raw: bytes, body: Any) -> str | None:
    """A key that some object of the JSON text `raw` repeats, or None; `body` is
    orjson's parse of `raw`. Nearly every body is proven free of repeats by
    `colons_accounted` (a few byte counts, no Python walk); only one it cannot prove
    so is parsed again by the exact check."""
    if colons_accounted(raw, body):
        return None
    return first_repeated_key(raw)


def colons_accounted(raw: bytes, body: Any) -> bool:
    r"""Whether the colons of `raw` prove that no object in it repeats a key.

    In a JSON text, a `:` byte outside strings separates a member's key from its
    value; inside a string it is that string's own colon, and a string's colon is
    either that byte or the escape `\u003a` (hex in either case). orjson writes
    `body` back with one `:` per member it kept and every colon of the strings it
    kept as a plain byte, so without repeats

        raw.count(b":") + escaped colons == orjson.dumps(body).count(b":")

    holds exactly. A repeated key makes orjson drop a member (it keeps the last
    value; the earlier one goes, with every member and colon inside it), so the
    right side falls short by at least one and equality cannot hold. Counting `\u003a` bytes can only
    overcount escaped colons (a `\\u003a` is an escaped backslash, then text):
    that makes equality fail too, never hold falsely, and leaves the body to the
    exact check. tests/integration/test_duplicate_keys.py checks both directions on generated
    texts."""
    written = _written(body)
    return written is not None and _colons_match(raw, written)


def _colons_match(raw: bytes, written: bytes) -> bool:
    """`colons_accounted`, with orjson's writing of the body at hand."""
    escaped = 0
    if b"\\u003" in raw:  # one scan; nearly every body has no such escape
        escaped = raw.count(_ESCAPED_COLONS[0]) + raw.count(_ESCAPED_COLONS[1])
    return raw.count(b":") + escaped == written.count(b":")


class _RepeatedKey(Exception):
    """Stops the exact check's parse at the first repeated key (never leaves this
    module: `first_repeated_key` turns it into its answer)."""

    def __init__(self, key: str) -> None:
        super().__init__(key)
        self.key = key


def _unique_members(pairs: list[tuple[str, Any]]) -> None:
    """The stdlib parser's hook for each object it closes: raises on a repeat. The
    parsed value is not kept, so nothing is built."""
    if len(pairs) > 1 and len({key for key, _ in pairs}) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise _RepeatedKey(key)
            seen.add(key)


def first_repeated_key(raw: bytes) -> str | None:
    """The exact check: the first key found repeated in one object of `raw` (objects
    are checked as they close, inner ones first), or None. `raw` is JSON orjson
    accepted, so the stdlib parser (which accepts more) reads it too; should it not,
    the body is refused as not JSON rather than passed unchecked."""
    try:
        json.loads(raw.decode("utf-8"), object_pairs_hook=_unique_members)
    except _RepeatedKey as repeat:
        return repeat.key
    except (ValueError, RecursionError):  # JSONDecodeError, UnicodeDecodeError
        raise InvalidRequest("the request body is not valid JSON") from None
    return None


# How much of a repeated key the refusal quotes: enough to name any real parameter,
# bounded whatever the client sent.
_KEY_SHOWN = 64


def _duplicate_key(key: str) -> InvalidRequest:
    """The 400 for a repeated key: names it (its first `_KEY_SHOWN` characters,
    JSON-escaped to ASCII, so no control or odd character reaches a log or a
    terminal) and nothing else the client sent."""
    shown = json.dumps(key[:_KEY_SHOWN])[1:-1]
    more = "..." if len(key) > _KEY_SHOWN else ""
    return DuplicateJsonKey(
        f'the request body repeats the key "{shown}"{more} in one object; send each key once',
        param=shown,
    )
