"""The internal request model (request.py) and what goes upstream from it: decoding
keeps every member the client sent, and the client's bytes stand for the request
only when they are exactly it.

Property tests over generated chat bodies: known fields (some sent as null), unknown
ones, streams with and without stream_options, caps asked or not."""

from __future__ import annotations

import json
import time
from typing import Any

import orjson
from hypothesis import given, settings
from hypothesis import strategies as st
from msgspec import structs

from support.deployments import REGISTRY  # deployments a (same name upstream) and b (up-b)
from switchyard.api.codecs import Embeddings, chat_completions, completions
from switchyard.execute.executor import upstream_payload
from switchyard.pipeline import RequestContext, RequestInput, Timings
from switchyard.policy.cost import PromptOverhead, plan
from switchyard.request import GENERATION_FIELDS, Generation, from_object, to_json
from switchyard.state.idempotency import body_hash

_text = st.text(max_size=12)
_stop = st.text(min_size=1, max_size=12)  # an empty stop string is refused
_json = st.recursive(
    st.none() | st.booleans() | st.integers(-1000, 1000) | _text,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_text, inner, max_size=3),
    max_leaves=6,
)
# Known optional fields with values their checks accept, or null.
_KNOWN = {
    "max_tokens": st.none() | st.integers(1, 4096),
    "max_completion_tokens": st.none() | st.integers(1, 4096),
    "temperature": st.none() | st.floats(0, 2),
    "n": st.none() | st.integers(1, 4),
    "seed": st.none() | st.integers(0, 10**6),
    "stop": st.none() | _stop | st.lists(_stop, max_size=4),
    # No control characters (refused) and no lone surrogates (no JSON parser yields one).
    "user": st.none() | st.text(st.characters(exclude_categories=("Cc", "Cs")), max_size=12),
    "return_token_ids": st.none() | st.booleans(),
    "prompt_cache_key": st.none() | _text,
}
# Names no stage reads: kept in `extra`, forwarded as sent.
_UNKNOWN = st.dictionaries(
    st.sampled_from(["top_x", "vendor_opt", "extra", "x-y", "répondre", "__init__"]),
    _json,
    max_size=3,
)


@st.composite
def chat_bodies(draw: st.DrawFn) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": draw(st.sampled_from(["a", "b"])),
        "messages": [{"role": "user", "content": draw(_text)}],
    }
    for name in draw(st.sets(st.sampled_from(sorted(_KNOWN)))):
        body[name] = draw(_KNOWN[name])
    stream = draw(st.sampled_from([None, False, True]))
    if stream is not None:
        body["stream"] = stream
    if stream and draw(st.booleans()):
        body["stream_options"] = {"include_usage": draw(st.booleans())}
    body.update(draw(_UNKNOWN))
    order = draw(st.permutations(list(body)))
    return {k: body[k] for k in order}


def _sent(body: dict[str, Any]) -> dict[str, Any]:
    """What a request means: a known field sent as null (or `stream: false`) is the
    same as one not sent."""
    return {
        k: v
        for k, v in body.items()
        if not (k in GENERATION_FIELDS and (v is None or (k == "stream" and v is False)))
    }


def _no_repeats(raw: bytes) -> dict[str, Any]:
    def pairs(items: list[tuple[str, Any]]) -> dict[str, Any]:
        keys = [k for k, _ in items]
        assert len(keys) == len(set(keys)), f"a repeated key upstream: {keys}"
        return dict(items)

    out: dict[str, Any] = json.loads(raw, object_pairs_hook=pairs)
    return out


@settings(max_examples=300, deadline=None)
@given(chat_bodies())
def test_decoding_keeps_every_member_as_sent(body: dict[str, Any]) -> None:
    req, exact = chat_completions().decode(body)
    assert orjson.loads(to_json(req)) == _sent(body)
    # Exact: every member is in the request as sent, so the bytes may stand for it.
    assert exact == all(v is not None for k, v in body.items() if k in GENERATION_FIELDS)
    assert set(req.extra) == set(body) - GENERATION_FIELDS
    assert req.include_usage is bool((body.get("stream_options") or {}).get("include_usage"))


def _ctx(body: dict[str, Any], raw: bytes) -> RequestContext:
    req, exact = chat_completions().decode(orjson.loads(raw))
    now = time.perf_counter()
    ctx = RequestContext(
        RequestInput("r", "chat.completions", time.time()), req, Timings(now), now + 5
    )
    ctx.wire = (req, raw if exact else None)
    ctx.stream, ctx.include_usage = req.stream, req.include_usage
    ctx.cost = plan(req, len(raw), req.model, 512, 64, 0, PromptOverhead())
    return ctx


@settings(max_examples=300, deadline=None)
@given(chat_bodies(), st.booleans())
def test_what_goes_upstream_is_the_checked_request_whichever_way_it_is_written(
    body: dict[str, Any], spaced: bool
) -> None:
    """The client's bytes with members appended and the request written again say the
    same, and neither repeats a key (a repeated one would let an upstream that keeps
    the first read a value policy never saw: `"max_tokens": null` then a cap)."""
    raw = json.dumps(body).encode() if spaced else orjson.dumps(body)
    for alias in ("a", "b"):
        dep = REGISTRY.deployments[alias]
        fast = _ctx(body, raw)
        slow = _ctx(body, raw)
        slow.request = structs.replace(slow.generation)  # no longer the decoded one
        got = _sent(_no_repeats(upstream_payload(fast, dep)))
        assert got == _sent(_no_repeats(upstream_payload(slow, dep)))
        want = {**_sent(body), "model": dep.upstream_model}
        cost = fast.cost
        assert cost is not None
        # The cap the request reserved goes out, whichever name carries it.
        caps = {got.pop(k) for k in ("max_tokens", "max_completion_tokens") if k in got}
        assert caps and max(caps) == cost.cap
        want.pop("max_tokens", None)
        want.pop("max_completion_tokens", None)
        if fast.stream:  # usage is always asked for on a stream
            assert got.pop("stream_options")["include_usage"] is True
            want.pop("stream_options", None)
        assert got == want


@settings(max_examples=200, deadline=None)
@given(chat_bodies(), chat_bodies())
def test_an_idempotency_key_matches_the_same_request_only(
    a: dict[str, Any], b: dict[str, Any]
) -> None:
    """The body hash is the request's meaning: member order and a null member do not
    change it; anything else does."""
    ra, _ = chat_completions().decode(a)
    rb, _ = chat_completions().decode(b)
    reordered, _ = chat_completions().decode(dict(reversed(list(a.items()))))
    assert body_hash(ra) == body_hash(reordered)
    assert (body_hash(ra) == body_hash(rb)) == (_sent(a) == _sent(b))


def test_the_codecs_keep_the_error_messages_and_params() -> None:
    """The schema's named checks (policy/validate.py) answer as before."""
    cases = [
        (chat_completions(), {"model": "a"}, "messages", "missing_required_parameter"),
        (chat_completions(), {"model": "a", "messages": [{"role": "x"}]}, "messages[0].role", None),
        (completions(), {"model": "a", "prompt": "p", "temperature": 3}, "temperature", None),
        (Embeddings(4), {"model": "e", "input": ["x"] * 5}, "input", None),
        (chat_completions("reject"), {"model": "a", "messages": [], "zz": 1}, "messages", None),
        (
            chat_completions(),
            {"model": "a", "messages": [{"role": "user", "content": "x"}], "user": "u\nforged"},
            "user",
            None,
        ),
    ]
    from switchyard.errors import InvalidRequest

    for codec, body, param, code in cases:
        try:
            codec.decode(body)
        except InvalidRequest as exc:
            assert exc.param == param, (body, exc.param)
            if code is not None:
                assert exc.code == code
        else:
            raise AssertionError(f"{body} was accepted")
    req, exact = completions().decode({"model": "a", "prompt": ["x", "y"], "logprobs": 2})
    assert (req.prompt, req.logprobs, exact) == (["x", "y"], 2, True)
    emb, _ = Embeddings(4).decode({"model": "e", "input": "one", "dimensions": 384})
    assert (emb.texts, emb.dimensions) == (["one"], 384)


def test_legacy_functions_are_refused_where_the_config_governs_tools() -> None:
    """Where tools are governed (the reply gate on chat, by default; any tool policy),
    the codec refuses the deprecated form by name before any stage; elsewhere it is
    forwarded as sent."""
    from switchyard.config import parse_settings
    from switchyard.decide.stages import refuses_legacy
    from switchyard.errors import InvalidRequest

    base = {"model": "a", "messages": [{"role": "user", "content": "x"}]}
    fn = [{"name": "f", "parameters": {"type": "object"}}]
    model = {"alias": "a", "engine": {"kind": "openai", "base_url": "http://127.0.0.1:9/v1"}}

    def config(tools: dict[str, Any]) -> Any:
        return parse_settings({"models": [model], "tools": tools})

    gated, ungated = config({}), config({"check_outputs": False})
    policed = config({"check_outputs": False, "deny": ["rm"]})
    assert refuses_legacy(gated, "chat.completions") and not refuses_legacy(gated, "completions")
    assert not refuses_legacy(ungated, "chat.completions")
    assert refuses_legacy(policed, "chat.completions") and refuses_legacy(policed, "completions")
    refusing = chat_completions(no_legacy=refuses_legacy(gated, "chat.completions"))
    for field, value in (("functions", fn), ("function_call", "auto")):
        try:
            refusing.decode({**base, field: value})
        except InvalidRequest as exc:
            assert exc.param == field and "send 'tools'" in exc.message
        else:
            raise AssertionError(f"{field} was accepted")
    req, _ = chat_completions(no_legacy=False).decode({**base, "functions": fn})
    assert req.functions == fn


@settings(max_examples=200, deadline=None)
@given(_json, _json, _json)
def test_a_member_the_protocol_does_not_check_is_never_typed(
    messages: Any, tools: Any, prompt: Any
) -> None:
    """A completion's `messages`/`tools`/`functions` and a chat's `prompt` are not
    checked by their protocol: whatever their shape, no stage reads them (they would
    reach code that assumes the checked shape), and they go upstream as sent."""
    body = {"model": "a", "prompt": "p", "messages": messages, "tools": tools, "functions": 1}
    req, exact = completions().decode(body)
    assert (req.messages, req.tools, req.functions, exact) == (None, None, None, True)
    assert orjson.loads(to_json(req)) == body
    chat = {"model": "a", "messages": [{"role": "user", "content": "x"}], "prompt": prompt}
    creq, _ = chat_completions().decode(chat)
    assert creq.prompt is None and orjson.loads(to_json(creq)) == chat
    # A stage that sets the typed field: the typed value goes out, once.
    typed = structs.replace(creq, prompt="set")
    assert _no_repeats(to_json(typed))["prompt"] == "set"


def test_an_unknown_field_is_forwarded_where_a_stage_changed_the_request() -> None:
    req, _ = from_object(
        Generation,
        {"model": "a", "messages": [{"role": "user", "content": "hi"}], "top_k": 5, "min_p": 0.1},
    )
    assert req.extra == {} and req.top_k == 5  # a field some engines take, typed
    vendor, _ = from_object(Generation, {"model": "a", "prompt": "p", "mirostat": 2})
    changed = structs.replace(vendor, prompt="<EMAIL_1>")
    assert orjson.loads(to_json(changed)) == {"model": "a", "prompt": "<EMAIL_1>", "mirostat": 2}
