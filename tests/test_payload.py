"""What the gateway sends upstream: the client's own bytes when nothing changed."""

from __future__ import annotations

import time

import orjson
from msgspec import structs

from switchyard.api.codecs import chat_completions
from switchyard.config import parse_settings
from switchyard.engines.registry import Registry
from switchyard.execute.executor import upstream_payload
from switchyard.pipeline import RequestContext, RequestInput, Timings

SETTINGS = parse_settings(
    {
        "models": [
            {"alias": "a", "engine": {"kind": "openai", "base_url": "http://127.0.0.1:9/v1"}},
            {
                "alias": "b",
                "engine": {"kind": "openai", "base_url": "http://127.0.0.1:9/v1", "model": "up-b"},
            },
        ],
        "embeddings": {"enabled": False},
    }
)
REGISTRY = Registry(SETTINGS)


def _ctx(raw: bytes) -> RequestContext:
    req, exact = chat_completions().decode(orjson.loads(raw))
    now = time.perf_counter()
    ctx = RequestContext(
        RequestInput("r", "chat.completions", time.time()), req, Timings(now), now + 5
    )
    ctx.wire = (req, raw if exact else None)
    ctx.stream = req.stream
    ctx.include_usage = req.include_usage
    return ctx


RAW = b'{"model": "a",  "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}'


def test_unchanged_body_goes_out_byte_for_byte() -> None:
    assert upstream_payload(_ctx(RAW), REGISTRY.deployments["a"]) == RAW


def test_upstream_model_name_is_rewritten() -> None:
    out = orjson.loads(upstream_payload(_ctx(RAW), REGISTRY.deployments["b"]))
    assert out["model"] == "up-b" and out["messages"] == [{"role": "user", "content": "hi"}]


def test_a_replaced_body_is_serialised_again() -> None:
    ctx = _ctx(RAW)
    ctx.request = structs.replace(
        ctx.generation, messages=[{"role": "user", "content": "<EMAIL_1>"}]
    )
    out = orjson.loads(upstream_payload(ctx, REGISTRY.deployments["a"]))
    assert out["messages"][0]["content"] == "<EMAIL_1>"


def test_streams_always_ask_for_usage() -> None:
    raw = b'{"model":"a","messages":[{"role":"user","content":"hi"}],"stream":true}'
    out = orjson.loads(upstream_payload(_ctx(raw), REGISTRY.deployments["a"]))
    assert out["stream_options"] == {"include_usage": True}
    asked = b'{"model":"a","messages":[{"role":"user","content":"hi"}],"stream":true,"stream_options":{"include_usage":true}}'
    assert upstream_payload(_ctx(asked), REGISTRY.deployments["a"]) == asked


def test_a_stream_without_stream_options_gets_usage_appended_to_its_bytes() -> None:
    raw = b'{"model": "a", "messages": [{"role": "user", "content": "}"}], "stream": true}\n'
    out = upstream_payload(_ctx(raw), REGISTRY.deployments["a"])
    assert out.startswith(raw.rstrip()[:-1])  # the client's bytes, then the new member
    parsed = orjson.loads(out)
    assert parsed["stream_options"] == {"include_usage": True}
    assert parsed["messages"] == [{"role": "user", "content": "}"}] and parsed["stream"] is True
    # With stream_options present (include_usage false), the object is rebuilt instead.
    asked_off = (
        b'{"model":"a","messages":[{"role":"user","content":"hi"}],"stream":true,'
        b'"stream_options":{"include_usage":false}}'
    )
    assert orjson.loads(upstream_payload(_ctx(asked_off), REGISTRY.deployments["a"]))[
        "stream_options"
    ] == {"include_usage": True}
