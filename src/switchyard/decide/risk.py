"""Risk classes: how far the cache may go for a request, whatever its similarity.

A false hit is worse than a slow miss, and worst where the answer is personal, about
money, medical, or about the moment. Each request gets the strictest policy of:

- its model (`cache.risk.models`), its cache tags (`cache.risk.tags`);
- the content classes its (PII-masked) last user message falls in
  (`cache.risk.classes`: whole words or phrases, and the types of PII masked in it).

Policies, loosest to strictest: `semantic` (exact and semantic hits), `exact_only` (the
same message verbatim in the same partition, never a similar one), `off` (no lookup,
no store). The shipped classes: account, payment and medical questions are exact only,
live-data questions (today, now, current, latest) are off. The cache decision names
the class and the policy that applied.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from switchyard.config import CacheRisk

STRICTNESS = {"semantic": 0, "exact_only": 1, "off": 2}


@dataclass(frozen=True, slots=True)
class Risk:
    policy: str  # "semantic" | "exact_only" | "off"
    source: str | None  # "class:payment", "model:m", "tag:t", or None (no rule applied)
    matched: str | None = None  # the word or PII type that put it in its class


NONE = Risk("semantic", None)


class RiskClassifier:
    def __init__(self, cfg: CacheRisk) -> None:
        self.models = dict(cfg.models)
        self.tags = dict(cfg.tags)
        self.classes: list[tuple[str, str, re.Pattern[str]]] = []
        for name, c in cfg.classes.items():
            parts = [r"\b" + re.escape(t.lower()).replace(r"\ ", r"\s+") + r"\b" for t in c.terms]
            parts += [r"<" + re.escape(p.upper()) + r"_\d+>" for p in c.pii]
            if parts and c.policy != "semantic":
                self.classes.append((name, c.policy, re.compile("|".join(parts), re.I)))
        # Strictest first, so the first class that matches decides among classes.
        self.classes.sort(key=lambda x: -STRICTNESS[x[1]])

    def classify(self, query: str, alias: str, tags: tuple[str, ...]) -> Risk:
        best = NONE
        ruled = self.models.get(alias)
        if ruled is not None:
            best = _stricter(best, Risk(ruled, f"model:{alias}"))
        for t in tags:
            ruled = self.tags.get(t)
            if ruled is not None:
                best = _stricter(best, Risk(ruled, f"tag:{t}"))
        if STRICTNESS[best.policy] == 2:
            return best
        for name, policy, pattern in self.classes:
            if STRICTNESS[policy] <= STRICTNESS[best.policy]:
                break  # sorted: no later class is stricter than what applies
            m = pattern.search(query)
            if m is not None:
                return Risk(policy, f"class:{name}", m.group(0)[:40])
        return best


def _stricter(a: Risk, b: Risk) -> Risk:
    return b if STRICTNESS[b.policy] > STRICTNESS[a.policy] else a
