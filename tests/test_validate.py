"""Request validation and the pipeline skeleton, without servers."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from switchyard.errors import InvalidRequest, ModelNotFound
from switchyard.pipeline import (
    Pipeline,
    RequestContext,
    RequestIds,
    Timings,
    decision_dict,
    request_id_from,
)
from switchyard.policy.validate import validate_chat, validate_completion, validate_embeddings


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


def test_request_id_accepts_well_formed_only() -> None:
    assert request_id_from("abc-123") == "abc-123"
    assert request_id_from("has space").startswith("req_")
    assert request_id_from("x" * 200).startswith("req_")
    assert request_id_from(None) != request_id_from(None)
    ids = RequestIds()
    assert ids("abc-123") == "abc-123" and ids("bad id").startswith("req_")
    assert len({ids(None) for _ in range(1000)}) == 1000
    assert ids(None)[:16] != RequestIds()(None)[:16]  # another process, another prefix


def _ctx() -> RequestContext:
    now = time.perf_counter()
    return RequestContext(
        request_id="r",
        endpoint="chat.completions",
        body={},
        received_at=time.time(),
        timings=Timings(received=now),
        deadline=now + 5,
    )


def test_pipeline_records_decisions_and_stops_at_a_response() -> None:
    calls: list[str] = []

    async def first(ctx: RequestContext) -> None:
        calls.append("first")
        ctx.record("first", "hit", "answered here", time.perf_counter(), {"score": 1.0})
        ctx.response = "cached"

    async def second(ctx: RequestContext) -> None:
        calls.append("second")

    ctx = _ctx()
    asyncio.run(Pipeline([("first", first), ("second", second)]).decide(ctx))
    assert calls == ["first"]
    assert [d[0] for d in ctx.decisions] == ["first"]
    d = decision_dict(ctx.decisions[0], ctx.clock_base)
    assert d["outcome"] == "hit" and d["evidence"] == {"score": 1.0} and d["duration_ms"] >= 0
    # Wall-clock start is derived from the request's clock: never before it was received.
    assert d["started_at"] >= ctx.received_at - 1e-6


def test_pipeline_reject_propagates() -> None:
    async def reject(ctx: RequestContext) -> None:
        raise ModelNotFound("nope")

    with pytest.raises(ModelNotFound):
        asyncio.run(Pipeline([("reject", reject)]).decide(_ctx()))
