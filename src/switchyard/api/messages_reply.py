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
from switchyard.reply import ChatChunk, chunk_parts
from switchyard.usage import counts

# chat `finish_reason` -> Messages `stop_reason`
STOP_REASONS = {
    "stop": "end_turn",
    "length": "max_tokens",
    "tool_calls": "tool_use",
    "function_call": "tool_use",
    "content_filter": "refusal",
}


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
    """A chat completion as a Messages `message` (the first choice: Messages has one)."""
    choices = chat.get("choices")
    choice = choices[0] if isinstance(choices, list) and choices else {}
    msg = choice.get("message") if isinstance(choice, dict) else None
    msg = msg if isinstance(msg, dict) else {}
    text = msg.get("content")
    if not isinstance(text, str):
        text = choice.get("text") if isinstance(choice.get("text"), str) else ""
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
    finish = choice.get("finish_reason") if isinstance(choice, dict) else None
    return {
        "id": message_id(chat.get("id")),
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": STOP_REASONS.get(finish, "end_turn") if finish else "end_turn",
        "stop_sequence": None,
        "usage": usage_of(chat.get("usage")),
    }


def event(kind: str, data: dict[str, Any]) -> bytes:
    return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"


def error_event(exc: SwitchyardError) -> bytes:
    return event("error", exc.anthropic_body())


class MessageEvents:
    """Chat completion chunks in, Messages events out: one stream's state (the open
    content block, tool calls by their chat index, stop reason, usage). Each step
    appends its events to the caller's list (api/sse.py's Translator)."""

    def __init__(self, model: str, input_tokens: int) -> None:
        self.model = model
        self.input_tokens = input_tokens  # the estimate, until the usage chunk says
        self.started = False
        self.open: int | None = None  # the open block's index
        self.open_kind: str | None = None
        self.blocks = 0
        self.calls: dict[int, int] = {}  # chat tool call index -> block index
        self.stop_reason: str | None = None
        self.usage: dict[str, int] | None = None

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

    def chunk(self, chunk: ChatChunk, out: list[bytes]) -> None:
        """The events of one chat completion chunk."""
        if not self.started:
            self.start(chunk.id, out)
        usage, text, calls, finish = chunk_parts(chunk)
        if usage is not None:
            self.usage = usage_of(usage)
        if text:
            if self.open_kind != "text":
                self._open({"type": "text", "text": ""}, out)
            assert self.open is not None
            out.append(self._delta(self.open, {"type": "text_delta", "text": text}))
        for call in calls:
            if call.index not in self.calls:
                block = {"type": "tool_use", "id": call.call_id, "name": call.name, "input": {}}
                self._open(block, out)
                self.calls[call.index] = self.blocks - 1
            if call.arguments:
                delta = {"type": "input_json_delta", "partial_json": call.arguments}
                out.append(self._delta(self.calls[call.index], delta))
        if finish is not None:
            self.stop_reason = STOP_REASONS.get(finish, "end_turn")

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
