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

    __slots__ = ("_only_marked", "_session", "_streams")

    def __init__(self, session: MaskSession, only_marked: bool = False) -> None:
        self._session = session
        self._only_marked = only_marked  # a stored reply: only one with placeholders
        # One restorer per text a stream carries, as each is its own run of deltas:
        # (choice index, MESSAGE_TEXTS name | "text" | a tool call's index).
        self._streams: dict[tuple[int, str | int], StreamRestorer] = {}

    def wants(self, body: bytes) -> bool:
        return not self._only_marked or b"<" in body

    async def whole(self, obj: dict[str, Any]) -> dict[str, Any]:
        return map_texts(obj, self._session.restore)

    def _feed(self, key: tuple[int, str | int], text: str) -> str:
        restorer = self._streams.get(key)
        if restorer is None:
            restorer = self._streams[key] = self._session.restore_stream()
        return restorer.feed(text)

    def event(self, data: bytes) -> list[bytes] | None:
        obj = reply_object(data)
        if obj is None:
            return None
        for c in obj.get("choices") or []:
            i = c.get("index") if isinstance(c.get("index"), int) else 0
            delta = c.get("delta")
            if isinstance(delta, dict):
                for name in MESSAGE_TEXTS:
                    if isinstance(delta.get(name), str):
                        delta[name] = self._feed((i, name), delta[name])
                calls = delta.get("tool_calls")
                if isinstance(calls, list):
                    for call in calls:
                        fn = call.get("function") if isinstance(call, dict) else None
                        if isinstance(fn, dict) and isinstance(fn.get("arguments"), str):
                            k = call.get("index") if isinstance(call.get("index"), int) else 0
                            fn["arguments"] = self._feed((i, k), fn["arguments"])
            if isinstance(c.get("text"), str):
                c["text"] = self._feed((i, "text"), c["text"])
        return [orjson.dumps(obj)]

    def end(self, ok: bool) -> list[bytes]:
        """What each text held back at the end (a placeholder never completed), as plain
        text in one more event of its own shape."""
        out = []
        for (i, part), restorer in self._streams.items() if ok else ():
            tail = restorer.flush()
            if not tail:
                continue
            if part == "text":
                chunk: dict[str, Any] = {
                    "object": "text_completion",
                    "choices": [{"index": i, "text": tail, "finish_reason": None}],
                }
            else:
                delta: dict[str, Any] = (
                    {part: tail}
                    if isinstance(part, str)
                    else {"tool_calls": [{"index": part, "function": {"arguments": tail}}]}
                )
                chunk = {
                    "object": "chat.completion.chunk",
                    "choices": [{"index": i, "delta": delta, "finish_reason": None}],
                }
            out.append(orjson.dumps(chunk))
        return out
