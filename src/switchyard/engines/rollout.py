"""Samples for RL rollouts from a llama.cpp server, with what a trainer needs of each.

A rollout sample is training data: besides its text it carries the prompt's and the
generated token ids, each generated token's logprob (and the top alternatives when
asked), why it stopped, and where it came from. llama-server gives all of it on its
native `/completion` endpoint (`return_tokens`, `n_probs`); the OpenAI-shaped routes
drop the token ids. The prompt goes as token ids (tokenized once per prompt by the
same server), so the prompt ids in the record are exactly what the engine read.

Logprobs are llama-server's default (`post_sampling_probs` off): the model's
distribution over the vocabulary before the sampling transforms (temperature, top-k,
top-p), so they are <= 0 and comparable across sampling settings.

The provenance of a revision (tokenizer and chat-template digests, engine version,
hardware) is read once when its engine is loaded; each sample adds its sampling
parameters, seed and the engine's slots busy at the moment it was sent.
"""

from __future__ import annotations

import hashlib
import os
import platform
import time
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import aiohttp

from switchyard.engines.llamacpp import ManagedLlamaCpp

# llama-server's stop_type -> the OpenAI finish_reason
_FINISH = {"eos": "stop", "word": "stop", "limit": "length", "none": "length"}


class EngineCallFailed(Exception):
    """The engine did not answer a rollout call (the message is safe to show)."""


@dataclass(frozen=True, slots=True)
class Sampling:
    """One sample's sampling parameters, as the record reports them."""

    temperature: float
    top_p: float
    top_k: int
    min_p: float
    max_tokens: int
    seed: int
    stop: tuple[str, ...]
    top_logprobs: int
    # No prompt cache: the same inputs give the same tokens. Reusing a cached prompt
    # prefix evaluates the rest in another split, which changes the numbers (and so
    # seeded draws); batching with other sequences did not, here (`switchyard
    # determinism` measures both).
    deterministic: bool = False

    def describe(self) -> dict[str, Any]:
        return {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "min_p": self.min_p,
            "max_tokens": self.max_tokens,
            "seed": self.seed,
            "stop": list(self.stop),
            "top_logprobs": self.top_logprobs,
            "deterministic": self.deterministic,
        }


@cache
def hardware() -> dict[str, Any]:
    """The machine the engines run on: CPU model, cores, the vector extensions that
    change kernels (and so, possibly, the numbers), GPU (none here)."""
    cpu, flags = platform.processor() or "unknown", set[str]()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and cpu in ("unknown", platform.processor()):
                cpu = line.split(":", 1)[1].strip()
            elif line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    except OSError:
        pass
    extensions = sorted(f for f in flags if f in ("avx2", "avx512f", "avx512_bf16", "amx_tile"))
    return {"cpu": cpu, "cores": os.cpu_count(), "extensions": extensions, "gpu": None}


@cache
def tokenizer_digest(gguf_path: str) -> dict[str, str | None]:
    """sha256 of the tokenizer (model kind, vocabulary, merges, token types, special
    ids) and of the chat template stored in a GGUF file; one read per file."""
    from gguf import GGUFReader  # llama.cpp's own reader, installed with the engine

    reader = GGUFReader(gguf_path)
    tok = hashlib.sha256()
    template: str | None = None
    for name in sorted(reader.fields):
        if not name.startswith("tokenizer."):
            continue
        field = reader.fields[name]
        if name == "tokenizer.chat_template":
            template = bytes(field.parts[field.data[0]]).decode("utf-8", "replace")
            continue
        tok.update(name.encode())
        for i in field.data:
            tok.update(bytes(field.parts[i]))
    return {
        "tokenizer_sha256": tok.hexdigest(),
        "gguf_chat_template_sha256": hashlib.sha256(template.encode()).hexdigest()
        if template is not None
        else None,
    }


def _root(engine: ManagedLlamaCpp) -> str:
    return engine.base_url.removesuffix("/v1")


async def _post(
    session: aiohttp.ClientSession, url: str, body: dict[str, Any], what: str, reads: bool = False
) -> Any:
    """The engine's JSON answer. `reads`: a call that changes nothing (apply-template,
    tokenize) is sent once more when the connection it went out on was closed under it
    (a kept-alive connection the engine had let go); a sample is never sent twice."""
    for attempt in (1, 2):
        try:
            async with session.post(url, json=body) as r:
                if r.status != 200:
                    raise EngineCallFailed(f"the engine answered {r.status} to {what}")
                return await r.json(content_type=None)
        except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as exc:
            if reads and attempt == 1:
                continue
            raise EngineCallFailed(
                f"the engine did not answer {what} ({type(exc).__name__})"
            ) from None
        except (aiohttp.ClientError, OSError, TimeoutError, ValueError) as exc:
            raise EngineCallFailed(
                f"the engine did not answer {what} ({type(exc).__name__})"
            ) from None
    raise AssertionError("unreachable")


async def engine_facts(session: aiohttp.ClientSession, engine: ManagedLlamaCpp) -> dict[str, Any]:
    """What the running engine says of itself: build, slots, its chat template."""
    try:
        async with session.get(_root(engine) + "/props") as r:
            props = await r.json(content_type=None) if r.status == 200 else {}
    except (aiohttp.ClientError, OSError, TimeoutError, ValueError):
        props = {}
    template = props.get("chat_template") if isinstance(props, dict) else None
    return {
        "kind": engine.kind,
        "version": props.get("build_info") if isinstance(props, dict) else None,
        "slots": props.get("total_slots") if isinstance(props, dict) else None,
        "chat_template_sha256": hashlib.sha256(template.encode()).hexdigest()
        if isinstance(template, str)
        else None,
    }


async def render_prompt(
    session: aiohttp.ClientSession, engine: ManagedLlamaCpp, messages: list[dict[str, Any]]
) -> str:
    """A chat prompt as the engine's own template renders it (with the assistant's
    turn opened)."""
    out = await _post(
        session,
        _root(engine) + "/apply-template",
        {"messages": messages},
        "apply-template",
        reads=True,
    )
    prompt = out.get("prompt") if isinstance(out, dict) else None
    if not isinstance(prompt, str):
        raise EngineCallFailed("the engine's apply-template answer had no prompt")
    return prompt


async def tokenize(session: aiohttp.ClientSession, engine: ManagedLlamaCpp, text: str) -> list[int]:
    """The engine's tokens of a prompt: its special tokens (the template's markers)
    parsed, and BOS added when the model wants one, as /completion would."""
    out = await _post(
        session,
        _root(engine) + "/tokenize",
        {"content": text, "add_special": True, "parse_special": True},
        "tokenize",
        reads=True,
    )
    ids = out.get("tokens") if isinstance(out, dict) else None
    if not isinstance(ids, list) or not all(isinstance(i, int) for i in ids):
        raise EngineCallFailed("the engine's tokenize answer had no token ids")
    return ids


async def slots_busy(
    session: aiohttp.ClientSession, engine: ManagedLlamaCpp
) -> dict[str, Any] | None:
    """The engine's slots decoding now (its batch context), or None where it reports none."""
    try:
        async with session.get(_root(engine) + "/slots") as r:
            if r.status != 200:
                return None
            slots = await r.json(content_type=None)
    except (aiohttp.ClientError, OSError, TimeoutError, ValueError):
        return None
    if not isinstance(slots, list):
        return None
    busy = sum(1 for s in slots if isinstance(s, dict) and s.get("is_processing"))
    return {"slots_busy": busy, "slots_total": len(slots), "source": "llama-server /slots at send"}


def align_logprobs(
    ids: list[int], probs: list[Any], top: int
) -> tuple[list[float | None], list[list[dict[str, Any]]], list[int]]:
    """Each token's logprob (and top alternatives) from llama-server's probabilities.

    llama-server reports no probability for a token that ends inside a UTF-8
    character (an emoji or a CJK character split over tokens): its entry is dropped and
    the next token's comes instead. So entries are matched to tokens by id, in order;
    a token without one gets None, and its position is listed in `missing`."""
    logprobs: list[float | None] = []
    tops: list[list[dict[str, Any]]] = []
    missing: list[int] = []
    k = 0
    for i, tid in enumerate(ids):
        p = probs[k] if k < len(probs) else None
        if not isinstance(p, dict) or p.get("id") != tid:
            logprobs.append(None)
            missing.append(i)
            if top:
                tops.append([])
            continue
        k += 1
        lp = p.get("logprob")
        logprobs.append(float(lp) if isinstance(lp, int | float) else None)
        if logprobs[-1] is None:
            missing.append(i)
        if top:
            tops.append(
                [
                    {"token_id": t.get("id"), "logprob": t.get("logprob")}
                    for t in (p.get("top_logprobs") or [])[:top]
                    if isinstance(t, dict)
                ]
            )
    return logprobs, tops, missing


async def sample(
    session: aiohttp.ClientSession,
    engine: ManagedLlamaCpp,
    prompt_ids: list[int],
    s: Sampling,
    lora: list[dict[str, Any]] | None,
) -> dict[str, Any]:
    """One sample: its text, token ids, logprobs, finish reason and timings."""
    batch = await slots_busy(session, engine)
    body: dict[str, Any] = {
        "prompt": prompt_ids,
        "n_predict": s.max_tokens,
        "temperature": s.temperature,
        "top_p": s.top_p,
        "top_k": s.top_k,
        "min_p": s.min_p,
        "seed": s.seed,
        "stop": list(s.stop),
        "n_probs": max(1, s.top_logprobs),  # the sampled token's own logprob comes with it
        "return_tokens": True,
        "cache_prompt": not s.deterministic,
        "stream": False,
    }
    if lora is not None:
        body["lora"] = lora
    started = time.time()
    out = await _post(session, _root(engine) + "/completion", body, "the sample")
    if not isinstance(out, dict):
        raise EngineCallFailed("the engine's answer was not an object")
    ids = out.get("tokens")
    probs = out.get("completion_probabilities") or []
    if (
        not isinstance(ids, list)
        or not all(isinstance(i, int) for i in ids)
        or not isinstance(probs, list)
        or len(probs) > len(ids)
    ):
        raise EngineCallFailed("the engine's answer lacked token ids or their logprobs")
    logprobs, tops, missing = align_logprobs(ids, probs, s.top_logprobs)
    return {
        "text": str(out.get("content", "")),
        "token_ids": ids,
        "logprobs": logprobs,
        "logprobs_missing": missing,
        "top_logprobs": tops if s.top_logprobs else None,
        "finish_reason": _FINISH.get(str(out.get("stop_type")), "stop"),
        "prompt_tokens": len(prompt_ids),
        "completion_tokens": len(ids),
        "batch": batch,
        "started_at": started,
        "finished_at": time.time(),
    }


# -- either engine kind: what rollouts, validation and determinism call ---------------
async def prompt_ids(
    session: aiohttp.ClientSession,
    engine: ManagedLlamaCpp,
    text: str | None,
    messages: list[dict[str, Any]] | None,
) -> list[int]:
    """The ids the engine reads for a text prompt, or a chat under its own template."""
    if engine.kind == "vllm":
        from switchyard.engines import vllm_sampling

        p: dict[str, Any] = {"messages": messages} if messages is not None else {"prompt": text}
        return await vllm_sampling.prompt_ids(session, engine, p)
    if messages is not None:
        text = await render_prompt(session, engine, messages)
    return await tokenize(session, engine, str(text))


async def draw(
    session: aiohttp.ClientSession,
    engine: ManagedLlamaCpp,
    ids: list[int],
    s: Sampling,
    lora: list[dict[str, Any]] | None,
    served_as: str | None = None,
) -> dict[str, Any]:
    """One sample from either engine kind (`served_as`: the name vLLM serves an
    adapter under; llama-server takes the adapter as `lora`)."""
    if engine.kind == "vllm":
        from switchyard.engines import vllm_sampling

        return await vllm_sampling.sample(session, engine, ids, s, served_as)
    return await sample(session, engine, ids, s, lora)


async def facts(session: aiohttp.ClientSession, engine: ManagedLlamaCpp) -> dict[str, Any]:
    if engine.kind == "vllm":
        from switchyard.engines import vllm_sampling

        return await vllm_sampling.engine_facts(session, engine)
    return await engine_facts(session, engine)


@cache
def hf_tokenizer_digest(folder: str) -> dict[str, str | None]:
    """sha256 of a Hugging Face model folder's tokenizer and of its chat template."""
    root = Path(folder)
    tok = root / "tokenizer.json"
    template: str | None = None
    jinja = root / "chat_template.jinja"
    if jinja.exists():
        template = jinja.read_text(encoding="utf-8")
    else:
        import json

        cfg = root / "tokenizer_config.json"
        if cfg.exists():
            t = json.loads(cfg.read_text(encoding="utf-8")).get("chat_template")
            template = t if isinstance(t, str) else None
    return {
        "tokenizer_sha256": hashlib.sha256(tok.read_bytes()).hexdigest() if tok.exists() else None,
        "gguf_chat_template_sha256": None,
        "hf_chat_template_sha256": hashlib.sha256(template.encode()).hexdigest()
        if template is not None
        else None,
    }
