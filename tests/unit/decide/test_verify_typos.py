"""Misspellings the cache must see through (decide/verify.py, round 2 of #52): vowel
slips, look-alike words, contractions without their apostrophe, a dropped article,
number words against digits, words run together; and the traps none of them may hide.

Example tests name pairs that pass or fail on one rule each; the properties check, over
the development sets' texts and generated variants, that a number, a negation or a
name is never respelt and that a trap (a changed number, a negation, a swapped name or
owner) never becomes the same question.
"""

from __future__ import annotations

import random
import re

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from support.paths import REPO
from switchyard.decide import pair_augment, pair_encoder
from switchyard.decide.calibrate import load_pairs
from switchyard.decide.verify import (
    _CONFUSED,
    _DROPPABLE,
    _FACT_WORDS,
    _NEGATIONS,
    _NUMBER_WORDS,
    _OWNER,
    _QUANTITY,
    _SPELT,
    _confusable,
    _dictionary,
    _directional,
    _doubling_slip,
    _known,
    _second_words,
    _vowel_slip,
    parse,
    respell,
    same_question,
    same_words,
    verify,
)

DATA = REPO / "data"
TRAINING = [p for name in pair_encoder.TRAINING_SETS for p in load_pairs(DATA / name)]
TEXTS = sorted({t for p in TRAINING for t in (p["a"], p["b"])})
# The trap kinds the cache must keep out whatever the spelling.
TRAP_KINDS = {"negation", "entity", "entity_swap", "number", "numbers_versions", "date", "scope"}
TRAPS = [(p["a"], p["b"]) for p in TRAINING if p.get("category") in TRAP_KINDS]


# -- vowel slips -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("a", "b", "word"),
    [
        (
            "Is the Great Wall visible from space?",
            "is the great wall visable from space",
            "visible",
        ),
        ("How do I bleed a radiator?", "how do i bleed a radiater", "radiator"),
        ("What is the derivative of sin x?", "whats the derivitive of sin x", "derivative"),
        ("Is a calendar year 365 days?", "is a calender year 365 days", "calendar"),
        # Neither in the first list; the second knows the right one.
        ("Can I take ibuprofen with coffee?", "can i take ibuprofin with coffee", "ibuprofen"),
    ],
)
def test_a_vowel_slip_is_read_as_the_other_prompts_word(a: str, b: str, word: str) -> None:
    new, cached = respell(b, a)
    assert word in new.lower().split() and new.lower() != b.lower()
    assert cached == a  # the side spelt right is kept
    assert same_question(b, a) and same_question(a, b)
    assert verify(b, a) == (True, "ok")


@pytest.mark.parametrize(
    ("a", "b"),
    [
        ("Which foods contain nitrate?", "Which foods contain nitrite?"),  # two words
        ("Explain microeconomics", "Explain macroeconomics"),  # neither list knows one
        ("What causes lumber prices to rise?", "What causes lumbar prices to rise?"),  # a
        # rare word the first list lacks and the second knows
        ("Is a college degree worth it?", "Is a collage degree worth it?"),
        ("Ask Maria about it", "Ask Marie about it"),  # names are compared as written
        ("Which is bigger, a mile or a kilometre?", "Which is bigger, a mole or a kilometre?"),
    ],
)
def test_what_a_vowel_slip_could_not_be_is_left_as_written(a: str, b: str) -> None:
    assert respell(a, b) == (a, b)
    assert not same_question(a, b)


def test_a_vowel_slip_two_words_could_be_is_read_as_neither() -> None:
    dictionary = _dictionary() or frozenset()
    # "bant": "bent", "bunt", "bint"... (and short words are never vowel slips).
    assert not _vowel_slip("banter", "bunter", dictionary)
    # Unique, unknown to both lists: read.
    assert _vowel_slip("radiater", "radiator", dictionary)
    # The misspelt word is one the second list knows: never.
    assert not _vowel_slip("lumbar", "lumber", dictionary)


@pytest.mark.parametrize(
    ("a", "b", "word"),
    [
        ("Can you recommend a good book?", "can you reccomend a good book", "recommend"),
        ("Why did the ending disappoint fans?", "why did the ending dissapoint fans", "disappoint"),
        ("Is it raining tomorrow?", "is it raining tommorow", "tomorrow"),  # a listed word
    ],
)
def test_letters_doubled_and_undoubled_are_read_as_the_other_prompts_word(
    a: str, b: str, word: str
) -> None:
    assert word in respell(b, a)[0].split()
    assert same_question(a, b) and verify(a, b) == (True, "ok")


@pytest.mark.parametrize(
    ("a", "b"),
    [
        ("Is the diner open late?", "Is the dinner open late?"),  # two words
        ("Ask Anna about it", "Ask Ana about it"),  # names
    ],
)
def test_what_doubling_could_not_be_is_left_as_written(a: str, b: str) -> None:
    assert respell(a, b) == (a, b)
    assert not same_question(a, b)


def test_a_doubling_slip_is_a_word_no_list_knows_and_squeezes_to_one() -> None:
    assert _doubling_slip("reccomend", "recommend")
    assert not _doubling_slip("dinner", "diner")  # a word
    assert not _doubling_slip("reccomend", "recommends")  # squeezes otherwise


def _doubled(word: str, rng: random.Random) -> str:
    """The word with two of its letters (past the first) doubled or undoubled."""
    out = word
    for _ in range(2):
        i = rng.randrange(1, len(out))
        if i + 1 < len(out) and out[i] == out[i + 1]:
            out = out[:i] + out[i + 1 :]
        else:
            out = out[:i] + out[i] + out[i:]
    return out


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(TEXTS), st.integers(0, 2**32 - 1))
def test_a_doubling_slip_nothing_else_could_be_is_the_same_question(text: str, seed: int) -> None:
    """Equivalence: a text against a copy with letters of one word doubled or
    undoubled twice, where that misspelling is in neither list and squeezes to no
    other word either knows: the same question, the same verdict."""
    rng = random.Random(seed)
    dictionary = _dictionary() or frozenset()
    words = [
        m
        for m in pair_augment._changeable(text)
        if len(m.group(0)) >= 5
        and m.group(0) in dictionary
        and not re.match(r"['\w]", text[m.end() : m.end() + 1])
        and not re.match(r"['\w]", text[m.start() - 1 : m.start()] if m.start() else "")
    ]
    assume(words)
    m = rng.choice(words)
    slipped = _doubled(m.group(0), rng)
    assume(_doubling_slip(slipped, m.group(0)))
    other = text[: m.start()] + slipped + text[m.end() :]
    assert same_question(text, other) and same_question(other, text), (text, other)
    assert verify(text, other) == verify(text, text)


def test_the_second_word_list_comes_from_the_local_models_wheel() -> None:
    words = _second_words()
    assert words is not None and len(words) > 15_000
    assert {"ibuprofen", "lumbar", "warranty", "radiator"} <= words
    assert "ibuprofin" not in words and "radiater" not in words


# -- contractions, informal spellings, numbers, joined words, a dropped small word ------


@pytest.mark.parametrize(
    ("a", "b"),
    [
        ("What is the capital of Mongolia?", "whats the capital of mongolia"),
        ("I am 24. How do I improve my credit score?", "im 24 how do i improve my credit score"),
        ("I do not understand: why?", "i dont understand why"),
        ("Why do onions make you cry?", "why do onions make u cry"),
        ("Is it okay to run daily?", "is it ok to run daily"),
        ("What is an API?", "wat is an api"),
        ("Is there a fee if I pay two days late?", "is there a fee if i pay 2 days late"),
        ("Is 2,000 steps enough?", "is 2000 steps enough"),
        ("My six-year-old asked why.", "my 6-year-old asked why"),
        ("How does the stock market work?", "how does the stockmarket work??"),
        ("Quelle est la capitale de l'Australie ?", "quelle est la capitale de l australie"),
        ("How do I set up Wi-Fi?", "how do i set up wifi"),
        ("What is the capital of Mongolia?", "what the capital of mongolia"),
        ("Can I pay with a credit card?", "can i pay with credit card"),
        ("What is the capital of Mongolia?", "what the capital mongolia"),  # two dropped
        ("What are the symptoms of flu?", "what is the symptoms of flu"),  # a slip
        ("Does it work offline?", "do it work offline"),
    ],
)
def test_one_question_written_twice(a: str, b: str) -> None:
    assert same_words(a, b) and same_words(b, a)
    assert same_question(a, b) and same_question(b, a)


@pytest.mark.parametrize(
    ("a", "b"),
    [
        ("Is there a fee if I pay two days late?", "is there a fee if i pay 3 days late"),
        ("Ship in 3-5 days?", "ship in 35 days"),
        ("Does nobody use it?", "does no body use it"),  # "no" is never joined
        ("Can I pay with my credit card?", "can i pay with credit card"),  # an owner
        ("Can I pay with all credit cards?", "can i pay with credit cards"),  # a quantifier
        ("Is it not safe?", "is it safe"),  # a negation is never a small word
        ("What is the capital of Mongolia?", "what capital mongolia"),  # three dropped
        ("Is the rash a symptom?", "rash symptom?"),  # "is", "the" and "a": three
        ("Is the rash a symptom?", "are rash symptom?"),  # two dropped and a slip
        ("How do I reset a password?", "how do i reset the password"),  # not dropped
    ],
)
def test_what_is_not_one_question_written_twice(a: str, b: str) -> None:
    assert not same_words(a, b) and not same_words(b, a)
    assert not same_question(a, b)


def test_a_bare_contraction_is_not_respelt_as_a_shorter_word() -> None:
    # "whats" is "what is", not a misspelling of "what" (which drops the "is").
    assert respell("whats the time in Oslo", "What is the time in Oslo?")[0] == (
        "whats the time in Oslo"
    )


def test_only_small_words_are_droppable() -> None:
    assert not _DROPPABLE & (_NEGATIONS | set(_OWNER) - {"a", "an"} | set(_QUANTITY))
    assert not _DROPPABLE & set(_NUMBER_WORDS)


# -- look-alike words ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("a", "b"),
    [
        ("What is the capital of Mongolia?", "what is the capitol of mongolia"),
        ("How often should I replace my brakes?", "how often should i replace my breaks"),
        ("Is a Mac better than a PC for coding?", "is a mac better then a pc for coding"),
        ("What happens if I lose my job?", "what happens if i loose my job"),
    ],
)
def test_a_look_alike_is_read_as_the_other_prompts_word(a: str, b: str) -> None:
    assert same_question(a, b) and same_question(b, a)
    assert verify(a, b) == (True, "ok")


def test_a_capitalised_look_alike_is_a_name() -> None:
    a, b = "How old is the Capitol in Washington?", "How old is the capital in Washington?"
    assert respell(a, b) == (a, b)
    assert not same_question(a, b)


def test_no_look_alike_is_a_word_the_checks_compare() -> None:
    for pair in _CONFUSED:
        assert not pair & _FACT_WORDS, pair
        assert not all(_directional(w) for w in pair), pair
    listed = {frozenset(("than", "then")), frozenset(("capital", "capitol"))}
    assert listed <= _CONFUSED
    # What the filter turns away: a negation, a number, an owner, a question word, a
    # unit, a date, a name, two direction words.
    for x, y in (
        ("know", "no"),
        ("to", "two"),
        ("their", "there"),
        ("were", "where"),
        ("weak", "week"),
        ("sundae", "sunday"),
        ("pairs", "paris"),
        ("accept", "decline"),
    ):
        assert not _confusable(x, y) and not _confusable(y, x), (x, y)
    assert _confusable("capitol", "capital") and _confusable("loose", "lose")


@pytest.mark.parametrize(
    ("a", "b", "reason"),
    [
        ("Is the museum open on Monday?", "is the museum open on mondey", None),
        ("Is the museum open on Monday?", "is the musuem not open on monday", "veto: negation"),
        ("Is a Mac better than a PC?", "is a mac worse then a pc", "veto: comparison"),
        ("Does the capital have 3 airports?", "does the capitol have 4 airports", "veto: number"),
        (
            "What is the capital of Austria?",
            "whats the capitol of australia",
            "veto: entity austria != australia",
        ),
        ("Can I cancel my order?", "can i cancel their order", "veto: scope"),
    ],
)
def test_new_readings_do_not_hide_a_trap(a: str, b: str, reason: str | None) -> None:
    ok, why = verify(a, b)
    if reason is None:
        assert ok
    else:
        assert not ok and why.startswith(reason), why
        assert not same_question(a, b)


# -- properties ---------------------------------------------------------------------------

_NUMBERS = ["2", "3", "15", "two", "three", "fifteen", "2024", "10%"]
_NEGS = ["not", "no", "never", "without", "dont", "doesnt", "can't", "isnt"]
_NAMES = ["Maria", "Marie", "Python", "Paris", "Austria", "Australia", "Kasia"]
_PLAIN = [
    "what",
    "whats",
    "is",
    "the",
    "a",
    "capital",
    "capitol",
    "visible",
    "visable",
    "radiator",
    "radiater",
    "brakes",
    "breaks",
    "stock",
    "market",
    "stockmarket",
    "my",
    "your",
    "of",
    "to",
    "too",
    "then",
    "than",
    "acount",
    "account",
    "im",
    "u",
    "you",
]
_PROMPT = st.lists(st.sampled_from(_NUMBERS + _NEGS + _NAMES + _PLAIN), min_size=2, max_size=9)


def _kept(text: str) -> tuple[object, ...]:
    p = parse(text)
    negations = sum(t in _NEGATIONS for t in p.tokens)
    names = sorted(w for w in _SPELT.findall(text) if w[:1].isupper())
    return (p.facts.numbers, negations, names)


@settings(max_examples=500, deadline=None)
@given(_PROMPT, _PROMPT)
def test_numbers_negations_and_names_are_never_respelt(a: list[str], b: list[str]) -> None:
    """Whatever the two prompts hold, respelling leaves each one's numbers, negations
    and capitalised names as they were."""
    x, y = " ".join(a), " ".join(b)
    for before, after in zip((x, y), respell(x, y), strict=True):
        assert _kept(before) == _kept(after), (x, y, respell(x, y))


def _make_trap(text: str, rng: random.Random) -> str | None:
    """The text with one thing a check compares changed: a number, a negation added,
    a weekday, an owner; None when the text has none of them to change."""
    ways = []
    m = re.search(r"\b\d+\b", text)
    if m:
        ways.append(text[: m.start()] + str(int(m.group(0)) + 1) + text[m.end() :])
    m = re.search(r"\b(is|are|can|does|do|should)\b", text, re.IGNORECASE)
    if m:
        ways.append(text[: m.end()] + " not" + text[m.end() :])
    m = re.search(r"\bmy\b", text)
    if m:
        ways.append(text[: m.start()] + "their" + text[m.end() :])
    m = re.search(r"\b(Monday|Friday|June|July)\b", text)
    if m:
        other = {"Monday": "Tuesday", "Friday": "Sunday", "June": "July", "July": "June"}
        ways.append(text[: m.start()] + other[m.group(0)] + text[m.end() :])
    return rng.choice(ways) if ways else None


@settings(max_examples=400, deadline=None)
@given(st.sampled_from(TEXTS), st.integers(0, 2**32 - 1))
def test_a_made_trap_never_becomes_the_same_question(text: str, seed: int) -> None:
    """A text against itself with a number changed, a negation added or an owner or a
    day swapped, and misspelt any way the generator knows (vowel slips, look-alikes,
    dropped small words, contractions, digits): never the same question, and vetoed
    by the rules whenever the trap spelt right is."""
    rng = random.Random(seed)
    trap = _make_trap(text, rng)
    assume(trap is not None)
    assert trap is not None
    misspelt = pair_augment.typo(trap, rng)
    assert not same_question(text, misspelt), (text, misspelt)
    assert not same_words(*respell(text, misspelt)), (text, misspelt)
    if not verify(text, trap)[0]:  # a trap the rules catch spelt right, caught misspelt
        assert not verify(text, misspelt)[0], (text, trap, misspelt)


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(TRAPS), st.integers(0, 2**32 - 1))
def test_a_writers_trap_misspelt_never_becomes_the_same_question(
    pair: tuple[str, str], seed: int
) -> None:
    """The development sets' negation, entity, number, date and scope traps, one side
    misspelt: never one question once respelt, whatever the verdict of the rest."""
    rng = random.Random(seed)
    a, b = pair if rng.random() < 0.5 else pair[::-1]
    misspelt = pair_augment.typo(b, rng)
    assert not same_question(a, misspelt), (a, misspelt)


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(TEXTS), st.integers(0, 2**32 - 1))
def test_a_vowel_slip_nothing_else_could_be_is_the_same_question(text: str, seed: int) -> None:
    """Equivalence: a text against a copy with one vowel slipped, in a word at least
    five letters long, where the slip is in neither word list and one vowel from no
    other word either knows: the same question."""
    rng = random.Random(seed)
    dictionary = _dictionary() or frozenset()
    words = [  # whole words, not in quotes: a quoted string is compared as written
        m
        for m in pair_augment._changeable(text)
        if len(m.group(0)) >= 5
        and m.group(0) in dictionary
        and not re.match(r"['\w]", text[m.end() : m.end() + 1])  # a whole word ("déranger")
        and not re.match(r"['\w]", text[m.start() - 1 : m.start()] if m.start() else "")
    ]
    assume(words)
    m = rng.choice(words)
    slipped = pair_augment.vowel_slip(m.group(0), rng)
    assume(slipped != m.group(0) and _vowel_slip(slipped, m.group(0), dictionary))
    other = text[: m.start()] + slipped + text[m.end() :]
    assert same_question(text, other) and same_question(other, text), (text, other)
    assert verify(text, other) == verify(text, text)


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(TEXTS), st.integers(0, 2**32 - 1))
def test_respelling_keeps_the_rules_facts_under_every_generated_typo(text: str, seed: int) -> None:
    """Whatever typo the generator makes, the respelt text holds the numbers,
    negations and known names of the text it came from."""
    rng = random.Random(seed)
    misspelt = pair_augment.typo(text, rng)
    _, respelt = respell(text, misspelt)
    p, q = parse(text), parse(respelt)
    assert p.facts.numbers == q.facts.numbers
    assert sum(t in _NEGATIONS for t in p.tokens) == sum(t in _NEGATIONS for t in q.tokens)
    assert set(_known(p)) <= set(_known(q)) | set(_known(parse(misspelt)))


# -- a word both prompts write -------------------------------------------------------------


def test_a_misspelling_of_a_word_both_write_is_respelt() -> None:
    a = "I've had hiccups all day. What causes hiccups?"
    b = "ive had hiccups all day. what causes hicups"
    assert respell(b, a)[0] == "ive had hiccups all day. what causes hiccups"
    assert same_question(a, b)


@pytest.mark.parametrize(
    ("a", "b"),
    [
        # "charge" is a word: not a misspelling of the "charger" both write.
        (
            "How long to charge it with a 20W charger?",
            "how long to churge it with a 20W charger",
        ),
        # "effect" is a word: not the "affect" both write.
        ('affect or effect: "The new price"', 'affect or effict: "The new price"'),
    ],
)
def test_a_word_spelt_right_is_not_read_as_a_word_both_write(a: str, b: str) -> None:
    new, cached = respell(b, a)
    assert cached == a  # before the fix: "charge" was written "charger" here
    assert same_words(new, cached)  # and the slip read as the word spelt right


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(TEXTS), st.data())
def test_a_content_word_left_out_is_another_question(text: str, data: st.DataObject) -> None:
    """Only the listed small words may be left out: without any other word (not one
    run together with a neighbour), never one question written twice."""
    words = text.split()
    assume(len(words) >= 3)
    k = data.draw(st.integers(0, len(words) - 1))
    word = re.sub(r"[^\w']", "", words[k]).lower().replace("'", "")
    assume(word and word not in _DROPPABLE and word.isalpha())
    # Not a word its neighbour repeats, nor one half of a word the text also writes
    # joined ("back up ... backup"): those are still the same words.
    assume(all(word not in re.sub(r"[^\w]", "", w).lower() for j, w in enumerate(words) if j != k))
    shorter = " ".join(words[:k] + words[k + 1 :])
    assert not same_words(text, shorter), (text, shorter)


@pytest.mark.parametrize(
    ("text", "misspelt"),
    [
        ("Can I transfer my domain?", "Can I transfer their doaun?"),
        (
            "How much does roaming cost inside the EU on my plan?",
            "How much does roaming cost inside the EU on their plun?",
        ),
    ],
)
def test_an_owner_swapped_on_a_misspelt_noun_is_still_a_scope_trap(
    text: str, misspelt: str
) -> None:
    """Found by the property above in CI: whose the noun is differs, and the noun is
    spelt so that no respelling brings it back; the nouns only one side writes are
    paired in order, so the owners still meet."""
    assert verify(text, misspelt) == (False, "veto: scope my != their")
