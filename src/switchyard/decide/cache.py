"""Exact and semantic response cache, hard-partitioned before any similarity.

A partition is everything that bounds an answer's validity: scope (tenant, or key),
model alias and revision, the system prompt, tools, response format, sampling
parameters, locale, a data/tool version, and a fingerprint of the earlier turns.
Similarity is only ever computed inside one partition, so no threshold — not even
-1 — can serve another tenant's or another model's answer. Within a partition the
last user message's embedding is compared by cosine; a candidate above the
threshold must still pass the verifier (`decide/verify.py`) before it is served.

Entries have a TTL and the cache an LRU bound on entries and bytes. Vectors of a
partition live in one contiguous matrix (swap-remove on delete), so a lookup is a
single matrix-vector product.
"""

from __future__ import annotations

import hashlib
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import orjson

# Request fields that change the output; part of the partition (and the exact key).
SAMPLING_FIELDS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "max_tokens",
    "max_completion_tokens",
    "n",
    "stop",
    "seed",
    "presence_penalty",
    "frequency_penalty",
    "repeat_penalty",
    "logit_bias",
    "logprobs",
    "top_logprobs",
)


def digest(obj: Any) -> str:
    return hashlib.sha256(orjson.dumps(obj, option=orjson.OPT_SORT_KEYS)).hexdigest()[:32]


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return ""


@dataclass(frozen=True, slots=True)
class CacheKeys:
    partition: str  # hash of everything that bounds validity, incl. earlier turns
    exact: str  # hash of the partition + the last user message
    query: str  # the (masked) last user message: what is embedded and verified
    tags: tuple[str, ...]
    tenant: str
    model: str


def cache_keys(
    body: dict[str, Any],
    endpoint: str,
    scope: str,
    tenant: str,
    model: str,
    revision: str,
    locale: str | None,
    data_version: str | None,
    tags: tuple[str, ...] = (),
) -> CacheKeys:
    """Keys of a (PII-masked) request. The partition covers every input but the last
    user message; the exact key adds that message verbatim."""
    if endpoint == "chat.completions":
        messages = body.get("messages") or []
        last = max((i for i, m in enumerate(messages) if m.get("role") == "user"), default=-1)
        query = _text(messages[last].get("content")) if last >= 0 else ""
        system = [m for m in messages if m.get("role") in ("system", "developer")]
        earlier = [m for i, m in enumerate(messages) if i != last and m not in system]
        after = messages[last + 1 :] if last >= 0 else []
    else:
        query = str(body.get("prompt", ""))
        system, earlier, after = [], [], []
    partition = digest(
        {
            "endpoint": endpoint,
            "scope": scope,
            "model": model,
            "revision": revision,
            "system": system,
            "tools": body.get("tools"),
            "tool_choice": body.get("tool_choice"),
            "response_format": body.get("response_format"),
            "sampling": {k: body.get(k) for k in SAMPLING_FIELDS if body.get(k) is not None},
            "locale": locale,
            "data_version": data_version,
            "earlier_turns": earlier,
            "after": after,
        }
    )
    exact = digest({"partition": partition, "query": query})
    return CacheKeys(partition, exact, query, tags, tenant, model)


@dataclass(slots=True)
class Entry:
    keys: CacheKeys
    body: bytes  # the stored chat.completion / text_completion JSON
    created: float
    expires: float
    size: int
    row: int = -1  # row in the partition's matrix; -1 when it has no vector
    hits: int = 0


@dataclass
class _Partition:
    dim: int
    matrix: np.ndarray = field(default_factory=lambda: np.zeros((0, 0), dtype=np.float32))
    entries: list[Entry] = field(default_factory=list)

    def add(self, entry: Entry, vec: np.ndarray) -> None:
        n = len(self.entries)
        if self.matrix.shape[0] == 0:
            self.matrix = np.zeros((8, self.dim), dtype=np.float32)
        elif n == self.matrix.shape[0]:
            grown = np.zeros((n * 2, self.dim), dtype=np.float32)
            grown[:n] = self.matrix
            self.matrix = grown
        self.matrix[n] = vec
        entry.row = n
        self.entries.append(entry)

    def remove(self, entry: Entry) -> None:
        i, last = entry.row, len(self.entries) - 1
        if i < 0 or i > last or self.entries[i] is not entry:
            return
        if i != last:
            moved = self.entries[last]
            self.matrix[i] = self.matrix[last]
            self.entries[i] = moved
            moved.row = i
        self.entries.pop()
        entry.row = -1

    def best(self, vec: np.ndarray) -> tuple[Entry | None, float]:
        n = len(self.entries)
        if n == 0:
            return None, -2.0
        sims = self.matrix[:n] @ vec
        i = int(np.argmax(sims))
        return self.entries[i], float(sims[i])


@dataclass(frozen=True, slots=True)
class Lookup:
    entry: Entry | None
    kind: str  # "exact" | "semantic" | "miss"
    similarity: float | None
    candidates: int


class ResponseCache:
    def __init__(self, max_entries: int, max_bytes: int, dim: int = 384) -> None:
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.dim = dim
        self.bytes = 0
        self._exact: OrderedDict[str, Entry] = OrderedDict()  # LRU order
        self._partitions: dict[str, _Partition] = {}

    def __len__(self) -> int:
        return len(self._exact)

    # -- lookup ------------------------------------------------------------------------
    def lookup_exact(self, keys: CacheKeys, now: float | None = None) -> Entry | None:
        now = time.time() if now is None else now
        entry = self._exact.get(keys.exact)
        if entry is None:
            return None
        if entry.expires <= now:
            self._drop(entry)
            return None
        self._exact.move_to_end(keys.exact)
        entry.hits += 1
        return entry

    def nearest(self, keys: CacheKeys, vec: np.ndarray, now: float | None = None) -> Lookup:
        """The most similar live entry of the request's partition (no threshold here)."""
        now = time.time() if now is None else now
        part = self._partitions.get(keys.partition)
        if part is None:
            return Lookup(None, "miss", None, 0)
        while True:
            entry, sim = part.best(vec)
            if entry is None:
                return Lookup(None, "miss", None, 0)
            if entry.expires > now:
                return Lookup(entry, "semantic", sim, len(part.entries))
            self._drop(entry)  # expired: remove and look again

    def touch(self, entry: Entry) -> None:
        if entry.keys.exact in self._exact:
            self._exact.move_to_end(entry.keys.exact)
        entry.hits += 1

    # -- store ----------------------------------------------------------------------------
    def store(
        self,
        keys: CacheKeys,
        body: bytes,
        vec: np.ndarray | None,
        ttl_s: float,
        now: float | None = None,
    ) -> Entry:
        now = time.time() if now is None else now
        old = self._exact.get(keys.exact)
        if old is not None:
            self._drop(old)
        entry = Entry(
            keys, body, now, now + ttl_s, len(body) + (self.dim * 4 if vec is not None else 0) + 256
        )
        self._exact[keys.exact] = entry
        self.bytes += entry.size
        if vec is not None:
            part = self._partitions.get(keys.partition)
            if part is None:
                part = self._partitions[keys.partition] = _Partition(self.dim)
            part.add(entry, vec)
        while len(self._exact) > self.max_entries or self.bytes > self.max_bytes:
            _, lru = next(iter(self._exact.items()))
            self._drop(lru)
        return entry

    def _drop(self, entry: Entry) -> None:
        if self._exact.get(entry.keys.exact) is entry:
            del self._exact[entry.keys.exact]
            self.bytes -= entry.size
        part = self._partitions.get(entry.keys.partition)
        if part is not None:
            part.remove(entry)
            if not part.entries:
                del self._partitions[entry.keys.partition]

    # -- invalidation -------------------------------------------------------------------------
    def invalidate(
        self,
        tenant: str | None = None,
        model: str | None = None,
        tag: str | None = None,
        partition: str | None = None,
        dry_run: bool = False,
    ) -> dict[str, Any]:
        """Remove entries matching every given filter (at least one is required)."""
        if tenant is None and model is None and tag is None and partition is None:
            raise ValueError("give at least one of tenant, model, tag, partition")
        matched = [
            e
            for e in self._exact.values()
            if (tenant is None or e.keys.tenant == tenant)
            and (model is None or e.keys.model == model)
            and (tag is None or tag in e.keys.tags)
            and (partition is None or e.keys.partition == partition)
        ]
        if not dry_run:
            for e in matched:
                self._drop(e)
        return {
            "dry_run": dry_run,
            "matched": len(matched),
            "removed": 0 if dry_run else len(matched),
            "partitions": sorted({e.keys.partition for e in matched}),
            "bytes": sum(e.size for e in matched),
        }

    def stats(self) -> dict[str, Any]:
        return {
            "entries": len(self._exact),
            "partitions": len(self._partitions),
            "bytes": self.bytes,
            "max_entries": self.max_entries,
            "max_bytes": self.max_bytes,
        }
