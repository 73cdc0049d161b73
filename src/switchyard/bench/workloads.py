"""Request workloads: synthetic lengths, a JSONL prompts file, ShareGPT conversations.

Throughput means nothing without the workload's shape, so each workload describes itself
(`describe()`, written into the result) and is reproducible from its seed. Synthetic
prompts are built from common English words that are one token each in the usual BPE
vocabularies (SmolLM2's included), so the prompt length in tokens is close to the target;
the server's `prompt_tokens` (which adds the chat template) is what the report counts.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from switchyard.bench import tokens

_WORD_TEXT = (
    "the of and to in is it you that he was for on are with as his they be at one have this "
    "from or had by but some what there we can out other were all your when up use word how "
    "said an each she which do their time if will way about many then them would write like "
    "so these her long make thing see him two has look more day could go come did my sound "
    "no most number who over know water than call first people may down side been now find "
    "any new work part take get place made live where after back little only"
)
WORDS = _WORD_TEXT.split()


@dataclass(frozen=True, slots=True)
class RequestSpec:
    """One request to send: chat messages (or a completions prompt) and its budget."""

    messages: list[dict[str, Any]]
    max_tokens: int
    input_len: int | None = None

    @property
    def prompt_text(self) -> str:
        return "\n".join(str(m.get("content") or "") for m in self.messages)


def sample_len(rng: random.Random, mean: int, dist: str, spread: float) -> int:
    """A length around `mean`: fixed; uniform within ±spread·mean; normal with
    sd = spread·mean. Never below 1."""
    if dist == "fixed" or spread <= 0:
        return max(1, mean)
    if dist == "uniform":
        return max(1, round(rng.uniform(mean * (1 - spread), mean * (1 + spread))))
    if dist == "normal":
        return max(1, round(rng.gauss(mean, mean * spread)))
    raise ValueError(f"unknown length distribution {dist!r}; use fixed, uniform or normal")


class Workload:
    """An endless, seeded stream of RequestSpecs."""

    kind = "base"

    def next(self) -> RequestSpec:
        raise NotImplementedError

    def describe(self) -> dict[str, Any]:
        raise NotImplementedError


class Synthetic(Workload):
    kind = "synthetic"

    def __init__(
        self, input_len: int, output_len: int, dist: str, spread: float, seed: int
    ) -> None:
        sample_len(random.Random(0), 1, dist, spread)  # validates dist early
        self.input_len, self.output_len = input_len, output_len
        self.dist, self.spread, self.seed = dist, spread, seed
        self.rng = random.Random(seed)

    def next(self) -> RequestSpec:
        n_in = sample_len(self.rng, self.input_len, self.dist, self.spread)
        n_out = sample_len(self.rng, self.output_len, self.dist, self.spread)
        # Random words from the first one on, so no two prompts share a cacheable prefix.
        text = " ".join(self.rng.choice(WORDS) for _ in range(n_in))
        return RequestSpec([{"role": "user", "content": text}], n_out, n_in)

    def describe(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "input_len": self.input_len,
            "output_len": self.output_len,
            "len_dist": self.dist,
            "len_spread": self.spread,
            "seed": self.seed,
        }


class Dataset(Workload):
    """Prompts from a file, shuffled by seed, cycled when the run needs more."""

    def __init__(
        self, kind: str, path: str, items: list[RequestSpec], seed: int, note: str
    ) -> None:
        if not items:
            raise ValueError(f"{path}: no usable prompts")
        self.kind, self.path, self.seed, self.note = kind, path, seed, note
        self.items = list(items)
        random.Random(seed).shuffle(self.items)
        self.i = 0

    def next(self) -> RequestSpec:
        spec = self.items[self.i % len(self.items)]
        self.i += 1
        return spec

    def describe(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "path": self.path,
            "prompts": len(self.items),
            "seed": self.seed,
            "output_len": self.note,
        }


def load_jsonl(path: str, default_max_tokens: int, seed: int) -> Dataset:
    """Lines of `{"prompt": str}` or `{"messages": [...]}`, optionally with `max_tokens`."""
    items = []
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        obj = json.loads(line)
        if isinstance(obj.get("messages"), list):
            messages = obj["messages"]
        elif isinstance(obj.get("prompt"), str):
            messages = [{"role": "user", "content": obj["prompt"]}]
        else:
            raise ValueError(f"{path}:{n}: needs a 'prompt' string or a 'messages' list")
        items.append(RequestSpec(messages, int(obj.get("max_tokens") or default_max_tokens)))
    note = f"per line max_tokens, else {default_max_tokens}"
    return Dataset("jsonl", path, items, seed, note)


def load_sharegpt(path: str, max_output: int, seed: int) -> Dataset:
    """ShareGPT JSON: a list of `{"conversations": [{"from": "human"|"gpt", "value"}]}`.
    The first human turn is the prompt; the reply's length (tokenizer, else chars/4),
    capped at `max_output`, is `max_tokens`, as vLLM bench does."""
    items = []
    for conv in json.loads(Path(path).read_text()):
        turns = conv.get("conversations") or conv.get("conversation") or []
        if len(turns) < 2 or turns[0].get("from") not in ("human", "user"):
            continue
        prompt, reply = str(turns[0].get("value", "")), str(turns[1].get("value", ""))
        n = tokens.count(reply)
        n = len(reply) // 4 if n is None else n
        items.append(RequestSpec([{"role": "user", "content": prompt}], max(1, min(n, max_output))))
    note = f"reply length, capped at {max_output}"
    return Dataset("sharegpt", path, items, seed, note)


class WithImages(Workload):
    """Another workload's requests with `count` image parts (one data: URI, made once)
    added to the last user message, for vision models and the media stage."""

    kind = "with_images"

    def __init__(self, inner: Workload, count: int, data_uri: str, size: str) -> None:
        self.inner = inner
        self.count = count
        self.data_uri = data_uri
        self.size = size

    def next(self) -> RequestSpec:
        spec = self.inner.next()
        messages = [dict(m) for m in spec.messages]
        for m in reversed(messages):
            if m.get("role") == "user":
                text = m.get("content")
                parts: list[dict[str, Any]] = [{"type": "text", "text": str(text or "")}]
                parts += [
                    {"type": "image_url", "image_url": {"url": self.data_uri}}
                    for _ in range(self.count)
                ]
                m["content"] = parts
                break
        return RequestSpec(messages, spec.max_tokens, spec.input_len)

    def describe(self) -> dict[str, Any]:
        return {
            **self.inner.describe(),
            "images": {"per_request": self.count, "size": self.size, "bytes": len(self.data_uri)},
        }
