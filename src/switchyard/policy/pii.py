"""PII masking: find personal data and secrets in request text, swap them for typed placeholders.

Masked text is what reaches cache keys, embeddings, stored traces and logs, so this runs on
every request: pure Python over precompiled regexes (no network, no models). Python's regex
engine pays for every start position it tries, so most patterns search only small windows
that literal or `bytes.translate` searches found first (see `_Detector`); every pass is
linear in the length of the text.

Detection favours precision where a false positive would damage a prompt: numbers must have
the shape of what they claim to be *and* pass the check that shape implies (Luhn for cards,
mod-97 for IBANs, a real date for Korean resident numbers, valid octets for IPs). A plain
number (a year, a price, an order number) is left alone; a dotted quad that is a valid IPv4
address is masked even when it was meant as a version string, since the two cannot be told
apart. Credentials written as `key=value`, `key: value` or `"key": "value"` under a
credential key (password, secret, token, api_key, ... with any prefix: DB_PASSWORD,
x-api-key) lose their value but keep their key (`password=<SECRET_1>`); a value after a
bare word and a colon ("Password: required") must also look like a password. A URL's
`user:password@` is masked whole.

Placeholders are typed and numbered per type in order of first appearance within one request
(`<EMAIL_1>`, `<EMAIL_2>`, `<PHONE_1>`); the same raw value always gets the same placeholder
within the request. The placeholder -> raw mapping lives only in the `MaskSession` of that
request and is never logged, stored or shown in a repr.

The caller picks the mode (`Mode`):

* ``observe_only``: the raw text goes upstream; only what is stored, logged or embedded is
  masked. Detection still feeds the decision evidence (`MaskSession.found`).
* ``mask_upstream``: the masked text goes upstream; placeholders in the response are put back
  for the caller with `MaskSession.restore` (or `MaskSession.restore_stream` for SSE).
* ``block``: a request that contains PII is refused (400 ``pii_detected``, naming the types
  from `MaskSession.found`, never the values).

If masking fails internally it raises `MaskingError`, and the gateway fails closed.
"""

from __future__ import annotations

import datetime
import ipaddress
import math
import re
import string
from bisect import bisect_right
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple, TypeVar, get_args

import msgspec

from switchyard.request import Generation

__all__ = [
    "MODES",
    "PII_TYPES",
    "Finding",
    "MaskSession",
    "MaskingError",
    "Mode",
    "PiiMasker",
    "PiiType",
    "StreamRestorer",
    "contains_pii",
]

Mode = Literal["observe_only", "mask_upstream", "block"]
MODES: tuple[Mode, ...] = get_args(Mode)

PiiType = Literal["EMAIL", "PHONE", "CARD", "IBAN", "SSN", "KR_RRN", "IP", "SECRET"]
PII_TYPES: tuple[PiiType, ...] = get_args(PiiType)


class MaskingError(Exception):
    """Masking failed internally; the request must fail closed (never go out unmasked).

    The message names only the kind of failure: the original exception is not chained,
    because its text could quote the raw value and end up in a log.
    """


Span = tuple[int, int]
_T = TypeVar("_T")
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


# --------------------------------------------------------------------------- secrets

_WORD_CHARS = frozenset(string.ascii_letters + string.digits + "_")
_TOKEN_CHARS = _WORD_CHARS | {"-"}
_B64_CHARS = _TOKEN_CHARS | {"+", "/"}
_B64_PAD = _B64_CHARS | {"="}

_PEM = _rx(
    r"-----BEGIN[A-Z ]{0,40}PRIVATE KEY-----[\s\S]*?(?:-----END[A-Z ]{0,40}PRIVATE KEY-----|\Z)"
)
# Lookbehinds right after the literal: keep the fast literal search, and stop "eyJeyJ..."
# from being rescanned from every inner "eyJ".
_JWT = _rx(r"eyJ(?<![\w-]eyJ)[\w-]{2,}\.[\w-]{2,}\.[\w-]*")
# Searched from the rarer tail of the word, whose head the lookbehind then checks.
_BEARER = _rx(r"earer(?<=\b[Bb]earer)\s+(?P<v>[\w.~+/=-]{8,})")
_BEARER_CAPS = _rx(r"EARER(?<=\bBEARER)\s+(?P<v>[\w.~+/=-]{8,})")
_BASIC = _rx(r"uthorization(?<=\b[Aa]uthorization)\s*:\s*[Bb]asic\s+(?P<v>[A-Za-z0-9+/=]{8,})")
# Vendor key formats; `_token_start` checks the left boundary.
_KEYS = {
    "github": (_rx(r"gh[pousr]_[A-Za-z0-9]{30,}|github_pat_\w{30,}"), ("gh",)),
    "slack": (_rx(r"xox[abposr]-[\w-]{10,}"), ("xox",)),
    "google": (_rx(r"AIza[\w-]{35}(?![\w-])"), ("AIza",)),
    "huggingface": (_rx(r"hf_[A-Za-z0-9]{30,}"), ("hf_",)),
    "stripe": (_rx(r"[spr]k_(?:live|test)_\w{16,}"), ("k_live_", "k_test_")),
}
_AWS = _rx(r"(?:AKIA|ASIA)(?<![A-Z0-9]....)[0-9A-Z]{16}(?![A-Z0-9])")
# OpenAI-style and our own `sk-sy-` keys. The body must hold a digit, so hyphenated prose
# such as "sk-learn-compatible-estimators" stays.
_SK = _rx(r"sk-(?<![\w-]sk-)(?P<v>[\w-]{20,})")
# Generic: a long base64/base64url/hex run. '=' only as trailing padding, so that in
# `api_key=...` only the value is taken. Longer runs are data (images, blobs), not keys.
_TOKEN = _rx(r"[\w+/-]{32,256}={0,2}")
_TOKEN_RUNS = _long_runs(_table({string.ascii_letters + string.digits + "_+/-": "a"}), 32)
_LOWER_RUN = _rx(r"[a-z]{3,}")
_HEX = frozenset(string.hexdigits)


def _token_start(m: re.Match[str]) -> Span | None:
    return m.span() if _follows(m, _TOKEN_CHARS) else None


def _auth_value(m: re.Match[str]) -> Span | None:
    """Mask the credential after `Bearer`, not the word: "Bearer of bad news" stays."""
    v = m.group("v")
    if len(v) >= 24 or any(c.isdigit() for c in v):
        return m.span("v")
    return None


def _sk_key(m: re.Match[str]) -> Span | None:
    return m.span() if any(c.isdigit() for c in m.group("v")) else None


def _entropy(s: str) -> float:
    n = len(s)
    return -sum(c / n * math.log2(c / n) for c in Counter(s).values())


def _looks_random(s: str) -> bool:
    """True for key-like strings, false for identifiers, paths and repeated characters.

    Hex needs digits and letters; other runs need lower, upper and digits, and must not
    be made mostly of lowercase words (CamelCase names, snake_case names and paths are;
    random base64 almost never is: about 3 in 10,000 at this threshold).
    """
    body = s.rstrip("=")
    if set(body) <= _HEX:
        has_alpha = any(c.isalpha() for c in body)
        return has_alpha and any(c.isdigit() for c in body) and _entropy(body) >= 2.8
    classes = (str.islower, str.isupper, str.isdigit)
    if not all(any(f(c) for c in body) for f in classes):
        return False
    wordy = sum(len(w) for w in _LOWER_RUN.findall(body)) / len(body)
    return wordy < 0.6 and _entropy(body) >= 3.5


def _token(m: re.Match[str]) -> Span | None:
    # Boundaries checked here, not by lookbehind, so the search keeps its fast path.
    after = m.string[m.end() : m.end() + 1]
    if not _follows(m, _B64_CHARS) or (after and after in _B64_PAD):
        return None
    return m.span() if _looks_random(m.group(0)) else None


# --------------------------------------------------------------------------- credentials

# A URL's userinfo (`postgres://bob:s3cret@db`): searched from the literal "://"; the greedy
# password part backtracks to the last '@' of the authority, since people paste passwords
# with a raw '@' in them. Only `user:password` is masked; a lone user name is not a secret.
_USERINFO = _rx(r"://(?P<ui>[^\s/?#@:\"'<>`]{0,256}:[^\s/?#\"'<>`]{1,256})@")
_SCHEME_CHARS = frozenset(string.ascii_letters + string.digits + "+.-")

# `key=value`, `key: value`, `"key": "value"` (also `:=`, `=>`, JSON escaped once more)
# where the key ends in a credential word. The search starts at that word (the windows
# come from `_credential_windows`); what is glued before it (DB_, x-api-, client_) is
# walked back in Python. Only the value is masked, so the text still says what it held
# ("password=<SECRET_1>"). An unquoted value runs to whitespace or a quote; a ';', '&' or
# ',' ends it only where another `key=` follows (connection strings, query strings).
_CREDENTIAL = re.compile(
    r"(?P<word>pass(?:word|wd|phrase)?|pwd|secret(?:[ _-]?key)?|token|auth"
    r"|(?:api|private|access|signing|encryption)[ _-]?key)"
    r"(?P<kq>\\?[\"'])?(?P<s1>[ \t]{0,16})(?P<sep>:=|=>|=|:(?!:))(?P<s2>[ \t]{0,16})"
    # Each value is runs of plain characters (one fast loop each) joined by up to eight
    # escapes or separators, so a text of nothing but keys stays cheap.
    r"(?:\\\"(?P<eq>[^\"\\\r\n]{0,256}(?:\\[^\"\r\n][^\"\\\r\n]{0,256}){0,8})(?:\\\"|(?=[\r\n]|\Z))"
    r"|\"(?P<dq>[^\"\\\r\n]{0,256}(?:\\[^\r\n][^\"\\\r\n]{0,256}){0,8})(?:\"|(?=[\r\n]|\Z))"
    r"|'(?P<sq>[^'\r\n]{1,256})(?:'|(?=[\r\n]|\Z))"
    r"|`(?P<bq>[^`\r\n]{1,256})(?:`|(?=[\r\n]|\Z))"
    r"|(?P<v>[^\s\"'`;&,]{1,256}"
    r"(?:[;&,](?![ \t]{0,4}[\w.-]{1,64}[ \t]{0,4}[=:])[^\s\"'`;&,]{0,256}){0,8}))",
    re.ASCII | re.IGNORECASE,
)
_QUOTED_VALUES = ("eq", "dq", "sq", "bq")
# How each credential word begins: the windows start where one occurs.
_CREDENTIAL_STEMS = (
    b"pass", b"pwd", b"secret", b"token", b"auth", b"api", b"private", b"access", b"signing",
    b"encryption",
)  # fmt: skip
# Longest word + quotes + spaces + separator + the longest value + the lookahead after it
# (an anchored match reads only what it matches, so a long window costs nothing).
_CREDENTIAL_REACH = 2560
_KEY_CHARS = frozenset(string.ascii_letters + string.digits + "_.-")
_KEY_PREFIX_MAX = 64
# Short words glued to a prefix are other words ("bypass", "OLDPWD", "oauth").
_UNGLUED_WORDS = frozenset({"pass", "pwd", "auth"})
# What stands where a value goes without being one: types, switches, redactions.
_NOT_VALUES = frozenset({
    "true", "false", "null", "none", "nil", "undefined", "yes", "no", "on", "off",
    "required", "optional", "string", "str", "int", "bool", "boolean", "object", "bytes",
    "hidden", "redacted", "masked", "removed", "unset", "empty", "na", "n/a", "tbd", "todo",
    "secret", "password", "passwd", "token",
})  # fmt: skip
# References and templates, not values: ${X}, $X, {{ x }}, {x}, %s, %(x)s, <x>, [x], (x),
# and runs of mask characters (****, xxxx).
_REFERENCE = _rx(
    r"\$\{[^}]*\}|\$\([^)]*\)|\$[A-Za-z_]\w*|\{\{.*\}\}|\{[\w.]*\}|%\(\w+\)[sd]|%[sd]"
    r"|<.*>|\[.*\]|\(.*\)|\*+|[xX]+|[.#?_-]+"
)
# Code, not a value: a call or index (`getpass()`, `os.environ[...]`), a dotted name
# (`args.token`, `settings.SECRET_KEY`).
_IDENTIFIER = r"[A-Za-z_$][\w$]*"
_EXPRESSION = _rx(rf"{_IDENTIFIER}(?:\.{_IDENTIFIER})*[(\[].*|{_IDENTIFIER}(?:\.{_IDENTIFIER})+")
_NAME = _rx(r"[A-Za-z_]+")
_CLOSERS = {")": "(", "]": "[", "}": "{"}


def _userinfo(m: re.Match[str]) -> Span | None:
    """`user:password` after a scheme (`https://`, `postgres+psycopg://`)."""
    i = m.start()
    return m.span("ui") if i and m.string[i - 1] in _SCHEME_CHARS else None


def _credential_windows(view: _View) -> list[Span]:
    """A window from each place a credential word may start (any case), for an anchored
    match: prose full of "API", "access" and "tokens" then costs one failed match per word
    instead of a case-insensitive search through every position. A text with no '=' and
    no ':' holds no credential at all."""
    if "=" not in view.text and ":" not in view.text:
        return []
    lower, n = view.ascii.lower(), len(view.text)
    starts: list[int] = []
    for stem in _CREDENTIAL_STEMS:
        i = lower.find(stem)
        while i != -1:
            starts.append(i)
            i = lower.find(stem, i + len(stem))
    return [(i, min(n, i + _CREDENTIAL_REACH)) for i in sorted(starts)]


def _key_prefix(text: str, start: int, word: str) -> str | None:
    """What is glued before the credential word (`DB_`, `x-api-`), or None if the word
    is the tail of another word ("bypass", "OLDPWD"; camelCase `userPass` is a key)."""
    j, floor = start, max(0, start - _KEY_PREFIX_MAX)
    while j > floor and text[j - 1] in _KEY_CHARS:
        j -= 1
    prefix = text[j:start]
    if prefix and prefix[-1].isalnum() and word.lower() in _UNGLUED_WORDS:
        camel = not prefix[-1].isupper() and text[start].isupper()
        return prefix if camel else None
    return prefix


def _trim(value: str) -> str:
    """Drop sentence punctuation and unbalanced closing brackets after an unquoted value
    ("password=abc123." and "f(password=abc123)" both hold "abc123")."""
    while value:
        last = value[-1]
        if last in ".,:;" or (last in _CLOSERS and value.count(last) > value.count(_CLOSERS[last])):
            value = value[:-1]
        else:
            break
    return value


def _looks_like_password(value: str) -> bool:
    """For a value that may be prose ("Password: required", "Token: 12"): six or more
    characters mixing at least two of lower, upper (a leading capital does not count),
    digits and symbols; or six or more digits."""
    if len(value) < 6 or "://" in value:
        return False
    if value.isdigit():
        return True
    classes = (
        any(c.islower() for c in value),
        any(c.isupper() for c in value[1:]),
        any(c.isdigit() for c in value),
        any(not c.isalnum() and c not in "_-." for c in value),
    )
    return sum(classes) >= 2


def _letters(s: str) -> str:
    return "".join(c for c in s.lower() if c.isalpha())


def _is_value(value: str, word: str, *, quoted: bool, strong: bool) -> bool:
    """Whether what follows the key is a credential rather than a type, a template, a
    variable or code: `password=${DB_PASSWORD}`, `token=args.token`, `pwd=/home/bob`."""
    lowered = value.lower()
    if len(value) < 4 or lowered in _NOT_VALUES or _REFERENCE.fullmatch(value):
        return False
    if not quoted:
        if _EXPRESSION.fullmatch(value):
            return False
        if _NAME.fullmatch(value) and _letters(word) in _letters(value):
            return False  # a variable passed on: `password=new_password`
        if word.lower() == "pwd" and value[0] in "/~.":
            return False  # the shell's working directory
    return strong or _looks_like_password(value)


def _credential(m: re.Match[str]) -> Span | None:
    """The value of a credential key, if it is one.

    A quoted value, a quoted or compound key (`DB_PASSWORD`, `client_secret`) and a tight
    `key=value` are data; a bare word and a colon (`Password: ...`) may be prose, so the
    value must also look like a password.
    """
    word = m.group("word")
    prefix = _key_prefix(m.string, m.start(), word)
    if prefix is None:
        return None
    group = next((g for g in _QUOTED_VALUES if m.group(g) is not None), "v")
    start = m.start(group)
    quoted = group != "v"
    value = m.group(group) if quoted else _trim(m.group(group))
    tight = m.group("sep") == "=" and not m.group("s1") and not m.group("s2")
    joined = word.lower().endswith("key") and " " not in word  # apikey, privateKey
    compound = bool(prefix) or "_" in word or "-" in word or joined
    strong = quoted or tight or compound or m.group("kq") is not None
    if not _is_value(value, word, quoted=quoted, strong=strong):
        return None
    return (start, start + len(value))


# --------------------------------------------------------------------------- e-mail

# Searched from the '@' (a literal: fast); the local part is then walked back in Python.
_EMAIL_DOMAIN = _rx(
    r"@[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
    r"(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*"
    r"\.[A-Za-z]{2,24}(?![\w-])"
)
_LOCAL_CHARS = frozenset(string.ascii_letters + string.digits + "._%+-")


def _email(m: re.Match[str]) -> Span | None:
    # Linear overall: each walk stops at the previous '@' or any other non-local character.
    text, start = m.string, m.start()
    while start > 0 and text[start - 1] in _LOCAL_CHARS:
        start -= 1
    return (start, m.end()) if start < m.start() else None


# --------------------------------------------------------------------------- numbers

# Every numeric value below (card, SSN, resident number, IPv4, phone) lies in a run of
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


# --------------------------------------------------------------------------- IBAN

# Registry lengths (SWIFT IBAN registry): a known length lets the match stop exactly at the
# IBAN's end even when words or numbers follow it.
_IBAN_LENGTHS: Mapping[str, int] = {
    "AD": 24, "AE": 23, "AL": 28, "AT": 20, "AZ": 28, "BA": 20, "BE": 16, "BG": 22,
    "BH": 22, "BI": 27, "BR": 29, "BY": 28, "CH": 21, "CR": 22, "CY": 28, "CZ": 24,
    "DE": 22, "DJ": 27, "DK": 18, "DO": 28, "EE": 20, "EG": 29, "ES": 24, "FI": 18,
    "FK": 18, "FO": 18, "FR": 27, "GB": 22, "GE": 22, "GI": 23, "GL": 18, "GR": 27,
    "GT": 28, "HR": 21, "HU": 28, "IE": 22, "IL": 23, "IQ": 23, "IS": 26, "IT": 27,
    "JO": 30, "KW": 30, "KZ": 20, "LB": 28, "LC": 32, "LI": 21, "LT": 20, "LU": 20,
    "LV": 21, "LY": 25, "MC": 27, "MD": 24, "ME": 22, "MK": 19, "MN": 20, "MR": 27,
    "MT": 31, "MU": 30, "NI": 28, "NL": 18, "NO": 15, "OM": 23, "PK": 24, "PL": 28,
    "PS": 29, "PT": 25, "QA": 29, "RO": 24, "RS": 22, "RU": 33, "SA": 24, "SC": 31,
    "SD": 18, "SE": 24, "SI": 19, "SK": 24, "SM": 27, "SO": 23, "ST": 25, "SV": 28,
    "TL": 23, "TN": 24, "TR": 26, "UA": 29, "VA": 22, "VG": 24, "XK": 20, "YE": 30,
}  # fmt: skip
_IBAN = _rx(r"(?<![A-Za-z0-9])[A-Z]{2}\d{2}(?: ?[A-Z0-9]){11,30}")
# Two capitals and two digits start every IBAN; 34 characters plus spaces (and one more for
# the end check) fit in 44.
_IBAN_SEEDS = _class_seeds(
    _table({string.ascii_uppercase: "A", string.digits: "0"}), b"AA00", width=44
)


def _mod97(iban: str) -> bool:
    rearranged = iban[4:] + iban[:4]
    return int("".join(str(int(c, 36)) for c in rearranged)) % 97 == 1


def _iban(m: re.Match[str]) -> Span | None:
    length = _IBAN_LENGTHS.get(m.group(0)[:2])
    if length is None:
        return None
    positions = [i for i, c in enumerate(m.group(0)) if c != " "]
    if len(positions) < length:
        return None
    end = m.start() + positions[length - 1] + 1
    if m.string[end : end + 1].isalnum():
        return None
    compact = m.group(0).replace(" ", "")[:length]
    return (m.start(), end) if _mod97(compact) else None


# --------------------------------------------------------------------------- cards

# Issuers' first digits are 2-6 (Mastercard 2/5, Amex/Diners/JCB 3, Visa 4, Discover/
# UnionPay 6); that keeps 13-digit millisecond timestamps and most ids out. Grouped forms
# use one separator throughout (4-4-4-4, 4-6-5, 4-4-4-4-3).
_CARD = _rx(
    r"(?<![\w.+-])[2-6]\d{3}"
    r"(?:(?P<sep>[ -])\d{3,6}(?:(?P=sep)\d{3,6}){1,4}|\d{9,15})"
    r"(?![\w]|[.,]\d)"
)
_CARD_SEPARATOR = _rx(r"[ -]")


def _luhn(digits: str) -> bool:
    total = 0
    for i, c in enumerate(reversed(digits)):
        d = int(c) * (2 if i % 2 else 1)
        total += d - 9 if d > 9 else d
    return total % 10 == 0


def _card(m: re.Match[str]) -> Span | None:
    """Luhn-check the match; if it fails, drop trailing groups (a card then more numbers)."""
    groups = _CARD_SEPARATOR.split(m.group(0))
    while groups:
        digits = "".join(groups)
        if len(digits) < 13:
            return None
        if len(digits) <= 19 and _luhn(digits):
            return (m.start(), m.start() + len(digits) + len(groups) - 1)
        groups.pop()
    return None


# --------------------------------------------------------------------------- national ids

_SSN = _rx(r"(?<![\w-])(?!000|666|9)\d{3}-(?!00)\d{2}-(?!0000)\d{4}(?![\w]|-\d)")
_KR_RRN = _rx(r"(?<![\w-])(?P<date>\d{6})-(?P<g>[1-8])\d{6}(?![\w]|-\d)")
# The gender digit also tells the century: 1, 2, 5, 6 -> 1900s; 3, 4, 7, 8 -> 2000s.
_RRN_CENTURY = {g: 1900 for g in "1256"} | {g: 2000 for g in "3478"}
_RRN_WEIGHTS = (2, 3, 4, 5, 6, 7, 8, 9, 2, 3, 4, 5)


def _rrn_date_ok(m: re.Match[str]) -> bool:
    date, year = m.group("date"), _RRN_CENTURY[m.group("g")] + int(m.group("date")[:2])
    try:
        datetime.date(year, int(date[2:4]), int(date[4:6]))
    except ValueError:
        return False
    return True


def _rrn_checksum_ok(number: str) -> bool:
    digits = [int(c) for c in number if c.isdigit()]
    total = sum(d * w for d, w in zip(digits, _RRN_WEIGHTS, strict=False))
    return (11 - total % 11) % 10 == digits[12]


def _kr_rrn(m: re.Match[str]) -> Span | None:
    return m.span() if _rrn_date_ok(m) else None


def _kr_rrn_strict(m: re.Match[str]) -> Span | None:
    return m.span() if _rrn_date_ok(m) and _rrn_checksum_ok(m.group(0)) else None


# --------------------------------------------------------------------------- IP

_OCTET = r"(?:25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)"
_IPV4 = _rx(rf"(?<![\w.])(?:{_OCTET}\.){{3}}{_OCTET}(?![\w]|\.\d)")
# An IPv6 address holds "::" or, written out, four colons with 1-4 hex digits between them
# (times and ratios do not): a literal-led search for that, then the address is the run of
# hex digits, ':' and '.' around it.
_IPV6_SEED = _rx(r":(?::|(?:[0-9A-Fa-f]{1,4}:){3})")
_IPV6_RUN = _rx(r"[0-9A-Fa-f:.]+")
_IPV6_CHARS = frozenset(string.hexdigits + ":.")
_IPV6_MAX = 45  # ffff:ffff:ffff:ffff:ffff:ffff:255.255.255.255


def _ipv6_runs(view: _View) -> list[Span]:
    """Runs of hex digits, ':' and '.' around each seed that could be an address.

    Each run is taken once (the search resumes after it), so text full of colons stays
    linear; runs too long, or without "::" and with under 6 colons (MAC addresses), are
    dropped before any parsing.
    """
    text, pos = view.text, 0
    out: list[Span] = []
    while (seed := _IPV6_SEED.search(text, pos)) is not None:
        start, floor = seed.start(), max(0, seed.start() - _IPV6_MAX - 1)
        while start > floor and text[start - 1] in _IPV6_CHARS:
            start -= 1
        run = _IPV6_RUN.match(text, seed.start())
        pos = run.end() if run else seed.end()
        candidate = text[start:pos]
        if (
            (start > floor or floor == 0)
            and len(candidate) <= _IPV6_MAX + 1  # + a full stop after it
            and ("::" in candidate or candidate.count(":") >= 6)
        ):
            out.append((start, pos))
    return out


def _ipv6(m: re.Match[str]) -> Span | None:
    """A valid IPv6 address with enough substance to not be code: `x[1::2]`, `a::b` stay.

    Needs three non-empty groups, or two with a full first group (`fe80::1`,
    `2001:db8::`). The loopback `::1` is therefore not masked.
    """
    text, start, end = m.string, m.start(), m.end()
    while end > start and text[end - 1] == ".":  # a full stop after the address
        end -= 1
    if (start and text[start - 1] in _WORD_CHARS) or text[end : end + 1] in _WORD_CHARS:
        return None
    address = text[start:end]
    try:
        ipaddress.IPv6Address(address)
    except ValueError:
        return None
    groups = [g for g in address.split(":") if g]
    n = len(groups) + (1 if "." in address else 0)
    return (start, end) if n >= 3 or (n == 2 and len(groups[0]) == 4) else None


# --------------------------------------------------------------------------- phones

_PHONE_INTL = _rx(r"(?<![\w+])\+\d+(?:\(\d+\)|[ .-]\(\d+\)|[ .-]\d+|(?<=\))\d+)*(?![\w])")
# `(?<!\d[ .-])`: not the tail of a longer digit sequence (a card, an IBAN, a list).
_PHONE_US = _rx(
    r"(?<![\w+])(?<!\d[ .-])(?:1[ .-]?)?"
    r"(?:\(\d{3}\) ?\d{3}[ .-]\d{4}|\d{3}(?P<s>[.-])\d{3}(?P=s)\d{4}|[2-9]\d\d [2-9]\d\d \d{4})"
    r"(?![\w]|[.-]\d)"
)
_PHONE_KR = _rx(r"(?<![\w+])(?<!\d[ .-])01[016789](?P<s>[ .-]?)\d{3,4}(?P=s)\d{4}(?![\w]|[.-]\d)")
# National numbers with a trunk 0 (UK, DE, FR, KR landlines, JP, AU, ...): a leading 0 plus
# separated groups is the "phone-like structure" that years, prices and quantities lack.
_PHONE_NATIONAL = _rx(
    r"(?<![\w+.-])(?<!\d )(?:\(0\d{1,4}\)[ -]?|0(?!00)\d{1,4}[ .-])\d{2,8}(?:[ .-]\d{2,8}){0,4}"
    r"(?![\w]|[.-]\d)"
)
_PHONE_SEPARATOR = _rx(r"[ .-]")


def _trunk_zero(h: _Hit) -> bool:
    """A national number starts a run, or follows a space in it, with "0" or "(0"."""
    t = h.text
    return t.startswith(("0", "(0")) or " 0" in t or " (0" in t


def _digit_count(s: str) -> int:
    return sum(map(str.isdigit, s))


def _intl_phone(m: re.Match[str]) -> Span | None:
    return m.span() if 8 <= _digit_count(m.group(0)) <= 15 else None


def _national_phone(m: re.Match[str]) -> Span | None:
    """9-15 digits, one separator throughout (so "05.11.2023 14" is not a phone)."""
    s = m.group(0)
    tail = s[s.index(")") + 1 :].lstrip(" -") if s.startswith("(") else s
    if len(set(_PHONE_SEPARATOR.findall(tail))) > 1:
        return None
    return m.span() if 9 <= _digit_count(s) <= 15 else None


# --------------------------------------------------------------------------- registry


def _detectors(strict_kr_rrn: bool) -> list[_Detector]:
    """All detectors, strongest first: on overlap the earlier one wins.

    Specific secrets come first (a bearer token may contain anything), then credentials
    by their context (a URL's `user:password@` before the e-mail it resembles; a value
    after `password=` is one secret even if it holds an address), the checksummed
    numbers before the loose phone shapes, and the entropy heuristic last. Each `near`
    predicate is the least a number run needs for that pattern to have a chance.
    """
    d, near = _Detector, _near_numbers
    rrn = _kr_rrn_strict if strict_kr_rrn else _kr_rrn
    return [
        d("SECRET", _PEM, _whole, ("PRIVATE KEY-----",)),
        d("SECRET", _JWT, _whole, ("eyJ",)),
        d("SECRET", _BEARER, _auth_value, ("earer",)),
        d("SECRET", _BEARER_CAPS, _auth_value, ("EARER",)),
        d("SECRET", _BASIC, _auth_value, ("uthorization",)),
        *(d("SECRET", rx, _token_start, hints) for rx, hints in _KEYS.values()),
        d("SECRET", _AWS, _whole, ("AKIA", "ASIA")),
        d("SECRET", _SK, _sk_key, ("sk-",)),
        d("SECRET", _USERINFO, _userinfo, ("://",)),
        d("SECRET", _CREDENTIAL, _credential, where=_credential_windows, anchored=True),
        d("EMAIL", _EMAIL_DOMAIN, _email, ("@",)),
        d("IBAN", _IBAN, _iban, where=_IBAN_SEEDS),
        d("CARD", _CARD, _card, where=near(lambda h: h.digits >= 13)),
        d("KR_RRN", _KR_RRN, rrn, where=near(lambda h: h.digits >= 13 and "-" in h.text)),
        d("SSN", _SSN, _whole, where=near(lambda h: h.digits >= 9 and "-" in h.text)),
        d("IP", _IPV6_RUN, _ipv6, (":",), where=_ipv6_runs),
        d("IP", _IPV4, _whole, where=near(lambda h: h.text.count(".") >= 3)),
        d("PHONE", _PHONE_INTL, _intl_phone, where=near(lambda h: "+" in h.text)),
        d("PHONE", _PHONE_US, _whole, where=near(lambda h: h.digits >= 10)),
        d("PHONE", _PHONE_KR, _whole, where=near(lambda h: h.digits >= 10 and "01" in h.text)),
        d("PHONE", _PHONE_NATIONAL, _national_phone, where=near(_trunk_zero)),
        d("SECRET", _TOKEN, _token, where=_TOKEN_RUNS),
    ]


_PLACEHOLDER = _rx(r"<(?:" + "|".join(PII_TYPES) + r")_\d+>")

Finding = tuple[int, int, PiiType]


def _select(candidates: list[tuple[int, int, int, PiiType]]) -> list[Finding]:
    """Resolve overlaps: by detector rank, then longest, then leftmost; keep disjoint spans."""
    candidates.sort(key=lambda c: (c[0], c[1] - c[2], c[1]))
    starts: list[int] = []
    chosen: list[Finding] = []
    for _, start, end, kind in candidates:
        i = bisect_right(starts, start)
        if i and chosen[i - 1][1] > start:
            continue
        if i < len(chosen) and chosen[i][0] < end:
            continue
        starts.insert(i, start)
        chosen.insert(i, (start, end, kind))
    return chosen


class PiiMasker:
    """The detectors, compiled once and shared by every request (immutable, thread-safe).

    `kinds` limits detection to some types (default: all). `strict_kr_rrn` also requires
    the Korean resident number checksum; it is off by default because numbers issued since
    October 2020 no longer carry one, and the date check already makes the shape rare.
    """

    def __init__(
        self, *, kinds: Iterable[PiiType] | None = None, strict_kr_rrn: bool = False
    ) -> None:
        wanted = set(PII_TYPES if kinds is None else kinds)
        unknown = wanted - set(PII_TYPES)
        if unknown:
            raise ValueError(f"unknown PII types: {sorted(unknown)}")
        self._detectors = tuple(d for d in _detectors(strict_kr_rrn) if d.kind in wanted)

    def session(self) -> MaskSession:
        """A fresh per-request session: placeholder numbering and mapping start empty."""
        return MaskSession(self)

    def mask(self, text: str) -> str:
        """Mask one text in a throwaway session (no restore possible)."""
        return self.session().mask(text)

    def contains_pii(self, text: str) -> bool:
        """True if `mask` would change anything (block mode can stop at the first hit)."""
        return _guarded(lambda: next(self._scan(_text(text)), None) is not None)

    def find(self, text: str) -> list[Finding]:
        """Disjoint `(start, end, type)` spans to mask, left to right."""
        return _guarded(lambda: _select(list(self._scan(_text(text)))))

    def _scan(self, text: str) -> Iterator[tuple[int, int, int, PiiType]]:
        """Every validated match as `(rank, start, end, type)`; they may overlap."""
        view = _View(text)
        for rank, det in enumerate(self._detectors):
            for a, b in det.windows(view):
                if det.anchored:
                    found = det.pattern.match(text, a, b)
                    matches: Iterable[re.Match[str]] = () if found is None else (found,)
                else:
                    matches = det.pattern.finditer(text, a, b)
                for m in matches:
                    span = det.check(m)
                    if span is not None and span[0] < span[1]:
                        yield rank, span[0], span[1], det.kind


def _guarded(work: Callable[[], _T]) -> _T:
    """Run `work`, turning any internal failure into `MaskingError` (fail closed)."""
    try:
        return work()
    except MaskingError:
        raise
    except Exception as exc:
        raise MaskingError(f"PII masking failed ({type(exc).__name__})") from None


def _text(text: object) -> str:
    if not isinstance(text, str):
        raise MaskingError(f"cannot mask a {type(text).__name__}")
    return text


class MaskSession:
    """Per-request masking state: numbering, the placeholder <-> raw mapping, the counts.

    Create one per request with `PiiMasker.session()`; mask every text of the request
    through it so a value repeated across messages keeps one placeholder. Not thread-safe
    (a request is handled by one task). The raw values are held only here, in memory; the
    repr shows counts only.
    """

    __slots__ = ("_found", "_masker", "_next", "_reserved", "_to_placeholder", "_to_raw")

    def __init__(self, masker: PiiMasker) -> None:
        self._masker = masker
        self._to_placeholder: dict[tuple[PiiType, str], str] = {}
        self._to_raw: dict[str, str] = {}
        self._next: Counter[str] = Counter()
        self._reserved: set[str] = set()
        self._found: Counter[str] = Counter()

    def __repr__(self) -> str:
        return f"MaskSession(found={dict(self._found)!r})"

    @property
    def found(self) -> dict[str, int]:
        """Occurrences masked so far, by type (`{"EMAIL": 2}`): evidence without values."""
        return dict(self._found)

    def mask(self, text: str) -> str:
        """Return `text` with every detected value replaced by its placeholder."""
        return _guarded(lambda: self._mask_one(text, reserve=True))

    def mask_messages(self, messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
        """Mask chat messages; returns new message dicts, the input is left untouched.

        Masks string `content` and the `text` of content parts; every other field
        (role, name, tool_calls, image parts, ...) is copied as it is.
        """
        return _guarded(lambda: self._mask_messages(messages))

    def restore(self, text: str) -> str:
        """Put the raw values back for this session's placeholders in `text`.

        Placeholders this session did not create (or that the model mangled) stay as they
        are.
        """
        if not self._to_raw or "<" not in text:
            return text
        return _PLACEHOLDER.sub(lambda m: self._to_raw.get(m.group(0), m.group(0)), text)

    def restore_stream(self) -> StreamRestorer:
        """An incremental restorer for one stream of text deltas (one per choice index)."""
        return StreamRestorer(self, self._to_raw.keys())

    def _mask_messages(self, messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
        # Reserve literal placeholder-shaped text of every message before numbering, so a
        # client's own "<EMAIL_1>" is never confused with ours on restore.
        for message in messages:
            for text in _message_texts(message):
                self._reserve(text)
        return [self._mask_message(m) for m in messages]

    def _mask_message(self, message: Mapping[str, Any]) -> dict[str, Any]:
        content = message.get("content")
        out = dict(message)
        if isinstance(content, str):
            out["content"] = self._mask_one(content, reserve=False)
        elif isinstance(content, list):
            out["content"] = [self._mask_part(p) for p in content]
        name = message.get("name")
        if isinstance(name, str):
            # A name must stay a name (OpenAI: [A-Za-z0-9_-]): the placeholder without <>.
            masked = self._mask_one(name, reserve=False)
            if masked != name:
                out["name"] = masked.replace("<", "").replace(">", "")
        calls = message.get("tool_calls")
        if isinstance(calls, list):
            out["tool_calls"] = [self._mask_call(c) for c in calls]
        return out

    def _mask_call(self, call: Any) -> Any:
        """A tool call with its `function.arguments` (a JSON string) masked."""
        if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
            return call
        args = call["function"].get("arguments")
        if not isinstance(args, str):
            return call
        return {**call, "function": {**call["function"], "arguments": self.mask_inline(args)}}

    def mask_inline(self, text: str) -> str:
        """`mask` for a text that is part of a message already reserved."""
        return self._mask_one(text, reserve=False)

    def _mask_part(self, part: Any) -> Any:
        if isinstance(part, str):
            return self._mask_one(part, reserve=False)
        if isinstance(part, dict) and "text" in part:
            return {**part, "text": self._mask_one(part["text"], reserve=False)}
        return part

    def _mask_one(self, text: str, *, reserve: bool) -> str:
        if reserve:
            self._reserve(text)
        findings = self._masker.find(text)
        if not findings:
            return text
        pieces: list[str] = []
        pos = 0
        for start, end, kind in findings:
            pieces += (text[pos:start], self._placeholder(kind, text[start:end]))
            pos = end
        pieces.append(text[pos:])
        return "".join(pieces)

    def _reserve(self, text: str) -> None:
        if "<" in _text(text):
            self._reserved.update(_PLACEHOLDER.findall(text))

    def _placeholder(self, kind: PiiType, raw: str) -> str:
        self._found[kind] += 1
        key = (kind, raw)
        placeholder = self._to_placeholder.get(key)
        if placeholder is None:
            placeholder = self._new_placeholder(kind)
            self._to_placeholder[key] = placeholder
            self._to_raw[placeholder] = raw
        return placeholder

    def _new_placeholder(self, kind: PiiType) -> str:
        while True:
            self._next[kind] += 1
            placeholder = f"<{kind}_{self._next[kind]}>"
            if placeholder not in self._reserved:
                return placeholder


def _message_texts(message: Mapping[str, Any]) -> Iterator[str]:
    """The texts `mask_messages` will mask; fails closed on shapes it cannot read."""
    if not isinstance(message, Mapping):
        raise MaskingError(f"a message must be an object, not {type(message).__name__}")
    if isinstance(message.get("name"), str):
        yield message["name"]
    for call in message.get("tool_calls") or ():
        if isinstance(call, dict) and isinstance(call.get("function"), dict):
            args = call["function"].get("arguments")
            if isinstance(args, str):
                yield args
    content = message.get("content")
    if content is None:
        return
    if isinstance(content, str):
        yield content
    elif isinstance(content, list):
        for part in content:
            if isinstance(part, str):
                yield part
            elif isinstance(part, dict) and "text" in part:
                yield part["text"]
    else:
        raise MaskingError(f"message content must be text or parts, not {type(content).__name__}")


class StreamRestorer:
    """Restores placeholders in a stream of deltas, even when one is split across chunks.

    A trailing `<...` that could still grow into one of the session's placeholders is held
    back (never more than the longest placeholder) and emitted with the next chunk;
    `flush()` returns whatever is held at the end of the stream.
    """

    __slots__ = ("_held", "_max_len", "_placeholders", "_session")

    def __init__(self, session: MaskSession, placeholders: Iterable[str]) -> None:
        self._session = session
        self._placeholders = tuple(placeholders)
        self._max_len = max(map(len, self._placeholders), default=0)
        self._held = ""

    def feed(self, chunk: str) -> str:
        """Return the restored text that is safe to emit now (may be empty)."""
        text = self._held + chunk
        cut = self._safe_cut(text)
        self._held = text[cut:]
        return self._session.restore(text[:cut])

    def flush(self) -> str:
        """Return (restored) whatever is still held; call once at the end of the stream."""
        text, self._held = self._held, ""
        return self._session.restore(text)

    def _safe_cut(self, text: str) -> int:
        i = text.rfind("<", max(0, len(text) - self._max_len))
        if i < 0:
            return len(text)
        tail = text[i:]
        if ">" not in tail and any(p.startswith(tail) for p in self._placeholders):
            return i
        return len(text)


_DEFAULT = PiiMasker()


def contains_pii(text: str) -> bool:
    """True if `text` holds any PII type the default masker detects."""
    return _DEFAULT.contains_pii(text)


def mask_request(session: MaskSession, req: Generation) -> Generation:
    """The request with every field that can carry user text masked: chat `messages`
    (content and content-part text, names, tool-call arguments), completion `prompt`
    (a text or a list of texts) and `user`."""
    messages, prompt, user = req.messages, req.prompt, req.user
    if messages is not None:
        messages = session.mask_messages(messages)
    if isinstance(prompt, str):
        prompt = session.mask(prompt)
    elif isinstance(prompt, list) and all(isinstance(p, str) for p in prompt):
        prompt = [session.mask(p) for p in prompt]
    if user is not None:
        user = session.mask(user).replace("<", "").replace(">", "")
    return msgspec.structs.replace(req, messages=messages, prompt=prompt, user=user)
