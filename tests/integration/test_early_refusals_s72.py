"""A request for a model the gateway serves none of is refused first, before any
costly work (review s72 r3).

Before, the authorize stage passed an unknown model on ("selection will refuse it"):
the request was admitted (an rpm slot and a reservation taken), its body scanned for
PII, embedded and looked up in the cache, and only `select` answered 404. A tenant
could spend its rpm, and the gateway megabytes of PII scanning, on requests that could
never be served. Now `authorize` refuses it, and a routed alias (the router's own)
still passes to the router.
"""

from __future__ import annotations

import json
import os

import httpx

from support.gateways import Gateway

BODY = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}


def test_an_unknown_model_is_refused_before_admission_and_costs_no_rpm(gw: Gateway) -> None:
    _, key = gw.new_tenant("s72-unknown", rpm=1)
    name = "nope-" + os.urandom(4).hex()
    for path, body in (
        ("/v1/chat/completions", {**BODY, "model": name}),
        ("/v1/messages", {**BODY, "model": name}),
        ("/v1/responses", {"model": name, "input": "hello", "max_output_tokens": 16}),
    ):
        r = gw.post(path, key=key, json=body)
        assert r.status_code == 404, (path, r.text)
        assert name in r.text  # the client is told the name it sent
        trace = gw.trace(r.headers["x-request-id"])
        stages = [d["stage"] for d in trace["decisions"]]
        assert stages[-1] == "authorize", (path, stages)
        assert not {"admit", "pii", "cache", "select"} & set(stages), (path, stages)
        last = trace["decisions"][-1]
        assert last["outcome"] == "reject:unknown_model", last
        assert name not in str(trace), "the client's free text is not recorded"
    # The tenant's one request a minute was not spent on them.
    r = gw.post("/v1/chat/completions", key=key, json={**BODY, "model": "cheap"})
    assert r.status_code == 200, r.text
    r = gw.post("/v1/chat/completions", key=key, json={**BODY, "model": "cheap"})
    assert r.status_code == 429, r.text


def test_count_tokens_refuses_an_unknown_model_with_the_same_404(gw: Gateway) -> None:
    name = "nope-" + os.urandom(4).hex()
    r = httpx.post(
        gw.url + "/v1/messages/count_tokens",
        json={"model": name, "messages": BODY["messages"]},
        headers={"x-api-key": gw.key, "anthropic-version": "2023-06-01"},
    )
    assert r.status_code == 404, r.text
    assert r.json()["type"] == "error" and r.json()["error"]["type"] == "not_found_error"
    assert name in r.json()["error"]["message"]


def _big_body(model: str) -> bytes:
    """A valid chat body of about 3 MB: reading, parsing, validating and counting it is
    the work a refusal before the body spares."""
    text = "word " * 120_000
    messages = [{"role": "user", "content": text} for _ in range(5)]
    return json.dumps({"model": model, "messages": messages, "max_tokens": 4}).encode()


def test_past_its_rpm_a_tenant_is_refused_before_its_body_is_read(gw: Gateway) -> None:
    """Before, a tenant past its requests per minute still had every body read, parsed,
    validated and counted before admission refused it (a 2 MB body took ~0.4 s, and
    was answered 400 context_length rather than 429). Once admission has found the
    window full, the next request of the tenant is refused with the same 429 from the
    headers alone, until the window frees (nothing gives a request back to it)."""
    tenant, key = gw.new_tenant("s72-rpm", rpm=1)
    r = gw.post("/v1/chat/completions", key=key, json={**BODY, "model": "cheap"})
    assert r.status_code == 200, r.text
    r = gw.post("/v1/chat/completions", key=key, json={**BODY, "model": "cheap"})
    assert r.status_code == 429, r.text  # admission's own refusal: the window is full
    stages = [d["stage"] for d in gw.trace(r.headers["x-request-id"])["decisions"]]
    assert "validate" in stages and stages[-1] == "admit", stages
    for path in ("/v1/chat/completions", "/v1/responses", "/v1/messages"):
        r = httpx.post(
            gw.url + path,
            content=_big_body("cheap"),
            headers={"Authorization": f"Bearer {key}", "content-type": "application/json"},
            timeout=30,
        )
        assert r.status_code == 429, (path, r.text[:300])
        assert 1 <= int(r.headers["retry-after"]) <= 60, r.headers
        trace = gw.trace(r.headers["x-request-id"])
        stages = [d["stage"] for d in trace["decisions"]]
        assert stages == ["authenticate", "admit"], (path, stages)
        assert trace["decisions"][-1]["outcome"] == "reject:rpm"
        assert "before the body is read" in trace["decisions"][-1]["reason"]
    # A limit raised since is the limiter's to judge again: served at once.
    r = httpx.patch(f"{gw.url}/admin/tenants/{tenant}", json={"rpm": 100}, headers=gw.admin)
    assert r.status_code == 200, r.text
    r = gw.post("/v1/chat/completions", key=key, json={**BODY, "model": "cheap"})
    assert r.status_code == 200, r.text
