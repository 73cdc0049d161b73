"""A stdio tool server's connection with every message line read within a bound.

The SDK's `stdio_client` reads a server's stdout as text and keeps a line until its
newline (re-joining the buffer on every chunk, so a long line costs quadratic time),
then parses it whole: one 24 MB reply, asked for by one client, holds the gateway's
memory and stalls the connection every tenant's calls to that server share. Here the
stdout is read in chunks of bytes (`BoundedLines`), and a line longer than
`max_line_bytes` (the tool service sets `mcp.max_result_bytes` plus room for the JSON-RPC
envelope) is discarded as it arrives: only its first and last 4 KiB are kept, and the
session gets, in its place, a JSON-RPC error whose `data` is an `OversizedReply` (a Python
object, so no server can forge one), which the call path reports as `too_large`.
A line within the bound goes to the SDK's `ClientSession` exactly as the SDK's transport
delivers it (its own `_parse_line`: a `SessionMessage`, or the parse error as a value;
a line that is not valid text comes as its decode error, where the SDK's reader stops).

Which request an oversized line answers (`PendingRequests.answer_oversized`) is read
from its top-level members that its first 4 KiB (members parsed in order until the first
one that does not end there) or its last 4 KiB (the longest suffix that parses as the end
of the object) show; the SDK's servers write `{"jsonrpc", "id", "result"}` in that order,
the TypeScript SDK's `{"result", "jsonrpc", "id"}`:

1. a line that shows a `"method"` is the server's own request or notification: it is
   dropped, and the session gets a parse error as a value (as for any line it cannot
   read), which it logs; a server request so dropped goes unanswered;
2. a line that shows an integer or string `"id"` answers that request (one no longer
   waited on, such as a cancelled call's late reply, fails nothing: the session drops it);
3. otherwise (the id sits between two large members) it answers the oldest request this
   connection sent that is still unanswered, pings aside (a ping's reply is empty): with
   one call in flight that is the one; with several, a server that hides its ids may see
   another call fail in place of the large one. A request is unanswered from its write
   until a reply with its id within the bound, an oversized reply attributed to it, or
   the session's `notifications/cancelled` for it.

A line within the bound that the SDK's reader cannot parse (its parser stops at about
200 levels of nesting) but that is a reply to a pending request (read with orjson, which
goes to 1,024) is not dropped: the request gets a JSON-RPC error in its place, whose
`data` is an `UnpassableReply` naming why (engines/mcp_forward.py `result_refusal`:
nested too deep), or none when the reply is malformed otherwise; else the call would
wait out its whole timeout for a reply that already came.

Only the read side is ours. The process is started, and stopped, with the SDK's own
helpers from `mcp.client.stdio` (its spawn in a new session or job, the specification's
shutdown sequence of close stdin, wait, terminate, kill): they are not public API, and the
tests that start a server through this module fail if a later SDK renames them. The write
side is a copy of the SDK's writer loop that also notes each request's id as pending (the
SDK's own loop has no place to observe what it writes). Lines are split on the byte
`\\n`, so the encoding must be ASCII-compatible (the gateway's is UTF-8).
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, TextIO

import anyio
import anyio.lowlevel
import orjson
from mcp.client.stdio import (  # the SDK's process handling (see the module docstring)
    _WRITER_FLUSH_TIMEOUT,
    StdioServerParameters,
    _aclose_all,
    _create_platform_compatible_process,
    _drain_stdout,
    _get_executable_command,
    _parse_line,
    _stop_server_process,
    get_default_environment,
)
from mcp.shared.dispatcher import coerce_request_id
from mcp.shared.message import SessionMessage
from mcp_types import (
    INTERNAL_ERROR,
    ErrorData,
    JSONRPCError,
    JSONRPCNotification,
    JSONRPCRequest,
    JSONRPCResponse,
    RequestId,
)

from switchyard.engines.mcp_forward import result_refusal

log = logging.getLogger("switchyard.mcp")
CHUNK = 64 * 1024  # bytes read from the server's stdout at a time
HEAD = TAIL = 4096  # bytes kept of an oversized line's start and end, to find its id


@dataclass(frozen=True, slots=True)
class OversizedLine:
    """A line longer than the bound: its size, and its first and last bytes."""

    size: int
    head: bytes
    tail: bytes


@dataclass(frozen=True, slots=True)
class OversizedReply:
    """The `data` of the error delivered for a reply over the bound (never on the wire)."""

    size: int
    limit: int


@dataclass(frozen=True, slots=True)
class UnpassableReply:
    """The `data` of the error delivered for a reply the SDK's reader could not parse
    (never on the wire): why its result is not passed on."""

    why: str


class BoundedLines:
    """Splits a byte stream into lines (without their `\\n`), keeping at most
    `max_line_bytes` of a line: a longer one comes out as an `OversizedLine`. An
    unterminated last line is never delivered (as in the SDK's reader)."""

    def __init__(self, max_line_bytes: int) -> None:
        self.max_line_bytes = max_line_bytes
        self._parts: list[bytes] = []
        self._size = 0
        self._head: bytes | None = None  # set once the line is over the bound
        self._tail = b""

    def feed(self, chunk: bytes) -> list[bytes | OversizedLine]:
        out: list[bytes | OversizedLine] = []
        start = 0
        while True:
            end = chunk.find(b"\n", start)
            self._take(chunk[start:] if end < 0 else chunk[start:end])
            if end < 0:
                return out
            out.append(self._end_line())
            start = end + 1

    def _take(self, piece: bytes) -> None:
        if not piece:
            return
        self._size += len(piece)
        if self._head is not None:  # discarding: only the ends are kept
            if len(self._head) < HEAD:  # (a bound below HEAD)
                self._head += piece[: HEAD - len(self._head)]
            self._tail = (self._tail + piece[-TAIL:])[-TAIL:]
        elif self._size <= self.max_line_bytes:
            self._parts.append(piece)
        else:
            parts = [*self._parts, piece]
            self._head = _first(parts, HEAD)
            self._tail = _last(parts, TAIL)
            self._parts = []

    def _end_line(self) -> bytes | OversizedLine:
        line: bytes | OversizedLine
        if self._head is not None:
            line = OversizedLine(self._size, self._head, self._tail)
        elif len(self._parts) == 1:
            line = self._parts[0]
        else:
            line = b"".join(self._parts)
        self._parts, self._size, self._head, self._tail = [], 0, None, b""
        return line


def _first(parts: list[bytes], n: int) -> bytes:
    out = bytearray()
    for p in parts:
        out += p[: n - len(out)]
        if len(out) >= n:
            break
    return bytes(out)


def _last(parts: list[bytes], n: int) -> bytes:
    out = b""
    for p in reversed(parts):
        out = p[-(n - len(out)) :] + out
        if len(out) >= n:
            break
    return out


_DECODER = json.JSONDecoder()
_MEMBER_START = re.compile(r",[ \t\r\n]*\"")


def _skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in " \t\r\n":
        i += 1
    return i


def head_members(head: bytes) -> dict[str, Any]:
    """The top-level members a line's first bytes show whole, in order, up to the first
    one that does not end within them (a value counts only once a `,` or `}` follows)."""
    text = head.decode("utf-8", "replace")
    out: dict[str, Any] = {}
    i = _skip_ws(text, 0)
    if text[i : i + 1] != "{":
        return out
    i += 1
    try:
        while True:
            key, i = _DECODER.raw_decode(text, _skip_ws(text, i))
            i = _skip_ws(text, i)
            if not isinstance(key, str) or text[i : i + 1] != ":":
                return out
            value, i = _DECODER.raw_decode(text, _skip_ws(text, i + 1))
            i = _skip_ws(text, i)
            if text[i : i + 1] not in (",", "}"):
                return out
            out[key] = value
            if text[i] == "}":
                return out
            i += 1
    except ValueError:
        return out


def tail_members(tail: bytes) -> dict[str, Any]:
    """The top-level members a line's last bytes show whole: the longest suffix that,
    after a `,`, parses as the end of an object (a suffix that starts inside a nested
    value has a closing bracket too many, so it does not)."""
    text = tail.decode("utf-8", "replace")
    for m in _MEMBER_START.finditer(text):
        try:
            members = json.loads("{" + text[m.start() + 1 :])
        except ValueError:
            continue
        if isinstance(members, dict):
            return members
    return {}


class PendingRequests:
    """The requests one connection sent and is waiting on, oldest first, and what an
    oversized line turns into (the rule is in the module docstring)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._waiting: dict[RequestId, tuple[RequestId, str]] = {}  # coerced id -> (id, method)

    def __len__(self) -> int:
        return len(self._waiting)

    def sent(self, message: Any) -> None:
        """Note a message written to the server."""
        if isinstance(message, JSONRPCRequest):
            self._waiting[coerce_request_id(message.id)] = (message.id, message.method)
        elif (
            isinstance(message, JSONRPCNotification) and message.method == "notifications/cancelled"
        ):
            rid = (message.params or {}).get("requestId")
            if isinstance(rid, str | int) and not isinstance(rid, bool):
                self._waiting.pop(coerce_request_id(rid), None)

    def received(self, line: bytes, encoding: str, errors: str) -> SessionMessage | Exception:
        """A line within the bound, as the SDK's transport delivers it."""
        try:
            text = line.decode(encoding, errors)
        except UnicodeDecodeError as exc:
            return exc
        item = _parse_line(text)
        if not isinstance(item, SessionMessage):
            return self._unreadable(line, item)
        message = item.message
        if isinstance(message, JSONRPCResponse | JSONRPCError) and message.id is not None:
            self._waiting.pop(coerce_request_id(message.id), None)
        return item

    def _unreadable(self, line: bytes, error: Exception) -> SessionMessage | Exception:
        """A line the SDK's reader refused: the error for the pending request it answers
        (see the module docstring), else the reader's error as it is."""
        try:
            reply = orjson.loads(line)
        except orjson.JSONDecodeError:
            return error
        rid = reply.get("id") if isinstance(reply, dict) else None
        if type(rid) is not str and type(rid) is not int:
            return error
        found = self._waiting.pop(coerce_request_id(rid), None)
        if found is None or "method" in reply:
            return error
        why = result_refusal(reply.get("result")) if "result" in reply else None
        log.warning("MCP stdio server's reply to request %r could not be read", found[0])
        data = UnpassableReply(why) if why is not None else None
        message = "result not passed on" if why is not None else "malformed reply"
        error_data = ErrorData(code=INTERNAL_ERROR, message=message, data=data)
        return SessionMessage(JSONRPCError(jsonrpc="2.0", id=found[0], error=error_data))

    def answer_oversized(self, line: OversizedLine) -> SessionMessage | Exception:
        """The error for the request an oversized line answers, or, where it answers
        none, a parse error as a value (the session logs it)."""
        seen = {**tail_members(line.tail), **head_members(line.head)}
        if "method" in seen:
            log.warning(
                "MCP stdio server sent a message of %d bytes (over %d): dropped",
                line.size,
                self.limit,
            )
            return ValueError(f"a server message of {line.size} bytes was dropped")
        rid = seen.get("id")
        if isinstance(rid, bool) or not isinstance(rid, str | int):
            rid = self._oldest()
        elif (found := self._waiting.get(coerce_request_id(rid))) is not None:
            rid = found[0]
        if rid is None:
            log.warning(
                "MCP stdio server sent a reply of %d bytes (over %d) to no pending request",
                line.size,
                self.limit,
            )
            return ValueError(f"a reply of {line.size} bytes to no pending request was dropped")
        self._waiting.pop(coerce_request_id(rid), None)
        log.warning(
            "MCP stdio server replied to request %r with %d bytes (over %d): not read",
            rid,
            line.size,
            self.limit,
        )
        error = ErrorData(
            code=INTERNAL_ERROR,
            message="result too large",
            data=OversizedReply(line.size, self.limit),
        )
        return SessionMessage(JSONRPCError(jsonrpc="2.0", id=rid, error=error))

    def _oldest(self) -> RequestId | None:
        return next((rid for rid, method in self._waiting.values() if method != "ping"), None)


@contextlib.asynccontextmanager
async def bounded_stdio_client(
    server: StdioServerParameters, errlog: TextIO, max_line_bytes: int
) -> AsyncIterator[tuple[Any, Any]]:
    """`mcp.client.stdio.stdio_client`, with its stdout read by `BoundedLines`: yields
    the (read, write) streams for a `ClientSession`."""
    command = await _get_executable_command(server.command)
    process = await _create_platform_compatible_process(
        command=command,
        args=server.args,
        env=get_default_environment() | (server.env or {}),
        errlog=errlog,
        cwd=server.cwd,
    )
    # No awaits until the task group is entered (a cancel here would leak the process).
    read_stream_writer, read_stream = anyio.create_memory_object_stream[SessionMessage | Exception](
        0
    )
    write_stream, write_stream_reader = anyio.create_memory_object_stream[SessionMessage](0)
    pending = PendingRequests(max_line_bytes)
    shutting_down = False
    writer_done = anyio.Event()

    async def stdout_reader() -> None:
        assert process.stdout, "the server process has no stdout"
        lines = BoundedLines(max_line_bytes)
        try:
            async with read_stream_writer:
                try:
                    while True:
                        try:
                            chunk = await process.stdout.receive(CHUNK)
                        except anyio.EndOfStream:
                            return
                        for line in lines.feed(chunk):
                            item = (
                                pending.answer_oversized(line)
                                if isinstance(line, OversizedLine)
                                else pending.received(
                                    line, server.encoding, server.encoding_error_handler
                                )
                            )
                            try:
                                await read_stream_writer.send(item)
                            except (anyio.ClosedResourceError, anyio.BrokenResourceError):
                                return  # the session is gone: only the drain remains
                finally:
                    await _drain_stdout(process)
        except anyio.ClosedResourceError:
            pass  # our own shutdown closed stdout under the read
        except (anyio.BrokenResourceError, ConnectionError):
            if not shutting_down:
                log.exception("reading an MCP stdio server's stdout failed mid-session")

    async def stdin_writer() -> None:
        assert process.stdin, "the server process has no stdin"
        try:
            async with write_stream_reader:
                async for session_message in write_stream_reader:
                    message = session_message.message
                    pending.sent(message)
                    text = message.model_dump_json(by_alias=True, exclude_unset=True)
                    data = (text + "\n").encode(server.encoding, server.encoding_error_handler)
                    await process.stdin.send(data)
        except (anyio.ClosedResourceError, anyio.BrokenResourceError, OSError):
            # The server may live on: end the read side, so no request hangs forever.
            await read_stream_writer.aclose()
        finally:
            writer_done.set()

    async def shutdown() -> None:
        """The SDK's: stop traffic, flush, stop the server, release the streams."""
        read_stream.close()
        write_stream.close()
        with anyio.move_on_after(_WRITER_FLUSH_TIMEOUT) as flush_scope:
            await writer_done.wait()
        if flush_scope.cancelled_caught:
            await anyio.lowlevel.cancel_shielded_checkpoint()
        await _stop_server_process(process)
        await _aclose_all(read_stream, write_stream, read_stream_writer, write_stream_reader)
        await anyio.lowlevel.checkpoint()

    async with anyio.create_task_group() as tg:
        tg.start_soon(stdout_reader)
        tg.start_soon(stdin_writer)
        try:
            yield read_stream, write_stream
        finally:
            shutting_down = True
            with anyio.CancelScope(shield=True):  # bounded waits: the process never leaks
                await shutdown()
            tg.cancel_scope.cancel()
    await anyio.lowlevel.cancel_shielded_checkpoint()
