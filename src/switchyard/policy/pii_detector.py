"""The PII detectors' common parts: the detector contract, and the cheap window finders.

Python's regex engine pays for every start position it tries, so a detector's pattern is
searched only in windows found with cheaper means: a literal `in` test, a `bytes.translate`
class map searched at C speed (`_class_seeds`, `_long_runs`), or the runs of digits and
separators every numeric value lies in (`_near_numbers`). Every pass is linear in the
length of the text. The word lists and tables the detectors read are in `pii_tables.toml`
beside this file, loaded here once at import (`_TABLES`).
"""

from __future__ import annotations

import re
import string
import tomllib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from importlib import resources
from typing import Any, Literal, NamedTuple, get_args

PiiType = Literal["EMAIL", "PHONE", "CARD", "IBAN", "SSN", "KR_RRN", "IP", "SECRET"]
PII_TYPES: tuple[PiiType, ...] = get_args(PiiType)

_TABLES: dict[str, Any] = tomllib.loads(
    resources.files("switchyard.policy").joinpath("pii_tables.toml").read_text(encoding="utf-8")
)

Span = tuple[int, int]
Check = Callable[[re.Match[str]], Span | None]


def _rx(pattern: str) -> re.Pattern[str]:
    # ASCII: \w, \d and \b must not treat Hangul or other letters as word characters,
    # or "010-1234-5678입니다" would never match its trailing boundary.
    return re.compile(pattern, re.ASCII)


class _Hit(NamedTuple):
    """A run of digits and separators that may hold a numeric value (see `_NUMBERS`)."""

    start: int
    end: int
    text: str
    digits: int


class _View:
    """One text plus what the detectors' window finders derive from it, computed lazily.

    `ascii` has one byte per character (non-ASCII becomes '?'), so offsets match the text
    and `bytes.translate` + `bytes.find` can look for character-class shapes at C speed.
    """

    __slots__ = ("_ascii", "_hits", "text")

    def __init__(self, text: str) -> None:
        self.text = text
        self._ascii: bytes | None = None
        self._hits: list[_Hit] | None = None

    @property
    def ascii(self) -> bytes:
        if self._ascii is None:
            self._ascii = self.text.encode("ascii", "replace")
        return self._ascii

    @property
    def number_hits(self) -> list[_Hit]:
        if self._hits is None:
            self._hits = _number_hits(self.text)
        return self._hits


Where = Callable[[_View], list[Span]]


@dataclass(frozen=True, slots=True)
class _Detector:
    """One pattern for one type; `check` validates a match and returns the span to mask.

    Python's regex engine pays for every start position it tries, so only patterns that
    begin with a literal search the whole text, and only when it holds one of `hints` (a
    cheap `in` test). The others search just the windows that `where` finds with cheaper
    means (see `_near_numbers`, `_class_seeds`); an `anchored` one is only tried at the
    start of each window (see `_credential_windows`).
    """

    kind: PiiType
    pattern: re.Pattern[str]
    check: Check
    hints: tuple[str, ...] = ()
    where: Where | None = None
    # The pattern is matched only at the start of each window, not searched through it.
    anchored: bool = False

    def windows(self, view: _View) -> list[Span]:
        if self.hints and not any(map(view.text.__contains__, self.hints)):
            return []
        return [(0, len(view.text))] if self.where is None else self.where(view)


def _merge(spans: Iterable[Span]) -> list[Span]:
    """Merge overlapping spans given in order of start."""
    out: list[Span] = []
    for a, b in spans:
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(b, out[-1][1]))
        else:
            out.append((a, b))
    return out


def _class_seeds(table: bytes, seed: bytes, width: int) -> Where:
    """Windows `width` long from each place where `seed` occurs in the translated text.

    `table` maps each ASCII byte to a class letter; a seed such as b"AA00" (two capitals,
    two digits) is then a plain substring search.
    """

    def where(view: _View) -> list[Span]:
        classes, n = view.ascii.translate(table), len(view.text)
        starts: list[int] = []
        i = classes.find(seed)
        while i != -1:
            starts.append(i)
            i = classes.find(seed, i + len(seed))
        return _merge((i, min(n, i + width)) for i in starts)

    return where


def _long_runs(table: bytes, length: int) -> Where:
    """Windows over each run of at least `length` characters that `table` maps to b"a"."""
    seed = b"a" * length

    def where(view: _View) -> list[Span]:
        classes, n = view.ascii.translate(table), len(view.text)
        out: list[Span] = []
        i = classes.find(seed)
        while i != -1:
            end = classes.find(b" ", i + length)
            end = n if end == -1 else end
            out.append((i, min(n, end + 3)))  # the regex may take up to two '=' after it
            i = classes.find(seed, end)
        return out

    return where


def _near_numbers(fits: Callable[[_Hit], bool], margin: int = 2) -> Where:
    """Windows around the number runs that `fits` accepts, widened by `margin`."""

    def where(view: _View) -> list[Span]:
        n = len(view.text)
        if not view.number_hits:
            return []
        hits = filter(fits, view.number_hits)
        return _merge((max(0, h.start - margin), min(n, h.end + margin)) for h in hits)

    return where


def _table(classes: Mapping[str, str], default: str = " ") -> bytes:
    """A `bytes.translate` table: each character of a key maps to its class letter."""
    out = bytearray(default.encode() * 256)
    for chars, letter in classes.items():
        for c in chars:
            out[ord(c)] = ord(letter)
    return bytes(out)


def _whole(m: re.Match[str]) -> Span:
    return m.span()


def _follows(m: re.Match[str], chars: frozenset[str]) -> bool:
    """True if the match starts a token: the character before it is not in `chars`."""
    i = m.start()
    return i == 0 or m.string[i - 1] not in chars


# What ASCII `\w` matches: the characters a value must not be glued to.
_WORD_CHARS = frozenset(string.ascii_letters + string.digits + "_")


# --------------------------------------------------------------------------- numbers

# Every numeric value (card, SSN, resident number, IPv4, phone) lies in a run of
# digits and separators, 7+ characters from digit to digit, holding 8+ digits or 3 dots.
# One pass finds those runs; the numeric detectors then search only around them.
_NUMBERS = _rx(r"\d[\d ().+-]{5,}\d")


def _number_hits(text: str) -> list[_Hit]:
    hits: list[_Hit] = []
    for m in _NUMBERS.finditer(text):
        start = m.start()
        while start > 0 and text[start - 1] in "+(" and m.start() - start < 2:
            start -= 1  # a leading '+' or '(' belongs to the run
        run = text[start : m.end()]
        digits = sum(map(str.isdigit, run))
        if digits >= 8 or run.count(".") >= 3:
            hits.append(_Hit(start, m.end(), run, digits))
    return hits
