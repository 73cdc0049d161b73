"""Stored responses under the key's limits, and a stored stream whose client leaves. Over
sockets against a real gateway in front of the scripted upstream.

Defects these tests found (each fails on the code before the fix):
- `GET` and `DELETE /v1/responses/{id}`, `POST .../cancel` and `GET .../input_items`
  were held to no limit: a key allowed 2 requests a minute read stored responses at
  will, and nothing recorded who read what (no trace, no usage row);
- a continuation (`previous_response_id`) read its stored conversation before its
  limits were asked: a key past its rpm still had the store read (a missing id
  answered 404, before the 429 it was due);
- a stored stream (`store: true, stream: true`) whose client left mid-stream was never
  stored: its `GET` answered 404.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import httpx
import orjson

from support.gateways import Gateway
from support.upstreams import Scripted

MISSING = "resp_" + "0" * 12 + "ab" * 10  # well formed, never made


def _auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def _create(gw: Gateway, key: str, **body: Any) -> httpx.Response:
    return gw.post("/v1/responses", key, json={"model": "cheap", "input": "hi", **body})


def _rate_refused(r: httpx.Response) -> None:
    """A rate refusal as every OpenAI route answers it: 429, OpenAI's error body,
    Retry-After and the rate headers."""
    assert r.status_code == 429, (r.status_code, r.text)
    error = r.json()["error"]
    assert error["code"] == "rate_limit_rpm" and error["type"], error
    assert int(r.headers["retry-after"]) >= 1
    assert r.headers["x-ratelimit-remaining-requests"] == "0"
    assert r.headers["x-request-id"]


def test_stored_response_reads_count_against_the_keys_rpm(gw: Gateway) -> None:
    """A key allowed 3 requests a minute: a create, a GET and an input_items list spend
    them; then GET, input_items, cancel and DELETE are each a 429 in OpenAI's shape, an
    unknown id too (the store is not asked). Each call has its usage row (its endpoint,
    no tokens, cost 0) and a trace with its admission."""
    tenant, key = gw.new_tenant("rd")
    limited = str(gw.create_key(tenant, rpm=3)["key"])
    r = _create(gw, limited)
    assert r.status_code == 200, r.text
    rid = r.json()["id"]
    got = httpx.get(f"{gw.url}/v1/responses/{rid}", headers=_auth(limited))
    assert got.status_code == 200, got.text
    assert got.json()["id"] == rid
    assert got.headers["x-ratelimit-remaining-requests"] == "1"
    items = httpx.get(f"{gw.url}/v1/responses/{rid}/input_items", headers=_auth(limited))
    assert items.status_code == 200, items.text
    # The key's 3 requests this minute are spent: every stored-response route refuses.
    for method, path in (
        ("GET", f"/v1/responses/{rid}"),
        ("GET", f"/v1/responses/{rid}/input_items"),
        ("POST", f"/v1/responses/{rid}/cancel"),
        ("DELETE", f"/v1/responses/{rid}"),
        ("GET", f"/v1/responses/{MISSING}"),  # refused before the store is asked
    ):
        _rate_refused(httpx.request(method, gw.url + path, headers=_auth(limited)))
    # The response is still there for a key with room (the DELETE was refused).
    assert httpx.get(f"{gw.url}/v1/responses/{rid}", headers=_auth(key)).status_code == 200
    # Each read is recorded: a usage row with its endpoint, no tokens, cost 0.
    rows = gw.tenant_rows(tenant, 9)
    by_endpoint: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        by_endpoint.setdefault(row["endpoint"], []).append(row)
    retrieved = by_endpoint["responses.retrieve"]
    assert sorted(row["status"] for row in retrieved) == ["error", "error", "ok", "ok"]
    assert {row["error_code"] for row in retrieved if row["status"] == "error"} == {
        "rate_limit_rpm"
    }
    assert [row["status"] for row in by_endpoint["responses.input_items"]] in (
        ["ok", "error"],
        ["error", "ok"],
    )
    assert [row["error_code"] for row in by_endpoint["responses.cancel"]] == ["rate_limit_rpm"]
    assert [row["error_code"] for row in by_endpoint["responses.delete"]] == ["rate_limit_rpm"]
    assert all(
        row["cost_usd"] == 0 and row["input_tokens"] == 0 and row["output_tokens"] == 0
        for row in rows
        if row["endpoint"].startswith("responses.")
    )
    # and traced: the admission that let the read through
    trace = gw.trace(got.headers["x-request-id"])
    admit = [d for d in trace["decisions"] if d["stage"] == "admit"]
    assert [d["outcome"] for d in admit] == ["admitted"], trace["decisions"]


def test_a_continuation_is_held_to_its_rpm_before_the_store_is_read(gw: Gateway) -> None:
    """Past its rpm, a continuation is refused before its stored conversation is read
    (`admit_call` in its trace, no `window` or `admit`); within it, the call is counted
    once and `admit` still reserves the conversation's tokens."""
    tenant, _ = gw.new_tenant("ct")
    key = str(gw.create_key(tenant, rpm=3, tpm=1_000_000)["key"])
    first = _create(gw, key, input="my name is Ada")
    assert first.status_code == 200, first.text
    rid = first.json()["id"]
    # A continuation within the rpm is counted once, not once for its read and again
    # for its generation: 1 of 3 left after two requests.
    second = _create(gw, key, input="and my name?", previous_response_id=rid)
    assert second.status_code == 200, second.text
    assert second.headers["x-ratelimit-remaining-requests"] == "1"
    assert _create(gw, key).status_code == 200  # the third
    # Past the rpm, a continuation is refused before its stored conversation is looked
    # up: an id with nothing stored is a 429, not the store's 404.
    missing = _create(gw, key, input="go on", previous_response_id=MISSING)
    _rate_refused(missing)
    trace = gw.trace(missing.headers["x-request-id"])
    stages = [(d["stage"], d["outcome"]) for d in trace["decisions"]]
    assert ("admit_call", "reject:rpm") in stages, stages
    assert not {"window", "admit"} & {s for s, _ in stages}, stages  # nothing was read
    # Once the limiter found the window full, the next is refused before its body is
    # even read (policy/admit.py FullWindows): no stored conversation read either.
    refused = _create(gw, key, input="go on", previous_response_id=rid)
    _rate_refused(refused)
    trace = gw.trace(refused.headers["x-request-id"])
    stages = [(d["stage"], d["outcome"]) for d in trace["decisions"]]
    assert stages == [("authenticate", "ok"), ("admit", "reject:rpm")], stages
    # The admitted continuation: its call counted before the read, then the whole
    # conversation reserved by `admit` (rpm not counted a second time).
    trace = gw.trace(second.headers["x-request-id"])
    decisions = {d["stage"]: d for d in trace["decisions"]}
    call, admit = decisions["admit_call"], decisions["admit"]
    assert call["evidence"]["reserved_tokens"] == 0
    assert admit["evidence"]["reserved_tokens"] > 0
    assert all("limit_requests" not in s for s in admit["evidence"]["scopes"].values())


def _events(lines: Iterator[str]) -> Iterator[dict[str, Any]]:
    for line in lines:
        if line.startswith("data: "):
            yield orjson.loads(line[6:])


def test_a_stored_stream_whose_client_leaves_is_kept_incomplete(
    gw: Gateway, scripted: Scripted
) -> None:
    """A client reads 3 deltas of a slow stored stream and leaves: GET answers the
    response `incomplete` (client_disconnected) with the text it was sent, short of the
    whole answer, and a continuation goes on from that text."""
    _, key = gw.new_tenant("dc")
    scripted.fault("slow:300", 1)  # 16 events, 300 ms apart: ~5 s
    body = {"model": "cheap", "input": "tell me more", "stream": True, "store": True}
    received: list[str] = []
    rid = None
    with httpx.stream(
        "POST", gw.url + "/v1/responses", json=body, headers=_auth(key), timeout=30
    ) as r:
        assert r.status_code == 200
        for event in _events(r.iter_lines()):
            if event["type"] == "response.created":
                rid = event["response"]["id"]
            elif event["type"] == "response.output_text.delta":
                received.append(event["delta"])
                if len(received) == 3:
                    break  # the client leaves mid-stream
    assert rid is not None and len(received) == 3
    deadline = time.monotonic() + 10
    while True:
        got = httpx.get(f"{gw.url}/v1/responses/{rid}", headers=_auth(key))
        if got.status_code != 404 or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert got.status_code == 200, got.text
    obj = got.json()
    assert obj["status"] == "incomplete", obj
    assert obj["incomplete_details"] == {"reason": "client_disconnected"}
    [item] = obj["output"]
    assert item["type"] == "message" and item["status"] == "incomplete"
    text = item["content"][0]["text"]
    # what the client was sent (and perhaps a little more it had not read yet) ...
    assert text.startswith("".join(received)), (text, received)
    # ... and not the whole answer: the upstream call stopped when the client left
    whole = _create(gw, key, input="the whole answer").json()["output"][0]["content"][0]["text"]
    assert len(text) < len(whole), (text, whole)
    # An incomplete response is continued from what it had.
    go_on = _create(gw, key, input="go on", previous_response_id=rid)
    assert go_on.status_code == 200, go_on.text
    sent = httpx.get(scripted.url + "/control/last").json()["body"]["messages"]
    assert [m["content"] for m in sent if m["role"] == "assistant"] == [text], sent
