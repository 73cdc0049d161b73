"""A partition's semantic threshold, moved by what shadow mode saw.

In shadow mode the gateway looks up, calls the model anyway, and compares the cached
answer with the fresh one (the `cache_shadow` decision). That comparison is live
evidence of what the partition's traffic does at a given prompt similarity:

- a would-be hit whose answers disagree (answer similarity below `disagree_below`) was
  a false hit: the partition's threshold rises to just above that prompt similarity
  (`step` above it), at most `max_raise` above the configured threshold;
- `lower_after` agreeing would-be hits in a row, each at or above the partition's
  current threshold, lower it by `step`, never below the configured threshold. One
  disagreement starts the count again.

So a partition whose traffic has one-word traps the checks miss serves fewer, surer
hits, and one whose near misses keep agreeing earns its threshold back. Only shadow
comparisons move it; the raised threshold applies in both modes, so a partition
turned from shadow to enforce keeps what it learned. It is kept in memory (bounded LRU
of partitions), and every change is a decision's evidence. With the shared cache
(state/cache_redis.py) each change is also published, and every other gateway process
adopts the partition's new threshold (`adopt`); the run of agreements stays each
process's own.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from switchyard.config import ShadowFeedback


@dataclass
class _State:
    raise_by: float = 0.0  # above the configured threshold
    agreed: int = 0  # agreeing would-be hits in a row at or above the current threshold


class PartitionThresholds:
    def __init__(self, cfg: ShadowFeedback, max_partitions: int = 10_000) -> None:
        self.cfg = cfg
        self.max_partitions = max_partitions
        self._state: OrderedDict[str, _State] = OrderedDict()

    def count(self) -> int:
        """Partitions whose threshold shadow evidence has raised."""
        return sum(1 for s in self._state.values() if s.raise_by > 0)

    def raised(self, partition: str) -> float:
        state = self._state.get(partition)
        return 0.0 if state is None else state.raise_by

    def adopt(self, partition: str, raise_by: float) -> None:
        """Another process moved `partition`'s threshold to `raise_by` above the
        configured one (bounded by `max_raise`); its run of agreements starts over."""
        state = self._state.pop(partition, None) or _State()
        state.raise_by = max(0.0, min(float(raise_by), self.cfg.max_raise))
        state.agreed = 0
        self._state[partition] = state
        while len(self._state) > self.max_partitions:
            self._state.popitem(last=False)

    def moved(self) -> dict[str, float]:
        """Every partition's raise, for a process that catches up."""
        return {p: s.raise_by for p, s in self._state.items() if s.raise_by > 0}

    def threshold(self, partition: str, base: float) -> float:
        """The threshold this partition's lookups use: the configured one, raised."""
        return min(1.0, base + self.raised(partition)) if self.cfg.enabled else base

    def observe(
        self, partition: str, base: float, prompt_similarity: float, answer_similarity: float
    ) -> dict[str, float | str]:
        """Take one shadow comparison; returns the evidence (what moved, and why)."""
        cfg = self.cfg
        before = self.threshold(partition, base)
        if not cfg.enabled:
            return {"threshold": before, "change": "none", "why": "shadow feedback off"}
        state = self._state.pop(partition, None) or _State()
        self._state[partition] = state  # most recently used last
        while len(self._state) > self.max_partitions:
            self._state.popitem(last=False)
        if answer_similarity < cfg.disagree_below:
            state.agreed = 0
            target = min(prompt_similarity + cfg.step, base + cfg.max_raise, 1.0)
            if target > before:
                state.raise_by = target - base
                why = (
                    f"answers disagreed ({answer_similarity:.3f} < {cfg.disagree_below}) "
                    f"at prompt similarity {prompt_similarity:.3f}"
                )
                return {"threshold": round(target, 4), "change": "raised", "why": why}
            return {"threshold": round(before, 4), "change": "none", "why": "already above"}
        if prompt_similarity >= before and state.raise_by > 0:
            state.agreed += 1
            if state.agreed >= cfg.lower_after:
                state.agreed = 0
                state.raise_by = max(0.0, state.raise_by - cfg.step)
                after = self.threshold(partition, base)
                why = f"{cfg.lower_after} agreeing would-be hits in a row at or above it"
                return {"threshold": round(after, 4), "change": "lowered", "why": why}
        return {"threshold": round(before, 4), "change": "none", "why": "answers agreed"}
