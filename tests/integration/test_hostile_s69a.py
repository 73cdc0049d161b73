"""Hostile input against the response cache where it meets routing, revisions, canaries,
fallbacks and what an upstream may put in a reply. Over sockets against one real
gateway in front of three scripted upstreams (each answering its own text, so a reply
tells which one wrote it), a hostile upstream of tests/support/hostile_upstream.py and
a small upstream of this module's own that echoes the request into the reply fields
PII masking at rest does not read.

Defects these tests find (each fails on today's code):
- the cache partition keys the alias's configured revision and ignores a pinned one
  (decide/stages_cache.py `CachePlanner.plan` reads `ctx.alias` and `model.revision`,
  never `ctx.pin`): `chat@r2` is served the reply revision r1 wrote; and since a hit
  ends the request before selection, a pin the key may not make (403
  `revision_pin_not_allowed`) or of a revision that does not exist (404) is answered
  200 from the cache (decide/stages_select.py `Select._balance` and
  decide/balance.py `_pinned` never run);
- an entry is keyed by what was asked, not by what answered: a canary's reply stays
  served under the alias after a rollback took all its traffic away, and a fallback
  model's reply is served as the primary's to a key that may not use the fallback;
- the canary guard cuts a promoted canary (the only deployment with weight) to 0
  (decide/balance.py `_judge`), a state the weights API refuses; with no eligible
  deployment `Balancer.choose` sends every request to the first one listed, which may
  be the cut canary: the alias keeps failing while its stable revision is healthy;
- a cached completion is served in the chat shape: a stream hit is replayed as
  `chat.completion.chunk` events with `delta.content` (api/sse.py `replay`), and a
  streamed completion is stored as a `chat.completion` (decide/cacheability.py
  `assemble`), so a `/v1/completions` client reads no `text`;
- an attachment (`file`, `input_audio` part) of the last user message is in neither the
  partition nor the exact key (decide/cache.py `_text` reads text parts only, and
  decide/cacheability.py refuses images alone): another file with the same words is
  served the first file's answer;
- a reply cut short by the cap a budget shrank (policy/stages_admission.py shrinks
  `ctx.cost.cap`, which the partition does not read) is stored for the request as asked
  and served, cut, after the budget was raised;
- a stream's answer is stored as its `delta.content` alone and replayed so
  (decide/cacheability.py `assemble`, api/sse.py `replay`): a repeated stream that
  refused gets an empty answer ending `stop`, one that asked for `logprobs` none;
- a routed alias (`auto`) is authorized only after the route (decide/stages.py
  `Route.work` checks `may_use` on the routed model), which runs after the cache: a key
  that may not use the routed model is served that model's cached reply (where the same
  request without the cache is 403 `model_not_allowed`);
- a stream that carried an upstream `error` event before `[DONE]` is stored as a
  complete answer (decide/cacheability.py `assemble` skips the event, and
  reply.py `relay` counts the stream as complete): the truncated text is served to
  later requests;
- PII at rest: `at_rest` (policy/pii_reply.py `map_texts`) masks a reply's `content`,
  tool-call arguments and `text` only, so the raw values in `reasoning_content` or
  `refusal` are stored, and a later request of another user of the tenant whose
  masked message is the same is served the first user's e-mail address;
- a second `Cache-Control` header line is ignored (api/body.py `header_map` keeps the
  first of repeated names): `Cache-Control: max-age=0` then `Cache-Control: no-store`
  stores the reply (RFC 9110 5.3: the lines are one comma-separated list);
- `POST /admin/cache/invalidate` takes filters and `dry_run` of any JSON type
  (api/admin/cache.py `cache_invalidate`): `"dry_run": "false"` is read as true and
  removes nothing, `"tenant": 5` matches nothing, both answered 200.

Gaps guarded (pass today; no other test covers them): a reply cached from chat
completions is served to the Messages API in Anthropic's shape, while a Messages
request with another system prompt misses; an invalidation by tenant leaves every other
tenant's entries in place.
"""

from __future__ import annotations

import http.server
import json
import os
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from support.gateways import Gateway, start_gateway
from support.hostile_upstream import Hostile, hostile_upstream, sse_reply
from support.procs import http_server
from support.upstreams import Scripted

A_SAYS, B_SAYS, C_SAYS = "answer from upstream A", "answer from upstream B", "answer from C"
ALICE, BOB = "alice.one@example.com", "bob.two@example.com"
NO_STORE = {"Cache-Control": "no-store"}


def _event(data: bytes | dict[str, Any]) -> bytes:
    return b"data: " + (data if isinstance(data, bytes) else json.dumps(data).encode()) + b"\n\n"


# A stream the engine broke off with an error event, then ended as if complete.
ERROR_STREAM = sse_reply(
    _event(
        {
            "id": "e1",
            "object": "chat.completion.chunk",
            "created": 1,
            "model": "m",
            "choices": [
                {
                    "index": 0,
                    "delta": {"role": "assistant", "content": "The first half of"},
                    "finish_reason": None,
                }
            ],
        }
    ),
    _event({"error": {"message": "the engine ran out of memory", "type": "server_error"}}),
    _event(b"[DONE]"),
)


def _chunk(delta: dict[str, Any], finish: str | None = None, **more: Any) -> bytes:
    choice = {"index": 0, "delta": delta, "finish_reason": finish, **more}
    return _event({"id": "s1", "object": "chat.completion.chunk", "created": 1, "model": "m",
                   "choices": [choice]})  # fmt: skip


LOGPROBS = {"content": [{"token": "Paris", "logprob": -0.01, "bytes": [80, 97, 114, 105, 115]}]}
# Streams whose answer is more than `delta.content`: a refusal (structured outputs), and
# the log probabilities a request asked for.
SIDE_STREAMS = {
    "refusal-stream": sse_reply(
        _chunk({"role": "assistant", "refusal": "I can't help with that."}),
        _chunk({}, "stop"),
        _event(b"[DONE]"),
    ),
    "logprobs-stream": sse_reply(
        _chunk({"role": "assistant", "content": "Paris"}, logprobs=LOGPROBS),
        _chunk({}, "stop"),
        _event(b"[DONE]"),
    ),
}


class _Echo(http.server.BaseHTTPRequestHandler):
    """An engine that writes the request's last user message into the reply field the
    path names (`/<field>/v1/chat/completions`): a reasoning model's
    `reasoning_content`, or a `refusal`."""

    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: object) -> None:
        """Quiet."""

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)))
        said = next(m for m in reversed(body["messages"]) if m["role"] == "user")["content"]
        field = self.path.strip("/").split("/", 1)[0]
        message: dict[str, Any] = {"role": "assistant", "content": "Noted."}
        message[field] = f"The user wrote: {said}"
        if field == "refusal":
            message["content"] = None
        reply = {
            "id": "x1",
            "object": "chat.completion",
            "created": 1,
            "model": "m",
            "choices": [{"index": 0, "message": message, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 9, "completion_tokens": 9, "total_tokens": 18},
        }
        out = json.dumps(reply).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)


@pytest.fixture(scope="module")
def echo() -> Iterator[str]:
    with http_server(_Echo) as url:
        yield url


@pytest.fixture(scope="module")
def up() -> Iterator[Hostile]:
    with hostile_upstream({"errstream": ERROR_STREAM, **SIDE_STREAMS}) as hostile:
        yield hostile


def _openai(url: str, alias: str, revision: str, **more: Any) -> dict[str, Any]:
    return {
        "alias": alias,
        "revision": revision,
        "engine": {"kind": "openai", "base_url": url},
        "resilience": {"retries": 0},
        **more,
    }


@pytest.fixture(scope="module")
def gw(
    two: tuple[Scripted, Scripted], scripted: Scripted, up: Hostile, echo: str
) -> Iterator[Gateway]:
    a, b = two
    c = scripted
    for s, says in ((a, A_SAYS), (b, B_SAYS), (c, C_SAYS)):
        s.content(says)
        httpx.put(s.url + "/control/fault", json={"fault": None})  # none left over
    chat = {
        "alias": "chat",
        "revision": "r1",
        # The canary listed first: config order says nothing of which is the stable one.
        "deployments": [
            {
                "name": "canary",
                "revision": "r2",
                "canary": True,
                "weight": 0.0,
                "engine": {"kind": "openai", "base_url": b.url + "/v1"},
            },
            {"name": "stable", "revision": "r1", "engine": {"kind": "openai", "base_url": a.url + "/v1"}},
        ],
        "balance": {"strategy": "weighted", "affinity": False, "prefix_affinity": False},
        "canary_guard": {"max_error_rate": 0.2, "min_samples": 4, "window_s": 300},
        "resilience": {"retries": 0},
    }  # fmt: skip
    models = [
        chat,
        _openai(a.url + "/v1", "premium", "p1"),
        _openai(c.url + "/v1", "primary", "pr1", fallbacks=["backup"]),
        _openai(b.url + "/v1", "backup", "bk1"),
        _openai(c.url + "/v1", "cheap", "c1"),
        _openai(c.url + "/v1", "priced", "pc1", price={"input": 0.0, "output": 1000.0}),
        _openai(up.base_url("errstream"), "errstream", "e1"),
        *(_openai(up.base_url(name), name, "s1") for name in SIDE_STREAMS),
        _openai(f"{echo}/reasoning_content/v1", "reasoner", "rs1"),
        _openai(f"{echo}/refusal/v1", "refuser", "rf1"),
    ]
    g = start_gateway(
        {
            "models": models,
            # One route, also the default: `auto` is `premium` for every request.
            "router": {
                "enabled": True,
                "policy_version": "s69a",
                "default_route": "premium-route",
                "routes": [{"name": "premium-route", "model": "premium", "examples": ["poem"]}],
            },
            "cache": {"enabled": True, "semantic": False},
            # A budget may shrink a cap to 2 tokens (the scripted upstream writes 16).
            "policy": {"min_output_tokens": 2},
        }
    )
    yield g
    g.proc.stop()


def _chat(
    gw: Gateway,
    model: str,
    text: str,
    key: str | None = None,
    headers: Any = None,
    **fields: Any,
) -> httpx.Response:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": text}],
        "temperature": 0,
        "max_tokens": 8,
        **fields,
    }
    auth = [("Authorization", f"Bearer {key or gw.key}")]
    extra = list(headers.items()) if isinstance(headers, dict) else list(headers or [])
    return httpx.post(gw.url + "/v1/chat/completions", json=body, headers=auth + extra, timeout=30)


def _said(r: httpx.Response) -> str:
    assert r.status_code == 200, r.text
    return str(r.json()["choices"][0]["message"]["content"])


def _pinner(gw: Gateway) -> tuple[str, str]:
    tenant, _ = gw.new_tenant("s69a-pin")
    return tenant, str(gw.create_key(tenant, may_pin_revisions=True)["key"])


# -- revisions, canaries, fallbacks, routes ---------------------------------------------


def test_a_pinned_revision_is_never_served_another_revisions_reply(gw: Gateway) -> None:
    """The canary r2 has weight 0: only a pin reaches it. A key that may pin asks the
    alias (r1 answers, and its reply is cached), then pins r2: what r2 says is what it
    must get. Today the pin is not in the partition: r1's cached reply is served as
    r2's."""
    _, key = _pinner(gw)
    text = "Summarise the release notes of version two"
    assert _said(_chat(gw, "chat", text, key)) == A_SAYS
    pinned = _chat(gw, "chat@r2", text, key)
    assert pinned.headers.get("x-switchyard-cache") != "hit-exact", pinned.headers
    assert _said(pinned) == B_SAYS


@pytest.mark.parametrize(
    ("model", "may_pin", "status", "code"),
    [
        ("chat@r2", False, 403, "revision_pin_not_allowed"),
        ("chat@canary", False, 403, "revision_pin_not_allowed"),
        ("chat@r99", True, 404, "model_not_found"),
    ],
)
def test_a_pin_the_cache_could_answer_is_still_refused_as_without_it(
    gw: Gateway, model: str, may_pin: bool, status: int, code: str
) -> None:
    """A pin the key may not make is 403, one of a revision the alias does not have is
    404 (test_balance.py checks both without the cache). With an entry for the alias
    in the tenant's partition, the cache hit ends the request before selection looks
    at the pin: both are answered 200 with the cached reply."""
    tenant, key = gw.new_tenant("s69a-refuse")
    if may_pin:
        key = str(gw.create_key(tenant, may_pin_revisions=True)["key"])
    text = f"What changed between the revisions? ({model})"
    assert _said(_chat(gw, "chat", text, key)) == A_SAYS
    r = _chat(gw, model, text, key)
    assert r.status_code == status, (r.headers.get("x-switchyard-cache"), r.text)
    assert r.json()["error"]["code"] == code


def test_a_rolled_back_canarys_replies_are_not_served_after_the_rollback(
    gw: Gateway,
) -> None:
    """All traffic to the canary (r2), one reply from it, then a rollback: every
    request goes to the stable revision again. The canary's reply stays cached under
    the alias (keyed by the alias's configured revision, not the one that answered) and
    is served for the whole TTL: the rollback does not take r2's output away."""
    url = gw.url + "/admin/models/chat/weights"
    r = httpx.post(url, json={"weights": {"stable": 0, "canary": 1}}, headers=gw.admin)
    assert r.status_code == 200, r.text
    try:
        text = "Explain the new retry policy"
        first = _chat(gw, "chat", text)
        assert _said(first) == B_SAYS and first.headers["x-switchyard-revision"] == "r2"
    finally:
        back = httpx.post(gw.url + "/admin/models/chat/rollback", headers=gw.admin)
        assert back.status_code == 200 and back.json()["weights"]["canary"] == 0.0, back.text
    after = _chat(gw, "chat", text)
    assert _said(after) == A_SAYS, after.headers.get("x-switchyard-cache")


def _weights(gw: Gateway) -> dict[str, float]:
    r = httpx.get(gw.url + "/admin/models/chat/weights", headers=gw.admin)
    assert r.status_code == 200, r.text
    return dict(r.json()["weights"])


def test_the_canary_guard_never_leaves_a_promoted_alias_without_a_deployment(
    gw: Gateway, two: tuple[Scripted, Scripted]
) -> None:
    """After a promote (stable 0, canary 1) the canary fails: the guard cuts it to 0 and
    the alias has no deployment with weight left, a state the weights API refuses ("at
    least one deployment must keep a positive weight"; decide/balance.py `_judge` cuts
    whatever the others weigh). `Balancer.choose` then sends every request to the first
    deployment listed, here the cut canary itself: the alias keeps failing though its
    stable revision is healthy, as if the guard had never acted. A cut that leaves
    nothing must give the traffic back to the stable deployments, as a rollback does."""
    canary = two[1]
    promoted = httpx.post(gw.url + "/admin/models/chat/promote", headers=gw.admin)
    assert promoted.status_code == 200 and promoted.json()["weights"]["stable"] == 0.0
    try:
        canary.fault("status:500", count=1000)
        for i in range(20):
            if _weights(gw)["canary"] == 0.0:
                break
            r = _chat(gw, "chat", f"Failing canary request {i}", headers=NO_STORE)
            assert r.status_code >= 500, r.text
        assert _weights(gw)["canary"] == 0.0, "the guard never cut the failing canary"
        after = _chat(gw, "chat", "Is the alias still served?", headers=NO_STORE)
        assert after.status_code == 200, (_weights(gw), after.text)
        assert after.headers["x-switchyard-revision"] == "r1"
    finally:
        httpx.put(canary.url + "/control/fault", json={"fault": None})
        httpx.post(gw.url + "/admin/models/chat/rollback", headers=gw.admin)


def test_a_fallbacks_reply_is_not_served_as_the_primarys_to_a_key_barred_from_it(
    gw: Gateway, scripted: Scripted
) -> None:
    """The primary fails once and its fallback `backup` answers a key that may use
    both; the reply is cached under `primary`. A key of the same tenant allowed
    `primary` only asks the same once the primary is back: it is served backup's
    cached reply, from a model it may never use (executor.py checks `may_use` before a
    fallback; the cache never does)."""
    tenant, key = gw.new_tenant("s69a-fallback")
    barred = str(gw.create_key(tenant, allowed_models=["primary"])["key"])
    text = "Translate the onboarding guide"
    scripted.fault("status:500", count=1)
    first = _chat(gw, "primary", text, key)
    assert _said(first) == B_SAYS and "x-switchyard-fallback" in first.headers, first.headers
    again = _chat(gw, "primary", text, barred)
    assert _said(again) == C_SAYS, again.headers.get("x-switchyard-cache")


def test_a_routed_reply_is_not_served_to_a_key_that_may_not_use_the_routed_model(
    gw: Gateway,
) -> None:
    """`auto` routes to `premium`. A key allowed `auto` and `cheap` only is refused
    403 `model_not_allowed` for it (test_routing_gateway.py), unless a key of its
    tenant asked the same first: then it is served premium's cached reply."""
    tenant, key = gw.new_tenant("s69a-route")
    limited = str(gw.create_key(tenant, allowed_models=["auto", "cheap"])["key"])
    alone = _chat(gw, "auto", "Write a poem about harbours", limited)
    assert alone.status_code == 403 and alone.json()["error"]["code"] == "model_not_allowed"
    text = "Write a poem about lighthouses"
    first = _chat(gw, "auto", text, key)
    assert _said(first) == A_SAYS and first.headers["x-switchyard-model"] == "premium"
    r = _chat(gw, "auto", text, limited)
    assert r.status_code == 403, (r.headers.get("x-switchyard-cache"), r.text)
    assert r.json()["error"]["code"] == "model_not_allowed"


# -- what is stored ----------------------------------------------------------------------


def test_a_stream_broken_off_by_an_error_event_is_not_stored(gw: Gateway) -> None:
    """The engine streams half an answer, an `error` event and `[DONE]`. That is a
    failed generation: a later identical request must reach the engine again, not be
    served "The first half of" as a complete reply."""
    body = {
        "model": "errstream",
        "messages": [{"role": "user", "content": "Tell me the whole story"}],
        "temperature": 0,
        "max_tokens": 8,
        "stream": True,
    }
    rid = "errstream-" + os.urandom(4).hex()
    with gw.stream(body, headers={"x-client-request-id": rid}) as st:
        assert st.status_code == 200 and st.headers["x-switchyard-cache"] == "miss"
        text = st.read().decode()  # to its end: the reply side stores a stream once it is over
    assert '"error"' in text  # the client was told, as the engine sent it
    with gw.stream(body) as again:
        again.read()
        assert again.headers["x-switchyard-cache"] == "miss", again.headers
    # And the ledger says what it was: not a success.
    deadline = time.monotonic() + 10
    while not (rows := [r for r in gw.usage(limit=200) if r["client_request_id"] == rid]):
        assert time.monotonic() < deadline, "no usage row"
        time.sleep(0.1)
    assert (rows[0]["status"], rows[0]["error_code"]) == ("incomplete", "upstream_error")


def _side(gw: Gateway, body: dict[str, Any]) -> tuple[str, Any, Any]:
    """(x-switchyard-cache, the refusal text, the logprobs) a chat stream carried."""
    with gw.stream(body) as st:
        assert st.status_code == 200
        raw = st.read().decode()
        cache = st.headers["x-switchyard-cache"]
    chunks = [json.loads(e[6:]) for e in raw.split("\n\n") if e.startswith("data: {")]
    choices = [c["choices"][0] for c in chunks if c.get("choices")]
    refusal = "".join(str(c["delta"].get("refusal") or "") for c in choices)
    logprobs = [c["logprobs"] for c in choices if c.get("logprobs")]
    return cache, refusal, logprobs


@pytest.mark.parametrize("model", list(SIDE_STREAMS))
def test_a_stream_served_from_the_cache_carries_what_the_engines_stream_did(
    gw: Gateway, model: str
) -> None:
    """The same stream twice: the second is served from the cache and must carry what
    the first did. `assemble` keeps `delta.content` and tool calls only, and `replay`
    writes `delta.content` only: a refusal comes back as an empty answer that
    finished with `stop`, and the log probabilities the request asks for are gone."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": "What is the capital of France?"}],
        "temperature": 0,
        "max_tokens": 8,
        "stream": True,
        **({"logprobs": True} if model == "logprobs-stream" else {}),
    }
    cache, refusal, logprobs = _side(gw, body)
    assert cache == "miss" and (refusal or logprobs), (refusal, logprobs)
    cache, again_refusal, again_logprobs = _side(gw, body)
    assert (again_refusal, again_logprobs) == (refusal, logprobs), cache


@pytest.mark.parametrize(
    ("model", "field"), [("reasoner", "reasoning_content"), ("refuser", "refusal")]
)
def test_no_users_pii_reaches_another_user_through_an_unmasked_reply_field(
    gw: Gateway, model: str, field: str
) -> None:
    """Two users of one tenant send the same message with their own e-mail address
    (masked, the same exact key). The engine writes the message into `field`, which
    the cache stores raw: the second user is served the first user's address. Stored
    replies must be masked in every generated text (then the hit restores the second
    user's own address), or not stored."""
    tenant, first_key = gw.new_tenant("s69a-pii")
    second_key = str(gw.create_key(tenant)["key"])
    first = _chat(gw, model, f"Please confirm the address {ALICE}", first_key)
    assert first.status_code == 200 and ALICE in first.json()["choices"][0]["message"][field]
    second = _chat(gw, model, f"Please confirm the address {BOB}", second_key)
    assert second.status_code == 200, second.text
    assert ALICE not in second.text, (second.headers.get("x-switchyard-cache"), second.text)
    assert BOB in second.json()["choices"][0]["message"][field]


def test_a_reply_cut_short_by_a_budget_is_not_served_once_the_budget_allows_more(
    gw: Gateway, scripted: Scripted
) -> None:
    """A tenant with $0.005 left asks for 16 tokens ($0.016): the gateway shrinks the
    cap it sends to 5 (x-switchyard-max-tokens: 5; reason=budget) and the reply stops
    at `length`. The cap sent is not in the partition (policy/stages_admission.py
    shrinks `ctx.cost`, not the request the cache keys), so the cut reply is stored for
    the request as asked: once the budget is raised, the same request is served the
    5-token reply for the whole TTL instead of reaching the model."""
    tenant, key = gw.new_tenant("s69a-budget", budget_usd=0.005)
    scripted.content(None)  # the scripted words: as many as the cap lets through
    try:
        text = "Describe the billing cycle"
        cut = _chat(gw, "priced", text, key, max_tokens=16)
        assert cut.status_code == 200, cut.text
        assert cut.headers["x-switchyard-max-tokens"].endswith("; reason=budget"), cut.headers
        assert cut.json()["choices"][0]["finish_reason"] == "length"
        raised = httpx.patch(
            f"{gw.url}/admin/tenants/{tenant}", json={"budget_usd": 100}, headers=gw.admin
        )
        assert raised.status_code == 200, raised.text
        full = _chat(gw, "priced", text, key, max_tokens=16)
        assert full.status_code == 200, full.text
        assert full.headers["x-switchyard-cache"] == "miss", full.json()
        assert full.json()["choices"][0]["finish_reason"] == "stop"
    finally:
        scripted.content(C_SAYS)


def _completion_text(gw: Gateway, body: dict[str, Any]) -> tuple[str, str, dict[str, Any]]:
    """(the x-switchyard-cache header, the text, the last object) of a completion, as
    an OpenAI client of /v1/completions reads it: `choices[0].text` of a
    `text_completion`, whole or in the chunks of a stream."""
    if not body.get("stream"):
        r = gw.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        obj = r.json()
        assert obj.get("object") == "text_completion", obj
        return r.headers["x-switchyard-cache"], str(obj["choices"][0].get("text")), obj
    with gw.stream(body, path="/v1/completions") as st:
        assert st.status_code == 200
        raw = st.read().decode()
        cache = st.headers["x-switchyard-cache"]
    chunks = [json.loads(e[6:]) for e in raw.split("\n\n") if e.startswith("data: {")]
    assert chunks and all(c.get("object") == "text_completion" for c in chunks), chunks
    text = "".join(str(c["choices"][0].get("text") or "") for c in chunks if c.get("choices"))
    return cache, text, chunks[-1]


@pytest.mark.parametrize(
    "first_streams", [False, True], ids=["whole-then-stream", "stream-then-whole"]
)
def test_a_cached_completion_is_served_as_a_completion(gw: Gateway, first_streams: bool) -> None:
    """/v1/completions, once whole and once streamed (in either order): the second is a
    hit, and must be a `text_completion` with its `text`. A stream hit is replayed as
    `chat.completion.chunk` events with `delta.content` (api/sse.py `replay`), and a
    streamed completion is stored as a `chat.completion` with a `message`
    (decide/cacheability.py `assemble`): a completions client reads no text at all."""
    body = {
        "model": "cheap",
        "prompt": f"Complete the sentence ({first_streams}): the harbour at dawn is",
        "max_tokens": 8,
        "temperature": 0,
    }
    cache, text, _ = _completion_text(gw, {**body, "stream": first_streams})
    assert cache == "miss" and text, text
    cache, again, _ = _completion_text(gw, {**body, "stream": not first_streams})
    assert cache == "hit-exact"
    assert again == text


def _file(file_id: str) -> dict[str, Any]:
    return {"type": "file", "file": {"file_id": file_id}}


def _audio(data: str) -> dict[str, Any]:
    return {"type": "input_audio", "input_audio": {"data": data, "format": "wav"}}


@pytest.mark.parametrize(
    ("kind", "first", "second"),
    [
        ("file", _file("file-q3-report"), _file("file-q4-report")),
        ("input_audio", _audio("UklGRiQAAABXQVZFZm10IBAAAAAB"), _audio("UklGRiQAAABXQVZFZm10IBAAAAAC")),
    ],
)  # fmt: skip
def test_another_file_or_recording_in_the_last_message_is_not_served_the_cached_reply(
    gw: Gateway, kind: str, first: dict[str, Any], second: dict[str, Any]
) -> None:
    """ "Summarise the attached" with one file (or recording), then with another: the
    answer is about the attachment, but the exact key reads the last message's text
    parts only (decide/cache.py `_text`, `cache_keys`) and cacheability refuses images
    alone: the second attachment is served the first one's summary, within the tenant
    (another user's document)."""
    text = f"Summarise the attached {kind} in one line"

    def ask(part: dict[str, Any]) -> httpx.Response:
        content = [{"type": "text", "text": text}, part]
        return _chat(gw, "cheap", "", messages=[{"role": "user", "content": content}])

    assert _said(ask(first)) == C_SAYS
    other = ask(second)
    assert other.status_code == 200, other.text
    assert not other.headers["x-switchyard-cache"].startswith("hit"), other.headers


def test_no_store_on_a_repeated_cache_control_line_is_honoured(gw: Gateway) -> None:
    """`Cache-Control` is a list: two header lines are one comma-separated value (RFC
    9110 5.3), so `max-age=0` then `no-store` asks not to store. The gateway reads the
    first line only and stores the reply."""
    text = "Draft a reply to the complaint"
    lines = [("Cache-Control", "max-age=0"), ("Cache-Control", "no-store")]
    first = _chat(gw, "cheap", text, headers=lines)
    assert first.status_code == 200 and first.headers["x-switchyard-cache"] == "bypass"
    assert _chat(gw, "cheap", text).headers["x-switchyard-cache"] == "miss"


# -- the admin API -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "body",
    [
        {"tenant": "acme", "dry_run": "false"},
        {"tenant": "acme", "dry_run": 0.5},
        {"tenant": 5},
        {"model": ["cheap"]},
        {"tag": {"a": 1}},
    ],
)
def test_an_invalidation_with_a_field_of_the_wrong_type_is_a_400(
    gw: Gateway, body: dict[str, Any]
) -> None:
    """Filters are strings and `dry_run` a boolean. Today any JSON value passes:
    `"dry_run": "false"` is truthy and removes nothing (200), a number or list as a
    filter matches nothing (200): an operator's purge silently does nothing."""
    r = httpx.post(gw.url + "/admin/cache/invalidate", json=body, headers=gw.admin)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] in body, err


# -- gap guards ------------------------------------------------------------------------------


def test_a_chat_reply_is_served_to_messages_in_its_shape_and_a_system_prompt_partitions(
    gw: Gateway,
) -> None:
    """Gap guard: a hit across protocols answers in the asking protocol's shape with
    the cached text; a Messages request with a system prompt is another partition."""
    text = "Name the three primary colours"
    assert _said(_chat(gw, "cheap", text)) == C_SAYS
    messages = {
        "model": "cheap",
        "max_tokens": 8,
        "temperature": 0,
        "messages": [{"role": "user", "content": text}],
    }
    head = {"anthropic-version": "2023-06-01"}
    hit = gw.post("/v1/messages", json=messages, headers=head)
    assert hit.status_code == 200 and hit.headers["x-switchyard-cache"] == "hit-exact", hit.text
    body = hit.json()
    assert body["type"] == "message" and body["role"] == "assistant"
    assert body["content"] == [{"type": "text", "text": C_SAYS}]
    other = gw.post("/v1/messages", json={**messages, "system": "Answer in French."}, headers=head)
    assert other.status_code == 200 and other.headers["x-switchyard-cache"] == "miss"


def test_an_invalidation_by_tenant_leaves_other_tenants_entries(gw: Gateway) -> None:
    """Gap guard: test_cache.py checks that an invalidation removes the tenant's entries;
    here another tenant's entry for the same request still hits afterwards."""
    gone, gone_key = gw.new_tenant("s69a-inv")
    _, kept_key = gw.new_tenant("s69a-inv")
    text = "List the supported regions"
    for key in (gone_key, kept_key):
        assert _chat(gw, "cheap", text, key).headers["x-switchyard-cache"] == "miss"
    done = httpx.post(gw.url + "/admin/cache/invalidate", json={"tenant": gone}, headers=gw.admin)
    assert done.status_code == 200 and done.json()["removed"] == 1, done.text
    assert _chat(gw, "cheap", text, gone_key).headers["x-switchyard-cache"] == "miss"
    assert _chat(gw, "cheap", text, kept_key).headers["x-switchyard-cache"] == "hit-exact"
