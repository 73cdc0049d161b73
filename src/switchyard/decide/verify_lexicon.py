"""The verifier's word lists, read once at import from `verify_lexicon.toml` beside this file.

The lists live in a data file so that a person extends them by adding a line, and a
review reads the change as a line; this module only turns them into the sets and tables
the parser, the checks and the respeller look words up in, and derives the few sets that
combine them (which words are facts, which are never respelt).
"""

from __future__ import annotations

import re
import tomllib
from importlib import resources
from typing import Any

_DATA: dict[str, Any] = tomllib.loads(
    resources.files("switchyard.decide").joinpath("verify_lexicon.toml").read_text(encoding="utf-8")
)


def _rewrites(pairs: list[list[str]]) -> list[tuple[re.Pattern[str], str]]:
    """[pattern, replacement] lines as compiled rewrites, in the order given."""
    return [(re.compile(pattern), repl) for pattern, repl in pairs]


def _polar(lines: list[str]) -> dict[str, tuple[str, int]]:
    """Direction words from "up words | down words" lines: word -> (group, polarity), the
    first word of a line naming its group; a word listed twice keeps its first place."""
    table: dict[str, tuple[str, int]] = {}
    for line in lines:
        up, down = (side.split() for side in line.split("|"))
        for polarity, words in ((1, up), (-1, down)):
            for w in words:
                table.setdefault(w, (up[0], polarity))
    return table


_negation = _DATA["negation"]
_dates = _DATA["dates"]
_units = _DATA["units"]
_numbers = _DATA["numbers"]
_scope = _DATA["scope"]
_directions = _DATA["directions"]
_entities = _DATA["entities"]
_spelling = _DATA["spelling"]

# --------------------------------------------------------------------------- negation

_NEGATIONS = frozenset(_negation["words"])
# Phrases whose negation word does not negate the question ("I don't know how to ...").
_HEDGES = re.compile(r"\b(?:" + "|".join(_negation["hedges"]) + r")\b")

# --------------------------------------------------------------------------- dates

_WEEKDAYS: dict[str, str] = {d: d for d in _dates["weekdays"]}
_WEEKDAYS.update({d + "s": d for d in list(_WEEKDAYS)})
_MONTHS: dict[str, str] = {m: m for m in _dates["months"]}
_MONTHS.update(_dates["month_abbreviations"])
# "may" is a month only where a date is plausible ("in May", "May 3"), else a modal verb.
_MAY_BEFORE = frozenset(_dates["may_before"])
_RELATIVE_DAYS = frozenset(_dates["relative_days"])
_RELATIVE_WHEN: dict[str, str] = dict(_dates["relative_when"])
_RELATIVE_SPANS = frozenset(_dates["relative_spans"])

# --------------------------------------------------------------------------- units

_UNITS: dict[str, str] = {
    spelling: canon for canon, spellings in _units["spellings"].items() for spelling in spellings
}
_CURRENCY_SYMBOLS = frozenset(_units["currency_symbols"])
# Units that only count when glued to a number ("5s", "10l"): alone they are letters.
# "" keeps the number but names no unit: "5m" is metres, minutes or millions.
_GLUED_UNITS: dict[str, str] = dict(_units["glued"])

# --------------------------------------------------------------------------- numbers

# In order: a word's position is its value.
_NUMBER_WORDS: dict[str, int] = {w: i for i, w in enumerate(_numbers["small"])}
_NUMBER_WORDS.update(_numbers["words"])
_MULTIPLIERS: dict[str, int] = dict(_numbers["multipliers"])

# --------------------------------------------------------------------------- scope

# Possessive/quantifier scope. Two dimensions: whose thing, and how many of them.
_OWNER: dict[str, str] = dict(_scope["owner"])
_QUANTITY: dict[str, str] = dict(_scope["quantity"])
_WILDCARD = frozenset(_scope["wildcard"])
# "X's account" names someone else's account when X is a person or an organisation.
_PERSONS = frozenset(_scope["persons"])

# --------------------------------------------------------------------------- directions

# Direction words: (group, polarity). Comparisons first, then antonym pairs.
_COMPARISONS = _polar(_directions["comparisons"])
_ANTONYMS = _polar(_directions["antonyms"])
_IRREGULAR: dict[str, str] = dict(_directions["irregular"])
# Words that begin with "un" without negating anything.
_NOT_UN = frozenset(_directions["not_un"])
# Question words that fix the kind of answer: a person, a time, a place.
_ASKS = frozenset(_DATA["questions"]["asks"])

# --------------------------------------------------------------------------- rewrites

_PHRASES = _rewrites(_DATA["rewrites"]["phrases"])
_CONTRACTIONS = _rewrites(_DATA["rewrites"]["contractions"])

# --------------------------------------------------------------------------- entities

# Capitalised words that name no entity: stop words, greetings, generic acronyms.
_STOP = frozenset(_entities["stop"])
_COMMON = _STOP | frozenset(_entities["common"])
_ENTITY_ALIASES: dict[str, str] = dict(_entities["aliases"])
# Names users write in lower case or at the start of a sentence: compared even then.
_KNOWN_ENTITIES = frozenset(_entities["known"])

# --------------------------------------------------------------------------- spelling

# Informal and regional spellings that both look right, or lie too far apart.
_SPELLINGS: dict[str, str] = dict(_spelling["informal"])
# Contractions written without their apostrophe that are no other word.
_BARE_CONTRACTIONS: dict[str, list[str]] = {
    w: full.split() for w, full in _spelling["bare_contractions"].items()
}
# Words a writer drops without changing the question: two per pair at most.
_DROPPABLE = frozenset(_spelling["droppable"])
# Grammar slips between small words: "what is the symptoms", "a apple", "do it work".
_AGREEMENT = frozenset(frozenset(pair) for pair in _spelling["agreement"])
# Real words written for one another, before `verify_respell` drops the ones a check
# compares.
_CONFUSED_PAIRS: tuple[tuple[str, str], ...] = tuple((x, y) for x, y in _spelling["confused"])
# British endings, written the American way: "colour" / "color".
_REGIONAL = _rewrites(_spelling["regional"])
# Each key's neighbours on a QWERTY keyboard.
_KEYS: dict[str, frozenset[str]] = {
    key: frozenset(near) for key, near in _spelling["keyboard"].items()
}

# --------------------------------------------------------------------------- derived

_NUMBERS_WRITTEN = frozenset(_NUMBER_WORDS) | frozenset(_MULTIPLIERS)
# Words whose spelling is a fact: a misspelt word may be read as one of them only
# where it is the one such word it can be ("Satrday", not "Jule": June or July?).
_DATE_WORDS = frozenset(_WEEKDAYS) | frozenset(_MONTHS) | _RELATIVE_DAYS
_LISTED = (
    _DATE_WORDS
    | frozenset(_RELATIVE_WHEN)
    | _RELATIVE_SPANS
    | frozenset(_UNITS)
    | frozenset(_COMPARISONS)
    | frozenset(_ANTONYMS)
    | frozenset(_OWNER)
    | frozenset(_QUANTITY)
    | _ASKS
)
# Never respelt nor respelt into: numbers and negations are compared as written.
_STRICT = _NEGATIONS | _NUMBERS_WRITTEN
# Never respelt; a misspelling may be read as one, where it is the only one it can be.
_NAMED = _KNOWN_ENTITIES | frozenset(_ENTITY_ALIASES)
_NEVER_RESPELT = _STRICT | _NAMED
# Words whose difference a check weighs: never read as a confusion (`_CONFUSED_PAIRS`).
_FACT_WORDS = (
    _STRICT
    | _NAMED
    | frozenset(_OWNER)
    | frozenset(_QUANTITY)
    | _ASKS
    | _DATE_WORDS
    | frozenset(_RELATIVE_WHEN)
    | _RELATIVE_SPANS
    | frozenset(_UNITS)
)
