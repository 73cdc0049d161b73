"""A body that repeats a key in any object is refused (issue #41, finding 5).

orjson keeps the last of repeated keys, so policy checked `{"model":"premium",
"model":"cheap"}` as `cheap`, while the client's bytes went upstream unchanged and an
upstream that keeps the first key served `premium`. Now every JSON body is refused
400 `duplicate_key` before any policy runs: checked end to end through the real
gateway, on parse_json itself, and by a property test that the fast colon-count proof
agrees with the exact stdlib check on generated JSON texts.
"""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from hypothesis import Phase, find, given, settings
from hypothesis import strategies as st

from support.gateways import Gateway, start_gateway
from support.upstreams import Scripted
from switchyard.api.body import colons_accounted, first_repeated_key, parse_json, repeated_key
from switchyard.errors import InvalidRequest

# --- through the real gateway -----------------------------------------------------------


@pytest.fixture(scope="module")
def gw(scripted: Scripted) -> Iterator[Gateway]:
    engine = {"kind": "openai", "base_url": scripted.url + "/v1"}
    g = start_gateway(
        {
            "models": [
                {"alias": "cheap", "engine": engine},
                {"alias": "premium", "engine": engine},
            ],
            "embeddings": {"enabled": False},
        }
    )
    yield g
    g.proc.stop()


@pytest.fixture(scope="module")
def cheap_key(gw: Gateway) -> str:
    """A key allowed only `cheap`: the one finding 5's attack starts from."""
    tenant = "dup-" + os.urandom(3).hex()
    gw.create_tenant(tenant)
    return str(gw.create_key(tenant, allowed_models=["cheap"])["key"])


MESSAGES = '[{"role": "user", "content": "hi"}]'
DUPLICATED = {
    "model": '{"model": "premium", "model": "cheap", "messages": ' + MESSAGES + "}",
    "max_tokens": '{"model": "cheap", "max_tokens": 100000, "max_tokens": 5, "messages": '
    + MESSAGES
    + "}",
    "n": '{"model": "cheap", "n": 64, "messages": ' + MESSAGES + ', "n": 1}',
    "tools": '{"model": "cheap", "messages": '
    + MESSAGES
    + ', "tools": [{"type": "function", "function": {"name": "rm_rf"}}], "tools": []}',
    "content": '{"model": "cheap", "messages": [{"role": "user", "content": "SECRET-1", '
    '"content": "hi"}]}',
}


def _post(gw: Gateway, key: str, text: str, path: str = "/v1/chat/completions") -> httpx.Response:
    return httpx.post(
        gw.url + path,
        content=text.encode(),
        headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"},
        timeout=30,
    )


@pytest.mark.parametrize("key_name", list(DUPLICATED))
def test_a_repeated_key_is_refused_before_the_upstream(
    gw: Gateway, scripted: Scripted, cheap_key: str, key_name: str
) -> None:
    before = scripted.requests()
    r = _post(gw, cheap_key, DUPLICATED[key_name])
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["code"] == "duplicate_key"
    assert error["type"] == "invalid_request_error"
    assert error["param"] == key_name
    assert f'"{key_name}"' in error["message"]
    assert "SECRET" not in r.text and "premium" not in r.text  # no other client content
    assert scripted.requests() == before
    # The same body without the repeat is served: only the repeat was refused.
    fine = _post(gw, cheap_key, '{"model": "cheap", "messages": ' + MESSAGES + "}")
    assert fine.status_code == 200, fine.text
    assert scripted.requests() == before + 1


def test_every_json_endpoint_refuses_a_repeated_key(gw: Gateway, scripted: Scripted) -> None:
    before = scripted.requests()
    r = _post(gw, gw.key, '{"model": "cheap", "prompt": "a", "prompt": "b"}', "/v1/completions")
    assert r.status_code == 400 and r.json()["error"]["code"] == "duplicate_key", r.text
    assert scripted.requests() == before
    tenant = "dup-" + os.urandom(3).hex()
    admin = httpx.post(
        gw.url + "/admin/tenants",
        content=f'{{"id": "{tenant}", "id": "{tenant}-2"}}'.encode(),
        headers={**gw.admin, "Content-Type": "application/json"},
        timeout=30,
    )
    assert admin.status_code == 400 and admin.json()["error"]["code"] == "duplicate_key"


def test_colons_and_escaped_colons_without_a_repeat_are_served(
    gw: Gateway, scripted: Scripted, cheap_key: str
) -> None:
    """No false refusal: colons in strings, `\\u003a` escapes, an escaped backslash
    before `u003a` text, the same key in different objects."""
    text = (
        '{"model": "cheap", "messages": [{"role": "user", "content": "a:b \\u003a \\\\u003A"}, '
        '{"role": "assistant", "content": "x"}, {"role": "user", "content": "at 10:32"}], '
        '"metadata": {"a\\u003ab": "1", "a:c": "2"}}'
    )
    before = scripted.requests()
    r = _post(gw, cheap_key, text)
    assert r.status_code == 200, r.text
    assert scripted.requests() == before + 1


# --- parse_json ---------------------------------------------------------------------------


def _refusal(text: str | bytes) -> InvalidRequest:
    raw = text.encode() if isinstance(text, str) else text
    with pytest.raises(InvalidRequest) as caught:
        parse_json(raw)
    assert caught.value.code == "duplicate_key", caught.value.message
    assert caught.value.status == 400
    return caught.value


def test_a_repeat_at_any_depth_is_refused_and_named() -> None:
    assert _refusal('{"a": 1, "a": 1}').param == "a"  # even with the same value
    assert _refusal('[1, {"x": [{"k": {"deep": 1, "deep": 2}}]}]').param == "deep"
    assert _refusal('{"messages": [{"role": "user", "role": "system"}]}').param == "role"


def test_keys_equal_once_decoded_are_repeats() -> None:
    assert _refusal('{"a": 1, "\\u0061": 2}').param == "a"
    assert _refusal('{"a:b": 1, "a\\u003Ab": 2}').param == "a:b"
    assert _refusal('{"\\ud83d\\ude00": 1, "\U0001f600": 2}').message.count("\\ud83d") == 1


def test_the_same_key_in_different_objects_is_not_a_repeat() -> None:
    assert parse_json(b'[{"a": 1}, {"a": 2}, {"a": {"a": {"a": 3}}}]') == [
        {"a": 1},
        {"a": 2},
        {"a": {"a": {"a": 3}}},
    ]
    assert parse_json(b'{"a\\u003ab": 1, "a:c": 2}') == {"a:b": 1, "a:c": 2}


def test_the_refusal_quotes_a_bounded_escaped_key_and_nothing_else() -> None:
    long = "k" * 10_000
    err = _refusal(f'{{"{long}": "SECRET-A", "{long}": "SECRET-B"}}')
    assert err.message == f'the request body repeats the key "{"k" * 64}"... in one object; ' + (
        "send each key once"
    )
    assert err.param == "k" * 64
    odd = _refusal('{"\\u0000\\u001b[31m\\u2028": 1, "\\u0000\\u001b[31m\\u2028": 2}')
    assert odd.message.isascii() and odd.param == "\\u0000\\u001b[31m\\u2028"
    assert "\x1b" not in odd.message and "\x00" not in odd.message


def test_a_realistic_body_is_proven_by_its_counts_alone() -> None:
    """The hot path: a chat body with colons in its strings needs no second parse."""
    from switchyard.bench.hotpath import AGENT_CHAT

    raw = json.dumps(AGENT_CHAT).encode()
    assert b": " in raw and raw.count(b":") > 2 * len(AGENT_CHAT)
    assert colons_accounted(raw, orjson.loads(raw))
    repeated = raw.replace(b'"max_tokens": 256', b'"max_tokens": 256, "max_tokens": 9')
    assert not colons_accounted(repeated, orjson.loads(repeated))


def test_an_escaped_backslash_before_u003a_text_leaves_the_body_to_the_exact_check() -> None:
    raw = b'{"a": "\\\\u003a"}'  # the string is a backslash, then the text u003a
    body = orjson.loads(raw)
    assert body == {"a": "\\u003a"}
    assert not colons_accounted(raw, body)  # counts overcount: not proven
    assert repeated_key(raw, body) is None  # and the exact check clears it
    assert parse_json(raw) == body


# --- the fast proof agrees with the exact check ---------------------------------------


@dataclass(frozen=True)
class Obj:
    """A JSON object as written: its members in order, repeats allowed."""

    members: tuple[tuple[str, Any], ...]


# Pieces of keys and strings: colons, text that spells `u003a` after a backslash,
# characters JSON must or may escape, non-ASCII and astral ones.
PIECES = ["a", "b", ":", "\\", "u003a", "u003A", '"', "/", "é", "\u2028", "😀", "\n", "\x00", " "]
KEYS = st.lists(st.sampled_from(PIECES), max_size=3).map("".join)
STRINGS = st.lists(st.sampled_from(PIECES), max_size=6).map("".join)
SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(10**12), 10**12),
    st.floats(allow_nan=False, allow_infinity=False),
    STRINGS,
)


@st.composite
def objects(draw: st.DrawFn, values: st.SearchStrategy[Any]) -> Obj:
    """An object with distinct keys, then (sometimes) one key repeated somewhere in it:
    so repeats sit at random depths, beside repeats that equal keys happen to make."""
    members = draw(st.lists(st.tuples(KEYS, values), max_size=4, unique_by=lambda m: m[0]))
    if members and draw(st.integers(0, 3)) == 0:
        key = draw(st.sampled_from(members))[0]
        at = draw(st.integers(0, len(members)))
        members.insert(at, (key, draw(values)))
    return Obj(tuple(members))


TREES = st.recursive(
    SCALARS,
    lambda kids: st.one_of(st.lists(kids, max_size=4), objects(kids)),
    max_leaves=16,
)


def repeats(tree: Any) -> bool:
    """The oracle: whether some object in the tree has two equal keys."""
    if isinstance(tree, Obj):
        keys = [key for key, _ in tree.members]
        return len(set(keys)) != len(keys) or any(repeats(v) for _, v in tree.members)
    if isinstance(tree, list):
        return any(repeats(v) for v in tree)
    return False


SHORT = {'"': '\\"', "\\": "\\\\", "/": "\\/", "\n": "\\n", "\b": "\\b", "\t": "\\t"}


def _u(code: int, rng: random.Random) -> str:
    hex4 = f"{code:04x}"
    return "\\u" + (hex4.upper() if rng.random() < 0.5 else hex4)


def encode_string(text: str, rng: random.Random) -> str:
    """A JSON string for `text`, each character written literally where JSON allows,
    or as its short escape, or as `\\uXXXX` in either case (astral: a surrogate pair)."""
    out = ['"']
    for ch in text:
        code = ord(ch)
        must = ch in '"\\' or code < 0x20
        roll = rng.random()
        if ch in SHORT and (must or roll < 0.3):
            out.append(SHORT[ch] if roll < 0.7 or code >= 0x10000 else _u(code, rng))
        elif must or roll < 0.3:
            if code >= 0x10000:
                high, low = divmod(code - 0x10000, 0x400)
                out.append(_u(0xD800 + high, rng) + _u(0xDC00 + low, rng))
            else:
                out.append(_u(code, rng))
        else:
            out.append(ch)
    out.append('"')
    return "".join(out)


def encode(tree: Any, rng: random.Random) -> str:
    """A JSON text for the tree, with random whitespace between tokens."""

    def ws() -> str:
        return rng.choice(["", "", " ", "\n", "\t", "\r\n  "])

    if isinstance(tree, Obj):
        members = [
            ws() + encode_string(k, rng) + ws() + ":" + ws() + encode(v, rng) + ws()
            for k, v in tree.members
        ]
        return "{" + (",".join(members) or ws()) + "}"
    if isinstance(tree, list):
        return "[" + (",".join(ws() + encode(v, rng) + ws() for v in tree) or ws()) + "]"
    if isinstance(tree, str):
        return encode_string(tree, rng)
    return json.dumps(tree)


@settings(max_examples=600, deadline=None)
@given(tree=TREES, rng=st.randoms(use_true_random=False))
def test_the_fast_proof_refuses_exactly_when_the_exact_check_finds_a_repeat(
    tree: Any, rng: random.Random
) -> None:
    text = encode(tree, rng)
    raw = text.encode()
    body = orjson.loads(raw)  # what the gateway parses: the generator writes valid JSON
    exact = first_repeated_key(raw)
    assert (exact is not None) == repeats(tree)  # the exact check against the oracle
    proven = colons_accounted(raw, body)
    assert not (proven and exact is not None)  # sound: a proof never passes a repeat
    if exact is None and b"\\\\" not in raw:
        assert proven  # complete: without escaped backslashes, every clean body is proven
    assert repeated_key(raw, body) == exact
    try:
        parse_json(raw, max_depth=200)
        refused = False
    except InvalidRequest as err:
        assert err.code == "duplicate_key", err.message
        refused = True
    assert refused == (exact is not None)


def test_the_generator_makes_every_case_the_property_needs() -> None:
    """The property is only as good as its texts: clean objects with colons in their
    keys, repeats below the top level, repeats of keys with colons (each occurrence
    written its own way by `encode`, so equal keys often differ as written)."""

    def sample(want: Any) -> None:
        # Found, not shrunk: the first example that has it will do.
        find(
            TREES,
            want,
            settings=settings(database=None, max_examples=5000, phases=[Phase.generate]),
        )

    sample(lambda t: isinstance(t, Obj) and not repeats(t) and any(":" in k for k, _ in t.members))
    sample(lambda t: isinstance(t, list) and any(isinstance(v, Obj) and repeats(v) for v in t))
    sample(lambda t: isinstance(t, Obj) and any(repeats(v) for _, v in t.members))
    sample(
        lambda t: (
            isinstance(t, Obj)
            and len({k for k, _ in t.members}) < len(t.members)
            and any(":" in k for k, _ in t.members)
        )
    )


# --- its cost, in bench hotpath ------------------------------------------------------


def test_bench_hotpath_reports_the_check_per_request(tmp_path: Path) -> None:
    out = tmp_path / "hotpath.json"
    argv = ["--requests", "400", "--blocks", "2", "--out", str(out)]
    done = subprocess.run(
        [sys.executable, "-m", "switchyard.bench.hotpath", *argv],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    line = re.search(
        r"duplicate-key check: ([\d.]+) / ([\d.]+) us per request on a (\d+)-byte", done.stdout
    )
    assert line is not None, done.stdout
    stage = json.loads(out.read_text())["stages"]["duplicate_key_check_us"]
    assert len(stage["blocks"]) == 2 and all(b > 0 for b in stage["blocks"])
    assert stage["body_bytes"] == int(line.group(3)) > 1000  # a realistic body, not the tiny one
    assert stage["parse_min"] > 0
