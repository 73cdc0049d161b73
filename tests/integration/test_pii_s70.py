"""PII in every member a request sends upstream, and credentials in the ids a client
chooses. Over sockets against one gateway before the scripted upstream: its model
`cheap` under `pii.mode: mask_upstream`, `blocked` (the same upstream) under `block`,
`validation.unknown_fields: pass`; a second gateway process on the same SQLite file
for the idempotency keys; and, in process, `mask_request` on the requests it walks.

What these tests hold (test_hostile_s70b.py found the defects):
- `mask_upstream` masks every string the upstream receives, an object's keys too,
  and a reply's placeholders come back raw whichever member carried the value
  (a stop sequence, a schema); `block` refuses PII in a member kept in `extra`;
- a request without PII is the very request that came (the cache keys of such
  requests do not move), and a media payload is sent as it came;
- an id header or `Idempotency-Key` with a credential's shape is refused 400 naming
  the header, never quoting it, and settled; a plain id (a UUID in hex) still passes
  and is kept; an `Idempotency-Key` is stored only as a keyed hash, and a repeat is
  replayed by another process sharing the store.
"""

from __future__ import annotations

import contextlib
import json
import os
import sqlite3
from collections.abc import Iterator
from typing import Any

import httpx
import msgspec
import pytest

from support.gateways import CHEAP_PRICE, Gateway, cheap_config, start_gateway
from support.upstreams import Scripted
from switchyard.policy.pii import MaskingError, PiiMasker, mask_request
from switchyard.request import Generation

EMAIL = "bob.two@example.org"


@pytest.fixture(scope="module")
def config(scripted: Scripted) -> dict[str, Any]:
    blocked = {
        "alias": "blocked",
        "engine": {"kind": "openai", "base_url": scripted.url + "/v1"},
        "price": CHEAP_PRICE,
    }
    return cheap_config(
        scripted, blocked, pii={"mode": "mask_upstream", "models": {"blocked": "block"}}
    )


@pytest.fixture(scope="module")
def gw(config: dict[str, Any]) -> Iterator[Gateway]:
    g = start_gateway(config)
    yield g
    g.proc.stop()


def _last(scripted: Scripted) -> dict[str, Any]:
    return dict(httpx.get(scripted.url + "/control/last").json()["body"])


def _chat(gw: Gateway, model: str = "cheap", headers: Any = None, **fields: Any) -> httpx.Response:
    marker = f"s70-{os.urandom(4).hex()}"
    body = {"model": model, "max_tokens": 4, "messages": [{"role": "user", "content": marker}]}
    return gw.post(
        "/v1/chat/completions",
        json={**body, **fields},
        headers={"Cache-Control": "no-store", **(headers or {})},
    )


def _refused(r: httpx.Response, status: int, code: str) -> dict[str, Any]:
    assert r.status_code == status, r.text[:300]
    err = r.json()["error"]
    assert err["code"] == code, err
    return dict(err)


# -- mask_upstream: every member, and the restore --------------------------------------


@pytest.mark.parametrize(
    "fields, sent",
    [
        ({"stop": [f"Regards, {EMAIL}"]}, lambda b: b["stop"] == ["Regards, <EMAIL_1>"]),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "c", "schema": {"description": f"to {EMAIL}"}},
                }
            },
            lambda b: (
                b["response_format"]["json_schema"]["schema"]["description"] == "to <EMAIL_1>"
            ),
        ),
    ],
    ids=["stop", "schema"],
)
def test_a_value_masked_in_a_member_no_stage_reads_comes_back_raw_in_the_reply(
    gw: Gateway, content: Scripted, fields: dict[str, Any], sent: Any
) -> None:
    """The upstream is sent the placeholder (the same one the request's other texts
    would get), and a reply that carries it is restored for the client."""
    content.content("Write to <EMAIL_1> today.")
    r = _chat(gw, **fields)
    assert r.status_code == 200, r.text[:300]
    body = _last(content)
    assert EMAIL not in json.dumps(body) and sent(body), body
    assert r.json()["choices"][0]["message"]["content"] == f"Write to {EMAIL} today."


def test_an_object_key_holding_pii_is_masked_too(gw: Gateway, scripted: Scripted) -> None:
    """Keys are strings sent upstream as well: a `metadata` key and an extra member's
    nested key go out as placeholders."""
    r = _chat(gw, metadata={EMAIL: "v"}, engine_options={"notes": {EMAIL: 1}})
    assert r.status_code == 200, r.text[:300]
    body = _last(scripted)
    assert EMAIL not in json.dumps(body), body
    assert body["metadata"] == {"<EMAIL_1>": "v"}
    assert body["engine_options"] == {"notes": {"<EMAIL_1>": 1}}


def test_a_request_without_pii_goes_upstream_as_sent(gw: Gateway, scripted: Scripted) -> None:
    """Nothing found, nothing changed: the members the walk reads reach the upstream
    exactly as the client sent them (the request itself is not replaced)."""
    fields = {
        "stop": ["END", "<EMAIL_1>"],
        "tools": [
            {
                "type": "function",
                "function": {
                    "name": "lookup",
                    "description": "Find an order",
                    "parameters": {"type": "object", "properties": {"id": {"type": "string"}}},
                },
            }
        ],
        "response_format": {"type": "json_object"},
        "metadata": {"team": "s70"},
        "web_search_options": {"search_context_size": "low"},
    }
    r = _chat(gw, **fields)
    assert r.status_code == 200, r.text[:300]
    body = _last(scripted)
    assert {k: body.get(k) for k in fields} == fields


# -- block: a member kept in `extra` ----------------------------------------------------


@pytest.mark.parametrize(
    "path, fields",
    [
        ("/v1/completions", {"prompt": "hi", "messages": [{"role": "user", "content": EMAIL}]}),
        ("/v1/chat/completions", {"metadata": {"contact": EMAIL}}),
        ("/v1/chat/completions", {"x_notes": [{"to": f"mail {EMAIL}"}]}),
    ],
    ids=["completion-messages", "metadata", "unknown-member"],
)
def test_block_refuses_pii_in_a_member_kept_in_extra(
    gw: Gateway, scripted: Scripted, path: str, fields: dict[str, Any]
) -> None:
    before = scripted.requests()
    body: dict[str, Any] = {"model": "blocked", "max_tokens": 4, **fields}
    if path == "/v1/chat/completions":
        body["messages"] = [{"role": "user", "content": "hi"}]
    err = _refused(gw.post(path, json=body), 400, "pii_detected")
    assert EMAIL not in err["message"]
    assert scripted.requests() == before  # never sent


# -- credentials as ids -------------------------------------------------------------------


@pytest.mark.parametrize(
    "header, secret",
    [
        ("x-request-id", "sk-proj-" + os.urandom(16).hex()),
        ("x-client-request-id", "ghp_" + "A1b2C3d4E5" * 4),
        ("x-task-id", "AKIA" + "ABCDEFGHIJ234567"),
        ("x-parent-request-id", "req-1,sk-sy-" + os.urandom(12).hex()),
        ("Idempotency-Key", "sk-proj-" + os.urandom(16).hex()),
    ],
    ids=["request-id", "client-request-id", "task-id", "parent-ids", "idempotency-key"],
)
def test_a_credential_shaped_id_is_refused_and_settled(
    gw: Gateway, header: str, secret: str
) -> None:
    tenant, key = gw.new_tenant("s70-cred")
    headers = {header: secret}
    if header == "x-parent-request-id":
        headers["x-task-id"] = "s70-task"
    r = gw.post(
        "/v1/completions",
        key=key,
        json={"model": "cheap", "prompt": "hi", "max_tokens": 2},
        headers=headers,
    )
    err = _refused(r, 400, "invalid_header")
    assert err["param"] == header
    assert secret.split(",")[-1] not in r.text
    rows = gw.stored_rows(tenant)
    assert rows and rows[0]["status"] != "ok", rows
    assert rows[0]["client_request_id"] is None and rows[0]["task_id"] in (None, "s70-task")


def test_plain_ids_still_pass_and_are_kept(gw: Gateway) -> None:
    """A random id is an id, not a key: a UUID in hex (which the text detector's entropy
    rule would call a token) and a task id with colons are accepted and recorded."""
    tenant, key = gw.new_tenant("s70-ids")
    rid, task = os.urandom(16).hex(), "agent:run-7.step_2"
    r = gw.post(
        "/v1/completions",
        key=key,
        json={"model": "cheap", "prompt": "hi", "max_tokens": 2},
        headers={"x-request-id": rid, "x-task-id": task},
    )
    assert r.status_code == 200, r.text[:300]
    row = gw.stored_rows(tenant)[0]
    assert (row["client_request_id"], row["task_id"]) == (rid, task)


def _idempotency_keys(db: str) -> list[str]:
    with contextlib.closing(sqlite3.connect(f"file:{db}?mode=ro", uri=True)) as conn:
        return [row[0] for row in conn.execute("SELECT key FROM idempotency")]


def test_an_idempotency_key_is_stored_hashed_and_replayed_by_another_process(
    gw: Gateway, config: dict[str, Any], scripted: Scripted
) -> None:
    """The table holds an HMAC of the scoped key, never the key; a repeat finds its
    reply in this process and in a second gateway process on the same database."""
    _, key = gw.new_tenant("s70-idem")
    idem = "order-" + os.urandom(6).hex()
    body = {"model": "cheap", "prompt": "hi", "max_tokens": 2}
    first = gw.post("/v1/completions", key=key, json=body, headers={"Idempotency-Key": idem})
    assert first.status_code == 200, first.text[:300]
    stored = _idempotency_keys(gw.db)
    assert stored and not any(idem in k for k in stored), stored
    assert all(len(k) == 64 and set(k) <= set("0123456789abcdef") for k in stored), stored
    calls = scripted.requests()
    again = gw.post("/v1/completions", key=key, json=body, headers={"Idempotency-Key": idem})
    assert again.headers.get("x-switchyard-idempotent-replay") == "true"
    other = start_gateway(config, db=gw.db)
    try:
        r = other.post("/v1/completions", key=key, json=body, headers={"Idempotency-Key": idem})
    finally:
        other.proc.stop()
    assert r.status_code == 200, r.text[:300]
    assert r.headers.get("x-switchyard-idempotent-replay") == "true"
    assert r.json()["choices"] == first.json()["choices"]
    assert scripted.requests() == calls  # neither repeat reached the upstream


# -- mask_request in process --------------------------------------------------------------

MASKER = PiiMasker()


def test_a_request_without_pii_is_the_request_that_came() -> None:
    """No copy when nothing is found: the cache's keys and the client's bytes going
    upstream both rest on it."""
    req = msgspec.convert(
        {
            "model": "m",
            "messages": [
                {"role": "user", "content": [{"type": "text", "text": "hello"}]},
                {"role": "assistant", "tool_calls": [{"id": "c1", "function": {"name": "f"}}]},
            ],
            "stop": ["x"],
            "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}],
            "response_format": {"type": "json_object"},
            "extra": {"metadata": {"a": "b"}, "top_n": [1, 2.5, None, True]},
        },
        Generation,
    )
    session = MASKER.session()
    assert mask_request(session, req) is req
    assert session.found == {}


def test_media_payloads_pass_and_every_other_member_of_a_message_is_masked() -> None:
    data = "data:image/png;base64," + "Qk3x9ZpL0aRt7YwUv2MnE4sG" * 8  # random-looking
    req = Generation(
        model="m",
        messages=[
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": f"I am {EMAIL}"},
                    {"type": "image_url", "image_url": {"url": data}},
                    {"type": "input_audio", "input_audio": {"data": data[22:], "format": "wav"}},
                ],
            },
            {"role": "assistant", "content": None, "refusal": f"not for {EMAIL}"},
        ],
    )
    masked = mask_request(MASKER.session(), req)
    assert masked.messages is not None
    parts = masked.messages[0]["content"]
    assert parts[0]["text"] == "I am <EMAIL_1>"
    assert parts[1:] == req.messages[0]["content"][1:]  # type: ignore[index]
    assert masked.messages[1]["refusal"] == "not for <EMAIL_1>"


def test_a_literal_placeholder_anywhere_is_never_reused() -> None:
    """A client's own `<EMAIL_1>` in a stop sequence is reserved before numbering: the
    address in the message gets `<EMAIL_2>`, so a restore cannot confuse them."""
    req = Generation(model="m", messages=[{"role": "user", "content": EMAIL}], stop=["<EMAIL_1>"])
    session = MASKER.session()
    masked = mask_request(session, req)
    assert masked.messages == [{"role": "user", "content": "<EMAIL_2>"}]
    assert masked.stop == ["<EMAIL_1>"]
    assert session.restore("<EMAIL_1> <EMAIL_2>") == f"<EMAIL_1> {EMAIL}"


def test_a_value_nested_past_any_parsed_body_fails_closed() -> None:
    deep: Any = EMAIL
    for _ in range(100):
        deep = [deep]
    with pytest.raises(MaskingError):
        mask_request(MASKER.session(), Generation(model="m", extra={"deep": deep}))
