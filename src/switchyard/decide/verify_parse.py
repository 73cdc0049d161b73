"""Parsing for the cache-hit verifier: each prompt once, into everything the checks compare.

A prompt becomes a `_Prompt`: its quoted strings, file names and PII placeholders (taken out
and compared verbatim), its tokens after contractions and phrases are written out, its
capitalised names, its dates, units and numbers (`_Facts`), the scope of its owned and
quantified nouns, and its direction words. The parse is memoised: the same prompt is
parsed once however many candidates it is compared with.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache

from switchyard.decide.verify_lexicon import (
    _ANTONYMS,
    _COMMON,
    _COMPARISONS,
    _CONTRACTIONS,
    _CURRENCY_SYMBOLS,
    _ENTITY_ALIASES,
    _GLUED_UNITS,
    _HEDGES,
    _IRREGULAR,
    _MAY_BEFORE,
    _MONTHS,
    _MULTIPLIERS,
    _NEGATIONS,
    _NUMBER_WORDS,
    _OWNER,
    _PERSONS,
    _PHRASES,
    _QUANTITY,
    _RELATIVE_DAYS,
    _RELATIVE_SPANS,
    _RELATIVE_WHEN,
    _STOP,
    _UNITS,
    _WEEKDAYS,
    _WILDCARD,
)

# Typographic quotes, dashes and spaces as their plain forms.
_SMART = str.maketrans(
    {
        "\u2018": "'",
        "\u2019": "'",
        "\u201c": '"',
        "\u201d": '"',
        "\u2013": "-",
        "\u2014": " - ",
        "\u00a0": " ",
    }
)

_TOKEN = re.compile(r"[$\u20ac\u00a3\u00a5%+]|c\+\+|c#|f#|[a-z0-9]+(?:[.,:/'-][a-z0-9]+)*")
_QUOTED = re.compile(r'"([^"\n]{1,200})"|`([^`\n]{1,200})`|(?<![\w])\'([^\'\n]{1,200})\'(?!\w)')
_FILE = re.compile(
    r"(?<![\w./-])(?:[\w-]+(?:\.[\w-]+)*\.[a-z][a-z0-9]{1,5}|\.[a-z][\w-]{1,30})"
    r"(?![\w-])"
)
# PII placeholders (`<EMAIL_1>`, see policy/pii.py): opaque, compared verbatim.
_PLACEHOLDER = re.compile(r"<[A-Z][A-Z_]*_\d+>")
_WORD = re.compile(r"[a-z0-9+#]+")
_ABBREVIATION = re.compile(r"[a-z]\.[a-z]")  # "e.g", "i.e": not file names
_GLUED = re.compile(r"(\d+(?:\.\d+)?)([a-z]+)")
_VERSION = re.compile(r"v(\d+(?:\.\d+)*)")
_RANGE = re.compile(r"\d+(?:-\d+)+")
_THOUSANDS = re.compile(r"\d{1,3}(?:,\d{3})+(?:\.\d+)?")
_NUMBER = re.compile(r"\d+(?:\.\d+)?%?")
_HOUR = re.compile(r"\d{1,2}(?::\d{2})?")
_CLOCK = re.compile(r"\d{1,2}:\d{2}")
_CAP_WORD = re.compile(r"[A-Za-z0-9][\w+#-]*(?:'[a-z]+)?|\S")
_SENTENCE_END = frozenset(".!?:;\n")


# ---------------------------------------------------------------------------------
# Parsing: each prompt once, into everything the checks compare.
# ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Facts:
    """Dates, units and numbers; a date consumes its own numbers ("March 3")."""

    dates: frozenset[str]
    units: frozenset[str]
    bound: dict[str, str]  # number -> the unit written with it ("5 km")
    numbers: frozenset[str]


@dataclass(frozen=True, slots=True)
class _Prompt:
    raw: str  # lowercased, quotes normalised: where "is it mentioned at all?" is asked
    names: frozenset[str]  # every word of `raw`, its normalised tokens and their aliases
    quoted: frozenset[str]
    files: frozenset[str]
    tokens: tuple[str, ...]
    caps: tuple[str, ...]  # capitalised words that are not sentence-initial or common
    facts: _Facts
    scopes: dict[str, tuple[set[str], set[str]]]  # noun -> (owners, quantities)
    comparisons: dict[str, dict[int, str]]  # scale -> direction -> word
    antonyms: dict[str, dict[int, str]]


@lru_cache(maxsize=8192)
def _parse(text: str) -> _Prompt:
    text = text.translate(_SMART)
    stripped, quoted, files = _strip_quoted(text)
    raw = text.lower()
    tokens = _tokens(_normalise(stripped))
    words = set(_WORD.findall(raw)) | set(tokens)
    caps = _capitalised(stripped)
    return _Prompt(
        raw=raw,
        names=frozenset(words | {_ENTITY_ALIASES[w] for w in words if w in _ENTITY_ALIASES}),
        quoted=quoted,
        files=files,
        tokens=tokens,
        caps=caps,
        facts=_facts(tokens),
        scopes=_scopes(tokens, caps),
        comparisons=_directions(tokens, _COMPARISONS),
        antonyms=_directions(tokens, _ANTONYMS),
    )


def _strip_quoted(text: str) -> tuple[str, frozenset[str], frozenset[str]]:
    """Take quoted strings, PII placeholders and file names out: they are compared
    verbatim, not as words ("<CARD_1>" holds no number 1 and names no entity)."""
    placeholders = {m.lower() for m in _PLACEHOLDER.findall(text)}
    text = _PLACEHOLDER.sub(" ", text)
    quoted = placeholders | {
        " ".join((m.group(1) or m.group(2) or m.group(3)).lower().split())
        for m in _QUOTED.finditer(text)
    }
    text = _QUOTED.sub(" , ", text)
    files = {
        f
        for f in (m.group(0).lower() for m in _FILE.finditer(text))
        if not _ABBREVIATION.fullmatch(f)
    }
    text = _FILE.sub(" ", text)
    return text, frozenset(q for q in quoted if q), frozenset(files)


def _capitalised(text: str) -> tuple[str, ...]:
    """Capitalised words that are not at a sentence start and not common: likely names."""
    out: list[str] = []
    at_start = True
    for m in _CAP_WORD.finditer(text):
        tok = m.group(0)
        if len(tok) == 1 and not tok.isalnum():
            at_start = at_start or tok in _SENTENCE_END or tok in '("-'
            continue
        word = tok.lower().removesuffix("'s")
        if (
            not at_start
            and any(c.isupper() for c in tok)
            and word not in _COMMON
            and not _owned_elsewhere(word)
        ):
            out.append(_ENTITY_ALIASES.get(word, word))
        at_start = False
    return tuple(dict.fromkeys(out))


def _owned_elsewhere(word: str) -> bool:
    """Words another check owns (dates, units, direction words) are not entities."""
    return (
        word in _WEEKDAYS
        or word in _MONTHS
        or word == "may"
        or word in _UNITS
        or word in _COMPARISONS
        or word in _ANTONYMS
        or word in _NEGATIONS
    )


def _normalise(text: str) -> str:
    text = text.lower()
    if "'" in text or "cannot" in text or "nt" in text:
        for pattern, repl in _CONTRACTIONS:
            text = pattern.sub(repl, text)
    for pattern, repl in _PHRASES:
        text = pattern.sub(repl, text)
    return _HEDGES.sub(" ", text)


def _tokens(text: str) -> tuple[str, ...]:
    out: list[str] = []
    for raw in _TOKEN.findall(text):
        for tok in _split_token(raw.strip(".,:/'-")):
            if tok == "%" and out and _is_number(out[-1]):
                out[-1] += "%"
            elif tok:
                out.append(tok)
    return tuple(out)


def _split_token(tok: str) -> list[str]:
    """Split glued forms: "8gb" -> 8 gb, "5th" -> 5, "3pm" -> 3 pm, "3-5" -> 3 5."""
    m = _GLUED.fullmatch(tok)
    if m:
        num, suffix = m.groups()
        if suffix in ("st", "nd", "rd", "th"):
            return [num]
        if suffix == "k":  # "10k"
            value = float(num) * 1000
            return [str(int(value)) if value.is_integer() else str(value)]
        if suffix in ("am", "pm") or suffix in _UNITS or suffix in _GLUED_UNITS:
            unit = _GLUED_UNITS.get(suffix, suffix)
            return [num, unit] if unit else [num]
        return [tok]  # "2fa", "4g": a name, not a quantity
    m = _VERSION.fullmatch(tok)
    if m:
        return [m.group(1)]
    if _RANGE.fullmatch(tok) and not _DATE_TOKEN.fullmatch(tok):
        return tok.split("-")
    if _THOUSANDS.fullmatch(tok):
        return [tok.replace(",", "")]
    if "-" in tok and all(p in _NUMBER_WORDS for p in tok.split("-")):
        return tok.split("-")  # "twenty-five"
    return [tok]


def _is_number(tok: str) -> bool:
    return _NUMBER.fullmatch(tok) is not None


# ---------------------------------------------------------------------------------
# Dates, units and numbers share one pass.
# ---------------------------------------------------------------------------------


def _facts(toks: tuple[str, ...]) -> _Facts:
    dates: set[str] = set()
    units: set[str] = set()
    bound: dict[str, str] = {}
    numbers: set[str] = set()
    i = 0
    while i < len(toks):
        date = _date_at(toks, i)
        if date:
            dates.add(date[0])
            i += date[1]
            continue
        num = (toks[i], 1) if _is_number(toks[i]) else _number_words(toks, i)
        if num:
            numbers.add(num[0])
            unit = _unit_near(toks, i, num[1])
            if unit:
                bound.setdefault(num[0], unit)
            i += num[1]
            continue
        if toks[i] in _UNITS:
            units.add(_UNITS[toks[i]])
        i += 1
    return _Facts(frozenset(dates), frozenset(units), bound, frozenset(numbers))


def _date_at(toks: tuple[str, ...], i: int) -> tuple[str, int] | None:
    """A date starting at token i, as (canonical text, tokens consumed)."""
    tok = toks[i]
    nxt = toks[i + 1] if i + 1 < len(toks) else ""
    month = _month_at(toks, i)
    if month:
        return (f"{month} {int(nxt)}", 2) if _is_day(nxt) else (month, 1)
    if _is_day(tok):
        j = i + 2 if nxt == "of" else i + 1
        month = _month_at(toks, j) if j < len(toks) else None
        if month:
            return f"{month} {int(tok)}", j - i + 1
    if nxt in ("am", "pm") and _HOUR.fullmatch(tok):
        return _time_of_day(tok, nxt), 2
    if _CLOCK.fullmatch(tok):
        return _time_of_day(tok, ""), 1
    if _DATE_TOKEN.fullmatch(tok) and nxt not in _UNITS:
        return tok, 1
    if tok in _WEEKDAYS:
        return _WEEKDAYS[tok], 1
    if tok in _RELATIVE_DAYS:
        return tok, 1
    if tok in _RELATIVE_WHEN and (nxt in _RELATIVE_SPANS or nxt in _WEEKDAYS):
        return f"{_RELATIVE_WHEN[tok]} {_WEEKDAYS.get(nxt, nxt)}", 2
    return None


# Years, decades, ISO and slashed dates, quarters and halves.
_DATE_TOKEN = re.compile(
    r"(?:19|20)\d{2}s?|\d{4}-\d{2}-\d{2}|\d{1,2}/\d{1,2}(?:/\d{2,4})?"
    r"|q[1-4]|h[12]"
)


def _month_at(toks: tuple[str, ...], i: int) -> str | None:
    tok = toks[i]
    if tok in _MONTHS:
        return _MONTHS[tok]
    if tok == "may" and (
        (i > 0 and toks[i - 1] in _MAY_BEFORE) or (i + 1 < len(toks) and _is_day(toks[i + 1]))
    ):
        return "may"
    return None


def _is_day(tok: str) -> bool:
    return tok.isdigit() and 1 <= int(tok) <= 31


def _time_of_day(clock: str, ampm: str) -> str:
    """ "3pm", "3:00 pm" and "15:00" are one time."""
    hour, _, minute = clock.partition(":")
    h = int(hour) % 12 + (12 if ampm == "pm" else 0) if ampm else int(hour)
    return f"{h:02d}:{minute or '00'}"


def _number_words(toks: tuple[str, ...], i: int) -> tuple[str, int] | None:
    """ "two hundred and five" -> ("205", 4); None when no number word starts at i."""
    if toks[i] not in _NUMBER_WORDS:
        return None
    total, current, j = 0, 0, i
    while j < len(toks):
        tok = toks[j]
        if tok in _NUMBER_WORDS:
            current += _NUMBER_WORDS[tok]
        elif tok in _MULTIPLIERS:
            total += max(current, 1) * _MULTIPLIERS[tok]
            current = 0
        elif not (tok == "and" and j + 1 < len(toks) and toks[j + 1] in _NUMBER_WORDS):
            break
        j += 1
    return str(total + current), j - i


def _unit_near(toks: tuple[str, ...], i: int, width: int) -> str | None:
    """The unit written with the number at i: "$5", "5 km", "5 degrees celsius"."""
    if i > 0 and toks[i - 1] in _CURRENCY_SYMBOLS:
        return _UNITS[toks[i - 1]]
    for j in (i + width, i + width + 1):
        if j >= len(toks):
            break
        if toks[j] in _UNITS:
            return _UNITS[toks[j]]
        if toks[j] not in ("degree", "degrees", "square", "cubic"):
            break
    return None


# ---------------------------------------------------------------------------------
# Scope and direction words.
# ---------------------------------------------------------------------------------


def _singular(word: str) -> str:
    """Crude, but enough to match "all invoices" with "my invoice"."""
    if word.endswith("ies") and len(word) > 4:
        return word[:-3] + "y"
    if word.endswith("s") and not word.endswith("ss") and len(word) > 3:
        return word[:-1]
    return word


def _scope_class(tok: str, caps: tuple[str, ...]) -> str | None:
    """Scope of a determiner-like token: my/your/their/an (owner), all/any (quantity)."""
    if tok in _OWNER:
        return _OWNER[tok]
    if tok in _QUANTITY:
        return _QUANTITY[tok]
    if tok.endswith("'s") and (tok[:-2] in _PERSONS or tok[:-2] in caps):
        return "their"
    return None


def _scopes(toks: tuple[str, ...], caps: tuple[str, ...]) -> dict[str, tuple[set[str], set[str]]]:
    """noun -> (owners, quantities): "all of my files" gives file -> ({my}, {all})."""
    out: dict[str, tuple[set[str], set[str]]] = {}
    for i, tok in enumerate(toks):
        cls = _scope_class(tok, caps)
        if cls is None:
            continue
        j = i + 1
        while j < len(toks) and (
            toks[j] == "of" or toks[j] in _WILDCARD or toks[j] in _OWNER or toks[j] in _QUANTITY
        ):
            j += 1
        nouns = [toks[j][:-2]] if j < len(toks) and toks[j].endswith("'s") else toks[j : j + 2]
        for noun in nouns:
            if noun in _STOP:
                break
            owners, quantities = out.setdefault(_singular(noun), (set(), set()))
            (quantities if cls in ("all", "any") else owners).add(cls)
    return out


def _lemma(word: str, table: dict[str, tuple[str, int]]) -> str | None:
    """The table entry an inflected word belongs to ("increased" -> "increase")."""
    if word in table:
        return word
    if _IRREGULAR.get(word) in table:
        return _IRREGULAR[word]
    for suffix, repl in (
        ("ing", ""),
        ("ing", "e"),
        ("ed", ""),
        ("ed", "e"),
        ("d", ""),
        ("es", ""),
        ("s", ""),
    ):
        if not word.endswith(suffix):
            continue
        stem = word[: -len(suffix)] + repl
        if stem in table:
            return stem
        if len(stem) > 2 and stem[-1] == stem[-2] and stem[:-1] in table:  # "stopped"
            return stem[:-1]
    return None


def _directions(
    toks: tuple[str, ...], table: dict[str, tuple[str, int]]
) -> dict[str, dict[int, str]]:
    """group -> polarity -> the first word that expressed it."""
    out: dict[str, dict[int, str]] = {}
    for tok in toks:
        lemma = _lemma(tok, table)
        if lemma is not None:
            group, polarity = table[lemma]
            out.setdefault(group, {}).setdefault(polarity, lemma)
    return out
