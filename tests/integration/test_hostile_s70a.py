"""Hostile and unlucky clients against the model queue, task cancels, priorities and
background Responses, over sockets against real gateways in front of the scripted
upstream.

Defects these tests find (each fails on today's code):
- a client that hangs up while its request waits in a model's queue is not removed: no
  route listens for `http.disconnect` before the reply starts (api/openai.py,
  service.py `generate`; only api/sse.py's relay does, once streaming), so the request
  keeps its place, takes the slot when its turn comes, is sent upstream for nobody and
  is recorded `ok`;
- a cancelled task (`DELETE /v1/tasks/{id}`) keeps its declared planned steps in the
  model gate's admitted work (policy/admission.py `DeploymentGate._tasks`; the cancel,
  control/cancels.py, never tells the gates): while the model is saturated, every new
  task of the tenant's class is refused 503 `overloaded` behind work that will never
  come, until the cancelled task's own deadline;
- background responses belong to `host:port` (state/responses.py `instance_name`), the
  port being `server.port` from the config, not the one `serve --port` listens on
  (state/choose.py `build_store`): a gateway restarted under another name (a changed
  port, a new pod name) never fails its orphans, which stay `in_progress` and keep the
  tenant's `responses.max_background_per_tenant` places for ever; and a second gateway
  started on the same store and host (another `--port`) fails the first's running
  responses at its start (`fail_orphans`);
- a background response cut by an orderly stop (SIGTERM) is stored failed as "upstream
  ... broke the connection" with an `upstream_error` ledger row (api/responses.py
  `_run`: the gateway's own client closing is read as the engine's failure), not with
  the documented restart reason (docs/guides/responses.md);
- a client's own `priority` body member (vLLM's engine-queue priority) is relayed
  upstream unchanged when the deployment does not send the gateway's class
  (execute/executor.py: replaced only under `scheduling_policy: priority`): a batch key
  asks the engine to run it first.

Checked and sound (no test here: they pass): a full queue's 429 `queue_full` with
`Retry-After` in each protocol's own shape (chat, completions, Responses foreground,
streamed and background, Messages plain and streamed); a request whose deadline passes
in the queue gets 504 and a ledger row, and gives its tenant's concurrency slot back;
a task cancelled while its call waits in the queue answers that call 409.
"""

from __future__ import annotations

import concurrent.futures
import os
import signal
import socket
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from support.gateways import Gateway, start_gateway
from support.upstreams import Scripted
from switchyard.policy.admission import ServiceModel
from switchyard.state.responses import ORPHAN_REASON

CHAT = {"model": "one", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}


def _config(scripted: Scripted, port: int | None = None) -> dict[str, Any]:
    model = {
        "alias": "one",
        "engine": {"kind": "openai", "base_url": scripted.url + "/v1"},
        "limits": {"max_concurrency": 1, "queue": 4},
        "resilience": {"retries": 0},
    }
    config: dict[str, Any] = {
        "models": [model],
        "embeddings": {"enabled": False},
        "responses": {"max_background_per_tenant": 1},
    }
    if port is not None:  # the configured port (the gateway listens where --port says)
        config["server"] = {"port": port}
    return config


@pytest.fixture(scope="module")
def gw(scripted: Scripted) -> Iterator[Gateway]:
    g = start_gateway(_config(scripted))
    yield g
    g.proc.stop()


def _chat(gw: Gateway, key: str | None = None, **headers: str) -> httpx.Response:
    return gw.post("/v1/chat/completions", key=key, json=CHAT, headers=headers, timeout=30)


def test_a_client_that_leaves_while_queued_is_never_sent_upstream(
    gw: Gateway, scripted: Scripted
) -> None:
    tenant, key = gw.new_tenant("gone")
    scripted.fault("delay:1500", count=1)
    before = scripted.requests()
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        held = pool.submit(_chat, gw)  # holds the only slot for 1.5 s
        time.sleep(0.4)
        body = b'{"model": "one", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}'
        head = (
            "POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            f"Authorization: Bearer {key}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n"
        ).encode()
        with socket.create_connection(("127.0.0.1", gw.port), timeout=10) as s:
            s.sendall(head + body)
            time.sleep(0.3)  # queued behind the held request; then the client hangs up
        assert held.result().status_code == 200
    rows = gw.stored_rows(tenant, 1)
    time.sleep(0.5)  # anything still on its way upstream gets there
    # Nobody is left to answer: the abandoned request goes nowhere and is cancelled.
    assert scripted.requests() == before + 1  # the held request alone
    assert [(r["status"], r["attempts"]) for r in rows] == [("cancelled", 0)]


def test_a_cancelled_tasks_planned_steps_do_not_refuse_new_tasks(
    gw: Gateway, scripted: Scripted
) -> None:
    _, key = gw.new_tenant("cancel")
    learn = ServiceModel.MIN_SAMPLES + 1
    scripted.fault("delay:100", count=learn)
    for _ in range(learn):  # the model learns: about 0.1 s a call
        assert _chat(gw).status_code == 200
    big = {"x-task-id": "big", "x-task-planned-steps": "64", "x-task-timeout": "600"}
    assert _chat(gw, key, **big).status_code == 200  # its first step; 63 declared to come
    cancelled = httpx.delete(
        gw.url + "/v1/tasks/big", headers={"Authorization": f"Bearer {key}"}, timeout=10
    )
    assert cancelled.status_code == 200 and cancelled.json()["cancelled"] is True
    assert _chat(gw, key, **big).status_code == 409  # the task takes no more calls
    scripted.fault("delay:1500", count=1)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        held = pool.submit(_chat, gw)  # the model is saturated for 1.5 s
        time.sleep(0.4)
        # A new task of 2 steps (0.2 s of work) with 5 s: nothing is queued, so it waits
        # about the held call's rest and runs well within 80 % of its time.
        small = _chat(
            gw, key, **{"x-task-id": "small", "x-task-planned-steps": "2", "x-task-timeout": "5"}
        )
        assert held.result().status_code == 200
    assert small.status_code == 200, small.text


def _background(gw: Gateway, key: str) -> httpx.Response:
    body = {"model": "one", "input": "hi", "background": True}
    return gw.post("/v1/responses", key=key, json=body, timeout=30)


def _status(gw: Gateway, key: str, rid: str) -> str:
    r = httpx.get(f"{gw.url}/v1/responses/{rid}", headers={"Authorization": f"Bearer {key}"})
    assert r.status_code == 200, r.text
    return str(r.json()["status"])


def test_a_background_response_orphaned_by_a_restart_on_another_port_is_failed(
    scripted: Scripted,
) -> None:
    first = start_gateway(_config(scripted, port=18741))
    db, key = first.db, first.key
    second: Gateway | None = None
    try:
        scripted.fault("hang", count=1)
        r = _background(first, key)
        assert r.status_code == 200, r.text
        rid = r.json()["id"]
        os.killpg(first.proc.popen.pid, signal.SIGKILL)  # a crash: nothing runs it any more
        first.proc.popen.wait(10)
        # The same store, the gateway moved to another port (a new pod name does the same).
        second = start_gateway(_config(scripted, port=18742), db=db)
        status = _status(second, key, rid)
        again = _background(second, key)
        # Nothing runs the orphan: it is failed, and the tenant's one place is free.
        assert (status, again.status_code) == ("failed", 200), again.text
    finally:
        first.proc.stop()
        if second is not None:
            second.proc.stop()


def test_a_second_gateway_on_the_store_leaves_the_firsts_running_responses_alone(
    scripted: Scripted,
) -> None:
    first = start_gateway(_config(scripted))
    second: Gateway | None = None
    try:
        scripted.fault("delay:20000", count=1)  # runs on; the stop ends it
        r = _background(first, first.key)
        assert r.status_code == 200, r.text
        rid = r.json()["id"]
        # Another gateway on the same store and host, listening on its own --port.
        second = start_gateway(_config(scripted), db=first.db)
        # The first still runs it: a poll must not read a final `failed`.
        assert _status(first, first.key, rid) == "in_progress"
    finally:
        first.proc.stop()
        if second is not None:
            second.proc.stop()


def test_a_background_response_cut_by_a_graceful_stop_is_not_blamed_on_the_upstream(
    scripted: Scripted,
) -> None:
    first = start_gateway(_config(scripted))
    second: Gateway | None = None
    try:
        tenant, key = first.new_tenant("stop")
        scripted.fault("hang", count=1)  # the upstream is working on it, healthy
        r = _background(first, key)
        assert r.status_code == 200, r.text
        rid = r.json()["id"]
        first.proc.stop()  # SIGTERM: an orderly stop (a deploy, a restart)
        second = start_gateway(_config(scripted), db=first.db)
        polled = httpx.get(
            f"{second.url}/v1/responses/{rid}", headers={"Authorization": f"Bearer {key}"}
        )
        assert polled.status_code == 200, polled.text
        rows = second.stored_rows(tenant, 1)
        # The stop ended it, not the upstream: the documented reason, and no upstream
        # error in the ledger (it is no engine's failure).
        assert polled.json()["error"]["message"] == ORPHAN_REASON, polled.json()
        assert [row["error_code"] for row in rows] != ["upstream_error"]
    finally:
        first.proc.stop()
        if second is not None:
            second.proc.stop()


def test_a_clients_own_engine_priority_never_reaches_the_upstream(
    gw: Gateway, scripted: Scripted
) -> None:
    _, key = gw.new_tenant("jump", priority="batch")
    body = {**CHAT, "priority": -1000}  # vLLM's field: lower runs first in its queue
    r = gw.post("/v1/chat/completions", key=key, json=body, timeout=30)
    assert r.status_code == 200, r.text
    sent = httpx.get(scripted.url + "/control/last", timeout=5).json()["body"]
    # A batch key never raises its own class: not at the gateway's queue, nor at the
    # engine's (the gateway's class, or nothing, goes upstream).
    assert sent.get("priority") in (None, 2), sent
