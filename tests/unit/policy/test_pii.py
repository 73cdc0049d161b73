"""PII masking: what is masked, what is left alone, numbering, restore and streaming restore.

Pure unit tests (no processes, no network). Values are realistic but made up: card numbers
are the issuers' published test numbers or generated with a valid Luhn digit, IBANs are the
registry's examples or generated with valid check digits.
"""

from __future__ import annotations

import random
import re
import string
import time
from typing import Any

import pytest

from switchyard.policy import pii
from switchyard.policy.pii import (
    MODES,
    PII_TYPES,
    MaskingError,
    PiiMasker,
    contains_pii,
)

MASKER = PiiMasker()
PLACEHOLDER = re.compile(r"<([A-Z_]+)_(\d+)>")


def mask(text: str) -> str:
    return MASKER.mask(text)


# --------------------------------------------------------------------------- generators


def luhn_digit(body: str) -> str:
    """The check digit that makes `body + digit` pass Luhn (written apart from pii.py)."""
    total = 0
    for i, c in enumerate(reversed(body)):
        d = int(c) * (2 if i % 2 == 0 else 1)
        total += d // 10 + d % 10
    return str((10 - total % 10) % 10)


def card_number(rng: random.Random, length: int) -> str:
    body = rng.choice("23456") + "".join(rng.choice(string.digits) for _ in range(length - 2))
    return body + luhn_digit(body)


def break_luhn(number: str) -> str:
    last = (int(number[-1]) + 1 + number.count("7") % 9) % 10
    return number[:-1] + str(last)


def iban_de(rng: random.Random) -> str:
    bban = "".join(rng.choice(string.digits) for _ in range(18))
    check = 98 - int(bban + "131400") % 97  # D=13, E=14, then "00"
    return f"DE{check:02d}{bban}"


def kr_rrn(rng: random.Random) -> str:
    year, month, day = rng.randint(1950, 2019), rng.randint(1, 12), rng.randint(1, 28)
    gender = rng.choice("12") if year < 2000 else rng.choice("34")
    tail = "".join(rng.choice(string.digits) for _ in range(6))
    return f"{year % 100:02d}{month:02d}{day:02d}-{gender}{tail}"


def secret_key(rng: random.Random) -> str:
    alphabet = string.ascii_letters + string.digits + "-_"
    body = "".join(rng.choice(alphabet) for _ in range(40))
    return f"sk-sy-{body}{rng.choice(string.digits)}"


# --------------------------------------------------------------------------- positives

POSITIVES: list[tuple[str, str, str]] = [
    # (sentence, raw value, type)
    ("Reach me at jane.doe@example.com tomorrow.", "jane.doe@example.com", "EMAIL"),
    ("cc: a.b+tag@mail.example.co.uk, thanks", "a.b+tag@mail.example.co.uk", "EMAIL"),
    ("메일은 kim_minsu@naver.com 입니다", "kim_minsu@naver.com", "EMAIL"),
    ("메일은kim@test.kr입니다", "kim@test.kr", "EMAIL"),
    ("<a href='mailto:ops-team@corp.example.org'>", "ops-team@corp.example.org", "EMAIL"),
    ("Call +1 (415) 555-2671 after 5pm.", "+1 (415) 555-2671", "PHONE"),
    ("London office: +44 20 7946 0958.", "+44 20 7946 0958", "PHONE"),
    ("Seoul: +82 10-1234-5678", "+82 10-1234-5678", "PHONE"),
    ("Handy +4915112345678 bitte", "+4915112345678", "PHONE"),
    ("Phone (415) 555-2671 or later", "(415) 555-2671", "PHONE"),
    ("phone: 415-555-2671.", "415-555-2671", "PHONE"),
    ("fax 415.555.2671", "415.555.2671", "PHONE"),
    ("toll free 1-800-555-0199!", "1-800-555-0199", "PHONE"),
    ("제 번호는 010-1234-5678입니다", "010-1234-5678", "PHONE"),
    ("연락처 01012345678 로 주세요", "01012345678", "PHONE"),
    ("서울 사무실 02-123-4567", "02-123-4567", "PHONE"),
    ("ring 020 7946 0958 tonight", "020 7946 0958", "PHONE"),
    ("portable 06 12 34 56 78.", "06 12 34 56 78", "PHONE"),
    ("Büro (030) 1234567", "(030) 1234567", "PHONE"),
    ("Pay with 4111 1111 1111 1111 please", "4111 1111 1111 1111", "CARD"),
    ("card=4111-1111-1111-1111;", "4111-1111-1111-1111", "CARD"),
    ("MC 5555555555554444 exp 12/27", "5555555555554444", "CARD"),
    ("Amex 3782 822463 10005.", "3782 822463 10005", "CARD"),
    ("Discover 6011 1111 1111 1117", "6011 1111 1111 1117", "CARD"),
    ("MC 2-series 2223003122003222", "2223003122003222", "CARD"),
    ("카드번호 4000056655665556입니다", "4000056655665556", "CARD"),
    ("IBAN DE89 3704 0044 0532 0130 00, BIC COBADEFFXXX", "DE89 3704 0044 0532 0130 00", "IBAN"),
    ("to GB82WEST12345698765432 today", "GB82WEST12345698765432", "IBAN"),
    ("to GB82 WEST 1234 5698 7654 32.", "GB82 WEST 1234 5698 7654 32", "IBAN"),
    ("FR: FR14 2004 1010 0505 0001 3M02 606", "FR14 2004 1010 0505 0001 3M02 606", "IBAN"),
    ("NL91ABNA0417164300 (ABN AMRO)", "NL91ABNA0417164300", "IBAN"),
    ("Norway NO9386011117947", "NO9386011117947", "IBAN"),
    ("My SSN is 123-45-6789.", "123-45-6789", "SSN"),
    ("ssn:078-05-1120", "078-05-1120", "SSN"),
    ("SSN 219-09-9999 on file", "219-09-9999", "SSN"),
    ("주민번호 900101-1234567", "900101-1234567", "KR_RRN"),
    ("주민등록번호는 850315-2123456입니다", "850315-2123456", "KR_RRN"),
    ("born 2005: 050315-3234567", "050315-3234567", "KR_RRN"),
    ("외국인 900101-5234567", "900101-5234567", "KR_RRN"),
    ("server at 192.168.1.10 is down", "192.168.1.10", "IP"),
    ("ssh 10.0.0.1:2222", "10.0.0.1", "IP"),
    ("dns 8.8.8.8.", "8.8.8.8", "IP"),
    ("v6 2001:db8::8a2e:370:7334 ok", "2001:db8::8a2e:370:7334", "IP"),
    ("link-local fe80::1%eth0", "fe80::1", "IP"),
    ("mapped ::ffff:192.0.2.1", "::ffff:192.0.2.1", "IP"),
    ("full 2001:0db8:85a3:0000:0000:8a2e:0370:7334.", "2001:0db8:85a3:0000:0000:8a2e:0370:7334", "IP"),
    ("url http://[2001:db8::1]:443/x", "2001:db8::1", "IP"),
    # A dotted quad of valid octets is an IPv4 address even if meant as a version.
    ("version 1.2.3.4 released", "1.2.3.4", "IP"),
    ("key sk-sy-3JqXbW0f1n8sQ2Vd_p-HkLr7TzYc9mAe4uGi6oNwKxE", "sk-sy-3JqXbW0f1n8sQ2Vd_p-HkLr7TzYc9mAe4uGi6oNwKxE", "SECRET"),
    ("OPENAI_API_KEY=sk-proj-Ab12Cd34Ef56Gh78Ij90KlMnOpQr", "sk-proj-Ab12Cd34Ef56Gh78Ij90KlMnOpQr", "SECRET"),
    ("token ghp_16C7e42F292c6912E7710c838347Ae178B4a in CI", "ghp_16C7e42F292c6912E7710c838347Ae178B4a", "SECRET"),
    ("SLACK=xoxb-263594206564-FGqddMF8t08v8N7Oq4i57vs1", "xoxb-263594206564-FGqddMF8t08v8N7Oq4i57vs1", "SECRET"),
    ("aws_access_key_id = AKIAIOSFODNN7EXAMPLE", "AKIAIOSFODNN7EXAMPLE", "SECRET"),
    ("maps key AIzaSyA1b2C3d4E5f6G7h8I9j0KlMnOpQrStUvW", "AIzaSyA1b2C3d4E5f6G7h8I9j0KlMnOpQrStUvW", "SECRET"),
    ("HF_TOKEN=hf_AbCdEfGhIjKlMnOpQrStUvWxYz012345", "hf_AbCdEfGhIjKlMnOpQrStUvWxYz012345", "SECRET"),
    ("stripe sk_live_4eC39HqLyjWDarjtT1zdp7dc", "sk_live_4eC39HqLyjWDarjtT1zdp7dc", "SECRET"),
    ("Authorization: Bearer abc123def456ghi789", "abc123def456ghi789", "SECRET"),
    ("Authorization: Basic dXNlcjpwYXNzd29yZA==", "dXNlcjpwYXNzd29yZA==", "SECRET"),
    (
        "jwt eyJhbGciOiJIUzI1NiIsInR5cCI6IkpXVCJ9.eyJzdWIiOiIxMjM0NTY3ODkwIn0.dozjgNryP4J3jVmNHl0w5N_XgL0n3I9PlFUP0THsR8U here",
        "eyJhbGciOiJIUzI1NiIsInR5cCI6IkpXVCJ9.eyJzdWIiOiIxMjM0NTY3ODkwIn0.dozjgNryP4J3jVmNHl0w5N_XgL0n3I9PlFUP0THsR8U",
        "SECRET",
    ),
    ("aws_secret=wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY", "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY", "SECRET"),
    ("digest 9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08", "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08", "SECRET"),
    ("api_key=Zx9Qw3Er5Ty7Ui9Op1As3Df5Gh7Jk9Lz", "Zx9Qw3Er5Ty7Ui9Op1As3Df5Gh7Jk9Lz", "SECRET"),
]  # fmt: skip


@pytest.mark.parametrize(("sentence", "raw", "kind"), POSITIVES)
def test_each_type_is_masked_with_its_placeholder(sentence: str, raw: str, kind: str) -> None:
    assert raw in sentence  # the fixture itself is right
    assert mask(sentence) == sentence.replace(raw, f"<{kind}_1>")


def test_every_type_is_covered_by_the_positive_examples() -> None:
    kinds = {kind for _, _, kind in POSITIVES}
    assert kinds == set(PII_TYPES)
    for kind in PII_TYPES:
        assert sum(k == kind for _, _, k in POSITIVES) >= 3, kind


def test_private_key_block_is_masked_whole() -> None:
    pem = (
        "-----BEGIN RSA PRIVATE KEY-----\n"
        "MIIEowIBAAKCAQEA1c7+9z5Pad7OejecsQ0bu3aozN3tihPmljnnudb9G3HECdnH\n"
        "lWu2/a1gB9JW5TBQ+AVpum9Okx7KfqkfBKL9mcHgSL0yWMdjMfNOqNtrQqKlN4kE\n"
        "-----END RSA PRIVATE KEY-----"
    )
    assert mask(f"key:\n{pem}\nthanks") == "key:\n<SECRET_1>\nthanks"
    # A truncated paste is masked to the end rather than leaked.
    assert mask("key: " + pem[:120]) == "key: <SECRET_1>"


def test_card_followed_by_more_digits_is_still_masked() -> None:
    # The grouped run is 19 digits and fails Luhn; its first 16 pass, so they are the card.
    assert mask("card 4111 1111 1111 1111 123 cvv") == "card <CARD_1> 123 cvv"


# --------------------------------------------------------------------------- negatives

NEGATIVES = [
    "Not a card: 4111 1111 1111 1112",
    "order 4111111111111112 shipped",
    "Order #123456789 ships in 2024.",
    "It costs $1,299.99 (or €1.234.567,89) for 1 000 000 units.",
    "Release v1.2.3 needs Python 3.11.4; build 10.0.19045 too.",
    "Meeting on 2024-01-15 10:30:00, or 05.11.2023 14:00, or 12/31/2023.",
    "ISBN 0-306-40615-2 and 978-3-16-148410-0",
    "epoch ms 1700000000000 and ns 1700000000000000000",
    "invalid SSNs 000-12-3456, 666-12-3456, 912-34-5678, 123-00-4567, 123-45-0000",
    "invalid RRNs 901332-1234567 and 900101-9234567 and 900230-1234567",
    "not IPs: 256.1.1.1, 1.2.3, 1.2.3.4.5, 01.02.03.04",
    "bad IBAN check digits GB83WEST12345698765432 and DE88 3704 0044 0532 0130 00",
    "code: x[1::2], a::b, std::vector<int>, s[::-1], ::1 and 12:30:45",
    "MAC 00:1a:2b:3c:4d:5e",
    "uuid 550e8400-e29b-41d4-a716-446655440000",
    "AbstractSingletonProxyFactoryBean2 in src/switchyard/policy/pii_masking_2.py",
    "sk-learn-compatible-estimators are fine, and bearer of bad news, bearer instruments",
    "decorators like @app.route and user@localhost are not addresses",
    "short sha abc1234 and ratio 16:9 and score 98.6",
    "numbers 10 20 30 40 50 60 70 80 and -122.4194, 37.7749",
]


@pytest.mark.parametrize("text", NEGATIVES)
def test_ordinary_text_and_numbers_are_left_alone(text: str) -> None:
    assert mask(text) == text
    assert not contains_pii(text)


# --------------------------------------------------------------------------- numbering


def test_repeated_value_keeps_its_placeholder_and_numbering_is_per_type() -> None:
    session = MASKER.session()
    text = (
        "jane@example.com wrote to bob@example.com; call jane at 415-555-2671 "
        "or mail jane@example.com again."
    )
    assert session.mask(text) == (
        "<EMAIL_1> wrote to <EMAIL_2>; call jane at <PHONE_1> or mail <EMAIL_1> again."
    )
    # Later texts of the same request continue the numbering and reuse placeholders.
    assert session.mask("bob@example.com and carol@example.com") == "<EMAIL_2> and <EMAIL_3>"
    assert session.found == {"EMAIL": 5, "PHONE": 1}


def test_a_new_session_starts_numbering_again() -> None:
    assert MASKER.session().mask("a@example.com") == "<EMAIL_1>"
    assert MASKER.session().mask("b@example.com") == "<EMAIL_1>"


def test_placeholders_already_in_the_input_are_never_reused() -> None:
    session = MASKER.session()
    text = "Template: 'Dear <EMAIL_1>,' -- send it to jane@example.com"
    masked = session.mask(text)
    assert masked == "Template: 'Dear <EMAIL_1>,' -- send it to <EMAIL_2>"
    assert session.restore(masked) == text


# --------------------------------------------------------------------------- restore

ALL_TYPES_TEXT = (
    "Hi, I'm Jane (jane.doe@example.com, +1 (415) 555-2671, 010-1234-5678). "
    "Card 4111 1111 1111 1111, IBAN DE89 3704 0044 0532 0130 00, SSN 123-45-6789, "
    "RRN 900101-1234567. My box is 192.168.1.10 / 2001:db8::8a2e:370:7334 and my key is "
    "sk-sy-3JqXbW0f1n8sQ2Vd_p-HkLr7TzYc9mAe4uGi6oNwKxE. Again: jane.doe@example.com."
)


def test_round_trip_restores_every_type() -> None:
    session = MASKER.session()
    masked = session.mask(ALL_TYPES_TEXT)
    assert {m.group(1) for m in PLACEHOLDER.finditer(masked)} == set(PII_TYPES)
    assert session.restore(masked) == ALL_TYPES_TEXT


def test_restore_puts_values_into_a_model_response() -> None:
    session = MASKER.session()
    session.mask("Email jane@example.com about card 4111111111111111")
    reply = "Sure: I emailed <EMAIL_1> about <CARD_1>. <EMAIL_9> and <CARD_1 > are not ours."
    assert session.restore(reply) == (
        "Sure: I emailed jane@example.com about 4111111111111111. "
        "<EMAIL_9> and <CARD_1 > are not ours."
    )


def test_a_reply_kept_at_rest_has_every_generated_text_masked() -> None:
    """What a reply keeps at rest (cache, idempotency store) is masked in every text a
    model writes: the answer, its reasoning (`reasoning_content`, `reasoning`), a
    refusal, tool-call arguments and a completion's text; and restored from each."""
    from switchyard.policy.pii_reply import at_rest, map_texts

    raw = "mail jane@example.com"
    session = MASKER.session()
    session.mask(raw)
    message = {
        "role": "assistant",
        "content": raw,
        "reasoning_content": raw,
        "reasoning": raw,
        "refusal": raw,
        "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": raw}}],
    }
    reply = {"choices": [{"index": 0, "message": message}, {"index": 1, "text": raw}]}
    stored = at_rest(session, reply)
    assert "jane@example.com" not in repr(stored)
    assert stored["choices"][0]["message"]["refusal"] == "mail <EMAIL_1>"
    assert map_texts(stored, session.restore) == reply


def test_a_stream_restores_every_text_it_carries_each_on_its_own() -> None:
    """A streamed reply's placeholders are restored in every text the stream carries,
    each its own run of deltas (split placeholders included): the answer, reasoning,
    and each tool call's arguments of each choice; what a JSON reply restores too. A
    placeholder left incomplete ends as plain text in an event of its own shape."""
    import orjson

    from switchyard.policy.pii_reply import PiiRestore

    session = MASKER.session()
    session.mask("mail jane@example.com and bob@example.org")
    part = PiiRestore(session)

    def chunk(index: int, delta: dict[str, Any]) -> bytes:
        return orjson.dumps({"choices": [{"index": index, "delta": delta}]})

    def call(k: int, args: str) -> dict[str, Any]:
        return {"tool_calls": [{"index": k, "function": {"arguments": args}}]}

    events = [
        chunk(0, {"reasoning_content": "to <EMA"}),
        chunk(0, call(0, '{"to": "<EMAI')),
        chunk(1, {"content": "hi <EMAIL_"}),
        chunk(0, call(1, '{"cc": "<EMAIL_2>"}')),
        chunk(0, {"reasoning_content": "IL_1>"}),
        chunk(0, call(0, 'L_1>"}')),
        chunk(1, {"content": "2> and <EMAIL_"}),
    ]
    out = [orjson.loads(e) for ev in events for e in part.event(ev) or []]
    out += [orjson.loads(e) for e in part.end(True)]

    def joined(index: int, pick: Any) -> str:
        texts = [pick(c["delta"]) for o in out for c in o["choices"] if c["index"] == index]
        return "".join(t for t in texts if t)

    def args(k: int) -> Any:
        return lambda d: next(
            (t["function"]["arguments"] for t in d.get("tool_calls", []) if t["index"] == k),
            None,
        )

    assert joined(0, lambda d: d.get("reasoning_content")) == "to jane@example.com"
    assert joined(0, args(0)) == '{"to": "jane@example.com"}'
    assert joined(0, args(1)) == '{"cc": "bob@example.org"}'
    assert joined(1, lambda d: d.get("content")) == "hi bob@example.org and <EMAIL_"


def test_restore_without_mapping_is_identity() -> None:
    session = MASKER.session()
    assert session.mask("nothing here") == "nothing here"
    assert session.restore("<EMAIL_1> stays") == "<EMAIL_1> stays"


def _stream(session: pii.MaskSession, chunks: list[str]) -> str:
    restorer = session.restore_stream()
    return "".join(restorer.feed(c) for c in chunks) + restorer.flush()


def test_stream_restore_at_every_split_point() -> None:
    session = MASKER.session()
    session.mask(ALL_TYPES_TEXT)
    response = "Done <EMAIL_1>, <KR_RRN_1> and <SECRET_1>; x<y <EMAIL_1><CARD_1> <EMA"
    expected = session.restore(response)
    assert "jane.doe@example.com" in expected and expected.endswith(" <EMA")
    n = len(response)
    for i in range(n + 1):
        assert _stream(session, [response[:i], response[i:]]) == expected, i
        for j in range(i, n + 1):
            assert _stream(session, [response[:i], response[i:j], response[j:]]) == expected
    assert _stream(session, list(response)) == expected


def test_stream_restore_holds_back_only_a_possible_placeholder() -> None:
    session = MASKER.session()
    session.mask("jane@example.com")
    restorer = session.restore_stream()
    assert restorer.feed("a < b and <b>") == "a < b and <b>"
    assert restorer.feed("hi <EMA") == "hi "
    assert restorer.feed("IL_1> ok <EMAIL_2") == "jane@example.com ok <EMAIL_2"
    assert restorer.feed(">") == ">"
    assert restorer.feed("<EMAIL_") == ""
    assert restorer.flush() == "<EMAIL_"


# --------------------------------------------------------------------------- messages


def test_mask_messages_masks_strings_and_text_parts_only() -> None:
    image = {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}
    tool_calls = [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "Support bot for jane@example.com"},
        {
            "role": "user",
            "name": "jane",
            "content": [{"type": "text", "text": "I am jane@example.com, 010-1234-5678"}, image],
        },
        {"role": "assistant", "content": None, "tool_calls": tool_calls},
        {"role": "tool", "tool_call_id": "c1", "content": "card 4111 1111 1111 1111"},
    ]
    original = repr(messages)
    session = MASKER.session()
    out = session.mask_messages(messages)
    assert repr(messages) == original  # input untouched
    assert out == [
        {"role": "system", "content": "Support bot for <EMAIL_1>"},
        {
            "role": "user",
            "name": "jane",
            "content": [{"type": "text", "text": "I am <EMAIL_1>, <PHONE_1>"}, image],
        },
        {"role": "assistant", "content": None, "tool_calls": tool_calls},
        {"role": "tool", "tool_call_id": "c1", "content": "card <CARD_1>"},
    ]
    assert all(o is not m for o, m in zip(out, messages, strict=True))
    assert session.found == {"EMAIL": 2, "PHONE": 1, "CARD": 1}


def test_mask_messages_reserves_literal_placeholders_of_later_messages() -> None:
    session = MASKER.session()
    out = session.mask_messages(
        [{"role": "user", "content": "jane@example.com"}, {"role": "user", "content": "<EMAIL_1>"}]
    )
    assert out[0]["content"] == "<EMAIL_2>"
    assert session.restore("<EMAIL_1> <EMAIL_2>") == "<EMAIL_1> jane@example.com"


@pytest.mark.parametrize(
    "messages",
    [
        [{"role": "user", "content": 42}],
        [{"role": "user", "content": [{"type": "text", "text": None}]}],
        ["not a message"],
    ],
)
def test_unreadable_messages_fail_closed(messages: Any) -> None:
    with pytest.raises(MaskingError):
        MASKER.session().mask_messages(messages)


# --------------------------------------------------------------------------- no leaks


def test_no_raw_value_survives_in_a_long_mixed_text() -> None:
    rng = random.Random(6)
    words = ["the", "of", "and", "to", "in", "is", "for", "on", "with", "as", "please", "note"]
    raws: list[str] = []
    parts: list[str] = []
    for i in range(60):
        values = [
            f"user{i}.{rng.choice(words)}@example{i}.com",
            f"+1 ({rng.randint(201, 989)}) {rng.randint(200, 999)}-{rng.randint(0, 9999):04d}",
            f"010-{rng.randint(1000, 9999)}-{rng.randint(1000, 9999)}",
            card_number(rng, 16),
            iban_de(rng),
            f"{rng.randint(1, 665):03d}-{rng.randint(1, 99):02d}-{rng.randint(1, 9999):04d}",
            kr_rrn(rng),
            ".".join(str(rng.randint(1, 254)) for _ in range(4)),
            ":".join(f"{rng.randint(0x1000, 0xFFFF):x}" for _ in range(8)),
            secret_key(rng),
        ]
        raws += values
        for value in values:
            parts.append(" ".join(rng.choices(words, k=rng.randint(2, 8))) + f" {value},")
    text = " ".join(parts)
    session = MASKER.session()
    masked = session.mask(text)
    leaked = [raw for raw in raws if raw in masked]
    assert leaked == []
    assert not re.search(r"\d{4}", PLACEHOLDER.sub("", masked))
    assert session.restore(masked) == text
    assert sum(session.found.values()) == len(raws)


def test_found_and_repr_never_show_raw_values() -> None:
    session = MASKER.session()
    session.mask(ALL_TYPES_TEXT)
    shown = repr(session) + repr(session.found)
    assert "jane" not in shown and "4111" not in shown and "MaskSession" in shown
    assert session.found["EMAIL"] == 2


# --------------------------------------------------------------------------- cards


def test_generated_cards_masked_only_when_luhn_valid() -> None:
    rng = random.Random(2026)
    for _ in range(400):
        length = rng.randint(13, 19)
        valid = card_number(rng, length)
        invalid = break_luhn(valid)
        grouped = length == 16 and rng.random() < 0.5
        sep = rng.choice(" -")

        def shown(n: str, grouped: bool = grouped, sep: str = sep) -> str:
            return sep.join(n[k : k + 4] for k in range(0, 16, 4)) if grouped else n

        assert mask(f"Charge {shown(valid)} now.") == "Charge <CARD_1> now.", valid
        text = f"Charge {shown(invalid)} now."
        assert mask(text) == text, invalid


# --------------------------------------------------------------------------- API


def test_contains_pii() -> None:
    assert contains_pii("write to jane@example.com")
    assert MASKER.contains_pii("ip 10.1.2.3")
    assert not contains_pii("nothing personal in 2024")


def test_kinds_limits_detection() -> None:
    only_email = PiiMasker(kinds=["EMAIL"])
    assert only_email.mask("jane@example.com 10.0.0.1") == "<EMAIL_1> 10.0.0.1"
    with pytest.raises(ValueError):
        PiiMasker(kinds=["NAME"])  # type: ignore[list-item]


def test_strict_kr_rrn_requires_the_checksum() -> None:
    body = "900101123456"
    weights = (2, 3, 4, 5, 6, 7, 8, 9, 2, 3, 4, 5)
    check = (11 - sum(int(d) * w for d, w in zip(body, weights, strict=True)) % 11) % 10
    good = f"{body[:6]}-{body[6:]}{check}"
    bad = f"{body[:6]}-{body[6:]}{(check + 1) % 10}"
    strict = PiiMasker(strict_kr_rrn=True)
    assert strict.mask(good) == "<KR_RRN_1>"
    assert strict.mask(bad) == bad
    assert MASKER.mask(bad) == "<KR_RRN_1>"  # numbers issued since 2020 carry no checksum


def test_non_text_raises_masking_error() -> None:
    with pytest.raises(MaskingError):
        MASKER.session().mask(None)  # type: ignore[arg-type]
    with pytest.raises(MaskingError):
        MASKER.contains_pii(b"bytes")  # type: ignore[arg-type]


def test_internal_failure_fails_closed_without_leaking(monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(digits: str) -> bool:
        raise RuntimeError(f"cannot check {digits}")

    monkeypatch.setattr(pii, "_luhn", boom)
    with pytest.raises(MaskingError) as err:
        MASKER.session().mask("card 4111 1111 1111 1111 for jane@example.com")
    assert "4111" not in str(err.value) and "jane" not in str(err.value)
    assert err.value.__cause__ is None and err.value.__suppress_context__
    with pytest.raises(MaskingError):
        MASKER.session().mask_messages([{"role": "user", "content": "4111111111111111"}])


def test_modes_are_the_three_documented_ones() -> None:
    assert MODES == ("observe_only", "mask_upstream", "block")


ADVERSARIAL = [
    "1" * 100_000,
    "+1 " * 30_000,
    "a@" * 50_000,
    "0-" * 50_000,
    ":" * 50_000 + "1",
    "1:" * 50_000,
    "1." * 50_000,
    "eyJ" * 30_000 + ".",
    "-----BEGIN RSA PRIVATE KEY-----" * 2_000,
    "aB3/" * 30_000,
    "DE89" * 25_000,
    "a" * 100_000 + "@example.com",
]


@pytest.mark.parametrize("text", ADVERSARIAL, ids=lambda t: repr(t[:6]))
def test_pathological_inputs_stay_linear(text: str) -> None:
    # Generous bound (these take well under 0.2 s here); a quadratic pattern takes seconds.
    start = time.perf_counter()
    mask(text)
    assert time.perf_counter() - start < 2.0
