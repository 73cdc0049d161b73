"""Exact and semantic response cache, hard-partitioned before any similarity.

A partition is everything that bounds an answer's validity: scope (tenant, or key),
model alias and revision, every message but the last user message's text (the system
prompt, the earlier turns, in their places), tools, response format, sampling
parameters, locale, a data/tool version.
Similarity is only ever computed inside one partition, so no threshold — not even
-1 — can serve another tenant's or another model's answer. Within a partition the
last user message's embedding is compared by cosine; a candidate above the
threshold must still pass the verifier (`decide/verify.py`) before it is served.

Entries have a TTL and the cache an LRU bound on entries and bytes. Vectors of a
partition live in one contiguous float32 matrix (swap-remove on delete). A small
partition (<= `_Partition.exact_max` entries) is searched by one exact matrix-vector
product. A large one first scans a 1-bit sign code of each vector (48 bytes: signs of
384 fixed random Gaussian projections, so the Hamming distance of two codes estimates
their angle, ~10x less memory to read than the float32 matrix) and then re-ranks the
shortlist in exact float32: the similarity returned and compared with the threshold is
always the exact cosine of the returned entry. Which entries are re-ranked is bounded
statistically: the Hamming distance between the codes of vectors at cosine s is
Binomial(bits, acos(s)/pi), so the 32 nearest codes and every entry whose distance
is within `z` = 5 standard deviations of what `exact_floor` implies are re-ranked.
The result is therefore the exact best entry whenever the best cosine is >=
exact_floor (0.6, well below any useful threshold), except with probability ~1e-6
per such entry; below the floor it is the best of the re-ranked shortlist, a
near-best that is a miss at any sensible threshold either way.
"""

from __future__ import annotations

import hashlib
import importlib
import math
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import orjson

from switchyard.request import Generation
from switchyard.state.cache import CacheKeys, CacheShare, Entry, matches

if TYPE_CHECKING:
    from switchyard.decide.shadow_threshold import PartitionThresholds

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
    "best_of",
    "return_token_ids",
)


def digest(obj: Any) -> str:
    return hashlib.sha256(orjson.dumps(obj, option=orjson.OPT_SORT_KEYS)).hexdigest()[:32]


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return ""


def cache_keys(
    req: Generation,
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
    user message's text (a completion: its prompt, when that is not one text): every
    other message in its place, that message's other fields, and every member that
    goes upstream and may change the answer; the exact key adds that text (the
    prompt) verbatim."""
    last_fields: dict[str, Any] | None = None
    if endpoint == "chat.completions":
        messages = req.messages or []
        last = max((i for i, m in enumerate(messages) if m.get("role") == "user"), default=-1)
        query = _text(messages[last].get("content")) if last >= 0 else ""
        if last >= 0:  # its `name` (who asks) changes the answer as its words do
            last_fields = {k: v for k, v in messages[last].items() if k != "content"}
        # Every other message in its place: a system or developer message between
        # turns, or a turn after the question, is another conversation.
        turns = [m for i, m in enumerate(messages) if i != last]
    else:  # a text; texts or token ids are also typed in the partition (`prompt`)
        prompt = req.prompt
        query = prompt if isinstance(prompt, str) else orjson.dumps(prompt).decode()
        last, turns = -1, []
    partition = digest(
        {
            "endpoint": endpoint,
            "scope": scope,
            "model": model,
            "revision": revision,
            "turns": turns,
            "last": last,
            "last_fields": last_fields,
            "tools": req.tools,
            "functions": req.functions,
            "tool_choice": req.tool_choice,
            "response_format": req.response_format,
            "sampling": {k: v for k in SAMPLING_FIELDS if (v := getattr(req, k)) is not None},
            "locale": locale,
            "data_version": data_version,
            "prompt": None if isinstance(req.prompt, str) else req.prompt,
            # Every member no stage reads is forwarded as sent (`echo`, `suffix`, an
            # engine's own options): any of them may ask for another answer.
            "extra": req.extra,
        }
    )
    exact = digest({"partition": partition, "query": query})
    return CacheKeys(partition, exact, query, tags, tenant, model, revision)


_PROJECTIONS: dict[tuple[int, int], np.ndarray] = {}


def _projection(dim: int, bits: int) -> np.ndarray:
    """Fixed random Gaussian hyperplanes (same seed in every process)."""
    p = _PROJECTIONS.get((dim, bits))
    if p is None:
        p = np.random.default_rng(0x5EED).standard_normal((dim, bits)).astype(np.float32)
        _PROJECTIONS[(dim, bits)] = p
    return p


@dataclass
class _Partition:
    dim: int
    matrix: np.ndarray = field(default_factory=lambda: np.zeros((0, 0), dtype=np.float32))
    codes: np.ndarray = field(default_factory=lambda: np.zeros((0, 0), dtype=np.uint8))
    entries: list[Entry] = field(default_factory=list)

    # Up to this many entries one exact float32 product is cheap enough (< 1 ms).
    exact_max = 4096
    bits = 384  # sign-code length: 48 bytes per entry
    shortlist = 32  # re-ranked whatever the bound says
    exact_floor = 0.6  # the search is exact whenever the best cosine is at least this
    z = 5.0  # standard deviations of Hamming distance re-ranked beyond the expected

    def _code(self, vecs: np.ndarray) -> np.ndarray:
        signs = np.asarray(vecs, dtype=np.float32) @ _projection(self.dim, self.bits) > 0
        return np.packbits(signs, axis=-1)

    def add(self, entry: Entry, vec: np.ndarray) -> None:
        n = len(self.entries)
        if self.matrix.shape[0] == 0:
            self.matrix = np.zeros((8, self.dim), dtype=np.float32)
            self.codes = np.zeros((8, self.bits // 8), dtype=np.uint8)
        elif n == self.matrix.shape[0]:
            grown = np.zeros((n * 2, self.dim), dtype=np.float32)
            grown[:n] = self.matrix
            self.matrix = grown
            codes = np.zeros((n * 2, self.bits // 8), dtype=np.uint8)
            codes[:n] = self.codes
            self.codes = codes
        self.matrix[n] = vec
        self.codes[n] = self._code(self.matrix[n])
        entry.row = n
        self.entries.append(entry)

    def remove(self, entry: Entry) -> None:
        i, last = entry.row, len(self.entries) - 1
        if i < 0 or i > last or self.entries[i] is not entry:
            return
        if i != last:
            moved = self.entries[last]
            self.matrix[i] = self.matrix[last]
            self.codes[i] = self.codes[last]
            self.entries[i] = moved
            moved.row = i
        self.entries.pop()
        entry.row = -1

    def best(self, vec: np.ndarray) -> tuple[Entry | None, float]:
        n = len(self.entries)
        if n == 0:
            return None, -2.0
        vec = np.asarray(vec, dtype=np.float32)
        if n <= max(self.exact_max, self.shortlist):
            sims = self.matrix[:n] @ vec
            i = int(np.argmax(sims))
            return self.entries[i], float(sims[i])
        i, sim = self._filtered(vec, n)
        return self.entries[i], sim

    @classmethod
    def _cut(cls) -> float:
        """The largest Hamming distance the exact floor's bound cannot rule out."""
        p = math.acos(cls.exact_floor) / math.pi
        return cls.bits * p + cls.z * math.sqrt(cls.bits * p * (1 - p))

    def _filtered(self, vec: np.ndarray, n: int) -> tuple[int, float]:
        """Sign-code scan, then exact float32 re-ranking (see the module docstring)."""
        # Imported here (keeps `switchyard --help` light); untyped SWIG bindings.
        faiss: Any = importlib.import_module("faiss")

        query = self._code(vec)
        dist = np.empty(n, dtype=np.int32)
        faiss.hammings(
            faiss.swig_ptr(query),
            faiss.swig_ptr(self.codes),
            1,
            n,
            self.bits // 8,
            faiss.swig_ptr(dist),
        )
        # Every entry at least as close as the shortlist-th code, and every entry the
        # floor's bound cannot rule out; a best above the floor only tightens the bound.
        # When the bound alone admits a shortlist's worth, the shortlist-th code is
        # within it and adds nothing: the common case skips finding that code.
        rows = np.flatnonzero(dist <= self._cut())
        if rows.size < self.shortlist:
            near = np.partition(dist, self.shortlist - 1)[self.shortlist - 1]
            rows = np.flatnonzero(dist <= near)
        sims = self.matrix[rows] @ vec
        j = int(np.argmax(sims))
        return int(rows[j]), float(sims[j])


@dataclass(frozen=True, slots=True)
class Lookup:
    entry: Entry | None
    kind: str  # "exact" | "semantic" | "miss"
    similarity: float | None
    candidates: int


class ResponseCache:
    def __init__(
        self,
        max_entries: int,
        max_bytes: int,
        dimensions: int | Callable[[], int | None] | None = None,
        thresholds: PartitionThresholds | None = None,
    ) -> None:
        """`dimensions`: the embedder's vector size, or a callable that tells it once
        the embedding model has loaded. Unknown, a partition takes the size of its
        first vector; a vector of another size (a different embedding model) is
        never compared with it."""
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self._dimensions = dimensions
        self.bytes = 0
        self._exact: OrderedDict[str, Entry] = OrderedDict()  # LRU order
        self._partitions: dict[str, _Partition] = {}
        # Set by the gateway with storage.redis_url: entries shared by every process.
        self.share: CacheShare | None = None
        # Set by the gateway: each partition's threshold as shadow evidence moved it,
        # and what a semantic candidate must pass (decide/candidate.py), in words.
        self.thresholds = thresholds  # moved by shadow comparisons (shadow_threshold.py)
        self.checks: str | None = None

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

    def has_exact(self, keys: CacheKeys, now: float | None = None) -> bool:
        """Whether a live exact entry exists; unlike `lookup_exact`, touches nothing."""
        entry = self._exact.get(keys.exact)
        return entry is not None and entry.expires > (time.time() if now is None else now)

    @property
    def dim(self) -> int | None:
        d = self._dimensions
        return d() if callable(d) else d

    def nearest(self, keys: CacheKeys, vec: np.ndarray, now: float | None = None) -> Lookup:
        """The most similar live entry of the request's partition (no threshold here)."""
        now = time.time() if now is None else now
        part = self._partitions.get(keys.partition)
        if part is None or part.dim != vec.shape[-1]:
            return Lookup(None, "miss", None, 0)
        while True:
            entry, sim = part.best(vec)
            if entry is None:
                return Lookup(None, "miss", None, 0)
            if entry.expires > now:
                return Lookup(entry, "semantic", sim, len(part.entries))
            self._drop(entry)  # expired: remove and look again

    def entry(self, exact: str) -> Entry | None:
        """The entry under an exact key, live or not; touches nothing."""
        return self._exact.get(exact)

    def entries(self) -> list[Entry]:
        return list(self._exact.values())

    def drop(self, entry: Entry) -> None:
        self._drop(entry)

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
        if vec is not None:
            dim = self.dim
            if dim is not None and vec.shape[-1] != dim:
                raise ValueError(f"a {vec.shape[-1]}-dimension vector for a {dim}-dimension cache")
        vec_bytes = vec.shape[-1] * 4 + _Partition.bits // 8 if vec is not None else 0
        entry = Entry(keys, body, now, now + ttl_s, len(body) + vec_bytes + 256)
        self._exact[keys.exact] = entry
        self.bytes += entry.size
        if vec is not None:
            part = self._partitions.get(keys.partition)
            if part is not None and part.dim != vec.shape[-1]:  # the embedding model changed
                for old_entry in list(part.entries):
                    self._drop(old_entry)
                part = self._partitions.get(keys.partition)
            if part is None:
                part = self._partitions[keys.partition] = _Partition(int(vec.shape[-1]))
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

    def adopt_threshold(self, partition: str, raise_by: float) -> None:
        """Another process's shadow evidence moved a partition's threshold."""
        if self.thresholds is not None:
            self.thresholds.adopt(partition, raise_by)

    # -- invalidation -------------------------------------------------------------------------
    def invalidate(
        self,
        tenant: str | None = None,
        model: str | None = None,
        tag: str | None = None,
        partition: str | None = None,
        dry_run: bool = False,
    ) -> dict[str, Any]:
        """Remove entries matching every given filter (at least one is required). A
        model matches the alias asked for and the model that answered (a routed
        alias's routed model)."""
        if tenant is None and model is None and tag is None and partition is None:
            raise ValueError("give at least one of tenant, model, tag, partition")
        f = {"tenant": tenant, "model": model, "tag": tag, "partition": partition}
        matched = [e for e in self._exact.values() if matches(e.keys, f)]
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
            "shared": self.share.stats() if self.share is not None else {"redis": False},
            "semantic_checks": self.checks,
            "raised_partitions": self.thresholds.count() if self.thresholds is not None else 0,
        }
