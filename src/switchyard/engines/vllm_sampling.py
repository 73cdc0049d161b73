"""Samples with token ids and logprobs from a vLLM server, in the shape of
`engines/rollout.py`'s llama-server samples (so the determinism check compares both).

vLLM gives everything on its OpenAI completions route: the prompt goes as token ids,
`return_token_ids` returns the generated ids, `logprobs: k` each generated token's
logprob with the top k; `seed` is per request. Its default logprobs are the model's
raw distribution (before temperature and top-k/top-p), as llama-server's are. Its
`/tokenize` applies the model's chat template to messages, with the assistant's turn
opened, and returns the ids the engine reads.
"""

from __future__ import annotations

import time
from typing import Any

import aiohttp

from switchyard.engines.llamacpp import ManagedLlamaCpp
from switchyard.engines.rollout import EngineCallFailed, Sampling

_FINISH = {"stop": "stop", "length": "length", "abort": "error"}


def _root(engine: ManagedLlamaCpp) -> str:
    return engine.base_url.removesuffix("/v1")


async def _call(
    session: aiohttp.ClientSession, method: str, url: str, body: dict[str, Any] | None, what: str
) -> Any:
    try:
        async with session.request(method, url, json=body) as r:
            if r.status != 200:
                raise EngineCallFailed(f"the engine answered {r.status} to {what}")
            return await r.json(content_type=None)
    except (aiohttp.ClientError, OSError, TimeoutError, ValueError) as exc:
        raise EngineCallFailed(f"the engine did not answer {what} ({type(exc).__name__})") from None


async def prompt_ids(
    session: aiohttp.ClientSession, engine: ManagedLlamaCpp, prompt: dict[str, Any]
) -> list[int]:
    """A text prompt's ids, or a chat's under the model's template (turn opened)."""
    body: dict[str, Any] = {"model": engine.alias}
    if prompt.get("messages") is not None:
        body.update(messages=prompt["messages"], add_generation_prompt=True)
    else:
        body.update(prompt=str(prompt.get("prompt", "")), add_special_tokens=True)
    out = await _call(session, "POST", _root(engine) + "/tokenize", body, "tokenize")
    ids = out.get("tokens") if isinstance(out, dict) else None
    if not isinstance(ids, list) or not all(type(i) is int for i in ids):
        raise EngineCallFailed("the engine's tokenize answer had no token ids")
    return ids


async def engine_facts(session: aiohttp.ClientSession, engine: ManagedLlamaCpp) -> dict[str, Any]:
    """What the running vLLM says of itself: its version, and its sequences at once."""
    try:
        out = await _call(session, "GET", _root(engine) + "/version", None, "version")
    except EngineCallFailed:
        out = {}
    return {
        "kind": engine.kind,
        "version": out.get("version") if isinstance(out, dict) else None,
        "slots": engine.runtime_info().get("parallel"),
        "chat_template_sha256": None,  # the folder's (hf_chat_template_sha256) applies
    }


async def sample(
    session: aiohttp.ClientSession,
    engine: ManagedLlamaCpp,
    ids: list[int],
    s: Sampling,
    served_as: str | None = None,
) -> dict[str, Any]:
    """One sample: its text, token ids, logprobs, finish reason and timings
    (`served_as`: an adapter's name, which vLLM serves it under)."""
    body: dict[str, Any] = {
        "model": served_as or engine.alias,
        "prompt": ids,
        "max_tokens": s.max_tokens,
        "temperature": s.temperature,
        "top_p": s.top_p,
        "top_k": s.top_k if s.top_k > 0 else -1,  # vLLM: -1 is the whole vocabulary
        "min_p": s.min_p,
        "seed": s.seed,
        "stop": list(s.stop),
        "logprobs": max(1, s.top_logprobs),
        "return_token_ids": True,
    }
    started = time.time()
    out = await _call(session, "POST", engine.base_url + "/completions", body, "the sample")
    choice = (out.get("choices") or [None])[0] if isinstance(out, dict) else None
    if not isinstance(choice, dict):
        raise EngineCallFailed("the engine's answer had no choice")
    got = choice.get("token_ids")
    raw = choice.get("logprobs")
    lp: dict[str, Any] = raw if isinstance(raw, dict) else {}
    values = lp.get("token_logprobs")
    if (
        not isinstance(got, list)
        or not all(type(i) is int for i in got)
        or not isinstance(values, list)
        or len(values) != len(got)
    ):
        raise EngineCallFailed("the engine's answer lacked token ids or their logprobs")
    logprobs = [float(v) if isinstance(v, int | float) else None for v in values]
    tops = [
        [{"token": t, "logprob": float(v)} for t, v in list(d.items())[: s.top_logprobs]]
        if isinstance(d, dict)
        else []
        for d in (lp.get("top_logprobs") or [])
    ]
    return {
        "text": str(choice.get("text", "")),
        "token_ids": got,
        "logprobs": logprobs,
        "logprobs_missing": [i for i, v in enumerate(logprobs) if v is None],
        "top_logprobs": tops if s.top_logprobs else None,
        "finish_reason": _FINISH.get(str(choice.get("finish_reason")), "stop"),
        "prompt_tokens": len(ids),
        "completion_tokens": len(got),
        "batch": None,  # vLLM reports no per-request batch here
        "started_at": started,
        "finished_at": time.time(),
    }
