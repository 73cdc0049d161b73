"""PII masking: find personal data and secrets in request text, swap them for typed placeholders.

Masked text is what reaches cache keys, embeddings, stored traces and logs, so this runs on
every request: pure Python over precompiled regexes (no network, no models). Python's regex
engine pays for every start position it tries, so most patterns search only small windows
that literal or `bytes.translate` searches found first (see pii_detector.py); every pass is
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

This module holds the masker, its registry of detectors, the session and the stream
restorer, and the card detector. The detectors sit beside it: `pii_detector.py` (the
detector contract and the window finders), `pii_secrets.py` (keys, tokens, credentials),
`pii_identifiers.py` (e-mail, IBAN, national ids, IP, phones); their word lists and tables
are in `pii_tables.toml`.
"""

from __future__ import annotations

import re
import unicodedata
from bisect import bisect_right
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from itertools import chain
from typing import Any, Literal, TypeVar, get_args

import msgspec

from switchyard.policy.pii_detector import (
    PII_TYPES,
    PiiType,
    Span,
    _Detector,
    _near_numbers,
    _rx,
    _View,
    _whole,
)
from switchyard.policy.pii_identifiers import (
    _EMAIL_DOMAIN,
    _IBAN,
    _IBAN_SEEDS,
    _IPV4,
    _IPV6_RUN,
    _KR_RRN,
    _PHONE_INTL,
    _PHONE_KR,
    _PHONE_NATIONAL,
    _PHONE_US,
    _SSN,
    _email,
    _iban,
    _intl_phone,
    _ipv6,
    _ipv6_runs,
    _kr_rrn,
    _kr_rrn_strict,
    _luhn,
    _national_phone,
    _trunk_zero,
)
from switchyard.policy.pii_secrets import (
    _AWS,
    _BASIC,
    _BEARER,
    _BEARER_CAPS,
    _CREDENTIAL,
    _JWT,
    _KEYS,
    _PEM,
    _SK,
    _TOKEN,
    _TOKEN_RUNS,
    _USERINFO,
    _auth_value,
    _credential,
    _credential_windows,
    _sk_key,
    _token,
    _token_start,
    _userinfo,
)
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


class MaskingError(Exception):
    """Masking failed internally; the request must fail closed (never go out unmasked).

    The message names only the kind of failure: the original exception is not chained,
    because its text could quote the raw value and end up in a log.
    """


_T = TypeVar("_T")


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


def _fold_table() -> dict[int, str]:
    """What a reader (a tokenizer, a model, a person) reads in place of a character
    the detectors' ASCII patterns would not match: nothing for an invisible one
    (Unicode format and control characters: a zero-width space, a soft hyphen, a
    byte-order mark, NUL), its ASCII for a compatibility form (full-width at signs
    and digits, mathematical letters, a no-break or ideographic space: NFKC), `-` for
    a dash, and a tag character's ASCII (U+E0041 is an `A` to a model that reads
    tags). Tab, line feed and carriage return are text."""
    table: dict[int, str] = {cp: "" for cp in chain(range(0x20), range(0x7F, 0xA0))}
    for cp in (0x09, 0x0A, 0x0D):
        del table[cp]
    for cp in chain(range(0xA0, 0xD800), range(0xE000, 0x10000), range(0x1D400, 0x1D800)):
        c = chr(cp)
        if unicodedata.category(c) == "Cf":
            table[cp] = ""
            continue
        nfkc = unicodedata.normalize("NFKC", c)
        if nfkc != c and nfkc.isascii():
            table[cp] = nfkc
    for dash in "\u2010\u2011\u2012\u2013\u2014\u2015\u2212\ufe58\ufe63":
        table[ord(dash)] = "-"
    for cp in range(0xE0000, 0xE0080):  # tags: invisible, read as ASCII by some models
        table[cp] = chr(cp - 0xE0000) if 0x20 <= cp - 0xE0000 < 0x7F else ""
    return table


def _char_class(cps: Iterable[int]) -> re.Pattern[str]:
    """A character class of the code points `cps` (ascending), written as ranges."""
    runs: list[list[int]] = []
    for cp in cps:
        if runs and runs[-1][1] == cp - 1:
            runs[-1][1] = cp
        else:
            runs.append([cp, cp])
    ranges = (re.escape(chr(a)) + ("" if a == b else "-" + re.escape(chr(b))) for a, b in runs)
    return re.compile("[" + "".join(ranges) + "]")


_FOLD = _fold_table()
# A class of BMP ranges is searched in ~2 ns a character, one that also holds many
# astral ranges ~15 times slower: the astral characters are looked for by their two
# blocks (mathematical letters, tags), and the whole class (`_FOLDABLE`) is read only
# in a text that holds one of them.
_FOLDABLE_ASCII = _char_class(cp for cp in sorted(_FOLD) if cp < 0x80)
_FOLDABLE_BMP = _char_class(cp for cp in sorted(_FOLD) if cp < 0x10000)
_FOLDABLE_ASTRAL = re.compile("[\U0001d400-\U0001d7ff\U000e0000-\U000e007f]")
_FOLDABLE = _char_class(sorted(_FOLD))


# The most characters `_folded` replaces one by one; past it, one translate (~30 ns a
# character) costs less than a replace each (~1 ns a character each).
_REPLACES = 16


def _same(at: int) -> int:
    return at


def _folded(text: str) -> tuple[str, Callable[[int], int]] | None:
    """(the text as the detectors read it, the index in `text` of each of its
    characters), or None when that is `text` itself (nearly every text: one C scan,
    none of the rest). Each character of `_FOLD` becomes its reading; the others stay."""
    if text.isascii():
        rx = _FOLDABLE_ASCII
    elif _FOLDABLE_ASTRAL.search(text) is None:
        rx = _FOLDABLE_BMP
    else:
        rx = _FOLDABLE
    first = rx.search(text)
    if first is None:
        return None
    found = set(rx.findall(text, first.start()))
    if all(len(_FOLD[ord(c)]) == 1 for c in found):
        # Each read as one character (a no-break space, a full-width form, a dash):
        # the view has the text's own indices, and is made by a few C replaces, or,
        # for a text of many different ones (a replace each would read the whole
        # text again: a megabyte of a thousand full-width and mathematical letters
        # took 0.8 s, the event loop's), by one translate.
        if len(found) > _REPLACES:
            return text.translate({ord(c): _FOLD[ord(c)] for c in found}), _same
        for c in found:
            text = text.replace(c, _FOLD[ord(c)])
        return text, _same
    pieces: list[str] = []
    starts: list[int] = []  # where each piece starts in the view
    origins: list[int] = []  # a run's start in `text`, or -1 - the character read
    size = pos = 0
    for m in rx.finditer(text, first.start()):
        i = m.start()
        if i > pos:
            pieces.append(text[pos:i])
            starts.append(size)
            origins.append(pos)
            size += i - pos
        reading = _FOLD[ord(text[i])]
        if reading:
            pieces.append(reading)
            starts.append(size)
            origins.append(-1 - i)
            size += len(reading)
        pos = i + 1
    if pos < len(text):
        pieces.append(text[pos:])
        starts.append(size)
        origins.append(pos)

    def origin(at: int) -> int:
        k = bisect_right(starts, at) - 1
        o = origins[k]
        return o + at - starts[k] if o >= 0 else -1 - o

    return "".join(pieces), origin


Finding = tuple[int, int, PiiType]

# A JSON escape that matters to a reader: a `\\` pair (kept, so the escape after it is
# not misread), a surrogate pair, any `\uXXXX`, an escaped solidus.
_ESCAPE = _rx(
    r"\\(?:u([dD][89abAB][0-9a-fA-F]{2})\\u([dD][c-fC-F][0-9a-fA-F]{2})|u([0-9a-fA-F]{4})|([\\/]))"
)


def _unescape(m: re.Match[str]) -> str:
    high, low, one, other = m.groups()
    if high is not None:
        return chr(0x10000 + ((int(high, 16) - 0xD800) << 10) + int(low, 16) - 0xDC00)
    if one is not None:
        cp = int(one, 16)
        # Kept: what a JSON string must escape (controls, a quote, a backslash) and a
        # lone surrogate, so a JSON text stays the same JSON.
        if cp < 0x20 or cp in (0x22, 0x5C) or 0xD800 <= cp < 0xE000:
            return m.group(0)
        return chr(cp)
    return "/" if other == "/" else m.group(0)


def _json_unescaped(text: str) -> str:
    """`text` with its JSON `\\uXXXX` (and `\\/`) escapes decoded where that keeps a
    JSON text the same JSON (quotes, backslashes, controls and lone surrogates stay
    escaped): what a tool reading its arguments, or a model, reads. `text` itself when
    it has none."""
    if "\\u" not in text and "\\/" not in text:
        return text
    out = _ESCAPE.sub(_unescape, text)
    return text if out == text else out


def _json_view(text: str) -> tuple[str, Callable[[int, int], tuple[int, int]]] | None:
    """(`_json_unescaped(text)`, the span of `text` each span of it was read from), or
    None when that is `text` itself. A span that starts or ends inside a decoded
    escape covers the whole escape, so a masked text keeps every other character as
    the client wrote it (a `\\u00e9` in a question about escapes stays written so)."""
    if "\\u" not in text and "\\/" not in text:
        return None
    starts: list[int] = []  # where each piece starts in the view
    runs: list[tuple[int, int]] = []  # (its start in `text`, -1) or an escape's (start, end)
    pieces: list[str] = []
    size = pos = 0
    for m in _ESCAPE.finditer(text):
        reading = _unescape(m)
        if reading == m.group(0):
            continue  # kept as written: part of the text around it
        i = m.start()
        if i > pos:
            pieces.append(text[pos:i])
            starts.append(size)
            runs.append((pos, -1))
            size += i - pos
        pieces.append(reading)
        starts.append(size)
        runs.append((i, m.end()))
        size += len(reading)
        pos = m.end()
    if not runs:
        return None
    if pos < len(text):
        pieces.append(text[pos:])
        starts.append(size)
        runs.append((pos, -1))

    def span(start: int, end: int) -> tuple[int, int]:
        k = bisect_right(starts, start) - 1
        o, e = runs[k]
        a = o + start - starts[k] if e < 0 else o
        k = bisect_right(starts, end - 1) - 1
        o, e = runs[k]
        b = o + end - starts[k] if e < 0 else e
        return a, b

    return "".join(pieces), span


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

        def scan() -> bool:
            folded = _folded(_text(text))
            return next(self._scan(text if folded is None else folded[0]), None) is not None

        return _guarded(scan)

    def find(self, text: str) -> list[Finding]:
        """Disjoint `(start, end, type)` spans to mask, left to right. The detectors
        read the text as a reader does (`_folded`: an invisible character read
        through, a full-width at sign read as `@`); the spans are the text's own."""
        return _guarded(lambda: self._find(_text(text)))

    def _find(self, text: str) -> list[Finding]:
        folded = _folded(text)
        if folded is None:
            return _select(list(self._scan(text)))
        view, origin = folded
        # Two spans of the view may end and start inside one character's reading
        # (`℅` is read `c/o`: an address's last letter, the next one's first): that
        # character is masked once, by the first, so a restored text holds it once.
        out: list[Finding] = []
        after = 0
        for s, e, k in _select(list(self._scan(view))):
            start, end = max(origin(s), after), origin(e - 1) + 1
            if start < end:
                out.append((start, end, k))
                after = end
        return out

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


# The media payload of each media content part, sent as it came and never read for PII:
# an image's URL or base64 data (`image_url.url`), base64 audio (`input_audio.data`), a
# file's base64 data (`file.file_data`): the detectors read text. Only a content part's
# payload: every other member of the part (an image's `detail`, an audio's `format`, a
# file's name), and a member of any other object that shares a payload's name (a tool
# schema's property `image_url`, a `metadata` key `file_data`), is text and read.
_MEDIA = {"image_url": "url", "input_audio": "data", "file": "file_data"}
# Deeper than any body the API parses (api/body.py: 64 levels): fail closed.
_MAX_DEPTH = 80
# A string shorter than this made of letters (and underscores) only is a word no
# detector matches: each needs a digit, a separator (@ : = . - / whitespace) or a run
# of 20 characters or more (an AWS key id, a vendor key, a long token). Most strings
# of a request's structure are such words (roles, types, property names).
_PLAIN_MAX = 16
_Rule = Callable[["MaskSession", Any], Any]


def _plain(text: str) -> bool:
    return text.isalpha() or ("_" in text and text.replace("_", "").isalpha())


def _deep(depth: int) -> None:
    if depth > _MAX_DEPTH:
        raise MaskingError("a member is nested too deep to mask")


class MaskSession:
    """Per-request masking state: numbering, the placeholder <-> raw mapping, the counts.

    Create one per request with `PiiMasker.session()`; mask every text of the request
    through it so a value repeated across messages keeps one placeholder. Not thread-safe
    (a request is handled by one task). The raw values are held only here, in memory; the
    repr shows counts only.
    """

    __slots__ = (
        "_clean",
        "_found",
        "_masker",
        "_next",
        "_reserved",
        "_to_placeholder",
        "_to_raw",
    )

    def __init__(self, masker: PiiMasker) -> None:
        self._masker = masker
        self._to_placeholder: dict[tuple[PiiType, str], str] = {}
        self._to_raw: dict[str, str] = {}
        self._next: Counter[str] = Counter()
        self._reserved: set[str] = set()
        self._found: Counter[str] = Counter()
        # Texts found clean already: a text repeated across the request (a schema's
        # descriptions, a tool call's id) is scanned once.
        self._clean: set[str] = set()

    def __repr__(self) -> str:
        return f"MaskSession(found={dict(self._found)!r})"

    @property
    def found(self) -> dict[str, int]:
        """Occurrences masked so far, by type (`{"EMAIL": 2}`): evidence without values."""
        return dict(self._found)

    def mask(self, text: str) -> str:
        """Return `text` with every detected value replaced by its placeholder."""
        return _guarded(lambda: self._mask_one(text, reserve=True))

    def spans(self, text: str) -> list[tuple[int, int, str]]:
        """Where `mask(text)` puts a placeholder, and which: disjoint `(start, end,
        placeholder)`, left to right."""

        def found() -> list[tuple[int, int, str]]:
            self._reserve(text)
            return [(s, e, self._placeholder(k, text[s:e])) for s, e, k in self._masker.find(text)]

        return _guarded(found)

    def mask_messages(self, messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
        """Mask chat messages; returns new message dicts, the input is left untouched.

        Masks string `content` and the `text` of content parts, a `name` (kept a
        name), tool calls' arguments, and every other string of a message (a tool
        call's id, a refusal, a file's name, ...) but media payloads (`_MEDIA`).
        """

        def masked() -> list[dict[str, Any]]:
            out = self._mask_messages(messages)
            return [dict(o) if o is m else o for o, m in zip(out, messages, strict=True)]

        return _guarded(masked)

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
            self._reserve_all(message, 0)
        return self._mask_messages_reserved(messages)

    def _mask_messages_reserved(
        self, messages: Sequence[Mapping[str, Any]]
    ) -> list[dict[str, Any]]:
        """The messages masked (their placeholders reserved already): the very list
        when nothing in it changed."""
        out = [self._mask_message(m) for m in messages]
        if isinstance(messages, list) and all(a is b for a, b in zip(out, messages, strict=True)):
            return messages
        return out

    def _reserve_all(self, value: Any, depth: int) -> None:
        """Reserve the placeholder-shaped text of every string in a JSON value (keys
        included; media payloads are not read)."""
        if isinstance(value, str):
            self._reserve_text(value)
        elif isinstance(value, dict):
            _deep(depth)
            for k, v in value.items():
                self._reserve_all(k, depth)
                self._reserve_all(v, depth + 1)
        elif isinstance(value, list):
            _deep(depth)
            for v in value:
                self._reserve_all(v, depth + 1)

    def _walk(self, value: _T, depth: int) -> _T:
        """A JSON value with every string in it masked, keys included (a member named
        in `_MEDIA` is kept as it is). The value itself when nothing changed (no copy),
        so a request without PII stays the very request that came."""
        if isinstance(value, str):
            return self._mask_one(value, reserve=False)  # type: ignore[return-value]
        if isinstance(value, dict):
            return self._walk_with(value, _NO_RULES, depth)  # type: ignore[return-value]
        if isinstance(value, list):
            _deep(depth)
            items = [self._walk(v, depth + 1) for v in value]
            if any(a is not b for a, b in zip(items, value, strict=True)):
                return items  # type: ignore[return-value]
            return value
        if value is None or isinstance(value, (bool, int, float)):
            return value
        raise MaskingError(f"cannot mask a {type(value).__name__}")

    def _mask_message(self, message: Mapping[str, Any]) -> dict[str, Any]:
        """One message: its own members by their rules (`content`'s texts, a `name`
        that stays a name, tool calls' JSON arguments), every other member walked."""
        return self._walk_with(message, _MESSAGE_RULES, 0)  # type: ignore[arg-type]

    def _content(self, content: Any) -> Any:
        if isinstance(content, str):
            return self._mask_one(content, reserve=False)
        if isinstance(content, list):
            parts = [self._mask_part(p) for p in content]
            return (
                parts if any(a is not b for a, b in zip(parts, content, strict=True)) else content
            )
        return self._walk(content, 1)

    def _name(self, name: Any) -> Any:
        if not isinstance(name, str):
            return self._walk(name, 1)
        # A name must stay a name (OpenAI: [A-Za-z0-9_-]): the placeholder without <>.
        masked = self._mask_one(name, reserve=False)
        return name if masked is name else masked.replace("<", "").replace(">", "")

    def _calls(self, calls: Any) -> Any:
        if not isinstance(calls, list):
            return self._walk(calls, 1)
        out = [self._mask_call(c) for c in calls]
        return out if any(a is not b for a, b in zip(out, calls, strict=True)) else calls

    def _arguments(self, args: Any) -> Any:
        return self.mask_inline(args) if isinstance(args, str) else self._walk(args, 3)

    def _function(self, fn: Any) -> Any:
        if not isinstance(fn, dict):
            return self._walk(fn, 2)
        return self._walk_with(fn, _FUNCTION_RULES, 2)

    def _mask_call(self, call: Any) -> Any:
        """A tool call with its `function.arguments` (a JSON string) masked inline and
        every other member walked."""
        if not isinstance(call, dict):
            return self._walk(call, 2)
        return self._walk_with(call, _CALL_RULES, 2)

    def _walk_with(
        self, obj: dict[str, Any], rules: Mapping[str, _Rule], depth: int
    ) -> dict[str, Any]:
        """`_walk` of an object whose members named in `rules` are masked by them."""
        _deep(depth)
        out: dict[Any, Any] = {}
        changed = False
        for k, v in obj.items():
            rule = rules.get(k)
            if rule is not None:
                mk, mv = k, rule(self, v)
            else:
                mk = self._mask_one(k, reserve=False) if isinstance(k, str) else k
                mv = self._walk(v, depth + 1)
            if mk is not k or mv is not v:
                changed = True
            out[mk] = mv
        if len(out) != len(obj):
            raise MaskingError("two members of an object mask to one name")
        return out if changed else obj

    def mask_inline(self, text: str) -> str:
        """`mask` for a text that is part of a message already reserved."""
        return self._mask_one(text, reserve=False)

    def _mask_part(self, part: Any) -> Any:
        """A content part: its `text` (one that is not text fails, closed), and every
        other member walked (a refusal, a file's name, an image's `detail`); a media
        part's payload (`_MEDIA`: its `image_url.url`, `input_audio.data` or
        `file.file_data`, by the part's type) is kept as sent."""
        if isinstance(part, str):
            return self._mask_one(part, reserve=False)
        if not isinstance(part, dict):
            return self._walk(part, 2)
        return self._walk_with(part, _MEDIA_PART_RULES.get(part.get("type"), _PART_RULES), 2)

    def _text_member(self, text: Any) -> Any:
        return self._mask_one(text, reserve=False)  # not text: fails, closed

    def _media(self, media: Any, rules: Mapping[str, _Rule]) -> Any:
        """A media part's object (`image_url`, `input_audio`, `file`): its payload
        member (`rules`) kept as sent, every other member walked; a bare string (an
        image's URL written without its object) is the payload itself."""
        if isinstance(media, dict):
            return self._walk_with(media, rules, 3)
        return media if isinstance(media, str) else self._walk(media, 3)

    def _as_sent(self, value: Any) -> Any:
        return value

    def _mask_one(self, text: str, *, reserve: bool) -> str:
        if reserve:
            self._reserve(text)
        if type(text) is str and (
            (len(text) < _PLAIN_MAX and _plain(text))  # a word no detector can match
            or text in self._clean
        ):
            return text
        # A text with JSON escapes (a tool call's arguments, a tool's JSON result) is
        # read as its reader reads it: `alice\u0040example.com` is an address to the
        # tool the arguments go to and to the model. A span found in that reading
        # masks the characters (escapes included) it was read from; the rest of the
        # text goes out as written (`_json_view`), each placeholder standing for the
        # value as read (the same JSON inside a JSON string).
        viewed = _json_view(text)
        view = text if viewed is None else viewed[0]
        findings = self._masker.find(view)
        if not findings:
            self._clean.add(text)
            return text
        pieces: list[str] = []
        pos = 0
        for start, end, kind in findings:
            a, b = (start, end) if viewed is None else viewed[1](start, end)
            pieces += (text[pos:a], self._placeholder(kind, view[start:end]))
            pos = b
        pieces.append(text[pos:])
        return "".join(pieces)

    def _reserve(self, text: str) -> None:
        self._reserve_text(_text(text))

    def _reserve_text(self, text: str) -> None:
        """Reserve a text's placeholder-shaped pieces, as written and as its JSON
        escapes read (`\\u003cEMAIL_1>`: what `_mask_one` reads)."""
        if "\\" in text:
            text = _json_unescaped(text)
        if "<" in text:
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


# How `_walk_with` masks the members of a message, a tool call, its function and a
# content part that have rules of their own; every other member is walked.
_MESSAGE_RULES: dict[str, _Rule] = {
    "content": MaskSession._content,
    "name": MaskSession._name,
    "tool_calls": MaskSession._calls,
    "function_call": MaskSession._function,  # the deprecated form of one tool call
}
_CALL_RULES: dict[str, _Rule] = {"function": MaskSession._function}
_NO_RULES: dict[str, _Rule] = {}
_FUNCTION_RULES: dict[str, _Rule] = {"arguments": MaskSession._arguments}
_PART_RULES: dict[str, _Rule] = {"text": MaskSession._text_member}


def _media_rule(payload: str) -> _Rule:
    """The rule of a media part's object whose member `payload` is kept as sent."""
    rules: dict[str, _Rule] = {payload: MaskSession._as_sent}
    return lambda session, media: session._media(media, rules)


# A media part's rules, by the part's type: its own object keeps its payload as sent.
_MEDIA_PART_RULES: dict[Any, dict[str, _Rule]] = {
    kind: {**_PART_RULES, kind: _media_rule(payload)} for kind, payload in _MEDIA.items()
}


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
    legacy = message.get("function_call")  # the deprecated form of one tool call
    if isinstance(legacy, dict) and isinstance(legacy.get("arguments"), str):
        yield legacy["arguments"]
    content = message.get("content")
    if content is None:
        return
    if isinstance(content, str):
        yield content
    elif isinstance(content, list):
        for part in content:
            if isinstance(part, str):
                yield part
            elif isinstance(part, dict):
                yield from _part_texts(part)
    else:
        raise MaskingError(f"message content must be text or parts, not {type(content).__name__}")


def _part_texts(part: Mapping[str, Any]) -> Iterator[str]:
    """The texts of one content part: its `text` (whatever it holds: one that is not
    text fails the masking, closed), a refusal's `refusal`, a file's name."""
    if "text" in part:
        yield part["text"]
    if isinstance(part.get("refusal"), str):
        yield part["refusal"]
    file = part.get("file")
    if isinstance(file, dict) and isinstance(file.get("filename"), str):
        yield file["filename"]


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
    """The request with every text it would send upstream masked, whichever member
    carries it: what is found in any of them is what `block` refuses and
    `mask_upstream` replaces.

    Chat `messages` keep their own rules (`mask_messages`: names stay names); the
    end-user ids `user` and `prompt_cache_key` stay ids (their placeholders without
    <>); every other member the upstream receives, typed or kept in `extra` as sent
    (stop sequences, tools, a `response_format` schema, `web_search_options`, the
    other protocol's `messages` or `prompt`, an engine's own options, ...), is walked
    whole: every string in it, keys included, is masked. Not walked: `model` (the
    upstream is sent its own name for the deployment) and media payloads (`_MEDIA`:
    an image URL or base64 data is sent as it came; the detectors read text, not
    images). Depth and size are bounded by the body's parse (api/body.py: 64 levels,
    `server.max_body_bytes`); a value no JSON body holds fails the masking, closed."""
    return _guarded(lambda: _mask_request(session, req))


def _mask_request(session: MaskSession, req: Generation) -> Generation:
    # Reserve literal placeholder-shaped text of the whole request before numbering,
    # so a client's own "<EMAIL_1>" anywhere is never confused with ours on restore.
    messages, prompt = req.messages, req.prompt
    if messages is not None:
        for message in messages:
            for text in _message_texts(message):  # fails closed on a shape it cannot read
                session._reserve(text)
    changes: dict[str, Any] = {}
    for name in _READ:
        value = getattr(req, name)
        if value is not None and value is not False:
            session._reserve_all(value, 0)
    if messages is not None:
        masked_messages = session._mask_messages_reserved(messages)
        if masked_messages is not messages:
            changes["messages"] = masked_messages
    # An end-user id stays an id: its placeholder without <>.
    if prompt is not None:
        masked_prompt = session._walk(prompt, 0)
        if masked_prompt is not prompt:
            changes["prompt"] = masked_prompt
    for name in ("user", "prompt_cache_key"):
        value = getattr(req, name)
        if value is not None:
            ident = session.mask_inline(value)
            if ident is not value:
                changes[name] = ident.replace("<", "").replace(">", "")
    for name in _WALKED:
        value = getattr(req, name)
        if value is None or value is False or name == "prompt":
            continue
        masked = session._walk(value, 0)
        if masked is not value:
            changes[name] = masked
    extra = session._walk(req.extra, 0)
    if extra is not req.extra:
        changes["extra"] = extra
    return msgspec.structs.replace(req, **changes) if changes else req


# The typed members walked whole: every one but `model` (replaced by the deployment's
# upstream name), `messages` (their own rules), the end-user ids and `extra` (walked
# after them), in the order of the struct. Members typed as numbers or booleans pass
# the walk untouched.
_WALKED = tuple(
    name
    for name in Generation.__struct_fields__
    if name not in {"model", "messages", "user", "prompt_cache_key", "extra"}
)
# Every member read: all but `model`.
_READ = ("messages", "user", "prompt_cache_key", *_WALKED, "extra")
