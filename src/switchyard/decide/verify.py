"""Hit verification for the semantic cache: is a near neighbour really the same question?

Cosine similarity of sentence embeddings cannot tell "How do I enable dark mode?" from
"How do I disable dark mode?": the traps score as high as true paraphrases. So a
candidate hit that passes the similarity threshold must also pass `verify`, which
compares the two prompts for salient differences a paraphrase would keep intact:
quoted strings and file names, dates, units, numbers, named entities, negation,
possessive/quantifier scope, comparison direction, antonyms and the kind of answer asked
for (who/when/where). The first difference found vetoes the hit with a named reason
(`veto: number 3 != 5`); the check order only decides which name a veto gets.

It is deliberately conservative: a false veto costs one model call, a false hit serves
a wrong answer. It is pure and runs on every candidate hit, so it uses small built-in
word lists and regular expressions, and memoises the parse of each prompt.

This module is the verifier's face: `verify`, `same_words`, `same_question`, `respell`,
`warm`, and the checks and parser the learned pair model reads. The parts sit beside it:

* `verify_lexicon.toml` - the word lists (negations, dates, units, names, spellings, ...),
  read by `verify_lexicon.py`;
* `verify_parse.py` - a prompt parsed once into what the checks compare;
* `verify_checks.py` - the checks, in the order they run;
* `verify_respell.py` - misspellings read as the word the other prompt writes;
* `verify_vocab.py` - the dictionaries read from installed wheels, on first use.
"""

from __future__ import annotations

import re
from functools import lru_cache

# What the checks, the pair model, decide/pair_augment.py and the tests read from here is
# re-exported (`name as name`) from the modules that define it.
from switchyard.decide.verify_checks import _CHECKS
from switchyard.decide.verify_checks import NONE as NONE
from switchyard.decide.verify_checks import _known as _known
from switchyard.decide.verify_lexicon import (
    _AGREEMENT,
    _DROPPABLE,
    _SPELLINGS,
    _STRICT,
)
from switchyard.decide.verify_lexicon import _BARE_CONTRACTIONS as _BARE_CONTRACTIONS
from switchyard.decide.verify_lexicon import _ENTITY_ALIASES as _ENTITY_ALIASES
from switchyard.decide.verify_lexicon import _FACT_WORDS as _FACT_WORDS
from switchyard.decide.verify_lexicon import _HEDGES as _HEDGES
from switchyard.decide.verify_lexicon import _KEYS as _KEYS
from switchyard.decide.verify_lexicon import _KNOWN_ENTITIES as _KNOWN_ENTITIES
from switchyard.decide.verify_lexicon import _LISTED as _LISTED
from switchyard.decide.verify_lexicon import _NEGATIONS as _NEGATIONS
from switchyard.decide.verify_lexicon import _NUMBER_WORDS as _NUMBER_WORDS
from switchyard.decide.verify_lexicon import _NUMBERS_WRITTEN as _NUMBERS_WRITTEN
from switchyard.decide.verify_lexicon import _OWNER as _OWNER
from switchyard.decide.verify_lexicon import _QUANTITY as _QUANTITY
from switchyard.decide.verify_lexicon import _STOP as _STOP
from switchyard.decide.verify_parse import _SMART
from switchyard.decide.verify_parse import _parse as _parse
from switchyard.decide.verify_respell import _CONFUSED as _CONFUSED
from switchyard.decide.verify_respell import _CONFUSED_WITH, _fold, _squeeze_index
from switchyard.decide.verify_respell import _SPELT as _SPELT
from switchyard.decide.verify_respell import _confusable as _confusable
from switchyard.decide.verify_respell import _directional as _directional
from switchyard.decide.verify_respell import _doubling_slip as _doubling_slip
from switchyard.decide.verify_respell import _one_typo as _one_typo
from switchyard.decide.verify_respell import _vowel_slip as _vowel_slip
from switchyard.decide.verify_respell import respell as respell
from switchyard.decide.verify_vocab import _dictionary as _dictionary
from switchyard.decide.verify_vocab import _either_list
from switchyard.decide.verify_vocab import _second_words as _second_words

Verdict = tuple[bool, str]
OK: Verdict = (True, "ok")


# ---------------------------------------------------------------------------------
# One question written twice: the same words, but for case, punctuation, spelling.
# ---------------------------------------------------------------------------------

_SURFACE = re.compile(r"\w+|[^\w\s]")
_SENTENCE_MARKS = frozenset(".,!?;:\u00bf\u00a1")  # and Spanish "¿" / "¡"
# Hyphens between words, not between numbers ("3-5"): "Wi-Fi" / "wi fi" / "wifi".
_JOINED = re.compile(r"(?<=\w)-(?=\w)(?<!\d-(?=\d))")
_DIGIT_GROUPS = re.compile(r"(?<=\d),(?=\d{3}(?!\d))")  # "2,000" / "2000"
# Number words as digits: "two weeks" / "2 weeks" (the rules compare the values too).
_DIGITS = {w: str(n) for w, n in _NUMBER_WORDS.items() if n <= 90 and w.isalpha()}
for _w in ("once", "twice", "thrice", "double", "triple", "dozen"):
    _DIGITS.pop(_w, None)


@lru_cache(maxsize=8192)
def _surface(text: str) -> tuple[str, ...]:
    """The words as `same_words` compares them: lower case, without sentence
    punctuation and apostrophes, contractions written out ("whats", "what's": "what
    is"), informal spellings as the listed word ("u": "you"), number words as digits,
    hyphens between letters as spaces ("push-ups": "push ups")."""
    text = text.translate(_SMART).lower().replace("'", "").replace('"', "")
    text = _JOINED.sub(" ", _DIGIT_GROUPS.sub("", text))
    out: list[str] = []
    for tok in _SURFACE.findall(text):
        if tok in _SENTENCE_MARKS:
            continue
        tok = _SPELLINGS.get(tok, tok)
        if tok in _BARE_CONTRACTIONS:
            out += _BARE_CONTRACTIONS[tok]
        else:
            out.append(_DIGITS.get(tok, tok))
    return tuple(out)


def _joins(whole: str, first: str, second: str) -> bool:
    """One word written as two ("stockmarket" / "stock market", "l'Australie" / "l
    Australie"): letters only, and neither part a negation or a number ("no body")."""
    return (
        whole == first + second
        and whole.isalpha()
        and first not in _STRICT
        and second not in _STRICT
        and whole not in _STRICT
    )


_SLIPS = 2  # small words dropped or slipped, per pair


def _aligned(sa: tuple[str, ...], sb: tuple[str, ...]) -> bool:
    """The same words in the same order, but for words written joined on one side and
    apart on the other, and up to two small words (`_DROPPABLE`) one side leaves out
    or writes in another person or number ("is" / "are")."""
    i = j = 0
    slips = 0
    while i < len(sa) or j < len(sb):
        x = sa[i] if i < len(sa) else ""
        y = sb[j] if j < len(sb) else ""
        if x and x == y:
            i, j = i + 1, j + 1
        elif x and y and j + 1 < len(sb) and _joins(x, y, sb[j + 1]):
            i, j = i + 1, j + 2
        elif x and y and i + 1 < len(sa) and _joins(y, x, sa[i + 1]):
            i, j = i + 2, j + 1
        elif slips == _SLIPS:
            return False
        elif frozenset((x, y)) in _AGREEMENT:
            i, j, slips = i + 1, j + 1, slips + 1
        elif x in _DROPPABLE and sa[i + 1 : i + 2] == sb[j : j + 1]:
            i, slips = i + 1, slips + 1
        elif y in _DROPPABLE and sb[j + 1 : j + 2] == sa[i : i + 1]:
            j, slips = j + 1, slips + 1
        else:
            return False
    return True


def same_words(a: str, b: str) -> bool:
    """One question written twice: the same words in the same order, whatever the
    case, the sentence punctuation and the apostrophes, a contraction written out or
    not, a number as a word or in digits, a word joined or apart, and up to two
    articles, "is", "do", "of" or "to" left out or slipped ("is" / "are")."""
    sa, sb = _surface(a), _surface(b)
    return sa == sb or _aligned(sa, sb)


def same_question(a: str, b: str) -> bool:
    """One question written twice: the same words (`same_words`) once misspellings are
    respelt. A candidate like this is put to the checks whatever its cosine, which
    cannot see through a typo ("contintents" puts a repeat at 0.35). Cheap when it is
    not: a few words apart at most, respelling only then."""
    sa, sb = _surface(a), _surface(b)
    if sa == sb:
        return True
    if abs(len(sa) - len(sb)) > 4 or len(set(sa) ^ set(sb)) > 16:
        return False  # joins and one dropped word change the length by a few at most
    if not (_matchable(sa, sb) and _matchable(sb, sa)):
        return False
    return same_words(*respell(a, b))


def _matchable(sa: tuple[str, ...], sb: tuple[str, ...]) -> bool:
    """Whether each word only `sa` writes could be one `sb` writes respelt, joined or
    dropped: it shares a first letter (accents aside) with one of `sb`'s, is part of
    one, or is a listed spelling, look-alike or small word. Cheap: most candidates below the
    threshold are other questions, and fail here before any respelling."""
    initials = {_fold(w)[:1] for w in sb}
    others = set(sb).difference(sa)
    return all(
        _fold(w)[:1] in initials
        or w in _DROPPABLE
        or w in _CONFUSED_WITH
        or w in _SPELLINGS
        or any(w in x for x in others)  # a part of a word written joined ("take off")
        for w in set(sa).difference(sb)
    )


def warm() -> None:
    """Build the word lists now (about 0.2 s once), at the gateway's start, so the
    first request whose check needs one does not wait for it."""
    _either_list()
    _squeeze_index()


def verify(a: str, b: str) -> Verdict:
    """(True, "ok") when no salient difference is found, else (False, "veto: <why>")."""
    pa, pb = (_parse(t) for t in respell(a, b))
    for name, check in _CHECKS:
        detail = check(pa, pb)
        if detail is not None:
            return False, f"veto: {name} {detail}".rstrip()
    return OK


# For the learned pair model (decide/pair_model.py): each check is one of its features.
CHECKS = _CHECKS
parse = _parse
