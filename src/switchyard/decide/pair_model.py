"""A learned verdict on a semantic-cache candidate: logistic regression over features
the gateway already has, trained on the development set only.

Features of a pair (the request's masked last message, the candidate's, their cosine):
the cosine; for each check of the rule verifier (decide/verify.py) whether it finds a
difference; word-level overlap (Jaccard of all words and of content words); the
share of words only one side has; and the length ratio. The rules alone veto on the
first difference they see; the model weighs them against each other and against the
cosine, so a difference that rarely changes an answer on the development set costs
less than one that always does.

`switchyard cache train-verifier` fits it on data/cache_pairs.jsonl (never on the
held-out test set) with scikit-learn and writes `pair_model.json` (weights, the feature
names, and the probability cut chosen on the development set for the false-hit
limit). At run time it is a dot product on the one candidate above the threshold.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from difflib import SequenceMatcher
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np

from switchyard.decide.verify import CHECKS, parse

MODEL_FILE = Path(__file__).with_name("pair_model.json")
_WORD = re.compile(r"[\w']+")
_STOP_WORDS = "a an the is are was were be do does did i you we my your our it this that to of"
_STOP = frozenset(
    (_STOP_WORDS + " in on for with and or can could would should how what me").split()
)
_NEGATIONS = frozenset(
    [
        "not",
        "no",
        "never",
        "without",
        "none",
        "nothing",
        "nobody",
        "neither",
        "nor",
        "cannot",
        "can't",
        "don't",
        "doesn't",
        "didn't",
        "isn't",
        "aren't",
        "wasn't",
        "won't",
        "shouldn't",
    ]
)
FEATURES = (
    "cosine",
    *(f"differs_{name}" for name, _ in CHECKS),
    "word_jaccard",
    "content_jaccard",
    "unshared_share",
    "length_ratio",
    # What differs, whatever the word lists know: a one-for-one swap of a content word
    # (an entity, a number, an antonym) changes an answer far more often than a
    # rewording, an added negation always does, and a typo never does.
    "one_word_swap",
    "unshared_negation",
    "unshared_digit",
    "unshared_capitalised",
    "typo_only",
)


@lru_cache(maxsize=8192)
def _words(text: str) -> tuple[frozenset[str], frozenset[str], int]:
    words = [w.lower() for w in _WORD.findall(text)]
    return frozenset(words), frozenset(w for w in words if w not in _STOP), len(words)


def _jaccard(a: frozenset[str], b: frozenset[str]) -> float:
    return len(a & b) / len(a | b) if a or b else 1.0


def _stem(w: str) -> str:
    for suffix in ("ing", "ed", "es", "s"):
        if len(w) > len(suffix) + 3 and w.endswith(suffix):
            return w[: -len(suffix)]
    return w


def _close(w: str, others: frozenset[str]) -> bool:
    """A typo of one of `others`: same first letter, lengths within 2, ratio >= 0.75."""
    return any(
        o[:1] == w[:1] and abs(len(o) - len(w)) <= 2 and SequenceMatcher(None, w, o).ratio() >= 0.75
        for o in others
    )


def _capitalised(text: str) -> frozenset[str]:
    """Words written with a capital inside the sentence (names), lowercased."""
    words = _WORD.findall(text)
    return frozenset(w.lower() for i, w in enumerate(words) if i > 0 and w[:1].isupper())


def features(a: str, b: str, cosine: float) -> np.ndarray:
    pa, pb = parse(a), parse(b)
    wa, ca, na = _words(a)
    wb, cb, nb = _words(b)
    union = wa | wb
    sa = frozenset(_stem(w) for w in ca)
    sb = frozenset(_stem(w) for w in cb)
    only_a, only_b = sa - sb, sb - sa
    unshared = (wa ^ wb) | only_a | only_b
    caps = _capitalised(a) | _capitalised(b)
    typo_only = (
        bool(only_a or only_b)
        and all(_close(w, only_b) for w in only_a)
        and all(_close(w, only_a) for w in only_b)
    )
    return np.array(
        [
            cosine,
            *(1.0 if check(pa, pb) is not None else 0.0 for _, check in CHECKS),
            _jaccard(wa, wb),
            _jaccard(ca, cb),
            len(wa ^ wb) / len(union) if union else 0.0,
            min(na, nb) / max(na, nb) if max(na, nb) else 1.0,
            1.0 if len(only_a) == 1 and len(only_b) == 1 and not typo_only else 0.0,
            1.0 if unshared & _NEGATIONS else 0.0,
            1.0 if any(any(c.isdigit() for c in w) for w in unshared) else 0.0,
            1.0 if unshared & caps else 0.0,
            1.0 if typo_only else 0.0,
        ],
        dtype=np.float64,
    )


@dataclass(frozen=True)
class PairModel:
    weights: np.ndarray  # per feature
    bias: float
    cut: float  # serve when the probability is at least this

    def probability(self, a: str, b: str, cosine: float) -> float:
        z = float(features(a, b, cosine) @ self.weights) + self.bias
        return 1.0 / (1.0 + math.exp(-max(-60.0, min(60.0, z))))

    def verify(self, a: str, b: str, cosine: float) -> tuple[bool, str]:
        p = self.probability(a, b, cosine)
        if p >= self.cut:
            return True, f"ok: same answer p={p:.3f} >= {self.cut:.3f}"
        return False, f"veto: same answer p={p:.3f} < {self.cut:.3f}"

    def to_json(self, trained_on: str, report: dict[str, Any]) -> str:
        return json.dumps(
            {
                "features": list(FEATURES),
                "weights": [round(float(w), 6) for w in self.weights],
                "bias": round(self.bias, 6),
                "cut": round(self.cut, 6),
                "trained_on": trained_on,
                "development_report": report,
            },
            indent=2,
        )


@lru_cache(maxsize=1)
def shipped() -> PairModel:
    return load(MODEL_FILE)


def load(path: Path) -> PairModel:
    data = json.loads(path.read_text())
    if list(data["features"]) != list(FEATURES):
        raise ValueError(
            f"{path}: trained on other features; run `switchyard cache train-verifier`"
        )
    return PairModel(
        np.array(data["weights"], dtype=np.float64), float(data["bias"]), float(data["cut"])
    )


def train(
    pairs: Sequence[dict[str, Any]],
    similarities: Sequence[float],
    threshold: float,
    max_false_hit_rate: float,
) -> tuple[PairModel, dict[str, Any]]:
    """Fit on the pairs (the development set), then choose the lowest probability cut
    whose false-hit rate over the pairs above `threshold` stays within the limit."""
    from sklearn.linear_model import LogisticRegression

    x = np.array([features(p["a"], p["b"], s) for p, s in zip(pairs, similarities, strict=True)])
    y = np.array([bool(p["same_answer"]) for p in pairs])
    fit = LogisticRegression(C=1.0, class_weight="balanced", max_iter=2000).fit(x, y)
    model = PairModel(fit.coef_[0].astype(np.float64), float(fit.intercept_[0]), 0.5)
    probs = np.array([float(v) for v in fit.predict_proba(x)[:, 1]])
    above = np.array(similarities) >= threshold
    negatives = int((~y).sum())
    best: dict[str, Any] | None = None
    for cut in np.round(np.arange(0.05, 1.0, 0.01), 2):
        served = above & (probs >= cut)
        fp, tp = int((served & ~y).sum()), int((served & y).sum())
        fhr = fp / negatives if negatives else 0.0
        if fhr <= max_false_hit_rate:
            best = {"cut": float(cut), "false_hit_rate": fhr, "recall": tp / max(1, int(y.sum()))}
            break
    if best is None:
        best = {"cut": 0.99, "false_hit_rate": None, "recall": None}
    model = PairModel(model.weights, model.bias, best["cut"])
    return model, {"threshold": threshold, **best}
