"""PII on the way out: the reply part that restores a request's own values, and the
masking of a reply for storage.

The PII stage (policy/stages.Pii) masks a request on its way in; on the way out its
`PiiRestore` part puts the raw values back wherever the reply carries placeholders —
a whole JSON reply, each streamed event, a cache hit, an idempotent replay — and is
the only place that does. Replies kept at rest (the cache, the idempotency store)
go through `at_rest` first, so no raw value is ever stored.
"""

from __future__ import annotations

import bisect
import itertools
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


# Where a run of tokens' joined text holds values to mask: (start, end, placeholder).
Spans = Callable[[str], list[tuple[int, int, str]]]


def map_texts(
    obj: dict[str, Any], fn: Callable[[str], str], spans: Spans | None = None
) -> dict[str, Any]:
    """A copy of a completion with `fn` applied to every generated text (a message's
    MESSAGE_TEXTS, tool-call arguments, a completion's text, each token of its
    logprobs). `spans` (masking): a value split across tokens becomes one token, the
    placeholder (see `_tokens`)."""
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
        if isinstance(c.get("logprobs"), dict):
            c["logprobs"] = _map_logprobs(c["logprobs"], fn, spans)
        choices.append(c)
    out["choices"] = choices
    return out


def _map_call(call: Any, fn: Callable[[str], str]) -> Any:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("arguments"), str):
        return call
    return {**call, "function": {**function, "arguments": fn(function["arguments"])}}


def _map_logprobs(lp: dict[str, Any], fn: Callable[[str], str], spans: Spans | None) -> Any:
    """A choice's logprobs with `fn` applied to every token: chat's (`content` and
    `refusal`: lists of entries with `token`, `bytes` and `top_logprobs`) and a
    completion's (`tokens`, `token_logprobs`, `top_logprobs`, `text_offset`)."""
    out = dict(lp)
    for name in ("content", "refusal"):
        entries = lp.get(name)
        if isinstance(entries, list) and all(
            isinstance(e, dict) and isinstance(e.get("token"), str) for e in entries
        ):
            out[name] = _chat_entries(entries, fn, spans)
    tokens = lp.get("tokens")
    if isinstance(tokens, list) and all(isinstance(t, str) for t in tokens):
        out.update(_completion_tokens(lp, tokens, fn, spans))
    return out


def _runs(tokens: list[str], spans: Spans | None) -> list[tuple[int, int, str]]:
    """(first, end, text) of each run of tokens that a value to mask overlaps, with the
    run's text masked: one token then stands for the whole run, so no token holds a
    piece of a value (`spans` None, or nothing found: no runs)."""
    if spans is None:
        return []
    text = "".join(tokens)
    found = spans(text)
    if not found:
        return []
    starts = list(itertools.accumulate((len(t) for t in tokens[:-1]), initial=0))
    runs: list[tuple[int, int, list[tuple[int, int, str]]]] = []
    for s, e, placeholder in found:
        first = max(bisect.bisect_right(starts, s) - 1, 0)
        end = max(bisect.bisect_left(starts, e), first + 1)  # tokens [first, end) hold it
        if runs and first < runs[-1][1]:  # it shares a token with the run before
            before = runs.pop()
            first, end = before[0], max(end, before[1])
            runs.append((first, end, [*before[2], (s, e, placeholder)]))
        else:
            runs.append((first, end, [(s, e, placeholder)]))
    out = []
    for first, end, inside in runs:
        pos = starts[first]
        pieces: list[str] = []
        for s, e, placeholder in inside:
            pieces += (text[pos:s], placeholder)
            pos = e
        pieces.append(text[pos : starts[end] if end < len(tokens) else len(text)])
        out.append((first, end, "".join(pieces)))
    return out


def _total(lps: list[Any]) -> float | None:
    """The logprob of a run of tokens: the sum of theirs (None unless all are numbers)."""
    return sum(lps) if all(type(x) in (int, float) for x in lps) else None


def _chat_entries(
    entries: list[dict[str, Any]], fn: Callable[[str], str], spans: Spans | None
) -> list[dict[str, Any]]:
    runs = {first: (end, text) for first, end, text in _runs([e["token"] for e in entries], spans)}
    out: list[dict[str, Any]] = []
    i = 0
    while i < len(entries):
        if i in runs:
            end, text = runs[i]
            total = _total([e.get("logprob") for e in entries[i:end]])
            out.append({"token": text, "logprob": total, "bytes": None, "top_logprobs": []})
            i = end
            continue
        out.append(_entry(entries[i], fn))
        if isinstance(entries[i].get("top_logprobs"), list):
            out[-1]["top_logprobs"] = [_entry(t, fn) for t in entries[i]["top_logprobs"]]
        i += 1
    return out


def _entry(entry: Any, fn: Callable[[str], str]) -> Any:
    """A logprobs entry with `fn` applied to its token (its bytes dropped if that
    changed it: they would say the old token)."""
    if not isinstance(entry, dict) or not isinstance(entry.get("token"), str):
        return entry
    token = fn(entry["token"])
    if token == entry["token"]:
        return dict(entry)
    return {**entry, "token": token, "bytes": None}


def _completion_tokens(
    lp: dict[str, Any], tokens: list[str], fn: Callable[[str], str], spans: Spans | None
) -> dict[str, Any]:
    runs = {first: (end, text) for first, end, text in _runs(tokens, spans)}
    lps, tops, offsets = lp.get("token_logprobs"), lp.get("top_logprobs"), lp.get("text_offset")

    def at(xs: Any, i: int) -> Any:
        return xs[i] if isinstance(xs, list) and i < len(xs) else None

    out_t: list[str] = []
    out_lp: list[Any] = []
    out_top: list[Any] = []
    out_off: list[Any] = []
    i = 0
    while i < len(tokens):
        if i in runs:
            end, text = runs[i]
            out_t.append(text)
            out_lp.append(_total([at(lps, k) for k in range(i, end)]))
            out_top.append(None)
            out_off.append(at(offsets, i))
            i = end
            continue
        out_t.append(fn(tokens[i]))
        out_lp.append(at(lps, i))
        top = at(tops, i)
        out_top.append({fn(k): v for k, v in top.items()} if isinstance(top, dict) else top)
        out_off.append(at(offsets, i))
        i += 1
    masked: dict[str, Any] = {"tokens": out_t}
    if isinstance(lps, list):
        masked["token_logprobs"] = out_lp
    if isinstance(tops, list):
        masked["top_logprobs"] = out_top
    if isinstance(offsets, list):
        masked["text_offset"] = out_off
    return masked


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
    """A reply as it may be stored: every generated text masked (a value split across
    logprobs tokens: one token, its placeholder)."""
    return map_texts(obj, session.mask, session.spans) if session is not None else obj


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
