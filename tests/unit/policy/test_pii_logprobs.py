"""A reply's logprobs at rest: a value split across tokens is never kept in pieces.

`pii_reply.at_rest` masks every generated text of a reply before it is stored (the
idempotency store); its logprobs carry the same text again, token by token, so a value
the masker finds in the joined text is kept as one token, its placeholder. Property
tests over generated texts and token splits, chat's shape and a completion's."""

from __future__ import annotations

import itertools

import orjson
from hypothesis import given, settings
from hypothesis import strategies as st

from switchyard.policy.pii import PiiMasker
from switchyard.policy.pii_reply import at_rest, map_texts

VALUES = ["jane.doe@example.com", "+1 415 555 0132", "bob@corp.example.org"]
SPACED = [f" {v} " for v in VALUES]  # words apart, as the masker finds them
WORDS = ["hello", " there", ", ", "write to ", " or call ", " now.", "x", ""]


@st.composite
def split_text(draw: st.DrawFn) -> tuple[str, list[str]]:
    """A text of words and values, cut into tokens anywhere (a value too)."""
    parts = draw(st.lists(st.one_of(st.sampled_from(WORDS), st.sampled_from(SPACED)), max_size=8))
    text = "".join(parts)
    cuts = sorted(set(draw(st.lists(st.integers(0, max(len(text), 1)), max_size=20))))
    edges = [0, *[c for c in cuts if 0 < c < len(text)], len(text)]
    tokens = [text[a:b] for a, b in itertools.pairwise(edges)] if text else []
    return text, tokens


def _chat(text: str, tokens: list[str], lps: list[float]) -> dict:
    entries = [
        {
            "token": t,
            "logprob": lp,
            "bytes": list(t.encode()),
            "top_logprobs": [{"token": t, "logprob": lp, "bytes": list(t.encode())}],
        }
        for t, lp in zip(tokens, lps, strict=True)
    ]
    message = {"role": "assistant", "content": text}
    return {"choices": [{"index": 0, "message": message, "logprobs": {"content": entries}}]}


def _completion(text: str, tokens: list[str], lps: list[float]) -> dict:
    offsets, at = [], 0
    for t in tokens:
        offsets.append(at)
        at += len(t)
    logprobs = {
        "tokens": tokens,
        "token_logprobs": lps,
        "top_logprobs": [{t: lp} for t, lp in zip(tokens, lps, strict=True)],
        "text_offset": offsets,
    }
    return {"choices": [{"index": 0, "text": text, "logprobs": logprobs}]}


def _tokens(choice: dict) -> tuple[list[str], list[float | None]]:
    lp = choice["logprobs"]
    if "content" in lp:
        return [e["token"] for e in lp["content"]], [e["logprob"] for e in lp["content"]]
    return lp["tokens"], lp["token_logprobs"]


@settings(max_examples=150, deadline=None)
@given(split_text(), st.booleans(), st.randoms(use_true_random=False))
def test_no_value_is_kept_in_pieces_and_a_replay_restores_the_text(
    drawn: tuple[str, list[str]], chat: bool, rnd
) -> None:
    text, tokens = drawn
    lps = [-round(rnd.random(), 3) for _ in tokens]
    reply = (_chat if chat else _completion)(text, tokens, lps)
    session = PiiMasker().session()
    stored = at_rest(session, reply)
    kept = orjson.dumps(stored).decode()
    spans = PiiMasker().find(text)
    for s, e, _ in spans:  # what the masker finds in the text is nowhere at rest
        assert text[s:e] not in kept
    assert all(v not in kept for v in VALUES if f" {v} " in text)
    stored_tokens, stored_lps = _tokens(stored["choices"][0])
    # The tokens still spell the (masked) text, and carry the same total logprob.
    masked = session.mask(text)
    assert "".join(stored_tokens) == masked
    assert abs(sum(x for x in stored_lps if x is not None) - sum(lps)) < 1e-6
    # No token holds a piece of a value: the tokens without a placeholder are, in order,
    # exactly the original tokens no value touches.
    untouched, at = [], 0
    for t in tokens:
        if t:
            touched = any(s < at + len(t) and at < e for s, e, _ in spans)
        else:  # an empty token touches a value only strictly inside it
            touched = any(s < at < e for s, e, _ in spans)
        if not touched:
            untouched.append(t)
        at += len(t)
    assert [t for t in stored_tokens if "<" not in t] == untouched
    # A replay restores the request's values: the tokens spell the original text.
    restored = map_texts(stored, session.restore)
    assert "".join(_tokens(restored["choices"][0])[0]) == text


def test_a_value_in_one_token_is_masked_in_its_alternatives_too() -> None:
    reply = _chat("mail jane.doe@example.com", ["mail ", "jane.doe@example.com"], [-0.1, -0.2])
    reply["choices"][0]["logprobs"]["content"][0]["top_logprobs"] = [
        {"token": "bob@corp.example.org", "logprob": -3.0, "bytes": [98]}
    ]
    stored = at_rest(PiiMasker().session(), reply)
    entries = stored["choices"][0]["logprobs"]["content"]
    assert [e["token"] for e in entries] == ["mail ", "<EMAIL_1>"]
    assert entries[1]["bytes"] is None  # the raw value's bytes are not kept either
    alternative = entries[0]["top_logprobs"][0]
    assert alternative["token"].startswith("<EMAIL_") and alternative["bytes"] is None
