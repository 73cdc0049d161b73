"""Tool shortlisting: forward only the tools a request is likely to need.

Agents often send dozens of tool definitions with every call; each costs prompt tokens
and gives a small model more ways to pick the wrong one. When a request carries more
than `tools.shortlist_k` tools, the ones whose "name: description" is most similar to
the last user message are kept.

Shortlisting is not authorization. A high similarity says a tool looks relevant, never
that the tenant may use it, so tools the config forbids (`tools.deny`, `tools.allow`,
`tools.tenant_allow`, a registry entry's `allowed_tenants`: the rule the reply's gate
applies, `ToolPolicy.refusal`) are removed first, whatever their score, and each
removal is recorded. Even a tool that survives is only offered to the model: whatever executes the
tool call must still authorize it right before running it.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from switchyard.outcomes import Kind, Tagged, tagged
from switchyard.policy.tool_calls_governor import ToolPolicy

Embed = Callable[[list[str]], np.ndarray]


def _function(tool: dict[str, Any]) -> dict[str, Any]:
    """The function object of an OpenAI tool (`{"type": "function", "function": {...}}`),
    or the tool itself for the legacy `functions` shape (`{"name", "description"}`)."""
    fn = tool.get("function")
    return fn if isinstance(fn, dict) else tool


def tool_name(tool: dict[str, Any]) -> str | None:
    name = _function(tool).get("name")
    return name if isinstance(name, str) and name else None


def tool_text(tool: dict[str, Any]) -> str:
    """The text embedded for a tool: "name: description".

    Underscores and hyphens in the name become spaces so the tokenizer sees words
    (`get_invoice` reads as "get invoice"), which is what the similarity depends on.
    """
    fn = _function(tool)
    name = (tool_name(tool) or "").replace("_", " ").replace("-", " ")
    desc = fn.get("description")
    desc = desc.strip() if isinstance(desc, str) else ""
    return f"{name}: {desc}" if desc else name


@dataclass(frozen=True, slots=True)
class ShortlistResult:
    """What was forwarded, what was removed by policy, and what was cut by score.

    `tools` are the kept definitions in request order. `removed` lists tools the tenant
    may not use (name, reason). `candidates` are the permitted tools with their
    similarity, best first (empty when no scoring was needed); `dropped` those cut.
    """

    tools: list[dict[str, Any]]
    kept: list[str]
    dropped: list[str]
    removed: list[dict[str, str]]
    candidates: list[dict[str, Any]]
    k: int | None
    shortlisted: bool
    reason: str
    required: list[str] = field(default_factory=list)

    @property
    def outcome(self) -> Tagged:
        offered = len(self.kept) + len(self.dropped) + len(self.removed)
        return tagged(Kind.TOOLS, f"{len(self.kept)}/{offered}")

    def evidence(self) -> dict[str, Any]:
        return {
            "k": self.k,
            "shortlisted": self.shortlisted,
            "kept": list(self.kept),
            "dropped": list(self.dropped),
            "removed": [dict(r) for r in self.removed],
            "candidates": [dict(c) for c in self.candidates],
            "required": list(self.required),
        }


def _top_k(scores: np.ndarray, names: Sequence[str], k: int, required: Collection[str]) -> set[int]:
    """Positions to keep: required tools first, then the best scores (stable on ties)."""
    keep = {i for i, n in enumerate(names) if n in required}
    for i in np.argsort(-scores, kind="stable"):
        if len(keep) >= k:
            break
        keep.add(int(i))
    return keep


def shortlist(
    tools: list[dict[str, Any]],
    query_vec: np.ndarray | None,
    tool_vecs: np.ndarray | None,
    k: int | None,
    tenant: str | None,
    policy: ToolPolicy,
    *,
    required: Collection[str] = (),
) -> ShortlistResult:
    """Remove forbidden tools, then keep the top-k by cosine with the query.

    `tool_vecs` has one unit row per entry of `tools` (`ToolVectorCache.vectors`). When
    scoring is needed but a vector is missing (no user message, embeddings off) every
    permitted tool is kept: the shortlist only saves tokens, so failing open is safe,
    while the policy removal above never fails open. `required` names (e.g. the tool
    that `tool_choice` forces) are kept whenever permitted, even past k.
    """
    names = [tool_name(t) for t in tools]
    removed: list[dict[str, str]] = []
    permitted: list[int] = []
    for i, name in enumerate(names):
        why = policy.refusal(name, tenant)
        if why is None:
            permitted.append(i)
        else:
            removed.append({"name": name or f"#{i}", "reason": why})
    if k is None or len(permitted) <= k:
        why = "no shortlist configured" if k is None else f"{len(permitted)} <= k={k}"
        return _keep_all(tools, names, permitted, removed, k, why, required)
    if query_vec is None or tool_vecs is None:
        return _keep_all(tools, names, permitted, removed, k, "no vectors to score", required)
    return _score_and_cut(tools, names, permitted, removed, query_vec, tool_vecs, k, required)


def _policy_note(removed: list[dict[str, str]]) -> str:
    return f"{len(removed)} removed by policy; " if removed else ""


def _keep_all(
    tools: list[dict[str, Any]],
    names: list[str | None],
    permitted: list[int],
    removed: list[dict[str, str]],
    k: int | None,
    why: str,
    required: Collection[str],
) -> ShortlistResult:
    return ShortlistResult(
        tools=[tools[i] for i in permitted],
        kept=[str(names[i]) for i in permitted],
        dropped=[],
        removed=removed,
        candidates=[],
        k=k,
        shortlisted=False,
        reason=f"{_policy_note(removed)}kept all {len(permitted)} permitted tools ({why})",
        required=sorted(required),
    )


def _score_and_cut(
    tools: list[dict[str, Any]],
    names: list[str | None],
    permitted: list[int],
    removed: list[dict[str, str]],
    query_vec: np.ndarray,
    tool_vecs: np.ndarray,
    k: int,
    required: Collection[str],
) -> ShortlistResult:
    if tool_vecs.shape[0] != len(tools):
        raise ValueError(f"tool_vecs has {tool_vecs.shape[0]} rows for {len(tools)} tools")
    q = np.asarray(query_vec, dtype=np.float32).reshape(-1)
    scores = np.asarray(tool_vecs, dtype=np.float32)[permitted] @ q
    cand_names = [str(names[i]) for i in permitted]
    keep = _top_k(scores, cand_names, k, required)
    order = np.argsort(-scores, kind="stable")
    candidates = [{"name": cand_names[j], "score": round(float(scores[j]), 4)} for j in order]
    kept_pos = sorted(keep)  # request order: the client's ordering is preserved
    dropped = [cand_names[int(j)] for j in order if int(j) not in keep]
    return ShortlistResult(
        tools=[tools[permitted[j]] for j in kept_pos],
        kept=[cand_names[j] for j in kept_pos],
        dropped=dropped,
        removed=removed,
        candidates=candidates,
        k=k,
        shortlisted=True,
        reason=f"{_policy_note(removed)}kept {len(keep)} of {len(permitted)} permitted tools by similarity",
        required=sorted(required),
    )


class ToolVectorCache:
    """Tool vectors kept between requests, so a recurring tool set is embedded once.

    Entries are keyed by a digest of `tool_text(tool)`, the exact text that is embedded:
    a change to a tool's parameter schema does not change its vector, so it reuses the
    entry, and any change to name or description gets a new one. Least recently used
    entries are evicted past `max_entries`.
    """

    def __init__(self, embed: Embed, max_entries: int = 4096) -> None:
        if max_entries < 1:
            raise ValueError("max_entries must be at least 1")
        self.embed = embed
        self.max_entries = max_entries
        self.hits = 0
        self.misses = 0
        self._entries: OrderedDict[bytes, np.ndarray] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    @staticmethod
    def fingerprint(text: str) -> bytes:
        return hashlib.blake2b(text.encode("utf-8"), digest_size=16).digest()

    def missing(self, tools: list[dict[str, Any]]) -> list[str]:
        """Texts of these tools that are not cached (deduplicated), for callers that embed
        asynchronously themselves and then `add()` the vectors."""
        with self._lock:
            texts = dict.fromkeys(tool_text(t) for t in tools)
            return [t for t in texts if self.fingerprint(t) not in self._entries]

    def add(self, texts: list[str], vecs: np.ndarray) -> None:
        rows = np.asarray(vecs, dtype=np.float32)
        if rows.ndim != 2 or rows.shape[0] != len(texts):
            raise ValueError(f"got {rows.shape} vectors for {len(texts)} texts")
        with self._lock:
            for text, row in zip(texts, rows, strict=True):
                key = self.fingerprint(text)
                self._entries[key] = row
                self._entries.move_to_end(key)
            while len(self._entries) > self.max_entries:
                self._entries.popitem(last=False)

    def vectors(self, tools: list[dict[str, Any]]) -> np.ndarray:
        """One row per tool, in order; misses are embedded together in one call."""
        texts = [tool_text(t) for t in tools]
        if not texts:
            return np.zeros((0, 0), dtype=np.float32)
        cached = self._lookup(list(dict.fromkeys(texts)))
        found = {t: row for t, row in cached.items() if row is not None}
        missing = [t for t in cached if t not in found]
        if missing:
            vecs = np.asarray(self.embed(missing), dtype=np.float32)
            self.add(missing, vecs)
            found.update(zip(missing, vecs, strict=True))
        with self._lock:
            self.misses += len(missing)
            self.hits += len(cached) - len(missing)
        return np.stack([found[t] for t in texts])

    def _lookup(self, texts: list[str]) -> dict[str, np.ndarray | None]:
        with self._lock:
            out: dict[str, np.ndarray | None] = {}
            for text in texts:
                key = self.fingerprint(text)
                row = self._entries.get(key)
                if row is not None:
                    self._entries.move_to_end(key)
                out[text] = row
            return out
