"""The scripted upstream's Anthropic side: `POST /v1/messages` in the documented wire format.

Tests of an `anthropic`-kind alias need an upstream that speaks the Messages API as the
provider does: the `message` object, the SSE event sequence (`message_start`,
`content_block_start`, `ping`, `content_block_delta` with `text_delta` or
`input_json_delta`, `content_block_stop`, `message_delta`, `message_stop`), `error`
events, error bodies `{"type": "error", "error": {"type", "message"}}`, and a request
check strict enough to catch a wrong translation (unknown fields, empty turns, a
`tool_result` that answers no `tool_use` of the turn before, a missing `max_tokens`).
These functions build and check; scripted_upstream.py serves them.
"""

from __future__ import annotations

from typing import Any

import orjson

from switchyard.errors import anthropic_type

# Top-level request fields of the Messages API (anthropic-version 2023-06-01); any other
# is refused, as the provider refuses extra inputs.
REQUEST_FIELDS = frozenset(
    {
        "model",
        "messages",
        "max_tokens",
        "system",
        "stop_sequences",
        "temperature",
        "top_p",
        "top_k",
        "metadata",
        "stream",
        "tools",
        "tool_choice",
        "thinking",
        "service_tier",
    }
)
_USER_BLOCKS = frozenset({"text", "image", "tool_result", "document"})
_ASSISTANT_BLOCKS = frozenset({"text", "tool_use", "thinking", "redacted_thinking"})

error_type = anthropic_type  # the Messages API types errors by status (errors.py)


def error_body(status: int, message: str) -> bytes:
    """An error body in the Messages API's shape."""
    err = {"type": error_type(status), "message": message}
    return orjson.dumps({"type": "error", "error": err})


def check_request(body: Any) -> str | None:
    """What is wrong with a Messages request, as the provider would say it; None if
    nothing is."""
    if not isinstance(body, dict):
        return "the request body must be a JSON object"
    extra = sorted(set(body) - REQUEST_FIELDS)
    if extra:
        return f"{extra[0]}: Extra inputs are not permitted"
    if not isinstance(body.get("model"), str) or not body["model"]:
        return "model: Field required"
    cap = body.get("max_tokens")
    if not isinstance(cap, int) or isinstance(cap, bool) or cap < 1:
        return "max_tokens: Field required (an integer of at least 1)"
    system = body.get("system")
    if not (
        system is None
        or isinstance(system, str)
        or (isinstance(system, list) and all(_text_ok(b) for b in system))
    ):
        return "system: must be a string or a list of non-empty text blocks"
    temperature = body.get("temperature")
    if temperature is not None and not (
        isinstance(temperature, int | float) and 0 <= temperature <= 1
    ):
        return "temperature: must be between 0 and 1"
    stops = body.get("stop_sequences")
    if stops is not None and not (
        isinstance(stops, list) and all(isinstance(s, str) and s for s in stops)
    ):
        return "stop_sequences: must be a list of non-empty strings"
    metadata = body.get("metadata")
    if metadata is not None and (not isinstance(metadata, dict) or set(metadata) - {"user_id"}):
        return "metadata: only user_id is allowed"
    why = _check_tools(body.get("tools"), body.get("tool_choice"))
    return why or _check_messages(body.get("messages"))


def _text_ok(block: Any) -> bool:
    return (
        isinstance(block, dict)
        and block.get("type") == "text"
        and isinstance(block.get("text"), str)
        and bool(block["text"])
    )


def _check_tools(tools: Any, choice: Any) -> str | None:
    if tools is not None:
        if not isinstance(tools, list):
            return "tools: must be a list"
        for i, t in enumerate(tools):
            if not isinstance(t, dict) or not isinstance(t.get("name"), str) or not t["name"]:
                return f"tools.{i}.name: Field required"
            schema = t.get("input_schema")
            if not isinstance(schema, dict) or schema.get("type") != "object":
                return f"tools.{i}.input_schema: must be a JSON schema of type object"
            if set(t) - {"name", "description", "input_schema", "cache_control", "type"}:
                return f"tools.{i}: Extra inputs are not permitted"
    if choice is not None:
        kind = choice.get("type") if isinstance(choice, dict) else None
        if kind not in ("auto", "any", "tool", "none"):
            return "tool_choice.type: must be auto, any, tool or none"
        if kind == "tool" and not isinstance(choice.get("name"), str):
            return "tool_choice.name: Field required"
    return None


def _check_messages(messages: Any) -> str | None:
    if not isinstance(messages, list) or not messages:
        return "messages: at least one message is required"
    last_tool_uses: set[str] = set()
    for i, m in enumerate(messages):
        role = m.get("role") if isinstance(m, dict) else None
        if role not in ("user", "assistant"):
            return f"messages.{i}.role: must be user or assistant"
        content = m.get("content")
        if isinstance(content, str):
            if not content and i != len(messages) - 1:
                return f"messages.{i}: all messages must have non-empty content"
            blocks: list[Any] = []
        elif isinstance(content, list) and content:
            blocks = content
        else:
            return f"messages.{i}.content: must be a non-empty string or list of blocks"
        allowed = _USER_BLOCKS if role == "user" else _ASSISTANT_BLOCKS
        tool_uses: set[str] = set()
        for j, b in enumerate(blocks):
            kind = b.get("type") if isinstance(b, dict) else None
            where = f"messages.{i}.content.{j}"
            if kind not in allowed:
                return f"{where}.type: {kind!r} is not allowed in a {role} message"
            if kind == "text" and not _text_ok(b):
                return f"{where}: text content blocks must be non-empty"
            if kind == "image":
                source = b.get("source")
                sk = source.get("type") if isinstance(source, dict) else None
                if sk == "base64":
                    if not (source.get("media_type") and source.get("data")):
                        return f"{where}.source: media_type and data are required"
                elif sk != "url" or not isinstance(source.get("url"), str):
                    return f"{where}.source: must be a base64 or url source"
            if kind == "tool_use":
                if not isinstance(b.get("input"), dict) or not b.get("id") or not b.get("name"):
                    return f"{where}: tool_use needs an id, a name and an object input"
                tool_uses.add(b["id"])
            if kind == "tool_result":
                if b.get("tool_use_id") not in last_tool_uses:
                    return (
                        f"{where}: unexpected tool_use_id {b.get('tool_use_id')!r} in "
                        "tool_result blocks: each must answer a tool_use of the previous message"
                    )
                if any(isinstance(x, dict) and x.get("type") != "tool_result" for x in blocks[:j]):
                    return f"{where}: tool_result blocks must come first in a user message"
        # (consecutive turns of one role are allowed: the provider joins them)
        last_tool_uses = tool_uses if role == "assistant" else set()
    return None


def last_text(messages: Any) -> str | None:
    """The text of the last user message, for the echo mode and `/stats`."""
    for m in reversed(messages if isinstance(messages, list) else []):
        if isinstance(m, dict) and m.get("role") == "user":
            content = m.get("content")
            if isinstance(content, str):
                return content
            if isinstance(content, list):
                return " ".join(
                    str(b.get("text")) for b in content if isinstance(b, dict) and "text" in b
                )
    return None


def message(
    model: str,
    pieces: list[str],
    calls: list[dict[str, Any]],
    stop_reason: str,
    usage: dict[str, int],
) -> dict[str, Any]:
    """A whole `message`: the text, then a tool_use block per call."""
    content: list[dict[str, Any]] = []
    text = "".join(pieces)
    if text:
        content.append({"type": "text", "text": text})
    for i, c in enumerate(calls):
        content.append(
            {
                "type": "tool_use",
                "id": f"toolu_{i}",
                "name": c["name"],
                "input": orjson.loads(c["arguments"] or "{}"),
            }
        )
    return {
        "id": "msg_scripted",
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": stop_reason,
        "stop_sequence": None,
        "usage": {
            "input_tokens": usage["input_tokens"],
            "output_tokens": usage["output_tokens"],
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": 0,
        },
    }


def _event(kind: str, data: dict[str, Any]) -> bytes:
    return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps({"type": kind, **data}) + b"\n\n"


def stream_events(
    model: str,
    pieces: list[str],
    calls: list[dict[str, Any]],
    stop_reason: str,
    usage: dict[str, int],
) -> list[bytes]:
    """The SSE events of the same message, as the provider streams it: the text in
    `pieces`, each tool call's input in two `input_json_delta` pieces, and a `ping`
    after the first block starts."""
    start = message(model, [], [], stop_reason, usage)
    start.update(stop_reason=None, content=[])
    start["usage"] = {**start["usage"], "output_tokens": 1}
    events = [_event("message_start", {"message": start})]
    index = 0
    if any(pieces):
        events.append(
            _event(
                "content_block_start", {"index": 0, "content_block": {"type": "text", "text": ""}}
            )
        )
        events.append(_event("ping", {}))
        for p in pieces:
            delta = {"type": "text_delta", "text": p}
            events.append(_event("content_block_delta", {"index": 0, "delta": delta}))
        events.append(_event("content_block_stop", {"index": 0}))
        index = 1
    for i, c in enumerate(calls):
        block = {"type": "tool_use", "id": f"toolu_{i}", "name": c["name"], "input": {}}
        events.append(_event("content_block_start", {"index": index, "content_block": block}))
        args = c["arguments"]
        half = len(args) // 2
        for piece in (args[:half], args[half:]):
            delta = {"type": "input_json_delta", "partial_json": piece}
            events.append(_event("content_block_delta", {"index": index, "delta": delta}))
        events.append(_event("content_block_stop", {"index": index}))
        index += 1
    events.append(
        _event(
            "message_delta",
            {
                "delta": {"stop_reason": stop_reason, "stop_sequence": None},
                "usage": {"output_tokens": usage["output_tokens"]},
            },
        )
    )
    events.append(_event("message_stop", {}))
    return events


def error_event(status: int, message: str) -> bytes:
    """An `error` event, as the provider sends one in the middle of a stream."""
    return _event("error", {"error": {"type": error_type(status), "message": message}})
