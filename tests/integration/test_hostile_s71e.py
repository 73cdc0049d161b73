"""After a storm, every hold is given back. About a hundred requests of one tenant, drawn
with a fixed seed, hit one gateway at once: chat completions, Responses (some in the
background, then cancelled or deleted) and Messages, streamed and whole, to a model
that answers, one that answers 503 (without retries, with two, with a fallback that
answers and with one behind a gate), one that answers 400, a slow one behind a
deployment gate (`max_concurrency` and `queue`), one whose every call times out, and
one that breaks off mid-reply, and one that never answers behind a gate of its own
(called only by clients that leave or whose deadline passes); some in agent tasks with a cost budget, some with an
Idempotency-Key shared with others (replays, races and mismatched bodies), some with a
deadline that passes while queued or served, some from clients that hang up before
their body ends, while queued, while the upstream works or mid-stream, and a task
cancelled by its DELETE while its calls run. The storm runs against a gateway with
in-process limits and one with Redis-backed limits and tasks.

Once it is over, nothing it took may still be held (DESIGN.md: a stage's release runs
on every ending, exactly once):
- every request has exactly one ledger row (by its `x-request-id`), whose status says
  how it ended;
- while it ran, no gate count left its bounds or went below 0; after it, every gate
  (/admin/live `queues`) and `active_requests` are back to 0, the slow model's gate
  takes its slots and its queue at once again, and no upstream call is left open;
- the key and the tenant each run their `max_concurrency` requests at once again, and
  the tenant's budget holds no reservation (cut to what was billed plus one request's
  reservation, it admits one request and refuses the next);
- each task's `used` (calls, tokens, cost) is what its rows say went upstream and were
  billed;
- every Idempotency-Key used can be used again, never "in flight" for ever;
- every stored response a client saw has ended, and the tenant's background places
  are free; every breaker the storm opened closes once its upstream heals.

All of these pass on today's code (memory and Redis): they pin invariants no other
test holds over a mixed storm.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import random
import re
import socket
import sqlite3
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from support.gateways import CHEAP_PRICE, Gateway, start_gateway
from support.procs import Proc
from support.upstreams import Scripted, start_scripted

SEED = 71_05
N_REQUESTS = 100
TENANT_CONCURRENCY = 6
KEY_CONCURRENCY = 4  # the storm's key's own limit, under its tenant's
TENANT_BUDGET_USD = 50.0
BACKGROUND = 2  # responses.max_background_per_tenant
GATE = {"max_concurrency": 2, "queue": 6}
TASKS = ("task-a", "task-b", "task-doomed")
TASK_BUDGET_USD = 0.1  # about six calls: the storm spends some tasks out
# Each Idempotency-Key names one request (its repeats replay it or race it), never streamed.
IDEM_SHAPES: dict[str, tuple[str, str, bool] | None] = {
    "idem-slow-chat": ("/v1/chat/completions", "slow", False),
    "idem-slow-resp": ("/v1/responses", "slow", False),
    "idem-down-mess": ("/v1/messages", "down", False),
    "idem-drop-chat": ("/v1/chat/completions", "drop", False),
    "idem-ok-mess": ("/v1/messages", "ok", False),
    "idem-fbslow-resp": ("/v1/responses", "fbslow", False),
    "idem-bg-slow": ("/v1/responses", "slow", True),  # background
    "idem-bg-down": ("/v1/responses", "down", True),
    "idem-mixed": None,  # one key for requests of every shape (each repeat a mismatch)
}
IDEM_KEYS = tuple(IDEM_SHAPES)
# (alias, fault of its upstream): each model its own scripted upstream process.
FAULTS = {"down": "status:503", "bad": "status:400", "slow": "delay:300,slow:40", "drop": "drop-mid-stream", "hang": "hang"}  # fmt: skip
MODELS = (
    "ok",
    "ok",
    "down",
    "retry",
    "fb",
    "fbslow",
    "bad",
    "slow",
    "slow",
    "flaky",
    "flaky",
    "drop",
    "hang",
)
PATHS = ("/v1/chat/completions", "/v1/responses", "/v1/messages")
# How a client behaves: waits for the whole answer, hangs up before its body ends,
# hangs up a moment after sending (queued, or while the upstream works), hangs up
# after the first bytes of its answer.
CLIENTS = ("whole", "whole", "whole", "cut_body", "leave_early", "leave_mid", "deadline")


@dataclass
class Shot:
    """One request of the storm and how it ended for its client."""

    rid: str
    path: str
    model: str
    stream: bool
    client: str
    task: str | None
    idem: str | None
    background: bool = False
    status: int | None = None
    response_id: str | None = None  # a background response's, as its client read it
    how: str = "keep"  # what became of a background response: kept, cancelled, deleted  # None: the client left before any answer


def _body(
    path: str, model: str, stream: bool, text: str, background: bool = False
) -> dict[str, Any]:
    if path == "/v1/responses":
        out = {"model": model, "input": text, "max_output_tokens": 16, "stream": stream}
        return out | ({"background": True} if background else {})
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": 16,
        "messages": [{"role": "user", "content": text}],
        "stream": stream,
    }
    if stream and path == "/v1/chat/completions":
        body["stream_options"] = {"include_usage": True}
    return body


def _config(ok: Scripted, faulty: dict[str, Scripted]) -> dict[str, Any]:
    def model(alias: str, upstream: Scripted, **more: Any) -> dict[str, Any]:
        engine = {"kind": "openai", "base_url": upstream.url + "/v1"}
        return {"alias": alias, "engine": engine, "price": CHEAP_PRICE, **more}

    # A breaker that opens after two failures and lets a probe through half a second later.
    breaker = {"failures": 2, "cooldown_s": 0.5}
    no_retry = {"resilience": {"retries": 0, "breaker": breaker}}
    return {
        "models": [
            model("ok", ok),
            model("down", faulty["down"], **no_retry),
            model(
                "retry",
                faulty["down"],
                resilience={"retries": 2, "breaker": breaker},
                timeouts={"first_byte_s": 5},
            ),
            model("fb", faulty["down"], fallbacks=["ok"], **no_retry),
            model("fbslow", faulty["down"], fallbacks=["slow"], **no_retry),
            model("bad", faulty["bad"], **no_retry),
            model("slow", faulty["slow"], limits=GATE, **no_retry),
            model("slowfree", faulty["slow"], **no_retry),
            # every call times out before the slow upstream's first byte: its breaker
            # opens, and its half-open probes are often left by their clients
            model("flaky", faulty["slow"], timeouts={"first_byte_s": 0.2}, **no_retry),
            model("drop", faulty["drop"], **no_retry),
            # never answers: only clients that leave, or whose deadline passes, call it
            model(
                "hang",
                faulty["hang"],
                limits={"max_concurrency": 1, "queue": 2},
                timeouts={"first_byte_s": 2},
                **no_retry,
            ),
        ],
        "embeddings": {"enabled": False},
        "cache": {"enabled": False},
        "responses": {"max_background_per_tenant": BACKGROUND},
    }


@pytest.fixture(scope="module")
def faulty() -> Iterator[dict[str, Scripted]]:
    started: list[Proc] = []
    out: dict[str, Scripted] = {}
    try:
        for name, spec in FAULTS.items():
            proc, s = start_scripted("--fault", spec)
            started.append(proc)
            out[name] = s
        yield out
    finally:
        for proc in started:
            proc.stop()


@dataclass
class Storm:
    gw: Gateway
    tenant: str
    key: str  # the storm's key (KEY_CONCURRENCY)
    other: str  # another key of the tenant, without a limit of its own
    shots: list[Shot]
    deletes: list[int]
    upstreams: dict[str, dict[str, Any]]  # each fault's upstream's /stats after the storm
    seen: list[dict[str, Any]]  # /admin/live, sampled while the storm ran


def _raw(gw: Gateway, key: str, shot: Shot, body: bytes, headers: dict[str, str]) -> None:
    """A client on a raw socket that hangs up: before its body ends (`cut_body`), or
    a moment after sending it (`leave_early`: while queued or the upstream works)."""
    extra = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
    head = (
        f"POST {shot.path} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {key}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n{extra}\r\n"
    ).encode()
    with socket.create_connection(("127.0.0.1", gw.port), timeout=10) as s:
        if shot.client == "cut_body":
            s.sendall(head + body[: len(body) // 2])
            time.sleep(0.05)
        else:
            s.sendall(head + body)
            time.sleep(random.Random(shot.rid).uniform(0.01, 0.25))


def _fire(gw: Gateway, key: str, shot: Shot) -> Shot:
    headers = {"x-request-id": shot.rid}
    if shot.client == "deadline":  # a deadline that passes while queued or served
        headers["x-request-timeout"] = "0.4"
    if shot.task is not None:
        headers |= {"x-task-id": shot.task, "x-task-budget": f"cost_usd={TASK_BUDGET_USD}"}
    if shot.idem is not None:
        headers["Idempotency-Key"] = shot.idem
    text = f"storm {shot.idem or shot.rid}"
    body = _body(shot.path, shot.model, shot.stream, text, shot.background)
    if shot.client in ("cut_body", "leave_early"):
        _raw(gw, key, shot, json.dumps(body).encode(), headers)
        return shot
    headers["Authorization"] = f"Bearer {key}"
    first = b""
    try:
        with httpx.stream("POST", gw.url + shot.path, json=body, headers=headers, timeout=30) as r:
            shot.status = r.status_code
            for piece in r.iter_raw(64):
                first += piece
                if shot.client == "leave_mid":
                    break  # hangs up after the first bytes of the answer
    except httpx.HTTPError:
        pass  # a reply cut by the upstream's break: the status is known
    if shot.path == "/v1/responses" and shot.status == 200:
        found = re.search(rb'"id":\s*"(resp_[0-9A-Za-z_]+)"', first)
        shot.response_id = found.group(1).decode() if found else None
    if shot.background and shot.status == 200 and shot.client == "whole":
        # a background response cancelled, or deleted, while it runs
        how = shot.how = random.Random(shot.rid).choice(("keep", "cancel", "delete"))
        rid = shot.response_id
        if rid is not None:
            auth = {"Authorization": f"Bearer {key}"}
            if how == "cancel":
                httpx.post(f"{gw.url}/v1/responses/{rid}/cancel", headers=auth, timeout=10)
            elif how == "delete":
                httpx.delete(f"{gw.url}/v1/responses/{rid}", headers=auth, timeout=10)
    return shot


def _plan(rng: random.Random, prefix: str) -> list[Shot]:
    shots = []
    for i in range(N_REQUESTS):
        path, model, stream = rng.choice(PATHS), rng.choice(MODELS), rng.random() < 0.5
        idem = rng.choice(IDEM_KEYS) if rng.random() < 0.2 else None
        background = path == "/v1/responses" and not stream and rng.random() < 0.4
        shape = IDEM_SHAPES[idem] if idem is not None else None
        if shape is not None:  # one key, one request: repeats replay or race
            (path, model, background), stream = shape, False
        task = rng.choice((*TASKS, None, None)) if idem is None else None
        client = rng.choice(CLIENTS)
        if model == "hang" and client in ("whole", "leave_mid"):
            client = "deadline"
        shot = Shot(f"{prefix}-{i:03d}", path, model, stream, client, task, idem, background)
        shots.append(shot)
    return shots


def _live_queues(gw: Gateway) -> dict[str, dict[str, Any]]:
    r = httpx.get(gw.url + "/admin/live", headers=gw.admin, timeout=10)
    assert r.status_code == 200, r.text
    return dict(r.json()["queues"])


def _quiet(gw: Gateway, timeout_s: float = 15.0) -> dict[str, dict[str, Any]]:
    """The gates' counts once nothing is in flight or queued, or as they are after
    `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        queues = _live_queues(gw)
        busy = any(q.get("in_flight") or q.get("queued") for q in queues.values())
        if not busy or time.monotonic() > deadline:
            return queues
        time.sleep(0.2)


def _stats(upstream: Scripted, reset: bool = False) -> dict[str, Any]:
    r = (httpx.delete if reset else httpx.get)(upstream.url + "/stats", timeout=10)
    assert r.status_code == 200, r.text
    return dict(r.json())


def _run_storm(gw: Gateway, faulty: dict[str, Scripted], label: str) -> Storm:
    tenant = f"s71e-{label}-{os.urandom(3).hex()}"
    gw.create_tenant(tenant, max_concurrency=TENANT_CONCURRENCY, budget_usd=TENANT_BUDGET_USD)
    key = str(gw.create_key(tenant, max_concurrency=KEY_CONCURRENCY)["key"])
    other = str(gw.create_key(tenant)["key"])
    rng = random.Random(SEED)
    prefix = f"s71e-{label}-{os.urandom(3).hex()}"
    shots = _plan(rng, prefix)
    deletes: list[int] = []
    for upstream in faulty.values():
        _stats(upstream, reset=True)
    seen: list[dict[str, Any]] = []
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            r = httpx.get(gw.url + "/admin/live", headers=gw.admin, timeout=10)
            if r.status_code == 200:
                seen.append(r.json())
            time.sleep(0.05)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        futures = []
        for i, shot in enumerate(shots):
            futures.append(pool.submit(_fire, gw, key, shot))
            time.sleep(rng.uniform(0.0, 0.04))
            if i in (40, 70):  # the doomed task is cancelled while its calls run
                r = httpx.delete(
                    f"{gw.url}/v1/tasks/task-doomed",
                    headers={"Authorization": f"Bearer {key}"},
                    timeout=10,
                )
                deletes.append(r.status_code)
        for f in futures:
            f.result()
    _quiet(gw)
    done.set()
    watcher.join(15)
    time.sleep(0.5)  # an upstream learns of a hang-up when it next reads or writes
    upstreams = {name: _stats(u) for name, u in faulty.items()}
    return Storm(gw, tenant, key, other, shots, deletes, upstreams, seen)


@pytest.fixture(scope="module", params=["memory", "redis"])
def storm(
    request: pytest.FixtureRequest, scripted: Scripted, faulty: dict[str, Scripted]
) -> Iterator[Storm]:
    config = _config(scripted, faulty)
    if request.param == "redis":
        redis_url = request.getfixturevalue("redis_url")
        config["storage"] = {"redis_url": redis_url, "redis_timeout_s": 3}
    gw = start_gateway(config)
    try:
        yield _run_storm(gw, faulty, request.param)
    finally:
        gw.proc.stop()


def _rows(storm: Storm) -> list[dict[str, Any]]:
    """The tenant's ledger rows, read from the gateway's SQLite file, once their count
    holds still for a second (rows are written a moment after each request settles)."""
    seen, still_since = -1, time.monotonic()
    deadline = time.monotonic() + 15
    while True:
        with contextlib.closing(sqlite3.connect(f"file:{storm.gw.db}?mode=ro", uri=True)) as db:
            db.row_factory = sqlite3.Row
            rows = [
                dict(r)
                for r in db.execute("SELECT * FROM usage WHERE tenant_id = ?", (storm.tenant,))
            ]
        if len(rows) != seen:
            seen, still_since = len(rows), time.monotonic()
        elif time.monotonic() - still_since > 1.0 or time.monotonic() > deadline:
            return rows
        time.sleep(0.1)


# -- the ledger ---------------------------------------------------------------------------


def test_every_request_of_the_storm_has_exactly_one_ledger_row(storm: Storm) -> None:
    rows = _rows(storm)
    by_rid: dict[str, int] = {}
    for row in rows:
        rid = row["client_request_id"]
        by_rid[rid] = by_rid.get(rid, 0) + 1
    missing = [s for s in storm.shots if by_rid.get(s.rid, 0) == 0]
    ours = {s.rid for s in storm.shots}  # later tests add rows of their own
    doubled = {rid: n for rid, n in by_rid.items() if n > 1 and rid in ours}
    shape = [
        (s.rid, s.path, s.model, s.stream, s.client, s.task, s.idem, s.status) for s in missing
    ]
    assert not missing and not doubled, f"missing rows: {shape}; doubled: {doubled}"


def test_each_row_says_how_its_request_ended(storm: Storm) -> None:
    """A 200 the client read whole is `ok`, an error answer it read is not; a request
    whose body never ended is `cancelled`."""
    rows = {r["client_request_id"]: r for r in _rows(storm)}
    wrong = []
    for s in storm.shots:
        row = rows.get(s.rid)
        if row is None:
            continue
        shape = (s.rid, s.path, s.model, s.stream, s.client, s.status, row["status"])
        if s.client == "cut_body" and row["status"] != "cancelled":
            wrong.append(shape)
        if s.status is None or s.client not in ("whole", "deadline"):
            continue
        if s.status >= 400 and row["status"] == "ok":
            wrong.append(shape)
        if s.status == 200 and not (s.stream or s.background) and row["status"] != "ok":
            wrong.append(shape)
    assert not wrong, wrong


# -- gates and concurrency ------------------------------------------------------------------


def test_every_gate_is_back_to_nothing_in_flight_or_queued(storm: Storm) -> None:
    queues = _quiet(storm.gw, timeout_s=5)
    held = {n: q for n, q in queues.items() if q.get("in_flight") or q.get("queued")}
    assert "slow" in queues, queues
    assert not held, f"holds left after the storm: {held}"
    live = httpx.get(storm.gw.url + "/admin/live", headers=storm.gw.admin, timeout=10).json()
    assert live["active_requests"] == 0, live["active_requests"]


def test_the_gates_counts_never_leave_their_bounds_while_the_storm_runs(storm: Storm) -> None:
    """Sampled while the storm ran: the slow model's gate never holds more than its
    slots or queues more than its queue, and no count goes below 0 (a slot given back
    twice lets one request too many in later)."""
    assert len(storm.seen) > 10, len(storm.seen)
    out = []
    for live in storm.seen:
        for name, q in live["queues"].items():
            if q["in_flight"] < 0 or q["queued"] < 0:
                out.append((name, q))
        slow = live["queues"]["slow"]
        if slow["in_flight"] > GATE["max_concurrency"] or slow["queued"] > GATE["queue"]:
            out.append(("slow", slow))
        if live["active_requests"] < 0:
            out.append(("active_requests", live["active_requests"]))
    assert not out, out[:10]
    assert max(live["queues"]["slow"]["in_flight"] for live in storm.seen) >= 1


def test_every_upstream_call_of_the_storm_was_closed(storm: Storm) -> None:
    """Once the storm is over no upstream connection is left open: a client that left
    took its upstream call with it."""
    open_ = {n: (u["in_flight"], u["open_streams"]) for n, u in storm.upstreams.items()}
    assert all(v == (0, 0) for v in open_.values()), open_


@pytest.mark.parametrize(("model", "upstream"), [("down", "down"), ("retry", "down"), ("fb", "down"), ("fbslow", "down"), ("flaky", "slow")])  # fmt: skip
def test_a_healed_upstreams_breaker_closes_again(
    storm: Storm, faulty: dict[str, Scripted], model: str, upstream: str
) -> None:
    """Once the upstream answers again, the model's breaker lets a probe through after
    its cooldown and closes: no half-open probe the storm's clients left holds it."""
    _quiet(storm.gw)
    faulty[upstream].fault("delay:0", count=1000)  # no fault: instant answers
    try:
        body = _body("/v1/chat/completions", model, False, "is it back")
        deadline = time.monotonic() + 6
        answers = []
        while time.monotonic() < deadline:
            r = storm.gw.post("/v1/chat/completions", storm.other, json=body, timeout=10)
            answers.append((r.status_code, r.headers.get("x-switchyard-model")))
            if r.status_code == 200 and r.headers.get("x-switchyard-fallback") in (None, ""):
                break
            time.sleep(0.25)
        live = httpx.get(storm.gw.url + "/admin/live", headers=storm.gw.admin, timeout=10).json()
        assert answers[-1][0] == 200, (answers[-8:], live["breakers"])
        assert live["breakers"][model] == "closed", live["breakers"]
    finally:
        # back to the fault it was started with
        httpx.put(faulty[upstream].url + "/control/fault", json={"fault": None}, timeout=10)


def _together(gw: Gateway, key: str, model: str, n: int) -> list[int]:
    body = _body("/v1/chat/completions", model, False, "after the storm")
    with concurrent.futures.ThreadPoolExecutor(n) as pool:
        futures = [
            pool.submit(gw.post, "/v1/chat/completions", key, json=body, timeout=30)
            for _ in range(n)
        ]
        return [f.result().status_code for f in futures]


def test_the_key_runs_its_max_concurrency_requests_at_once_again(storm: Storm) -> None:
    _quiet(storm.gw)
    codes = _together(storm.gw, storm.key, "slowfree", KEY_CONCURRENCY)
    assert codes == [200] * KEY_CONCURRENCY, codes


def test_the_tenant_runs_its_max_concurrency_requests_at_once_again(storm: Storm) -> None:
    _quiet(storm.gw)
    codes = _together(storm.gw, storm.other, "slowfree", TENANT_CONCURRENCY)
    assert codes == [200] * TENANT_CONCURRENCY, codes


def test_the_tenants_budget_holds_no_reservation_of_the_storm(storm: Storm) -> None:
    """Its budget is cut to what its rows were billed plus $0.02: one more request
    (it reserves 16 tokens at $1000 a million: $0.016) is admitted, the next is not.
    A reservation the storm left held would refuse the first."""
    _quiet(storm.gw)
    billed = sum(float(r["cost_usd"]) for r in _rows(storm))
    r = httpx.patch(
        f"{storm.gw.url}/admin/tenants/{storm.tenant}",
        json={"budget_usd": round(billed + 0.02, 6)},
        headers=storm.gw.admin,
        timeout=10,
    )
    assert r.status_code == 200, r.text
    try:
        body = _body("/v1/chat/completions", "ok", False, "after the storm")
        first = storm.gw.post("/v1/chat/completions", storm.other, json=body, timeout=30)
        second = storm.gw.post("/v1/chat/completions", storm.other, json=body, timeout=30)
        assert (first.status_code, second.status_code) == (200, 429), (
            f"billed ${billed:.4f}; {first.text[:300]} / {second.text[:300]}"
        )
    finally:
        httpx.patch(
            f"{storm.gw.url}/admin/tenants/{storm.tenant}",
            json={"budget_usd": TENANT_BUDGET_USD},
            headers=storm.gw.admin,
            timeout=10,
        )


def test_the_tenants_background_places_are_free_again(storm: Storm) -> None:
    """`max_background_per_tenant` background responses are accepted at once again
    (the storm's own may still be finishing for a moment: tried for up to 10 s)."""
    body = _body("/v1/responses", "ok", False, "after the storm", background=True)
    deadline = time.monotonic() + 10
    while True:
        with concurrent.futures.ThreadPoolExecutor(BACKGROUND) as pool:
            futures = [pool.submit(gw_post, storm.gw, storm.other, body) for _ in range(BACKGROUND)]
            answers = [f.result() for f in futures]
        codes = [a.status_code for a in answers]
        if codes == [200] * BACKGROUND or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert codes == [200] * BACKGROUND, [a.text[:200] for a in answers]


def gw_post(gw: Gateway, key: str, body: dict[str, Any]) -> httpx.Response:
    return gw.post("/v1/responses", key, json=body, timeout=30)


def test_the_slow_gate_takes_its_slots_and_its_queue_again(storm: Storm) -> None:
    _quiet(storm.gw)
    _, key = storm.gw.new_tenant("s71e-gate")
    n = GATE["max_concurrency"] + GATE["queue"]
    codes = _together(storm.gw, key, "slow", n)
    assert codes == [200] * n, codes


# -- tasks ----------------------------------------------------------------------------------


@pytest.mark.parametrize("task", ["task-a", "task-b", "task-doomed"])
def test_a_tasks_use_is_what_its_rows_were_billed(storm: Storm, task: str) -> None:
    rows = [r for r in _rows(storm) if r["task_id"] == task]
    r = httpx.get(
        f"{storm.gw.url}/v1/tasks/{task}",
        headers={"Authorization": f"Bearer {storm.key}"},
        timeout=10,
    )
    assert r.status_code == 200, r.text
    state = r.json()
    assert state["running"] == [], state["running"]
    billed = sum(float(row["cost_usd"]) for row in rows)
    used = float(state["used"]["cost_usd"])
    calls = sum(1 for row in rows if row["attempts"] > 0)
    assert float(state["used"]["calls"]) == calls, (
        f"task {task}: used {state['used']['calls']} calls, {calls} rows went upstream"
    )
    tokens = sum(int(row["input_tokens"]) + int(row["output_tokens"]) for row in rows)
    assert float(state["used"]["tokens"]) == tokens, (
        f"task {task}: used {state['used']['tokens']} tokens, rows billed {tokens}"
    )
    assert used == pytest.approx(billed, abs=1e-6), (
        f"task {task}: used ${used:.4f}, rows billed ${billed:.4f}; "
        f"rows {[(x['client_request_id'], x['status'], x['cost_usd']) for x in rows]}"
    )


# -- idempotency ----------------------------------------------------------------------------


def test_every_idempotency_key_of_the_storm_is_free_again(storm: Storm) -> None:
    stuck = []
    for idem in IDEM_KEYS:
        shots = [s for s in storm.shots if s.idem == idem]
        if not shots:
            continue
        s = shots[0]
        body = _body(s.path, s.model, False, f"storm {idem}", s.background)
        r = storm.gw.post(
            s.path, storm.key, json=body, headers={"Idempotency-Key": idem}, timeout=15
        )
        if r.status_code in (409, 504) or (r.status_code >= 400 and "in flight" in r.text):
            stuck.append((idem, s.path, s.model, s.stream, r.status_code, r.text[:200]))
    assert not stuck, stuck


# -- background responses -------------------------------------------------------------------


def test_every_stored_response_of_the_storm_reached_an_end(storm: Storm) -> None:
    """Each response a client was handed an id of (background, streamed or whole,
    the client gone or not) is, once the storm is over, completed, failed, cancelled
    or incomplete (or gone, where it was deleted): none is left `queued` or
    `in_progress`."""
    shots = [s for s in storm.shots if s.response_id is not None]
    assert any(s.background for s in shots) and any(s.stream for s in shots), shots
    auth = {"Authorization": f"Bearer {storm.key}"}
    deadline = time.monotonic() + 5
    while True:
        open_ = []
        for s in shots:
            r = httpx.get(f"{storm.gw.url}/v1/responses/{s.response_id}", headers=auth, timeout=10)
            status = r.json().get("status") if r.status_code == 200 else r.status_code
            if status in ("queued", "in_progress") or (s.how == "delete" and status != 404):
                open_.append((s.rid, s.model, s.stream, s.background, s.client, s.how, status))
        if not open_ or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert not open_, open_
