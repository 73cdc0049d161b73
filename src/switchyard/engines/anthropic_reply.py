"""Anthropic Messages reply -> chat-completions reply, for engines/anthropic.py.

Pure (no I/O, no clock: `created` is passed in): a whole `message` as a
`chat.completion` (`message_to_chat`), its usage and stop reason in chat terms, a
stream's `error` event as the error an HTTP reply of its type would give, and the
`StreamTranslator` that turns Messages SSE events into `chat.completion.chunk` data
ending with `[DONE]`, exactly as an OpenAI upstream streams.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import orjson

from switchyard.engines.upstream import _upstream_error
from switchyard.errors import SwitchyardError, UpstreamError, UpstreamStatusError
from switchyard.usage import counts

STOP_REASONS = {
    "end_turn": "stop",
    "stop_sequence": "stop",
    "pause_turn": "stop",
    "max_tokens": "length",
    "model_context_window_exceeded": "length",
    "tool_use": "tool_calls",
    "refusal": "content_filter",
}

# The HTTP status of each Messages-API error type, for an `error` event in a stream
# (which has no status of its own): mapped then like an HTTP error (_upstream_error).
ERROR_STATUS = {
    "invalid_request_error": 400,
    "authentication_error": 401,
    "billing_error": 402,
    "permission_error": 403,
    "not_found_error": 404,
    "request_too_large": 413,
    "rate_limit_error": 429,
    "api_error": 500,
    "timeout_error": 504,
    "overloaded_error": 529,
}


# -- Messages reply -> chat reply -------------------------------------------------------


def chat_usage(usage: Any) -> dict[str, Any] | None:
    """Messages usage as chat usage: the prompt counts every input token, those read
    from and written to the provider's prompt cache included (they are billed).

    None when the counts are no usage: not an object, no `output_tokens` (the Messages
    API always reports it: without it nothing says what was written), or a count that
    `usage.counts` refuses (not an integer from 0 up, a bool). The reply then carries no
    usage and settling bills the estimate, exactly as for an OpenAI upstream's reply
    without usable usage; a missing or null cache count is 0."""
    if not isinstance(usage, dict) or usage.get("output_tokens") is None:
        return None
    main = counts({"prompt_tokens": usage.get("input_tokens"),
                   "completion_tokens": usage.get("output_tokens")})  # fmt: skip
    cache = counts({"prompt_tokens": usage.get("cache_read_input_tokens"),
                    "completion_tokens": usage.get("cache_creation_input_tokens")})  # fmt: skip
    if main is None or cache is None:
        return None
    (inp, completion), (cached, written) = main, cache
    prompt = inp + cached + written
    out: dict[str, Any] = {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }
    if counts(out) is None:  # the sum is past any request
        return None
    if cached:
        out["prompt_tokens_details"] = {"cached_tokens": cached}
    return out


def finish_reason(stop_reason: Any) -> str:
    return STOP_REASONS.get(stop_reason, "stop") if isinstance(stop_reason, str) else "stop"


def _arguments(value: Any, who: str = "the upstream") -> str:
    """A `tool_use` block's `input` as the call's arguments: an object (none is `{}`);
    anything else is no Messages-API tool call."""
    if value is None:
        value = {}
    if not isinstance(value, dict):
        raise UpstreamError(f"{who} sent a tool call whose input is not an object")
    return orjson.dumps(value).decode()


def message_to_chat(msg: Any, model: str, created: int) -> dict[str, Any]:
    """A Messages `message` as a `chat.completion`: text blocks joined as the content,
    `tool_use` blocks as tool calls (thinking and server-tool blocks have no place in
    a chat completion). `model` stands in when the reply names none."""
    if not isinstance(msg, dict) or not isinstance(msg.get("content"), list):
        raise UpstreamError("the upstream's reply is not a Messages-API message")
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    for block in msg["content"]:
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            texts.append(str(block.get("text", "")))
        elif kind == "tool_use":
            fn = {"name": block.get("name"), "arguments": _arguments(block.get("input"))}
            calls.append({"id": block.get("id"), "type": "function", "function": fn})
    message: dict[str, Any] = {
        "role": "assistant",
        "content": "".join(texts) if texts or not calls else None,
    }
    if calls:
        message["tool_calls"] = calls
    chat: dict[str, Any] = {
        "id": msg.get("id"),
        "object": "chat.completion",
        "created": created,
        "model": msg.get("model") or model,
        "choices": [
            {
                "index": 0,
                "message": message,
                "logprobs": None,
                "finish_reason": finish_reason(msg.get("stop_reason")),
            }
        ],
    }
    usage = chat_usage(msg.get("usage"))
    if usage is not None:  # else none: settling bills the estimate
        chat["usage"] = usage
    return chat


def error_event(data: Mapping[str, Any], name: str) -> SwitchyardError:
    """A stream's `error` event as the error an HTTP reply of its type would give,
    with the gateway's own words: the event comes after the request was accepted, so
    its text (kept as the error's `detail`, for the log and the trace) says nothing
    about the client's request, and no upstream text reaches the client."""
    err = data.get("error")
    kind = err.get("type") if isinstance(err, dict) else None
    status = ERROR_STATUS.get(kind, 500) if isinstance(kind, str) else 500
    mapped = _upstream_error(status, orjson.dumps(data), name)
    if isinstance(mapped, UpstreamStatusError):  # the one mapping that relays the text
        known = f" ({kind})" if kind in ERROR_STATUS else ""
        own = f"upstream {name} ended its stream with an error{known}"
        return UpstreamStatusError(mapped.status, own, detail=mapped.detail)
    return mapped


# -- Messages stream -> chat chunks -----------------------------------------------------

# The events whose place in a stream is fixed: `message_start` first and once, content
# blocks before `message_delta`. `ping`, `error` and event types added later may come
# anywhere.
ORDERED = frozenset(
    {
        "message_start",
        "content_block_start",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    }
)


class StreamTranslator:
    """Messages SSE events in, chat.completion.chunk data out, exactly as an OpenAI
    upstream streams: a role delta first, text as `delta.content`, each tool call as
    its id and name with empty arguments and then the arguments in pieces, a chunk
    with the finish reason, the usage chunk when asked, and `[DONE]`."""

    def __init__(self, model: str, created: int, include_usage: bool, name: str = "") -> None:
        self.model = model
        self.created = created
        self.include_usage = include_usage
        self.name = name  # the upstream's, for errors
        self.id = "msg"
        self.started = False  # message_start came: the role chunk went out
        self.usage: dict[str, Any] = {}
        self.stop_reason: Any = None
        self.finished = False  # the finish chunk went out
        self.done = False  # message_stop: [DONE] went out
        self._tools: dict[int, int] = {}  # content block index -> tool call index
        self._args: set[int] = set()  # tool blocks that sent a piece of arguments

    def _chunk(self, delta: dict[str, Any], finish: str | None = None) -> bytes:
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        return orjson.dumps(
            {
                "id": self.id,
                "object": "chat.completion.chunk",
                "created": self.created,
                "model": self.model,
                "choices": [choice],
            }
        )

    def _tool_delta(self, block: int, call: dict[str, Any]) -> bytes:
        return self._chunk({"tool_calls": [{"index": self._tools[block], **call}]})

    def feed(self, event_type: str, data: Mapping[str, Any]) -> list[bytes]:
        """The chunk data one event gives (often none). Raises the mapped
        SwitchyardError on an `error` event, and an UpstreamError on an event out of
        order (anything before `message_start`, a second one, a content block after
        `message_delta`): the stream is broken, never a success, and no chunk goes out
        that no OpenAI upstream could send (content after the finish chunk, chunks
        under another id)."""
        if self.done:
            return []
        starts = event_type == "message_start"
        if event_type in ORDERED and (
            (self.started if starts else not self.started)
            or (self.finished and event_type.startswith("content_block"))
        ):
            raise UpstreamError(
                f"upstream {self.name} sent the Messages-API event {event_type} out of order"
            )
        if event_type == "message_start":
            self.started = True
            msg = data.get("message")
            msg = msg if isinstance(msg, dict) else {}
            if isinstance(msg.get("id"), str):
                self.id = msg["id"]
            if isinstance(msg.get("model"), str) and msg["model"]:
                self.model = msg["model"]
            if isinstance(msg.get("usage"), dict):
                self.usage.update(msg["usage"])
            return [self._chunk({"role": "assistant", "content": ""})]
        index = data.get("index")
        if event_type == "content_block_start" and isinstance(index, int):
            block = data.get("content_block")
            kind = block.get("type") if isinstance(block, dict) else None
            if kind == "text" and block and block.get("text"):
                return [self._chunk({"content": block["text"]})]
            if kind == "tool_use" and block:
                self._tools[index] = len(self._tools)
                head = {
                    "id": block.get("id"),
                    "type": "function",
                    "function": {"name": block.get("name"), "arguments": ""},
                }
                whole = _arguments(block.get("input"), f"upstream {self.name}")
                out = [self._tool_delta(index, head)]
                if whole != "{}":  # a provider that sends the input whole
                    self._args.add(index)
                    out.append(self._tool_delta(index, {"function": {"arguments": whole}}))
                return out
            return []
        if event_type == "content_block_delta" and isinstance(index, int):
            delta = data.get("delta")
            kind = delta.get("type") if isinstance(delta, dict) else None
            if kind == "text_delta" and delta and delta.get("text"):
                return [self._chunk({"content": delta["text"]})]
            if kind == "input_json_delta" and delta and index in self._tools:
                piece = delta.get("partial_json")
                if isinstance(piece, str) and piece:
                    self._args.add(index)
                    return [self._tool_delta(index, {"function": {"arguments": piece}})]
            return []  # thinking, signatures, citations: not part of a chat completion
        if event_type == "content_block_stop" and isinstance(index, int):
            if index in self._tools and index not in self._args:
                self._args.add(index)  # a call without input: its arguments are {}
                return [self._tool_delta(index, {"function": {"arguments": "{}"}})]
            return []
        if event_type == "message_delta":
            delta = data.get("delta")
            if isinstance(delta, dict) and delta.get("stop_reason") is not None:
                self.stop_reason = delta["stop_reason"]
            if isinstance(data.get("usage"), dict):  # cumulative counts
                self.usage.update({k: v for k, v in data["usage"].items() if v is not None})
            return self._finish()
        if event_type == "message_stop":
            out = self._finish()
            counted = chat_usage(self.usage)
            if self.include_usage and counted is not None:  # else none, as for OpenAI
                usage = {
                    "id": self.id,
                    "object": "chat.completion.chunk",
                    "created": self.created,
                    "model": self.model,
                    "choices": [],
                    "usage": counted,
                }
                out.append(orjson.dumps(usage))
            self.done = True
            out.append(b"[DONE]")
            return out
        if event_type == "error":
            raise error_event(data, self.name)
        return []  # ping, and event types added later (the API may add them)

    def _finish(self) -> list[bytes]:
        if self.finished:
            return []
        self.finished = True
        return [self._chunk({}, finish_reason(self.stop_reason))]

    def feed_data(self, raw: bytes) -> list[bytes]:
        """One SSE event's data (its `type` names the event, as the event line does)."""
        try:
            data = orjson.loads(raw)
        except orjson.JSONDecodeError:
            data = None
        if not isinstance(data, dict) or not isinstance(data.get("type"), str):
            raise UpstreamError(
                f"upstream {self.name} sent a stream event that is not a Messages-API event"
            )
        return self.feed(data["type"], data)
