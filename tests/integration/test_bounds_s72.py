"""Header and body bounds, and refusals before costly work, over sockets against one real
gateway in front of the scripted upstream (its model `cheap`), with a valid key.

Defects these tests found (each failed on the code before the fix named):
- a body with `Content-Encoding: gzip` (or deflate, br) was read whole and answered
  400 "the request body is not valid JSON" with `param: null`: nothing says the coding
  is the problem. Now 415 `unsupported_media_type` naming `content-encoding`, before any
  of the body is read (api/body.py `check_encoding`), so a zip bomb is never inflated;
- a bad `x-switchyard-priority` was refused only by the scheduling queue, after routing
  and selection (the trace held route, select, deployment_limits) and with the chosen
  model's headers on the 400. Now refused with the other headers, before any stage
  (policy/headers.py `check`);
- a body nested past `max_json_depth` was first parsed whole by orjson, then walked in
  Python: 6 MB of arrays 66 deep held the event loop over a second before the 400.
  Now the depth is read from the bytes before parsing (api/body.py `too_deep`);
- a path one slash away from a route was redirected (307) to an absolute URL built
  from the Host header. Now the `Location` is the path alone (api/app.py
  `_slash_flipped`).
"""

from __future__ import annotations

import gzip
import os
import zlib
from collections.abc import Iterator
from typing import Any

import httpx
import orjson
import pytest

from support.gateways import Gateway, cheap_config, start_gateway
from support.upstreams import Scripted

ANTHROPIC = {"anthropic-version": "2023-06-01"}
MESSAGES = ("/v1/messages", "/v1/messages/count_tokens")


@pytest.fixture(scope="module")
def gw(scripted: Scripted) -> Iterator[Gateway]:
    g = start_gateway(cheap_config(scripted))
    yield g
    g.proc.stop()


def _ask() -> str:
    return f"say something {os.urandom(4).hex()}"  # unique: never an exact cache hit


def _body(path: str) -> dict[str, Any]:
    if path == "/v1/completions":
        return {"model": "cheap", "max_tokens": 4, "prompt": _ask()}
    if path == "/v1/responses":
        return {"model": "cheap", "max_output_tokens": 16, "input": _ask()}
    body: dict[str, Any] = {"model": "cheap", "messages": [{"role": "user", "content": _ask()}]}
    return body if path == "/v1/messages/count_tokens" else body | {"max_tokens": 4}


def _error(path: str, r: httpx.Response) -> dict[str, Any]:
    """The error object of a refusal, checked to be in the route's protocol shape."""
    got = r.json()
    if path in MESSAGES:
        assert got["type"] == "error" and set(got) == {"type", "error"}, got
    else:
        assert set(got) == {"error"}, got
    return dict(got["error"])


# -- Content-Encoding ---------------------------------------------------------------

# 16 MB of zeros in ~16 KB: inflated, twice the body limit.
BOMB = gzip.compress(b"\0" * 16_000_000, compresslevel=9)


def _coded(coding: str, raw: bytes) -> bytes:
    if coding == "gzip":
        return gzip.compress(raw)
    if coding == "deflate":
        return zlib.compress(raw)
    return os.urandom(64)  # br, or a coding nobody knows: never read


@pytest.mark.parametrize(
    ("path", "coding"),
    [
        ("/v1/chat/completions", "gzip"),
        ("/v1/chat/completions", "bomb"),
        ("/v1/completions", "deflate"),
        ("/v1/responses", "br"),
        ("/v1/messages", "gzip"),
        ("/v1/messages/count_tokens", "x-custom"),
    ],
)
def test_a_coded_body_is_a_415_naming_content_encoding_and_never_inflated(
    gw: Gateway, scripted: Scripted, path: str, coding: str
) -> None:
    raw = orjson.dumps(_body(path))
    content = BOMB if coding == "bomb" else _coded(coding, raw)
    header = "gzip" if coding == "bomb" else coding
    headers = {"content-type": "application/json", "content-encoding": header, **ANTHROPIC}
    before = scripted.requests()
    r = gw.post(path, content=content, headers=headers)
    assert r.status_code == 415, r.text[:300]
    err = _error(path, r)
    assert err["code"] == "unsupported_media_type", err
    assert "Content-Encoding" in err["message"] and "valid JSON" not in err["message"], err
    if path not in MESSAGES:
        assert err["param"] == "content-encoding" and err["type"] == "invalid_request_error"
    else:
        assert err["type"] == "invalid_request_error", err
    assert len(r.content) < 400  # nothing of the body comes back
    assert scripted.requests() == before  # nothing reached the upstream


def test_a_coded_body_is_a_415_in_the_ledger_and_identity_is_no_coding(
    gw: Gateway, scripted: Scripted
) -> None:
    r = gw.post(
        "/v1/chat/completions",
        content=BOMB,
        headers={"content-type": "application/json", "content-encoding": "gzip"},
    )
    assert r.status_code == 415, r.text[:300]
    trace = gw.trace(r.headers["x-request-id"])
    assert trace["status"] == "error" and trace["error_code"] == "unsupported_media_type", trace
    assert trace["upstream"] is None and trace["attempts"] == 0, trace
    before = scripted.requests()
    r = gw.post(
        "/v1/chat/completions",
        content=orjson.dumps(_body("/v1/chat/completions")),
        headers={"content-type": "application/json", "content-encoding": "Identity"},
    )
    assert r.status_code == 200, r.text[:300]
    assert r.json()["object"] == "chat.completion"
    assert scripted.requests() == before + 1


# -- x-switchyard-priority ------------------------------------------------------------


@pytest.mark.parametrize("value", ["a" * 10_000, "", "batch, interactive", "batch\tx"])
def test_a_bad_priority_is_refused_before_routing_and_selection(
    gw: Gateway, scripted: Scripted, value: str
) -> None:
    before = scripted.requests()
    r = gw.post(
        "/v1/chat/completions",
        json=_body("/v1/chat/completions"),
        headers={"x-switchyard-priority": value},
    )
    assert r.status_code == 400, r.text[:300]
    err = _error("/v1/chat/completions", r)
    assert err["code"] == "invalid_header" and err["param"] == "x-switchyard-priority", err
    assert len(r.content) < 400  # the value is never echoed
    assert "x-switchyard-model" not in r.headers  # no model was chosen for it
    assert scripted.requests() == before
    stages = [d["stage"] for d in gw.trace(r.headers["x-request-id"])["decisions"]]
    assert stages == ["authenticate"], stages  # refused before any stage ran


def test_a_priority_is_checked_before_the_stages_and_the_queue_still_reads_it(
    gw: Gateway, scripted: Scripted
) -> None:
    """`urgent` is refused with the headers, before any stage; `Batch` (the queue
    reads names without case) still passes and reaches the queue."""
    before = scripted.requests()
    body = _body("/v1/chat/completions")
    r = gw.post("/v1/chat/completions", json=body, headers={"x-switchyard-priority": "urgent"})
    assert r.status_code == 400, r.text[:300]
    assert _error("/v1/chat/completions", r)["param"] == "x-switchyard-priority"
    stages = [d["stage"] for d in gw.trace(r.headers["x-request-id"])["decisions"]]
    assert stages == ["authenticate"], stages
    assert scripted.requests() == before
    r = gw.post("/v1/chat/completions", json=body, headers={"x-switchyard-priority": "Batch"})
    assert r.status_code == 200, r.text[:300]
    assert scripted.requests() == before + 1
    queue = [d for d in gw.trace(r.headers["x-request-id"])["decisions"] if d["stage"] == "queue"]
    assert queue and not queue[0]["outcome"].startswith("reject"), queue


# -- nesting, read from the bytes -----------------------------------------------------

DEEP = 66  # two past the default max_json_depth (64), counting the body itself


def _server_ms(gw: Gateway, r: httpx.Response) -> float:
    return float(gw.trace(r.headers["x-request-id"])["timings"]["duration_ms"])


def test_a_wide_body_nested_too_deep_is_refused_without_being_parsed(
    gw: Gateway, scripted: Scripted
) -> None:
    """6 MB of arrays nested 66 deep (3 million arrays) is refused 400 as quickly,
    within the gateway, as one array nested 66 deep: its depth is read from the bytes,
    never by parsing it whole and then walking it."""
    chain = b"[" * (DEEP - 1) + b"]" * (DEEP - 1)
    one = b'{"model":"cheap","max_tokens":4,"messages":' + chain + b"}"
    wide = b'{"model":"cheap","max_tokens":4,"messages":[' + b",".join([chain] * 46_000) + b"]}"
    assert len(wide) > 6_000_000
    before = scripted.requests()
    times: dict[str, float] = {}
    for name, raw in (("one", one), ("wide", wide), ("one", one), ("wide", wide)):
        r = gw.post(
            "/v1/chat/completions", content=raw, headers={"content-type": "application/json"}
        )
        assert r.status_code == 400, r.text[:300]
        err = _error("/v1/chat/completions", r)
        assert err["code"] == "invalid_request" and "nested deeper than 64" in err["message"], err
        times[name] = min(times.get(name, 1e9), _server_ms(gw, r))
    assert scripted.requests() == before
    # Before: the wide one took over 1,000 ms more (orjson built 3 million lists).
    assert times["wide"] < times["one"] + 400, times


# -- headers on two lines ---------------------------------------------------------------


def _lines(gw: Gateway, path: str, *pairs: tuple[str, str]) -> httpx.Response:
    """POST a fresh body of `path` with the key and `pairs` as header lines, in order."""
    lines = [("authorization", f"Bearer {gw.key}"), *ANTHROPIC.items(), *pairs]
    return httpx.post(gw.url + path, json=_body(path), headers=lines, timeout=60)


def test_a_parent_on_a_second_line_is_heard(gw: Gateway, scripted: Scripted) -> None:
    """`x-parent-request-id` is a list: a second line adds parents (RFC 9110 5.3), it
    is never dropped (the task's critical path is built from them)."""
    parents = ("x-parent-request-id", "req-p1"), ("x-parent-request-id", "req-p2, req-p3")
    r = _lines(gw, "/v1/chat/completions", *parents)
    assert r.status_code == 200, r.text[:300]
    row = gw.trace(r.headers["x-request-id"])
    assert row["parent_request_ids"] == ["req-p1", "req-p2", "req-p3"], row


@pytest.mark.parametrize(
    ("path", "name", "first", "second"),
    [
        ("/v1/chat/completions", "x-task-id", "task-a-{tag}", "task-b-{tag}"),
        ("/v1/chat/completions", "idempotency-key", "idem-a-{tag}", "idem-b-{tag}"),
        ("/v1/chat/completions", "x-request-timeout", "1", "3600"),
        ("/v1/completions", "x-switchyard-priority", "batch", "interactive"),
        ("/v1/responses", "x-request-id", "client-a", "client-b"),
        ("/v1/messages", "anthropic-version", "2023-06-01", "2023-01-01"),
    ],
)
def test_a_single_valued_header_with_two_values_is_a_400_naming_it(
    gw: Gateway, scripted: Scripted, path: str, name: str, first: str, second: str
) -> None:
    """Which of two values counts would be a guess (a proxy or the upstream may keep
    the other one): refused, naming the header; the same value twice is served."""
    tag = os.urandom(3).hex()  # a fresh task and idempotency key per run
    first, second = first.format(tag=tag), second.format(tag=tag)
    before = scripted.requests()
    r = _lines(gw, path, (name, first), (name, second))
    assert r.status_code == 400, r.text[:300]
    err = _error(path, r)
    assert err["code"] == "invalid_header" and name in err["message"], err
    if path not in MESSAGES:
        assert err["param"] == name, err
    assert second not in r.text  # neither value is echoed
    assert scripted.requests() == before
    r = _lines(gw, path, (name, first), (name, first))
    assert r.status_code == 200, r.text[:300]
    assert scripted.requests() == before + 1


def test_an_encoding_on_a_second_line_is_heard(gw: Gateway, scripted: Scripted) -> None:
    """`content-encoding: identity` then `content-encoding: gzip`: the codings are one
    list, so the body is coded and refused 415, not read as if it were not."""
    raw = gzip.compress(orjson.dumps(_body("/v1/chat/completions")))
    lines = [
        ("authorization", f"Bearer {gw.key}"),
        ("content-type", "application/json"),
        ("content-encoding", "identity"),
        ("content-encoding", "gzip"),
    ]
    before = scripted.requests()
    r = httpx.post(gw.url + "/v1/chat/completions", content=raw, headers=lines, timeout=60)
    assert r.status_code == 415, r.text[:300]
    assert _error("/v1/chat/completions", r)["param"] == "content-encoding"
    assert scripted.requests() == before


@pytest.mark.parametrize(
    ("path", "location"),
    [
        ("/v1/models/", "/v1/models"),
        ("/v1/models/?limit=2", "/v1/models?limit=2"),
        ("/admin/keys/", "/admin/keys"),
        ("/console/", "/console"),
    ],
)
def test_a_trailing_slash_redirect_names_the_path_not_the_host(
    gw: Gateway, path: str, location: str
) -> None:
    """A path one slash away from a route is redirected as Starlette did (307), but to
    the path alone: Starlette built an absolute `Location` from the Host header, so a
    forged Host (`evil.example`) was where the client was sent (review s72 r6)."""
    headers = {"host": "evil.example", "authorization": f"Bearer {gw.key}"}
    r = httpx.get(gw.url + path, headers=headers, timeout=30)
    assert r.status_code == 307, r.text[:300]
    assert r.headers["location"] == location
    assert "evil" not in r.text


def test_no_redirect_to_another_host_or_for_a_path_that_is_no_route(gw: Gateway) -> None:
    headers = {"authorization": f"Bearer {gw.key}"}
    for path in ("//v1/models/", "//evil.example/", "/v1/nothing/"):
        r = httpx.get(gw.url + path, headers=headers, timeout=30)
        assert r.status_code == 404, (path, r.status_code, r.headers.get("location"))
        assert r.json()["error"]["code"] == "route_not_found" or "no route" in r.text
    followed = httpx.get(gw.url + "/v1/models/", headers=headers, timeout=30, follow_redirects=True)
    assert followed.status_code == 200 and followed.json()["object"] == "list"
