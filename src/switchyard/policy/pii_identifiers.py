"""Identifiers by their shape and check: e-mail addresses, IBANs, national ids, IP
addresses and phone numbers.

A number must have the shape of what it claims to be *and* pass the check that shape
implies (mod-97 for IBANs, a real date for Korean resident numbers, valid octets and
groups for IPs, a digit count and one separator for phones, Luhn for cards, whose shapes
are in pii.py), so a year, a price or an order number is left alone.

`personal_number` applies the checksummed and structured ones to a value a client sends
where an id belongs (a task id, a request id): an id is kept in usage rows, traces and
spans as sent, so one that is a card number, an IBAN or a national id must be refused.
"""

from __future__ import annotations

import datetime
import ipaddress
import re
import string
from collections.abc import Mapping

from switchyard.policy.pii_detector import (
    _TABLES,
    _WORD_CHARS,
    Span,
    _class_seeds,
    _Hit,
    _rx,
    _table,
    _View,
    _whole,
)

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


# --------------------------------------------------------------------------- IBAN

# Registry lengths (SWIFT IBAN registry): a known length lets the match stop exactly at the
# IBAN's end even when words or numbers follow it.
_IBAN_LENGTHS: Mapping[str, int] = dict(_TABLES["iban_lengths"])
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

# Cards (their shapes) are matched in pii.py; the check digit is here, for ids too.


def _luhn(digits: str) -> bool:
    total = 0
    for i, c in enumerate(reversed(digits)):
        d = int(c) * (2 if i % 2 else 1)
        total += d - 9 if d > 9 else d
    return total % 10 == 0


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


# --------------------------------------------------------------------------- ids

# An id's parts: `task-FR1420041010050500013M02606` holds an IBAN the text detectors
# (which want a number to stand alone) would not see in it.
_ID_PARTS = re.compile(r"[-_.:]")
# A card number in an id as a person writes one, in dashed groups (4-4-4-4, 4-4-4-4-3,
# Amex's 4-6-5), bounded by no other digit or letter; issuers' first digits 2-6, as
# pii.py `_CARD`. A bare run of 13-19 digits is not read as a card in an id: numeric ids
# (a clock's nanoseconds, a random number) pass Luhn one time in ten, and refusing them
# would fail a client's requests at random.
_CARD_GROUPS = re.compile(
    r"(?<![0-9A-Za-z])[2-6]\d{3}(?:-\d{4}-\d{4}-\d{4}(?:-\d{3})?|-\d{6}-\d{5})(?![0-9A-Za-z])"
)
_ID_NUMBERS = ((_IBAN, _iban), (_SSN, _whole), (_KR_RRN, _kr_rrn))


def personal_number(value: str) -> bool:
    """True if the id `value` holds a card number written in groups (Luhn), an IBAN
    (mod-97), a US SSN or a Korean resident number, as a whole or as one of its
    `-_.:`-separated parts."""
    if any(_luhn(m.group(0).replace("-", "")) for m in _CARD_GROUPS.finditer(value)):
        return True
    parts = _ID_PARTS.split(value)
    for text in (value, *parts):
        for rx, check in _ID_NUMBERS:
            for m in rx.finditer(text):
                if check(m) is not None:
                    return True
    return False
