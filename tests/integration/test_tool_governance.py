"""Tool calls under governance (policy/tool_calls.py): authorization on what the model
returns (streamed and not), idempotency keys for side effects, duplicate results and
approvals. A real gateway in front of a scripted upstream that returns tool calls."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from hypothesis import given
from hypothesis import strategies as st

from support.gateways import ADMIN_KEY, Gateway, start_gateway
from support.upstreams import Scripted, start_scripted
from switchyard.config import ToolsConfig
from switchyard.policy.tool_calls import (
    StreamToolGate,
    ToolGovernor,
    ToolPolicy,
    idempotency_key,
    new_results,
    tool_results,
)
from switchyard.request import Generation

REGISTRY = [
    {"name": "search", "class": "read_only"},
    {"name": "wire_money", "class": "side_effect", "allowed_tenants": ["bank"]},
    {"name": "send_email", "class": "side_effect", "requires_approval": True},
    {"name": "create_ticket", "class": "side_effect"},
]
TIMEOUTS = {"connect_s": 1, "first_byte_s": 10, "total_s": 30}


@pytest.fixture(scope="module")
def upstream() -> Iterator[Scripted]:
    proc, s = start_scripted()
    yield s
    proc.stop()


def _config(upstream: Scripted, mode: str = "block") -> dict[str, Any]:
    return {
        "tools": {"registry": REGISTRY, "on_forbidden_call": mode},
        "models": [
            {
                "alias": "m",
                "engine": {"kind": "openai", "base_url": upstream.url + "/v1"},
                "timeouts": TIMEOUTS,
            }
        ],
    }


@pytest.fixture(scope="module")
def gw(upstream: Scripted) -> Iterator[Gateway]:
    g = start_gateway(_config(upstream))
    yield g
    g.proc.stop()


def _calls(upstream: Scripted, *calls: tuple[str, dict[str, Any]]) -> None:
    body = {"calls": [{"name": n, "arguments": a} for n, a in calls]}
    r = httpx.put(upstream.url + "/control/tool_calls", json=body)
    assert r.status_code == 200, r.text


def _tenant(gw: Gateway, name: str) -> dict[str, str]:
    tenant = f"{name}-{time.monotonic_ns()}"
    gw.create_tenant(tenant)
    return {"Authorization": f"Bearer {gw.create_key(tenant)['key']}", "tenant": tenant}


def _post(gw: Gateway, who: dict[str, str], body: dict[str, Any], **headers: str) -> httpx.Response:
    h = {"Authorization": who["Authorization"], **headers}
    return httpx.post(gw.url + "/v1/chat/completions", json=body, headers=h, timeout=30)


ASK = {"model": "m", "messages": [{"role": "user", "content": "pay the invoice"}]}


def _sse(gw: Gateway, who: dict[str, str], body: dict[str, Any]) -> list[dict[str, Any]]:
    h = {"Authorization": who["Authorization"]}
    chunks = []
    with httpx.stream(
        "POST",
        gw.url + "/v1/chat/completions",
        json={**body, "stream": True},
        headers=h,
        timeout=30,
    ) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
    return chunks


def _assembled(chunks: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], str | None]:
    """The tool calls a client assembles from a stream, and the finish reason."""
    calls: dict[int, dict[str, Any]] = {}
    finish = None
    for c in chunks:
        for choice in c.get("choices") or []:
            finish = choice.get("finish_reason") or finish
            for d in (choice.get("delta") or {}).get("tool_calls") or []:
                call = calls.setdefault(d["index"], {"id": None, "name": None, "arguments": ""})
                call["id"] = d.get("id") or call["id"]
                fn = d.get("function") or {}
                call["name"] = fn.get("name") or call["name"]
                call["arguments"] += fn.get("arguments") or ""
    return [calls[i] for i in sorted(calls)], finish


def test_a_forbidden_call_is_removed_and_an_allowed_one_passes(
    gw: Gateway, upstream: Scripted
) -> None:
    who = _tenant(gw, "shop")
    _calls(upstream, ("search", {"q": "invoice 7"}), ("wire_money", {"to": "x", "usd": 500}))
    r = _post(gw, who, ASK)
    assert r.status_code == 200, r.text
    assert r.headers["x-switchyard-tools-blocked"] == "1"
    choice = r.json()["choices"][0]
    calls = choice["message"]["tool_calls"]
    assert [c["function"]["name"] for c in calls] == ["search"]
    # A read-only call is relayed as it came: same id, same arguments.
    assert calls[0]["id"] == "call_0"
    assert json.loads(calls[0]["function"]["arguments"]) == {"q": "invoice 7"}
    assert choice["finish_reason"] == "tool_calls"
    d = next(
        d for d in gw.trace(r.headers["x-request-id"])["decisions"] if d["stage"] == "tool_calls"
    )
    assert d["outcome"] == "blocked:1"
    blocked = [c for c in d["evidence"]["calls"] if c["action"] == "blocked"]
    assert blocked[0]["name"] == "wire_money" and "allowed_tenants" in blocked[0]["reason"]
    # Blocking every call: no tool_calls, finish_reason "stop".
    _calls(upstream, ("wire_money", {"to": "x", "usd": 500}))
    r = _post(gw, who, ASK)
    choice = r.json()["choices"][0]
    assert "tool_calls" not in choice["message"] and choice["finish_reason"] == "stop"
    assert choice["message"]["content"] == ""
    # The tenant the registry allows gets the call.
    bank = "bank"
    if httpx.get(f"{gw.url}/admin/tenants/{bank}", headers=gw.admin).status_code == 404:
        gw.create_tenant(bank)
    key = gw.create_key(bank)["key"]
    r = _post(gw, {"Authorization": f"Bearer {key}"}, ASK)
    assert [c["function"]["name"] for c in r.json()["choices"][0]["message"]["tool_calls"]] == [
        "wire_money"
    ]
    assert "x-switchyard-tools-blocked" not in r.headers


def test_a_streamed_forbidden_call_is_never_relayed(gw: Gateway, upstream: Scripted) -> None:
    who = _tenant(gw, "shop")
    _calls(
        upstream,
        ("search", {"q": "invoice 7"}),
        ("wire_money", {"to": "x", "usd": 500}),
        ("create_ticket", {"title": "late invoice"}),
    )
    chunks = _sse(gw, who, ASK)
    raw = json.dumps(chunks)
    assert "wire_money" not in raw and '"usd"' not in raw
    calls, finish = _assembled(chunks)
    assert [c["name"] for c in calls] == ["search", "create_ticket"]
    assert calls[0]["id"] == "call_0" and json.loads(calls[0]["arguments"]) == {"q": "invoice 7"}
    # The side-effecting call arrives whole, under its idempotency key.
    assert calls[1]["id"].startswith("call_sy_")
    assert json.loads(calls[1]["arguments"]) == {"title": "late invoice"}
    assert finish == "tool_calls"
    # The same step, not streamed, yields the same key.
    r = _post(gw, who, ASK)
    got = {c["function"]["name"]: c["id"] for c in r.json()["choices"][0]["message"]["tool_calls"]}
    assert got["create_ticket"] == calls[1]["id"]
    # Only forbidden calls: the stream says stop.
    _calls(upstream, ("wire_money", {"to": "x", "usd": 1}))
    chunks = _sse(gw, who, ASK)
    calls, finish = _assembled(chunks)
    assert calls == [] and finish == "stop" and "wire_money" not in json.dumps(chunks)


def test_side_effect_keys_are_stable_across_a_retried_step(gw: Gateway, upstream: Scripted) -> None:
    who = _tenant(gw, "keys")
    _calls(upstream, ("create_ticket", {"title": "t", "priority": 2}))
    task = {"x-task-id": f"k-{time.monotonic_ns()}", "x-parent-request-id": "req_parent_1"}
    ids = [
        _post(gw, who, ASK, **task).json()["choices"][0]["message"]["tool_calls"][0]["id"]
        for _ in range(2)
    ]
    assert ids[0] == ids[1] and ids[0].startswith("call_sy_") and len(ids[0]) == 8 + 32
    # The same arguments in another key order: the same canonical call.
    _calls(upstream, ("create_ticket", {"priority": 2, "title": "t"}))
    again = _post(gw, who, ASK, **task).json()["choices"][0]["message"]["tool_calls"][0]["id"]
    assert again == ids[0]
    # Another step (other parents) or other arguments: another key.
    other = {**task, "x-parent-request-id": "req_parent_2"}
    assert (
        _post(gw, who, ASK, **other).json()["choices"][0]["message"]["tool_calls"][0]["id"]
        != ids[0]
    )
    _calls(upstream, ("create_ticket", {"title": "u", "priority": 2}))
    assert (
        _post(gw, who, ASK, **task).json()["choices"][0]["message"]["tool_calls"][0]["id"] != ids[0]
    )


def _with_result(call_id: str, name: str) -> dict[str, Any]:
    return {
        "model": "m",
        "messages": [
            ASK["messages"][0],
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": call_id,
                        "type": "function",
                        "function": {"name": name, "arguments": "{}"},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": call_id, "content": "done"},
        ],
    }


def test_a_duplicate_side_effect_result_is_flagged(gw: Gateway, upstream: Scripted) -> None:
    who = _tenant(gw, "dup")
    task = {"x-task-id": f"d-{time.monotonic_ns()}"}
    _calls(upstream, ("create_ticket", {"title": "t"}))
    call_id = _post(gw, who, ASK, **task).json()["choices"][0]["message"]["tool_calls"][0]["id"]
    _calls(upstream)  # the model answers in text now
    decisions = []
    for _ in range(2):
        r = _post(gw, who, _with_result(call_id, "create_ticket"), **task)
        assert r.status_code == 200, r.text
        trace = gw.trace(r.headers["x-request-id"])
        decisions.append(next(d for d in trace["decisions"] if d["stage"] == "tool_results"))
    assert decisions[0]["outcome"] == "ok"
    assert decisions[1]["outcome"] == "duplicate:1"
    dup = decisions[1]["evidence"]["duplicates"][0]
    assert dup["call_id"] == call_id and dup["tool"] == "create_ticket" and dup["results"] == 2
    # The task report lists the side effect and the duplicate.
    time.sleep(0.3)
    t = httpx.get(
        f"{gw.url}/admin/tasks/{task['x-task-id']}",
        params={"tenant": who["tenant"]},
        headers=gw.admin,
    ).json()["task"]["governance"]
    assert [c["name"] for c in t["side_effects"]] == ["create_ticket"]
    assert [d["call_id"] for d in t["duplicate_results"]] == [call_id]


def test_a_result_that_needs_approval(gw: Gateway, upstream: Scripted) -> None:
    who = _tenant(gw, "appr")
    task_id = f"a-{time.monotonic_ns()}"
    task = {"x-task-id": task_id}
    _calls(upstream, ("send_email", {"to": "cfo@example.com"}))
    call_id = _post(gw, who, ASK, **task).json()["choices"][0]["message"]["tool_calls"][0]["id"]
    _calls(upstream)
    body = _with_result(call_id, "send_email")
    before = upstream.requests()
    r = _post(gw, who, body, **task)
    assert r.status_code == 403 and r.json()["error"]["code"] == "approval_required", r.text
    assert upstream.requests() == before  # refused before anything went upstream
    # Another tenant's approval does not count, nor one for another task.
    other = _tenant(gw, "appr-other")
    foreign = gw.approve(other["tenant"], task_id, call_id)
    r = _post(gw, who, body, **task, **{"x-switchyard-approval": foreign})
    assert r.status_code == 403
    wrong_task = gw.approve(who["tenant"], "another-task", call_id)
    r = _post(gw, who, body, **task, **{"x-switchyard-approval": wrong_task})
    assert r.status_code == 403
    token = gw.approve(who["tenant"], task_id, call_id)
    r = _post(gw, who, body, **task, **{"x-switchyard-approval": token})
    assert r.status_code == 200, r.text
    d = next(
        d for d in gw.trace(r.headers["x-request-id"])["decisions"] if d["stage"] == "tool_results"
    )
    assert d["evidence"]["approved"] == [
        {"call_id": call_id, "tool": "send_email", "approver": "ops-anna"}
    ]
    # The call is approved now: a retried step carries its result on that approval
    # (and is flagged as a duplicate result), without using another.
    r = _post(gw, who, body, **task)
    assert r.status_code == 200, r.text
    d = next(
        d for d in gw.trace(r.headers["x-request-id"])["decisions"] if d["stage"] == "tool_results"
    )
    assert d["evidence"]["approved_before"] == [call_id] and d["outcome"] == "duplicate:1"
    # A token approves its own call only: spent on one, it approves no other.
    _calls(upstream, ("send_email", {"to": "ceo@example.com"}))
    call_id = _post(gw, who, ASK, **task).json()["choices"][0]["message"]["tool_calls"][0]["id"]
    _calls(upstream)
    body = _with_result(call_id, "send_email")
    r = _post(gw, who, body, **task, **{"x-switchyard-approval": token})
    assert r.status_code == 403, r.text
    # The CLI issues the same kind of approval, on the gateway's database.
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "switchyard",
            "approve",
            task_id,
            call_id,
            "--tenant",
            who["tenant"],
            "--approver",
            "ops-ben",
            "--db",
            gw.db,
        ],
        capture_output=True,
        text=True,
        env={**os.environ, "SWITCHYARD_ADMIN_KEY": ADMIN_KEY},
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    token = json.loads(out.stdout)["token"]
    r = _post(gw, who, body, **task, **{"x-switchyard-approval": token})
    assert r.status_code == 200, r.text


def test_outside_a_task_a_renamed_call_still_needs_its_approval(
    gw: Gateway, upstream: Scripted
) -> None:
    """Outside a task the gateway keeps no note of the calls it relayed, and the client
    writes the conversation it sends back: the id says the call needs an approval."""
    who = _tenant(gw, "forge")
    _calls(upstream, ("send_email", {"to": "cfo@example.com"}), ("search", {"q": "x"}))
    calls = _post(gw, who, ASK).json()["choices"][0]["message"]["tool_calls"]
    ids = {c["function"]["name"]: c["id"] for c in calls}
    assert ids["send_email"].startswith("call_sya_"), ids  # keyed, with its own prefix
    assert not ids["search"].startswith("call_sy"), ids  # read-only, no approval: as it came
    _calls(upstream)
    forged = _with_result(ids["send_email"], "search")  # the history renames the tool
    r = _post(gw, who, forged)
    assert r.status_code == 403 and r.json()["error"]["code"] == "approval_required", r.text
    token = gw.approve(who["tenant"], None, ids["send_email"])
    assert _post(gw, who, forged, **{"x-switchyard-approval": token}).status_code == 200
    # A read-only call's result needs nothing.
    assert _post(gw, who, _with_result(ids["search"], "search")).status_code == 200


def test_flag_mode_relays_a_forbidden_call_and_records_it(upstream: Scripted) -> None:
    g = start_gateway(_config(upstream, mode="flag"))
    try:
        _calls(upstream, ("wire_money", {"to": "x", "usd": 5}))
        r = g.post("/v1/chat/completions", json=ASK)
        assert [c["function"]["name"] for c in r.json()["choices"][0]["message"]["tool_calls"]] == [
            "wire_money"
        ]
        assert "x-switchyard-tools-blocked" not in r.headers
        d = next(
            d for d in g.trace(r.headers["x-request-id"])["decisions"] if d["stage"] == "tool_calls"
        )
        assert d["outcome"] == "flagged:1"
    finally:
        g.proc.stop()


# -- the stream gate equals the reply's governance -----------------------------------------

names = st.sampled_from(["search", "wire_money", "create_ticket", "rm"])
arguments = st.dictionaries(st.sampled_from(["a", "b", "c"]), st.integers(0, 9), max_size=3)


def _stream_of(calls: list[tuple[str, dict[str, Any]]], cut: int) -> list[dict[str, Any]]:
    """The calls as a stream, each call's arguments cut into pieces of `cut` characters."""
    chunks: list[dict[str, Any]] = []
    for i, (name, args) in enumerate(calls):
        text = json.dumps(args)
        head = {"index": i, "id": f"call_{i}", "type": "function"}
        head["function"] = {"name": name, "arguments": ""}
        chunks.append(
            {"choices": [{"index": 0, "delta": {"tool_calls": [head]}, "finish_reason": None}]}
        )
        for j in range(0, len(text), cut):
            piece = {"index": i, "function": {"arguments": text[j : j + cut]}}
            chunks.append(
                {"choices": [{"index": 0, "delta": {"tool_calls": [piece]}, "finish_reason": None}]}
            )
    chunks.append({"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]})
    return chunks


@given(
    st.lists(st.tuples(names, arguments), min_size=1, max_size=4),
    st.integers(1, 7),
    st.sampled_from(["block", "flag"]),
)
def test_a_governed_stream_assembles_to_the_governed_reply(
    calls: list[tuple[str, dict[str, Any]]], cut: int, mode: str
) -> None:
    """Whatever the pieces, a client assembling the governed stream gets exactly the
    calls, ids, arguments and finish reason of the governed non-streamed reply."""
    policy = ToolPolicy(
        ToolsConfig.model_validate(
            {"registry": REGISTRY, "deny": ["rm"], "on_forbidden_call": mode}
        )
    )
    body = Generation(model="m", messages=ASK["messages"])
    reply = {
        "choices": [
            {
                "index": 0,
                "message": {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": f"call_{i}",
                            "type": "function",
                            "function": {"name": n, "arguments": json.dumps(a)},
                        }
                        for i, (n, a) in enumerate(calls)
                    ],
                },
                "finish_reason": "tool_calls",
            }
        ]
    }
    whole = ToolGovernor(policy, "shop", "t", "r1", (), body).govern_reply(reply)["choices"][0]
    gate = StreamToolGate(ToolGovernor(policy, "shop", "t", "r2", (), body))
    out = [o for chunk in _stream_of(calls, cut) for o in gate.feed(chunk)]
    got, finish = _assembled(out)
    want = [
        {"id": c["id"], "name": c["function"]["name"], "arguments": c["function"]["arguments"]}
        for c in whole["message"].get("tool_calls", [])
    ]
    assert got == want
    assert finish == whole["finish_reason"]


def test_keys_depend_on_every_part() -> None:
    base = ("acme", "t1", b"p|x", "send", {"to": "a"})
    k = idempotency_key(*base)
    for i, other in enumerate((("zeta",), ("acme", "t2"), ("acme", "t1", b"p|y"))):
        changed = list(base)
        changed[: len(other)] = other
        assert idempotency_key(*changed) != k, i
    assert idempotency_key("acme", "t1", b"p|x", "send", '{"to": "a"}') == k  # canonical JSON
    assert idempotency_key("acme", "t1", b"p|x", "send", {"to": "b"}) != k


def test_new_results_are_those_after_the_last_assistant_message_or_unseen() -> None:
    """After the last assistant message: brought now. Earlier: new only when the
    task's record knows the call with no result yet (one slipped into the history)."""
    body = {
        "messages": [
            {"role": "user", "content": "x"},
            {"role": "assistant", "tool_calls": [{"id": "a"}]},
            {"role": "tool", "tool_call_id": "a", "content": "1"},
            {"role": "assistant", "tool_calls": [{"id": "b"}, {"id": "c"}]},
            {"role": "tool", "tool_call_id": "b", "content": "2"},
            {"role": "tool", "tool_call_id": "c", "content": "3"},
        ]
    }
    results = tool_results(body["messages"])
    assert new_results(results, {}) == ["b", "c"]
    assert new_results(results, {"a": 1, "b": 1}) == ["b", "c"]
    assert new_results(results, {"a": 0}) == ["a", "b", "c"]
    assert tool_results([{"role": "user", "content": "x"}]) == []
