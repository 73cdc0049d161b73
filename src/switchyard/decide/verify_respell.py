"""Misspellings: before anything is compared, a word one prompt misspells is read as the
word the other prompt writes.

"acount" / "account", "Saturdys" / "Saturdays", "colour" / "color": so a typo looks
neither like another entity, date or word nor like a missing one. Numbers, negations and
names are never respelt, and two words that are both spelt right are never taken for each
other ("June" / "July", "form" / "from"): only a word the dictionary does not know can be
a misspelling, but for a short listed set of look-alikes ("capitol" / "capital") none of
which is a word a check compares. A vowel for another ("visable") is a misspelling only
of the one word a vowel away that either word list knows, and only when neither knows
the misspelt word (`_vowel_slip`).
"""

from __future__ import annotations

import re
import unicodedata
from functools import lru_cache

from switchyard.decide.verify_lexicon import (
    _ANTONYMS,
    _COMPARISONS,
    _CONFUSED_PAIRS,
    _ENTITY_ALIASES,
    _FACT_WORDS,
    _KEYS,
    _LISTED,
    _MONTHS,
    _NAMED,
    _REGIONAL,
    _SPELLINGS,
    _STRICT,
    _UNITS,
    _WEEKDAYS,
)
from switchyard.decide.verify_parse import _lemma, _parse
from switchyard.decide.verify_vocab import _dictionary, _either_list, _second_words

_SPELT = re.compile(r"[^\W\d_]+(?:'[^\W\d_]+)*")


def _directional(word: str) -> bool:
    return _lemma(word, _ANTONYMS) is not None or _lemma(word, _COMPARISONS) is not None


def _confusable(x: str, y: str) -> bool:
    """A listed confusion both of whose words are free to be read as each other."""
    return (
        x not in _FACT_WORDS and y not in _FACT_WORDS and not (_directional(x) and _directional(y))
    )


# The listed look-alikes (verify_lexicon.toml) a check leaves free to be read as each other.
_CONFUSED = frozenset(frozenset(pair) for pair in _CONFUSED_PAIRS if _confusable(*pair))


def _one_typo(x: str, y: str) -> bool:
    """Whether one slip of the fingers turns one into the other: a letter dropped or
    doubled (or any one added), two neighbours swapped, or a key's neighbour struck.
    Not a vowel for another: "nitrite" / "nitrate" and "micro" / "macro" are words."""
    if len(x) == len(y):
        diffs = [i for i, (p, q) in enumerate(zip(x, y, strict=True)) if p != q]
        if len(diffs) == 1:
            return y[diffs[0]] in _KEYS.get(x[diffs[0]], frozenset())
        i = diffs[0] if len(diffs) == 2 else -1
        return i >= 0 and diffs[1] == i + 1 and x[i] == y[i + 1] and x[i + 1] == y[i]
    long, short = (x, y) if len(x) > len(y) else (y, x)
    if len(long) != len(short) + 1:
        return False
    i = next((i for i, (p, q) in enumerate(zip(long, short, strict=False)) if p != q), len(short))
    return long[i + 1 :] == short[i:]


def _regional(word: str) -> str:
    word = _SPELLINGS.get(word, word)
    for pattern, repl in _REGIONAL:
        word = pattern.sub(repl, word)
    return word


def _meaning(word: str) -> str:
    """What a listed word stands for: "saturdays" and "saturday" are one day."""
    return (
        _WEEKDAYS.get(word)
        or _MONTHS.get(word)
        or _UNITS.get(word)
        or _ENTITY_ALIASES.get(word)
        or word
    )


_VOWELS = frozenset("aeiou")


def _one_vowel(x: str, y: str) -> bool:
    """The same letters but one vowel for another: "visable" / "visible"."""
    if len(x) != len(y):
        return False
    diffs = [i for i, (p, q) in enumerate(zip(x, y, strict=True)) if p != q]
    return len(diffs) == 1 and x[diffs[0]] in _VOWELS and y[diffs[0]] in _VOWELS


def _vowel_slip(wrong: str, right: str, dictionary: frozenset[str]) -> bool:
    """Whether `wrong` is `right` with one vowel for another ("radiater", "visable",
    "derivitive"), read as it only where it can be nothing else: `wrong` is in
    neither word list (the second guards rare words the first lacks: "ileum" is not
    "ilium"), `right` is in one of them, and no other word either list knows is one
    vowel from `wrong` ("nitrite" / "nitrate" are both words: never respelt)."""
    second = _second_words()
    if second is None or len(wrong) < 5 or not _one_vowel(wrong, right):
        return False
    if wrong in dictionary or wrong in second:
        return False
    near = {
        candidate
        for i, c in enumerate(wrong)
        if c in _VOWELS
        for v in _VOWELS - {c}
        if (candidate := wrong[:i] + v + wrong[i + 1 :]) in dictionary or candidate in second
    }
    return near == {right}


_RUNS = re.compile(r"(.)\1+")


def _squeezed(word: str) -> str:
    """Each run of one letter as one letter: "recommend", "reccomend": "recomend"."""
    return _RUNS.sub(r"\1", word)


@lru_cache(maxsize=1)
def _squeeze_index() -> dict[str, frozenset[str]]:
    """Either list's words by their squeezed spelling (built once, ~50 ms)."""
    index: dict[str, set[str]] = {}
    for w in _either_list():
        index.setdefault(_squeezed(w), set()).add(w)
    return {k: frozenset(v) for k, v in index.items()}


def _doubling_slip(wrong: str, right: str) -> bool:
    """Whether `wrong` is `right` with letters doubled or undoubled, more than once
    ("reccomend", "tommorow", "dissapoint"; once is `_one_typo`'s), read as it only
    where it can be nothing else: `wrong` is in neither word list, five letters or
    more, and `right` the one word either list knows that squeezes the same way
    ("diner" / "dinner" are both words: never)."""
    if _second_words() is None or len(wrong) < 5 or wrong in _either_list():
        return False
    key = _squeezed(wrong)
    return key == _squeezed(right) and _squeeze_index().get(key) == frozenset((right,))


@lru_cache(maxsize=4096)
def _listed_near(word: str) -> frozenset[str]:
    """What the listed words within a misspelling of `word` stand for."""
    return frozenset(
        _meaning(w)
        for w in _LISTED | _NAMED
        if len(w) >= 4
        and w[0] == word[0]
        and (_one_typo(word, w) or _one_vowel(word, w) or _squeezed(word) == _squeezed(w))
    )


@lru_cache(maxsize=65536)
def _fold(word: str) -> str:
    """Without apostrophes and accents: "don't" / "dont", "Schrödinger" / "Schrodinger"."""
    return "".join(
        c for c in unicodedata.normalize("NFKD", word) if not unicodedata.combining(c)
    ).replace("'", "")


def _misspelling(x: str, y: str, names: frozenset[str]) -> int | None:
    """How far `x` and `y` are as two spellings of one word (0: a variant, 1: a
    typo), or None when they are two words. A word spelt right (in the dictionary, a
    known name, a capitalised name) is never taken for another; a word the dictionary
    does not know, one slip from it, is read as it."""
    if x in _STRICT or y in _STRICT:
        return None  # numbers and negations are compared as written
    named = x in names or y in names
    if frozenset((x, y)) in _CONFUSED and not named:
        return 1  # two real words written for each other ("capitol" / "capital");
        # not a name: "the Capitol" is a building, not a country's capital
    if _fold(x) == _fold(y) and (not named or _fold(x) in _NAMED):
        return 0  # apostrophes and accents: "dont", "Canadá" / "canada" (a known name)
    if not named and (
        _SPELLINGS.get(x) == y
        or _SPELLINGS.get(y) == x
        or (len(x) >= 5 and len(y) >= 5 and _regional(x) == _regional(y))
    ):
        return 0
    dictionary = _dictionary()
    if dictionary is None or min(len(x), len(y)) < 3 or x[0] != y[0]:
        return None  # short words and first letters: too many real words one slip apart
    if min(len(x), len(y)) == 3 and len(x) == len(y) and sorted(x) != sorted(y):
        return None  # three letters: a letter dropped ("frm") or swapped ("yuo") only
    if not (x.isalpha() and y.isalpha()) or (x in dictionary and y in dictionary):
        return None  # two words ("form" / "from")
    if x not in dictionary and y not in dictionary:
        # Two the dictionary does not know ("photosythesis" / "photosynthesis",
        # "Fibonacci" / "fibonaci"): one slip apart and long, and not two names
        # ("Kasia" / "Kasja").
        two_names = x in names and y in names
        if two_names or min(len(x), len(y)) < 6:
            return None
        if _one_typo(x, y):
            return 1
        # One vowel apart, where the second list knows one ("ibuprofin" / "ibuprofen").
        second = _second_words() or frozenset()
        if (x in second) == (y in second):
            return None
        wrong, right = (y, x) if x in second else (x, y)
        if wrong in names:
            return None
        slipped = _vowel_slip(wrong, right, dictionary) or _doubling_slip(wrong, right)
        return 1 if slipped else None
    wrong, right = (y, x) if x in dictionary else (x, y)
    if not _one_typo(wrong, right) and (
        wrong in names
        or not (_vowel_slip(wrong, right, dictionary) or _doubling_slip(wrong, right))
    ):
        return None
    if (right in _LISTED or right in _NAMED) and _listed_near(wrong) != {_meaning(right)}:
        return None  # "Jule": June or July? Read as neither
    return 1


def respell(a: str, b: str) -> tuple[str, str]:
    """(a, b), each word one of them misspells written as the other writes it (the
    misspelt side takes the word spelt right). Closest pairs first, each word in one
    pair at most, ties in alphabetical order: the result does not depend on which
    prompt is which (so it is worked out, and memoised, once for both orders)."""
    if a <= b:
        return _respell(a, b)
    b2, a2 = _respell(b, a)
    return a2, b2


def _candidates(
    wa: set[str], wb: set[str], only_a: set[str], only_b: set[str]
) -> set[tuple[str, str]]:
    """The pairs worth asking `_misspelling` about: a word one prompt alone writes
    against the other's words with the same first letter (accents aside), a listed
    spelling of each other ("u" / "you"), or a listed confusion ("affect" /
    "effect"). Long prompts that share little would otherwise cost every word against
    every word. The other's word may be one both write: "hiccups ... hicups"."""

    def initials(words: set[str]) -> dict[str, list[str]]:
        out: dict[str, list[str]] = {}
        for w in words:
            out.setdefault(_fold(w)[:1], []).append(w)
        return out

    in_a, in_b = initials(wa), initials(wb)
    out = {(x, y) for x in only_a for y in in_b.get(_fold(x)[:1], ())}
    out |= {(x, y) for y in only_b for x in in_a.get(_fold(y)[:1], ())}
    # Against a word both write, only a word no list knows: "hicups", never "charge"
    # for the "charger" both write, nor "effect" for their "affect".
    known = _either_list()
    out = {
        (x, y)
        for x, y in out
        if (x in only_a and y in only_b) or (x if y in wa else y) not in known
    }
    out |= {(x, _SPELLINGS[x]) for x in only_a if _SPELLINGS.get(x) in wb}
    out |= {(_SPELLINGS[y], y) for y in only_b if _SPELLINGS.get(y) in wa}
    for x in only_a:
        out |= {(x, y) for pair in _CONFUSED_WITH.get(x, ()) for y in pair & wb if y != x}
    for y in only_b:
        out |= {(x, y) for pair in _CONFUSED_WITH.get(y, ()) for x in pair & wa if x != y}
    return {(x, y) for x, y in out if x != y}


_CONFUSED_WITH: dict[str, list[frozenset[str]]] = {}
for _pair in _CONFUSED:
    for _w in _pair:
        _CONFUSED_WITH.setdefault(_w, []).append(_pair)


@lru_cache(maxsize=8192)
def _respell(a: str, b: str) -> tuple[str, str]:
    wa = {w.lower() for w in _SPELT.findall(a)}
    wb = {w.lower() for w in _SPELT.findall(b)}
    only_a, only_b = wa - wb, wb - wa
    if not only_a and not only_b:
        return a, b
    names = frozenset(_parse(a).caps) | frozenset(_parse(b).caps)
    near = sorted(
        (d, x not in only_a or y not in only_b, min(x, y), max(x, y), x)
        for x, y in _candidates(wa, wb, only_a, only_b)
        if (d := _misspelling(x, y, names)) is not None
    )
    if not near:
        return a, b
    fix_a: dict[str, str] = {}
    fix_b: dict[str, str] = {}
    used: set[str] = set()
    dictionary = _either_list()
    for _, _, low, high, x in near:
        if low in used or high in used:
            continue
        used |= {low, high}
        y = high if x == low else low
        if x in wb:
            fix_b[y] = x  # a word both prompts write is kept: "hiccups ... hicups"
        elif y in wa:
            fix_a[x] = y
        elif (x in dictionary and y not in dictionary) or (x in names and y not in names):
            fix_b[y] = x  # the side spelt right, or the name, is kept
        else:
            fix_a[x] = y
    return _rewrite(a, fix_a), _rewrite(b, fix_b)


def _rewrite(text: str, fixes: dict[str, str]) -> str:
    if not fixes:
        return text
    pattern = re.compile(
        r"(?<![\w'])(?:" + "|".join(re.escape(w) for w in fixes) + r")(?![\w'])", re.IGNORECASE
    )

    def spell(m: re.Match[str]) -> str:
        word = fixes[m.group(0).lower()]
        return word[:1].upper() + word[1:] if m.group(0)[:1].isupper() else word

    return pattern.sub(spell, text)
