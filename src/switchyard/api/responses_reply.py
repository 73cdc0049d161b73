"""The OpenAI Responses protocol's replies: the internal reply (a chat completion, or
its stream's chunks, after the request's reply side) as a `response` object and as the
Responses event stream, at the HTTP boundary.

The reply side (tool gate, cache, PII restore) has run on the chat shape, so a tool
call the gate removed never becomes a `function_call` item, and a cache hit is served
in the shape of the protocol that asked. Stream events carry `sequence_number`s:
`response.created`, `response.in_progress`, then per output item
`response.output_item.added`, for a message `response.content_part.added`,
`response.output_text.delta`…, `response.output_text.done`, `response.content_part.done`,
for a function call `response.function_call_arguments.delta`…,
`response.function_call_arguments.done`, then `response.output_item.done` (items
are done in output order; a function call's at the stream's end, since an upstream
may interleave its calls' pieces: `ResponseEvents`); last
`response.completed` (`response.incomplete` for a choice cut at `length` or by a
content filter), or on a broken stream `error` and `response.failed`. A refusal is a
message item of its own (`refusal` part, `response.refusal.delta`/`.done`); a call
whose arguments are no JSON object ends `incomplete` (`call_status`). A stream
whose client left before its end sends nothing more; its response ends `incomplete`
(`ResponseEvents.interrupted`), for the store.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, cast

import msgspec
import orjson

from switchyard.api.responses_codec import Ids, ResponsesRequest, new_item_id
from switchyard.errors import SwitchyardError
from switchyard.reply import (
    ChatChunk,
    ToolCallPiece,
    TypedChunk,
    chunk_parts,
    first_choice,
    typed_parts,
)
from switchyard.usage import counts


class Shell(msgspec.Struct):
    """What every state of one response object repeats: its id, request and model.

    A state's object is put together as bytes (`encoded`): the members every state
    repeats are encoded once, at the first state, in runs between the members the
    state sets, so a stream's two states (in progress, then completed) neither build
    nor encode the 24 members twice, and a whole reply's one state is encoded without
    building it as an object first. `object` is those bytes decoded, for what keeps
    the object itself (a background response, a failed stream). A struct: one is made
    per request, at a third of a dataclass's `__init__`."""

    rid: str
    req: ResponsesRequest
    model: str
    created_at: float = msgspec.field(default_factory=time.time)
    ids: Ids = new_item_id  # makes its output items' ids
    # The runs of members every state repeats (`_repeated`), made at the first state
    # (not passed: a struct has no member outside its `__init__`).
    _runs: tuple[bytes, bytes, bytes, bytes] | None = None

    def _repeated(self) -> tuple[bytes, bytes, bytes, bytes]:
        """The members every state repeats, in the object's order, encoded in the runs
        between those a state sets: up to `status`; `background` (then `error`); from
        `instructions` to `max_output_tokens` (then `model`); from
        `parallel_tool_calls` to `metadata` (then `usage`). A run of several members is
        the encoding of an object of them less its braces: the bytes orjson writes for
        them inside the whole object."""
        req = self.req
        echo = req.echo
        tail = orjson.dumps(
            {
                "parallel_tool_calls": echo.get("parallel_tool_calls", True),
                "previous_response_id": req.previous_response_id,
                "store": req.store,
                "temperature": echo.get("temperature"),
                "top_p": echo.get("top_p"),
                "text": echo.get("text") or {"format": {"type": "text"}},
                "tool_choice": echo.get("tool_choice", "auto"),
                "tools": echo.get("tools") or [],
                "truncation": "disabled",
                "metadata": echo.get("metadata") or {},
            }
        )
        runs = self._runs = (
            b"".join(
                (
                    b'{"id":',
                    orjson.dumps(self.rid),
                    b',"object":"response","created_at":',
                    b"%d" % int(self.created_at),
                    b',"status":',
                )
            ),
            b',"background":true,"error":' if req.background else b',"background":false,"error":',
            b"".join(
                (
                    b',"instructions":',
                    orjson.dumps(req.instructions),
                    b',"max_output_tokens":',
                    orjson.dumps(echo.get("max_output_tokens")),
                    b',"model":',
                )
            ),
            b"".join((b",", tail[1:-1], b',"usage":')),
        )
        return runs

    def encoded(
        self,
        status: str,
        output: bytes,
        usage: dict[str, Any] | None = None,
        error: dict[str, Any] | None = None,
        incomplete: str | None = None,
    ) -> bytes:
        """The response object in this state as JSON (`output`: its output items'
        JSON), byte for byte what orjson makes of the object (property-tested against
        the object written out member by member, tests/unit/api/
        test_responses_objects.py)."""
        head, background, middle, tail = self._runs or self._repeated()
        return b"".join(
            (
                head,
                orjson.dumps(status),
                b',"completed_at":',
                b"%d" % int(time.time()) if status == "completed" else b"null",
                background,
                b"null" if error is None else orjson.dumps(error),
                b',"incomplete_details":',
                orjson.dumps({"reason": incomplete}) if incomplete else b"null",
                middle,
                orjson.dumps(self.model),
                b',"output":',
                output,
                tail,
                orjson.dumps(usage) if status in _DONE else b"null",
                b"}",
            )
        )

    def object(
        self,
        status: str,
        output: list[dict[str, Any]],
        usage: dict[str, Any] | None = None,
        error: dict[str, Any] | None = None,
        incomplete: str | None = None,
    ) -> dict[str, Any]:
        """The response object in this state: its encoding (`encoded`) read back."""
        obj: dict[str, Any] = orjson.loads(
            self.encoded(status, orjson.dumps(output), usage, error, incomplete)
        )
        return obj


_DONE = frozenset(("completed", "failed", "incomplete", "cancelled"))


def response_error(exc: SwitchyardError | None) -> dict[str, Any]:
    """A failed response's `error` as OpenAI's API writes it, `code` and `message`:
    the code one of its codes for a response (the SDK's `ResponseError.code` is a
    closed set: a rate limit is `rate_limit_exceeded`, a request an engine or a check
    refused `invalid_prompt`, anything else `server_error`), the message the gateway's
    (the gateway's own code is in the usage row and the trace). None: an error that is
    no client's (its text is the log's alone). A stream's `error` event keeps the
    gateway's code, as the client's other error bodies do."""
    if exc is None:
        return {"code": "server_error", "message": "internal error"}
    if exc.status == 429:
        code = "rate_limit_exceeded"
    elif 400 <= exc.status < 500 and exc.status != 408:
        code = "invalid_prompt"
    else:
        code = "server_error"
    return {"code": code, "message": exc.message}


def usage_of(chat_usage: Any) -> dict[str, Any] | None:
    """The Responses usage of a chat usage; None when there is none, or its counts are
    none a request could have (the request is billed its estimate then: settle.py)."""
    counted = counts(chat_usage)
    if counted is None:
        return None
    inp, out = counted
    details = chat_usage.get("prompt_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    if type(cached) is not int or not 0 <= cached <= inp:
        cached = 0
    return {
        "input_tokens": inp,
        "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
        "output_tokens": out,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": inp + out,
    }


def _said(item_id: str, status: str, part: dict[str, Any]) -> dict[str, Any]:
    """An assistant message item of one content part."""
    return {
        "id": item_id,
        "type": "message",
        "role": "assistant",
        "status": status,
        "content": [part],
    }


def message_item(text: str, item_id: str, status: str = "completed") -> dict[str, Any]:
    part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
    return _said(item_id, status, part)


def call_item(
    call_id: str, name: str, arguments: str, item_id: str, status: str = "completed"
) -> dict[str, Any]:
    return {
        "id": item_id,
        "type": "function_call",
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }


def refusal_item(text: str, item_id: str, status: str = "completed") -> dict[str, Any]:
    """A message item whose content is the model's refusal (a chat `refusal`)."""
    return _said(item_id, status, {"type": "refusal", "refusal": text})


def call_status(arguments: str) -> str:
    """A function call item's status once its arguments are whole: `completed` when
    they are a JSON object, else `incomplete` (arguments as the model wrote them, which
    a client cannot parse: not a call to run, and not one the stored conversation
    answers). The one rule of the stream (`ResponseEvents`) and the whole reply."""
    try:
        value = orjson.loads(arguments)
    except orjson.JSONDecodeError:
        return "incomplete"
    return "completed" if type(value) is dict else "incomplete"


# chat `finish_reason` -> Responses `incomplete_details.reason` (others: completed)
INCOMPLETE = {"length": "max_output_tokens", "content_filter": "content_filter"}


def chat_message(chat: dict[str, Any]) -> dict[str, Any]:
    """The assistant message of a chat completion (its choice 0), as a chat message
    the conversation continues from."""
    msg = first_choice(chat).get("message")
    msg = msg if isinstance(msg, dict) else {}
    out: dict[str, Any] = {"role": "assistant", "content": msg.get("content")}
    if isinstance(msg.get("tool_calls"), list) and msg["tool_calls"]:
        out["tool_calls"] = msg["tool_calls"]
    return out


def _finish(chat: dict[str, Any]) -> str | None:
    got = first_choice(chat).get("finish_reason")
    return got if isinstance(got, str) else None


def _refusal(chat: dict[str, Any]) -> str:
    """The refusal of a chat completion's choice 0 ("" when it has none)."""
    msg = first_choice(chat).get("message")
    got = msg.get("refusal") if isinstance(msg, dict) else None
    return got if isinstance(got, str) else ""


def response_json(
    chat: dict[str, Any], shell: Shell, msg: dict[str, Any] | None = None
) -> tuple[str, bytes]:
    """A whole chat completion as the completed (or incomplete) response object:
    (its status, its JSON). `msg`: its `chat_message`, when the caller has it already."""
    if msg is None:
        msg = chat_message(chat)
    output: list[dict[str, Any]] = []
    text = msg.get("content")
    calls = msg.get("tool_calls") or []
    refusal = _refusal(chat)
    if (isinstance(text, str) and text) or not (calls or refusal):
        output.append(message_item(text if isinstance(text, str) else "", shell.ids("msg")))
    if refusal:
        output.append(refusal_item(refusal, shell.ids("msg")))
    for call in calls:
        fn = call.get("function") if isinstance(call, dict) else None
        if isinstance(fn, dict):
            args = fn.get("arguments")
            args = args if isinstance(args, str) else orjson.dumps(args).decode()
            output.append(
                call_item(
                    str(call.get("id") or ""),
                    str(fn.get("name") or ""),
                    args,
                    shell.ids("fc"),
                    call_status(args),
                )
            )
    incomplete = INCOMPLETE.get(_finish(chat) or "")
    status = "incomplete" if incomplete else "completed"
    usage = usage_of(chat.get("usage"))
    return status, shell.encoded(status, orjson.dumps(output), usage, incomplete=incomplete)


def to_response(
    chat: dict[str, Any], shell: Shell, msg: dict[str, Any] | None = None
) -> dict[str, Any]:
    """A whole chat completion as the completed (or incomplete) response object
    (`response_json`'s, read back)."""
    obj: dict[str, Any] = orjson.loads(response_json(chat, shell, msg)[1])
    return obj


def _sse(data: dict[str, Any]) -> bytes:
    return b"event: " + str(data["type"]).encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"


# Byte templates. Most of a stream's events have a fixed framing in which only ids,
# indexes, sequence numbers and text vary: each is put together from constant pieces
# and the JSON of what varies (its strings encoded by orjson, as `_sse` encodes them),
# the same bytes `_sse` makes of the event's object (property-tested for every
# template, tests/unit/api/test_responses_stream_templates.py), without building and
# encoding the object for each event. The events that are rare (function calls,
# errors) are made from their objects by `_sse`.


def _head(kind: str) -> bytes:
    """What an event of this type starts with, up to its second member."""
    return b'event: %s\ndata: {"type":"%s",' % (kind.encode(), kind.encode())


# What an event ends with, either side of its sequence number: the templates put an
# event together in one join of constant pieces and the few numbers formatted alone
# (formatting the pieces with `%` cost more).
_SEQ, _END = b',"sequence_number":', b"}\n\n"


def _tail(seq: int) -> bytes:
    return b"".join((_SEQ, b"%d" % seq, _END))


_CREATED = _head("response.created")
_IN_PROGRESS = _head("response.in_progress")
_ITEM_ADDED = _head("response.output_item.added")
_PART_ADDED = _head("response.content_part.added")
_TEXT_DONE = _head("response.output_text.done")
_PART_DONE = _head("response.content_part.done")
_ITEM_DONE = _head("response.output_item.done")
_RESPONSE_DONE = {
    "completed": _head("response.completed"),
    "incomplete": _head("response.incomplete"),
}


def response_event(head: bytes, response: bytes, seq: int) -> bytes:
    """`response.created`, `.in_progress`, `.completed`, `.incomplete` (by `head`) of
    the response object encoded as `response`."""
    return head + b'"response":' + response + _tail(seq)


def message_added(item_id: bytes, index: int, seq: int) -> bytes:
    """`response.output_item.added` and `response.content_part.added` of a message
    item (`item_id`: its id's JSON) at output `index`, numbered from `seq`."""
    at = b"%d" % index
    return b"".join(
        (
            _ITEM_ADDED, b'"output_index":', at, b',"item":{"id":', item_id,
            b',"type":"message","role":"assistant","status":"in_progress","content":[]}',
            _SEQ, b"%d" % seq, _END,
            _PART_ADDED, b'"item_id":', item_id, b',"output_index":', at,
            b',"content_index":0,'
            b'"part":{"type":"output_text","text":"","annotations":[],"logprobs":[]}',
            _SEQ, b"%d" % (seq + 1), _END,
        )
    )  # fmt: skip


def message_done(item_id: bytes, index: int, text: str, seq: int) -> bytes:
    """`response.output_text.done`, `response.content_part.done` and
    `response.output_item.done` of a completed message item with this `text`, numbered
    from `seq`: its text encoded once for the three."""
    at = b"%d" % index
    text_json = orjson.dumps(text)
    return b"".join(
        (
            _TEXT_DONE, b'"item_id":', item_id, b',"output_index":', at,
            b',"content_index":0,"text":', text_json, b',"logprobs":[]',
            _SEQ, b"%d" % seq, _END,
            _PART_DONE, b'"item_id":', item_id, b',"output_index":', at,
            b',"content_index":0,"part":{"type":"output_text","text":', text_json,
            b',"annotations":[],"logprobs":[]}',
            _SEQ, b"%d" % (seq + 1), _END,
            _ITEM_DONE, b'"output_index":', at, b',"item":{"id":', item_id,
            b',"type":"message","role":"assistant","status":"completed",'
            b'"content":[{"type":"output_text","text":', text_json,
            b',"annotations":[],"logprobs":[]}]}',
            _SEQ, b"%d" % (seq + 2), _END,
        )
    )  # fmt: skip


_TEXT_DELTA = _head("response.output_text.delta")
# What follows a text delta's JSON string (ResponseEvents.chunk puts it after the
# delta itself, as `delta_event` does, rather than calling it once per token).
DELTA_TAIL = b',"logprobs":[]' + _SEQ + b"%d" + _END
# That tail for the sequence numbers most streams reach, made once (formatting one
# costs more than the rest of a delta's bytes); a longer stream's later ones are
# formatted as they come.
_TAILED = 1024
_DELTA_TAILS = tuple(DELTA_TAIL % seq for seq in range(_TAILED))


def text_delta_head(item_id: str, output_index: int) -> bytes:
    """The bytes every `response.output_text.delta` event of one message item starts
    with, up to its delta: a stream's most frequent event is then its delta's JSON
    string between two constant pieces (`delta_event`), the same bytes `_sse` makes of
    the event's object (property-tested), without building the object per token."""
    return (
        _TEXT_DELTA
        + b'"item_id":'
        + orjson.dumps(item_id)
        + b',"output_index":%d,"content_index":0,"delta":' % output_index
    )


# A text delta's JSON string: msgspec's encoder (about 0.4k instructions for a token's
# few characters, orjson.dumps about 1k) writes the same bytes for any string
# (property-tested, tests/unit/api/test_responses_stream_templates.py); a lone
# surrogate, which no decoded chunk holds, both refuse.
_json_str = msgspec.json.Encoder().encode


def delta_event(head: bytes, text: str, seq: int) -> bytes:
    return head + _json_str(text) + DELTA_TAIL % seq


class ResponseEvents:
    """Chat completion chunks in, Responses events out, for one stream: the output
    items so far, the finish reason and usage, and the sequence. Each step appends its
    events to the caller's list (api/sse.py's Translator).

    An item is done (its `.done` events, then `response.output_item.done`) once nothing
    more can come for it, and items are done in output order: a message (or refusal)
    item when the next item opens, a function call item only when the stream ends, since
    an upstream may interleave the pieces of its calls (call 0, then 1, then 0 again:
    each piece is a delta of its own item, never one after that item is done, and each
    item's arguments are all its pieces in order). A message item that opens after a
    call waits for it, behind it in output order, to be done with it."""

    typed = True  # `chunk` takes reply.TypedChunk: sse.translated reads the usual chunk so

    def __init__(
        self, shell: Shell, on_end: Callable[[ResponseEvents], Awaitable[None]] | None = None
    ) -> None:
        self.shell = shell
        self.on_end = on_end  # once it ended (the route stores the response)
        self.seq = 0
        self.started = False
        self.output: list[dict[str, Any]] = []
        self.open: dict[str, Any] | None = None  # the message item being streamed
        # chat tool call index -> (its function call item, the item's output index)
        self.calls: dict[Any, tuple[dict[str, Any], int]] = {}
        # Items added and not yet done, with their output index, in output order: the
        # open message (last), the calls (open until the stream ends), and a message
        # after a call that is waiting for the call to be done before it.
        self.pending: list[tuple[dict[str, Any], int]] = []
        self.finish: str | None = None
        self.usage: dict[str, Any] | None = None
        # How it ended (completed, incomplete, failed) and its response object then,
        # as its last event carried it; `final` reads that back when asked for.
        self.status: str | None = None
        self.final_json: bytes | None = None
        self._final: dict[str, Any] | None = None
        self.closed = False  # `ended` ran (on_end was told)
        self._delta_head = b""  # text_delta_head of the open message item
        self._item_id = b""  # and its id's JSON
        # The open message item's text so far, in its deltas (joined into the item
        # when it closes, or when a broken stream shows it); None: no message open.
        self._text: list[str] | None = None
        # The same for an open message item of the model's refusal (its refusal part).
        self._refusal: list[str] | None = None

    @property
    def final(self) -> dict[str, Any] | None:
        """The response object once the stream ended."""
        if self._final is None and self.final_json is not None:
            self._final = orjson.loads(self.final_json)
        return self._final

    def _event(self, data: dict[str, Any]) -> bytes:
        data["sequence_number"] = self.seq
        self.seq += 1
        return _sse(data)

    def start(self, out: list[bytes]) -> None:
        self.started = True
        snapshot = self.shell.encoded("in_progress", b"[]")
        seq = self.seq
        out.append(response_event(_CREATED, snapshot, seq))
        out.append(response_event(_IN_PROGRESS, snapshot, seq + 1))
        self.seq = seq + 2

    def _text_so_far(self) -> None:
        """The open message item's text (or refusal) as its deltas have told it."""
        if self.open is not None:
            if self._text is not None:
                self.open["content"][0]["text"] = "".join(self._text)
            elif self._refusal is not None:
                self.open["content"][0]["refusal"] = "".join(self._refusal)

    def _settle(self) -> None:
        """The open message item is whole: its text (or refusal) joined into it, and
        nothing more goes to it (the next text opens a message item of its own)."""
        if self.open is not None:
            self._text_so_far()
            self.open, self._text, self._refusal = None, None, None

    def _done_so_far(self, out: list[bytes]) -> None:
        """The pending items that can be done now, in output order: those up to the
        first function call (open until the stream ends) or the open message."""
        pending = self.pending
        while pending and (item := pending[0][0]) is not self.open:
            if item["type"] == "function_call":
                return
            self._done(*pending.pop(0), out)

    def _done(self, item: dict[str, Any], index: int, out: list[bytes]) -> None:
        """The events that end one whole item at output `index`."""
        if item["type"] == "message":
            item["status"] = "completed"
            if item["content"][0]["type"] == "refusal":
                self._refusal_done(item, index, out)
                return
            text = item["content"][0]["text"]
            out.append(message_done(orjson.dumps(item["id"]), index, text, self.seq))
            self.seq += 3
            return
        item["status"] = call_status(item["arguments"])  # (once per call, at its end)
        out.append(
            self._event(
                {
                    "type": "response.function_call_arguments.done",
                    "item_id": item["id"],
                    "output_index": index,
                    "arguments": item["arguments"],
                }
            )
        )
        out.append(
            self._event({"type": "response.output_item.done", "output_index": index, "item": item})
        )

    def _close(self, out: list[bytes]) -> None:
        """The end of a complete stream's items: every pending one done, in order."""
        self._settle()
        pending, self.pending = self.pending, []
        for item, index in pending:
            self._done(item, index, out)

    def _refusal_done(self, item: dict[str, Any], index: int, out: list[bytes]) -> None:
        """`response.refusal.done`, `.content_part.done`, `.output_item.done` of a
        refusal's message item (rare: made from their objects)."""
        part = item["content"][0]
        at = {"item_id": item["id"], "output_index": index, "content_index": 0}
        out.append(self._event({"type": "response.refusal.done", **at, "refusal": part["refusal"]}))
        out.append(self._event({"type": "response.content_part.done", **at, "part": dict(part)}))
        out.append(
            self._event({"type": "response.output_item.done", "output_index": index, "item": item})
        )

    def _refused(self, refusal: str, out: list[bytes]) -> None:
        """A refusal delta: in a message item of its own (opened at its first)."""
        pieces = self._refusal
        item = self.open
        if pieces is None or item is None:
            item = refusal_item("", self.shell.ids("msg"), "in_progress")
            self._add(item, out)
            pieces = self._refusal = []
            at = {"item_id": item["id"], "output_index": len(self.output) - 1, "content_index": 0}
            part = {"type": "refusal", "refusal": ""}
            out.append(self._event({"type": "response.content_part.added", **at, "part": part}))
        pieces.append(refusal)
        index = len(self.output) - 1
        at = {"item_id": item["id"], "output_index": index, "content_index": 0}
        out.append(self._event({"type": "response.refusal.delta", **at, "delta": refusal}))

    def _add(self, item: dict[str, Any], out: list[bytes]) -> int:
        """A new output item (its `added` events; a message item is then the open one):
        the open message item is whole, and done unless a call before it is open.
        Returns its output index."""
        self._settle()
        self._done_so_far(out)
        index = len(self.output)
        self.output.append(item)
        self.pending.append((item, index))
        if item["type"] != "message":  # a function call
            out.append(
                self._event(
                    {"type": "response.output_item.added", "output_index": index, "item": item}
                )
            )
            return index
        self.open = item
        if item["content"][0]["type"] == "refusal":
            added = {**item, "content": []}  # (a refusal's: made from its object)
            out.append(
                self._event(
                    {"type": "response.output_item.added", "output_index": index, "item": added}
                )
            )
        else:
            self._text = []
            self._item_id = orjson.dumps(item["id"])
            self._delta_head = text_delta_head(item["id"], index)
            out.append(message_added(self._item_id, index, self.seq))
            self.seq += 2
        return index

    def chunk(self, chunk: ChatChunk | TypedChunk, out: list[bytes]) -> None:
        """The events of one chat completion chunk: read typed (reply.TypedChunk, the
        usual shape: api/sse.py's `translated` reads the relay's data so) or a
        ChatChunk (any other shape, a cached reply's chunks), read into its parts."""
        # `type(...) is`, not `isinstance`: a struct's class has its own metaclass, so
        # `isinstance` looks up and calls `__instancecheck__` (~0.8k instructions a chunk).
        if type(chunk) is not TypedChunk:
            usage, text, calls, finish, refusal = chunk_parts(cast(ChatChunk, chunk))
        elif (
            chunk.usage is None
            and (choices := chunk.choices)
            and (choice := choices[0]).finish_reason is None
            and ((i := choice.index) is None or (type(i) is int and i == 0))  # choice 0
            and (delta := choice.delta) is not None
            and delta.tool_calls is None
            and delta.refusal is None
            and type(text := delta.content) is str
        ):
            # Text and nothing else, a stream's usual chunk: its parts are (None, its
            # text, (), None), what `typed_parts` makes of it (property-tested), read
            # off the struct without that call and its tuple.
            usage, calls, finish, refusal = None, (), None, ""
        else:
            usage, text, calls, finish, refusal = typed_parts(chunk)
        if not self.started:
            self.start(out)
        if self.finish is not None:  # choice 0 ended: nothing after it is the answer
            if usage is not None:  # (but its usage, which may come after)
                self.usage = usage
            return
        if text:
            pieces = self._text
            if pieces is None:  # no message item open: one opens
                self._add(message_item("", self.shell.ids("msg"), "in_progress"), out)
                pieces = self._text
                assert pieces is not None
            pieces.append(text)
            seq = self.seq
            tail = _DELTA_TAILS[seq] if seq < _TAILED else DELTA_TAIL % seq
            out.append(self._delta_head + _json_str(text) + tail)  # delta_event
            self.seq = seq + 1
        if refusal:
            self._refused(refusal, out)
        if calls:
            self._calls(calls, out)
        if usage is not None:
            self.usage = usage
        if finish is not None:
            self.finish = finish

    def _calls(self, calls: Sequence[ToolCallPiece], out: list[bytes]) -> None:
        """Tool call pieces: each call a function call item (opened at its first piece,
        by its chat index), each piece's arguments a delta of that item, which stays
        open until the stream ends, whatever order the calls' pieces come in."""
        for call in calls:
            known = self.calls.get(call.index)  # (a key: reply._pieces)
            if known is None:
                item = call_item(call.call_id, call.name, "", self.shell.ids("fc"), "in_progress")
                known = self.calls[call.index] = (item, self._add(item, out))
            item, index = known
            if call.arguments:
                item["arguments"] += call.arguments
                out.append(
                    self._event(
                        {
                            "type": "response.function_call_arguments.delta",
                            "item_id": item["id"],
                            "output_index": index,
                            "delta": call.arguments,
                        }
                    )
                )

    def end(self, out: list[bytes]) -> None:
        """The events that close a complete stream (the final object kept in `final`)."""
        if not self.started:
            self.start(out)
        if not self.output:
            self._add(message_item("", self.shell.ids("msg"), "in_progress"), out)
        self._close(out)
        incomplete = INCOMPLETE.get(self.finish) if self.finish is not None else None
        status = "incomplete" if incomplete else "completed"
        self.status, self._final = status, None
        self.final_json = self.shell.encoded(  # once: the event and the store
            status, orjson.dumps(self.output), usage_of(self.usage), incomplete=incomplete
        )
        out.append(response_event(_RESPONSE_DONE[status], self.final_json, self.seq))
        self.seq += 1

    async def ended(self) -> None:
        self.closed = True
        if self.on_end is not None:
            await self.on_end(self)

    def interrupted(self, reason: str) -> None:
        """The end of a stream cut off between events (its client left): `incomplete`
        for `reason`, with the output so far, the item it was in marked `incomplete`
        with what it had; kept in `final` (no event: no one is left to read it)."""
        self._settle()
        for item, _ in self.pending:  # never done: what it had
            item["status"] = "incomplete"
        self.pending = []
        self.status, self._final = "incomplete", None
        self.final_json = self.shell.encoded(
            "incomplete", orjson.dumps(self.output), usage_of(self.usage), incomplete=reason
        )

    def error_event(self, exc: SwitchyardError) -> bytes:
        """The stream's end when it is stopped between events (a task cancel landing
        while a write is under way, api/sse.py): `error` and `response.failed` in
        this stream's sequence, as for a broken upstream."""
        out: list[bytes] = []
        self.failed(exc, out)
        return b"".join(out)

    def failed(self, exc: SwitchyardError, out: list[bytes]) -> None:
        """The events that end a broken stream: `error`, then `response.failed`."""
        if not self.started:
            self.start(out)
        self._text_so_far()
        error = response_error(exc)  # the response object's: OpenAI's codes
        self.status, self._final = "failed", None
        self.final_json = self.shell.encoded(
            "failed", orjson.dumps(self.output), usage_of(self.usage), error=error
        )
        out.append(
            self._event(
                {"type": "error", "code": exc.code, "message": exc.message, "param": exc.param}
            )
        )
        out.append(self._event({"type": "response.failed", "response": self.final}))
