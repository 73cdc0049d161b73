"""Resilience: retry classes, deadlines, retry budget, breakers, fallbacks, idempotency.

Pure state machines are driven with explicit clocks; the rest runs through a real
gateway in front of scripted upstreams on loopback.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import random
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from support.gateways import Gateway, start_gateway
from support.procs import free_port
from support.upstreams import Scripted, start_scripted
from switchyard.config import (
    BreakerConfig,
    ConfigError,
    Resilience,
    RetryBudgetConfig,
    parse_settings,
)
from switchyard.execute.compat import incompatibility, request_needs
from switchyard.execute.retry import RetryBudget, backoff_s
from switchyard.request import Generation
from switchyard.state.breakers_memory import CircuitBreaker

# -- pure parts -------------------------------------------------------------------------


def test_breaker_opens_probes_and_closes() -> None:
    b = CircuitBreaker("m", BreakerConfig(failures=3, cooldown_s=10, half_open_probes=1))
    for t in range(3):
        assert b.allow(t)[0]
        b.record(False, t)
    assert b.state == "open"
    assert b.allow(5)[0] is False
    assert b.allow(11.9)[0] is False  # opened at t=2, cooldown 10 s
    ok, why = b.allow(12.1)
    assert ok and why == "half-open probe"
    assert b.allow(12.2)[0] is False  # only one probe at a time
    b.record(False, 12.5)
    assert b.state == "open"  # a failed probe reopens for another cooldown
    assert b.allow(22.4)[0] is False
    assert b.allow(22.6)[0]
    b.record(True, 22.7)
    assert b.state == "closed" and b.allow(22.8)[0]


def test_breaker_opens_on_failure_rate() -> None:
    b = CircuitBreaker(
        "m", BreakerConfig(failures=100, failure_rate=0.5, window_s=30, min_requests=10)
    )
    for i in range(10):
        b.record(i % 2 == 0, float(i))  # alternate: never 2 failures in a row
    assert b.state == "open"


def test_backoff_full_jitter_and_retry_after() -> None:
    cfg = Resilience(backoff_base_s=0.1, backoff_max_s=1.0)
    rng = random.Random(1)
    waits = [backoff_s(3, cfg, None, rng) for _ in range(200)]
    assert all(0 <= w <= 0.4 for w in waits) and max(waits) > 0.3 and min(waits) < 0.1
    assert all(backoff_s(10, cfg, None, rng) <= 1.0 for _ in range(50))  # capped
    assert backoff_s(1, cfg, 2.5, rng) == 2.5  # the upstream's Retry-After wins


def test_retry_budget_caps_retries_during_an_outage() -> None:
    budget = RetryBudget(RetryBudgetConfig(ratio=0.2, window_s=10, min_retries=2))
    spent = 0
    for i in range(100):
        now = i * 0.05
        budget.first_attempt(now)
        if budget.try_spend(now):
            spent += 1
    assert spent <= 100 * 0.2 + 2
    assert budget.denied > 0


def test_attempt_timeout_never_passes_the_deadline_and_is_shared() -> None:
    from switchyard.config import Timeouts
    from switchyard.engines.upstream import OpenAIUpstream

    up = OpenAIUpstream("u", lambda: "http://127.0.0.1:9/v1")
    t = Timeouts(connect_s=1.0, first_byte_s=5.0, total_s=30.0)
    for remaining in (0.0004, 0.0123456, 2.9999, 29.99, 45.0):
        got = up._timeout(t, remaining)
        assert got.total is not None and got.total <= max(0.001, min(30.0, remaining))
        assert got.total > min(30.0, remaining) - 0.001 or got.total == 0.001
        assert (got.sock_connect, got.sock_read) == (1.0, 5.0)
    assert up._timeout(t, None).total == 30.0
    # Requests whose remaining time rounds to the same millisecond share one object.
    assert up._timeout(t, 12.3451) is up._timeout(t, 12.3459)
    assert up._timeout(t, 12.3451) is not up._timeout(t, 12.3461)
    # Other timeouts on the same client are never answered with the first ones'.
    other = Timeouts(connect_s=3.0, first_byte_s=7.0, total_s=60.0)
    got = up._timeout(other, 12.3451)
    assert (got.total, got.sock_connect, got.sock_read) == (12.345, 3.0, 7.0)
    assert up._timeout(t, None).total == 30.0


def test_compatibility_rules() -> None:
    s = parse_settings(
        {
            "models": [
                {
                    "alias": "small",
                    "engine": {"kind": "openai", "base_url": "http://h/v1"},
                    "capabilities": {"context_window": 1000},
                    "region": "us",
                },
                {
                    "alias": "tools",
                    "engine": {"kind": "openai", "base_url": "http://h/v1"},
                    "capabilities": {"context_window": 8000, "supports_tools": True},
                    "region": "eu",
                },
            ]
        }
    )
    small, tools = s.models
    with_tools = request_needs(
        Generation(model="m", tools=[{"type": "function"}], messages=[]), 100, 100
    )
    assert "tool" in (incompatibility(with_tools, small, None) or "")
    assert incompatibility(with_tools, tools, None) is None
    long = request_needs(Generation(model="m", messages=[]), 900, 200)
    assert "context window" in (incompatibility(long, small, None) or "")
    assert "region" in (incompatibility(long, tools, ["us"]) or "")


def test_impossible_fallback_and_unfit_retry_plan_fail_at_load() -> None:
    base = {"engine": {"kind": "openai", "base_url": "http://h/v1"}}
    with pytest.raises(ConfigError, match="outside this model's data_boundary"):
        parse_settings(
            {
                "models": [
                    {
                        "alias": "eu",
                        **base,
                        "region": "eu",
                        "data_boundary": ["eu"],
                        "fallbacks": ["us"],
                    },
                    {"alias": "us", **base, "region": "us"},
                ]
            }
        )
    with pytest.raises(ConfigError, match="unknown alias 'ghost'"):
        parse_settings({"models": [{"alias": "a", **base, "fallbacks": ["ghost"]}]})
    with pytest.raises(ConfigError) as exc:
        parse_settings(
            {
                "server": {"default_deadline_s": 10},
                "models": [
                    {
                        "alias": "a",
                        **base,
                        "timeouts": {"first_byte_s": 4},
                        "resilience": {"retries": 2},
                    }
                ],
            }
        )
    msg = str(exc.value)
    assert "resilience.retries 2" in msg and "timeouts.first_byte_s 4" in msg
    assert "server.default_deadline_s 10" in msg


# -- through the gateway --------------------------------------------------------------------

BODY: dict[str, Any] = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
TOOLS = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]


@pytest.fixture(scope="module")
def second() -> Iterator[Scripted]:
    proc, s = start_scripted()
    yield s
    proc.stop()


def _model(alias: str, url: str, **over: Any) -> dict[str, Any]:
    m: dict[str, Any] = {
        "alias": alias,
        "engine": {"kind": "openai", "base_url": url + "/v1"},
        "timeouts": {"connect_s": 1, "first_byte_s": 5, "total_s": 30},
    }
    m.update(over)
    return m


@pytest.fixture(scope="module")
def gw(scripted: Scripted, second: Scripted) -> Iterator[Gateway]:
    dead = f"http://127.0.0.1:{free_port()}"
    fast = {"backoff_base_s": 0.01, "backoff_max_s": 0.05}
    g = start_gateway(
        {
            "server": {"default_deadline_s": 30},
            "models": [
                _model("r1", scripted.url, resilience={"retries": 1, **fast}),
                _model("r3", scripted.url, resilience={"retries": 3, **fast}),
                _model(
                    "no503",
                    scripted.url,
                    resilience={"retries": 2, "retry_on": ["connect", "500"], **fast},
                ),
                _model(
                    "outage",
                    second.url,
                    resilience={
                        "retries": 3,
                        **fast,
                        "retry_budget": {"ratio": 0.2, "window_s": 60, "min_retries": 1},
                        "breaker": {"failures": 1000, "min_requests": 1000},
                    },
                ),
                _model(
                    "brk",
                    second.url,
                    resilience={"retries": 0, "breaker": {"failures": 3, "cooldown_s": 1.5}},
                ),
                _model(
                    "primary",
                    dead,
                    capabilities={"supports_tools": True},
                    region="eu",
                    resilience={"retries": 0},
                    fallbacks=["plain", "capable", "faraway"],
                ),
                _model("plain", second.url, region="eu"),
                _model("capable", second.url, capabilities={"supports_tools": True}, region="eu"),
                _model("faraway", second.url, capabilities={"supports_tools": True}, region="us"),
                _model(
                    "eu-only-chain",
                    dead,
                    region="eu",
                    resilience={"retries": 0},
                    fallbacks=["faraway"],
                ),
            ],
            "embeddings": {"enabled": False},
        }
    )
    yield g
    g.proc.stop()


def _chat(gw: Gateway, model: str, key: str | None = None, **kw: Any) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key or gw.key}", **kw.pop("headers", {})}
    body = {**BODY, "model": model, **kw.pop("body", {})}
    return httpx.post(gw.url + "/v1/chat/completions", json=body, headers=headers, timeout=60)


@pytest.mark.parametrize(
    ("fault", "model", "status", "attempts"),
    [
        ("status:503", "r1", 200, 2),  # retryable, retried once, then served
        ("status:500", "r1", 200, 2),
        ("close", "r1", 200, 2),  # connection reset before a reply
        ("status:400", "r1", 400, 1),  # final: passed through with its meaning, never retried
        ("status:422", "r1", 422, 1),
        ("status:503", "no503", 502, 1),  # 503 not configured as retryable here
    ],
)
def test_error_classes(
    gw: Gateway, scripted: Scripted, fault: str, model: str, status: int, attempts: int
) -> None:
    before = scripted.requests()
    scripted.fault(fault, count=1)
    r = _chat(gw, model)
    assert r.status_code == status, r.text
    assert scripted.requests() - before == attempts
    if status == 200:
        assert r.headers["x-switchyard-attempts"] == str(attempts)
    else:
        assert "Traceback" not in r.text


def test_retry_after_from_upstream_is_honoured(gw: Gateway, scripted: Scripted) -> None:
    scripted.fault("status:429", count=1)  # the fixture sends Retry-After: 1
    started = time.monotonic()
    r = _chat(gw, "r1")
    assert r.status_code == 200 and r.headers["x-switchyard-attempts"] == "2"
    assert time.monotonic() - started >= 1.0


@pytest.mark.parametrize("model", ["r1", "r3"])
def test_hanging_upstream_never_overruns_the_deadline(
    gw: Gateway, scripted: Scripted, model: str
) -> None:
    scripted.fault("hang", count=10)
    started = time.monotonic()
    r = _chat(gw, model, headers={"x-request-timeout": "1.5"})
    took = time.monotonic() - started
    scripted.fault("delay:0", count=0)
    assert r.status_code == 504
    assert took < 1.5 + 1.0, f"{took:.2f}s for a 1.5s deadline"


def test_retry_budget_bounds_load_during_outage(gw: Gateway, second: Scripted) -> None:
    second.fault("status:503", count=1000)
    before = second.requests()
    codes = [_chat(gw, "outage").status_code for _ in range(20)]
    calls = second.requests() - before
    second.fault("delay:0", count=0)
    assert codes == [502] * 20
    # 20 first attempts, retries capped at 20% of them plus the floor of 1.
    assert 20 < calls <= 20 * 1.2 + 1, calls


def test_breaker_opens_blocks_then_probes_and_closes(gw: Gateway, second: Scripted) -> None:
    second.fault("status:500", count=3)
    assert [_chat(gw, "brk").status_code for _ in range(3)] == [502, 502, 502]
    before = second.requests()
    r = _chat(gw, "brk")
    assert r.status_code == 503 and r.json()["error"]["code"] == "circuit_open"
    assert r.headers["retry-after"]
    assert second.requests() == before  # nothing reached the upstream while open
    ready = httpx.get(gw.url + "/readyz").json()["models"]["brk"]["breaker"]
    assert ready["state"] == "open"
    time.sleep(1.7)
    probe = _chat(gw, "brk")
    assert probe.status_code == 200  # the half-open probe succeeded
    assert httpx.get(gw.url + "/readyz").json()["models"]["brk"]["breaker"]["state"] == "closed"


def test_an_upstream_at_capacity_is_passed_on_and_never_opens_the_breaker(
    gw: Gateway, second: Scripted
) -> None:
    """503 with Retry-After (a Serve deployment's full queue while it scales out): the
    client gets 503 and that Retry-After at once, and the breaker, which opens after 3
    failures, counts none of them."""
    second.fault("busy:1", count=4)
    replies = [_chat(gw, "brk") for _ in range(4)]
    assert [r.status_code for r in replies] == [503] * 4, [r.text for r in replies]
    for r in replies:
        assert r.json()["error"]["code"] == "upstream_overloaded"
        assert r.headers["retry-after"] == "1"
    before = second.requests()
    assert _chat(gw, "brk").status_code == 200
    assert second.requests() == before + 1
    assert httpx.get(gw.url + "/readyz").json()["models"]["brk"]["breaker"]["state"] == "closed"


def test_tool_request_falls_back_only_to_a_tool_capable_target(gw: Gateway) -> None:
    r = _chat(gw, "primary", body={"tools": TOOLS})
    assert r.status_code == 200, r.text
    assert r.headers["x-switchyard-fallback"] == "primary -> capable"
    assert r.headers["x-switchyard-model"] == "capable"
    # Without tools the first fallback is fine.
    r = _chat(gw, "primary")
    assert r.headers["x-switchyard-fallback"] == "primary -> plain"


def test_eu_only_tenant_never_reaches_a_non_eu_target(gw: Gateway, second: Scripted) -> None:
    gw.create_tenant("eu-corp", labels={"regions": ["eu"]})
    key = gw.create_key("eu-corp")["key"]
    r = _chat(gw, "primary", key=key, body={"tools": TOOLS})
    assert r.headers["x-switchyard-fallback"] == "primary -> capable"
    before = second.requests()
    r = _chat(gw, "eu-only-chain", key=key)
    assert r.status_code in (502, 503) and "x-switchyard-fallback" not in r.headers
    assert second.requests() == before  # "faraway" (us) was never called
    # A tenant without the restriction does reach it.
    assert _chat(gw, "eu-only-chain").headers["x-switchyard-fallback"] == "eu-only-chain -> faraway"


def test_mid_stream_failure_is_an_sse_error_and_a_partial_usage_row(
    gw: Gateway, scripted: Scripted
) -> None:
    scripted.fault("drop-mid-stream", count=1)
    with gw.stream(
        {**BODY, "model": "r1", "stream": True}, headers={"x-request-id": "midstream-1"}
    ) as r:
        text = "".join(r.iter_text())
    assert '"error"' in text.split("\n\n")[-2] and "[DONE]" not in text
    told = json.loads(text.split("\n\n")[-2].removeprefix("data: "))["error"]["code"]
    rows = [x for x in gw.usage(limit=50) if x["client_request_id"] == "midstream-1"]
    assert rows and rows[0]["status"] == "incomplete"
    assert rows[0]["error_code"] == told == "upstream_error"  # what the client was told
    assert rows[0]["output_tokens"] > 0  # what was relayed before the failure is counted
    assert rows[0]["input_tokens"] > 0  # estimated, though no limit asked for an estimate


def test_idempotency_one_upstream_call_for_fifty_identical_requests(
    gw: Gateway, scripted: Scripted
) -> None:
    scripted.fault("delay:300", count=1)
    before = scripted.requests()

    def call(_: int) -> httpx.Response:
        return _chat(gw, "r1", headers={"Idempotency-Key": "order-7781"})

    with concurrent.futures.ThreadPoolExecutor(50) as pool:
        rs = list(pool.map(call, range(50)))
    assert scripted.requests() - before == 1
    assert {r.status_code for r in rs} == {200}
    assert len({r.content for r in rs}) == 1
    assert sum(1 for r in rs if r.headers.get("x-switchyard-idempotent-replay") == "true") == 49
    other = _chat(gw, "r1", headers={"Idempotency-Key": "order-7781"}, body={"max_tokens": 3})
    assert other.status_code == 422 and other.json()["error"]["code"] == "idempotency_key_reused"
    # Another tenant's identical key is a different request.
    gw.create_tenant("idem-b")
    key_b = gw.create_key("idem-b")["key"]
    before = scripted.requests()
    assert _chat(gw, "r1", key=key_b, headers={"Idempotency-Key": "order-7781"}).status_code == 200
    assert scripted.requests() - before == 1


def test_one_idempotency_key_on_another_protocol_is_another_request(
    gw: Gateway, scripted: Scripted
) -> None:
    """Chat, Messages and Responses requests that decode to one internal request, under
    one `Idempotency-Key`: each protocol's first is its own upstream call, never a reply
    translated from another protocol's; each protocol's repeat is its own replay."""
    key = {"Authorization": f"Bearer {gw.key}", "Idempotency-Key": "cross-proto-1"}
    calls = [
        ("/v1/chat/completions", {**BODY, "model": "r1"}),
        ("/v1/messages", {**BODY, "model": "r1"}),
        ("/v1/responses", {"model": "r1", "input": "hi", "max_output_tokens": 16}),
    ]
    for path, body in calls:
        before = scripted.requests()
        first = httpx.post(gw.url + path, json=body, headers=key, timeout=60)
        assert first.status_code == 200, (path, first.text)
        assert "x-switchyard-idempotent-replay" not in first.headers, path
        assert scripted.requests() - before == 1, path
        again = httpx.post(gw.url + path, json=body, headers=key, timeout=60)
        assert again.headers.get("x-switchyard-idempotent-replay") == "true", path
        assert scripted.requests() - before == 1, path


def test_failed_idempotent_request_can_be_repeated(gw: Gateway, scripted: Scripted) -> None:
    scripted.fault("status:400", count=1)
    assert _chat(gw, "r1", headers={"Idempotency-Key": "retry-me"}).status_code == 400
    r = _chat(gw, "r1", headers={"Idempotency-Key": "retry-me"})
    assert r.status_code == 200 and "x-switchyard-idempotent-replay" not in r.headers


@contextlib.contextmanager
def _gateways_sharing_redis(
    second: Scripted, alias: str, failures: int
) -> Iterator[tuple[Gateway, Gateway]]:
    """Two gateways on one Redis, serving `alias` from `second` with no retries and a
    breaker that opens after `failures`."""
    from support.redis_server import start_redis, stop_redis

    redis_proc, url = start_redis()
    model = _model(
        alias,
        second.url,
        resilience={"retries": 0, "breaker": {"failures": failures, "cooldown_s": 30}},
    )
    base = {
        "models": [model],
        "embeddings": {"enabled": False},
        "storage": {"redis_url": url, "redis_timeout_s": 3},
    }
    a = start_gateway(base)
    b = start_gateway(base)
    try:
        yield a, b
    finally:
        a.proc.stop()
        b.proc.stop()
        stop_redis(redis_proc)


def test_breaker_opened_by_one_gateway_stops_the_other_through_redis(second: Scripted) -> None:
    with _gateways_sharing_redis(second, "shared", failures=2) as (a, b):
        assert _chat(b, "shared").status_code == 200  # b's breaker is closed and healthy
        second.fault("status:500", count=2)
        assert [_chat(a, "shared").status_code for _ in range(2)] == [502, 502]  # a opens
        before = second.requests()
        time.sleep(0.5)  # longer than the shared-state refresh interval
        r = _chat(b, "shared")
        assert r.status_code == 503 and r.json()["error"]["code"] == "circuit_open"
        assert second.requests() == before  # b never called the failing upstream


def test_failures_split_across_gateways_open_the_breaker_through_redis(second: Scripted) -> None:
    """Each gateway sees fewer failures than the threshold; together they reach it. A
    success on either ends the run for both."""
    with _gateways_sharing_redis(second, "split", failures=3) as (a, b):
        # A run broken by a success: fail (a), fail (b), ok (a), fail (b): never 3 in a row.
        second.fault("status:500", count=2)
        assert [_chat(g, "split").status_code for g in (a, b)] == [502, 502]
        assert _chat(a, "split").status_code == 200
        second.fault("status:500", count=1)
        assert _chat(b, "split").status_code == 502
        time.sleep(0.5)  # past the refresh interval: b knows the run is at 1
        assert [_chat(g, "split").status_code for g in (a, b)] == [200, 200]

        # Now three in a row, split 2 (a) + 1 (b): neither alone reaches 3.
        second.fault("status:500", count=3)
        assert [_chat(g, "split").status_code for g in (a, b, a)] == [502, 502, 502]
        before = second.requests()
        time.sleep(0.5)
        for g in (a, b):
            r = _chat(g, "split")
            assert r.status_code == 503 and r.json()["error"]["code"] == "circuit_open"
        assert second.requests() == before  # neither called the failing upstream again
