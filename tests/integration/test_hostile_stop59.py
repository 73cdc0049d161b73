"""Hostile input against two landings: task-aware admission's capacity left to tasks
(single calls' rate, other clients at the engines) and MCP tool calls under a task's
budget (tool_calls, tool prices, per-server breakers, the result size cap), with the
memory and the Redis task stores. Gates on a controlled clock where timing decides;
everything else over sockets against real gateways, tool servers and redis-servers."""

from __future__ import annotations

import asyncio
import concurrent.futures
import gc
import http.server
import math
import os
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from support.gateways import Gateway, cheap_config, start_gateway
from support.mcp_http import ScriptedToolServer, in_session, open_session, tool_runs
from support.mcp_sessions import wait_tools_ready
from support.paths import MCP_TOOL_SERVER
from support.redis_server import start_redis, stop_redis
from support.upstreams import Scripted, start_scripted
from switchyard.engines.load import parse_metrics
from switchyard.errors import Overloaded, RateLimited
from switchyard.policy.admission import STANDARD, DeploymentGate, Priority, ServiceModel, SlotAsk

SERVER = MCP_TOOL_SERVER
PRICE = 0.02  # USD per call of crm__lookup
MAX_RESULT = 4096


# -- admission: the capacity left to tasks ------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


HOLD = SlotAsk(Priority.STANDARD, ("t", "hold"), 2, None)  # holds a slot, plans nothing


def _gate(queue: int, clock: Clock) -> DeploymentGate:
    g = DeploymentGate("m", 2, queue, "task_aware", 2.0, 0.8, clock)
    for _ in range(ServiceModel.MIN_SAMPLES):  # every call: 1 s
        g.model.observe(1.0, 100)
    return g


def _task(name: str, step: int, planned: int = 5) -> SlotAsk:
    return SlotAsk(Priority.STANDARD, ("tenant", name), step, planned)


async def _as_the_queue_stage(g: DeploymentGate, ask: SlotAsk, deadline: float) -> Any:
    """What policy/stages.py's Queue does with a request: try_acquire, then (when it
    would have to queue) acquire."""
    free = g.try_acquire(ask, deadline)
    if free is not None:
        return free
    return await g.acquire(deadline, ask)


async def _verdict(g: DeploymentGate, clock: Clock, ask: SlotAsk, left: float) -> Any:
    job = asyncio.create_task(_as_the_queue_stage(g, ask, clock.t + left))
    for _ in range(3):
        await asyncio.sleep(0)
    out: Any = "queued"
    if job.done():
        out = job.exception() or "admitted"
    job.cancel()
    await asyncio.gather(job, return_exceptions=True)
    return out


def test_a_single_call_that_waits_is_counted_once() -> None:
    """Saturated (the only time the capacity is estimated), each single call passes
    try_acquire twice: once in the Queue stage, once inside acquire. 30 of them in the
    window, each 1 s, are at most one slot's worth of single calls, never two."""

    async def go() -> dict[str, Any]:
        clock = Clock()
        g = _gate(64, clock)
        assert g.try_acquire(HOLD) is not None and g.try_acquire(HOLD) is not None
        waiting = [
            asyncio.create_task(_as_the_queue_stage(g, STANDARD, math.inf)) for _ in range(30)
        ]
        for _ in range(3):
            await asyncio.sleep(0)
        got = await _verdict(g, clock, _task("B", 1), 10.0)
        assert isinstance(got, Overloaded) and got.evidence is not None, got
        for w in waiting:
            w.cancel()
        await asyncio.gather(*waiting, return_exceptions=True)
        return dict(got.evidence["admission"]["capacity"])

    capacity = asyncio.run(go())
    assert capacity["single_calls"] <= 1.0 + 1e-9, capacity


def test_a_flood_of_refused_single_calls_takes_no_capacity_from_tasks() -> None:
    """A client floods single calls at a saturated model whose queue is full: each is
    refused 429 at once and holds no slot. They must not count as single calls holding
    slots, or the flood shrinks the capacity every tenant's tasks are admitted against
    to one slot and turns another tenant's admissible task into 503 `overloaded`.

    Two slots held, task A (step 2 of 5) queued: B (5 steps, 10 s left) waits A's 4 s
    of work over 2 slots + its own 5 s = 7 s, within 80 % of 10 s (admitted, then
    refused only because the queue is full); over 1 slot, 9 s: overloaded."""

    async def go(flood: int) -> Any:
        clock = Clock()
        g = _gate(1, clock)
        assert g.try_acquire(HOLD) is not None and g.try_acquire(HOLD) is not None
        a = asyncio.create_task(_as_the_queue_stage(g, _task("A", 2), clock.t + 60.0))
        for _ in range(3):
            await asyncio.sleep(0)
        for _ in range(flood):
            with pytest.raises(RateLimited):
                await _as_the_queue_stage(g, STANDARD, math.inf)
        got = await _verdict(g, clock, _task("B", 1), 10.0)
        a.cancel()
        await asyncio.gather(a, return_exceptions=True)
        return got

    quiet = asyncio.run(go(0))
    assert isinstance(quiet, RateLimited) and quiet.code == "queue_full", quiet
    flooded = asyncio.run(go(300))
    assert isinstance(flooded, RateLimited) and flooded.code == "queue_full", flooded


def test_single_calls_that_get_slots_still_count() -> None:
    """The fix keeps the guarantee it replaces: single calls that were served (30 in
    the window, 1 s each) take one slot from a new task's capacity."""

    async def go() -> Any:
        clock = Clock()
        g = _gate(16, clock)
        for _ in range(30):
            assert g.try_acquire(STANDARD) is not None
            g.release(1.0, 100, STANDARD)
        assert g.try_acquire(HOLD) is not None and g.try_acquire(HOLD) is not None
        a = asyncio.create_task(_as_the_queue_stage(g, _task("A", 1), clock.t + 9.0))
        for _ in range(3):
            await asyncio.sleep(0)
        got = await _verdict(g, clock, _task("B", 1), 10.0)
        a.cancel()
        await asyncio.gather(a, return_exceptions=True)
        return got

    got = asyncio.run(go())
    assert isinstance(got, Overloaded) and got.evidence is not None, got
    assert got.evidence["admission"]["capacity"]["single_calls"] == 1.0


def _admitted_batch_task(
    g: DeploymentGate, clock: Clock, name: str, planned: int, left: float = 3600.0
) -> None:
    """A batch task's first step takes a free slot (an idle model) and is answered: the
    gate now counts its remaining planned steps as work ahead."""
    ask = SlotAsk(Priority.BATCH, ("batch-tenant", name), 1, planned)
    assert g.try_acquire(ask, clock.t + left) is not None
    g.release()


def test_a_batch_tasks_planned_steps_do_not_refuse_an_interactive_task() -> None:
    """A batch tenant (the lowest class) declares one task of 64 planned steps
    (x-task-planned-steps) while the model is idle. Later, saturated, an interactive
    task of 3 steps with 20 s left arrives: every one of its steps ranks ahead of every
    batch step, so the batch task's 63 s of declared work is not ahead of it, and it
    must not be refused 503 `overloaded` for it."""

    async def go(waiting_class: Priority, long_left: float = 3600.0) -> Any:
        clock = Clock()
        g = _gate(16, clock)
        _admitted_batch_task(g, clock, "long", 64, long_left)
        assert g.try_acquire(HOLD) is not None and g.try_acquire(HOLD) is not None
        ask = SlotAsk(waiting_class, ("interactive-tenant", "t"), 1, 3)
        return await _verdict(g, clock, ask, 20.0)

    assert asyncio.run(go(Priority.INTERACTIVE)) == "queued"
    # The guarantee stays for the class the batch steps rank with: a batch task
    # behind it (due after it: earliest deadline first) is refused.
    refused = asyncio.run(go(Priority.BATCH, 15.0))
    assert isinstance(refused, Overloaded), refused


def test_queued_batch_steps_do_not_refuse_an_interactive_task() -> None:
    """The same for waiters: batch calls queued (they rank after an interactive task's
    steps until they have aged) are not work ahead of an interactive task."""

    async def go() -> Any:
        clock = Clock()
        g = _gate(64, clock)
        assert g.try_acquire(HOLD) is not None and g.try_acquire(HOLD) is not None
        batch = SlotAsk(Priority.BATCH)
        waiting = [asyncio.create_task(_as_the_queue_stage(g, batch, math.inf)) for _ in range(40)]
        for _ in range(3):
            await asyncio.sleep(0)
        ask = SlotAsk(Priority.INTERACTIVE, ("interactive-tenant", "t"), 1, 3)
        got = await _verdict(g, clock, ask, 20.0)
        for w in waiting:
            w.cancel()
        await asyncio.gather(*waiting, return_exceptions=True)
        return got

    assert asyncio.run(go()) == "queued"


def test_ten_thousand_declared_long_tasks_do_not_stall_the_event_loop() -> None:
    """A client registers the most tasks a gate keeps (10,000 cheap first steps, each
    declaring x-task-planned-steps over 64, hours to its deadline). Each new task's
    admission while saturated then sums their remaining steps: it must stay cheap, since
    it runs on the event loop every request shares (it took about a second: 640,000
    step estimates, one per remaining step)."""

    async def go() -> float:
        clock = Clock()
        g = _gate(16, clock)
        for i in range(DeploymentGate.MAX_TASKS):
            _admitted_batch_task(g, clock, f"t{i}", 1000 + i)
        assert g.try_acquire(HOLD) is not None and g.try_acquire(HOLD) is not None
        # The admission's own work: this thread's CPU time, with the collector held off
        # (a full suite's heap made one collection here take 0.67 s of wall time).
        gc.disable()
        try:
            t = time.thread_time()
            got = await _verdict(g, clock, SlotAsk(Priority.BATCH, ("b", "new"), 1, 3), 7200.0)
            took = time.thread_time() - t
        finally:
            gc.enable()
        assert isinstance(got, Overloaded), got  # their work is counted, just cheaply
        return took

    took = asyncio.run(go())
    assert took < 0.25, f"one admission took {took:.2f} s of the event loop"


@pytest.mark.parametrize(
    "page",
    [
        "vllm:num_requests_running NaN\nvllm:num_requests_waiting 1\n",
        "vllm:num_requests_running +Inf\nvllm:num_requests_waiting -Inf\n",
        "vllm:num_requests_running 1000001\nvllm:num_requests_waiting 0\n",
        'vllm:num_requests_running{a="1"} 600000\nvllm:num_requests_running{a="2"} 600000\n',
    ],
)
def test_an_engines_absurd_figures_never_reach_the_capacity(page: str) -> None:
    """What an engine's /metrics says is bounded before the gate sees it: NaN, infinities
    and more than a million requests are no reading; the gate's own bound holds too."""
    figures = parse_metrics("vllm", page)
    for name in ("running", "waiting"):
        value = figures[name]
        assert value is None or (isinstance(value, int) and 0 <= value <= 1_000_000), figures

    async def go() -> Any:
        clock = Clock()
        g = _gate(16, clock)
        g.others = lambda: (figures["running"] or 0) + (figures["waiting"] or 0)
        assert g.try_acquire(HOLD) is not None and g.try_acquire(HOLD) is not None
        return await _verdict(g, clock, _task("B", 1), 100.0)

    got = asyncio.run(go())
    assert got == "queued" or isinstance(got, Overloaded), got


def test_through_a_gateway_a_batch_tenants_long_task_does_not_refuse_interactive_ones() -> None:
    """Over sockets: a batch tenant starts a task declaring 64 steps while the model is
    idle; with both slots busy, an interactive tenant's 3-step task with 6 s left must
    be queued and served (its steps rank ahead of every batch step), not refused 503
    for the batch task's 63 declared steps."""
    proc, s = start_scripted()
    model = {
        "alias": "m",
        "engine": {"kind": "openai", "base_url": s.url + "/v1"},
        "limits": {"max_concurrency": 2, "queue": 8},
    }
    g = start_gateway({"models": [model], "embeddings": {"enabled": False}})
    try:

        def chat(key: str, **headers: str) -> httpx.Response:
            body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
            auth = {"Authorization": f"Bearer {key}"}
            return httpx.post(
                g.url + "/v1/chat/completions", json=body, headers={**auth, **headers}, timeout=60
            )

        keys = {}
        for cls in ("batch", "interactive"):
            tenant = f"{cls}-{os.urandom(3).hex()}"
            g.create_tenant(tenant, priority=cls)
            keys[cls] = str(g.create_key(tenant, priority=cls)["key"])
        s.fault("delay:300", count=ServiceModel.MIN_SAMPLES + 2)
        for _ in range(ServiceModel.MIN_SAMPLES + 1):  # learn the service time: 0.3 s
            assert chat(g.key).status_code == 200
        long = {"x-task-id": "long", "x-task-planned-steps": "64", "x-task-timeout": "3600"}
        assert chat(keys["batch"], **long).status_code == 200
        s.fault("delay:3000", count=2)
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            held = [pool.submit(chat, g.key) for _ in range(2)]  # both slots, 3 s
            time.sleep(0.5)
            h = {"x-task-id": "short", "x-task-planned-steps": "3", "x-task-timeout": "6"}
            step = chat(keys["interactive"], **h)
            assert all(x.result().status_code == 200 for x in held)
        assert step.status_code == 200, step.text
    finally:
        g.proc.stop()
        proc.stop()


# -- /mcp: a gateway with tool servers ------------------------------------------------------


class _PaidSearch(ScriptedToolServer):
    """An MCP server over Streamable HTTP (JSON replies) whose one tool, `search`, is
    priced: each tools/call it receives is counted (what the operator is billed for)
    and answered with an HTTP 500, as an overloaded paid API behind a proxy answers."""

    calls: list[dict[str, Any]] = []
    name = "paid"
    tools = [
        {
            "name": "search",
            "inputSchema": {"type": "object", "properties": {"q": {"type": "string"}}},
        }
    ]

    def call(self, msg: dict[str, Any]) -> Any:
        self.calls.append(msg["params"].get("arguments") or {})
        self.reply(500, "text/plain", b"internal error")
        return None


class Logs:
    def __init__(self) -> None:
        d = tempfile.mkdtemp(prefix="stop59-tools-")
        self.crm = os.path.join(d, "crm.log")
        self.shared = os.path.join(d, "shared.log")
        for p in (self.crm, self.shared):
            Path(p).touch()

    runs = staticmethod(tool_runs)


def _mcp_config(scripted: Scripted, logs: Logs, paid_port: int, **more: Any) -> dict[str, Any]:
    return cheap_config(
        scripted,
        mcp={
            "servers": [
                {
                    "name": "crm",
                    "command": [sys.executable, SERVER, "stdio", logs.crm],
                    "tool_prices": {"lookup": PRICE},
                    "timeout_s": 30,
                },
                {
                    # A server every tenant uses, under a breaker that opens after two
                    # failures and stays open long enough to be seen.
                    "name": "shared",
                    "command": [sys.executable, SERVER, "stdio", logs.shared],
                    "timeout_s": 10,
                    "breaker": {"failures": 2, "cooldown_s": 60},
                },
                {
                    "name": "paid",
                    "url": f"http://127.0.0.1:{paid_port}/mcp",
                    "tool_prices": {"search": 1.0},
                    "timeout_s": 5,
                },
            ],
            "max_result_bytes": MAX_RESULT,
        },
        tools={
            "registry": [
                {"name": "crm__lookup", "class": "read_only"},
                {"name": "crm__big", "class": "read_only"},
                {"name": "shared__hang", "class": "read_only"},
                {"name": "shared__lookup", "class": "read_only"},
                {"name": "paid__search", "class": "read_only"},
            ]
        },
        **more,
    )


@pytest.fixture(scope="module")
def paid() -> Iterator[int]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _PaidSearch)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server.server_address[1]
    server.shutdown()


@pytest.fixture(scope="module")
def logs() -> Logs:
    return Logs()


@pytest.fixture(scope="module")
def gw(scripted: Scripted, logs: Logs, paid: int) -> Iterator[Gateway]:
    g = start_gateway(_mcp_config(scripted, logs, paid))
    try:
        wait_tools_ready(g, ("crm", "shared", "paid"))
        yield g
    finally:
        g.proc.stop()


def _call(
    g: Gateway, key: str, sid: str, tool: str, args: dict[str, Any], **headers: str
) -> httpx.Response:
    body = {
        "jsonrpc": "2.0",
        "id": int.from_bytes(os.urandom(3), "big"),
        "method": "tools/call",
        "params": {"name": tool, "arguments": args},
    }
    return httpx.post(
        g.url + "/mcp", headers=in_session(key, sid, **headers), json=body, timeout=60
    )


def _code(r: httpx.Response) -> str:
    """`ok`, or the gateway's error code of a tools/call's JSON-RPC error."""
    assert "Traceback" not in r.text, r.text
    got = r.json()
    if "error" in got:
        return str(got["error"]["data"]["code"])
    assert r.status_code == 200, r.text
    return "tool_error" if got["result"].get("isError") else "ok"


def _tenant(g: Gateway, name: str) -> str:
    tenant = f"{name}-{os.urandom(3).hex()}"
    g.create_tenant(tenant)
    return str(g.create_key(tenant)["key"])


def _task_state(g: Gateway, key: str, task: str) -> dict[str, Any]:
    r = httpx.get(f"{g.url}/v1/tasks/{task}", headers={"authorization": f"Bearer {key}"})
    assert r.status_code == 200, r.text
    return dict(r.json())


def _race(
    g: Gateway, key: str, calls: list[tuple[str, dict[str, Any]]], **headers: str
) -> list[str]:
    """`calls` at once, each in its own session (opened first)."""
    sids = [open_session(g, key) for _ in calls]
    with concurrent.futures.ThreadPoolExecutor(len(calls)) as pool:
        jobs = [
            pool.submit(_call, g, key, sid, tool, args, **headers)
            for sid, (tool, args) in zip(sids, calls, strict=True)
        ]
        return [_code(j.result()) for j in jobs]


# -- /mcp: task headers are bounded where they are read -------------------------------------


@pytest.mark.parametrize(
    ("header", "value"),
    [
        ("x-task-budget", "tool_calls=0"),
        ("x-task-budget", "tool_calls=-1"),
        ("x-task-budget", "tool_calls=1e3"),
        ("x-task-budget", "tool_calls=1, tool_calls=2"),
        ("x-task-budget", "tool_calls=99999999999"),
        ("x-task-budget", "cost_usd=nan"),
        ("x-task-budget", "calls=1," + "x" * 300),
        ("x-task-timeout", "inf"),
        ("x-task-timeout", "0"),
        ("x-task-timeout", "1e9"),
        ("x-task-deadline", "9999-99-99T00:00:00Z"),
        ("x-task-deadline", "0000-01-01T00:00:00+14:00"),
        ("x-task-deadline", "2026-12-05T00:00:00+99:99"),
        ("x-task-deadline", "1700000000"),
    ],
)
def test_a_hostile_task_header_on_mcp_is_a_jsonrpc_400_naming_it(
    gw: Gateway, header: str, value: str
) -> None:
    sid = open_session(gw, gw.key)
    r = _call(gw, gw.key, sid, "crm__lookup", {"q": "h"}, **{"x-task-id": "h1", header: value})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["data"]["code"] == "invalid_header" and header in err["message"], r.text
    for leak in ("Traceback", "ValueError", "Overflow", "float("):
        assert leak not in r.text, r.text


# -- /mcp: no spend past a task's budget, whatever the shape ---------------------------------


def test_ten_tool_calls_at_once_take_exactly_the_tool_calls_left(gw: Gateway, logs: Logs) -> None:
    key = _tenant(gw, "race")
    task = "race-" + os.urandom(4).hex()
    marker = "race-" + os.urandom(3).hex()
    calls = [("crm__lookup", {"q": f"{marker}-{i}"}) for i in range(10)]
    codes = _race(gw, key, calls, **{"x-task-id": task, "x-task-budget": "tool_calls=3"})
    assert codes.count("ok") == 3 and codes.count("task_budget_exceeded") == 7, codes
    ran = sum(Logs.runs(logs.crm, "lookup", q=f"{marker}-{i}") for i in range(10))
    assert ran == 3
    assert _task_state(gw, key, task)["used"]["tool_calls"] == 3


def test_priced_tool_calls_at_once_never_pass_the_last_cent(gw: Gateway, logs: Logs) -> None:
    key = _tenant(gw, "cents")
    task = "cents-" + os.urandom(4).hex()
    marker = "cents-" + os.urandom(3).hex()
    calls = [("crm__lookup", {"q": f"{marker}-{i}"}) for i in range(10)]
    budget = f"cost_usd={PRICE * 2.5:.3f}"
    codes = _race(gw, key, calls, **{"x-task-id": task, "x-task-budget": budget})
    assert codes.count("ok") == 2, codes
    ran = sum(Logs.runs(logs.crm, "lookup", q=f"{marker}-{i}") for i in range(10))
    assert ran == 2
    assert _task_state(gw, key, task)["used"]["cost_usd"] == pytest.approx(2 * PRICE)


def test_tool_calls_and_model_calls_of_one_task_racing_the_last_cent(
    gw: Gateway, logs: Logs
) -> None:
    """Three priced tool calls ($0.02) and three model calls (10 tokens: $0.01 each) of
    one task at once, against $0.035: whatever wins, the task never spends past it."""
    key = _tenant(gw, "mixed")
    task = "mixed-" + os.urandom(4).hex()
    marker = "mixed-" + os.urandom(3).hex()
    h = {"x-task-id": task, "x-task-budget": "cost_usd=0.035"}
    sids = [open_session(gw, key) for _ in range(3)]

    def chat() -> int:
        body = {
            "model": "cheap",
            "max_tokens": 10,
            "messages": [{"role": "user", "content": "hi"}],
        }
        r = httpx.post(
            gw.url + "/v1/chat/completions",
            json=body,
            headers={"authorization": f"Bearer {key}", **h},
            timeout=60,
        )
        return r.status_code

    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        tools = [
            pool.submit(_call, gw, key, sid, "crm__lookup", {"q": f"{marker}-{i}"}, **h)
            for i, sid in enumerate(sids)
        ]
        chats = [pool.submit(chat) for _ in range(3)]
        codes = [_code(t.result()) for t in tools]
        statuses = [c.result() for c in chats]
    used = _task_state(gw, key, task)["used"]
    assert used["cost_usd"] <= 0.035 + 1e-9, (used, codes, statuses)
    ran = sum(Logs.runs(logs.crm, "lookup", q=f"{marker}-{i}") for i in range(3))
    rows = [r for r in gw.usage(task=task) if r["status"] == "ok"]
    spent = sum(float(r["cost_usd"] or 0) for r in rows)
    assert ran * PRICE <= 0.035 + 1e-9 and spent <= 0.035 + 1e-9, (ran, rows)


def test_another_tenants_task_id_is_its_own_task(gw: Gateway) -> None:
    """Tenant B naming tenant A's task id neither spends nor reads A's tool calls."""
    key_a, key_b = _tenant(gw, "ta"), _tenant(gw, "tb")
    task = "same-" + os.urandom(4).hex()
    h = {"x-task-id": task, "x-task-budget": "tool_calls=1"}
    sid_a, sid_b = open_session(gw, key_a), open_session(gw, key_b)
    assert _code(_call(gw, key_a, sid_a, "crm__lookup", {"q": "a"}, **h)) == "ok"
    assert _code(_call(gw, key_a, sid_a, "crm__lookup", {"q": "a"}, **h)) == "task_budget_exceeded"
    assert _code(_call(gw, key_b, sid_b, "crm__lookup", {"q": "b"}, **h)) == "ok"
    assert _task_state(gw, key_b, task)["used"]["tool_calls"] == 1
    assert _task_state(gw, key_a, task)["used"]["tool_calls"] == 1
    r = httpx.delete(f"{gw.url}/v1/tasks/{task}", headers={"authorization": f"Bearer {key_b}"})
    assert r.status_code == 200, r.text
    # B cancelled its own task, not A's: A's budget still answers, not a cancel.
    assert _code(_call(gw, key_a, sid_a, "crm__lookup", {"q": "a"}, **h)) == "task_budget_exceeded"


def test_through_redis_two_gateways_never_pass_a_tasks_tool_budget(
    scripted: Scripted, logs: Logs, paid: int
) -> None:
    """The Redis task store's Lua scripts, over two gateway processes: ten tool calls of
    one task at once, half through each gateway, take exactly the tool_calls left; ten
    priced ones exactly the cents left; priced tool calls through one gateway racing
    model calls through the other never pass the task's cost_usd."""
    redis_proc, url = start_redis()
    config = _mcp_config(scripted, logs, paid, storage={"redis_url": url})
    a = start_gateway(config)
    b = start_gateway(config, db=a.db)
    try:
        b.key = a.key
        wait_tools_ready(a, ("crm", "shared", "paid"))
        wait_tools_ready(b, ("crm", "shared", "paid"))

        def race(task: str, budget: str, marker: str) -> list[str]:
            h = {"x-task-id": task, "x-task-budget": budget}
            sids = [(g, open_session(g, a.key)) for g in (a, b) * 5]
            with concurrent.futures.ThreadPoolExecutor(10) as pool:
                jobs = [
                    pool.submit(_call, g, a.key, sid, "crm__lookup", {"q": f"{marker}-{i}"}, **h)
                    for i, (g, sid) in enumerate(sids)
                ]
                return [_code(j.result()) for j in jobs]

        task = "redis-" + os.urandom(4).hex()
        marker = "redis-" + os.urandom(3).hex()
        codes = race(task, "tool_calls=3", marker)
        assert codes.count("ok") == 3, codes
        assert sum(Logs.runs(logs.crm, "lookup", q=f"{marker}-{i}") for i in range(10)) == 3
        assert _task_state(b, a.key, task)["used"]["tool_calls"] == 3

        task = "redis-cents-" + os.urandom(4).hex()
        marker = "redis-cents-" + os.urandom(3).hex()
        codes = race(task, f"cost_usd={PRICE * 2.5:.3f}", marker)
        assert codes.count("ok") == 2, codes
        assert sum(Logs.runs(logs.crm, "lookup", q=f"{marker}-{i}") for i in range(10)) == 2
        assert _task_state(a, a.key, task)["used"]["cost_usd"] == pytest.approx(2 * PRICE)

        task = "redis-mixed-" + os.urandom(4).hex()
        marker = "redis-mixed-" + os.urandom(3).hex()
        h = {"x-task-id": task, "x-task-budget": "cost_usd=0.035"}
        sids = [open_session(a, a.key) for _ in range(3)]
        chat = {"model": "cheap", "max_tokens": 10, "messages": [{"role": "user", "content": "hi"}]}
        with concurrent.futures.ThreadPoolExecutor(6) as pool:
            tools = [
                pool.submit(_call, a, a.key, sid, "crm__lookup", {"q": f"{marker}-{i}"}, **h)
                for i, sid in enumerate(sids)
            ]
            chats = [
                pool.submit(b.post, "/v1/chat/completions", json=chat, headers=h) for _ in range(3)
            ]
            codes = [_code(t.result()) for t in tools]
            statuses = [c.result().status_code for c in chats]
        used = _task_state(a, a.key, task)["used"]
        assert used["cost_usd"] <= 0.035 + 1e-9, (used, codes, statuses)
        ran = sum(Logs.runs(logs.crm, "lookup", q=f"{marker}-{i}") for i in range(3))
        assert ran * PRICE <= 0.035 + 1e-9, (ran, codes, statuses)
    finally:
        a.proc.stop()
        b.proc.stop()
        stop_redis(redis_proc)


# -- /mcp: findings in files under rewrite (mcp_service/, engines/mcp_servers.py) --------


def test_a_clients_own_short_timeout_does_not_open_the_breaker_for_everyone(
    gw: Gateway, logs: Logs
) -> None:
    """Tenant A asks for 50 ms on a tool that takes a second, twice: its own calls time
    out, as it asked. The server is healthy; tenant B's call to it must still run."""
    key_a, key_b = _tenant(gw, "short"), _tenant(gw, "victim")
    sid_a, sid_b = open_session(gw, key_a), open_session(gw, key_b)
    for _ in range(2):
        r = _call(
            gw, key_a, sid_a, "shared__hang", {"seconds": 1.0}, **{"x-request-timeout": "0.05"}
        )
        assert _code(r) == "tool_timeout", r.text
    marker = "victim-" + os.urandom(3).hex()
    r = _call(gw, key_b, sid_b, "shared__lookup", {"q": marker})
    assert _code(r) == "ok", r.text
    assert Logs.runs(logs.shared, "lookup", q=marker) == 1


def test_a_priced_call_is_sent_no_more_often_than_the_task_paid_for(gw: Gateway) -> None:
    """A task with $1.00 left calls a $1.00 read-only tool whose server answers HTTP 500
    (it may have run: the gateway itself says a server error leaves a call in doubt).
    The gateway may send it once; a second send is a second $1.00 the task never had."""
    key = _tenant(gw, "paid")
    task = "paid-" + os.urandom(4).hex()
    sid = open_session(gw, key)
    before = len(_PaidSearch.calls)
    r = _call(
        gw,
        key,
        sid,
        "paid__search",
        {"q": "x"},
        **{"x-task-id": task, "x-task-budget": "cost_usd=1"},
    )
    assert _code(r) == "tool_server_error", r.text
    sent = len(_PaidSearch.calls) - before
    charged = _task_state(gw, key, task)["used"]["cost_usd"]
    assert sent * 1.0 <= charged + 1e-9, (sent, charged)


def test_a_tenants_usd_budget_counts_its_tool_prices(gw: Gateway, logs: Logs) -> None:
    """A tenant with $0.03 a day calls a $0.02 tool four times, outside any task: its
    budget pays for one call. (The usage rows carry each price, so a restarted gateway,
    reading its spend back from the ledger, would count them: the live limiter does
    not.)"""
    tenant = "usd-" + os.urandom(3).hex()
    gw.create_tenant(tenant, budget_usd=0.03, budget_period="day")
    key = str(gw.create_key(tenant)["key"])
    sid = open_session(gw, key)
    marker = "usd-" + os.urandom(3).hex()
    codes = [_code(_call(gw, key, sid, "crm__lookup", {"q": f"{marker}-{i}"})) for i in range(4)]
    ran = sum(Logs.runs(logs.crm, "lookup", q=f"{marker}-{i}") for i in range(4))
    assert ran * PRICE <= 0.03 + 1e-9, (ran, codes)


def _peak_rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    raise AssertionError("no VmHWM")


def test_a_result_far_over_the_cap_breaks_nothing_for_other_tenants(gw: Gateway) -> None:
    """A client asks a read-only stdio tool for 24 MB where the gateway keeps 4 KiB
    (the tool is the operator's; the size is the client's argument). The call must be
    refused `tool_result_too_large`; the server's connection, which every tenant's calls
    share, must survive it (no restart, no failures against its breaker), another
    tenant's call must run, and the gateway must not hold the result in memory."""
    n = 24_000_000
    pid = gw.proc.popen.pid
    before = _peak_rss_kib(pid)
    key_b = _tenant(gw, "bystander")
    sid, sid_b = open_session(gw, gw.key), open_session(gw, key_b)
    r = _call(gw, gw.key, sid, "crm__big", {"n": n})
    grown_mb = (_peak_rss_kib(pid) - before) / 1024
    got = _code(r)
    time.sleep(0.5)
    crm = httpx.get(gw.url + "/readyz", headers=gw.admin).json()["models"]["mcp:crm"]
    other = _code(_call(gw, key_b, sid_b, "crm__lookup", {"q": "bystander"}))
    assert (got, other) == ("tool_result_too_large", "ok"), (got, other, crm)
    assert crm["restarts"] == 0 and crm["breaker"]["consecutive_failures"] == 0, crm
    assert grown_mb < 16, f"the gateway's peak memory grew by {grown_mb:.0f} MB"
