"""PII on the way out: the reply part that restores a request's own values, and the
masking of a reply for storage.

The PII stage (policy/stages.Pii) masks a request on its way in; on the way out its
`PiiRestore` part puts the raw values back wherever the reply carries placeholders —
a whole JSON reply, each streamed event, a cache hit, an idempotent replay — and is
the only place that does. Replies kept at rest (the cache, the idempotency store)
go through `at_rest` first, so no raw value is ever stored.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import orjson

from switchyard.pipeline import ReplyPart, RequestContext
from switchyard.policy.pii import MaskSession, PiiMasker, StreamRestorer, mask_request
from switchyard.reply import reply_object
from switchyard.request import Generation

# The texts a model writes into a chat message besides its tool calls: the answer, the
# reasoning engines return beside it (vLLM, llama.cpp: `reasoning_content`; newer
# vLLM: `reasoning`) and a refusal.
MESSAGE_TEXTS = ("content", "reasoning_content", "reasoning", "refusal")


def map_texts(obj: dict[str, Any], fn: Callable[[str], str]) -> dict[str, Any]:
    """A copy of a completion with `fn` applied to every generated text (a message's
    MESSAGE_TEXTS, tool-call arguments, a completion's text)."""
    out = dict(obj)
    choices = []
    for c in obj.get("choices") or []:
        c = dict(c)
        message = c.get("message")
        if isinstance(message, dict):
            message = dict(message)
            for name in MESSAGE_TEXTS:
                if isinstance(message.get(name), str):
                    message[name] = fn(message[name])
            if isinstance(message.get("tool_calls"), list):
                message["tool_calls"] = [_map_call(call, fn) for call in message["tool_calls"]]
            c["message"] = message
        if isinstance(c.get("text"), str):
            c["text"] = fn(c["text"])
        choices.append(c)
    out["choices"] = choices
    return out


def _map_call(call: Any, fn: Callable[[str], str]) -> Any:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("arguments"), str):
        return call
    return {**call, "function": {**function, "arguments": fn(function["arguments"])}}


def request_session(masker: PiiMasker, ctx: RequestContext) -> MaskSession:
    """The request's PII session: the PII stage's, or one that has masked the
    request's own texts (same body, same placeholders: what a replay restores with)."""
    if ctx.pii is not None:
        return ctx.pii.session
    session = masker.session()
    sent = ctx.wire[0] if ctx.wire is not None else ctx.request
    assert isinstance(sent, Generation)
    mask_request(session, sent)
    return session


def at_rest(session: MaskSession | None, obj: dict[str, Any]) -> dict[str, Any]:
    """A reply as it may be stored: every generated text masked."""
    return map_texts(obj, session.mask) if session is not None else obj


class PiiRestore(ReplyPart):
    """The PII stage's reply part: placeholders in generated text become this
    request's raw values again. A placeholder split across streamed events is held
    back until it is complete; one that never completes goes out as plain text at
    the end."""

    __slots__ = ("_only_marked", "_session", "_stream")

    def __init__(self, session: MaskSession, only_marked: bool = False) -> None:
        self._session = session
        self._only_marked = only_marked  # a stored reply: only one with placeholders
        self._stream: StreamRestorer | None = None

    def wants(self, body: bytes) -> bool:
        return not self._only_marked or b"<" in body

    async def whole(self, obj: dict[str, Any]) -> dict[str, Any]:
        return map_texts(obj, self._session.restore)

    def event(self, data: bytes) -> list[bytes] | None:
        restorer = self._stream
        if restorer is None:
            restorer = self._stream = self._session.restore_stream()
        obj = reply_object(data)
        if obj is None:
            return None
        for c in obj.get("choices") or []:
            delta = c.get("delta") or {}
            if isinstance(delta.get("content"), str):
                delta["content"] = restorer.feed(delta["content"])
            elif isinstance(c.get("text"), str):
                c["text"] = restorer.feed(c["text"])
        return [orjson.dumps(obj)]

    def end(self, ok: bool) -> list[bytes]:
        tail = self._stream.flush() if self._stream is not None and ok else ""
        if not tail:
            return []
        chunk = {
            "object": "chat.completion.chunk",
            "choices": [{"index": 0, "delta": {"content": tail}, "finish_reason": None}],
        }
        return [orjson.dumps(chunk)]
