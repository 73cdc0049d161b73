"""The verifier's checks: each compares two parsed prompts for one kind of salient difference.

Each check returns the veto detail (`"3 != 5"`), or None when it finds no difference of its
kind. `_CHECKS` holds them in the order `verify` runs them; the order only decides which
name a veto gets (a date is checked before its day number).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable

from switchyard.decide.verify_lexicon import (
    _ASKS,
    _ENTITY_ALIASES,
    _KNOWN_ENTITIES,
    _NEGATIONS,
    _NOT_UN,
)
from switchyard.decide.verify_parse import _Prompt

NONE = "-"  # the side of a reason where the other prompt has nothing to compare

_Check = Callable[[_Prompt, _Prompt], str | None]


def _mentions(p: _Prompt, s: str) -> bool:
    """Whether `s` occurs in the prompt as a whole word or phrase (not inside another)."""
    return re.search(rf"(?<![\w.-]){re.escape(s)}(?![\w-])", p.raw) is not None


def _diff(a: Iterable[str], b: Iterable[str]) -> str:
    """`x != y` naming what only one side has; `-` for a side with nothing of its own."""
    a_set, b_set = set(a), set(b)
    left = ",".join(sorted(a_set - b_set)) or NONE
    right = ",".join(sorted(b_set - a_set)) or NONE
    return f"{left} != {right}"


def _check_quoted(a: _Prompt, b: _Prompt) -> str | None:
    """Quoted strings must reappear; file names veto only when both sides name others."""
    qa = {q for q in a.quoted if not _mentions(b, q)}
    qb = {q for q in b.quoted if not _mentions(a, q)}
    fa = {f for f in a.files - b.files if not _mentions(b, f)}
    fb = {f for f in b.files - a.files if not _mentions(a, f)}
    if not (qa or qb or (fa and fb)):
        return None
    left, right = sorted(qa | fa), sorted(qb | fb)
    return f"{_quote(left)} != {_quote(right)}"


def _quote(items: list[str]) -> str:
    return f"'{items[0]}'" if items else NONE


def _check_date(a: _Prompt, b: _Prompt) -> str | None:
    """Any date, time, weekday or relative day on one side only: answers expire by date."""
    return _diff(a.facts.dates, b.facts.dates) if a.facts.dates != b.facts.dates else None


def _check_unit(a: _Prompt, b: _Prompt) -> str | None:
    """Different units on both sides, or the same number carrying a different unit."""
    ua = a.facts.units | set(a.facts.bound.values())
    ub = b.facts.units | set(b.facts.bound.values())
    if ua and ub and ua != ub:
        return _diff(ua, ub)
    for num in sorted(a.facts.bound.keys() & b.facts.bound.keys()):
        if a.facts.bound[num] != b.facts.bound[num]:
            return f"{a.facts.bound[num]} != {b.facts.bound[num]}"  # "10 l to gal" reversed
    return None


def _check_number(a: _Prompt, b: _Prompt) -> str | None:
    """Any changed number vetoes, except a lone "one" against none ("more than one")."""
    na, nb = a.facts.numbers, b.facts.numbers
    if na == nb or {na, nb} == {frozenset(), frozenset({"1"})}:
        return None
    return _diff(na, nb)


def _check_entity(a: _Prompt, b: _Prompt) -> str | None:
    """Known names must reappear; other capitalised names veto only when swapped."""
    ka = [w for w in _known(a) if w not in b.names]
    kb = [w for w in _known(b) if w not in a.names]
    ca = [w for w in a.caps if w not in b.names and not _mentions(b, w)]
    cb = [w for w in b.caps if w not in a.names and not _mentions(a, w)]
    if not (ka or kb or (ca and cb)):
        return None
    return f"{(ka or ca or [NONE])[0]} != {(kb or cb or [NONE])[0]}"


def _known(p: _Prompt) -> list[str]:
    """Names from the built-in list, found in any case and position."""
    found = [_ENTITY_ALIASES.get(t, t) for t in p.tokens if t != "us"] + list(p.caps)
    return list(dict.fromkeys(w for w in found if w in _KNOWN_ENTITIES))


def _check_negation(a: _Prompt, b: _Prompt) -> str | None:
    """Negation words, counted after "can't" became "can not" and hedges ("not sure")
    were dropped: "without" against "with" or "no" against "a" flips the answer."""
    na = sum(t in _NEGATIONS for t in a.tokens)
    nb = sum(t in _NEGATIONS for t in b.tokens)
    return "" if na != nb else None


_PERSONS_OWNING = frozenset({"my", "your", "their"})  # owners that are a person, not "an"


def _check_scope(a: _Prompt, b: _Prompt) -> str | None:
    """The same noun owned or quantified differently: "my account" vs "an account".
    Nouns only one side writes are paired in order when both sides have as many (the
    same place, one spelt otherwise: "my domain" vs "their doaun"), and then only
    whose they are counts."""
    sa, sb = a.scopes, b.scopes
    only_a = [n for n in sa if n not in sb]
    only_b = [n for n in sb if n not in sa]
    if len(only_a) == len(only_b):  # whose, by person only: "a refund" / "my money" pass
        for na, nb in zip(only_a, only_b, strict=True):
            oa, ob = sa[na][0] & _PERSONS_OWNING, sb[nb][0] & _PERSONS_OWNING
            if oa and ob and oa.isdisjoint(ob):
                return f"{min(oa)} != {min(ob)}"
    for noun in sorted(sa.keys() & sb.keys()):
        (oa, qa), (ob, qb) = sa[noun], sb[noun]
        pairs = [(oa, ob), (qa, qb)]
        if not (qa or ob):
            pairs.append((oa, qb))  # "my data" vs "all data": whose, against how many
        if not (oa or qb):
            pairs.append((qa, ob))
        for left, right in pairs:
            if left and right and left.isdisjoint(right):
                return f"{min(left)} != {min(right)}"
    return None


def _direction_check(directions: Callable[[_Prompt], dict[str, dict[int, str]]]) -> _Check:
    """Both prompts speak of the same scale but point different ways on it."""

    def check(a: _Prompt, b: _Prompt) -> str | None:
        da, db = directions(a), directions(b)
        for group in sorted(da.keys() & db.keys()):
            if da[group].keys() != db[group].keys():
                left = next((w for pol, w in da[group].items() if pol not in db[group]), NONE)
                right = next((w for pol, w in db[group].items() if pol not in da[group]), NONE)
                return f"{left} != {right}"
        return None

    return check


def _check_antonym(a: _Prompt, b: _Prompt) -> str | None:
    """Listed antonyms, then "un-" words whose stem the other prompt uses ("mute"/"unmute")."""
    detail = _check_listed_antonym(a, b)
    if detail is not None:
        return detail
    for x, y, flip in ((a, b, False), (b, a, True)):
        for tok in x.tokens:
            stem = tok[2:]
            if (
                tok.startswith("un")
                and len(stem) >= 4
                and tok not in _NOT_UN
                and stem in y.tokens
                and stem not in x.tokens
            ):
                return f"{stem} != {tok}" if flip else f"{tok} != {stem}"
    return None


_check_listed_antonym = _direction_check(lambda p: p.antonyms)


def _check_question(a: _Prompt, b: _Prompt) -> str | None:
    """Both ask for a different kind of answer: "Who wrote X?" vs "When was X written?".

    Only when both name one and they share none: paraphrases often trade "where" or
    "when" for "how" or "which", and "when" is also a conjunction."""
    qa = [t for t in a.tokens if t in _ASKS]
    qb = [t for t in b.tokens if t in _ASKS]
    return _diff(qa, qb) if qa and qb and set(qa).isdisjoint(qb) else None


# Order only decides which name a veto gets: a date is checked before its day number.
_CHECKS: tuple[tuple[str, _Check], ...] = (
    ("quoted", _check_quoted),
    ("date", _check_date),
    ("unit", _check_unit),
    ("number", _check_number),
    ("entity", _check_entity),
    ("negation", _check_negation),
    ("scope", _check_scope),
    ("comparison", _direction_check(lambda p: p.comparisons)),
    ("antonym", _check_antonym),
    ("question", _check_question),
)
