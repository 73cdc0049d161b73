"""The wire of `/mcp` (api/mcp.py, and a worker's relay, api/mcp_relay.py): the key
checked, the request's headers read and bounded into a `Caller`, the body read within its
limit (and replayed to the SDK when the call is not one the fast path takes), the checks
that decide whether it is (a plain id, a JSON accept, a handshake version), the framing
the SDK would misanswer, the bounds of a call's arguments, the JSON-RPC reply and error
bodies written by hand, and the SDK's refusals reworded without exception text.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import Awaitable, Iterator
from typing import Any

import orjson
from starlette.types import Message, Receive, Scope, Send

from switchyard.api.body import header_map
from switchyard.api.checks import past_int64
from switchyard.errors import (
    InvalidHeader,
    InvalidRequest,
    PayloadTooLarge,
    SwitchyardError,
)
from switchyard.identity import ANONYMOUS, Principal, TaskBudget
from switchyard.mcp_service import Caller
from switchyard.policy import headers as hdr
from switchyard.policy.auth import Authenticator
from switchyard.policy.pii_secrets import credential_shaped
from switchyard.policy.tool_calls import approval_tokens

MAX_ID = 128  # characters of a string JSON-RPC id the fast path takes (else: the SDK's)
MAX_INT_ID = 2**53  # an integer id beyond ±this goes to the SDK
# Levels of nesting a call's arguments may have: the JSON writer (orjson) stops at 254,
# and the arguments are written inside the call's JSON-RPC envelope and its evidence.
MAX_ARGUMENT_DEPTH = 128
JSON_HEADERS = [(b"content-type", b"application/json")]
PARSE_ERROR = -32700
INVALID_REQUEST = -32600
INVALID_PARAMS = -32602


def _headers(scope: Scope) -> dict[str, str]:
    """The request's headers as the model endpoints read them (api/body.py `header_map`):
    a repeated one by its first value, the value the SDK reads (Starlette's
    `Headers.get`), so the session checked here is the one it serves; but a credential
    header sent on two lines is named (`HeaderMap`), so `authenticate` refuses it 401
    as every other endpoint does, before the fast path or the SDK's transport (either
    protocol version) or a worker's relay sees the request."""
    return header_map(scope)


async def authenticate(auth: Authenticator, disabled: bool, h: dict[str, str]) -> Principal:
    """The caller's principal from its key, before anything reads the body; raises the
    401, for a repeated `Authorization` too (`h` from `_headers`; `auth.mode:
    disabled`: anonymous)."""
    if disabled:
        return ANONYMOUS
    got = auth.authenticate(h)
    return await got if isinstance(got, Awaitable) else got


def _caller(principal: Principal, h: dict[str, str]) -> Caller:
    """The request's headers, each bounded and checked as it is read."""
    task, bad = hdr.task_id(h)
    if bad is not None:
        raise bad
    parents, bad = hdr.parent_request_ids(h)
    if bad is not None:
        raise bad
    call_id = h.get("x-switchyard-call-id")
    if call_id is not None and not (len(call_id) <= 128 and hdr.ID_PATTERN.fullmatch(call_id)):
        raise InvalidHeader(
            "header x-switchyard-call-id: 1 to 128 characters of A-Z a-z 0-9 . _ : -",
            param="x-switchyard-call-id",
        )
    if call_id is not None and credential_shaped(call_id):  # kept in records: never one
        raise InvalidHeader(
            f"header x-switchyard-call-id {hdr.CREDENTIAL_SHAPED}", param="x-switchyard-call-id"
        )
    timeout = h.get("x-request-timeout")
    traceparent = h.get("traceparent")
    budget, task_timeout, deadline = (
        h.get("x-task-budget"),
        h.get("x-task-timeout"),
        h.get("x-task-deadline"),
    )
    return Caller(
        principal,
        task_id=task,
        call_id=call_id,
        approvals=tuple(approval_tokens(h.get("x-switchyard-approval"))),
        timeout_s=hdr.request_timeout(timeout) if timeout is not None else None,
        parents=parents,
        traceparent=traceparent if traceparent and len(traceparent) <= 128 else None,
        task_budget=TaskBudget.of(hdr.task_budget(budget)) if budget is not None else None,
        task_timeout_s=hdr.task_timeout(task_timeout) if task_timeout is not None else None,
        task_deadline_at=hdr.task_deadline(deadline) if deadline is not None else None,
    )


async def _send_error(send: Send, exc: SwitchyardError) -> None:
    body = orjson.dumps({"jsonrpc": "2.0", "id": None, "error": exc.jsonrpc_error()})
    headers = [(b"content-type", b"application/json")]
    headers += [(k.lower().encode(), v.encode()) for k, v in exc.headers.items()]
    if exc.status == 401:
        headers.append((b"www-authenticate", b'Bearer realm="switchyard"'))
    await send({"type": "http.response.start", "status": exc.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


# The SDK's words for a body it could not read carry the parser's or pydantic's own
# exception text (and echo the input): the client gets a plain sentence instead, with
# JSON-RPC's code for it. A body that is no request object at all (a batch, no `method`,
# a `jsonrpc` other than "2.0") is an Invalid Request, which the SDK's transport codes
# as invalid params.
_SDK_REFUSALS = {
    "Parse error:": (PARSE_ERROR, "Parse error: the request body is not valid JSON"),
    "Validation error:": (
        INVALID_REQUEST,
        "Invalid Request: the body is not a JSON-RPC 2.0 request, notification or response",
    ),
}
_NOT_ALLOWED = "Method Not Allowed: this protocol revision is served by POST only"


def _invalid_request(message: str) -> bytes:
    error = {"code": INVALID_REQUEST, "message": message}
    return orjson.dumps({"jsonrpc": "2.0", "id": None, "error": error})


def _without_exception_text(status: int, body: bytes) -> bytes:
    """The SDK's 400 JSON-RPC error body, its message reworded when it carries exception
    text (see _SDK_REFUSALS); its 413, its plain-text 400s and its empty 405 (the
    2026-07-28 path's answer to a GET or a DELETE) as JSON-RPC errors."""
    if status == 413:
        exc: SwitchyardError = PayloadTooLarge(
            "the request body is larger than the gateway accepts"
        )
        return orjson.dumps({"jsonrpc": "2.0", "id": None, "error": exc.jsonrpc_error()})
    try:
        got = orjson.loads(body)
        message = got["error"]["message"]
    except (orjson.JSONDecodeError, TypeError, KeyError):
        if status == 405:
            return _invalid_request(_NOT_ALLOWED)
        return _invalid_request(body.decode("utf-8", "replace")[:200] or "Invalid Request")
    if not isinstance(message, str):
        return body
    for prefix, (code, plain) in _SDK_REFUSALS.items():
        if message.startswith(prefix):
            got["error"] = {"code": code, "message": plain}
            return orjson.dumps(got)
    return body


def _mcp_error(exc: SwitchyardError) -> Exception:
    from mcp import MCPError

    err = exc.jsonrpc_error()
    return MCPError(err["code"], err["message"], err["data"])


def _meta(params: Any) -> dict[str, Any]:
    meta = getattr(params, "meta", None)
    if meta is None:
        return {}
    if isinstance(meta, dict):
        return meta
    dump = getattr(meta, "model_dump", None)
    return dict(dump(by_alias=True, exclude_none=True)) if dump is not None else {}


def _plain_id(value: Any) -> bool:
    """A JSON-RPC id the fast path echoes: an integer within ±2^53 (no bool) or a
    string of 1 to MAX_ID characters."""
    if type(value) is int:
        return -MAX_INT_ID < value < MAX_INT_ID
    return type(value) is str and 0 < len(value) <= MAX_ID


def _id_or_none(message: dict[str, Any]) -> bool:
    """Whether a JSON-RPC message's `id` is absent (a notification) or a string or an
    integer (a request's, as MCP has it: never null)."""
    if "id" not in message:
        return True
    rid = message["id"]
    return type(rid) is str or type(rid) is int


INVALID_ID = orjson.dumps(
    {
        "jsonrpc": "2.0",
        "id": None,
        "error": {
            "code": -32600,
            "message": "Invalid Request: an MCP request's id is a string or an integer",
        },
    }
)


def _invalid_params(rid: Any, message: str) -> bytes:
    error = {"code": INVALID_PARAMS, "message": message}
    return orjson.dumps({"jsonrpc": "2.0", "id": rid, "error": error})


def _framing_refusal(message: Any) -> tuple[int, bytes] | None:
    """(status, body) for a request the SDK would misanswer, else None: an `id` that is
    null, a boolean, an object or an array (the SDK takes it for a notification and
    answers nothing) is an Invalid Request, as is a `method` that is no string, for the
    request's own id; `params` that is not an object is Invalid params for the request's
    own id (the SDK, on either protocol version, refuses both with id null before it
    reads the id). An integer id past 64 bits is read as a float (orjson), so it is
    never echoed changed: it is refused as an id of the wrong type."""
    if not isinstance(message, dict) or "method" not in message:
        return None
    if not _id_or_none(message):
        return 400, INVALID_ID
    method = message.get("method")
    rid = message.get("id")  # a string or an integer here, or absent (a notification)
    if message.get("jsonrpc") != "2.0" or rid is None:
        return None  # a notification, or no JSON-RPC 2.0 request: the SDK's to refuse
    if not isinstance(method, str):  # the SDK: Invalid Request with id null
        error = {"code": INVALID_REQUEST, "message": "Invalid Request: 'method' must be a string"}
        return 400, orjson.dumps({"jsonrpc": "2.0", "id": rid, "error": error})
    params = message.get("params")
    if params is None or isinstance(params, dict):
        return None
    # 400, as the SDK answers a body it refuses before dispatch, with the id it knows.
    return 400, _invalid_params(rid, "Invalid params: 'params' must be an object")


def _initialized_already(message: Any) -> tuple[int, bytes] | None:
    """(400, Invalid Request for the request's own id) for an `initialize` sent in a
    session that is open: initialization is a session's first exchange and happens
    once (a second one would negotiate again what the session's requests are bound
    to, their MCP-Protocol-Version); else None."""
    if not isinstance(message, dict) or message.get("method") != "initialize":
        return None
    if "id" not in message or message.get("jsonrpc") != "2.0":
        return None  # a notification, or no JSON-RPC 2.0 request: the SDK's to refuse
    error = {
        "code": INVALID_REQUEST,
        "message": "Invalid Request: this session is initialized already; open a new "
        "session (POST without Mcp-Session-Id) to initialize again",
    }
    return 400, orjson.dumps({"jsonrpc": "2.0", "id": message["id"], "error": error})


def _deeper_than(value: Any, limit: int) -> bool:
    """Whether a parsed JSON value nests more than `limit` levels (walked without
    recursion)."""
    stack = [(value, 1)]
    while stack:
        v, depth = stack.pop()
        if isinstance(v, dict):
            children: Any = v.values()
        elif isinstance(v, list):
            children = v
        else:
            continue
        if depth > limit:
            return True
        stack.extend((c, depth + 1) for c in children if isinstance(c, (dict, list)))
    return False


def _check_arguments(arguments: Any) -> None:
    """A call's arguments as the tool will get them, else Invalid params (-32602): no
    deeper than MAX_ARGUMENT_DEPTH, and no integer past 64 bits (checks.past_int64),
    which would reach the tool as another number or not be written at all."""
    if arguments is None:
        return
    if _deeper_than(arguments, MAX_ARGUMENT_DEPTH):
        raise InvalidRequest(
            f"'arguments' nest deeper than {MAX_ARGUMENT_DEPTH} levels", param="arguments"
        )
    if past_int64(arguments):
        raise InvalidRequest(
            "'arguments' hold an integer past 64 bits, which would reach the tool "
            "changed; send it as a string",
            param="arguments",
        )


def _accepts_json(accept: str) -> bool:
    """The Accept header admits a JSON reply (as the SDK reads it: wildcards count)."""
    for part in accept.split(","):
        media = part.split(";", 1)[0].strip().lower()
        if media in ("application/json", "application/*", "*/*"):
            return True
    return False


def _json_body(h: dict[str, str]) -> bool:
    """A POST whose body is JSON (read here on every protocol version, for the framing
    the SDK would misanswer; another content type is the SDK's to refuse)."""
    return h.get("content-type", "").split(";", 1)[0].strip().lower() == "application/json"


def _fast_headers(h: dict[str, str], versions: tuple[str, ...]) -> bool:
    """A POST the fast path may serve: a JSON body, a JSON reply accepted, and a
    handshake-era protocol version (or none), which the SDK's legacy transport serves."""
    version = h.get("mcp-protocol-version")
    return (
        _json_body(h)
        and _accepts_json(h.get("accept", ""))
        and (version is None or version in versions)
    )


async def _read_body(receive: Receive, limit: int) -> bytes | bool:
    """The request body; True past `limit` bytes, False when the client went away."""
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return False
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            return True
        chunks.append(chunk)
        if not message.get("more_body"):
            return b"".join(chunks)


def _replay(body: bytes, receive: Receive) -> Receive:
    """A `receive` that hands the already-read body over once, then the connection's."""
    sent = False

    async def again() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return again


async def _send_json(send: Send, status: int, body: bytes, session: str | None) -> None:
    headers = list(JSON_HEADERS)
    if session is not None:
        headers.append((b"mcp-session-id", session.encode("latin-1")))
    headers.append((b"content-length", str(len(body)).encode()))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


@contextlib.contextmanager
def _holding(transport: Any) -> Iterator[None]:
    """Hold an SDK session open while a fast call runs, as its transport does for its
    own requests (the idle countdown waits until no request is in flight)."""
    idle = transport.idle_scope
    timeout = transport._idle_timeout
    if idle is None or timeout is None:
        yield
        return
    transport._requests_in_flight += 1
    idle.deadline = math.inf
    try:
        yield
    finally:
        transport._requests_in_flight -= 1
        if not transport._requests_in_flight:
            idle.deadline = asyncio.get_running_loop().time() + timeout


class _FastCall:
    """A `tools/call` the fast path serves in its request's own task, and whether the
    client (or the end of its session) cancelled it."""

    __slots__ = ("cancelled", "task")

    def __init__(self, task: asyncio.Task[Any]) -> None:
        self.task = task
        self.cancelled = False

    def cancel(self) -> None:
        if not self.cancelled:
            self.cancelled = True
            self.task.cancel()
