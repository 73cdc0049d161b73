"""Hostile input against surfaces reviewed least: an Anthropic-protocol upstream whose
replies and streams no engine should send, POST /v1/rollouts and GET /v1/models on an
RL-managed model (a real llama-server), and the revision admin routes. Over sockets
against real gateways (tests/support/gateways.py), the Anthropic upstream being
tests/support/hostile_upstream.py answering in the Messages API's shape.

Defects these tests found (each fails on today's code):
- an Anthropic upstream's reply or stream without usage, or with counts that are no
  integers, is billed 0 tokens and $0 (engines/anthropic_reply.py `chat_usage` maps
  every missing or unusable count to 0, so settle.py `Settler._charge` sees a valid
  usage), where an OpenAI upstream's is billed the cap it was sent;
- a Messages stream whose events come out of order is relayed as a malformed chat
  stream: content after the finish chunk, chunks under two ids (`StreamTranslator.feed`);
- POST /admin/models/{alias}/revisions registers the revision (checksum read, engine
  loading) before it checks `wait_s` (api/admin/revisions.py `Revisions.revisions`);
- /v1/rollouts ignores the tenant's regions (rollouts.py `RolloutService.admit` checks
  `may_use` only), and /v1/models lists a model outside them (api/openai.py `models`);
- a rollout reserves its prompts by bytes, bills the engine's token ids n times, and
  never compares the two: a $3 budget spends $7.21 (rollouts.py `admit`/`stream`);
- a rollout ignores its deadline (`x-request-timeout`, server.default_deadline_s);
- a credential sent as a rollout's prompt id or dataset_revision is stored raw in the
  rollouts table (rollouts.py `_at_rest`);
- an admin body's unknown field name comes back whole, twice (api/admin/params.py
  `read_fields`): 120 KB of error for a 60,000-character name.

Gap guards (pass today; nothing else checks them): an honest Anthropic reply is billed
its own counts; a client that leaves mid-rollout gets one `cancelled` ledger row billing
at least the records it was sent.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import sqlite3
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from support.gateways import Gateway, local_model, start_gateway
from support.hostile_upstream import Hostile, Reply, hostile_upstream, json_reply, sse_reply
from switchyard.engines.assets import smollm2_gguf_path

PRICE = {"input": 0.0, "output": 1000.0}  # $1000 a million output tokens: 16 cost $0.016
CAP = 16
LEAKS = ("Traceback", "Error:", "orjson", "msgspec", "KeyError", "TypeError")


# -- an Anthropic-protocol upstream -------------------------------------------------------


def _message(usage: Any = None, text: str = "a long answer " * 40) -> bytes:
    msg: dict[str, Any] = {
        "id": "msg_1",
        "type": "message",
        "role": "assistant",
        "model": "claude-hostile",
        "content": [{"type": "text", "text": text}],
        "stop_reason": "end_turn",
        "stop_sequence": None,
    }
    if usage is not None:
        msg["usage"] = usage
    return json.dumps(msg).encode()


def _sse(kind: str, data: dict[str, Any]) -> bytes:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data})}\n\n".encode()


def _stream(usage_start: Any = None, usage_end: Any = None) -> Reply:
    start: dict[str, Any] = {"id": "msg_2", "type": "message", "role": "assistant",
                             "model": "claude-hostile", "content": []}  # fmt: skip
    if usage_start is not None:
        start["usage"] = usage_start
    delta: dict[str, Any] = {"delta": {"stop_reason": "end_turn", "stop_sequence": None}}
    if usage_end is not None:
        delta["usage"] = usage_end
    return sse_reply(
        _sse("message_start", {"message": start}),
        _sse("content_block_start", {"index": 0, "content_block": {"type": "text", "text": ""}}),
        *[
            _sse(
                "content_block_delta",
                {"index": 0, "delta": {"type": "text_delta", "text": "word "}},
            )
            for _ in range(40)
        ],
        _sse("content_block_stop", {"index": 0}),
        _sse("message_delta", delta),
        _sse("message_stop", {}),
    )


ANTHROPIC: dict[str, Reply] = {
    "a-honest": json_reply(_message({"input_tokens": 5, "output_tokens": CAP})),
    "a-no-usage": json_reply(_message()),
    "a-usage-strings": json_reply(_message({"input_tokens": "5", "output_tokens": "900"})),
    "a-usage-array": json_reply(_message(["input_tokens", 5, "output_tokens", 900])),
    "a-stream-no-usage": _stream(),
    "a-stream-usage-strings": _stream({"input_tokens": "5"}, {"output_tokens": "900"}),
}


@pytest.fixture(scope="module")
def up() -> Iterator[Hostile]:
    with hostile_upstream(ANTHROPIC) as hostile:
        yield hostile


@pytest.fixture(scope="module")
def gw(up: Hostile) -> Iterator[Gateway]:
    models = up.models(ANTHROPIC, PRICE, kind="anthropic", model="claude-x")
    g = start_gateway({"models": models, "embeddings": {"enabled": False}})
    yield g
    g.proc.stop()


def _rows(gw: Gateway, tenant: str, n: int) -> list[dict[str, Any]]:
    """The tenant's ledger rows once there are `n` (Gateway.stored_rows)."""
    return gw.stored_rows(tenant, n)


def _chat(gw: Gateway, key: str, model: str, stream: bool = False) -> httpx.Response:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": "write at length"}],
        "max_tokens": CAP,
        "stream": stream,
    }
    return gw.post("/v1/chat/completions", key=key, json=body, timeout=30)


@pytest.mark.parametrize(
    "model",
    [
        "a-no-usage",
        "a-usage-strings",
        "a-usage-array",
        "a-stream-no-usage",
        "a-stream-usage-strings",
    ],
)
def test_an_anthropic_reply_without_usable_usage_is_billed_the_cap_it_was_sent(
    gw: Gateway, model: str
) -> None:
    """An OpenAI upstream's complete reply without usable counts is billed the output it
    was let write (test_hostile_s68f, s68b). The same reply from a Messages-API upstream
    is billed 0 tokens and $0 today, whatever it wrote (anthropic_reply.chat_usage maps
    a missing or unusable count to 0), so a tenant's budget never moves."""
    tenant, key = gw.new_tenant("anth")
    stream = model.startswith("a-stream")
    r = _chat(gw, key, model, stream=stream)
    assert r.status_code == 200, r.text
    if stream:
        assert "data: [DONE]" in r.text, r.text[-300:]
    else:
        assert r.json()["choices"][0]["message"]["content"].startswith("a long answer")
    row = _rows(gw, tenant, 1)[0]
    assert row["status"] == "ok", row
    assert row["output_tokens"] >= CAP, row
    assert row["cost_usd"] >= CAP * PRICE["output"] / 1e6 - 1e-9, row


def test_an_honest_anthropic_reply_is_billed_what_it_reports(gw: Gateway) -> None:
    """Gap guard for the above: a Messages-API reply whose usage is well-formed is
    billed exactly its counts (no estimate in their place)."""
    tenant, key = gw.new_tenant("anth")
    r = _chat(gw, key, "a-honest")
    assert r.status_code == 200, r.text
    assert r.json()["usage"] == {"prompt_tokens": 5, "completion_tokens": CAP, "total_tokens": 21}
    row = _rows(gw, tenant, 1)[0]
    assert (row["input_tokens"], row["output_tokens"]) == (5, CAP), row
    assert abs(row["cost_usd"] - CAP * PRICE["output"] / 1e6) < 1e-9, row


def _well_formed_or_broken_off(text: str) -> str | None:
    """Why the chat stream `text` is neither well-formed (one id throughout, the role
    first, nothing after the chunk that carries the finish reason, `[DONE]` last) nor
    broken off with an error event; None when it is one of the two."""
    datas = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
    if not datas:
        return "no events"
    if datas[-1] != "[DONE]":
        last = json.loads(datas[-1])
        return None if "error" in last else f"ends with {datas[-1][:200]}"
    chunks = [json.loads(d) for d in datas[:-1]]
    ids = {c.get("id") for c in chunks}
    if len(ids) != 1:
        return f"chunks of one stream carry several ids: {sorted(map(str, ids))}"
    choices = [ch for c in chunks for ch in c.get("choices", [])]
    if not choices or choices[0]["delta"].get("role") != "assistant":
        return "the first delta is not the assistant's role"
    finished = [i for i, ch in enumerate(choices) if ch.get("finish_reason")]
    if len(finished) != 1 or finished[0] != len(choices) - 1:
        return f"a chunk comes after the finish reason: {choices[finished[0] + 1 :]}"
    return None


START = _sse("message_start", {"message": {"id": "msg_3", "type": "message", "role": "assistant",
              "model": "claude-hostile", "content": [], "usage": {"input_tokens": 3, "output_tokens": 1}}})  # fmt: skip
FINISH = _sse(
    "message_delta", {"delta": {"stop_reason": "end_turn"}, "usage": {"output_tokens": 4}}
)


def _text(t: str) -> bytes:
    return _sse("content_block_delta", {"index": 0, "delta": {"type": "text_delta", "text": t}})


ANTHROPIC.update(
    {
        "a-after-finish": sse_reply(START, _text("one"), FINISH, _text("AFTER"), _sse("message_stop", {})),
        "a-before-start": sse_reply(_text("EARLY"), START, _text("one"), FINISH, _sse("message_stop", {})),
    }
)  # fmt: skip


@pytest.mark.parametrize("model", ["a-after-finish", "a-before-start"])
def test_an_out_of_order_messages_stream_is_no_malformed_chat_stream(
    gw: Gateway, model: str
) -> None:
    """A Messages stream whose events come out of order (text after `message_delta`,
    text before `message_start`) is relayed today as a chat
    stream no OpenAI upstream could send: a content chunk after the finish chunk, chunks
    of one stream under two ids (`msg` and the message's)
    (anthropic_reply.StreamTranslator.feed takes every event in any order). The client
    is owed a well-formed stream or an error event."""
    _, key = gw.new_tenant("anth")
    r = _chat(gw, key, model, stream=True)
    assert r.status_code == 200, r.text
    assert _well_formed_or_broken_off(r.text) is None, (_well_formed_or_broken_off(r.text), r.text)
    assert not any(leak in r.text for leak in LEAKS), r.text


# -- an RL-managed model: its revisions and its rollouts -------------------------------------


@pytest.fixture(scope="module")
def gguf() -> tuple[str, str]:
    """The shipped base model's weights (a registrable `gguf` revision) and their sha256."""
    path = os.path.realpath(smollm2_gguf_path())
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return path, h.hexdigest()


@pytest.fixture(scope="module")
def rl(gguf: tuple[str, str]) -> Iterator[Gateway]:
    model = local_model("smol", parallel=2, ctx=1024, threads=1)
    model["price"] = {"input": 1000.0, "output": 1000.0}  # 1,000 tokens cost $1
    model["region"] = "us"
    g = start_gateway(
        {
            "models": [model],
            "embeddings": {"enabled": False},
            "rl": {"weights_dirs": [os.path.dirname(gguf[0])], "models": {"smol": {}}},
        }
    )
    yield g
    g.proc.stop()


def _admin(gw: Gateway, method: str, path: str, **kw: Any) -> httpx.Response:
    return httpx.request(method, gw.url + path, headers=gw.admin, timeout=60, **kw)


@pytest.mark.parametrize("wait_s", ["soon", 10**9])
def test_a_bad_wait_s_registers_no_revision(
    rl: Gateway, gguf: tuple[str, str], wait_s: Any
) -> None:
    """A registration refused for its `wait_s` must leave nothing behind. Today the
    revision is registered (its checksum read, its engine started loading in the
    background) before `wait_s` is checked (api/admin/revisions.py: `wait_for` runs
    after `manager.register`): the 400 leaves a live revision, and the same body with
    a good `wait_s` is then refused 409."""
    rev = "bad-wait-" + ("text" if isinstance(wait_s, str) else "huge")
    body = {"revision": rev, "kind": "gguf", "path": gguf[0], "sha256": gguf[1]}
    r = _admin(rl, "POST", "/admin/models/smol/revisions", json={**body, "wait_s": wait_s})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "wait_s", r.text
    got = _admin(rl, "GET", f"/admin/models/smol/revisions/{rev}")
    assert got.status_code == 404, got.text
    listed = _admin(rl, "GET", "/admin/models/smol/revisions")
    assert rev not in listed.text, listed.text


def _rollout(gw: Gateway, key: str, body: dict[str, Any], **headers: str) -> httpx.Response:
    auth = {"Authorization": f"Bearer {key}", **headers}
    return httpx.post(gw.url + "/v1/rollouts", json=body, headers=auth, timeout=180)


def _ndjson(r: httpx.Response) -> list[dict[str, Any]]:
    return [json.loads(line) for line in r.text.splitlines() if line.strip()]


def test_rollouts_keep_to_the_tenants_regions(rl: Gateway) -> None:
    """A tenant whose data may only go to region `eu` is refused the `us` model on chat
    completions; on /v1/rollouts it is served today (rollouts.RolloutService.admit
    checks `may_use` only, never the tenant's regions): its prompts reach an engine
    outside its data boundary, and the records name its tenant."""
    tenant, key = rl.new_tenant("eu", labels={"regions": ["eu"]})
    chat = rl.post(
        "/v1/chat/completions",
        key=key,
        json={"model": "smol", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
    )
    # A refusal on both, never a 503 a client would retry (test_hostile_s71a).
    assert chat.status_code == 403, chat.text
    assert chat.json()["error"]["code"] == "region_not_allowed", chat.text
    r = _rollout(rl, key, {"model": "smol", "prompts": ["hi"], "n": 1, "max_tokens": 2})
    assert r.status_code == 403, r.text[:500]
    assert r.json()["error"]["code"] == "region_not_allowed", r.text
    rows = _rows(rl, tenant, 2)
    assert [row["output_tokens"] for row in rows] == [0, 0], rows


def test_v1_models_lists_no_model_outside_the_tenants_regions(rl: Gateway) -> None:
    """/v1/models is "the models this key may use" (api/openai.py `models`); it lists
    the `us` model to a tenant held to `eu`, which every request for it is refused
    (chat above): the listing checks `may_use` only."""
    _, key = rl.new_tenant("eu", labels={"regions": ["eu"]})
    r = httpx.get(rl.url + "/v1/models", headers={"Authorization": f"Bearer {key}"})
    assert r.status_code == 200, r.text
    assert [m["id"] for m in r.json()["data"]] == [], r.text


def test_a_rollouts_prompts_never_spend_past_the_budget(rl: Gateway) -> None:
    """A rollout reserves its prompts by the body's bytes (~3 a token, policy/cost.py),
    then bills the token ids the engine made of them, n times. A character the
    tokenizer splits into 3 tokens (U+0F00, 3 bytes) makes 300 characters 900 tokens
    reserved as ~317: 8 samples reserve ~$2.54 of a $3 budget and spend $7.21 today
    (rollouts.py `admit` reserves before `stream` tokenizes; nothing checks the actual
    count against what was reserved). The prompt ids are known before any sample is
    drawn, so the request can be held to the budget: refused, or billed within it."""
    budget = 3.0
    tenant, key = rl.new_tenant("rb", budget_usd=budget)
    body = {"model": "smol", "prompts": ["\u0f00" * 300], "n": 8, "max_tokens": 1}
    r = _rollout(rl, key, {**body, "temperature": 0.0})
    if r.status_code == 200:
        summary = _ndjson(r)[-1]
        assert summary["object"] == "rollout.summary", summary
    else:
        assert r.status_code in (402, 429), r.text
    spent = sum(row["cost_usd"] for row in _rows(rl, tenant, 1))
    assert spent <= budget + 1e-9, f"spent ${spent:.3f} of a ${budget} budget"


def test_a_rollout_ends_at_its_deadline(rl: Gateway) -> None:
    """`x-request-timeout: 2` bounds a chat request to 2 s; a rollout ignores it (and
    server.default_deadline_s): rollouts.py `stream` draws every sample to its
    max_tokens with no deadline, on a session without a total timeout
    (engines/revisions.py), so a rollout holds engine slots for as long as its samples
    take. Past its deadline the client is owed the end of the stream (the samples not
    drawn as error records, or a rollout.error line), not minutes more of samples."""
    _, key = rl.new_tenant("dl")
    body = {
        "model": "smol",
        "prompts": [" ".join(["1"] * 64)],  # greedy, it repeats to max_tokens (~13 s here)
        "n": 2,
        "max_tokens": 300,
        "temperature": 0.0,
    }
    t0 = time.monotonic()
    r = _rollout(rl, key, body, **{"x-request-timeout": "2"})
    took = time.monotonic() - t0
    assert took < 6.0, f"a rollout with a 2 s deadline took {took:.1f} s"
    assert r.status_code in (200, 504), r.text[:300]
    if r.status_code == 200:
        assert _ndjson(r)[-1]["object"] in ("rollout.summary", "rollout.error"), r.text[-300:]


def test_the_samples_a_deadline_cuts_are_billed(rl: Gateway) -> None:
    """Samples cut at the engine by the deadline had their prompts read and may have
    written up to max_tokens each; they were billed nothing (rollouts.py counted only
    finished samples): a client could draw for free by always asking a deadline just
    short of its samples' end. Each one cut is billed its prompt and max_tokens."""
    tenant, key = rl.new_tenant("dlb")
    body = {
        "model": "smol",
        "prompts": [" ".join(["1"] * 64)],  # greedy, it repeats to max_tokens (~13 s here)
        "n": 1,
        "max_tokens": 300,
        "temperature": 0.0,
    }
    r = _rollout(rl, key, body, **{"x-request-timeout": "2"})
    assert r.status_code in (200, 504), r.text[:300]
    [row] = _rows(rl, tenant, 1)
    assert row["output_tokens"] >= 300 and row["input_tokens"] >= 64, row
    assert row["cost_usd"] > 0, row


SECRET = "sk-proj-Rv7wQ2nL9xB4tK1mZ6yH3pC8sD0fG5jA"  # an API key's shape, sent as an id
SECRET2 = "sk-proj-Tb4yN8cE1vQ6rM3kW9uJ2hX5pD7gL0aF"


def test_a_credential_sent_as_a_rollouts_ids_is_not_kept_raw(rl: Gateway) -> None:
    """A rollout's prompt `id` and `dataset_revision` are free identifiers (1-128 of
    A-Z a-z 0-9 . _ : - /), so a client can put a credential there, as it can in
    `model` (test_hostile_s68e: not kept raw). The stored records keep both raw today
    (rollouts.py `_at_rest` masks only the text and token ids; the rollouts table's
    `record` holds `prompt_id` and `provenance.dataset_revision` as sent)."""
    _, key = rl.new_tenant("sec")
    body = {
        "model": "smol",
        "prompts": [{"id": SECRET, "prompt": "hi"}],
        "dataset_revision": SECRET2,
        "n": 1,
        "max_tokens": 2,
    }
    r = _rollout(rl, key, body)
    assert r.status_code == 200, r.text
    assert _ndjson(r)[-1]["object"] == "rollout.summary", r.text[-300:]
    deadline = time.monotonic() + 10
    while True:  # the records are stored once the stream ended
        with contextlib.closing(sqlite3.connect(f"file:{rl.db}?mode=ro", uri=True)) as db:
            rid = r.headers["x-request-id"]
            stored = db.execute("SELECT record FROM rollouts WHERE request_id = ?", (rid,))
            records = [row[0] for row in stored]
        if records or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert records, "the rollout's records were never stored"
    assert not [s for s in (SECRET, SECRET2) if s in records[0]], records[0][:400]
    files = [Path(rl.db + suffix) for suffix in ("", "-wal", "-shm")]
    at_rest = b"".join(f.read_bytes() for f in files if f.exists())
    assert SECRET.encode() not in at_rest and SECRET2.encode() not in at_rest


def test_an_unknown_admin_field_is_named_within_a_bound(rl: Gateway) -> None:
    """An admin body's unknown field is refused by name (api/admin/params.py
    `read_fields`) with the whole name, twice (message and param): a 60,000-character
    name comes back as a 120 KB error. The client routes cut such a name to 64
    characters (rollouts.py `validate_rollout`); the admin routes' errors should too."""
    r = _admin(rl, "POST", "/admin/models/smol/revisions", json={"x" * 60_000: 1})
    assert r.status_code == 400, r.text[:300]
    err = r.json()["error"]
    assert err["code"] == "invalid_request", err
    assert len(err["message"]) <= 256 and len(err["param"] or "") <= 128, len(r.content)


def test_a_client_that_leaves_mid_rollout_is_billed_what_it_was_sent_once(rl: Gateway) -> None:
    """Gap guard: a client that reads the first NDJSON record and leaves gets one
    ledger row, `cancelled`, billing at least the tokens of every record it was sent
    (the stream's `finally` and `abandon` both settle; the second must be a no-op)."""
    tenant, key = rl.new_tenant("left")
    body = {
        "model": "smol",
        "prompts": [" ".join(["1"] * 16)],
        "n": 4,
        "max_tokens": 64,
        "temperature": 0.0,
    }
    auth = {"Authorization": f"Bearer {key}"}
    with httpx.stream("POST", rl.url + "/v1/rollouts", json=body, headers=auth, timeout=120) as r:
        assert r.status_code == 200
        rid = r.headers["x-request-id"]
        first = json.loads(next(r.iter_lines()))
    assert first["object"] == "rollout.sample", first
    time.sleep(1.0)  # a second settle, if any, would land by now
    rows = [row for row in _rows(rl, tenant, 1) if row["request_id"] == rid]
    assert len(rows) == 1, rows
    assert rows[0]["status"] == "cancelled", rows[0]
    assert rows[0]["output_tokens"] >= first["usage"]["completion_tokens"] > 0, rows[0]
    assert rows[0]["input_tokens"] >= first["usage"]["prompt_tokens"] > 0, rows[0]
