"""The learned pair model (decide/pair_model.py): its features on typed differences,
its verdict against its cut, training's choice of the cut, and the shipped weights."""

from __future__ import annotations

import math

import numpy as np

from switchyard.decide import pair_model
from switchyard.decide.pair_model import FEATURES, PairModel, features, train


def _f(a: str, b: str, cosine: float = 0.9) -> dict[str, float]:
    return dict(zip(FEATURES, features(a, b, cosine).tolist(), strict=True))


def test_features_name_what_differs() -> None:
    typo = _f("How do I reset the router?", "How do I reset the ruoter?")
    assert typo["typo_only"] == 1.0 and typo["one_word_swap"] == 0.0
    swap = _f("How do I reset the router?", "How do I reset the modem?")
    assert swap["one_word_swap"] == 1.0 and swap["typo_only"] == 0.0
    neg = _f("Should I eat fish with gout?", "Should I not eat fish with gout?")
    assert neg["unshared_negation"] == 1.0 and neg["differs_negation"] == 1.0
    num = _f("Is 5 mg a safe dose?", "Is 50 mg a safe dose?")
    assert num["unshared_digit"] == 1.0 and num["differs_number"] == 1.0
    name = _f("How far is it from Paris to Lyon?", "How far is it from Paris to Nice?")
    assert name["unshared_capitalised"] == 1.0
    same = _f("What is a mutual fund?", "What is a mutual fund?", 1.0)
    assert same["word_jaccard"] == 1.0 and same["unshared_share"] == 0.0
    assert same["cosine"] == 1.0 and sum(same[f"differs_{n}"] for n in ("number", "entity")) == 0


def test_the_verdict_is_the_probability_against_the_cut() -> None:
    w = np.zeros(len(FEATURES))
    w[0] = 10.0  # only the cosine counts
    model = PairModel(w, -9.0, 0.5)  # p = sigmoid(10 cos - 9): 0.5 at cos 0.9
    for cos in (0.85, 0.89, 0.91, 0.95):
        p = 1 / (1 + math.exp(-(10 * cos - 9)))
        assert math.isclose(model.probability("a b", "a c", cos), p, rel_tol=1e-9)
        assert model.verify("a b", "a c", cos)[0] == (p >= 0.5)
    ok, why = model.verify("a b", "a c", 0.95)
    assert ok and why.startswith("ok: same answer p=")


def test_training_picks_the_lowest_cut_within_the_false_hit_limit() -> None:
    rng = np.random.default_rng(3)
    words = ["alpha", "beta", "gamma", "delta", "omega", "sigma"]
    pairs, sims = [], []
    for i in range(120):
        base = f"how do I {words[i % 6]} the {words[(i + 1) % 6]} {i}"
        if i % 2:  # a paraphrase: the same words, reordered
            pairs.append(
                {
                    "a": base,
                    "b": base.replace("how do I", "what is the way to"),
                    "same_answer": True,
                }
            )
        else:  # a trap: one content word swapped
            pairs.append({"a": base, "b": base.replace(words[i % 6], "zeta"), "same_answer": False})
        sims.append(float(rng.uniform(0.85, 0.99)))
    model, report = train(pairs, sims, 0.9, 0.0)
    served = [
        s >= 0.9 and model.verify(p["a"], p["b"], s)[0] for p, s in zip(pairs, sims, strict=True)
    ]
    false_hits = sum(ok and not p["same_answer"] for ok, p in zip(served, pairs, strict=True))
    assert false_hits == 0 and report["false_hit_rate"] == 0.0
    assert (
        report["recall"]
        == sum(ok and p["same_answer"] for ok, p in zip(served, pairs, strict=True)) / 60
    )
    assert report["recall"] > 0.3  # the swaps are learnable from the features


def test_the_shipped_model_loads_with_these_features() -> None:
    model = pair_model.load(pair_model.MODEL_FILE)
    assert model.weights.shape == (len(FEATURES),) and 0 < model.cut < 1
