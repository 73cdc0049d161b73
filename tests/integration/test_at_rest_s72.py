"""What a hostile client can make the gateway keep at rest (session 72 audit).

One real gateway, with a home directory of its own (`HOME`, its SQLite files, the
Responses sealing key, its OpenTelemetry file), in front of the scripted upstream and
the test MCP tool server. The client puts PII (an e-mail address, a phone number, a card
number, an IBAN) and credentials (an `sk-` key, a `password=`) in every place it can:
chat messages, tool-call arguments and tool results, Responses input items and
instructions (stored, background, streamed), Messages system and `tool_result` blocks,
embeddings input, `user`, `metadata`, the headers the gateway records, idempotency keys,
requests the gateway refuses with a 400 that names a field, upstream 4xx and 5xx errors
that quote the prompt, a stream cut by the upstream, a stream the client leaves, a
cached reply, and an MCP `tools/call`. The upstream's own API key is a credential too.

Then the gateway is stopped and every file under its home (the databases read as bytes,
their WAL and journal files, the key file, the span file) and its log are scanned for the
raw values, their JSON-escaped forms and their lowercase forms. The scan is shown able to
fail: the same needles are found in what the scripted upstream received (observe_only
sends raw text upstream, by design).
"""

from __future__ import annotations

import contextlib
import json
import os
import sqlite3
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx
import pytest

from support.gateways import Gateway, cheap_config, start_gateway
from support.mcp_http import ACCEPT, in_session, open_session
from support.mcp_sessions import Tools, http_tool_server, wait_tools_ready
from support.upstreams import Scripted
from switchyard.api.codecs import chat_completions
from switchyard.state.idempotency import body_hash

# The raw values; none is stored, in any form.
EMAIL = "rhea.vasquez@example.org"
PHONE = "+1 (212) 555-0187"
CARD = "4012 8888 8888 1881"
IBAN = "FR14 2004 1010 0505 0001 3M02 606"
SK = "sk-live-Vb7Nq2Lp9Xw4Rt6Ys8Zk3Mh5Jd1Fc0Ga"
PASSWORD = "Qu4ntumLeap9x"
UPSTREAM_KEY = "upstream-cred-" + os.urandom(12).hex()
# The same card number and IBAN without spaces: valid ids by their characters.
CARD_ID = CARD.replace(" ", "-")  # a card as a person writes one where an id goes
IBAN_ID = IBAN.replace(" ", "")
PII = {"EMAIL": EMAIL, "PHONE": PHONE, "CARD": CARD, "IBAN": IBAN, "SK": SK, "PW": PASSWORD}
IDS = {"CARD_ID": CARD_ID, "IBAN_ID": IBAN_ID}
TEXT = f"Reach me at {EMAIL} or {PHONE}; card {CARD}, iban {IBAN}, key {SK}, password={PASSWORD}."


def _forms(raw: str) -> set[bytes]:
    """The raw value and the simple encodings a store may keep it in."""
    forms = {raw, raw.lower(), json.dumps(raw)[1:-1]}
    return {f.encode() for f in forms} | {raw.encode("utf-16-le")}


NEEDLES = {name: _forms(v) for name, v in {**PII, **IDS, "UPSTREAM_KEY": UPSTREAM_KEY}.items()}


def _found(data: bytes) -> set[str]:
    return {name for name, forms in NEEDLES.items() if any(f in data for f in forms)}


@pytest.fixture(scope="module")
def world(scripted: Scripted) -> Iterator[tuple[Gateway, Path]]:
    home = Path(tempfile.mkdtemp(prefix="switchyard-home-"))
    tools = Tools()
    with http_tool_server(tools) as mcp_url:
        config = cheap_config(
            scripted,
            {
                "alias": "masked",
                "engine": {"kind": "openai", "base_url": scripted.url + "/v1"},
                "resilience": {"retries": 0},
            },
            pii={"mode": "observe_only", "models": {"masked": "mask_upstream"}},
            cache={"enabled": True, "semantic": False},
            observe={"otel": {"exporter": "file", "path": str(home / "spans.jsonl")}},
            mcp={"servers": [{"name": "web", "url": mcp_url}]},
            tools={
                "registry": [
                    {"name": "web__lookup", "class": "read_only"},
                    {"name": "web__send_email", "class": "side_effect"},
                ]
            },
        )
        cheap = config["models"][0]
        cheap["engine"]["api_key_env"] = "S72_UPSTREAM_KEY"
        cheap["resilience"] = {"retries": 0}
        gw = start_gateway(
            config,
            env={"HOME": str(home), "S72_UPSTREAM_KEY": UPSTREAM_KEY},
            db=str(home / ".switchyard" / "switchyard.db"),
        )
        try:
            wait_tools_ready(gw, ("web",))
            yield gw, home
        finally:
            gw.proc.stop()


def _chat(model: str) -> dict[str, Any]:
    return {
        "model": model,
        "max_tokens": 8,
        "user": EMAIL,
        "metadata": {"note": TEXT},
        "messages": [
            {"role": "system", "content": TEXT},
            {"role": "user", "content": TEXT},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "lookup", "arguments": json.dumps({"q": TEXT})},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": TEXT},
        ],
    }


def _responses(model: str, **more: Any) -> dict[str, Any]:
    return {
        "model": model,
        "instructions": TEXT,
        "max_output_tokens": 16,
        "metadata": {"note": TEXT},
        "user": EMAIL,
        "input": [
            {"role": "user", "content": [{"type": "input_text", "text": TEXT}]},
            {"type": "function_call", "call_id": "c1", "name": "lookup", "arguments": TEXT},
            {"type": "function_call_output", "call_id": "c1", "output": TEXT},
        ],
        **more,
    }


def _messages(model: str) -> dict[str, Any]:
    return {
        "model": model,
        "max_tokens": 8,
        "system": [{"type": "text", "text": TEXT}],
        "metadata": {"user_id": EMAIL},
        "tools": [{"name": "lookup", "description": TEXT, "input_schema": {"type": "object"}}],
        "messages": [
            {"role": "user", "content": TEXT},
            {
                "role": "assistant",
                "content": [
                    {"type": "tool_use", "id": "tu1", "name": "lookup", "input": {"q": TEXT}}
                ],
            },
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": "tu1", "content": TEXT}],
            },
        ],
    }


def _send_everything(gw: Gateway, scripted: Scripted) -> None:
    for model in ("cheap", "masked"):
        # Chat, once into the cache and once replayed from it, once with an idempotency key.
        for headers in ({}, {}, {"Idempotency-Key": f"idem-{model}", "cache-control": "no-store"}):
            r = gw.post("/v1/chat/completions", json=_chat(model), headers=headers)
            assert r.status_code == 200, r.text
        # The upstream quotes the prompt in its errors (a 4xx a client sees, a 5xx only
        # the log and the trace see).
        for fault in ("echo:400", "echo:500"):
            scripted.fault(fault, count=1)
            r = gw.post(
                "/v1/chat/completions", json=_chat(model), headers={"cache-control": "no-store"}
            )
            assert r.status_code in (400, 502), (fault, r.text)
        # A stream the upstream cuts, and one the client leaves.
        scripted.fault("drop-mid-stream", count=1)
        with gw.stream(
            {**_chat(model), "stream": True}, headers={"cache-control": "no-store"}
        ) as s:
            s.read()
        scripted.fault("slow:200", count=1)
        with gw.stream(
            {**_chat(model), "stream": True}, headers={"cache-control": "no-store"}
        ) as s:
            next(s.iter_bytes())
        # Responses: stored, streamed, in the background.
        for more in (
            {"store": True},
            {"store": True, "stream": True},
            {"background": True, "store": True},
        ):
            r = gw.post("/v1/responses", json=_responses(model, **more))
            assert r.status_code == 200, r.text
        # Failing Responses (in the background, streamed) and Messages, whose upstream
        # error quotes the prompt; an upstream that refuses the gateway's credential.
        for fault, more in (
            ("echo:500", {"background": True, "store": True}),
            ("echo:400", {"stream": True, "store": True}),
            ("status:401", {"store": True}),
        ):
            scripted.fault(fault, count=1)
            r = gw.post("/v1/responses", json=_responses(model, **more))
            assert r.status_code in (200, 400, 401, 502), r.text
        scripted.fault("echo:400", count=1)
        r = gw.post("/v1/messages", json=_messages(model), headers={"cache-control": "no-store"})
        assert r.status_code == 400, r.text
        # Messages, with a system prompt and a tool_result.
        r = gw.post("/v1/messages", json=_messages(model))
        assert r.status_code == 200, r.text
        # Embeddings of a model that does not embed: refused, still settled.
        r = gw.post("/v1/embeddings", json={"model": model, "input": [TEXT], "user": EMAIL})
        assert r.status_code >= 400, r.text
        # A 400 that names a field whose value holds PII.
        bad = {**_chat(model), "temperature": TEXT}
        r = gw.post("/v1/chat/completions", json=bad)
        assert r.status_code == 400, r.text
        bad = {**_chat(model), "max_tokens": TEXT}
        r = gw.post("/v1/chat/completions", json=bad)
        assert r.status_code == 400, r.text
        r = gw.post("/v1/chat/completions", json={**_chat(model), "model": TEXT})
        assert r.status_code in (400, 404), r.text
    # Headers the gateway records, holding PII (ids must be refused, not stored).
    for name in ("x-task-id", "x-request-id", "x-client-request-id", "x-parent-request-id"):
        for value in (SK, EMAIL):
            r = gw.post("/v1/chat/completions", json=_chat("cheap"), headers={name: value})
            assert r.status_code in (200, 400), (name, r.text)
    for value in (SK, EMAIL, TEXT):
        r = gw.post(
            "/v1/chat/completions",
            json=_chat("cheap"),
            headers={
                "Idempotency-Key": value,
                "x-switchyard-cache-tags": "a",
                "traceparent": value,
            },
        )
        assert r.status_code in (200, 400), r.text
    # Malformed bodies, and PII in the path and the query string (an access log writes them).
    for raw in (
        b'{"model": "cheap", "messages": [' + TEXT.encode(),
        TEXT.encode(),
        b"\xff" + TEXT.encode(),
    ):
        r = gw.post(
            "/v1/chat/completions", content=raw, headers={"content-type": "application/json"}
        )
        assert r.status_code == 400, r.text
    r = gw.post("/v1/chat/completions?" + "q=" + quote(TEXT), json=_chat("cheap"))
    assert r.status_code in (200, 400), r.text
    for path in (
        f"/v1/responses/{quote(SK)}",
        f"/v1/responses/{quote(EMAIL)}",
        "/v1/" + quote(TEXT),
    ):
        r = httpx.get(gw.url + path, headers=gw.auth)
        assert r.status_code in (400, 404), r.text
        r = httpx.delete(gw.url + path, headers=gw.auth)
        assert r.status_code in (400, 404, 405), r.text
    # Other recorded headers that hold PII.
    for name in ("x-switchyard-cache-tags", "x-switchyard-data-version", "x-switchyard-locale"):
        for value in (*IDS.values(), SK):
            r = gw.post("/v1/chat/completions", json=_chat("cheap"), headers={name: value})
            assert r.status_code in (200, 400), (name, r.text)
    # Client-chosen tool-call ids, model names and approval tokens that hold PII.
    for cid in (SK, CARD_ID):
        body = _chat("cheap")
        body["messages"][2]["tool_calls"][0]["id"] = cid
        body["messages"][3]["tool_call_id"] = cid
        r = gw.post("/v1/chat/completions", json=body, headers={"x-task-id": "task-ids"})
        assert r.status_code in (200, 400), r.text
        body = _responses("cheap")
        body["input"][1]["call_id"] = body["input"][2]["call_id"] = cid
        r = gw.post("/v1/responses", json=body, headers={"x-task-id": "task-ids"})
        assert r.status_code in (200, 400), r.text
        r = gw.post("/v1/chat/completions", json={**_chat("cheap"), "model": cid})
        assert r.status_code in (400, 404), r.text
        r = gw.post(
            "/v1/chat/completions", json=_chat("cheap"), headers={"x-switchyard-approval": cid}
        )
        assert r.status_code in (200, 400, 403), r.text
    # Responses ids and end-user ids that hold PII.
    for more in (
        {"previous_response_id": SK},
        {"previous_response_id": CARD_ID},
        {"prompt_cache_key": SK, "safety_identifier": EMAIL, "store": True},
        {"conversation": SK},
    ):
        r = gw.post("/v1/responses", json=_responses("cheap", **more))
        assert r.status_code in (200, 400, 404), r.text
    # The upstream answers with PII: in its text, and in tool calls it proposes in a task.
    scripted.content(TEXT)
    try:
        for model in ("cheap", "masked"):
            r = gw.post(
                "/v1/chat/completions", json=_chat(model), headers={"Idempotency-Key": f"a-{model}"}
            )
            assert r.status_code == 200, r.text
            r = gw.post("/v1/responses", json=_responses(model, store=True))
            assert r.status_code == 200, r.text
            r = gw.post("/v1/messages", json=_messages(model))
            assert r.status_code == 200, r.text
    finally:
        scripted.content(None)
    calls = [{"name": "lookup", "arguments": {"q": TEXT}}]
    assert httpx.put(scripted.url + "/control/tool_calls", json={"calls": calls}).is_success
    try:
        for model in ("cheap", "masked"):
            r = gw.post(
                "/v1/chat/completions", json=_chat(model), headers={"x-task-id": f"task-{model}"}
            )
            assert r.status_code == 200, r.text
    finally:
        httpx.put(scripted.url + "/control/tool_calls", json={"calls": []})
    # MCP tools/call whose arguments, tool name, task id and call id hold PII (a call id
    # in `_meta.call_id` or `x-switchyard-call-id` was kept raw in tool_calls and the
    # trace before: refused now, as the id headers are).
    sid = open_session(gw, gw.key)
    headers = {**in_session(gw.key, sid), **ACCEPT}

    def mcp(
        rid: int, name: str, args: dict[str, Any], meta: dict[str, Any] | None = None, **h: str
    ) -> str:
        params: dict[str, Any] = {"name": name, "arguments": args}
        if meta is not None:
            params["_meta"] = meta
        call = {"jsonrpc": "2.0", "id": rid, "method": "tools/call", "params": params}
        r = httpx.post(gw.url + "/mcp", json=call, headers={**headers, **h}, timeout=30)
        assert r.status_code in (200, 400), r.text
        return r.text

    assert "found" in mcp(7, "web__lookup", {"q": TEXT})
    mcp(8, TEXT, {"q": TEXT})
    mcp(9, "web__send_email", {"to": EMAIL, "body": TEXT}, {"call_id": "send-1"})
    for i, cid in enumerate((SK, CARD_ID, IBAN_ID)):
        mcp(30 + i, "web__lookup", {"q": TEXT}, None, **{"x-task-id": cid})
        refused = mcp(40 + i, "web__lookup", {"q": TEXT}, {"call_id": cid})
        assert '"error"' in refused and "credential" in refused, refused[:300]
        refused = mcp(50 + i, "web__lookup", {"q": TEXT}, None, **{"x-switchyard-call-id": cid})
        assert '"error"' in refused and "credential" in refused, refused[:300]


ID_HEADERS = ("x-task-id", "x-client-request-id", "x-request-id", "x-parent-request-id")


def test_an_id_that_is_a_card_number_an_iban_or_a_national_id_is_refused(world: Any) -> None:
    """Ids are kept as sent in usage rows, traces and spans: before, a card number or an
    IBAN (valid id characters, no credential shape) was answered 200 and stored raw."""
    gw, _home = world
    values = (*IDS.values(), f"task-{CARD_ID}", "078-05-1120", "850315-2123456")
    for name in ID_HEADERS:
        for value in values:
            r = gw.post("/v1/chat/completions", json=_chat("cheap"), headers={name: value})
            assert r.status_code == 400, (name, value, r.text)
            error = r.json()["error"]
            assert error["param"] == name and value not in r.text, r.text
        # Ids are still ids: the gateway's own shapes, UUIDs, dates and timestamps pass,
        # and so do bare numbers that happen to pass Luhn (a clock's nanoseconds, a
        # random number: one in ten would, so a card is read in an id only as a
        # person writes one, in dashed groups).
        for value in (
            "task-cheap",
            "0f5e9c3a-1b2c-4d5e-8f90-123456789012",
            "2026-12-07",
            "1796621028621",
            CARD.replace(" ", ""),
            "task-" + CARD.replace(" ", ""),
            "4444333322221111",
        ):
            r = gw.post("/v1/chat/completions", json=_chat("cheap"), headers={name: value})
            assert r.status_code == 200, (name, value, r.text)
    sid = open_session(gw, gw.key)
    call = {
        "jsonrpc": "2.0",
        "id": 1,
        "method": "tools/call",
        "params": {"name": "web__lookup", "arguments": {"q": "x"}},
    }
    headers = {**in_session(gw.key, sid), **ACCEPT, "x-task-id": CARD_ID}
    r = httpx.post(gw.url + "/mcp", json=call, headers=headers, timeout=30)
    assert "x-task-id" in r.text and CARD_ID not in r.text and "found" not in r.text, r.text


def test_the_stored_body_digest_of_an_idempotency_key_cannot_be_guessed(world: Any) -> None:
    """The idempotency table kept a plain SHA-256 of the canonical request: whoever
    reads the database tests guesses of a short prompt's PII (a phone number, a card)
    offline against it. The digest is now keyed (HMAC) like the key column."""
    gw, _home = world
    phones = [f"+1 (212) 555-01{n:02d}" for n in range(100)]
    secret = phones[87]
    body = {
        "model": "cheap",
        "max_tokens": 8,
        "messages": [{"role": "user", "content": f"call {secret}"}],
    }
    r = gw.post("/v1/chat/completions", json=body, headers={"Idempotency-Key": "guess-me"})
    assert r.status_code == 200, r.text
    with contextlib.closing(sqlite3.connect(f"file:{gw.db}?mode=ro", uri=True)) as db:
        stored = {row[0] for row in db.execute("SELECT body_hash FROM idempotency")}
    assert stored
    # The attacker's guesses: the request the gateway decodes, hashed as it was stored.
    codec = chat_completions()
    guessed = [
        p
        for p in phones
        if body_hash(
            codec.decode({**body, "messages": [{"role": "user", "content": f"call {p}"}]})[0]
        )
        in stored
    ]
    assert guessed == [], guessed
    # The key still protects: the same key with another body is refused, the same body replayed.
    r = gw.post("/v1/chat/completions", json=body, headers={"Idempotency-Key": "guess-me"})
    assert r.headers.get("x-switchyard-idempotent-replay") == "true", r.headers
    other = {**body, "messages": [{"role": "user", "content": "call someone else"}]}
    r = gw.post("/v1/chat/completions", json=other, headers={"Idempotency-Key": "guess-me"})
    assert r.status_code == 422, r.text


def test_no_raw_pii_or_credential_anywhere_under_the_home(world: Any, scripted: Scripted) -> None:
    """Last in this module: it stops the shared gateway to read everything it wrote."""
    gw, home = world
    _send_everything(gw, scripted)
    # The scan can fail: the upstream (observe_only) receives the raw values.
    r = gw.post("/v1/chat/completions", json=_chat("cheap"), headers={"cache-control": "no-store"})
    assert r.status_code == 200, r.text
    last = httpx.get(scripted.url + "/control/last").content
    assert {"EMAIL", "PHONE", "CARD", "IBAN", "SK", "PW"} <= _found(last), last[:400]
    time.sleep(1.0)  # background responses and the last ledger batch
    gw.proc.stop()
    files = [p for p in home.rglob("*") if p.is_file()]
    names = {p.name for p in files}
    assert "switchyard.db" in names and "spans.jsonl" in names, names
    leaks = {str(p.relative_to(home)): sorted(_found(p.read_bytes())) for p in files}
    leaks["<gateway log>"] = sorted(_found(Path(gw.proc.log.name).read_bytes()))
    assert not {k: v for k, v in leaks.items() if v}, leaks
