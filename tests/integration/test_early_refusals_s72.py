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
