"""Request validation and the pipeline skeleton, without servers."""

from __future__ import annotations

import asyncio
import itertools
import re
import time
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from switchyard.errors import InvalidRequest, ModelNotFound
from switchyard.pipeline import (
    Pipeline,
    RequestContext,
    RequestIds,
    RequestInput,
    Stage,
    Timings,
    decision_dict,
    new_request_id,
)
from switchyard.policy import headers as request_headers
from switchyard.policy.validate import validate_chat, validate_completion, validate_embeddings
from switchyard.request import NOT_READ


def test_valid_chat_returns_model() -> None:
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
        "stream": True,
        "stream_options": {"include_usage": True},
        "unknown_field": 1,
    }
    assert validate_chat(body) == "m"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ([], None),
        ({"messages": [{"role": "user", "content": "x"}]}, "model"),
        ({"model": 3, "messages": [{"role": "user", "content": "x"}]}, "model"),
        ({"model": "m"}, "messages"),
        ({"model": "m", "messages": "hi"}, "messages"),
        ({"model": "m", "messages": ["hi"]}, "messages[0]"),
        ({"model": "m", "messages": [{"content": "x"}]}, "messages[0].role"),
        ({"model": "m", "messages": [{"role": "user"}]}, "messages[0].content"),
        ({"model": "m", "messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
        ({"model": "m", "messages": [{"role": "user", "content": "x"}], "stream": "yes"}, "stream"),
        (
            {"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": True},
            "max_tokens",
        ),
        ({"model": "m", "messages": [{"role": "user", "content": "x"}], "top_p": 2}, "top_p"),
        ({"model": "m", "messages": [{"role": "user", "content": "x"}], "stop": [1]}, "stop"),
        (
            {
                "model": "m",
                "messages": [{"role": "user", "content": "x"}],
                "stream_options": {"include_usage": True},
            },
            "stream_options",
        ),
    ],
)
def test_invalid_chat_names_param(body: Any, param: str | None) -> None:
    with pytest.raises(InvalidRequest) as exc:
        validate_chat(body)
    assert exc.value.param == param
    assert exc.value.status == 400


def test_completion_and_embeddings() -> None:
    assert validate_completion({"model": "m", "prompt": "x"}) == "m"
    with pytest.raises(InvalidRequest) as exc:
        validate_completion({"model": "m"})
    assert exc.value.param == "prompt"
    assert validate_embeddings({"model": "e", "input": "a"}, 10) == ("e", ["a"])
    with pytest.raises(InvalidRequest):
        validate_embeddings({"model": "e", "input": [[1, 2]]}, 10)
    with pytest.raises(InvalidRequest):
        validate_embeddings({"model": "e", "input": ["a"] * 11}, 10)


def test_gateway_request_ids_are_unique_time_ordered_and_not_guessable() -> None:
    ids = RequestIds()
    many = [ids() for _ in range(5000)]
    assert len(set(many)) == 5000
    assert all(i.startswith("req_") and len(i) == 36 for i in many)
    # Ordered in time (the ledger's index takes them at its right edge)...
    stamps = [int(i[4:16], 16) for i in many]
    assert stamps == sorted(stamps) and abs(stamps[-1] / 1000 - time.time()) < 60
    # ...and the rest is random: consecutive ids share no long run of it, and another
    # instance (another process) makes other ids.
    tails = [i[16:] for i in many]

    def shared(a: str, b: str) -> int:
        return next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))

    assert max(shared(a, b) for a, b in itertools.pairwise(tails)) < 8
    other = RequestIds()
    assert not {other() for _ in range(5000)} & set(many)
    assert new_request_id() != new_request_id()


@given(st.text(min_size=1, max_size=200))
def test_client_request_id_is_kept_only_when_well_formed(value: str) -> None:
    cid, err = request_headers.client_request_id({"x-request-id": value})
    ok = 1 <= len(value) <= 128 and all(c.isascii() and (c.isalnum() or c in "._:-") for c in value)
    if ok:
        assert cid == value and err is None
    else:
        assert cid is None and err is not None
        assert err.status == 400 and err.param == "x-request-id" and err.code == "invalid_header"


def test_x_client_request_id_wins_over_x_request_id() -> None:
    got = request_headers.client_request_id({"x-client-request-id": "a", "x-request-id": "b"})
    assert got == ("a", None)


@given(st.text(max_size=30))
def test_request_timeout_accepts_plain_decimal_seconds_only(value: str) -> None:
    plain = re.fullmatch(r"[0-9]{1,6}(\.[0-9]{1,6})?", value) is not None
    try:
        seconds = request_headers.request_timeout(value)
    except InvalidRequest as exc:
        assert exc.param == "x-request-timeout"
        assert not plain or not 0 < float(value) <= 86400
    else:
        assert plain and seconds == float(value) and 0 < seconds <= 86400


@pytest.mark.parametrize("value", ["1_0", "inf", "nan", "1e3", " 2", "-1", "0", "86401", "0x10"])
def test_request_timeout_refuses_what_float_would_take(value: str) -> None:
    with pytest.raises(InvalidRequest):
        request_headers.request_timeout(value)


@given(st.text(max_size=40))
def test_planned_steps_is_a_bounded_integer(value: str) -> None:
    steps, err = request_headers.planned_steps({"x-task-planned-steps": value})
    if err is None:
        assert steps is not None and 1 <= steps <= request_headers.MAX_PLANNED_STEPS
        assert str(steps) == value.lstrip("0") or value.lstrip("0") == ""
    else:
        assert steps is None and err.param == "x-task-planned-steps"


def test_planned_steps_beyond_64_bits_is_refused_not_dropped_later() -> None:
    steps, err = request_headers.planned_steps({"x-task-planned-steps": "9" * 26})
    assert steps is None and err is not None


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("x-task-id", "has space"),
        ("x-task-id", "x" * 129),
        ("x-parent-request-id", "a,b c"),
        ("x-parent-request-id", ",".join(f"p{i}" for i in range(40))),
        ("cache-control", "no-store" + "x" * 300),
        ("x-switchyard-locale", "en\x01"),
        ("x-switchyard-cache-tags", ",".join(f"t{i}" for i in range(40))),
        ("traceparent", "00-" + "a" * 200),
    ],
)
def test_every_read_header_is_bounded(name: str, value: str) -> None:
    headers = {name: value}
    errors = [
        request_headers.task_id(headers)[1],
        request_headers.parent_request_ids(headers)[1],
        request_headers.check(headers),
    ]
    named = [e for e in errors if e is not None]
    assert named and named[0].param == name and named[0].status == 400


def _ctx() -> RequestContext:
    now = time.perf_counter()
    return RequestContext(
        input=RequestInput("r", "chat.completions", time.time()),
        request=NOT_READ,
        timings=Timings(received=now),
        deadline=now + 5,
    )


class _Answer(Stage):
    name = "first"

    def __init__(self, calls: list[str]) -> None:
        self.calls = calls

    async def _work(self, ctx: RequestContext) -> None:
        self.calls.append("first")
        ctx.record("first", "hit", "answered here", time.perf_counter(), {"score": 1.0})
        ctx.response = "cached"

    def work(self, ctx: RequestContext) -> Any:
        return self._work(ctx)


class _Never(Stage):
    name = "second"

    def __init__(self, calls: list[str]) -> None:
        self.calls = calls

    def work(self, ctx: RequestContext) -> None:
        self.calls.append("second")


class _Reject(Stage):
    name = "reject"

    def work(self, ctx: RequestContext) -> None:
        raise ModelNotFound("nope")


def test_pipeline_records_decisions_and_stops_at_a_response() -> None:
    calls: list[str] = []
    ctx = _ctx()
    pending = Pipeline([_Answer(calls), _Never(calls)]).decide(ctx)
    assert pending is not None
    asyncio.run(pending)  # type: ignore[arg-type]
    assert calls == ["first"]
    assert [d[0] for d in ctx.decisions] == ["first"]
    d = decision_dict(ctx.decisions[0], ctx.clock_base)
    assert d["outcome"] == "hit" and d["evidence"] == {"score": 1.0} and d["duration_ms"] >= 0
    # Wall-clock start is derived from the request's clock: never before it was received.
    assert d["started_at"] >= ctx.input.received_at - 1e-6


def test_pipeline_reject_propagates() -> None:
    with pytest.raises(ModelNotFound):
        Pipeline([_Reject()]).decide(_ctx())


def _chat_body(**extra: Any) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": "hi"}], **extra}


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"n": 1000}, "n"),
        ({"logprobs": "yes"}, "logprobs"),
        ({"top_logprobs": 50}, "top_logprobs"),
        ({"user": {"id": 1}}, "user"),
        ({"user": "u" * 600}, "user"),
        ({"max_tokens": 2**63}, "max_tokens"),
        ({"seed": 2**64}, "seed"),
        ({"presence_penalty": 3}, "presence_penalty"),
        ({"response_format": "json"}, "response_format"),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
        ({"tool_choice": "always"}, "tool_choice"),
        ({"tool_choice": {"type": "function"}}, "tool_choice"),
        ({"tools": [{"type": "function", "function": {}}]}, "tools[0].function.name"),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": [1]}}]},
            "tools[0].function.parameters",
        ),
        ({"tools": ["f"]}, "tools[0]"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"logit_bias": {"abc": 1}}, "logit_bias.abc"),
        ({"logit_bias": {"5": 500}}, "logit_bias.5"),
        ({"metadata": {"k": 1}}, "metadata"),
        ({"parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ],
)
def test_fields_the_gateway_forwards_are_validated(extra: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidRequest) as got:
        validate_chat(_chat_body(**extra))
    assert got.value.param == param and got.value.status == 400


@pytest.mark.parametrize(
    ("message", "param"),
    [
        ({"role": "user", "content": [{"type": "video", "url": "x"}]}, "messages[0].content[0]"),
        ({"role": "user", "content": [{"type": "text", "text": 5}]}, "messages[0].content[0].text"),
        ({"role": "user", "content": ["bare string part"]}, "messages[0].content[0]"),
        (
            {"role": "user", "content": [{"type": "image_url", "image_url": "http://x"}]},
            "messages[0].content[0].image_url",
        ),
        ({"role": "user", "content": "hi", "name": 7}, "messages[0].name"),
        ({"role": "tool", "content": "result"}, "messages[0].tool_call_id"),
        (
            {"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "f"}}]},
            "messages[0].tool_calls[0]",
        ),
    ],
)
def test_message_shapes_are_validated(message: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidRequest) as got:
        validate_chat({"model": "m", "messages": [message]})
    assert got.value.param == param


def test_valid_requests_with_every_checked_field_pass() -> None:
    body = _chat_body(
        n=2,
        logprobs=True,
        top_logprobs=5,
        user="u-1",
        max_tokens=100,
        seed=-5,
        response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": {}}},
        tool_choice={"type": "function", "function": {"name": "f"}},
        tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
        stop=["a", "b"],
        logit_bias={"5": -100, "7": 2.5},
        metadata={"k": "v"},
        top_k=40,
        return_token_ids=True,
        typical_p=0.9,  # an engine's extra: passes by default
    )
    body["messages"] += [
        {"role": "user", "content": [{"type": "text", "text": "x"}], "name": "al"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}
            ],
        },
        {"role": "tool", "tool_call_id": "c", "content": "ok"},
    ]
    assert validate_chat(body) == "m"
    with pytest.raises(InvalidRequest) as got:
        validate_chat(body, "reject")
    assert got.value.param == "typical_p"
    assert validate_completion({"model": "m", "prompt": [[1, 2], [3]], "logprobs": 3}) == "m"
    with pytest.raises(InvalidRequest):
        validate_completion({"model": "m", "prompt": "x", "logprobs": 9})
    with pytest.raises(InvalidRequest):
        validate_completion({"model": "m", "prompt": [1, "a"]})
