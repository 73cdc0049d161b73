"""Secrets and credentials: keys, tokens and passwords, found by their shape or their key.

Specific formats first (PEM private keys, JWTs, `Bearer` and `Basic` values, vendor keys,
AWS and `sk-` keys), then credentials by their context: a URL's `user:password@`, and a
value under a credential key (`password=...`, `"api_key": "..."`), of which only the value
is masked. A long random-looking run is the last resort (`_token`).
"""

from __future__ import annotations

import math
import re
import string
from collections import Counter

from switchyard.policy.pii_detector import (
    _TABLES,
    _WORD_CHARS,
    Span,
    _follows,
    _long_runs,
    _rx,
    _table,
    _View,
    _whole,
)
from switchyard.policy.pii_identifiers import personal_number

# --------------------------------------------------------------------------- secrets

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
_CREDENTIAL_STEMS: tuple[bytes, ...] = tuple(
    stem.encode() for stem in _TABLES["credentials"]["stems"]
)
# Longest word + quotes + spaces + separator + the longest value + the lookahead after it
# (an anchored match reads only what it matches, so a long window costs nothing).
_CREDENTIAL_REACH = 2560
_KEY_CHARS = frozenset(string.ascii_letters + string.digits + "_.-")
_KEY_PREFIX_MAX = 64
# Short words glued to a prefix are other words ("bypass", "OLDPWD", "oauth").
_UNGLUED_WORDS = frozenset(_TABLES["credentials"]["unglued"])
# What stands where a value goes without being one: types, switches, redactions.
_NOT_VALUES = frozenset(_TABLES["credentials"]["not_values"])
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


# --------------------------------------------------------------------------- identifiers

# The key shapes a credential has by its format alone: vendor keys, `sk-` keys (OpenAI's
# `sk-proj-...`, the gateway's own `sk-sy-...`), AWS access key ids, JWTs. Not the
# entropy heuristic (`_token`): a random id (a UUID, a hex digest) is an id, not a key.
_ID_SECRETS = (
    *((rx, _token_start) for rx, _ in _KEYS.values()),
    (_SK, _sk_key),
    (_AWS, _whole),
    (_JWT, _whole),
)


def credential_shaped(value: str) -> bool:
    """True if `value` holds a credential by its shape, or a personal number (a card
    number, an IBAN, a national id: pii_identifiers.py `personal_number`): what a client
    pasted where an id belongs (`x-request-id`, `x-task-id`, `Idempotency-Key`, ...),
    which must be refused rather than kept in usage rows, traces, spans and tables."""
    for rx, check in _ID_SECRETS:
        for m in rx.finditer(value):
            if check(m) is not None:
                return True
    return personal_number(value)
