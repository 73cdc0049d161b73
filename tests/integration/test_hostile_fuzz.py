"""Generated hostile requests against the real gateway (hypothesis, real HTTP).

Random JSON bodies (valid-looking and not), random values of every header the gateway
reads, on both model routes. For each: no 500, every error in the OpenAI shape with no
exception text, the gateway keeps serving; and at the end the ledger holds exactly one
row per request that passed authentication. The upstream is the scripted instant one:
fuzzing never waits on a model.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, reject, settings
from hypothesis import strategies as st

from support.gateways import Gateway, start_gateway
from support.upstreams import Scripted

LEAKS = re.compile(
    r"Traceback|File \"|Exception|Connect call failed|ssl:default|ClientPayloadError"
    r"|ServerDisconnected|line \d+ column \d+|/site-packages/|\.py\b"
)
HEADERS = (
    "x-request-id",
    "x-client-request-id",
    "x-request-timeout",
    "x-task-id",
    "x-parent-request-id",
    "x-task-planned-steps",
    "idempotency-key",
    "cache-control",
    "x-switchyard-locale",
    "x-switchyard-cache-tags",
    "traceparent",
)
# What an HTTP client can put in a header value at all (no CR, LF or NUL).
header_text = st.text(
    alphabet=st.characters(min_codepoint=0x20, max_codepoint=0xFF, exclude_characters="\x7f"),
    max_size=300,
).map(lambda v: v.strip(" \t"))  # HTTP trims optional whitespace around a value
json_leaf = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False)
    | st.text(max_size=40)
)
json_value = st.recursive(
    json_leaf,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4)
    ),
    max_leaves=25,
)
FIELDS = (
    "model", "messages", "prompt", "stream", "max_tokens", "n", "temperature", "tools",
    "tool_choice", "response_format", "logprobs", "user", "stop", "logit_bias", "seed",
    "stream_options",
)  # fmt: skip
message = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "assistant", "tool", "bogus"])},
    optional={"content": json_value, "name": json_value, "tool_calls": json_value},
)
body_strategy = st.one_of(
    st.fixed_dictionaries(
        {"model": st.just("cheap"), "messages": st.lists(message, min_size=1, max_size=3)},
        optional={f: json_value for f in FIELDS[3:]},
    ),
    st.dictionaries(st.sampled_from(FIELDS), json_value, max_size=6),
    json_value,
)


@pytest.fixture(scope="module")
def gw(scripted: Scripted) -> Iterator[Gateway]:
    g = start_gateway(
        {
            "models": [
                {"alias": "cheap", "engine": {"kind": "openai", "base_url": scripted.url + "/v1"}}
            ],
            "embeddings": {"enabled": False},
        }
    )
    tenant = "fuzz-" + os.urandom(3).hex()
    g.create_tenant(tenant)
    g.key = g.create_key(tenant)["key"]
    g.config = {"tenant": tenant}
    yield g
    g.proc.stop()


SENT: dict[str, int] = {"authenticated": 0}


@settings(
    max_examples=150,
    deadline=None,
    derandomize=True,  # the same examples in every run: CI is reproducible
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    path=st.sampled_from(["/v1/chat/completions", "/v1/completions"]),
    body=body_strategy,
    headers=st.dictionaries(st.sampled_from(HEADERS), header_text, max_size=3),
    raw=st.booleans(),
)
def test_generated_requests_never_break_the_gateway(
    gw: Gateway, path: str, body: Any, headers: dict[str, str], raw: bool
) -> None:
    text = json.dumps(body).encode()  # the stdlib writes any integer (and Infinity)
    content = text if not raw else text[:-1]  # cut: not JSON
    try:
        r = httpx.post(
            gw.url + path,
            content=content,
            headers={
                **gw.auth,
                "Content-Type": "application/json",
                **{k: v.encode("latin-1") for k, v in headers.items()},
            },
            timeout=30,
        )
    except httpx.LocalProtocolError:  # the client library would not send it: not a case
        reject()
    SENT["authenticated"] += 1
    assert r.status_code != 500, r.text
    assert r.status_code < 500 or r.status_code in (502, 503, 504), r.text
    if r.status_code >= 400:
        err = r.json()["error"]
        assert set(err) >= {"message", "type", "param", "code"}
        assert isinstance(err["message"], str) and err["message"]
    assert not LEAKS.search(r.text), r.text


def test_the_ledger_has_one_row_per_authenticated_request(gw: Gateway) -> None:
    assert SENT["authenticated"] >= 100  # the generated test ran first
    r = gw.post(
        "/v1/chat/completions",
        json={"model": "cheap", "messages": [{"role": "user", "content": "hi"}]},
    )
    assert r.status_code == 200  # still serving
    rows = gw.usage(tenant=gw.config["tenant"], limit=100_000)
    assert len(rows) == SENT["authenticated"] + 1
    assert len({row["request_id"] for row in rows}) == len(rows)
    metrics = httpx.get(gw.url + "/metrics", headers=gw.admin).text
    dropped = re.search(r"^switchyard_ledger_rows_dropped_total (\S+)$", metrics, re.M)
    assert dropped is not None and float(dropped.group(1)) == 0.0
