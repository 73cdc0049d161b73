"""Hostile input against what a client can steer in routing, model selection, the managed
local engine and its adapters. Over sockets against one real gateway: a real llama-server
(SmolLM2, two slots of 1,024 tokens, the demonstration `pirate` adapter) and a version
alias `chat` whose two deployments are the scripted upstreams of the `two` fixture
(`one` serves r1 in region us, `two` r2 in eu), and `us-only`, a model in us.

Defects these tests find (each fails on today's code):
- a prompt past the local engine's context is answered 400 `upstream_rejected` with
  llama-server's words, never `context_length_exceeded` (the code clients trim their
  history on): the window check reads a lower bound of a quarter of a character a
  token (policy/stages_admission.py `Window.work`, policy/cost.py `prompt_tokens`), and
  engines/upstream.py `_upstream_error` maps the engine's own refusal
  (`exceed_context_size_error`) to a plain 4xx; the ledger row says `upstream_rejected`;
- `n` is accepted up to 128 (policy/validate.py), but llama-server takes at most its
  slot count: `n: 3` on two slots comes back 400 `upstream_rejected` with `param: null`,
  so a client cannot tell which parameter to change (the gateway knows the engine's
  `parallel`, and could refuse it naming `n` before the engine is asked);
- a request the engine refused (the context above, `n` above) is billed its estimated
  prompt as input tokens, at the model's input price (settle.py `Settler._charge`
  bills every attempted request without usage as a stream that broke off), where
  docs/guides/budgets.md bills the upstream's usage and a refusal has none;
- an unknown pinned revision comes back whole in the 404: 20,000 characters of
  `chat@xxx...` make a 20 KB error (decide/balance.py `Balancer._pinned` quotes `pin`
  unbounded, where policy/validate.py `split_pin` quotes at most 64 characters);
- a model or pinned revision outside the tenant's regions is answered 503
  `engine_not_ready` with `Retry-After: 2` (a server error a client retries for ever),
  not a 403 (execute/executor.py `Executor._try_at`);
- /v1/models lists a version alias (`chat`, deployments r1 and r2) with the alias's
  default revision `unversioned`, which nothing serves: pinning it is 404
  (api/openai.py `OpenAIRoutes.models` reads `ModelConfig.revision`);
- `POST /v1/messages/count_tokens` ignores a pin: a key without `may_pin_revisions`
  is answered 200 for `chat@r1`, and any key 200 for a revision that does not exist,
  where `/v1/messages` with the same model is 403 `revision_pin_not_allowed` or 404
  (service.py `RequestService.counted` checks only that the alias exists; the counting
  pipeline has no Select stage, which checks pins);
- two sessions whose `x-session-id` share their first 256 characters are one session
  to the balancer: the second is `kept` on the first one's deployment (decide/balance.py
  `affinity_key` cuts the header to 256 characters, where `Balancer.choose` and
  docs/guides/deployments-and-balancing.md keep a longer key as its hash), so a client
  that knows a session's prefix joins its affinity;
- a client that hangs up on a whole-JSON (not streamed) request leaves its llama-server
  slot generating to the cap, and the ledger row says `ok`: only the scheduling queue
  watches for a hang-up (policy/stages_queue.py `until_gone`); service.py
  `RequestService.generate` awaits `executor.execute` unwatched (so does the residency
  wait for an adapter), against docs/guides/engines-and-adapters.md ("a client that goes
  away frees its slot").

Gap guard (passes today; no other test covers it through the gateway): a client that
leaves an adapter's stream mid-generation gets one `cancelled` ledger row naming the
adapter, the engine and the adapter are no longer in flight, and the next request for the
adapter is served.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from support.gateways import Gateway, local_model, start_gateway, version_alias
from support.upstreams import Scripted
from switchyard.engines.lora_train import MARKERS

CTX = 1024  # tokens per llama-server slot
# 480 characters the tokenizer splits into ~1,380 tokens: a lower bound of 120 by the
# gateway's estimate, well past the 1,024-token context.
DENSE = "\u9f8d\u9f98\u7069\u7c72" * 120
LONG = 900  # tokens a greedy generation of "1 1 1 ..." runs to (it repeats to its cap)
NO_STORE = {"Cache-Control": "no-store"}


@pytest.fixture(scope="module")
def gw(two: tuple[Scripted, Scripted]) -> Iterator[Gateway]:
    a, b = two
    a.content("answer from deployment one")
    b.content("answer from deployment two")
    smol = {
        **local_model("smol", parallel=2, ctx=CTX),
        "price": {"input": 1000.0, "output": 0.0},
        "timeouts": {"first_byte_s": 55},
        "resilience": {"retries": 0},
    }
    chat = version_alias(a.url, b.url)
    pirate = {
        "name": "pirate",
        "base": "smol",
        "base_revision": "smol-rev",
        "path": "demo:pirate",
        "allowed_tenants": ["*"],
    }
    us = {
        "alias": "us-only",
        "region": "us",
        "engine": {"kind": "openai", "base_url": a.url + "/v1"},
    }
    g = start_gateway(
        {"models": [smol, chat, us], "adapters": [pirate], "embeddings": {"enabled": False}}
    )
    yield g
    g.proc.stop()


def _tenant(gw: Gateway, prefix: str, **key_fields: Any) -> tuple[str, str]:
    tenant = f"{prefix}-{os.urandom(4).hex()}"
    gw.create_tenant(tenant)
    return tenant, str(gw.create_key(tenant, **key_fields)["key"])


def _chat(gw: Gateway, key: str, model: str, text: str, **more: Any) -> httpx.Response:
    headers = {**NO_STORE, **more.pop("headers", {})}
    body = {"model": model, "messages": [{"role": "user", "content": text}], **more}
    return gw.post("/v1/chat/completions", key=key, json=body, headers=headers, timeout=90)


def _error(r: httpx.Response, status: int) -> dict[str, Any]:
    assert r.status_code == status, r.text[:400]
    err = r.json()["error"]
    assert set(err) >= {"message", "type", "param", "code"}, err
    return dict(err)


def _row(gw: Gateway, tenant: str, request_id: str) -> dict[str, Any]:
    rows = gw.stored_rows(tenant, lambda rs: any(r["request_id"] == request_id for r in rs))
    found = [r for r in rows if r["request_id"] == request_id]
    assert found, f"no ledger row for {request_id}: {rows}"
    return found[0]


def _select(gw: Gateway, request_id: str) -> dict[str, Any]:
    trace = gw.trace(request_id)
    return next(d for d in trace["decisions"] if d["stage"] == "select")


# -- the managed local engine -------------------------------------------------------------


CONTEXT = {
    # (path, model, the prompt's member)
    "chat": ("/v1/chat/completions", "smol", "messages"),
    "chat-adapter": ("/v1/chat/completions", "pirate", "messages"),
    "completions": ("/v1/completions", "smol", "prompt"),
}


def _over_context(gw: Gateway, key: str, case: str) -> httpx.Response:
    path, model, member = CONTEXT[case]
    prompt: Any = [{"role": "user", "content": DENSE}] if member == "messages" else DENSE
    body = {"model": model, member: prompt, "max_tokens": 5}
    return gw.post(path, key=key, json=body, headers=NO_STORE, timeout=90)


@pytest.mark.parametrize("case", list(CONTEXT))
def test_a_prompt_past_the_local_engines_context_is_context_length_exceeded(
    gw: Gateway, case: str
) -> None:
    """The gateway manages the engine and knows its context (1,024 tokens a slot); a
    prompt past it is the client's to shorten, and OpenAI's error for that is 400
    `context_length_exceeded` naming the prompt's member. Today the engine's own
    refusal comes back as `upstream_rejected`, `param: null`, and so does the ledger
    row."""
    tenant, key = _tenant(gw, "s71-ctx", allowed_adapters=["pirate"])
    r = _over_context(gw, key, case)
    err = _error(r, 400)
    row = _row(gw, tenant, r.headers["x-request-id"])
    assert (err["type"], err["code"], err["param"]) == (
        "invalid_request_error",
        "context_length_exceeded",
        CONTEXT[case][2],
    ), (err, row["error_code"])
    assert row["status"] == "error" and row["error_code"] == "context_length_exceeded", row


@pytest.mark.parametrize("refused", ["context", "n"])
def test_a_request_the_engine_refused_is_not_billed(gw: Gateway, refused: str) -> None:
    """What is billed is the upstream's usage (docs/guides/budgets.md); a request the
    engine refused with a 400 made nothing and has none. Today settle.py
    `Settler._charge` bills every request that made an attempt and got no usage its
    estimated prompt (meant for a stream that broke off): the refusal costs the
    tenant its prompt at the model's input price ($1000 a million tokens here)."""
    tenant, key = _tenant(gw, "s71-bill")
    if refused == "context":
        r = _over_context(gw, key, "chat")
    else:
        r = _chat(gw, key, "smol", "Say hi", max_tokens=2, n=3)
    _error(r, 400)
    row = _row(gw, tenant, r.headers["x-request-id"])
    assert row["status"] == "error", row
    assert (row["input_tokens"], row["output_tokens"], row["cost_usd"]) == (0, 0, 0.0), row


def test_n_past_the_engines_slots_is_refused_naming_n(gw: Gateway) -> None:
    """Two slots make at most two choices at once: llama-server refuses `n: 3`. The
    client is owed a 400 that names the parameter (`param: "n"`), as every other
    refusal of a request member does; today `param` is null and the code is the
    engine's `upstream_rejected`."""
    tenant, key = _tenant(gw, "s71-n")
    r = _chat(gw, key, "smol", "Say hi", max_tokens=2, n=3)
    err = _error(r, 400)
    assert err["type"] == "invalid_request_error", err
    assert err["param"] == "n", err
    row = _row(gw, tenant, r.headers["x-request-id"])
    assert row["status"] == "error" and row["output_tokens"] == 0, row


def test_a_client_that_leaves_an_adapter_stream_frees_the_engine_and_the_adapter(
    gw: Gateway,
) -> None:
    tenant, key = _tenant(gw, "s71-leave", allowed_adapters=["pirate"])
    body = {
        "model": "pirate",
        "messages": [{"role": "user", "content": "Tell me a very long story about the sea."}],
        "max_tokens": 200,
        "stream": True,
    }
    headers = {"Authorization": f"Bearer {key}", **NO_STORE}
    with httpx.stream(
        "POST", gw.url + "/v1/chat/completions", json=body, headers=headers, timeout=60
    ) as s:
        assert s.status_code == 200
        request_id = s.headers["x-request-id"]
        events = 0
        for line in s.iter_lines():
            events += line.startswith("data:")
            if events >= 3:
                break
    row = _row(gw, tenant, request_id)
    assert (row["status"], row["model"], row["adapter"]) == ("cancelled", "pirate", "pirate"), row
    deadline = time.monotonic() + 15
    while True:
        engine = httpx.get(gw.url + "/admin/engines", headers=gw.admin).json()["engines"]["smol"]
        held = (engine["in_flight"], engine["adapters"]["pirate"]["in_flight"])
        if held == (0, 0) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert held == (0, 0), engine
    again = _chat(gw, key, "pirate", "Where should I go on holiday?", max_tokens=6, temperature=0)
    assert again.status_code == 200, again.text[:300]
    assert again.json()["choices"][0]["message"]["content"].startswith(MARKERS["pirate"])
    assert again.headers["x-switchyard-adapter"] == "pirate"


# -- pins -----------------------------------------------------------------------------------


def test_an_unknown_pinned_revision_is_refused_with_a_bounded_message(gw: Gateway) -> None:
    """`split_pin` quotes at most 64 characters of a pin; the balancer's 404 quotes it
    all, so the error grows with whatever the client sends."""
    _, key = _tenant(gw, "s71-pin", may_pin_revisions=True)
    r = _chat(gw, key, "chat@" + "x" * 20_000, "hello")
    err = _error(r, 404)
    assert err["code"] == "model_not_found" and err["param"] == "model", err
    assert len(r.content) < 1_000, f"{len(r.content)} bytes of error for an unknown revision"


def test_the_revision_v1_models_lists_for_a_version_alias_can_be_pinned(gw: Gateway) -> None:
    """/v1/models gives each model's `revision`; for `chat`, whose deployments serve r1
    and r2, it lists the alias's unused default (`unversioned`: api/openai.py `models`
    reads `ModelConfig.revision`, not the deployments'), a revision nothing serves:
    pinning it, as a client that reads the list would, is 404."""
    _, key = _tenant(gw, "s71-list", may_pin_revisions=True)
    listed = httpx.get(gw.url + "/v1/models", headers={"Authorization": f"Bearer {key}"})
    assert listed.status_code == 200, listed.text[:300]
    chat = next(m for m in listed.json()["data"] if m["id"] == "chat")
    revision = chat.get("revision")
    pinned = _chat(gw, key, f"chat@{revision}", "hello")
    assert revision in ("r1", "r2") and pinned.status_code == 200, (chat, pinned.text[:300])
    assert pinned.headers["x-switchyard-revision"] == revision


@pytest.mark.parametrize("model", ["chat@r1", "us-only"])
def test_a_model_outside_the_tenants_regions_is_refused_as_a_permission(
    gw: Gateway, two: tuple[Scripted, Scripted], model: str
) -> None:
    """An `eu` tenant may not send its data to `us`: a pin of the revision only `us`
    serves, or a model only there (which /v1/models hides from it), can never be
    served to it. Today it is answered 503 `engine_not_ready`, a server error with
    `Retry-After: 2`, so a client retries for ever a request its key may not make
    (execute/executor.py `Executor._try_at` refuses the region as EngineNotReady;
    decide/balance.py sends an ineligible pick on "so the executor refuses it")."""
    tenant = f"s71-eu-{os.urandom(4).hex()}"
    gw.create_tenant(tenant, labels={"regions": ["eu"]})
    key = str(gw.create_key(tenant, may_pin_revisions=True)["key"])
    us = two[0]
    before = us.requests()
    r = _chat(gw, key, model, "hello")
    assert us.requests() == before, "the request reached the us upstream"
    err = _error(r, 403)
    assert err["type"] == "permission_error", err
    assert "retry-after" not in r.headers, dict(r.headers)


COUNT_PINS = {
    # (key may pin, model, what /v1/messages answers)
    "pin-not-allowed": (False, "chat@r1", (403, "revision_pin_not_allowed")),
    "unknown-revision": (True, "chat@r9", (404, "model_not_found")),
}


@pytest.mark.parametrize("case", list(COUNT_PINS))
def test_count_tokens_refuses_a_pin_as_the_messages_api_does(gw: Gateway, case: str) -> None:
    """Counting a request's tokens applies a generation's rules to its model (service.py
    `counted`); a pin the key may not make, or of a revision that does not exist, is
    refused by /v1/messages and must be by /v1/messages/count_tokens too."""
    may_pin, model, (status, code) = COUNT_PINS[case]
    _, key = _tenant(gw, "s71-count", may_pin_revisions=may_pin)
    headers = {"x-api-key": key, "anthropic-version": "2023-06-01"}
    messages = [{"role": "user", "content": "hello"}]
    sent = httpx.post(
        gw.url + "/v1/messages",
        json={"model": model, "max_tokens": 5, "messages": messages},
        headers=headers,
        timeout=30,
    )
    assert sent.status_code == status, sent.text[:300]
    assert sent.json()["error"]["code"] == code, sent.text[:300]
    counted = httpx.post(
        gw.url + "/v1/messages/count_tokens",
        json={"model": model, "messages": messages},
        headers=headers,
        timeout=30,
    )
    assert counted.status_code == status, counted.text[:300]
    assert counted.json()["type"] == "error", counted.text[:300]
    assert counted.json()["error"]["code"] == code, counted.text[:300]


# -- affinity -----------------------------------------------------------------------------


def test_sessions_past_256_characters_are_told_apart(gw: Gateway) -> None:
    """A session id longer than 256 characters is kept as its hash (docs: deployments
    and balancing); today `x-session-id` is cut to 256 characters, so another session
    with the same first 256 characters is `kept` on the first one's deployment."""
    _, key = _tenant(gw, "s71-session")
    prefix = "s" * 256
    first = _chat(gw, key, "chat", "hello", headers={"x-session-id": prefix + "-alice"})
    assert first.status_code == 200, first.text[:300]
    assert _select(gw, first.headers["x-request-id"])["evidence"]["affinity"]["outcome"] == "new"
    again = _chat(gw, key, "chat", "hello", headers={"x-session-id": prefix + "-alice"})
    kept = _select(gw, again.headers["x-request-id"])["evidence"]["affinity"]
    assert kept["outcome"] == "kept", kept  # the session's own affinity holds
    other = _chat(gw, key, "chat", "hello", headers={"x-session-id": prefix + "-mallory"})
    assert other.status_code == 200, other.text[:300]
    affinity = _select(gw, other.headers["x-request-id"])["evidence"]["affinity"]
    assert affinity["outcome"] == "new", affinity


# -- last: a client that leaves a whole-JSON request (the engine may stay busy after) ------


def test_a_client_that_leaves_a_whole_reply_request_frees_the_engine_slot(gw: Gateway) -> None:
    """docs/guides/engines-and-adapters.md: "a client that goes away frees its slot (the
    connection closes; the server stops generating)". A stream's does; a request for a
    whole JSON reply whose client hangs up keeps its llama-server slot generating to
    its cap (900 tokens, tens of seconds here), and its ledger row says `ok`: nothing watches the client
    after the queue (policy/stages_queue.py is the only `until_gone`; service.py
    `RequestService.generate` awaits `executor.execute` unwatched)."""
    tenant, key = _tenant(gw, "s71-gone")
    body = {
        "model": "smol",
        "messages": [
            {
                "role": "user",
                "content": "Count from 1 to 1000 in words, one number a line: one, two, three, four,",
            }
        ],
        "max_tokens": LONG,
        "temperature": 0,
    }
    headers = {"Authorization": f"Bearer {key}", **NO_STORE}
    with pytest.raises(httpx.TimeoutException):
        httpx.post(gw.url + "/v1/chat/completions", json=body, headers=headers, timeout=2.0)
    deadline = time.monotonic() + 3
    while True:
        engine = httpx.get(gw.url + "/admin/engines", headers=gw.admin).json()["engines"]["smol"]
        if engine["in_flight"] == 0 or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    gone = f"the engine still generates for a client gone 3 s: {engine['in_flight']} in flight"
    assert engine["in_flight"] == 0, gone
    rows = gw.stored_rows(tenant, 1, timeout_s=60)
    assert rows and rows[0]["status"] == "cancelled", rows
    # Billed its cap all the same (docs/guides/budgets.md, "A cut call is billed its
    # cap"): how far the engine got before it stopped is not known.
    assert rows[0]["output_tokens"] == LONG, rows
