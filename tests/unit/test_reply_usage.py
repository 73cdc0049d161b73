"""Settling reads a JSON reply's `usage` without building the rest of the reply
(reply.reply_usage). For every well-formed reply it must be what parsing the whole
reply gives; the only replies read differently are named below."""

from __future__ import annotations

from typing import Any

import orjson
from hypothesis import given, settings
from hypothesis import strategies as st

from switchyard.reply import reply_object, reply_usage

# JSON values orjson writes and reads back as they were: integers within 64 bits (wider
# ones orjson reads as floats), finite floats, any text.
scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text()
)
values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=20,
)


def whole_parse(body: bytes) -> dict[str, Any] | None:
    """What settling read before: the whole reply parsed, then its `usage`."""
    obj = reply_object(body)
    usage = obj.get("usage") if obj is not None else None
    return usage if isinstance(usage, dict) else None


@settings(max_examples=400)
@given(
    reply=st.dictionaries(st.text(), values, max_size=6),
    usage=st.none() | values | st.dictionaries(st.text(), values, max_size=4),
    where=st.integers(min_value=0, max_value=6),
    with_usage=st.booleans(),
)
def test_usage_is_what_the_whole_parse_reads(
    reply: dict[str, Any], usage: Any, where: int, with_usage: bool
) -> None:
    """Any JSON object, with or without a `usage` member of any type, anywhere in it."""
    items = [(k, v) for k, v in reply.items() if k != "usage"]
    if with_usage:
        items.insert(min(where, len(items)), ("usage", usage))
    body = orjson.dumps(dict(items))
    got = reply_usage(body)
    assert got == whole_parse(body)
    if with_usage and isinstance(usage, dict):
        assert got == usage
    else:
        assert got is None


@settings(max_examples=200)
@given(top=values)
def test_a_reply_that_is_no_object_has_no_usage(top: Any) -> None:
    body = orjson.dumps(top)
    assert reply_usage(body) == whole_parse(body)
    if not isinstance(top, dict):
        assert reply_usage(body) is None


@settings(max_examples=200)
@given(first=st.dictionaries(st.text(), scalars, max_size=3), second=values)
def test_a_repeated_usage_member_is_read_as_the_whole_parse_reads_it(
    first: dict[str, Any], second: Any
) -> None:
    """Both keep the last of a repeated member."""
    body = b'{"usage":' + orjson.dumps(first) + b',"usage":' + orjson.dumps(second) + b"}"
    assert reply_usage(body) == whole_parse(body)


def test_bytes_that_are_not_json_have_no_usage() -> None:
    for body in (
        b"",
        b"not json",
        b'{"usage":{"prompt_tokens":1}',  # cut short
        b'{"usage":{"prompt_tokens":1}} trailing',
        b'{"usage":{"prompt_tokens":NaN}}',
        b'{"usage":{"a":"\\ud800"}}',  # a lone surrogate
        b'{"usage":{"a":"\xff"}}',  # not UTF-8, inside usage
    ):
        assert whole_parse(body) is None
        assert reply_usage(body) is None, body


def test_what_is_malformed_only_outside_usage_still_has_its_usage_read() -> None:
    """The documented difference: members beside `usage` are skipped, not built, so a
    fault there no longer hides the usage the upstream reported (settling would
    otherwise fall back to the estimate)."""
    for body in (
        b'{"x":"\xff","usage":{"prompt_tokens":3}}',
        b'{"x":1e999,"usage":{"prompt_tokens":3}}',
    ):
        assert whole_parse(body) is None
        assert reply_usage(body) == {"prompt_tokens": 3}
