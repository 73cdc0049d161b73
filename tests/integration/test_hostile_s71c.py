"""Hostile review of what landed on 2026-12-07: tool call pairing across stored
responses, what /v1/models and the region and pin refusals tell a key, a client that
hangs up while the driver waits on a retry, a fallback or a slow upstream
(`aio.Waits`, in the executor), and what a refused or broken request is billed
(`settle.refused_outright`). Over sockets against one real gateway in front of three
scripted upstreams and a hostile upstream of tests/support/hostile_upstream.py.

Defects these tests find (each fails on today's code):
- two parallel calls of one tool with the same arguments get one id: a side effect's
  id is its idempotency key (policy/tool_calls_governor.py `idempotency_key`: tenant,
  task, step, tool, arguments; not the call's place in the reply), so a Responses
  client is handed two `function_call` items of one `call_id`; answering each is
  refused ("answered twice", api/checks.py `ToolPairs`) and answering one leaves a
  call the engine sees unanswered: the conversation cannot go on as the API says;
- `ToolPairs` is given only the calls the continued response left open
  (api/responses_codec.py `_paired`, `open_calls`), not every call id of the stored
  conversation: a continuation that makes a call of an id the conversation already
  used is taken and sent upstream, where the same conversation sent whole is a 400;
- /v1/models lists in `revisions` "what can be pinned" (api/openai.py `_revisions`)
  for a key whose `may_pin_revisions` is off: each pin of it is 403;
- a tenant held to its regions is told where a model it cannot reach runs: the 403
  `region_not_allowed` names the regions (decide/stages_select.py `region_refusal`),
  and the 404 of an unknown pin lists every revision of the alias, those outside the
  tenant's regions too (decide/balance.py `Balancer.pinned`), where /v1/models hides
  the model and those revisions from it;
- `GET /v1/models` hears the first of two `Authorization` lines (api/openai.py
  `OpenAIRoutes.models` reads Starlette's `request.headers`, not `header_map`), where
  fc0539f made every other authenticated route refuse a credential sent twice.

Gaps guarded (pass today; no other test covers them over sockets): a whole-reply
request whose client hangs up gives back its Idempotency-Key and its tenant's
concurrency slot, and is one `cancelled` row, as does a stream before its upstream's
headers; a hang-up during a retry's backoff makes
no further attempt; a hang-up during a fallback settles once, `cancelled`, with both
attempts counted; a parallel call group answered out of order is served; a call
answered in one continuation cannot be answered again in the next; a stream whose
first event is an error, and a fallback chain of a 503 then a 400, are billed the
estimate, not as refused outright; an engine's call without an id gets one of the
gateway's that a continuation can answer.
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from support.chat_replies import calls_reply
from support.gateways import CHEAP_PRICE, Gateway, start_gateway, version_alias
from support.hostile_upstream import Hostile, hostile_upstream, json_reply, sse_reply
from support.upstreams import Scripted

TOOLS = [{"type": "function", "name": "lookup", "parameters": {"type": "object"}}]
NO_STORE = {"Cache-Control": "no-store"}
CALL_ID = re.compile(r"[A-Za-z0-9_.:\-]{1,128}")  # what a function_call_output may name


def _calls(*ids: str | None) -> bytes:
    """A chat completion whose only answer is a parallel call of `lookup` per id (None:
    a call without an `id` member)."""
    calls = []
    for i, call_id in enumerate(ids):
        call: dict[str, Any] = {
            "index": i,
            "type": "function",
            "function": {"name": "lookup", "arguments": "{}"},
        }
        if call_id is not None:
            call["id"] = call_id
        calls.append(call)
    return json.dumps(calls_reply(calls)).encode()


def _event(obj: dict[str, Any] | bytes) -> bytes:
    return b"data: " + (obj if isinstance(obj, bytes) else json.dumps(obj).encode()) + b"\n\n"


REPLIES = {
    "noid": json_reply(_calls(None)),
    # Two parallel calls of one tool with the same arguments (two dice rolled), each
    # with its own id.
    "twins": json_reply(_calls("call_a", "call_b")),
    # A stream whose very first event is the engine's error: nothing relayed.
    "errfirst": sse_reply(
        _event({"error": {"message": "the engine ran out of memory", "type": "server_error"}}),
        _event(b"[DONE]"),
    ),
}


@pytest.fixture(scope="module")
def up() -> Iterator[Hostile]:
    with hostile_upstream(REPLIES) as hostile:
        yield hostile


def _openai(alias: str, url: str, **more: Any) -> dict[str, Any]:
    return {
        "alias": alias,
        "engine": {"kind": "openai", "base_url": url},
        "price": CHEAP_PRICE,
        "resilience": {"retries": 0},
        **more,
    }


@pytest.fixture(scope="module")
def gw(scripted: Scripted, two: tuple[Scripted, Scripted], up: Hostile) -> Iterator[Gateway]:
    a, b = two
    for s in (scripted, a, b):
        s.content(None)
        httpx.put(s.url + "/control/fault", json={"fault": None})
    chat = version_alias(a.url, b.url, us="us-secret-1")
    models = [
        _openai("cheap", scripted.url + "/v1"),
        _openai(
            "retrying", a.url + "/v1", resilience={"retries": 1}, timeouts={"first_byte_s": 10}
        ),
        _openai("primary", a.url + "/v1", fallbacks=["backup"]),
        _openai("backup", b.url + "/v1"),
        _openai("noid", up.base_url("noid")),
        _openai("twins", up.base_url("twins")),
        _openai("errfirst", up.base_url("errfirst")),
        chat,
        _openai("us-only", a.url + "/v1", region="us-secret-1"),
    ]
    g = start_gateway({"models": models, "embeddings": {"enabled": False}})
    yield g
    g.proc.stop()


def _tenant(gw: Gateway, prefix: str, **limits: Any) -> str:
    tenant = f"{prefix}-{os.urandom(4).hex()}"
    gw.create_tenant(tenant, **limits)
    return tenant


def _key(gw: Gateway, tenant: str, **fields: Any) -> str:
    return str(gw.create_key(tenant, **fields)["key"])


def _respond(gw: Gateway, **body: Any) -> httpx.Response:
    return gw.post("/v1/responses", json={"tools": TOOLS, **body}, headers=NO_STORE, timeout=30)


def _chat(gw: Gateway, key: str, model: str, **more: Any) -> httpx.Response:
    body = {"model": model, "messages": [{"role": "user", "content": "hello"}], **more}
    return gw.post("/v1/chat/completions", key=key, json=body, headers=NO_STORE, timeout=30)


def _call_ids(r: httpx.Response) -> list[Any]:
    assert r.status_code == 200, r.text[:400]
    return [i.get("call_id") for i in r.json()["output"] if i["type"] == "function_call"]


# -- tool calls across stored responses ---------------------------------------------------


@pytest.mark.parametrize("model", ["noid", "twins"])
def test_a_call_the_model_made_can_be_answered_in_the_continuation(gw: Gateway, model: str) -> None:
    """A Responses client answers each `function_call` of the output by its `call_id`,
    and (since 6e62d74) may not go on without answering it. An engine's call without
    an id gets one of the gateway's (noid: passes). Two parallel calls of one tool with
    the same arguments (twins) get one id: a side effect's id is its idempotency key
    (policy/tool_calls_governor.py `idempotency_key`: tenant, task, step, tool and
    arguments, not the call's place in the reply), so the client is handed two calls
    of one `call_id`, and answering each is refused (`ToolPairs`: "answered twice").
    Each call must reach the client with an id of its own that it can answer."""
    first = _respond(gw, model=model, input="look it up")
    ids = _call_ids(first)
    assert ids and all(isinstance(i, str) and CALL_ID.fullmatch(i) for i in ids), ids
    assert len(set(ids)) == len(ids), f"two calls share one call_id: {ids}"
    outputs = [{"type": "function_call_output", "call_id": i, "output": "42"} for i in ids]
    go_on = _respond(gw, model=model, previous_response_id=first.json()["id"], input=outputs)
    assert go_on.status_code == 200, go_on.text[:400]


def test_a_call_id_the_conversation_used_is_refused_in_a_continuation(
    gw: Gateway, scripted: Scripted
) -> None:
    """No call id is used twice in one conversation (api/checks.py `ToolPairs`): sent
    whole, a conversation whose later call reuses an earlier call's id is a 400 naming
    it. The same conversation sent as a continuation of the stored one is taken and
    sent upstream, two calls of one id in it: `ToolPairs` knows only the calls the
    stored response left open, not the ids it already used."""
    r = httpx.put(
        scripted.url + "/control/tool_calls",
        json={"calls": [{"name": "lookup", "arguments": "{}"}], "until_result": True},
    )
    assert r.status_code == 200, r.text
    try:
        first = _respond(gw, model="cheap", input="look it up")
        (call_id,) = _call_ids(first)
        answered = _respond(
            gw,
            model="cheap",
            previous_response_id=first.json()["id"],
            input=[{"type": "function_call_output", "call_id": call_id, "output": "42"}],
        )
        assert answered.status_code == 200, answered.text[:400]
        again = [
            {"type": "function_call", "call_id": call_id, "name": "lookup", "arguments": "{}"},
            {"type": "function_call_output", "call_id": call_id, "output": "43"},
        ]
        whole = [
            {"role": "user", "content": "look it up"},
            again[0],
            {"type": "function_call_output", "call_id": call_id, "output": "42"},
            {"role": "assistant", "content": "It is 42."},
            *again,
        ]
        sent_whole = _respond(gw, model="cheap", input=whole)
        assert sent_whole.status_code == 400, sent_whole.text[:400]
        before = scripted.requests()
        continued = _respond(
            gw, model="cheap", previous_response_id=answered.json()["id"], input=again
        )
        assert scripted.requests() == before, "a conversation with one call id twice went upstream"
        assert continued.status_code == 400, continued.text[:400]
        assert continued.json()["error"]["param"] == "input[0].call_id", continued.text[:400]
    finally:
        httpx.put(scripted.url + "/control/tool_calls", json={"calls": []})


def test_a_call_answered_in_one_continuation_is_not_answered_again_in_the_next(
    gw: Gateway, scripted: Scripted
) -> None:
    """Parallel calls answered out of order are served (OpenAI's API takes any order
    within the group); a call a continuation answered is closed: answering it again in
    the continuation of that continuation is a 400 naming the output, sent nowhere."""
    r = httpx.put(
        scripted.url + "/control/tool_calls",
        json={
            "calls": [
                {"name": "lookup", "arguments": '{"q": "a"}'},
                {"name": "lookup", "arguments": '{"q": "b"}'},
            ],
            "until_result": True,
        },
    )
    assert r.status_code == 200, r.text
    try:
        first = _respond(gw, model="cheap", input="look both up")
        ids = _call_ids(first)
        assert len(ids) == 2, ids
        outputs = [
            {"type": "function_call_output", "call_id": i, "output": str(k)}
            for k, i in enumerate(reversed(ids))
        ]
        answered = _respond(
            gw, model="cheap", previous_response_id=first.json()["id"], input=outputs
        )
        assert answered.status_code == 200, answered.text[:400]
        before = scripted.requests()
        twice = _respond(
            gw, model="cheap", previous_response_id=answered.json()["id"], input=outputs[:1]
        )
        assert twice.status_code == 400, twice.text[:400]
        assert twice.json()["error"]["param"] == "input[0].call_id", twice.text[:400]
        assert scripted.requests() == before
    finally:
        httpx.put(scripted.url + "/control/tool_calls", json={"calls": []})


# -- what /v1/models and the pin and region refusals tell a key ----------------------------


def _listed(gw: Gateway, key: str) -> dict[str, dict[str, Any]]:
    r = httpx.get(gw.url + "/v1/models", headers={"Authorization": f"Bearer {key}"})
    assert r.status_code == 200, r.text[:300]
    return {m["id"]: m for m in r.json()["data"]}


def test_models_lists_as_pinnable_only_revisions_the_key_may_pin(gw: Gateway) -> None:
    """ad88d14: /v1/models gives each model "a `revisions` list of what can be pinned"
    (api/openai.py `_revisions`). A key whose `may_pin_revisions` is off can pin
    nothing (403 `revision_pin_not_allowed`), yet is listed every revision."""
    tenant = _tenant(gw, "s71c-nopin")
    key = _key(gw, tenant)  # may_pin_revisions: off, the default
    chat = _listed(gw, key)["chat"]
    refused = {}
    for revision in chat.get("revisions", []):
        r = _chat(gw, key, f"chat@{revision}")
        if r.status_code != 200:
            refused[revision] = (r.status_code, r.json()["error"]["code"])
    assert not refused, f"listed as pinnable, refused when pinned: {refused}"


def test_a_region_refusal_does_not_say_where_the_model_runs(
    gw: Gateway, two: tuple[Scripted, Scripted]
) -> None:
    """/v1/models hides from an `eu` tenant a model that runs only outside its regions
    (and the revisions it may not reach): where they run is not the tenant's to know.
    The 403 `region_not_allowed` of a request for it names the region it runs in
    (decide/stages_select.py `region_refusal`: "it runs in us-secret-1, ...")."""
    tenant = _tenant(gw, "s71c-eu", labels={"regions": ["eu"]})
    key = _key(gw, tenant, may_pin_revisions=True)
    listed = _listed(gw, key)
    assert "us-only" not in listed and listed["chat"]["revisions"] == ["r2"], listed
    before = two[0].requests()
    for model in ("us-only", "chat@r1"):
        r = _chat(gw, key, model)
        assert r.status_code == 403, r.text[:300]
        assert r.json()["error"]["code"] == "region_not_allowed", r.text[:300]
        assert "us-secret-1" not in r.text, r.text[:300]
    assert two[0].requests() == before


def test_an_unknown_pin_lists_only_the_revisions_the_tenant_may_reach(gw: Gateway) -> None:
    """The 404 of a pin of no revision lists what the alias has (decide/balance.py
    `Balancer.pinned`: every deployment's revision). To an `eu` tenant /v1/models lists
    `chat`'s revisions as r2 alone; the 404 tells it r1, the revision that runs only
    outside its regions, exists too."""
    tenant = _tenant(gw, "s71c-eu404", labels={"regions": ["eu"]})
    key = _key(gw, tenant, may_pin_revisions=True)
    r = _chat(gw, key, "chat@r9")
    assert r.status_code == 404, r.text[:300]
    assert "r2" in r.json()["error"]["message"], r.text[:300]
    assert "r1" not in r.json()["error"]["message"], r.text[:300]


def test_models_refuses_a_credential_sent_on_two_lines(gw: Gateway) -> None:
    """fc0539f: a credential header sent twice is refused (401: neither line is heard)
    by the model endpoints, /mcp and the admin API. `GET /v1/models` authenticates
    with Starlette's `request.headers` (api/openai.py `OpenAIRoutes.models`), not
    `header_map`, so `repeated_credential` never sees the second line: a valid key on
    the first line and anything on the second lists the key's models."""
    headers = [("Authorization", f"Bearer {gw.key}"), ("Authorization", "Bearer sk-sy-other")]
    chat = httpx.post(
        gw.url + "/v1/chat/completions",
        json={"model": "cheap", "messages": [{"role": "user", "content": "hi"}]},
        headers=headers,
    )
    assert chat.status_code == 401, chat.text[:300]
    listed = httpx.get(gw.url + "/v1/models", headers=headers)
    assert listed.status_code == 401, listed.text[:300]


# -- a client that hangs up (aio.Waits) ----------------------------------------------------


def _hang_up(gw: Gateway, key: str, model: str, after_s: float, **headers: str) -> None:
    body = {"model": model, "messages": [{"role": "user", "content": "hello"}]}
    with pytest.raises(httpx.TimeoutException):
        gw.post(
            "/v1/chat/completions",
            key=key,
            json=body,
            headers={**NO_STORE, **headers},
            timeout=after_s,
        )


def _one_row(gw: Gateway, tenant: str) -> dict[str, Any]:
    rows = gw.stored_rows(tenant, 1)
    time.sleep(0.3)  # a second row, if the request were settled twice
    rows = gw.stored_rows(tenant, 1)
    assert len(rows) == 1, rows
    return rows[0]


def test_a_hang_up_gives_back_the_idempotency_key_and_the_concurrency_slot(
    gw: Gateway, scripted: Scripted
) -> None:
    """A client that hangs up on a whole reply (its upstream slow) is settled once,
    `cancelled`; the key it claimed is given back (the same request again runs, it is
    no replay and no 409), and so is its tenant's one concurrency slot."""
    tenant = _tenant(gw, "s71c-idem", max_concurrency=1)
    key = _key(gw, tenant)
    scripted.fault("delay:3000", 1)
    before = scripted.requests()
    _hang_up(gw, key, "cheap", 0.8, **{"Idempotency-Key": "s71c-once"})
    row = _one_row(gw, tenant)
    assert row["status"] == "cancelled", row
    body = {"model": "cheap", "messages": [{"role": "user", "content": "hello"}]}
    again = gw.post(
        "/v1/chat/completions",
        key=key,
        json=body,
        headers={**NO_STORE, "Idempotency-Key": "s71c-once"},
    )
    assert again.status_code == 200, again.text[:300]
    assert "x-switchyard-idempotent-replay" not in again.headers
    assert scripted.requests() == before + 2
    replay = gw.post(
        "/v1/chat/completions",
        key=key,
        json=body,
        headers={**NO_STORE, "Idempotency-Key": "s71c-once"},
    )
    assert replay.headers.get("x-switchyard-idempotent-replay") == "true", dict(replay.headers)


def test_a_stream_hung_up_before_its_first_byte_gives_back_the_slot(
    gw: Gateway, scripted: Scripted
) -> None:
    """A stream is watched until the upstream's headers arrive: a client that hangs up
    while the upstream is slow to answer is one `cancelled` row, and its tenant's one
    concurrency slot is free for the next request."""
    tenant = _tenant(gw, "s71c-stream", max_concurrency=1)
    key = _key(gw, tenant)
    scripted.fault("delay:3000", 1)
    body = {"model": "cheap", "messages": [{"role": "user", "content": "hello"}], "stream": True}
    with (
        pytest.raises(httpx.TimeoutException),
        httpx.stream(
            "POST",
            gw.url + "/v1/chat/completions",
            json=body,
            headers={"Authorization": f"Bearer {key}", **NO_STORE},
            timeout=0.8,
        ) as r,
    ):
        r.read()
    row = _one_row(gw, tenant)
    assert row["status"] == "cancelled", row
    assert _chat(gw, key, "cheap").status_code == 200


def test_a_hang_up_during_a_retry_backoff_makes_no_further_attempt(
    gw: Gateway, two: tuple[Scripted, Scripted]
) -> None:
    """The upstream answers 503 with `Retry-After: 2`; the client hangs up during the
    backoff: the retry is never made, and the request is one `cancelled` row."""
    a = two[0]
    tenant = _tenant(gw, "s71c-retry")
    key = _key(gw, tenant)
    a.fault("busy:2", 1)
    before = a.requests()
    _hang_up(gw, key, "retrying", 0.8)
    time.sleep(2.5)
    assert a.requests() == before + 1, "a retry went upstream for a client that had left"
    row = _one_row(gw, tenant)
    assert row["status"] == "cancelled", row


def test_a_hang_up_during_a_fallback_settles_once(
    gw: Gateway, two: tuple[Scripted, Scripted]
) -> None:
    """The primary answers 503, the fallback is slow; the client hangs up while the
    fallback works: one row, `cancelled`, both attempts counted."""
    a, b = two
    tenant = _tenant(gw, "s71c-fallback")
    key = _key(gw, tenant)
    a.fault("status:503", 1)
    b.fault("delay:3000", 1)
    before = b.requests()
    _hang_up(gw, key, "primary", 1.0)
    row = _one_row(gw, tenant)
    assert (row["status"], row["attempts"]) == ("cancelled", 2), row
    assert b.requests() == before + 1


# -- what a request that failed upstream is billed (settle.refused_outright) -------------


def test_a_stream_whose_first_event_is_an_error_is_billed_the_estimate(gw: Gateway) -> None:
    """The upstream took the request (200) and broke off before anything was relayed:
    it may have generated, so it is not "refused outright" and is billed the estimate
    of its prompt."""
    tenant = _tenant(gw, "s71c-errfirst")
    key = _key(gw, tenant)
    body = {"model": "errfirst", "messages": [{"role": "user", "content": "hello " * 40}]}
    body["stream"] = True
    with httpx.stream(
        "POST",
        gw.url + "/v1/chat/completions",
        json=body,
        headers={"Authorization": f"Bearer {key}", **NO_STORE},
        timeout=30,
    ) as r:
        text = r.read().decode()
    assert '"error"' in text, text[:300]
    row = _one_row(gw, tenant)
    assert row["status"] != "ok" and row["input_tokens"] > 0, row


def test_a_fallback_chain_of_a_503_then_a_400_is_billed_the_estimate(
    gw: Gateway, two: tuple[Scripted, Scripted]
) -> None:
    """Only a request every upstream refused with a 4xx is billed nothing: a 503 from
    the primary (it may have worked) then a 400 from the fallback keeps the estimate."""
    a, b = two
    tenant = _tenant(gw, "s71c-mixed")
    key = _key(gw, tenant)
    a.fault("status:503", 1)
    b.fault("status:400", 1)
    r = _chat(gw, key, "primary")
    assert r.status_code == 400, r.text[:300]
    row = _one_row(gw, tenant)
    assert (row["status"], row["attempts"]) == ("error", 2), row
    assert row["input_tokens"] > 0, row
