"""`return_token_ids` on chat and completions: the token ids a reply was made of.

The reply shape is vLLM's (`return_token_ids`, vLLM >= 0.10.2), so a trainer written
against vLLM reads ours unchanged: chat puts `prompt_token_ids` on the reply and
`token_ids` on each choice; completions put both on each choice.

- vLLM engines take the option natively: it passes through.
- llama-server's OpenAI routes drop token ids, and their per-token logprobs lose the
  entry of a token that ends inside a UTF-8 character (so ids read from logprobs
  would silently miss tokens). Its `verbose` + `return_tokens` options add the full
  native result (`__verbose`) to a non-streamed reply: every generated id, and the
  prompt string the chat template produced. The gateway asks for those, moves the ids
  into the vLLM shape, tokenizes the prompt string on the same server (what the
  server itself does with it) and drops `__verbose`. Only the first choice is
  covered there, and streamed chunks carry no ids: n > 1 and streaming are refused.
- The python worker runtime and external upstreams do not offer it (an external
  upstream known to be vLLM says so with `capabilities.supports_token_ids`).
- A managed engine that another process of the gateway owns (a worker of
  `serve --workers N`, a Ray gateway replica) is an OpenAI upstream at the engine front
  (engines/front.py `remote_engines`), a `FrontedEngine` that keeps the engine's own
  spec: token ids are given as that engine gives them, the front forwarding
  llama-server's `/tokenize` beside the OpenAI routes.

Prompt ids are given only when they are exactly what the engine read: their count
must equal the reply's `usage.prompt_tokens`, else `prompt_token_ids` is null.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

import orjson

from switchyard.config import Engine, LlamaCppEngine, ModelConfig, OpenAIEngine, VllmEngine
from switchyard.engines.upstream import OpenAIUpstream

if TYPE_CHECKING:
    from switchyard.engines.registry import Deployment

Support = Literal["native", "llamacpp"]


class FrontedEngine(OpenAIEngine):
    """A managed engine as a process that does not own it reaches it: an OpenAI
    upstream at the engine front (engines/front.py `remote_engines`). `managed` is the
    engine's own spec, so what the engine gives beyond the OpenAI API (token ids) is
    still known where only its upstream is seen. Built in code, never read from a
    config file; defined here, beside the one rule that reads it."""

    managed: LlamaCppEngine | VllmEngine


def support(model: ModelConfig) -> Support | None:
    """How `model`'s engine gives token ids, or None when it cannot."""
    spec: Engine = model.engine
    if isinstance(spec, FrontedEngine):
        spec = spec.managed
    if isinstance(spec, VllmEngine):
        return "native"
    if isinstance(spec, LlamaCppEngine):
        return "llamacpp" if spec.runtime == "server" else None
    if isinstance(spec, OpenAIEngine) and model.capabilities.supports_token_ids:
        return "native"
    return None


def refusal(model: ModelConfig, stream: bool, n: Any) -> str | None:
    """Why `model` cannot return token ids for this request, or None if it can."""
    how = support(model)
    if how is None:
        return (
            "does not return token ids (llamacpp models on the server runtime and vllm "
            "models do; an external upstream that does sets capabilities.supports_token_ids)"
        )
    if how == "llamacpp" and stream:
        return "cannot return token ids while streaming (llama-server's chunks carry none)"
    if how == "llamacpp" and isinstance(n, int) and n > 1:
        return "returns token ids for n = 1 only (llama-server reports the first choice)"
    return None


# What llama-server is asked instead of `return_token_ids`: its native result beside
# the reply (the prompt's and the output's tokens).
LLAMACPP_NATIVE = {"return_tokens": True, "verbose": True}


async def attached(
    body: bytes, served: Deployment | None, asked: Any, endpoint: str, timeout_s: float
) -> bytes:
    """`body` as the client gets it: with the token ids moved in when it `asked` for
    them and `served` is a llama-server (vLLM's reply already has them)."""
    if served is None or served.token_ids != "llamacpp" or asked is not True:
        return body
    return await attach(body, endpoint, served.upstream, max(0.5, timeout_s))


async def attach(body: bytes, endpoint: str, upstream: OpenAIUpstream, timeout_s: float) -> bytes:
    """A llama-server reply (asked with `llamacpp_body`) in vLLM's token-ids shape."""
    try:
        obj = orjson.loads(body)
    except orjson.JSONDecodeError:
        return body
    if not isinstance(obj, dict):
        return body
    native = obj.pop("__verbose", None)
    choices = obj.get("choices")
    if not isinstance(native, dict) or not isinstance(choices, list) or not choices:
        return orjson.dumps(obj)
    ids = native.get("tokens")
    ids = ids if isinstance(ids, list) and all(type(i) is int for i in ids) else None
    prompt_ids = None
    prompt = native.get("prompt")
    usage = obj.get("usage")
    want = usage.get("prompt_tokens") if isinstance(usage, dict) else None
    if isinstance(prompt, str) and isinstance(want, int):
        got = await upstream.tokenize(prompt, timeout_s)
        if got is not None and len(got) == want:
            prompt_ids = got
    first = choices[0]
    if isinstance(first, dict):
        first["token_ids"] = ids
        if endpoint == "completions":
            first["prompt_token_ids"] = prompt_ids
    if endpoint != "completions":
        obj["prompt_token_ids"] = prompt_ids
    return orjson.dumps(obj)
