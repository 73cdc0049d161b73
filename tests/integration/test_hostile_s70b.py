"""Hostile input against /v1/embeddings, /v1/completions, the fields PII policy does not
read, the local engine's own request fields, and what the gateway keeps of a request's
identifiers at rest. Over sockets against real gateways: one with the strict settings
(`validation.unknown_fields: reject`, `pii.mode: block`; the scripted upstream as
`cheap`, the embedding model from its wheel at a price), one with `mask_upstream`
before the same upstream, and one managing llama-server (SmolLM2) at a price.

Defects these tests find (each fails on today's code):
- an embeddings request ignores its deadline: with `x-request-timeout: 0.3` a batch that
  takes seconds to embed is answered 200 and billed (execute/embeddings.py
  `Embeddings.run` awaits `embedder.embed` with no deadline; service.py `embeddings`
  never checks `ctx.remaining_s()` after admission), where a generation past its
  deadline is 504 `deadline_exceeded`;
- `validation.unknown_fields: reject` does not reach /v1/embeddings: a field the gateway
  does not know is accepted there (api/openai.py builds `Embeddings(max_inputs)` with no
  unknown-fields policy; policy/validate.py `validate_embeddings` has no `_unknown`);
- `pii.mode: block` does not reach /v1/embeddings: an input or a `user` holding an e-mail
  address is embedded, where chat and completions are refused 400 `pii_detected`
  (gateway/pipelines.py: the embeddings pipeline is Authorize, Task, Admit; no Pii);
- the embeddings `user` is not held to the end-user id rules chat and completions apply
  (at most 512 characters, no control characters: policy/validate.py `_sampling`, which
  `validate_embeddings` never calls);
- an empty input text is embedded and billed (2 tokens for `""`), where the OpenAI API
  refuses it (policy/validate.py `validate_embeddings` checks types, never emptiness);
- a credential a client sends as `x-request-id`, `x-task-id`, `x-parent-request-id` or
  `Idempotency-Key` (free identifiers of A-Z a-z 0-9 . _ : -, so an API key fits) is
  kept raw in the gateway's SQLite files: the usage row and trace (state/traces.py
  `ledger_entry` records `client_request_id`, `task_id`, `parent_request_ids` as sent)
  and the idempotency table's `key` column, where a credential sent as `model`
  (test_hostile_s68e.py) or as a rollout's ids (test_hostile_s69c.py) is not;
- PII in a stop sequence, a `response_format` schema, `web_search_options`, or the
  other protocol's fields a body may carry (a completion's `messages`/`tools`, a chat's
  `prompt`: kept in `extra`, forwarded as sent) reaches the upstream raw under
  `mask_upstream`, and passes `block` (policy/pii.py `mask_request` and the detection
  read a fixed list of fields);
- llama-server's own `n_predict` overrides the `max_tokens` the gateway reserved and
  sent: 64 tokens generated and $0.064 billed on a $0.01 budget; its `n_cmpl` makes
  several choices the gateway neither reserved nor bills (policy/validate.py `_OTHER`
  refuses `lora`, `verbose`, `return_tokens` only);
- a reply of several choices (prompts, `n`) is billed llama-server's usage, which counts
  one choice: four choices run to a 3-token cap are billed 3 tokens (settle.py
  `Settler._charge` takes the count, never compares it with the reply).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from support.gateways import Gateway, cheap_config, local_model, start_gateway
from support.upstreams import Scripted

EMBED = "all-minilm-l6-v2"
EMAIL = "alice.one@example.com"


@pytest.fixture(scope="module")
def masked(scripted: Scripted) -> Iterator[Gateway]:
    """A second gateway before the same upstream: `pii.mode: mask_upstream` and the
    default `validation.unknown_fields: pass`."""
    g = start_gateway(cheap_config(scripted, pii={"mode": "mask_upstream"}))
    yield g
    g.proc.stop()


@pytest.fixture(scope="module")
def gw(scripted: Scripted) -> Iterator[Gateway]:
    scripted.content(None)
    httpx.put(scripted.url + "/control/fault", json={"fault": None})  # none left over
    g = start_gateway(
        cheap_config(
            scripted,
            embeddings={"enabled": True, "price": 100.0},  # USD per million input tokens
            validation={"unknown_fields": "reject"},
            pii={"mode": "block"},
        )
    )
    yield g
    g.proc.stop()


def _embed(gw: Gateway, key: str | None = None, headers: Any = None, **body: Any) -> httpx.Response:
    return gw.post("/v1/embeddings", key=key, json={"model": EMBED, **body}, headers=headers or {})


def _refused(r: httpx.Response, status: int, code: str | None = None) -> dict[str, Any]:
    assert r.status_code == status, r.text[:300]
    err = r.json()["error"]
    assert set(err) >= {"message", "type", "param", "code"}, err
    if code is not None:
        assert err["code"] == code, err
    return dict(err)


# -- /v1/embeddings --------------------------------------------------------------------


def test_an_embeddings_request_ends_at_its_deadline(gw: Gateway) -> None:
    """64 inputs of ~256 tokens take seconds on these CPUs. With a 0.3 s deadline the
    request must end as a generation does, 504 `deadline_exceeded`; today it is
    embedded to the end and answered 200 (and billed) seconds after its deadline."""
    _, key = gw.new_tenant("s70b-deadline")
    texts = [f"deadline {i} " + " ".join(f"w{i}x{j}" for j in range(300)) for i in range(64)]
    started = time.monotonic()
    r = _embed(gw, key, {"x-request-timeout": "0.3"}, input=texts)
    took = time.monotonic() - started
    assert r.status_code != 200, f"answered 200 after {took:.1f} s past a 0.3 s deadline"
    _refused(r, 504, "deadline_exceeded")


def test_an_unknown_embeddings_field_is_refused_under_reject(gw: Gateway) -> None:
    """`validation.unknown_fields: reject` refuses a field the gateway does not know,
    400 naming it (docs/operations/deployment.md), as chat completions do here;
    /v1/embeddings accepts it."""
    chat = {"model": "cheap", "messages": [{"role": "user", "content": "hi"}], "bogus_field": 1}
    _refused(gw.post("/v1/chat/completions", json=chat), 400)  # the policy is on
    err = _refused(_embed(gw, input="hello", bogus_field=1), 400)
    assert err["param"] == "bogus_field", err


@pytest.mark.parametrize(
    "body",
    [{"input": f"please write to {EMAIL} today"}, {"input": "hello", "user": EMAIL}],
    ids=["input", "user"],
)
def test_pii_block_refuses_an_embeddings_request_holding_pii(
    gw: Gateway, body: dict[str, Any]
) -> None:
    """Under `pii.mode: block` a request containing PII is refused 400 `pii_detected`
    (config/policy.py PiiConfig), as chat is here; an embeddings request holding an
    e-mail address in its input or its `user` is embedded and answered 200."""
    chat = {"model": "cheap", "messages": [{"role": "user", "content": body["input"]}]}
    if "user" in body:
        chat["user"] = body["user"]
    _refused(gw.post("/v1/chat/completions", json=chat), 400, "pii_detected")
    _refused(_embed(gw, **body), 400, "pii_detected")


@pytest.mark.parametrize(
    "user", ["end-user\nCRITICAL switchyard: forged", "u" * 513], ids=["control", "long"]
)
def test_the_embeddings_user_is_held_to_the_end_user_id_rules(gw: Gateway, user: str) -> None:
    """`user` is an end user's id: at most 512 characters and no control characters,
    400 naming it on chat and completions (policy/validate.py `_sampling`); on
    /v1/embeddings any string passes."""
    done = gw.post("/v1/completions", json={"model": "cheap", "prompt": "hi", "user": user})
    _refused(done, 400)
    err = _refused(_embed(gw, input="hello", user=user), 400)
    assert err["param"] == "user", err


@pytest.mark.parametrize("inp", ["", [""], ["a text", ""]], ids=["string", "list", "one-of-two"])
def test_an_empty_input_text_is_refused_not_billed(gw: Gateway, inp: Any) -> None:
    """The OpenAI API refuses an empty input text (400 on `input`); the gateway embeds
    it and bills the two tokens the tokenizer adds."""
    tenant, key = gw.new_tenant("s70b-empty")
    r = _embed(gw, key, input=inp)
    rows = gw.stored_rows(tenant)
    assert r.status_code == 400, (r.status_code, [row["cost_usd"] for row in rows])
    assert r.json()["error"]["param"] == "input"
    assert rows and rows[0]["cost_usd"] == 0, rows


# -- identifiers at rest ---------------------------------------------------------------


def _secret() -> str:
    """An API key's shape (the PII detector masks it in text), fresh for each test."""
    return "sk-proj-" + os.urandom(16).hex()


@pytest.mark.parametrize(
    "header", ["x-request-id", "x-task-id", "x-parent-request-id", "Idempotency-Key"]
)
def test_a_credential_sent_as_an_id_header_is_not_kept_raw(gw: Gateway, header: str) -> None:
    """A key pasted into an id header (each takes 1-128 of A-Z a-z 0-9 . _ : -, which an
    API key fits) is kept as sent in the usage row, the trace or the idempotency table:
    the raw key sits in the gateway's SQLite files, as a key sent as `model` no longer
    does. It may be refused, hashed or masked; it may not be stored raw."""
    tenant, key = gw.new_tenant("s70b-id")
    secret = _secret()
    headers = {header: secret}
    if header == "x-parent-request-id":
        headers["x-task-id"] = "s70b-task"
    body = {"model": "cheap", "prompt": "Say hello", "max_tokens": 4}
    r = gw.post("/v1/completions", key=key, json=body, headers=headers)
    assert r.status_code in (200, 400), r.text[:300]
    assert gw.stored_rows(tenant), "the request's usage row was never written"
    gw.trace(r.headers["x-request-id"])  # the trace is written too
    files = [Path(gw.db + suffix) for suffix in ("", "-wal", "-shm")]
    holding = [f.name for f in files if f.exists() and secret.encode() in f.read_bytes()]
    assert not holding, f"the raw key sent as {header} is in {holding}"


# -- PII in the fields policy/pii.py does not read -------------------------------------

SCHEMA = {"name": "contact", "schema": {"type": "object", "description": f"reply to {EMAIL}"}}
# Fields that reach the upstream besides those masked and checked today (test_hostile_s67c
# covers `suffix`, `prediction`, `metadata`, ...): (endpoint, fields). A completion's
# `messages` and `tools` and a chat's `prompt` are kept in `extra` and forwarded as sent
# (api/codecs.py: "read by no stage").
UNREAD: dict[str, tuple[str, dict[str, Any]]] = {
    "chat-stop": ("/v1/chat/completions", {"stop": [f"Regards, {EMAIL}"]}),
    "completion-stop": ("/v1/completions", {"stop": f"Regards, {EMAIL}"}),
    "response-format": ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": SCHEMA}}),
    "web-search-location": (
        "/v1/chat/completions",
        {"web_search_options": {"user_location": {"type": "approximate", "approximate": {"city": EMAIL}}}},
    ),
    "completion-messages": ("/v1/completions", {"messages": [{"role": "user", "content": f"mail {EMAIL}"}]}),
    "completion-tools": (
        "/v1/completions",
        {"tools": [{"type": "function", "function": {"name": "mail", "description": f"to {EMAIL}"}}]},
    ),
    "chat-prompt": ("/v1/chat/completions", {"prompt": f"mail {EMAIL}"}),
}  # fmt: skip


def _sent_upstream(gw: Gateway, scripted: Scripted, shape: str) -> tuple[httpx.Response, Any]:
    """Send one UNREAD shape with a marker of its own in the prompt or message: (the
    reply, the body the upstream received for it, or None when it received none)."""
    path, fields = UNREAD[shape]
    marker = f"s70b-{shape}-{os.urandom(4).hex()}"
    body: dict[str, Any] = {"model": "cheap", "max_tokens": 4, **fields}
    if path == "/v1/completions":
        body["prompt"] = marker
    else:
        body["messages"] = [{"role": "user", "content": marker}]
    r = gw.post(path, json=body, headers={"Cache-Control": "no-store"})
    last = httpx.get(scripted.url + "/control/last").json().get("body")
    return r, last if marker in json.dumps(last) else None


@pytest.mark.parametrize("shape", list(UNREAD))
def test_mask_upstream_sends_no_raw_pii_in_the_fields_it_does_not_read(
    masked: Gateway, scripted: Scripted, shape: str
) -> None:
    """`mask_upstream`: no raw PII reaches the upstream, whichever field carries it.
    policy/pii.py `mask_request` reads a fixed list of fields: stop sequences, a
    `response_format` schema, `web_search_options` and the other protocol's fields a
    body may carry (forwarded as sent under `unknown_fields: pass`) reach it raw."""
    r, sent = _sent_upstream(masked, scripted, shape)
    if sent is None:
        _refused(r, 400)
    else:
        assert EMAIL not in json.dumps(sent), sent


@pytest.mark.parametrize(
    "shape", ["chat-stop", "completion-stop", "response-format", "web-search-location"]
)
def test_block_refuses_pii_in_the_fields_it_does_not_read(
    gw: Gateway, scripted: Scripted, shape: str
) -> None:
    """`block`: a request with PII is refused before the upstream, wherever it is. The
    detection reads the fields `mask_request` masks, so an e-mail address in a stop
    sequence, a schema's description or a search location goes upstream."""
    r, sent = _sent_upstream(gw, scripted, shape)
    assert sent is None or EMAIL not in json.dumps(sent), sent
    _refused(r, 400, "pii_detected")


# -- the local engine's own fields -------------------------------------------------------


@pytest.fixture(scope="module")
def smol() -> Iterator[Gateway]:
    """The managed llama-server (SmolLM2 from its wheel) at $1000 per million output
    tokens: 10 tokens cost $0.01."""
    model = {**local_model("smol"), "price": {"input": 0.0, "output": 1000.0}}
    g = start_gateway({"models": [model], "embeddings": {"enabled": False}})
    yield g
    g.proc.stop()


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_n_predict_never_lifts_the_cap_past_the_budget(smol: Gateway, path: str) -> None:
    """llama-server reads `n_predict` before `max_tokens`: a client that adds
    `n_predict: 64` to `max_tokens: 4` is generated 64 tokens and billed $0.064 on a
    $0.01 budget. The gateway refuses llama-server's own `lora`, `verbose` and
    `return_tokens` (policy/validate.py `_OTHER`) but forwards `n_predict` as sent, past
    the cap admission reserved and the budget allowed."""
    tenant, key = smol.new_tenant("s70b-npredict", budget_usd=0.01)
    body: dict[str, Any] = {"model": "smol", "max_tokens": 4, "temperature": 0, "n_predict": 64}
    if path == "/v1/completions":
        body["prompt"] = "One, two, three,"
    else:
        body["messages"] = [{"role": "user", "content": "Count from one to fifty in words."}]
    r = smol.post(path, key=key, json=body)
    spent = sum(row["cost_usd"] for row in smol.stored_rows(tenant))
    if r.status_code == 200:
        assert r.json()["usage"]["completion_tokens"] <= 4, (r.json()["usage"], spent)
    else:
        _refused(r, 400)
    assert spent <= 0.01, f"${spent} spent on a $0.01 budget"


def test_n_cmpl_makes_no_more_choices_than_were_reserved(smol: Gateway) -> None:
    """llama-server's `n_cmpl` asks for several completions, as `n` does; the gateway
    reserves and bounds `n` and `best_of` only (policy/cost.py `sequences`), forwards
    `n_cmpl` as sent, and the engine's usage counts one choice: four choices are
    generated and one is billed."""
    tenant, key = smol.new_tenant("s70b-ncmpl")
    body = {"model": "smol", "prompt": "One, two, three,", "max_tokens": 4, "n_cmpl": 4}
    r = smol.post("/v1/completions", key=key, json=body)
    if r.status_code != 200:
        _refused(r, 400)
        return
    choices = r.json()["choices"]
    rows = smol.stored_rows(tenant)
    assert len(choices) == 1, (
        len(choices),
        r.json()["usage"],
        [row["output_tokens"] for row in rows],
    )


CHOICES = {
    "two-token-prompts": ("/v1/completions", {"prompt": [[1, 2], [3]]}),
    "two-prompts-n2": ("/v1/completions", {"prompt": ["One,", "Two,"], "n": 2}),
    "completion-n3": ("/v1/completions", {"prompt": "One,", "n": 3}),
    "chat-n3": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "n": 3}),
}


@pytest.mark.parametrize("shape", list(CHOICES))
def test_every_choice_of_a_reply_is_billed(smol: Gateway, shape: str) -> None:
    """A request for several choices (prompts, or `n`) is reserved for every choice
    (policy/cost.py `sequences`), but llama-server's usage counts one choice, and
    settle.py `Settler._charge` bills the count as reported: four choices that each ran
    to the 3-token cap (12 tokens at least) are billed 3."""
    path, fields = CHOICES[shape]
    tenant, key = smol.new_tenant("s70b-choices")
    body = {"model": "smol", "max_tokens": 3, "temperature": 0, **fields}
    r = smol.post(path, key=key, json=body)
    if r.status_code != 200:
        _refused(r, 400)
        return
    capped = [c for c in r.json()["choices"] if c["finish_reason"] == "length"]
    rows = smol.stored_rows(tenant)
    assert rows, "no usage row"
    billed = rows[0]["output_tokens"]
    assert billed >= 3 * len(capped), (
        f"{len(capped)} choices ran to the 3-token cap; {billed} tokens billed",
        r.json()["usage"],
    )


STREAMED = {
    "chat-n3": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "n": 3}),
    "completion-n2": ("/v1/completions", {"prompt": "One, two,", "n": 2}),
}


@pytest.mark.parametrize("shape", list(STREAMED))
def test_every_choice_of_a_stream_is_billed(smol: Gateway, shape: str) -> None:
    """The streamed form of the test above: each choice whose stream ends with `length`
    wrote the 3-token cap, whatever the engine's usage (one choice) says."""
    path, fields = STREAMED[shape]
    tenant, key = smol.new_tenant("s71-streamed")
    body = {"model": "smol", "max_tokens": 3, "temperature": 0, "stream": True, **fields}
    headers = {"Authorization": f"Bearer {key}"}
    capped: set[int] = set()
    with httpx.stream("POST", smol.url + path, json=body, headers=headers, timeout=60) as r:
        assert r.status_code == 200, r.read()[:300]
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for c in json.loads(line[6:]).get("choices") or []:
                if c.get("finish_reason") == "length":
                    capped.add(c["index"])
    assert len(capped) >= 2, f"the engine cut {sorted(capped)} at the cap"
    rows = smol.stored_rows(tenant)
    billed = rows[0]["output_tokens"]
    assert billed >= 3 * len(capped), f"{len(capped)} streams cut at 3 tokens; {billed} billed"
