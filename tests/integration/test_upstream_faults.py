"""Upstream failures seen through the gateway, using the scripted upstream fixture."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from support.gateways import Gateway, start_gateway
from support.procs import free_port
from support.upstreams import Scripted

BODY = {"model": "scripted", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}


@pytest.fixture(scope="module")
def gw(scripted: Scripted) -> Iterator[Gateway]:
    dead = free_port()  # nothing listens here
    g = start_gateway(
        {
            "models": [
                {
                    "alias": "scripted",
                    "revision": "s1",
                    "engine": {"kind": "openai", "base_url": scripted.url + "/v1"},
                    "timeouts": {"connect_s": 1, "first_byte_s": 20, "total_s": 60},
                    # No retries: these tests check how each failure maps to the contract.
                    "resilience": {"retries": 0},
                },
                {
                    "alias": "nowhere",
                    "engine": {"kind": "openai", "base_url": f"http://127.0.0.1:{dead}/v1"},
                },
            ],
            "embeddings": {"enabled": False},
        }
    )
    yield g
    g.proc.stop()


def _post(gw: Gateway, body: dict[str, Any], **kw: Any) -> httpx.Response:
    return gw.post("/v1/chat/completions", json=body, timeout=30, **kw)


def test_mid_stream_death_is_an_sse_error_not_a_truncated_success(
    gw: Gateway, scripted: Scripted
) -> None:
    scripted.fault("drop-mid-stream")
    with gw.stream({**BODY, "stream": True}) as r:
        assert r.status_code == 200
        text = "".join(r.iter_text())
    events = [e for e in text.split("\n\n") if e]
    assert "data: [DONE]" not in events
    assert events[-1].startswith('data: {"error"')
    assert "upstream" in events[-1]
    assert any('"content"' in e for e in events[:-1]), "the tokens before the failure were relayed"


def test_openai_client_raises_on_mid_stream_error(gw: Gateway, scripted: Scripted) -> None:
    import openai

    scripted.fault("drop-mid-stream")
    stream = gw.openai().chat.completions.create(**BODY, stream=True)
    with pytest.raises(openai.APIError):
        list(stream)


@pytest.mark.parametrize(
    ("fault", "status", "code"),
    [
        ("status:500", 502, "upstream_error"),
        ("status:503", 502, "upstream_error"),
        ("busy:3", 503, "upstream_overloaded"),  # at capacity: 503 with its Retry-After
        ("status:400", 400, "upstream_rejected"),
        ("status:429", 429, "upstream_rate_limited"),
        ("close", 502, "upstream_error"),
    ],
)
def test_upstream_errors_map_to_the_contract(
    gw: Gateway, scripted: Scripted, fault: str, status: int, code: str
) -> None:
    scripted.fault(fault)
    r = _post(gw, BODY)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["code"] == code
    assert "Traceback" not in r.text
    if status == 429:
        assert r.headers["retry-after"] == "1"
    if status == 503:
        assert r.headers["retry-after"] == "3"
    assert _post(gw, BODY).status_code == 200  # the fault was one request only


def test_unreachable_upstream_is_502(gw: Gateway) -> None:
    r = _post(gw, {**BODY, "model": "nowhere"})
    assert r.status_code == 502
    assert r.json()["error"]["code"] == "upstream_unreachable"
    assert r.headers["x-switchyard-model"] == "nowhere"


def test_hanging_upstream_is_504_at_the_deadline(gw: Gateway, scripted: Scripted) -> None:
    scripted.fault("hang")
    started = time.monotonic()
    r = _post(gw, BODY, headers={"x-request-timeout": "1.5"})
    took = time.monotonic() - started
    assert r.status_code == 504
    assert r.json()["error"]["code"] == "upstream_timeout"
    assert took < 10  # generous: only catches a hang past the deadline


def test_stream_usage_is_relayed_only_when_asked(gw: Gateway) -> None:
    def events(body: dict[str, Any]) -> list[str]:
        with gw.stream(body) as r:
            return [e for e in "".join(r.iter_text()).split("\n\n") if e]

    plain = events({**BODY, "stream": True})
    assert plain[-1] == "data: [DONE]"
    assert not any('"choices":[]' in e for e in plain)
    asked = events({**BODY, "stream": True, "stream_options": {"include_usage": True}})
    assert '"usage"' in asked[-2] and '"choices":[]' in asked[-2]
