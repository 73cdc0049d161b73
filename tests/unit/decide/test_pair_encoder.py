"""The cache's cross-encoder (decide/pair_encoder.py) and the chain of candidate checks
(decide/candidate.py): the built model's verdicts on typed traps, the cut's choice,
what keys a build, and what a gateway does when the model is not built."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest

from support.pair_data import tiny_pair_data
from switchyard.config import CacheConfig, EmbeddingsConfig
from switchyard.decide import pair_encoder
from switchyard.decide.candidate import CandidateCheck, from_config
from switchyard.decide.verify import respell
from switchyard.embed import minilm_model_path

# (cached request, new request): one answer cannot serve both.
TRAPS = [
    ("How do I enable two-factor authentication?", "How do I disable two-factor authentication?"),
    ("Can I get a refund on my order?", "Why can't I get a refund on my order?"),
    ("How do I upload a file to S3 with Python?", "How do I download a file from S3 with Python?"),
    ("How many calories are in 100 grams of rice?", "How many calories are in 300 grams of rice?"),
    ("What is the capital of Australia?", "What is the capital of Austria?"),
    ("Convert 30 degrees Celsius to Fahrenheit", "Convert 30 degrees Fahrenheit to Celsius"),
    ("How do I sort a list in ascending order?", "How do I sort a list in descending order?"),
    (
        "Is it safe to take ibuprofen during pregnancy?",
        "Is it safe to take ibuprofen after surgery?",
    ),
]
# ...and the same question reworded: one answer serves both.
SAME = [
    ("How do I reset my password?", "how do i reset my pasword"),
    ("What's the best way to learn Spanish quickly?", "How can I learn Spanish fast?"),
    ("How do I delete a branch in git?", "git delete branch how"),
    ("Hi! Could you tell me how to cancel my subscription?", "How do I cancel my subscription?"),
]


@pytest.fixture(scope="module")
def chain() -> CandidateCheck:
    check = from_config(CacheConfig(), EmbeddingsConfig())
    # Built by `make install` (the Makefile's verifier target): its absence is a failure.
    assert check.unavailable is None, check.unavailable
    assert check.encoder is not None
    return check


@pytest.mark.parametrize(("cached", "new"), TRAPS)
def test_the_shipped_chain_vetoes_typed_traps(chain: CandidateCheck, cached: str, new: str) -> None:
    ok, why = chain(new, cached, 0.95)
    assert not ok, why
    assert why.startswith("veto")


@pytest.mark.parametrize(("cached", "new"), SAME)
def test_the_cross_encoder_passes_rewordings(chain: CandidateCheck, cached: str, new: str) -> None:
    assert chain.encoder is not None
    ok, why = chain.encoder.verify(cached, new, 0.95)
    assert ok, why


# (cached request, new request): the same question misspelt; the rules and the
# cross-encoder read the misspelt words as the other prompt writes them.
MISSPELT = [
    (
        "How do I change the email address on my account?",
        "how do i chnage the email adress on my acount",
    ),
    ("Does the night bus run on Saturdays?", "Does the night bus run on Saturdys?"),
    ("Can I get a vegetarian meal on the flight?", "can i get a vegetrian meal on the flight"),
    ("What colour should I paint a small room?", "What color should I paint a small room?"),
]
# ...and traps with misspellings in them: still traps, for the cross-encoder alone too.
MISSPELT_TRAPS = [
    ("How do I enable two-factor authentication?", "How do I disable two-factor authentcation?"),
    ("Is the pool open on Saturdays?", "Is the pool open on Sundys?"),
    ("Can I bring my bycicle on the train?", "Why can't I bring my bicycle on the train?"),
]


@pytest.mark.parametrize(("cached", "new"), MISSPELT)
def test_a_misspelt_repeat_is_served_without_a_forward_pass(
    chain: CandidateCheck, cached: str, new: str
) -> None:
    assert chain.encoder is not None
    assert chain.encoder.score(cached, new) == 1.0
    ok, why = chain(new, cached, 0.9)
    assert ok and why.endswith("(the same words once respelt)"), why


@pytest.mark.parametrize(("cached", "new"), MISSPELT_TRAPS)
def test_misspellings_do_not_hide_a_trap_from_the_cross_encoder(
    chain: CandidateCheck, cached: str, new: str
) -> None:
    assert chain.encoder is not None
    ok, why = chain.encoder.verify(cached, new, 0.95)
    assert not ok, why
    assert not chain(new, cached, 0.95)[0]


def test_the_score_is_the_models_probability_on_the_respelt_pair(chain: CandidateCheck) -> None:
    encoder = chain.encoder
    assert encoder is not None
    cached, new = "How do I export my contacts to Excel?", "How can I exprot my contacts to a CSV?"
    assert encoder.score(cached, new) == encoder.probability(*respell(cached, new))
    assert respell(cached, new)[1] == "How can I export my contacts to a CSV?"


def test_the_manifest_records_the_validation_that_chose_the_cuts(chain: CandidateCheck) -> None:
    assert chain.encoder is not None
    m = chain.encoder.manifest
    assert m["recipe"] == pair_encoder.RECIPE
    assert m["trained_on"] == list(pair_encoder.TRAINING_SETS)
    assert m["validated_on"] == pair_encoder.VALIDATION_SET
    assert set(m["cuts"]) == set(pair_encoder.CHAINS) == {"rules+model", "rules", "model", "none"}
    for cut in m["cuts"].values():
        assert cut["false_hit_rate"] <= pair_encoder.MAX_FALSE_HIT_RATE
    # The shipped chain's cut is the one chosen for what its cheaper checks let through.
    cfg = CacheConfig()
    name = pair_encoder.chain_name(cfg.verify, cfg.verify_model)
    assert chain.encoder.chain == name and chain.encoder.cut == m["cuts"][name]["cut"]
    assert m["train_pairs"] > 3 * m["validation_pairs"] > 0


def test_the_cut_is_the_lowest_within_the_limit_above_the_threshold() -> None:
    pairs = [{"same_answer": y} for y in (True, True, False, False, True)]
    sims = [0.95, 0.95, 0.95, 0.5, 0.95]
    probs = [0.9, 0.6, 0.7, 0.99, 0.3]
    # The trap at 0.7 must not pass: the lowest cut above it is 0.71; the trap at
    # 0.99 is below the threshold and does not count.
    got = pair_encoder.choose_cut(pairs, sims, probs, 0.9, 0.0)
    assert got == {"cut": 0.71, "false_hits": 0, "false_hit_rate": 0.0, "recall": 0.3333}
    # Allowing one false hit in two traps: the cut goes down to the lowest positive's.
    got = pair_encoder.choose_cut(pairs, sims, probs, 0.9, 0.5)
    assert got["cut"] == 0.05 and got["false_hits"] == 1 and got["recall"] == 1.0


def _data(tmp_path: Path) -> Path:
    d = tmp_path / "data"
    d.mkdir()
    for name in (*pair_encoder.TRAINING_SETS, pair_encoder.VALIDATION_SET, *pair_encoder.HELD_OUT):
        shutil.copy(pair_encoder.DATA_DIR / name, d / name)
    return d


def test_the_build_key_follows_the_data_including_the_held_out_files(tmp_path: Path) -> None:
    d = _data(tmp_path)
    files = pair_encoder.training_files(d)
    path = minilm_model_path()
    key = pair_encoder.build_key(path, files)
    assert key == pair_encoder.build_key(path, pair_encoder.training_files(pair_encoder.DATA_DIR))
    with (d / pair_encoder.TRAINING_SETS[1]).open("a") as f:
        f.write(json.dumps({"a": "x", "b": "y", "same_answer": False}) + "\n")
    changed = pair_encoder.build_key(path, files)
    assert changed != key
    (d / pair_encoder.HELD_OUT[0]).write_text("")
    again = pair_encoder.build_key(path, files)
    assert again != changed
    (d / pair_encoder.HELD_OUT[1]).write_text("")
    assert pair_encoder.build_key(path, files) != again


def test_pairs_sharing_a_text_with_the_held_out_set_are_not_trained_on(tmp_path: Path) -> None:
    d = tmp_path / "d"
    d.mkdir()

    def write(name: str, *pairs: tuple[str, str]) -> None:
        rows = [{"a": a, "b": b, "same_answer": True} for a, b in pairs]
        (d / name).write_text("".join(json.dumps(r) + "\n" for r in rows))

    write(pair_encoder.TRAINING_SETS[0], ("How do I reset my password?", "Reset steps?"))
    write(pair_encoder.TRAINING_SETS[1], ("What is a VPN?", "Explain VPNs"), ("Hi", "explain  DNS"))
    write(pair_encoder.VALIDATION_SET, ("What's DNS?", "Explain DNS"), ("x", "what is a vpn?"))
    write(pair_encoder.HELD_OUT[0], ("how do I   reset my PASSWORD?", "other"), ("x", "y"))
    write(pair_encoder.HELD_OUT[1], ("What is a VPN?", "z"))
    train, validation, dropped = pair_encoder.development_pairs(pair_encoder.training_files(d))
    # Both held-out sets' texts leave both; the validation texts leave training.
    assert [p["a"] for p in validation] == ["What's DNS?"]
    assert [p["a"] for p in train] == []
    assert dropped == 4


def test_without_the_built_encoder_semantic_hits_are_off_not_weaker(tmp_path: Path) -> None:
    check = from_config(CacheConfig(), EmbeddingsConfig(cache_dir=str(tmp_path)))
    assert check.encoder is None and check.unavailable is not None
    assert "build-verifier" in check.unavailable
    ok, why = check("How do I reset my password?", "How do I reset my password", 0.99)
    assert not ok and why.startswith("veto: ") and "not built" in why
    assert check.describe().startswith("semantic hits off")
    # Asked for without the encoder, the rules and the pair model alone decide.
    plain = from_config(
        CacheConfig(verify_encoder=False), EmbeddingsConfig(cache_dir=str(tmp_path))
    )
    assert plain.unavailable is None and plain.encoder is None
    assert plain("How do I reset my password?", "How can I reset my password?", 0.97)[0]


def test_the_character_bound_keeps_what_the_model_would_see(chain: CandidateCheck) -> None:
    """A huge message is cut before it is tokenised (a bound on its cost); what the
    128 tokens would hold is kept, even behind a long run of whitespace."""
    encoder = chain.encoder
    assert encoder is not None
    question = "How do I export my contacts to a CSV file?"
    padded = " " * 3000 + question + " tail" * 400_000
    assert encoder.probability("How do I export contacts?", padded) == encoder.probability(
        "How do I export contacts?", question + " tail" * 200
    )


def test_a_build_trains_exports_chooses_cuts_and_is_then_reused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The whole build on a tiny data set, one epoch: train, export, quantise, choose
    a cut per chain on the validation file, write the manifest; a second build and a
    recut reuse the model."""
    d = tmp_path / "data"
    tiny_pair_data(d)
    monkeypatch.setattr(pair_encoder, "EPOCHS", 1)
    out = tmp_path / "cache"
    path, manifest, built = pair_encoder.build(out, 0.7, data_dir=d)
    assert built and path.exists() and path.parent == out
    assert manifest["train_pairs"] == 16 and manifest["validation_pairs"] == 2
    assert set(manifest["cuts"]) == set(pair_encoder.CHAINS)
    assert not list(out.glob("*.building")) and not list(out.glob("*fp32*"))
    encoder = pair_encoder.load(out, "rules", d)
    assert encoder.cut == manifest["cuts"]["rules"]["cut"]
    assert 0.0 <= encoder.probability("a", "b") <= 1.0
    again = pair_encoder.build(out, 0.7, data_dir=d)
    assert again[2] is False and again[1]["key"] == manifest["key"]
    recut = pair_encoder.build(out, 0.8, data_dir=d, recut=True)
    assert recut[2] is False and recut[1]["threshold"] == 0.8


def test_an_epoch_is_every_pair_both_ways_and_variants_only_when_asked(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    pairs = [
        {"a": "How do I reset my password?", "b": "Reset my password, how?", "same_answer": True},
        {"a": "How do I enable 2FA?", "b": "How do I disable 2FA?", "same_answer": False},
    ] * 20
    both_ways = [(p["a"], p["b"], float(p["same_answer"])) for p in pairs]
    both_ways += [(b, a, y) for a, b, y in both_ways]
    assert pair_encoder._epoch_examples(pairs, random.Random(0)) == both_ways
    # With variants asked for (the recipe's constants, part of the build key), the
    # writers' pairs come first, then generated ones, each labelled as its pair.
    monkeypatch.setattr(pair_encoder, "VARIANT_SHARE", 0.5)
    monkeypatch.setattr(pair_encoder, "NEAR_REPEAT_SHARE", 0.1)
    examples = pair_encoder._epoch_examples(pairs, random.Random(0))
    assert examples[: len(both_ways)] == both_ways and len(examples) > len(both_ways)
    for a, b, y in examples[len(both_ways) :]:
        if "able 2FA" in a + b and a.rstrip("?") != b.rstrip("?"):
            assert y == (("enable" in a) == ("enable" in b)), (a, b, y)


def test_the_held_out_sets_share_no_text_with_training_or_validation() -> None:
    """The second test set (#52): another writer, 14 domains of its own, balanced, each
    kind of the issue present; no text of either test set in what the cross-encoder
    is trained or validated on, so the build drops nothing for them but by design."""
    from switchyard.decide.calibrate import load_pairs

    second = load_pairs(pair_encoder.DATA_DIR / pair_encoder.HELD_OUT[1])
    kinds = {p["category"] for p in second}
    assert {"typo", "paraphrase", "negation", "entity", "number", "date", "scope"} <= kinds
    assert sum(p["same_answer"] for p in second) * 2 == len(second) >= 200
    assert all(p["same_answer"] == (p["category"] in ("typo", "paraphrase")) for p in second)
    assert len({p["domain"] for p in second}) >= 12
    norm = pair_encoder._texts
    developed = norm(
        [
            p
            for name in (*pair_encoder.TRAINING_SETS, pair_encoder.VALIDATION_SET)
            for p in load_pairs(pair_encoder.DATA_DIR / name)
        ]
    )
    assert not norm(second) & developed
    domains = {
        p["domain"]
        for name in (
            *pair_encoder.TRAINING_SETS[1:],
            pair_encoder.VALIDATION_SET,
            pair_encoder.HELD_OUT[0],
        )
        for p in load_pairs(pair_encoder.DATA_DIR / name)
    }
    assert not {p["domain"] for p in second} & domains
