"""Money when an upstream call is cut (s73): a non-streamed request whose upstream
call was sent and then ended without a reply (its client hung up while the upstream
generated, the attempt timed out, its task was cancelled) is billed the output cap it
was sent with, for each sequence asked, not 0.

Defect these tests find (each failed before its fix in settle.py `Settler._charge`):
such a request was billed its prompt estimate and the events relayed, which is 0 for a
non-streamed call, while a provider bills what it generated (a non-streamed
generation runs to its end server-side after the gateway leaves). A key under a budget
could send non-streamed requests with a large `max_tokens` and hang up after a
second, again and again: each billed $0, the provider billing every generation, so
the tenant's real spend passed its budget.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import socket
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from support.cut_calls import CAP, NO_STORE, PRICE
from support.gateways import Gateway, start_gateway
from support.upstreams import Scripted


@pytest.fixture(scope="module")
def gw(scripted: Scripted) -> Iterator[Gateway]:
    """`cut`: the scripted upstream, priced, no retries; `slow`: the same with a 1 s
    attempt timeout and one retry; `first`: a tenth of the price, a 1 s timeout, and
    `cut` as its fallback."""
    base = {"engine": {"kind": "openai", "base_url": scripted.url + "/v1"}, "price": PRICE}
    models = [
        {"alias": "cut", **base, "resilience": {"retries": 0}},
        {
            "alias": "slow",
            **base,
            "timeouts": {"first_byte_s": 1.0},
            "resilience": {"retries": 1, "backoff_base_s": 0.0},
        },
        {
            "alias": "first",
            "engine": base["engine"],
            "price": {"input": 0.0, "output": 100.0},  # a tenth of `cut`'s
            "timeouts": {"first_byte_s": 1.0},
            "resilience": {"retries": 0},
            "fallbacks": ["cut"],
        },
    ]
    g = start_gateway({"models": models, "embeddings": {"enabled": False}})
    yield g
    g.proc.stop()


def _body(model: str, **more: Any) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": "hi"}], **more}


def _wait_upstream(scripted: Scripted, before: int, count: int = 1) -> None:
    """Until the upstream has received `count` more generation requests than `before`."""
    deadline = time.monotonic() + 10
    while scripted.requests() < before + count:
        assert time.monotonic() < deadline, "the upstream never received the request"
        time.sleep(0.02)


def _hang_up_after_sent(
    gw: Gateway, scripted: Scripted, key: str, body: dict[str, Any], calls: int = 1
) -> None:
    """POST `body` on a raw socket, and close it once the upstream has had `calls`
    requests for it (each hangs: no answer), before any answer."""
    payload = json.dumps(body).encode()
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:{gw.port}\r\n"
        f"Authorization: Bearer {key}\r\nContent-Type: application/json\r\n"
        f"Cache-Control: no-store\r\nContent-Length: {len(payload)}\r\n\r\n"
    ).encode()
    before = scripted.requests()
    scripted.fault("hang", count=calls)
    with socket.create_connection(("127.0.0.1", gw.port), timeout=10) as sock:
        sock.sendall(head + payload)
        _wait_upstream(scripted, before, calls)
        time.sleep(0.2)  # the upstream is generating; the client leaves
    scripted.fault("hang", count=0)


def test_a_client_that_hangs_up_on_a_non_streamed_call_is_billed_its_cap(
    gw: Gateway, scripted: Scripted
) -> None:
    """The client closes its socket while the upstream works on `max_tokens: 500`:
    the row bills the 500 output tokens the reservation held ($0.50), not 0."""
    tenant, key = gw.new_tenant("s73-hangup", budget_usd=5.0)
    _hang_up_after_sent(gw, scripted, key, _body("cut", max_tokens=CAP))
    [row] = gw.stored_rows(tenant, 1)
    assert (row["status"], row["attempts"]) == ("cancelled", 1), row
    assert row["output_tokens"] == CAP, row
    assert row["cost_usd"] == pytest.approx(0.5), row
    assert row["input_tokens"] > 0, row


def test_hanging_up_again_and_again_never_passes_the_budget(
    gw: Gateway, scripted: Scripted
) -> None:
    """Under a $1.00 budget, two hang-ups on 500-token calls bill the whole budget:
    the next call is refused 429 insufficient_quota, so what the upstream may have
    generated for the tenant is never more than its budget. (Before, each hang-up was
    billed $0 and the third call was served.)"""
    tenant, key = gw.new_tenant("s73-again", budget_usd=1.0)
    for _ in range(2):
        _hang_up_after_sent(gw, scripted, key, _body("cut", max_tokens=CAP))
    rows = gw.stored_rows(tenant, 2)
    assert [r["output_tokens"] for r in rows] == [CAP, CAP], rows
    r = gw.post("/v1/chat/completions", key=key, json=_body("cut", max_tokens=CAP),
                headers=NO_STORE)  # fmt: skip
    assert r.status_code == 429, r.text
    assert r.json()["error"]["code"] == "insufficient_quota", r.text
    spent = sum(float(x["cost_usd"]) for x in gw.stored_rows(tenant, 3))
    assert spent == pytest.approx(1.0), rows


def test_an_attempt_timeout_bills_the_cap_of_every_sequence(
    gw: Gateway, scripted: Scripted
) -> None:
    """`slow` times out each attempt after 1 s and retries once: the request ends 504
    upstream_timeout after two attempts that reached the upstream, each billed its
    prompt and its cap for both sequences asked (`n: 2`): 2,000 output tokens (the
    retry first extended the reservation by one call: test_money_retries_s73)."""
    tenant, key = gw.new_tenant("s73-timeout", budget_usd=5.0)
    before = scripted.requests()
    scripted.fault("hang", count=2)
    try:
        r = gw.post("/v1/chat/completions", key=key, json=_body("slow", max_tokens=CAP, n=2),
                    headers=NO_STORE)  # fmt: skip
    finally:
        scripted.fault("hang", count=0)
    assert r.status_code == 504, r.text
    assert r.json()["error"]["code"] == "upstream_timeout", r.text
    assert scripted.requests() == before + 2
    [row] = gw.stored_rows(tenant, 1)
    assert (row["status"], row["attempts"]) == ("error", 2), row
    assert row["output_tokens"] == 2 * 2 * CAP, row
    assert row["cost_usd"] == pytest.approx(2.0), row


def test_a_task_cancel_of_a_running_non_streamed_call_bills_its_cap(
    gw: Gateway, scripted: Scripted
) -> None:
    """DELETE /v1/tasks/{id} while the task's non-streamed call waits on its upstream:
    the call ends 409 task_cancelled, and its row bills the 500-token cap; the task's
    own spend counts it too."""
    tenant, key = gw.new_tenant("s73-task", budget_usd=5.0)
    task = "s73-" + os.urandom(4).hex()
    auth = {"Authorization": f"Bearer {key}"}
    before = scripted.requests()
    scripted.fault("hang", count=1)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        call = pool.submit(
            gw.post, "/v1/chat/completions", key=key, json=_body("cut", max_tokens=CAP),
            headers={**NO_STORE, "x-task-id": task},
        )  # fmt: skip
        try:
            _wait_upstream(scripted, before)
            stop = httpx.delete(f"{gw.url}/v1/tasks/{task}", headers=auth, timeout=10)
        finally:
            scripted.fault("hang", count=0)
        r = call.result(timeout=20)
    assert stop.status_code == 200, stop.text
    assert r.status_code == 409 and r.json()["error"]["code"] == "task_cancelled", r.text
    [row] = gw.stored_rows(tenant, 1)
    assert row["error_code"] == "task_cancelled", row
    assert row["output_tokens"] == CAP, row
    assert row["cost_usd"] == pytest.approx(0.5), row
    state = httpx.get(f"{gw.url}/v1/tasks/{task}", headers=auth, timeout=10).json()
    assert state["used"]["cost_usd"] == pytest.approx(0.5), state


def test_a_call_cut_at_its_fallback_is_billed_at_the_fallbacks_price(
    gw: Gateway, scripted: Scripted
) -> None:
    """`first` times out and falls back to `cut` (ten times its price); the client
    hangs up while `cut` works: each cut call is billed its cap at its own model's
    price, `first`'s at $0.05 and `cut`'s at $0.50 (not both at `first`'s)."""
    tenant, key = gw.new_tenant("s73-fallback", budget_usd=5.0)
    _hang_up_after_sent(gw, scripted, key, _body("first", max_tokens=CAP), calls=2)
    [row] = gw.stored_rows(tenant, 1)
    assert (row["status"], row["attempts"]) == ("cancelled", 2), row
    assert row["output_tokens"] == 2 * CAP, row
    assert row["cost_usd"] == pytest.approx(0.55), row
