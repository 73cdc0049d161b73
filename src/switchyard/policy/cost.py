"""What a request may cost: one rule for chat, completions, embeddings and rollouts.

A reservation is the request's prompt, counted high from everything the engine will
see, plus its output at the cap, times every sequence it asks for (`n`/`best_of`
choices of every prompt). The cap is always sent upstream: the client's, or the one
the gateway reserved, so the engine can never write past what was reserved. When what
a scope has left is below that cap, the cap shrinks to what fits (`Cost.fit`) rather
than the request being refused; a refusal comes only when not even a minimal answer
fits.

Pure functions over the request body and settings; the stages in policy/stages.py
apply them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import orjson

from switchyard.config import LlamaCppEngine, ModelConfig, Price, VllmEngine
from switchyard.request import Generation, to_json

# Content parts that are images: counted at `policy.image_tokens` each, not by bytes.
IMAGE_PARTS = frozenset({"image_url", "input_image", "image"})
FRAMING = 8  # tokens a reservation adds per request for its framing


@dataclass(slots=True)
class Cost:
    """One generation request's shape, as the reservations and the wire see it."""

    base: int  # the body's own high estimate of its prompt tokens (no learned overhead)
    prompt: int  # base plus the model's learned template overhead: what is reserved
    lower: int  # a lower bound of the prompt's tokens: what the window check uses
    sequences: int  # choices x prompts: how many times the cap can be generated
    cap: int  # output tokens per sequence: reserved, and sent upstream
    asked: int | None  # the cap the client sent (the larger, when it sent both names)
    window: int | None  # the model's effective context window
    reason: str | None = None  # why the sent cap is the gateway's: default|window|budget|...
    # The alias the prompt was estimated for (its learned overhead): the one the client
    # named, which a router may change to a route's model after the reservation.
    alias: str = ""

    @property
    def output(self) -> int:
        return self.cap * self.sequences

    @property
    def tokens(self) -> int:
        return self.prompt + self.output

    def usd(self, price: Price | None) -> float:
        if price is None:
            return 0.0
        return (self.prompt * price.input + self.output * price.output) / 1_000_000

    def fit(self, tokens_left: float | None, usd_left: float | None, price: Price | None) -> int:
        """The largest cap per sequence whose reservation fits what is left (each None
        = unlimited); may be 0 or less when not even the prompt fits."""
        cap = self.cap
        if tokens_left is not None:
            cap = min(cap, int((tokens_left - self.prompt) // self.sequences))
        if usd_left is not None and price is not None:
            room = usd_left * 1_000_000 - self.prompt * price.input
            if price.output > 0:
                cap = min(cap, int(room // (price.output * self.sequences)))
            elif room < 0:
                cap = 0
        return cap

    def shrink(self, cap: int, reason: str) -> None:
        if cap < self.cap:
            self.cap = cap
            self.reason = reason

    @property
    def sends_cap(self) -> bool:
        """The gateway's cap differs from what the client asked for: it goes on the wire."""
        return self.asked is None or self.cap < self.asked


def effective_window(model: ModelConfig) -> int:
    """min(capabilities.context_window, the engines' real limits): llama-server's
    context per slot, vLLM's max_model_len, over the alias's deployments."""
    window = model.capabilities.context_window
    engines = [model.engine, *(d.engine for d in model.deployments)]
    for e in engines:
        if isinstance(e, LlamaCppEngine):
            window = min(window, e.ctx)
        elif isinstance(e, VllmEngine):
            window = min(window, e.max_model_len)
    return window


def choice_limit(model: ModelConfig, models: Mapping[str, ModelConfig]) -> int | None:
    """The most choices (`n`) a request for `model` can be served with, when
    llama-server (its `server` runtime) serves the model and each of its fallbacks:
    llama-server makes at most one choice a slot and refuses an `n` past its
    `parallel`, so the bound is the most slots any of those engines has. None when
    some engine of the chain takes any `n` (vLLM queues what does not fit, another
    upstream answers for itself)."""
    most = 0
    for m in (model, *(models.get(a) for a in model.fallbacks)):
        if m is None:
            continue
        for e in (m.engine, *(d.engine for d in m.deployments)):
            if not isinstance(e, LlamaCppEngine) or e.runtime != "server":
                return None
            most = max(most, e.parallel)
    return most or None


def window_mismatches(model: ModelConfig) -> list[str]:
    """Where capabilities.context_window differs from an engine's real limit (for
    check-config): the smaller applies."""
    out = []
    declared = model.capabilities.context_window
    engines = [model.engine, *(d.engine for d in model.deployments)]
    for e in engines:
        real = (
            e.ctx
            if isinstance(e, LlamaCppEngine)
            else e.max_model_len
            if isinstance(e, VllmEngine)
            else None
        )
        if real is not None and real != declared:
            what = "ctx" if isinstance(e, LlamaCppEngine) else "max_model_len"
            out.append(
                f"models[{model.alias}]: capabilities.context_window is {declared} but its "
                f"engine's {what} is {real}; requests are checked against {min(real, declared)}"
            )
    return out


def sequences(req: Generation) -> int:
    """How many outputs the request can make: max(n, best_of) choices of each prompt."""
    n, best_of = req.n or 1, req.best_of or 1
    choices = best_of if best_of > n else n  # max(), without its argument parsing
    prompt = req.prompt
    prompts = 1
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        prompts = len(prompt)  # a list of strings or of token arrays
    return choices * prompts


def _text_chars(content: Any) -> tuple[int, int, int]:
    """(characters of text, characters of image payloads, images) of a content value."""
    if isinstance(content, str):
        return len(content), 0, 0
    text = payload = images = 0
    if isinstance(content, list):
        for part in content:
            if not isinstance(part, dict):
                continue
            if part.get("type") in IMAGE_PARTS:
                images += 1
                payload += len(orjson.dumps(part))
            else:
                t = part.get("text")
                if isinstance(t, str):
                    text += len(t)
    return text, payload, images


def prompt_tokens(req: Generation, raw_len: int | None, image_tokens: int) -> tuple[int, int]:
    """(high estimate, lower bound) of the prompt tokens of a chat or completion body.

    High: every byte the engine is sent counts (messages with their names, tool calls
    and arguments, `tools`/`functions` and `response_format` schemas, fields it may
    not know), at ~3 bytes a token, except image payloads, counted at `image_tokens`
    each. `raw_len` is the length of the body as the client sent it (else it is
    serialized). Low: the characters of the message texts and prompts at 4 a token
    (token arrays count exactly), for the context-window check only."""
    total = raw_len if raw_len is not None else len(to_json(req))
    lower = payload = images = 0
    messages = req.messages
    if messages is not None:
        for m in messages:
            if isinstance(m, dict):
                t, p, i = _text_chars(m.get("content"))
                lower += t
                payload += p
                images += i
        lower //= 4
    else:
        prompt = req.prompt
        if isinstance(prompt, str):
            lower = len(prompt) // 4
        elif isinstance(prompt, list):
            for p in prompt:
                if isinstance(p, str):
                    lower += len(p) // 4
                elif isinstance(p, int):
                    lower += 1
                elif isinstance(p, list):
                    lower += len(p)
    sent = total - payload
    high = (sent if sent > 0 else 0) // 3 + images * image_tokens + FRAMING
    return (lower if lower > high else high), lower


class PromptOverhead:
    """Tokens a model's prompts carry beyond their own estimate (its chat template, a
    default system prompt), learned per model from the prompt counts upstreams report:
    a floor (the template's fixed part, at most `floor_cap` tokens) plus a ratio of the
    estimate (a tokenizer that needs more tokens than ~3 bytes each, at most
    `ratio_cap`). Before a model's first reply with usage, `floor` tokens and no ratio
    apply; the first reply's excess replaces that floor, and from then on both only
    grow, and both are bounded, so an odd count cannot make every estimate absurd."""

    def __init__(self, floor: int = 64, floor_cap: int = 1024, ratio_cap: float = 2.0) -> None:
        self.floor0 = floor
        self.floor_cap = floor_cap
        self.ratio_cap = ratio_cap
        self.learned: dict[str, tuple[int, float]] = {}  # alias -> (floor, ratio)

    def get(self, alias: str, base: int) -> int:
        floor, ratio = self.learned.get(alias, (self.floor0, 0.0))
        return floor + int(ratio * base + 0.999)

    def merge(self, alias: str, floor: int, ratio: float) -> None:
        """Take what another process learned for `alias` (state/overhead_redis.py):
        each part only grows, within its cap."""
        floor = max(0, min(int(floor), self.floor_cap))
        ratio = max(0.0, min(float(ratio), self.ratio_cap))
        mine = self.learned.get(alias)
        if mine is not None:
            floor, ratio = max(floor, mine[0]), max(ratio, mine[1])
        self.learned[alias] = (floor, ratio)

    def observe(self, alias: str, base: int, reported: int) -> None:
        excess = reported - base
        if alias not in self.learned:  # the first count replaces the assumed floor
            self.learned[alias] = (max(0, min(excess, self.floor_cap)), 0.0)
        floor, ratio = self.learned[alias]
        if excess <= floor + ratio * base:
            return
        if excess > floor:
            floor = min(excess, self.floor_cap)
        if excess > floor + ratio * base and base > 0:
            ratio = min(self.ratio_cap, (excess - floor) / base)
        self.learned[alias] = (floor, ratio)


def plan(
    req: Generation,
    raw_len: int | None,
    alias: str,
    window: int | None,
    default_cap: int,
    image_tokens: int,
    overhead: PromptOverhead,
) -> Cost:
    """The request's cost shape: its prompt, its sequences and its cap. The cap is the
    client's, or `default_cap`; either is bounded by what the window leaves after the
    prompt's lower bound."""
    base, lower = prompt_tokens(req, raw_len, image_tokens)
    asked = req.output_cap
    cap = asked if asked is not None else default_cap
    reason = None if asked is not None else "default"
    if window is not None and cap > window - lower:
        cap = max(1, window - lower)
        reason = "window"
    return Cost(
        base,
        base + overhead.get(alias, base),
        lower,
        sequences(req),
        cap,
        asked,
        window,
        reason,
        alias,
    )
