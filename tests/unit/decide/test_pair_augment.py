"""The cross-encoder's generated training variants (decide/pair_augment.py): labelled by
construction, so what the rules compare (numbers, dates, units, negations, known
names) must come through every typo and rewording unchanged, or a variant of a trap
would be trained on as the trap it no longer is."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from support.paths import REPO
from switchyard.decide import pair_augment, pair_encoder
from switchyard.decide.calibrate import load_pairs
from switchyard.decide.verify import _dictionary, _known, _one_typo, parse

DATA = REPO / "data"
TEXTS = sorted(
    {
        t
        for name in pair_encoder.TRAINING_SETS
        for p in load_pairs(DATA / name)
        for t in (p["a"], p["b"])
    }
)


def facts(text: str) -> tuple[object, ...]:
    """What the rules compare that a variant must keep."""
    p = parse(text)
    negations = sum(t in ("not", "no", "never", "without", "none", "nothing") for t in p.tokens)
    return (p.facts.dates, p.facts.units, p.facts.numbers, negations, sorted(_known(p)))


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(TEXTS), st.integers(0, 2**32 - 1))
def test_a_typo_keeps_what_the_rules_compare(text: str, seed: int) -> None:
    variant = pair_augment.typo(text, random.Random(seed))
    assert facts(variant) == facts(text), (text, variant)


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(TEXTS), st.integers(0, 2**32 - 1))
def test_a_rewording_keeps_what_the_rules_compare(text: str, seed: int) -> None:
    variant = pair_augment.reword(text, random.Random(seed))
    assert facts(variant) == facts(text), (text, variant)


@settings(max_examples=300, deadline=None)
@given(st.sampled_from([t for t in TEXTS if pair_augment._changeable(t)]), st.integers(0, 2**32))
def test_a_slip_is_one_typo_past_the_first_letter(text: str, seed: int) -> None:
    rng = random.Random(seed)
    word = rng.choice(pair_augment._changeable(text)).group(0)
    slipped = pair_augment.slip(word, rng)
    assert slipped != word and slipped[0] == word[0]
    assert _one_typo(slipped, word) and _one_typo(word, slipped)


def test_variants_keep_the_label_and_come_from_the_pairs() -> None:
    pairs = load_pairs(DATA / pair_encoder.TRAINING_SETS[1])[:300]
    made = pair_augment.augmented(pairs, random.Random(0), near_repeats=0.5)
    texts = {t for p in pairs for t in (p["a"], p["b"])}
    labels = {(p["a"], p["b"]): p["same_answer"] for p in pairs}
    labels |= {(b, a): y for (a, b), y in labels.items()}
    near = 0
    for v in made:
        assert v["a"] in texts and v["b"] != v["a"]
        partners = [y for (a, b), y in labels.items() if a == v["a"]]
        if v["same_answer"] and not any(partners):
            near += 1  # a text against its own variant: served
        else:
            assert v["same_answer"] in partners  # the label of a pair it came from
    assert len(made) >= len(pairs) and near > 0


def test_the_dictionary_is_the_embedding_models_vocabulary() -> None:
    words = _dictionary()
    assert words is not None and len(words) > 20_000
    assert {"account", "address", "saturday", "nitrate"} <= words
    assert not {"acount", "adress", "saturdys", "chnage"} & words
