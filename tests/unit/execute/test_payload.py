"""What the gateway sends upstream: the client's own bytes when nothing changed."""

from __future__ import annotations

import time

import orjson
from hypothesis import given, settings
from hypothesis import strategies as st
from msgspec import structs

from support.deployments import REGISTRY
from switchyard.api.codecs import chat_completions
from switchyard.config import parse_settings
from switchyard.engines.registry import Registry
from switchyard.execute.executor import upstream_payload
from switchyard.pipeline import RequestContext, RequestInput, Timings


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


PRIORITY_REGISTRY = Registry(
    parse_settings(
        {
            "models": [
                {
                    "alias": "v",
                    "engine": {"kind": "vllm", "scheduling_policy": "priority", "lazy": True},
                },
                {"alias": "f", "engine": {"kind": "vllm", "lazy": True}},
                {
                    "alias": "x",  # an external vLLM running its priority scheduler
                    "engine": {
                        "kind": "openai",
                        "base_url": "http://127.0.0.1:9/v1",
                        "scheduling_policy": "priority",
                    },
                },
            ],
            "embeddings": {"enabled": False},
        }
    )
)


@settings(max_examples=120, deadline=None)
@given(
    st.sampled_from([0, 1, 2]),
    st.one_of(st.none(), st.integers(-(2**31), 2**31), st.text(max_size=5)),
    st.booleans(),
)
def test_a_priority_engine_gets_the_gateways_class_never_the_clients(
    cls: int, own: object, stream: bool
) -> None:
    """vLLM's priority policy: the request's class as the queue took it, in place of any
    `priority` the client sent (it would otherwise jump the engine's queue); an engine
    without the policy gets no `priority` at all (a client's own never goes upstream)."""
    body: dict[str, object] = {"model": "v", "messages": [{"role": "user", "content": "hi"}]}
    if own is not None:
        body["priority"] = own
    if stream:
        body["stream"] = True
    for alias in ("v", "x"):
        body["model"] = alias
        raw = orjson.dumps(body)
        ctx = _ctx(raw)
        ctx.admission.priority = cls
        sent = upstream_payload(ctx, PRIORITY_REGISTRY.deployments[alias])
        assert orjson.loads(sent)["priority"] == cls and sent.count(b'"priority"') == 1
    body["model"] = "f"
    raw = orjson.dumps(body)
    assert upstream_payload(_ctx(raw), PRIORITY_REGISTRY.deployments["f"]).count(b'"priority"') == 0
