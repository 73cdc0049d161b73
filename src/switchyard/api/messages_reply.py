"""The Anthropic Messages protocol's replies: the internal reply (a chat completion,
or its stream's chunks, after the request's reply side) turned into a `message`, or
into the Messages event stream, at the HTTP boundary.

The reply side (tool gate, cache, PII restore) has already run on the chat shape, so a
tool call the gate removed never becomes a `tool_use` block, and a cache hit stored
from a chat request is served here in the Messages shape (and the other way round):
no reply is ever stored or served in the wrong protocol's shape.

Stream events, as the Messages API sends them: `message_start`, `ping`, then per
content block `content_block_start`, `content_block_delta` (`text_delta` or
`input_json_delta`) and `content_block_stop`, then `message_delta` (stop reason,
usage) and `message_stop`; a stream that breaks ends with an `error` event instead.
"""

from __future__ import annotations

from typing import Any

import orjson

from switchyard.errors import SwitchyardError
from switchyard.reply import ChatChunk, chunk_parts, first_choice
from switchyard.usage import counts

# chat `finish_reason` -> Messages `stop_reason`
STOP_REASONS = {
    "stop": "end_turn",
    "length": "max_tokens",
    "tool_calls": "tool_use",
    "function_call": "tool_use",
    "content_filter": "refusal",
}


def stop_reason(finish: Any, refused: bool) -> str:
    """The Messages `stop_reason` of a choice's finish: `refusal` when the model refused
    (a chat `refusal`), whatever finish followed; `end_turn` for none or one unknown."""
    if refused:
        return "refusal"
    return STOP_REASONS.get(finish, "end_turn") if type(finish) is str else "end_turn"


def message_id(chat_id: Any) -> str:
    """A `msg_` id from the chat reply's id (same characters, Anthropic's prefix)."""
    raw = chat_id if isinstance(chat_id, str) else ""
    tail = raw.removeprefix("chatcmpl-")[:96]
    return "msg_" + ("".join(c for c in tail if c.isalnum() or c in "_-") or "0")


def _input(arguments: Any) -> dict[str, Any]:
    """A tool call's arguments (a JSON string) as a `tool_use` block's `input`."""
    if isinstance(arguments, str):
        try:
            value = orjson.loads(arguments or "{}")
        except orjson.JSONDecodeError:
            return {"_arguments": arguments}  # what the model wrote, not valid JSON
        if isinstance(value, dict):
            return value
        return {"_arguments": value}
    return arguments if isinstance(arguments, dict) else {}


def usage_of(usage: Any) -> dict[str, int]:
    """The Messages usage of a chat usage; zeros for counts no request could have (the
    request is billed its estimate then: settle.py)."""
    inp, out = counts(usage) or (0, 0)
    return {"input_tokens": inp, "output_tokens": out}


def to_message(chat: dict[str, Any], model: str) -> dict[str, Any]:
    """A chat completion as a Messages `message` (its choice 0: Messages has one)."""
    choice = first_choice(chat)
    msg = choice.get("message")
    msg = msg if isinstance(msg, dict) else {}
    text = msg.get("content")
    if not isinstance(text, str):
        text = choice.get("text") if isinstance(choice.get("text"), str) else ""
    refusal = msg.get("refusal")
    refused = isinstance(refusal, str) and refusal != ""
    if refused:  # the model's refusal: its words, as text, and `stop_reason: refusal`
        text = f"{text or ''}{refusal}"
    content: list[dict[str, Any]] = []
    listed = msg.get("tool_calls")
    calls: list[Any] = listed if isinstance(listed, list) else []
    if text:  # nothing to say is no block (`content: []`, as the Messages API answers):
        content.append({"type": "text", "text": text})  # an empty text block is a 400
    for call in calls:
        fn = call.get("function") if isinstance(call, dict) else None
        if isinstance(fn, dict):
            content.append(
                {
                    "type": "tool_use",
                    "id": str(call.get("id") or ""),
                    "name": str(fn.get("name") or ""),
                    "input": _input(fn.get("arguments")),
                }
            )
    finish = choice.get("finish_reason")
    return {
        "id": message_id(chat.get("id")),
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": stop_reason(finish, refused),
        "stop_sequence": None,
        "usage": usage_of(chat.get("usage")),
    }


def event(kind: str, data: dict[str, Any]) -> bytes:
    return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"


def error_event(exc: SwitchyardError) -> bytes:
    return event("error", exc.anthropic_body())


class MessageEvents:
    """Chat completion chunks in, Messages events out: one stream's state (the open
    content block, tool calls by their chat index, finish, usage). Each step appends
    its events to the caller's list (api/sse.py's Translator).

    A choice ends at its first finish: what an upstream sends after it (text, calls, a
    second finish) is not the answer, only its usage is read. Its text streams as it
    comes; its tool calls are held, by their chat index, until it finishes (or the
    stream ends), then each is one `tool_use` block whose one `input_json_delta` is
    what the whole reply's `input` is (`_input`: arguments that are no JSON object
    become `{"_arguments": ...}`): a client never reads JSON it cannot parse, calls
    whose pieces interleave are each whole, and the blocks come in the whole reply's
    order (`to_message`: the text, then the calls)."""

    def __init__(self, model: str, input_tokens: int) -> None:
        self.model = model
        self.input_tokens = input_tokens  # the estimate, until the usage chunk says
        self.started = False
        self.open: int | None = None  # the open block's index
        self.open_kind: str | None = None
        self.blocks = 0
        # chat tool call index -> (id, name, argument pieces), in the order they came
        self.calls: dict[Any, tuple[str, str, list[str]]] = {}
        self.finish: str | None = None  # the choice's first finish
        self.refused = False  # a refusal came (the model's words, as text)
        self.usage: dict[str, int] | None = None

    @property
    def stop_reason(self) -> str | None:
        """The `stop_reason` so far (None: the choice has not finished nor refused)."""
        if self.finish is None and not self.refused:
            return None
        return stop_reason(self.finish, self.refused)

    def start(self, chat_id: Any, out: list[bytes]) -> None:
        self.started = True
        message: dict[str, Any] = {
            "id": message_id(chat_id),
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": self.input_tokens, "output_tokens": 0},
        }
        out.append(event("message_start", {"type": "message_start", "message": message}))
        out.append(event("ping", {"type": "ping"}))

    def _close(self, out: list[bytes]) -> None:
        if self.open is None:
            return
        index, self.open, self.open_kind = self.open, None, None
        out.append(event("content_block_stop", {"type": "content_block_stop", "index": index}))

    def _open(self, block: dict[str, Any], out: list[bytes]) -> None:
        self._close(out)
        self.open, self.open_kind = self.blocks, block["type"]
        self.blocks += 1
        out.append(
            event(
                "content_block_start",
                {"type": "content_block_start", "index": self.open, "content_block": block},
            )
        )

    def _delta(self, index: int, delta: dict[str, Any]) -> bytes:
        return event(
            "content_block_delta", {"type": "content_block_delta", "index": index, "delta": delta}
        )

    def _text(self, text: str, out: list[bytes]) -> None:
        if self.open_kind != "text":
            self._open({"type": "text", "text": ""}, out)
        assert self.open is not None
        out.append(self._delta(self.open, {"type": "text_delta", "text": text}))

    def _tool_blocks(self, out: list[bytes]) -> None:
        """The held calls, each a whole `tool_use` block (its arguments parsed once)."""
        calls, self.calls = self.calls, {}
        for call_id, name, pieces in calls.values():
            self._open({"type": "tool_use", "id": call_id, "name": name, "input": {}}, out)
            assert self.open is not None
            args = "".join(pieces)
            if args:
                try:
                    value = orjson.loads(args)
                except orjson.JSONDecodeError:
                    value = None
                if type(value) is not dict:  # as the whole reply's `input` has it
                    args = orjson.dumps(_input(args)).decode()
                delta = {"type": "input_json_delta", "partial_json": args}
                out.append(self._delta(self.open, delta))
            self._close(out)

    def chunk(self, chunk: ChatChunk, out: list[bytes]) -> None:
        """The events of one chat completion chunk."""
        if not self.started:
            self.start(chunk.id, out)
        usage, text, calls, finish, refusal = chunk_parts(chunk)
        if usage is not None:
            self.usage = usage_of(usage)
        if self.finish is not None:  # the choice ended: nothing after it is the answer
            return
        if text:
            self._text(text, out)
        if refusal:
            self.refused = True
            self._text(refusal, out)
        for call in calls:
            held = self.calls.get(call.index)  # (a key: reply._pieces)
            if held is None:
                held = self.calls[call.index] = (call.call_id, call.name, [])
            if call.arguments:
                held[2].append(call.arguments)
        if finish is not None:
            self.finish = finish
            if self.calls:
                self._tool_blocks(out)

    def failed(self, exc: SwitchyardError, out: list[bytes]) -> None:
        """A broken stream's end: an `error` event in place of the closing ones."""
        if not self.started:
            self.start(None, out)
        out.append(error_event(exc))

    async def ended(self) -> None:
        """Nothing to do once a Messages stream ended (api/sse.py's Translator)."""

    def end(self, out: list[bytes]) -> None:
        """The events that close a complete stream."""
        if not self.started:
            self.start(None, out)
        if self.calls:  # a stream whose choice never said it finished
            self._tool_blocks(out)
        self._close(out)  # no block at all when there was nothing to say (`content: []`)
        usage = self.usage or {"input_tokens": self.input_tokens, "output_tokens": 0}
        out.append(
            event(
                "message_delta",
                {
                    "type": "message_delta",
                    "delta": {"stop_reason": self.stop_reason or "end_turn", "stop_sequence": None},
                    "usage": usage,
                },
            )
        )
        out.append(event("message_stop", {"type": "message_stop"}))
