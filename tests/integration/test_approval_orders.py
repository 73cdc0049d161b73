"""Approvals hold for any message order and role (policy/tool_calls.py, the
`tool_results` stage): a result placed before an assistant turn, or carried by a
legacy `function` message, is checked like one at the end; an approved call stays
approved for the later turns of its conversation; a history too long to check is
refused, never checked in part.

Generated histories drive the pure decision (`tool_results`, `approvals_needed`,
`new_results`) against a naive oracle, and the real stage over the real stores
(MemoryStore's approvals, MemoryTaskStore); a few concrete cases go through a real
gateway in front of a scripted upstream."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from support.gateways import Gateway, start_gateway
from support.upstreams import Scripted
from switchyard.config import ToolsConfig
from switchyard.errors import ApprovalRequired, InvalidRequest
from switchyard.identity import Limits, TaskBudget
from switchyard.pipeline import RequestContext, RequestInput, Timings
from switchyard.policy.stages import ToolResults
from switchyard.policy.tool_calls import (
    MAX_TOOL_RESULTS,
    ToolPolicy,
    approvals_needed,
    new_results,
    tool_results,
)
from switchyard.request import Generation
from switchyard.state.approvals import ApprovalStore
from switchyard.state.store import MemoryStore
from switchyard.state.tasks import TaskFirst, ToolCallNote
from switchyard.state.tasks_memory import MemoryTaskStore

REGISTRY = [
    {"name": "send_email", "class": "side_effect", "requires_approval": True},
    {"name": "wire", "class": "side_effect", "requires_approval": True},
    {"name": "search", "class": "read_only"},
    {"name": "note", "class": "side_effect"},
]
GATED = {"send_email", "wire"}
POLICY = ToolPolicy(ToolsConfig.model_validate({"registry": REGISTRY}))
TENANT = "acme"

# -- generated histories -----------------------------------------------------------

IDS = ["call_sya_a", "call_sya_b", "call_c", "call_d", "function:send_email"]
NAMES = ["send_email", "wire", "search", "note"]

_tool_call = st.builds(
    lambda cid, name: {
        "id": cid,
        "type": "function",
        "function": {"name": name, "arguments": "{}"},
    },
    st.sampled_from(IDS),
    st.sampled_from(NAMES),
)
_message = st.one_of(
    st.just({"role": "user", "content": "u"}),
    st.just({"role": "assistant", "content": "Done."}),
    st.builds(
        lambda calls: {"role": "assistant", "content": None, "tool_calls": calls},
        st.lists(_tool_call, min_size=1, max_size=3),
    ),
    st.builds(
        lambda name: {"role": "assistant", "content": None, "function_call": {"name": name}},
        st.sampled_from(NAMES),
    ),
    st.builds(
        lambda cid, name: (
            {"role": "tool", "tool_call_id": cid, "content": "r"} | ({"name": name} if name else {})
        ),
        st.sampled_from(IDS),
        st.one_of(st.none(), st.sampled_from(NAMES)),
    ),
    st.builds(
        lambda name: {"role": "function", "name": name, "content": "r"},
        st.sampled_from(NAMES),
    ),
)
histories = st.lists(_message, min_size=1, max_size=14)
# The task's own record of some calls (call id → the tool the gateway relayed).
records = st.dictionaries(st.sampled_from(IDS), st.sampled_from(NAMES), max_size=3)


def oracle(messages: list[dict[str, Any]], noted: dict[str, str]) -> tuple[set[str], Counter[str]]:
    """Written from the rule, not the code: the call ids whose results need an
    approval, and how many legacy function results of each gated name there are."""
    ids: set[str] = set()
    functions: Counter[str] = Counter()
    for i, m in enumerate(messages):
        if m["role"] == "tool":
            cid = m["tool_call_id"]
            names = {m.get("name"), noted.get(cid)}
            for a in messages:
                for c in a.get("tool_calls") or []:
                    if c["id"] == cid:
                        names.add(c["function"]["name"])
            if cid.startswith("call_sya_") or names & GATED:
                ids.add(cid)
        elif m["role"] == "function":
            before = [a for a in messages[:i] if a["role"] == "assistant"]
            answered = (before[-1].get("function_call") or {}).get("name") if before else None
            gated = sorted({m["name"], answered} & GATED)
            if gated:
                functions["function:" + gated[0]] += 1
    return ids, functions


@settings(max_examples=400, deadline=None)
@given(histories, records)
def test_every_result_that_needs_an_approval_is_found(
    messages: list[dict[str, Any]], noted: dict[str, str]
) -> None:
    """Whatever the order, roles, interleaved assistant turns or duplicated ids, the
    results the decision asks an approval for are exactly the oracle's."""
    needed = approvals_needed(tool_results(messages), POLICY, noted)
    ids, functions = oracle(messages, noted)
    by_role: dict[str, list[Any]] = {"tool": [], "function": []}
    for n in needed:
        by_role[messages[n.index]["role"]].append(n)
    assert {n.approval_id for n in by_role["tool"]} == ids
    assert len(by_role["tool"]) == len(ids)  # one approval per call, however often
    assert Counter(n.approval_id for n in by_role["function"]) == functions
    # Only a call id may be covered by an approval consumed earlier, and never one
    # that could pass for a function result's.
    for n in needed:
        assert n.reusable == (
            messages[n.index]["role"] == "tool" and not n.approval_id.startswith("function:")
        )


@settings(max_examples=200, deadline=None)
@given(histories, st.dictionaries(st.sampled_from(IDS), st.integers(0, 2), max_size=4))
def test_what_is_new_is_decided_by_the_tasks_record(
    messages: list[dict[str, Any]], counts: dict[str, int]
) -> None:
    """Every result after the last assistant message is new; an earlier one is new
    when the task's record knows its call with no result yet."""
    last = max((i for i, m in enumerate(messages) if m["role"] == "assistant"), default=-1)
    want = [
        m["tool_call_id"]
        for i, m in enumerate(messages)
        if m["role"] == "tool" and (i > last or counts.get(m["tool_call_id"]) == 0)
    ]
    assert new_results(tool_results(messages), counts) == want


# -- the real stage over the real stores -------------------------------------------


def _ctx(messages: list[dict[str, Any]], task: str | None, tokens: list[str]) -> RequestContext:
    headers = {"x-switchyard-approval": ", ".join(tokens)} if tokens else {}
    now = time.perf_counter()
    ctx = RequestContext(
        RequestInput(f"req_{time.monotonic_ns()}", "chat.completions", time.time(), headers, task),
        Generation(model="m", messages=messages),
        Timings(now),
        now + 30,
    )
    ctx.principal = SimpleNamespace(tenant_id=TENANT)
    return ctx


async def _run(stage: ToolResults, ctx: RequestContext) -> None:
    pending = stage.work(ctx)
    if pending is not None:
        await pending


# Approvals issued before the request: (call id, consumed earlier, scope), where the
# scope is the request's task, no task (valid in any task) or another task.
_approvals = st.lists(
    st.tuples(
        st.sampled_from([*IDS, "function:wire"]),
        st.booleans(),
        st.sampled_from(["own", "none", "other"]),
    ),
    max_size=4,
)


@settings(max_examples=300, deadline=None)
@given(histories, records, _approvals, st.booleans(), st.data())
def test_the_stage_never_forwards_an_unapproved_result(
    messages: list[dict[str, Any]],
    noted: dict[str, str],
    noise: list[tuple[str, bool, str]],
    in_task: bool,
    data: st.DataObject,
) -> None:
    """The stage lets a request through exactly when every result that needs an
    approval has one: used by an earlier request for the same call (in scope), or
    presented now. When it does, the approvals table shows each of them used."""
    ids, functions = oracle(messages, noted if in_task else {})
    # Often approvals for much of what the history needs (earlier or now, in one
    # scope or another), always some that do not fit.
    fitting = st.tuples(
        st.sampled_from(sorted(ids | set(functions)) or IDS),
        st.booleans(),
        st.sampled_from(["own", "own", "none", "other"]),
    )
    approvals = data.draw(st.lists(fitting, max_size=8)) + noise
    asyncio.run(_stage_case(messages, noted, approvals, in_task))


async def _stage_case(
    messages: list[dict[str, Any]],
    noted: dict[str, str],
    approvals: list[tuple[str, bool, str]],
    in_task: bool,
) -> None:
    store = MemoryStore(Limits(), 60.0)
    tasks = MemoryTaskStore()
    task = "t-1" if in_task else None
    if task is not None:  # the task exists and its record knows some calls
        await tasks.admit((TENANT, task), TaskFirst(TaskBudget()), "req_0", 0, 0.0, time.time())
        notes = [ToolCallNote(c, tool, "side_effect", "req_0", None) for c, tool in noted.items()]
        await tasks.note_tool_calls((TENANT, task), notes)
    record = noted if task is not None else {}
    stage = ToolResults(POLICY, tasks, store.consume_approval, store.consumed_approvals)
    before: set[str] = set()
    fresh: Counter[str] = Counter()
    presented = []
    for call_id, used, scope in approvals:
        scoped = {"own": task, "none": None, "other": "t-other"}[scope]
        issued = store.approvals.issue(TENANT, scoped, call_id, "ops", 60.0)
        valid = scoped is None or scoped == task
        if used:  # consumed by an earlier request of its own scope
            assert store.approvals.consume(issued["token"], TENANT, scoped, call_id, "r0")[0]
            before |= {call_id} if valid else set()
        else:
            presented.append(issued["token"])
            fresh[call_id] += 1 if valid else 0
    ids, functions = oracle(messages, record)
    # Fresh approvals each call id must have now: one per function result, one per
    # call not approved before (an id like `function:...` never counts as approved).
    demand = Counter(functions)
    demand.update(c for c in ids if c not in before or c.startswith("function:"))
    covered = all(fresh[c] >= n for c, n in demand.items())
    ctx = _ctx(messages, task, presented)
    try:
        await _run(stage, ctx)
    except ApprovalRequired:
        assert not covered, ctx.decisions[-1]
        event("refused")
        return
    assert covered, (ids, functions, before, fresh)
    event("forwarded with approvals" if demand or ids else "forwarded, none needed")
    with store.connection() as conn:
        rows = conn.execute(
            "SELECT call_id, used_by FROM approvals WHERE used_at IS NOT NULL AND tenant_id = ?"
            " AND (task_id IS NULL OR task_id = ?)",
            (TENANT, task),
        ).fetchall()
    used = {r[0] for r in rows}
    now = Counter(r[0] for r in rows if r[1] == ctx.input.request_id)
    assert ids <= used
    assert all(now[c] >= n for c, n in demand.items())
    if task is not None:  # every known call whose result the history carries is counted
        for m in messages:
            if m["role"] == "tool" and m["tool_call_id"] in noted:
                note = await tasks.tool_call((TENANT, task), m["tool_call_id"])
                assert note is not None and note.results >= 1


def test_results_beyond_the_bound_are_refused_not_skipped() -> None:
    """257 results with the one that needs an approval last: a 400, where checking the
    first 256 would have let it through."""
    head = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]
    many = [{"role": "tool", "tool_call_id": f"c{i}", "content": "r"} for i in range(256)]
    last = {"role": "tool", "tool_call_id": "call_sya_z", "content": "r"}
    assert len(tool_results(head + many)) == MAX_TOOL_RESULTS
    with pytest.raises(InvalidRequest) as exc:
        tool_results([*head, *many, last])
    assert exc.value.code == "too_many_tool_results" and exc.value.status == 400
    # A function message counts as a result too.
    fn = {"role": "function", "name": "send_email", "content": "r"}
    with pytest.raises(InvalidRequest):
        tool_results([*head, *many, fn])


@pytest.mark.parametrize(
    ("message", "param"),
    [
        ({"role": "tool", "tool_call_id": "", "content": "r"}, "messages[1].tool_call_id"),
        ({"role": "function", "content": "r"}, "messages[1].name"),
    ],
)
def test_a_result_that_cannot_be_told_apart_is_refused(message: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidRequest) as exc:
        tool_results([{"role": "user", "content": "x"}, message])
    assert exc.value.param == param


def test_consumed_is_scoped_like_consume() -> None:
    """ApprovalStore.consumed answers for used approvals only, of this tenant, issued
    for this task or for none; the same rule `consume` applies."""
    store = MemoryStore(Limits(), 60.0)
    approvals: ApprovalStore = store.approvals
    for tenant, task, call, use in [
        ("acme", "t1", "a", True),
        ("acme", None, "b", True),
        ("acme", "t2", "c", True),
        ("acme", "t1", "d", False),
        ("zeta", "t1", "e", True),
    ]:
        token = approvals.issue(tenant, task, call, "ops", 60.0)["token"]
        if use:
            assert approvals.consume(token, tenant, task, call, "r")[0] == "ops"
            assert approvals.consume(token, tenant, task, call, "r2") == (
                None,
                "the approval was already used",
            )
    ask = ["a", "b", "c", "d", "e", "f"]
    assert approvals.consumed("acme", "t1", ask) == {"a", "b"}
    assert approvals.consumed("acme", None, ask) == {"b"}
    assert approvals.consumed("zeta", "t1", ask) == {"e"}
    assert approvals.consumed("acme", "t1", []) == set()


# -- through the real gateway ------------------------------------------------------

TIMEOUTS = {"connect_s": 1, "first_byte_s": 10, "total_s": 30}


@pytest.fixture(scope="module")
def upstream(scripted: Scripted) -> Scripted:
    return scripted  # conftest's, under the name these tests read it by


@pytest.fixture(scope="module")
def gw(upstream: Scripted) -> Iterator[Gateway]:
    g = start_gateway(
        {
            "tools": {"registry": REGISTRY},
            "models": [
                {
                    "alias": "m",
                    "engine": {"kind": "openai", "base_url": upstream.url + "/v1"},
                    "timeouts": TIMEOUTS,
                }
            ],
        }
    )
    yield g
    g.proc.stop()


ASK = {"role": "user", "content": "mail the cfo"}


def _who(gw: Gateway) -> dict[str, str]:
    tenant = f"orders-{time.monotonic_ns()}"
    gw.create_tenant(tenant)
    return {"Authorization": f"Bearer {gw.create_key(tenant)['key']}", "tenant": tenant}


def _post(gw: Gateway, who: dict[str, str], messages: list[Any], **headers: str) -> httpx.Response:
    h = {"Authorization": who["Authorization"], **headers}
    body = {"model": "m", "messages": messages}
    return httpx.post(gw.url + "/v1/chat/completions", json=body, headers=h, timeout=30)


def _decision(gw: Gateway, r: httpx.Response) -> dict[str, Any]:
    trace = gw.trace(r.headers["x-request-id"])
    return next(d for d in trace["decisions"] if d["stage"] == "tool_results")


def _results(gw: Gateway, who: dict[str, str], task: str, call_id: str) -> int:
    r = httpx.get(f"{gw.url}/v1/tasks/{task}", headers={"Authorization": who["Authorization"]})
    assert r.status_code == 200, r.text
    return next(int(c["results"]) for c in r.json()["tool_calls"] if c["call_id"] == call_id)


def _send_email_call(gw: Gateway, upstream: Scripted, who: dict[str, str], **h: str) -> Any:
    httpx.put(
        upstream.url + "/control/tool_calls",
        json={"calls": [{"name": "send_email", "arguments": {"to": "cfo@example.com"}}]},
    ).raise_for_status()
    r = _post(gw, who, [ASK], **h)
    httpx.put(upstream.url + "/control/tool_calls", json={"calls": []}).raise_for_status()
    assert r.status_code == 200, r.text
    message = r.json()["choices"][0]["message"]
    assert message["tool_calls"][0]["id"].startswith("call_sya_")
    return message


def test_a_result_before_a_trailing_assistant_turn_needs_its_approval(
    gw: Gateway, upstream: Scripted
) -> None:
    """The finding: the result sits before {"role": "assistant", "content": "Done."}.
    It is refused before anything goes upstream and left uncounted; approved, it
    passes and is counted; the conversation's later turns pass on that approval."""
    who = _who(gw)
    task = f"o-{time.monotonic_ns()}"
    h = {"x-task-id": task}
    call = _send_email_call(gw, upstream, who, **h)
    cid = call["tool_calls"][0]["id"]
    history = [
        ASK,
        call,
        {"role": "tool", "tool_call_id": cid, "content": "sent"},
        {"role": "assistant", "content": "Done."},
        {"role": "user", "content": "anything else?"},
    ]
    sent = upstream.requests()
    r = _post(gw, who, history, **h)
    assert r.status_code == 403 and r.json()["error"]["code"] == "approval_required", r.text
    assert cid in r.json()["error"]["message"]
    assert upstream.requests() == sent  # refused before the upstream saw it
    assert _results(gw, who, task, cid) == 0
    token = gw.approve(who["tenant"], task, cid)
    r = _post(gw, who, history, **h, **{"x-switchyard-approval": token})
    assert r.status_code == 200, r.text
    assert _decision(gw, r)["evidence"]["approved"] == [
        {"call_id": cid, "tool": "send_email", "approver": "ops-anna"}
    ]
    assert _results(gw, who, task, cid) == 1  # the task's record counts it now
    # A later turn carries the approved result as history: no new approval needed,
    # and it is not counted again.
    later = [*history, {"role": "assistant", "content": "No."}, {"role": "user", "content": "ok"}]
    r = _post(gw, who, later, **h)
    assert r.status_code == 200, r.text
    assert _decision(gw, r)["evidence"]["approved_before"] == [cid]
    assert _results(gw, who, task, cid) == 1
    # Outside a task the same holds for a fresh call: refused until approved.
    call = _send_email_call(gw, upstream, who)
    result = {"role": "tool", "tool_call_id": call["tool_calls"][0]["id"], "content": "sent"}
    other = [ASK, call, result, {"role": "assistant", "content": "Done."}]
    r = _post(gw, who, other)
    assert r.status_code == 403 and r.json()["error"]["code"] == "approval_required", r.text


def test_a_legacy_function_result_needs_an_approval_each_time(
    gw: Gateway, upstream: Scripted
) -> None:
    """{"role": "function", "name": "send_email"} has no call id: it needs an approval
    for `function:send_email` in every request that carries it."""
    who = _who(gw)
    task = f"f-{time.monotonic_ns()}"
    h = {"x-task-id": task}
    history = [
        ASK,
        {
            "role": "assistant",
            "content": None,
            "function_call": {"name": "send_email", "arguments": "{}"},
        },
        {"role": "function", "name": "send_email", "content": "sent"},
        {"role": "assistant", "content": "Done."},
    ]
    sent = upstream.requests()
    r = _post(gw, who, history, **h)
    assert r.status_code == 403 and r.json()["error"]["code"] == "approval_required", r.text
    assert "function:send_email" in r.json()["error"]["message"]
    assert upstream.requests() == sent
    token = gw.approve(who["tenant"], task, "function:send_email")
    r = _post(gw, who, history, **h, **{"x-switchyard-approval": token})
    assert r.status_code == 200, r.text
    # No id ties a function result to the approval an earlier request used: again.
    r = _post(gw, who, history, **h)
    assert r.status_code == 403, r.text
    # Named only by the function_call it answers: the same.
    unnamed_call = [*history[:2], {"role": "function", "name": "lookup", "content": "sent"}]
    r = _post(gw, who, unnamed_call, **h)
    assert r.status_code == 403 and "function:send_email" in r.json()["error"]["message"]


def test_a_history_with_too_many_results_is_a_400(gw: Gateway) -> None:
    who = _who(gw)
    messages: list[Any] = [ASK, {"role": "assistant", "content": "y"}]
    messages += [{"role": "tool", "tool_call_id": f"c{i}", "content": "r"} for i in range(300)]
    r = _post(gw, who, messages, **{"x-task-id": f"b-{time.monotonic_ns()}"})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == "too_many_tool_results"


def test_both_task_stores_report_a_calls_results(redis_url: str) -> None:
    """The stage tells a result already counted from a new one by the record's count:
    RedisTaskStore.tool_call reports it as MemoryTaskStore's does (it read 0 always,
    so every later turn would have counted its history again as duplicates)."""
    from switchyard.state.tasks_redis import RedisTaskStore

    async def go() -> None:
        red = RedisTaskStore(redis_url, prefix=f"res{time.monotonic_ns()}:", timeout_s=5)
        try:
            for store in (MemoryTaskStore(), red):
                key = (TENANT, "t-1")
                await store.admit(key, TaskFirst(TaskBudget()), "r0", 0, 0.0, time.time())
                await store.note_tool_calls(
                    key, [ToolCallNote("c", "note", "side_effect", "r0", None)]
                )
                note = await store.tool_call(key, "c")
                assert note is not None and note.results == 0, store
                await store.note_results(key, ["c", "c"])
                note = await store.tool_call(key, "c")
                assert note is not None and note.results == 2, store
                assert await store.tool_call(key, "unknown") is None
        finally:
            await red.close()

    asyncio.run(go())
