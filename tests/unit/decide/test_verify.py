"""The semantic cache's hit verifier, on the shipped labelled set and on named examples.

Every trap category must be vetoed under its own name (an operator reads the reason to
see why a hit was refused), and true paraphrases must mostly pass: each false veto costs
a model call the cache could have saved.
"""

from __future__ import annotations

import json
import random
from collections import Counter, defaultdict
from typing import Any

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from support.paths import REPO
from switchyard.decide.pair_augment import _PROTECTED, slip, typo
from switchyard.decide.verify import (
    _NEGATIONS,
    _SPELT,
    _dictionary,
    _known,
    parse,
    respell,
    same_words,
    verify,
)

PAIRS_FILE = REPO / "data" / "cache_pairs.jsonl"
TRAP_CATEGORIES = {
    "negation",
    "number",
    "date",
    "entity",
    "unit",
    "scope",
    "antonym",
    "comparison",
    "quoted",
}
# "topic" pairs (same subject, different question) are there for the threshold: they
# differ in no way the verifier looks for, so their veto rate is not asserted.
THRESHOLD_ONLY = {"topic"}


def shipped_pairs() -> list[dict[str, Any]]:
    return [json.loads(line) for line in PAIRS_FILE.read_text().splitlines() if line.strip()]


def by_category() -> dict[str, list[dict[str, Any]]]:
    groups: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for pair in shipped_pairs():
        groups[pair["category"]].append(pair)
    return groups


def test_shipped_set_shape() -> None:
    pairs = shipped_pairs()
    groups = by_category()
    assert len(pairs) >= 320
    assert set(groups) == TRAP_CATEGORIES | THRESHOLD_ONLY | {"paraphrase"}
    assert all(len(groups[c]) >= 20 for c in TRAP_CATEGORIES)
    assert 0.40 <= len(groups["paraphrase"]) / len(pairs) <= 0.50
    assert all(p["same_answer"] == (p["category"] == "paraphrase") for p in pairs)
    assert len({(p["a"], p["b"]) for p in pairs}) == len(pairs)
    assert all(p["a"] != p["b"] for p in pairs)


@pytest.mark.parametrize("category", sorted(TRAP_CATEGORIES))
def test_each_trap_category_is_vetoed_under_its_name(category: str) -> None:
    pairs = by_category()[category]
    reasons = [(p["a"], p["b"], verify(p["a"], p["b"])[1]) for p in pairs]
    misses = [r for r in reasons if not r[2].startswith(f"veto: {category}")]
    assert 1 - len(misses) / len(pairs) >= 0.90, misses


def test_paraphrases_are_rarely_vetoed() -> None:
    pairs = by_category()["paraphrase"]
    vetoed = [(p["a"], p["b"], verify(p["a"], p["b"])[1]) for p in pairs]
    vetoed = [v for v in vetoed if v[2] != "ok"]
    assert len(vetoed) / len(pairs) <= 0.05, vetoed


def test_verdict_does_not_depend_on_order() -> None:
    for p in shipped_pairs():
        assert verify(p["a"], p["b"])[0] == verify(p["b"], p["a"])[0], (p["a"], p["b"])


@pytest.mark.parametrize(
    ("a", "b", "reason"),
    [
        ("Can I add 3 users to my plan?", "Can I add 5 users to my plan?", "veto: number 3 != 5"),
        ("Is there a 10% discount?", "Is there a 20% discount?", "veto: number 10% != 20%"),
        ("How many calories are in two eggs?", "How many in three eggs?", "veto: number 2 != 3"),
        ("Can I cancel my order?", "Can't I cancel my order?", "veto: negation"),
        ("Install it with sudo", "Install it without sudo", "veto: negation"),
        (
            "Is the store open on Monday?",
            "Is the store open on Friday?",
            "veto: date monday != friday",
        ),
        ("Taxes in 2024?", "Taxes in 2025?", "veto: date 2024 != 2025"),
        (
            "Move my booking from March 3",
            "Move my booking from March 5",
            "veto: date march 3 != march 5",
        ),
        ("Book the room for 3pm", "Book the room for 5pm", "veto: date 15:00 != 17:00"),
        (
            "What's the population of Paris?",
            "What's the population of Berlin?",
            "veto: entity paris != berlin",
        ),
        (
            "How do I read a file in Python?",
            "How do I read a file in Java?",
            "veto: entity python != java",
        ),
        ("Who wrote Hamlet?", "Who wrote Macbeth?", "veto: entity hamlet != macbeth"),
        ("How long is a 5 km walk?", "How long is a 5 miles walk?", "veto: unit km != miles"),
        ("Can I upload 2 GB?", "Can I upload 2 MB?", "veto: unit gb != mb"),
        ("What's the price in USD?", "What's the price in EUR?", "veto: unit usd != eur"),
        ("Convert 10 liters to gallons.", "Convert 10 gallons to liters.", "veto: unit l != gal"),
        ("How do I delete my account?", "How do I delete an account?", "veto: scope my != an"),
        ("Can I see my invoices?", "Can I see your invoices?", "veto: scope my != your"),
        (
            "Do all plans include support?",
            "Do any plans include support?",
            "veto: scope all != any",
        ),
        (
            "How do I reset my password?",
            "How do I reset a user's password?",
            "veto: scope my != their",
        ),
        (
            "How do I increase my limit?",
            "How do I decrease my limit?",
            "veto: antonym increase != decrease",
        ),
        ("How do I open a port?", "How do I close a port?", "veto: antonym open != close"),
        ("Take it before meals?", "Take it after meals?", "veto: antonym before != after"),
        ("How do I mute the chat?", "How do I unmute the chat?", "veto: antonym mute != unmute"),
        (
            "Is Python faster than Java?",
            "Is Python slower than Java?",
            "veto: comparison faster != slower",
        ),
        (
            "Which plan has more storage?",
            "Which plan has less storage?",
            "veto: comparison more != less",
        ),
        (
            "Is it cheaper yearly?",
            "Is it more expensive yearly?",
            "veto: comparison cheaper != pricier",
        ),
        ("How do I open 'a.txt'?", "How do I open 'b.txt'?", "veto: quoted 'a.txt' != 'b.txt'"),
        (
            "Delete config.yaml from git",
            "Delete secrets.yaml from git",
            "veto: quoted 'config.yaml' != 'secrets.yaml'",
        ),
        (
            'What does "card declined" mean?',
            'What does "card expired" mean?',
            "veto: quoted 'card declined' != 'card expired'",
        ),
        ("Who wrote Hamlet?", "When was Hamlet written?", "veto: question who != when"),
        (
            "Why was card <CARD_1> declined?",
            "Why was card <CARD_2> declined?",
            "veto: quoted '<card_1>' != '<card_2>'",
        ),
    ],
)
def test_named_vetoes(a: str, b: str, reason: str) -> None:
    assert verify(a, b) == (False, reason)


@pytest.mark.parametrize(
    ("a", "b"),
    [
        ("I can't log in.", "I cannot sign in."),
        ("I can't log in to my account.", "I'm unable to log into my account."),
        ("Why doesn't my code compile?", "My code won't compile, why?"),
        ("What is 15% of 200?", "How much is 15 percent of 200?"),
        ("Was I charged twice?", "Was I charged two times?"),
        ("Convert 5 km to miles", "What is 5 kilometers in miles?"),
        ("Is 8 GB of RAM enough?", "Will 8GB RAM be sufficient?"),
        ("Meetings on March 5?", "Meetings on March 5th?"),
        ("Is the shop open on Sunday?", "Are you open on Sundays?"),
        ("My usage this month?", "My usage for the current month?"),
        ("Python: how do I reverse a list?", "How do I reverse a list in python?"),
        ("Hello! Quick question: how do I change my address?", "How can I change my address?"),
        ("Which city is France's capital?", "What is the capital of France?"),
        ("What is the GDP of the United States?", "How big is the US economy?"),
        ("How do I update my plan?", "How can I update the plan on my account?"),
        ("How do I turn on dark mode?", "How can I enable dark mode?"),
        ("Is a refund possible within 30 days?", "Can I get my money back within 30 days?"),
        ("What does the 'self' keyword do?", "What is 'self' for?"),
        ("How do I open config.yaml?", "What's the way to open the config.yaml file?"),
        ("Can I have more than one account?", "Can I have multiple accounts?"),
        ("Mail <EMAIL_1> or call <PHONE_1>", "Call <PHONE_1> or mail <EMAIL_1>"),
    ],
)
def test_paraphrase_examples_pass(a: str, b: str) -> None:
    assert verify(a, b) == (True, "ok")


@pytest.mark.parametrize("text", ["", "   ", "?!", "\u201cquoted\u201d \u2014 dash", "5", "'"])
def test_odd_inputs_do_not_raise(text: str) -> None:
    assert verify(text, text) == (True, "ok")
    assert isinstance(verify(text, "How do I reset my password?")[1], str)


# -- misspellings ------------------------------------------------------------------------
# A word one prompt misspells is read as the other prompt's word before the checks run;
# numbers, negations, names and two words both spelt right are never taken for each other.


@pytest.mark.parametrize(
    ("a", "b"),
    [
        (
            "How do I change the email address on my account?",
            "How do I chnage the email adress on my acount?",
        ),
        ("Does the night bus run on Saturdays?", "Does the night bus run on Saturdys?"),
        ("Is the clinic open in February?", "is the clinic open in Febuary"),
        ("Can I get a vegetarian meal on the flight?", "Can I get a vegetrian meal on the flight?"),
        ("How do I request a repeat prescription?", "How do I reqest a repeat perscription?"),
        ("What colour should I paint a small room?", "What color should I paint a small room?"),
        ("How far is it in kilometres?", "How far is it in kilometers?"),
        ("What tyre pressure for a road bike?", "What tire pressure for a road bike?"),
        ("I don't know how to start. What's first?", "I dont know how to start. Whats first?"),
        ("Is it ok to run it twice?", "Is it okay to run it twice?"),
        ("How do I sort a list in Python?", "how do i sort a list in pyhton"),
        ("What is Schrödinger's cat?", "what is schrodingers cat"),
        ("How does photosynthesis work?", "how does photosythesis work"),
    ],
)
def test_typo_only_near_repeats_pass(a: str, b: str) -> None:
    assert verify(a, b) == (True, "ok")
    assert verify(b, a) == (True, "ok")
    assert same_words(*respell(a, b))


@pytest.mark.parametrize(
    ("a", "b", "reason"),
    [
        # A misspelling one slip from two months is read as neither.
        ("Is the pool open in June?", "Is the pool open in Jule?", "veto: date june != -"),
        # Two names, both spelt right: a swap, however close.
        (
            "What is the capital of Austria?",
            "What is the capital of Australia?",
            "veto: entity austria != australia",
        ),
        # Negations and numbers are compared as written.
        (
            "Have you ever been charged twice?",
            "Have you never been charged twice?",
            "veto: negation",
        ),
        (
            "Why does my toddler eat vegetables?",
            "Why doesnt my toddler eat vegetables?",
            "veto: negation",
        ),
        ("Is fifteen minutes enough?", "Is fiften minutes enough?", "veto: number 15 != -"),
        # A typo elsewhere does not hide the trap.
        (
            "How do I enable the acount lock?",
            "How do I disable the account lock?",
            "veto: antonym enable != disable",
        ),
    ],
)
def test_misspellings_do_not_hide_a_trap(a: str, b: str, reason: str) -> None:
    assert verify(a, b) == (False, reason)


@pytest.mark.parametrize(
    ("a", "b"),
    [
        ("Which foods contain nitrate?", "Which foods contain nitrite?"),  # a vowel: a word
        ("Explain microeconomics", "Explain macroeconomics"),  # neither in the dictionary
        ("How do I fill in the form?", "How do I fill in the from?"),  # two words
        ("Is MySQL faster here?", "Is MSSQL faster here?"),  # a known name
        ("Ask Maria about it", "Ask Marie about it"),  # names are compared as written
    ],
)
def test_what_is_not_a_misspelling_is_left_as_written(a: str, b: str) -> None:
    assert respell(a, b) == (a, b)


def _pairs(*names: str) -> list[tuple[str, str]]:
    data = REPO / "data"
    return [
        (p["a"], p["b"])
        for name in names
        for line in (data / name).read_text().splitlines()
        if line.strip()
        for p in [json.loads(line)]
    ]


PAIRS = _pairs("cache_pairs.jsonl", "cache_pairs_dev2.jsonl")


def _slip_a_shared_word(a: str, b: str, rng: random.Random) -> str | None:
    """b with one slip in a word both prompts write once each, spelt right, that the
    rules do not compare; None when there is none, or the slip makes a word."""
    dictionary = _dictionary() or frozenset()
    count_a = Counter(w.lower() for w in _SPELT.findall(a))
    found = [
        m
        for m in _SPELT.finditer(b)
        if m.group(0).islower()
        and len(m.group(0)) >= 5
        and count_a[m.group(0)] == 1
        and sum(w == m.group(0) for w in _SPELT.findall(b)) == 1
        and m.group(0) in dictionary
        and m.group(0) not in _PROTECTED
    ]
    if not found:
        return None
    m = rng.choice(found)
    slipped = slip(m.group(0), rng)
    if slipped in dictionary or slipped.lower() in {w.lower() for w in _SPELT.findall(a + " " + b)}:
        return None
    return b[: m.start()] + slipped + b[m.end() :]


@settings(max_examples=400, deadline=None)
@given(st.sampled_from(PAIRS), st.integers(0, 2**32))
def test_a_slip_in_a_shared_word_changes_no_verdict(pair: tuple[str, str], seed: int) -> None:
    """Equivalence: a misspelt copy of a word the other prompt writes gets the verdict
    the correct spelling gets, whatever else the pair has in common or not."""
    a, b = pair
    slipped = _slip_a_shared_word(a, b, random.Random(seed))
    assume(slipped is not None)
    assert slipped is not None
    assert verify(a, slipped) == verify(a, b), (a, b, slipped)
    assert verify(slipped, a)[0] == verify(a, slipped)[0]


@settings(max_examples=400, deadline=None)
@given(st.sampled_from(PAIRS), st.integers(0, 2**32))
def test_respelling_never_changes_numbers_negations_or_names(
    pair: tuple[str, str], seed: int
) -> None:
    """Whatever is respelt (here on pairs with generated typos on both sides), the
    numbers and negations each prompt holds stay as they were, and so does every
    name spelt right: a misspelling may only become one."""
    rng = random.Random(seed)
    a, b = typo(pair[0], rng), typo(pair[1], rng)
    dictionary = _dictionary() or frozenset()
    for before, after in zip((a, b), respell(a, b), strict=True):
        p, q = parse(before), parse(after)
        assert p.facts.numbers == q.facts.numbers
        assert sum(t in _NEGATIONS for t in p.tokens) == sum(t in _NEGATIONS for t in q.tokens)
        assert set(_known(p)) <= set(_known(q))
        assert {n for n in p.caps if n in dictionary} <= set(q.caps)
