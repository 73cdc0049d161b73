"""The gateway's own parts failing (s73): upstreams that die, hang or answer nonsense,
read through one real gateway over sockets by a chat, a Responses and a Messages client.
The upstream is tests/support/hostile_upstream.py, scripted per model.

Defects these tests find (each failed before its fix):
- a whole 200 reply with no choice 0 (`choices` empty, missing, or holding only
  index 1) was passed on as a success: the chat client got `200 {"choices": []}`,
  the ledger row `ok`, billed at the estimate (the upstream reported no usage) for an
  answer that never came, so a tenant's budget drained on replies that held nothing.
  It is now a broken reply (engines/upstream.py `post`): 502 `upstream_error` in each
  protocol's own error shape, an `error` row that bills nothing, the reservation given
  back (a follow-up request fits the budget);
- a local engine (llama-server) killed while it streams a reply ended the stream with
  a nameless `upstream llamacpp:<alias> broke the connection` (`upstream_error`, the
  row's too), while the same crash under a whole reply was `engine_crashed` naming the
  model. The stream now ends in the protocol's error event with `engine_crashed`,
  naming the model and that it restarts; the row says `engine_crashed`
  (engines/upstream.py `UpstreamStream.watch`, api/openai.py `watched`);
- a local engine that is alive but answers nothing (SIGSTOP: a stopped, deadlocked or
  swapped-out server) was never noticed: /readyz said `ready` for as long as it hung
  and every request waited out its own timeout (50 s, then 504). The supervisor now
  asks a serving worker for /health, and one silent for 12 s is killed and restarted
  as a crashed one is, with the reason in /admin/engines (engines/llamacpp.py `_serve`).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from support.chat_replies import chat_reply
from support.gateways import CHEAP_PRICE, Gateway, local_model, start_gateway
from support.hostile_upstream import Hostile, hostile_upstream, json_reply
from support.procs import wait_http, worker_pids
from support.stream_reads import sse_events

USAGE = {"prompt_tokens": 5, "completion_tokens": 4, "total_tokens": 9}
ANSWER = chat_reply("Paris", [], "stop", USAGE)
OTHER_ONLY = {**ANSWER, "choices": [{**ANSWER["choices"][0], "index": 1}]}
REPLIES = {
    "honest": json_reply(json.dumps(ANSWER).encode()),
    # A 200 that holds no answer: no choice at all, no `choices`, only choice 1.
    "nochoices": json_reply(json.dumps({**ANSWER, "choices": []}).encode()),
    "nokey": json_reply(json.dumps({"id": "c1", "object": "chat.completion"}).encode()),
    "otheronly": json_reply(json.dumps(OTHER_ONLY).encode()),
}
EMPTY = ("nochoices", "nokey", "otheronly")
LEAKS = ("Traceback", "OperationalError", "aiohttp", "orjson", "/tmp/", ".py")


@pytest.fixture(scope="module")
def up() -> Iterator[Hostile]:
    with hostile_upstream(REPLIES) as hostile:
        yield hostile


@pytest.fixture(scope="module")
def gw(up: Hostile) -> Iterator[Gateway]:
    models = up.models(REPLIES, CHEAP_PRICE)
    for m in models:  # each failure seen as it is, never hidden by an open circuit
        m["resilience"] = {"retries": 0, "breaker": {"failures": 1000}}
    g = start_gateway({"models": models, "embeddings": {"enabled": False}})
    yield g
    g.proc.stop()


def _call(gw: Gateway, key: str, protocol: str, model: str) -> httpx.Response:
    bodies: dict[str, tuple[str, dict[str, Any]]] = {
        "chat": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
        "responses": ("/v1/responses", {"input": "hi", "max_output_tokens": 40}),
        "messages": ("/v1/messages", {"messages": [{"role": "user", "content": "hi"}]}),
    }
    path, body = bodies[protocol]
    body = {"model": model, "max_tokens": 40, **body}
    if protocol == "responses":
        body.pop("max_tokens")
    return gw.post(path, key=key, json=body, timeout=20)


def _protocol_error(protocol: str, r: httpx.Response) -> tuple[int, str, str]:
    """(status, type, code) of an error reply in its protocol's own shape."""
    body = r.json()
    if protocol == "messages":
        assert body["type"] == "error" and set(body) == {"type", "error"}, body
    else:
        assert set(body) == {"error"}, body
    err = body["error"]
    assert not any(leak in err["message"] for leak in LEAKS), err
    return r.status_code, err["type"], err["code"]


@pytest.mark.parametrize("protocol", ["chat", "responses", "messages"])
@pytest.mark.parametrize("model", EMPTY)
def test_a_reply_with_no_choice_0_is_a_broken_reply(gw: Gateway, model: str, protocol: str) -> None:
    """A 200 with no answer in it is 502 `upstream_error` in the client's protocol, its
    row an `error` that bills nothing. Before: chat `200 {"choices": []}` billed at the
    estimate, an `ok` row."""
    tenant, key = gw.new_tenant("s73-empty")
    r = _call(gw, key, protocol, model)
    kind = "api_error" if protocol == "messages" else "upstream_error"
    assert _protocol_error(protocol, r) == (502, kind, "upstream_error"), r.text
    assert "no choice 0" in r.json()["error"]["message"]
    rows = gw.stored_rows(tenant)
    assert [(x["status"], x["error_code"], x["cost_usd"]) for x in rows] == [
        ("error", "upstream_error", 0.0)
    ], rows


def test_empty_replies_spend_none_of_the_budget(gw: Gateway) -> None:
    """A tenant whose budget pays for one answer: three empty replies in each protocol
    leave it whole, and the answer after them fits. Before: the first empty reply was
    billed at the estimate ($0.04 of $0.05) and the next request was refused 429."""
    tenant, key = gw.new_tenant("s73-budget", budget_usd=0.05)
    for protocol in ("chat", "responses", "messages"):
        for model in EMPTY:
            assert _call(gw, key, protocol, model).status_code == 502
    r = _call(gw, key, "chat", "honest")
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == "Paris"
    rows = gw.stored_rows(tenant, 10)
    assert sum(x["cost_usd"] for x in rows) == pytest.approx(0.004), rows  # 4 tokens


# -- a local engine killed mid-stream ------------------------------------------------------

LOCAL = "smollm2-135m"
STORY = "Write a long story about a lighthouse keeper."


@pytest.fixture(scope="module")
def local() -> Iterator[Gateway]:
    g = start_gateway({"models": [local_model(LOCAL)], "embeddings": {"enabled": False}})
    yield g
    g.proc.stop()


def _kill_mid_stream(gw: Gateway, key: str, path: str, body: dict[str, Any]) -> bytes:
    """A stream read until its first text, the engine's worker killed (SIGKILL), then
    read to its end: its bytes."""
    wait_http(gw.url + "/readyz", gw.proc, 120)  # a worker killed before is back
    (worker,) = worker_pids(gw.proc.popen.pid, b"llama-server")
    got = b""
    headers = {"Authorization": f"Bearer {key}"}
    with httpx.stream("POST", gw.url + path, json=body, headers=headers, timeout=60) as r:
        assert r.status_code == 200, r.read()[:400]
        for part in r.iter_bytes():
            if b"delta" in got + part and worker:
                os.kill(worker, signal.SIGKILL)
                worker = 0
            got += part
    assert worker == 0, got[:400]  # it was killed while the stream ran
    return got


@pytest.mark.parametrize("protocol", ["chat", "messages"])
def test_an_engine_killed_mid_stream_is_named(local: Gateway, protocol: str) -> None:
    """The stream's last event is its protocol's error with `engine_crashed`, naming
    the model; the row is `incomplete`, `engine_crashed`; the engine restarts and
    answers again. Before: `upstream llamacpp:smollm2-135m broke the connection`,
    `upstream_error`, in the stream and the row."""
    tenant, key = local.new_tenant("s73-crash")
    body: dict[str, Any] = {"model": LOCAL, "max_tokens": 300, "stream": True,
                            "messages": [{"role": "user", "content": STORY}]}  # fmt: skip
    path = "/v1/chat/completions" if protocol == "chat" else "/v1/messages"
    events = sse_events(_kill_mid_stream(local, key, path, body).decode())
    kind, last = events[-1]
    if protocol == "messages":
        assert kind == "error" and last["type"] == "error", events[-2:]
        assert last["error"]["type"] == "api_error", last
    assert last["error"]["code"] == "engine_crashed", last
    assert f"engine of '{LOCAL}' crashed" in last["error"]["message"], last
    rows = local.stored_rows(tenant)
    assert [(x["status"], x["error_code"]) for x in rows] == [("incomplete", "engine_crashed")]
    deadline = time.monotonic() + 120
    while (r := local.post("/v1/chat/completions", key=key, json={**body, "stream": False,
           "max_tokens": 4})).status_code == 503 and time.monotonic() < deadline:  # fmt: skip
        time.sleep(0.5)
    assert r.status_code == 200, r.text  # restarted


def test_an_engine_killed_mid_responses_stream_is_named(local: Gateway) -> None:
    """The same on a Responses stream: its `error` event has `engine_crashed` naming the
    model, then `response.failed`; the row is `incomplete`, `engine_crashed`."""
    tenant, key = local.new_tenant("s73-crash-r")
    body = {"model": LOCAL, "input": STORY, "max_output_tokens": 300, "stream": True}
    events = sse_events(_kill_mid_stream(local, key, "/v1/responses", body).decode())
    (_, error), (_, failed) = events[-2], events[-1]
    assert error["type"] == "error" and error["code"] == "engine_crashed", error
    assert f"engine of '{LOCAL}' crashed" in error["message"], error
    assert failed["type"] == "response.failed", failed
    rows = local.stored_rows(tenant)
    assert [(x["status"], x["error_code"]) for x in rows] == [("incomplete", "engine_crashed")]


def test_a_hung_engine_is_killed_and_restarted(local: Gateway) -> None:
    """An engine stopped with SIGSTOP (alive, silent) is restarted within seconds, and
    the admin API names why; it then answers. Before: /readyz `ready` with the same worker
    for as long as it hung, each request 504 after its timeout."""
    wait_http(local.url + "/readyz", local.proc, 120)
    (worker,) = worker_pids(local.proc.popen.pid, b"llama-server")
    before = httpx.get(local.url + "/readyz").json()["models"][LOCAL]["restarts"]
    os.kill(worker, signal.SIGSTOP)
    try:
        deadline = time.monotonic() + 45
        while time.monotonic() < deadline:
            engine = httpx.get(local.url + "/readyz").json()["models"][LOCAL]
            if engine["restarts"] > before:
                break
            time.sleep(0.5)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(worker, signal.SIGCONT)
    assert engine["restarts"] == before + 1, engine
    engines = httpx.get(local.url + "/admin/engines", headers=local.admin).json()["engines"]
    assert "stopped answering its health check" in engines[LOCAL]["last_error"], engines
    wait_http(local.url + "/readyz", local.proc, 120)
    assert worker_pids(local.proc.popen.pid, b"llama-server") != [worker]
    r = local.post("/v1/chat/completions", json={"model": LOCAL, "max_tokens": 4,
                   "messages": [{"role": "user", "content": "hi"}]})  # fmt: skip
    assert r.status_code == 200, r.text
