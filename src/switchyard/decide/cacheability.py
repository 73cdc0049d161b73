"""Whether a request may be looked up in, or stored to, the response cache.

Pure: the request body, its Cache-Control header, the tenant and the config in; a
verdict with the reason out. A false hit serves a wrong answer at once, so anything
that makes an answer personal, side-effecting or random is not cached.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson

from switchyard.config import CacheConfig
from switchyard.decide.risk import Risk
from switchyard.request import Generation


@dataclass(frozen=True, slots=True)
class Cacheability:
    lookup: bool
    store: bool
    mode: str  # "enforce" | "shadow" | "off"
    threshold: float
    reason: str
    semantic: bool = True  # False: exact hits only (a risk class, decide/risk.py)
    risk: Risk | None = None  # the risk rule that applied, if any
    max_age: float | None = None  # Cache-Control max-age: no older entry is served


def cache_directives(value: str | None) -> dict[str, str]:
    """A request's Cache-Control directives by lower-case name, with their values
    (unquoted; "" when none): `no-cache="x"` is still no-cache."""
    out: dict[str, str] = {}
    for d in (value or "").split(","):
        name, _, arg = d.partition("=")
        name = name.strip().lower()
        if name:
            out.setdefault(name, arg.strip().strip('"'))
    return out


def max_age(directives: dict[str, str]) -> float | None:
    """The oldest entry (seconds) the client accepts, or None: any. A max-age that is
    not a number of seconds is read as 0, as RFC 9111 reads an invalid one (stale)."""
    if "max-age" not in directives:
        return None
    arg = directives["max-age"]
    return float(arg) if arg.isascii() and arg.isdigit() else 0.0


def cacheability(
    req: Generation,
    endpoint: str,
    cache_control: str | None,
    tenant: str,
    alias: str,
    cfg: CacheConfig,
) -> Cacheability:
    override = cfg.models.get(alias)
    mode = override.mode if override is not None and override.mode is not None else cfg.mode
    if tenant in cfg.shadow_tenants and mode == "enforce":
        mode = "shadow"
    threshold = (
        override.threshold
        if override is not None and override.threshold is not None
        else cfg.threshold
    )

    def no(reason: str) -> Cacheability:
        return Cacheability(False, False, mode, threshold, reason)

    if mode == "off":
        return no(f"cache off for model {alias}")
    if endpoint not in ("chat.completions", "completions"):
        return no(f"{endpoint} is not cached")
    directives = cache_directives(cache_control)
    if "no-store" in directives:
        return no("Cache-Control: no-store")
    if tenant in cfg.personalized_tenants:
        return no("tenant is flagged personalized")
    if (req.tools or req.functions) and not cfg.cache_tool_requests:
        return no("requests offering tools are not cached (side effects)")
    temperature = 1.0 if req.temperature is None else float(req.temperature)
    if temperature > cfg.max_temperature:
        return no(f"temperature {temperature} > cache.max_temperature {cfg.max_temperature}")
    if (req.n or 1) != 1:
        return no("n > 1 is not cached")
    if req.return_token_ids is True:
        # Token ids are the one part of a reply the cache's PII masking cannot reach
        # (they decode to the raw text), and a trainer wants this generation's.
        return no("requests for token ids are not cached")
    part = _non_text_part(req.messages)
    if part is not None:
        # The keys read a message's text parts alone, and the answer depends on the
        # image, file or recording beside them.
        return no(f"requests with images, files or recordings are not cached ({part[:32]})")
    if "no-cache" in directives:
        return Cacheability(False, True, mode, threshold, "Cache-Control: no-cache (store only)")
    oldest = max_age(directives)
    if oldest is not None:
        why = f"Cache-Control: max-age={oldest:g} (no older entry is served)"
        return Cacheability(True, True, mode, threshold, why, max_age=oldest)
    return Cacheability(True, True, mode, threshold, "cacheable")


def _non_text_part(messages: list[dict[str, Any]] | None) -> str | None:
    """The type of the first content part that is not text (an image, a file, a
    recording), or None."""
    for m in messages or ():
        content = m.get("content")
        if isinstance(content, list):
            for p in content:
                kind = p.get("type") if isinstance(p, dict) else None
                if kind != "text":
                    return str(kind)
    return None


def storable_reply(obj: dict[str, Any]) -> str | None:
    """Why a reply must not be stored, or None when it may be."""
    choices = obj.get("choices") or []
    if not choices:
        return "no choices"
    for c in choices:
        msg = c.get("message") or {}
        if msg.get("tool_calls") or msg.get("function_call"):
            return "the reply calls tools"
        # A hit replayed as a stream carries the answer's text alone (api/sse.py
        # `replay`, reply.py `stream_chunks`): no refusal, no log probabilities.
        if msg.get("refusal"):
            return "the reply is a refusal"
        if c.get("logprobs"):
            return "the reply carries log probabilities"
        if c.get("finish_reason") not in ("stop", "length", None):
            return f"finish_reason {c.get('finish_reason')}"
    return None


def assemble(events: list[bytes], endpoint: str = "chat.completions") -> dict[str, Any] | None:
    """Rebuild the whole reply from streamed chunks (for the cache): a chat.completion
    (with a reasoning model's `reasoning_content` or `reasoning`, as a whole reply
    carries it), or a text_completion for the `completions` endpoint; None if the
    stream carried tool calls, a refusal, log probabilities or an error event, or
    could not be read."""
    text: list[str] = []
    # A reasoning model's thinking, streamed beside the answer under either name.
    reasoning: dict[str, list[str]] = {"reasoning_content": [], "reasoning": []}
    head: dict[str, Any] = {}
    finish: str | None = None
    usage: Any = None
    for raw in events:
        try:
            obj = orjson.loads(raw)
        except orjson.JSONDecodeError:
            return None
        if type(obj) is not dict or "error" in obj:  # the engine broke the answer off
            return None
        head = head or obj
        usage = obj.get("usage") or usage
        for c in obj.get("choices") or []:
            delta = c.get("delta") or {}
            if (
                delta.get("tool_calls")
                or delta.get("function_call")
                or delta.get("refusal")
                or c.get("logprobs")
            ):
                return None  # not stored (storable_reply says why of a whole reply)
            for name, parts in reasoning.items():
                piece = delta.get(name)
                if isinstance(piece, str):
                    parts.append(piece)
            if delta.get("content"):
                text.append(delta["content"])
            elif c.get("text"):
                text.append(c["text"])
            finish = c.get("finish_reason") or finish
    if not head:
        return None
    kind = "text_completion" if endpoint == "completions" else "chat.completion"
    answer = "".join(text)
    choice: dict[str, Any] = (
        {"index": 0, "text": answer, "logprobs": None}
        if kind == "text_completion"
        else {"index": 0, "message": {"role": "assistant", "content": answer}}
    )
    if kind == "chat.completion":
        for name, parts in reasoning.items():
            if parts:
                choice["message"][name] = "".join(parts)
    choice["finish_reason"] = finish or "stop"
    return {
        "id": head.get("id"),
        "object": kind,
        "created": head.get("created"),
        "model": head.get("model"),
        "choices": [choice],
        "usage": usage,
    }
