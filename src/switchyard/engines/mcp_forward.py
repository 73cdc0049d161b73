"""`tools/call` to a Streamable HTTP tool server over the gateway's own kept-alive HTTP
connection, on the session the official SDK opened.

Why JSON-RPC is written here: the SDK's client (`ClientSession` over its Streamable HTTP
transport) sends each request through memory streams to a writer task, then httpx2 and
more anyio tasks, and validates the reply on the way back; per call that cost more than
everything the gateway governs (docs/benchmarks/2026-12-05-mcp-tools.md). The SDK still
does what is not per call: it opens the session (initialize, version negotiation), lists
the tools, pings, and serves every stdio server (engines/mcp_servers.py). This module
sends one JSON-RPC request per call with that session's `Mcp-Session-Id` and negotiated
`Mcp-Protocol-Version`, and reads one reply. A tool server is not trusted:

* the reply is read up to `max_bytes` (a JSON body, or an SSE stream until the event
  that answers this call); past it the call ran but its result is not taken
  (`too_large`);
* a reply counts only when it is a JSON object whose `id` is this call's own (ids are
  `sy-<n>` strings, apart from the SDK client's integers on the same session); a result
  is validated with the SDK's own model (`CallToolResult`), else it is malformed;
* an error's `code` must be an integer within ±2^31 and its `message` a string, kept to
  500 characters for the (masked) trace, never passed to the client;
* a result that cannot be passed on as it came (`result_refusal`: nested deeper than
  MAX_RESULT_DEPTH, or an integer no 64-bit integer holds, which orjson reads as a
  rounded float and does not write) is not validated: the call ran, and its result is
  refused (`unpassable`, with the reason), as one too large is;
* no redirect is followed and no compressed body is asked for; credentials go in the
  request headers only.

What an ending means for the caller (`CallOutcome`) is what the SDK path reported: a
refusal (4xx, a JSON-RPC error other than an internal one) was not run; a 5xx, an
internal error, a lost connection or a malformed reply may have run; a timeout or a
cancel sends `notifications/cancelled` to the server, as the SDK does. A 404 means the
server forgot the session: nothing ran, and the connection is renewed by its supervisor.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import re
from typing import Any

import aiohttp
import orjson

from switchyard.engines.bounded import read_bounded

log = logging.getLogger("switchyard.mcp")
KEEPALIVE_S = 4.0  # below uvicorn's 5 s, so the server never closes a connection we reuse
MAX_MESSAGE = 500
MAX_CODE = 2**31
INTERNAL_ERROR = -32603
INVALID_REQUEST = -32600
METHOD_NOT_FOUND = -32601
CONNECTION_CLOSED = -32000
REQUEST_TIMEOUT = -32001
CANCEL_TIMEOUT_S = 5.0
# A server's own requests met on a call's SSE stream that are answered: at most this many
# per call, and never while this many answers are still being posted (each is a POST of
# its own, on a connection of its own when none is idle): a server that writes thousands
# of pings into one reply stream gets a few answers, not thousands of connections.
MAX_ANSWERED_PER_CALL = 8
MAX_ANSWERS_IN_FLIGHT = 32
# Levels of nesting a tool's result may have: it is written inside the client's JSON-RPC
# reply, the SDK's envelope and a side effect's stored record, and orjson stops at 254
# levels, pydantic's serializer at 255 (a call's arguments have the same bound).
MAX_RESULT_DEPTH = 128
_INT64, _UINT64 = 2**63, 2**64
# An integer literal of 19 digits or more may be past 64 bits, which orjson reads as a
# float (another number): such a reply is read again with the standard library's parser,
# which keeps integers whole, so that `result_refusal` sees them.
_LONG_INTEGER = re.compile(rb"\d{19}")


class SessionLost(Exception):
    """The server no longer knows the session (HTTP 404): nothing ran."""


class ConnectFailed(Exception):
    """No connection could be made: nothing was sent."""


class HttpForwarder:
    """One tool server's `tools/call`s on an SDK-opened session (see the module
    docstring); `lost` once the server has forgotten the session."""

    def __init__(
        self,
        url: str,
        credentials: dict[str, str],
        session_id: str | None,
        protocol_version: str,
        max_bytes: int,
    ) -> None:
        self.url = url
        self.max_bytes = max_bytes
        self.lost = False
        headers = {
            **credentials,
            "content-type": "application/json",
            "accept": "application/json, text/event-stream",
            "accept-encoding": "identity",
            "mcp-protocol-version": protocol_version,
        }
        if session_id is not None:
            headers["mcp-session-id"] = session_id
        self._http = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=KEEPALIVE_S),
            headers=headers,
            timeout=aiohttp.ClientTimeout(total=None),
            skip_auto_headers=("User-Agent",),
        )
        self._ids = itertools.count(1)
        self._background: set[asyncio.Task[None]] = set()

    async def close(self) -> None:
        for task in list(self._background):
            task.cancel()
        await self._http.close()

    async def call(
        self, tool: str, arguments: dict[str, Any], meta: dict[str, Any] | None, timeout_s: float
    ) -> tuple[dict[str, Any] | None, tuple[int, str] | None, str]:
        """(result, error, how): `how` is `ok`, `refused` (not run), `timeout`, `lost`
        (the connection, after sending), `server_error`, `malformed`, `too_large` or
        `unpassable` (a result `result_refusal` refuses: the error's message says why).
        Raises SessionLost or ConnectFailed when nothing was sent."""
        rid = f"sy-{next(self._ids)}"
        params: dict[str, Any] = {"name": tool, "arguments": arguments}
        if meta:
            params["_meta"] = meta
        body = orjson.dumps({"jsonrpc": "2.0", "id": rid, "method": "tools/call", "params": params})
        try:
            async with asyncio.timeout(timeout_s):
                return await self._exchange(rid, body)
        except TimeoutError:
            self._tell_cancelled(rid, "timed out")
            return None, (REQUEST_TIMEOUT, "timed out"), "timeout"
        except asyncio.CancelledError:
            self._tell_cancelled(rid, "cancelled")
            raise

    async def _exchange(
        self, rid: str, body: bytes
    ) -> tuple[dict[str, Any] | None, tuple[int, str] | None, str]:
        try:
            async with self._http.post(self.url, data=body, allow_redirects=False) as resp:
                status = resp.status
                if status == 404:
                    self.lost = True
                    raise SessionLost("the tool server no longer knows the session")
                if status == 200 and resp.content_type == "text/event-stream":
                    reply, big = await self._read_sse(resp, rid)
                else:
                    raw = await self._read(resp)
                    reply, big = (None, True) if raw is None else (_json(raw), False)
        except aiohttp.ClientConnectorError:
            raise ConnectFailed("could not connect to the tool server") from None
        except (aiohttp.ClientError, OSError, EOFError, ValueError) as exc:
            log.warning("MCP tool server %s: call failed: %s", self.url, type(exc).__name__)
            return None, (CONNECTION_CLOSED, "connection lost"), "lost"
        if big:
            return None, (INTERNAL_ERROR, "result too large"), "too_large"
        return _outcome(status, reply, rid)

    async def _read(self, resp: aiohttp.ClientResponse) -> bytes | None:
        """The body, or None past max_bytes (a hostile length is not believed)."""
        return await read_bounded(resp, self.max_bytes)

    async def _read_sse(
        self, resp: aiohttp.ClientResponse, rid: str
    ) -> tuple[dict[str, Any] | None, bool]:
        """The event that answers `rid`, and whether max_bytes ran out first; requests
        from the server on the way are answered (ping) or declined, up to
        MAX_ANSWERED_PER_CALL of them, notifications skipped."""
        total = answered = 0
        # The stream so far, from the start of its unfinished line: each line is sliced
        # out once, and the rest is moved down once per chunk (never once per line), so
        # a server sending many short lines costs time linear in what it sent.
        buf = bytearray()
        data: list[bytes] = []
        async for chunk in resp.content.iter_any():
            total += len(chunk)
            if total > self.max_bytes:
                return None, True
            seek = len(buf)  # no line break before here: search only the new bytes
            buf += chunk
            start = 0
            while (i := buf.find(b"\n", seek)) >= 0:
                line = bytes(buf[start:i]).rstrip(b"\r")
                start = seek = i + 1
                if line.startswith(b"data:"):
                    value = line[5:]
                    data.append(value[1:] if value.startswith(b" ") else value)
                    continue
                if line or not data:
                    continue
                message, data = _json(b"\n".join(data)), []
                if not isinstance(message, dict):
                    continue
                if message.get("id") == rid and ("result" in message or "error" in message):
                    return message, False
                request = isinstance(message.get("method"), str) and "id" in message
                if request and answered < MAX_ANSWERED_PER_CALL:  # beyond: unanswered
                    answered += 1
                    self._answer(message)
            del buf[:start]
        return None, False

    def _answer(self, request: dict[str, Any]) -> None:
        """Answer a server's request met on a call's stream, as the SDK client would
        without callbacks: a ping with an empty result, anything else declined."""
        rid = request.get("id")
        if not (type(rid) is int and abs(rid) < MAX_CODE) and not (
            type(rid) is str and len(rid) <= 128
        ):
            return
        if len(self._background) >= MAX_ANSWERS_IN_FLIGHT:
            return
        reply: dict[str, Any] = {"jsonrpc": "2.0", "id": rid}
        if request.get("method") == "ping":
            reply["result"] = {}
        else:
            reply["error"] = {"code": METHOD_NOT_FOUND, "message": "not supported by this client"}
        self._post_later(orjson.dumps(reply))

    def _tell_cancelled(self, rid: str, reason: str) -> None:
        note = {
            "jsonrpc": "2.0",
            "method": "notifications/cancelled",
            "params": {"requestId": rid, "reason": reason},
        }
        self._post_later(orjson.dumps(note))

    def _post_later(self, body: bytes) -> None:
        task = asyncio.ensure_future(self._post_quietly(body))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _post_quietly(self, body: bytes) -> None:
        with contextlib.suppress(aiohttp.ClientError, OSError, TimeoutError):
            async with (
                asyncio.timeout(CANCEL_TIMEOUT_S),
                self._http.post(self.url, data=body, allow_redirects=False) as resp,
            ):
                await resp.read()


def _json(raw: bytes) -> Any:
    try:
        value = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return None
    if _LONG_INTEGER.search(raw) is not None:  # (a string of digits, too, is read twice)
        try:
            return json.loads(raw)
        except (ValueError, RecursionError):  # deeper than it reads: refused as such
            return value
    return value


def result_refusal(value: Any) -> str | None:
    """Why a tool's result (parsed JSON) cannot be passed on as it came, else None:
    nested deeper than MAX_RESULT_DEPTH, or an integer outside what orjson writes
    (-2^63 to 2^64 - 1). Walked without recursion, so any depth a parser reads is safe."""
    big = "it holds an integer past 64 bits, which would reach the client changed"
    if type(value) is int:
        return None if -_INT64 <= value < _UINT64 else big
    if type(value) is not dict and type(value) is not list:
        return None
    stack = [(value, 1)]
    while stack:
        v, depth = stack.pop()
        if depth > MAX_RESULT_DEPTH:
            return f"it nests deeper than {MAX_RESULT_DEPTH} levels"
        for c in v.values() if type(v) is dict else v:
            kind = type(c)
            if kind is dict or kind is list:
                stack.append((c, depth + 1))
            elif kind is int and not -_INT64 <= c < _UINT64:
                return big
    return None


def _error(value: Any) -> tuple[int, str]:
    """A JSON-RPC error object's (code, message), each checked and bounded."""
    if not isinstance(value, dict):
        return INTERNAL_ERROR, "malformed error"
    code, message = value.get("code"), value.get("message")
    if type(code) is not int or not -MAX_CODE < code < MAX_CODE:
        code = INTERNAL_ERROR
    return code, message[:MAX_MESSAGE] if isinstance(message, str) else ""


def _outcome(
    status: int, reply: Any, rid: str
) -> tuple[dict[str, Any] | None, tuple[int, str] | None, str]:
    from mcp_types import CallToolResult
    from pydantic import ValidationError

    if status >= 500:
        return None, (INTERNAL_ERROR, f"HTTP {status}"), "server_error"
    if status != 200:  # refused before it ran (no redirect is followed)
        if isinstance(reply, dict) and "error" in reply:
            return None, _error(reply["error"]), "refused"
        return None, (INVALID_REQUEST, f"HTTP {status}"), "refused"
    if not isinstance(reply, dict) or reply.get("id") != rid:
        return None, (INTERNAL_ERROR, "malformed reply"), "malformed"
    if "error" in reply:
        code, message = _error(reply["error"])
        return None, (code, message), "server_error" if code == INTERNAL_ERROR else "refused"
    result = reply.get("result")
    if not isinstance(result, dict):
        return None, (INTERNAL_ERROR, "malformed result"), "malformed"
    why = result_refusal(result)
    if why is not None:  # it ran; what it answered is not passed on
        return None, (INTERNAL_ERROR, why), "unpassable"
    try:
        checked = CallToolResult.model_validate(result)
    except ValidationError:
        return None, (INTERNAL_ERROR, "malformed result"), "malformed"
    return checked.model_dump(by_alias=True, mode="json", exclude_none=True), None, "ok"
