"""The OpenAI Responses API (`/v1/responses`), driven by the official `openai` SDK and
the OpenAI Agents SDK over sockets: a real gateway in front of a scripted upstream.
Stored responses are the tenant's, encrypted at rest, continued across a restart and
on the deployment that served the previous turn; background responses poll and
cancel; tool calls are governed as on chat."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from support.gateways import Gateway, start_gateway
from support.upstreams import Scripted, start_scripted

REGISTRY = [
    {"name": "lookup", "class": "read_only"},
    {"name": "wire_money", "class": "side_effect", "allowed_tenants": ["bank"]},
    {"name": "send_email", "class": "side_effect", "requires_approval": True},
]
TOOLS: list[Any] = [
    {"type": "function", "name": n, "parameters": {"type": "object", "properties": {}}}
    for n in ("lookup", "wire_money", "send_email")
]


def _config(a: Scripted, b: Scripted, **sections: Any) -> dict[str, Any]:
    up = {"kind": "openai", "base_url": a.url + "/v1"}
    return {
        "tools": {"registry": REGISTRY, "on_forbidden_call": "block"},
        "models": [
            {"alias": "m", "engine": up, "price": {"input": 0.0, "output": 1000.0}},
            {  # two deployments: continuations stay where the previous turn ran
                "alias": "pair",
                "engine": up,
                "deployments": [
                    {"name": "pair-a", "engine": up},
                    {"name": "pair-b", "engine": {"kind": "openai", "base_url": b.url + "/v1"}},
                ],
            },
        ],
        "embeddings": {"enabled": False},
        **sections,
    }


@pytest.fixture(scope="module")
def ups() -> Iterator[tuple[Scripted, Scripted]]:
    pa, a = start_scripted()
    pb, b = start_scripted()
    yield a, b
    pa.stop()
    pb.stop()


@pytest.fixture(scope="module")
def gw(ups: tuple[Scripted, Scripted]) -> Iterator[Gateway]:
    g = start_gateway(_config(*ups, responses={"max_background_per_tenant": 2}))
    yield g
    g.proc.stop()


def _calls(up: Scripted, *calls: tuple[str, dict[str, Any]], until_result: bool = False) -> None:
    body = {"calls": [{"name": n, "arguments": a} for n, a in calls], "until_result": until_result}
    assert httpx.put(up.url + "/control/tool_calls", json=body).status_code == 200


def _last(up: Scripted) -> dict[str, Any]:
    return dict(httpx.get(up.url + "/control/last").json()["body"])


def _tenant(gw: Gateway, name: str) -> tuple[str, openai.OpenAI]:
    tenant = f"{name}-{time.monotonic_ns()}"
    gw.create_tenant(tenant)
    return tenant, gw.openai(gw.create_key(tenant)["key"])


def test_create_stream_retrieve_continue_and_delete(
    gw: Gateway, ups: tuple[Scripted, Scripted]
) -> None:
    up = ups[0]
    _calls(up)
    _, c = _tenant(gw, "r")
    first = c.responses.create(model="m", input="My name is Ada.", instructions="Be brief.")
    assert first.status == "completed" and first.id.startswith("resp_")
    assert "scripted" in first.output_text and first.usage is not None
    assert first.usage.output_tokens > 0
    # Stored: the same object back, and its input items.
    got = c.responses.retrieve(first.id)
    assert got.id == first.id and got.output_text == first.output_text
    items = c.responses.input_items.list(first.id)
    assert [i.type for i in items.data] == ["message"]
    # A continuation sends the whole conversation upstream; instructions do not carry.
    second = c.responses.create(model="m", input="What is my name?", previous_response_id=first.id)
    sent = _last(up)["messages"]
    assert [m["role"] for m in sent] == ["user", "assistant", "user"]
    assert sent[0]["content"] == "My name is Ada." and sent[2]["content"] == "What is my name?"
    assert second.previous_response_id == first.id
    # Streamed: the SDK's events, and the final response stored too.
    with c.responses.stream(model="m", input="stream it", previous_response_id=second.id) as s:
        kinds = [e.type for e in s]
        final = s.get_final_response()
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert "response.output_text.delta" in kinds and kinds[-1] == "response.completed"
    assert c.responses.retrieve(final.id).output_text == final.output_text
    assert len(_last(up)["messages"]) == 5
    # Deleted: gone.
    c.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        c.responses.retrieve(first.id)
    # store false: answered, not kept.
    ephemeral = c.responses.create(model="m", input="x", store=False)
    with pytest.raises(openai.NotFoundError):
        c.responses.retrieve(ephemeral.id)
    # Input items page: limit, order, after.
    three = c.responses.create(
        model="m",
        input=[
            {"role": "user", "content": "one"},
            {"role": "assistant", "content": "two"},
            {"role": "user", "content": "three"},
        ],
    )
    page = c.responses.input_items.list(three.id, limit=2, order="asc")
    assert [i.content[0].text for i in page.data] == ["one", "two"] and page.has_more
    rest = c.responses.input_items.list(three.id, limit=2, order="asc", after=page.data[-1].id)
    assert [i.content[0].text for i in rest.data] == ["three"] and not rest.has_more
    newest = c.responses.input_items.list(three.id, limit=1)  # desc by default
    assert [i.content[0].text for i in newest.data] == ["three"]
    # The usage row names the endpoint.
    rows = gw.usage(limit=50)
    assert any(r["endpoint"] == "responses" for r in rows)


def test_stored_responses_are_the_tenants_own(gw: Gateway) -> None:
    _, a = _tenant(gw, "iso-a")
    _, b = _tenant(gw, "iso-b")
    mine = a.responses.create(model="m", input="secret plans")
    for call in (
        lambda: b.responses.retrieve(mine.id),
        lambda: b.responses.input_items.list(mine.id),
        lambda: b.responses.delete(mine.id),
        lambda: b.responses.create(model="m", input="x", previous_response_id=mine.id),
    ):
        with pytest.raises(openai.NotFoundError):
            call()
    assert a.responses.retrieve(mine.id).id == mine.id
    with pytest.raises(openai.BadRequestError) as bad:
        a.responses.create(model="m", input="x", extra_body={"reasoning": {"effort": "low"}})
    assert "reasoning" in str(bad.value)


def test_continuations_stay_on_the_previous_turns_deployment(gw: Gateway) -> None:
    _, c = _tenant(gw, "aff")
    first = c.responses.with_raw_response.create(model="pair", input="hello")
    where = first.headers["x-switchyard-upstream"]
    rid = first.parse().id
    for _ in range(4):
        nxt = c.responses.with_raw_response.create(
            model="pair", input="again", previous_response_id=rid
        )
        assert nxt.headers["x-switchyard-upstream"] == where
        trace = gw.trace(nxt.headers["x-request-id"])
        select = next(d for d in trace["decisions"] if d["stage"] == "select")
        assert select["evidence"]["affinity"] == {"kind": "response", "outcome": "kept"}
        rid = nxt.parse().id


def test_background_poll_cancel_and_the_cap(gw: Gateway, ups: tuple[Scripted, Scripted]) -> None:
    up = ups[0]
    _calls(up)
    _, c = _tenant(gw, "bg")
    queued = c.responses.create(model="m", input="later", background=True)
    assert queued.status in ("queued", "in_progress")
    deadline = time.monotonic() + 20
    while (r := c.responses.retrieve(queued.id)).status not in ("completed", "failed"):
        assert time.monotonic() < deadline
        time.sleep(0.1)
    assert r.status == "completed" and "scripted" in r.output_text
    # A response that hangs upstream: cancelled, its upstream call stopped.
    up.fault("hang", count=2)
    slow = [c.responses.create(model="m", input=f"slow {i}", background=True) for i in range(2)]
    with pytest.raises(openai.RateLimitError):  # responses.max_background_per_tenant: 2
        c.responses.create(model="m", input="one too many", background=True)
    for s in slow:
        assert c.responses.cancel(s.id).status == "cancelled"
        assert c.responses.retrieve(s.id).status == "cancelled"
    # Their requests are settled as the client's cancel, not as the gateway's error.
    deadline = time.monotonic() + 10
    while len([r for r in gw.usage(limit=500) if r["status"] == "cancelled"]) < 2:
        assert time.monotonic() < deadline, [r["status"] for r in gw.usage(limit=500)]
        time.sleep(0.2)
    # Requests racing in together do not all pass the cap.
    up.fault("hang", count=8)

    async def race() -> list[httpx.Response]:
        auth = {"Authorization": f"Bearer {c.api_key}"}
        async with httpx.AsyncClient(base_url=gw.url, headers=auth, timeout=30) as http:
            await asyncio.gather(*(http.get("/v1/models") for _ in range(8)))  # 8 connections
            return list(
                await asyncio.gather(
                    *(
                        http.post(
                            "/v1/responses",
                            json={"model": "m", "input": f"race {i}", "background": True},
                        )
                        for i in range(8)
                    )
                )
            )

    sent = asyncio.run(race())
    accepted = [r.json()["id"] for r in sent if r.status_code == 200]
    assert len(accepted) <= 2 and {r.status_code for r in sent} <= {200, 429}
    for rid in accepted:
        assert c.responses.cancel(rid).status == "cancelled"
    up.fault("delay:0", count=0)


def test_tool_calls_are_governed(gw: Gateway, ups: tuple[Scripted, Scripted]) -> None:
    up = ups[0]
    tenant, c = _tenant(gw, "gov")
    _calls(up, ("lookup", {"q": "invoice"}), ("wire_money", {"to": "x", "usd": 5}))
    r = c.responses.with_raw_response.create(model="m", input="pay", tools=TOOLS)
    assert r.headers["x-switchyard-tools-blocked"] == "1"
    calls = [i for i in r.parse().output if i.type == "function_call"]
    assert [(i.name, i.arguments) for i in calls] == [("lookup", '{"q":"invoice"}')]
    with c.responses.stream(model="m", input="pay", tools=TOOLS) as s:
        events = list(s)
        final = s.get_final_response()
    items = [e.item for e in events if e.type.startswith("response.output_item")]
    assert {getattr(i, "name", None) for i in items} == {"lookup"}  # never the forbidden one
    deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    assert "usd" not in "".join(deltas)
    assert [i.name for i in final.output if i.type == "function_call"] == ["lookup"]
    # A result that needs an approval is refused until it has one.
    task = f"t-{time.monotonic_ns()}"
    _calls(up, ("send_email", {"to": "cfo"}))
    first = c.responses.create(
        model="m", input="mail", tools=TOOLS, extra_headers={"x-task-id": task}
    )
    call = next(i for i in first.output if i.type == "function_call")
    _calls(up)
    result = [{"type": "function_call_output", "call_id": call.call_id, "output": "sent"}]
    with pytest.raises(openai.PermissionDeniedError):
        c.responses.create(
            model="m",
            input=result,
            previous_response_id=first.id,
            extra_headers={"x-task-id": task},
        )
    token = gw.approve(tenant, task, call.call_id)
    ok = c.responses.create(
        model="m",
        input=result,
        previous_response_id=first.id,
        extra_headers={"x-task-id": task, "x-switchyard-approval": token},
    )
    assert ok.status == "completed"


def test_an_agents_sdk_agent_runs_a_tool_through_the_gateway(
    gw: Gateway, ups: tuple[Scripted, Scripted]
) -> None:
    from agents import (
        Agent,
        OpenAIResponsesModel,
        RunConfig,
        Runner,
        function_tool,
        set_tracing_disabled,
    )

    set_tracing_disabled(True)
    up = ups[0]
    _calls(up, ("lookup", {"q": "order 7"}), until_result=True)
    looked: list[str] = []

    @function_tool
    def lookup(q: str) -> str:
        """Look an order up."""
        looked.append(q)
        return "order 7 ships tomorrow"

    _, key_client = _tenant(gw, "agent")
    client = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key=key_client.api_key, max_retries=0)
    agent = Agent(
        name="support",
        instructions="Answer with the tool's help.",
        tools=[lookup],
        model=OpenAIResponsesModel(model="m", openai_client=client),
    )
    result = asyncio.run(Runner.run(agent, "Where is order 7?", run_config=RunConfig()))
    assert looked == ["order 7"]
    assert "scripted" in str(result.final_output)
    # The second model call carried the tool's result upstream.
    sent = _last(up)["messages"]
    assert sent[-1] == {
        "role": "tool",
        "tool_call_id": sent[-2]["tool_calls"][0]["id"],
        "content": "order 7 ships tomorrow",
    }
    _calls(up)


def test_restart_continues_and_fails_what_was_in_flight(
    ups: tuple[Scripted, Scripted], tmp_path: Path
) -> None:
    """Across a restart, on the same database: a stored response continues, one left
    in the background is failed with the reason, and no file under the gateway's home
    holds the conversation's text."""
    up = ups[1]
    db = str(tmp_path / "home" / "switchyard.db")
    cfg = _config(up, up)
    g = start_gateway(cfg, db=db)
    try:
        _calls(up)
        c = g.openai()
        marker = "zebra-" + os.urandom(6).hex()
        first = c.responses.create(model="m", input=f"remember {marker}")
        up.fault("hang", count=1)
        stuck = c.responses.create(model="m", input=f"never {marker}", background=True)
        time.sleep(0.5)
        key = g.key
    finally:
        g.proc.stop()
    g = start_gateway(cfg, db=db)
    try:
        g.key = key
        c = g.openai()
        assert c.responses.retrieve(stuck.id).status == "failed"
        assert "restarted" in str(c.responses.retrieve(stuck.id).error)
        nxt = c.responses.create(model="m", input="and now?", previous_response_id=first.id)
        assert nxt.status == "completed"
        assert marker in str(_last(up)["messages"][0]["content"])  # the real text went upstream
    finally:
        g.proc.stop()
    home = Path(db).parent
    for f in home.rglob("*"):
        if f.is_file():
            assert marker.encode() not in f.read_bytes(), f


def test_two_gateways_on_one_database_share_responses_and_cancels(
    ups: tuple[Scripted, Scripted], tmp_path: Path
) -> None:
    """Two gateway processes on one database (and so one key file): a response made
    through one is continued and read through the other, and a background response
    running on one is cancelled through the other, which stops it there (its request
    is settled as cancelled)."""
    up = ups[1]
    db = str(tmp_path / "shared" / "switchyard.db")
    cfg = _config(up, up)
    a = start_gateway(cfg, db=db)
    try:
        b = start_gateway(cfg, db=db)
        try:
            b.key = a.key
            ca, cb = a.openai(), b.openai()
            _calls(up)
            first = ca.responses.create(model="m", input="remember the number 7")
            nxt = cb.responses.create(model="m", input="which?", previous_response_id=first.id)
            assert nxt.status == "completed"
            assert _last(up)["messages"][0]["content"] == "remember the number 7"
            assert cb.responses.retrieve(first.id).id == first.id
            up.fault("hang", count=1)
            job = ca.responses.create(model="m", input="forever", background=True)
            time.sleep(0.5)
            assert cb.responses.cancel(job.id).status == "cancelled"
            deadline = time.monotonic() + 15
            while True:  # a's run notices, stops its upstream call, settles the request
                rows = [r for r in a.usage(limit=100) if r["status"] == "cancelled"]
                if rows or time.monotonic() > deadline:
                    break
                time.sleep(0.25)
            assert rows, [(r["endpoint"], r["status"]) for r in a.usage(limit=100)]  # stopped
            assert ca.responses.retrieve(job.id).status == "cancelled"
        finally:
            b.proc.stop()
    finally:
        a.proc.stop()


def test_a_background_response_is_admitted_before_anything_is_stored(gw: Gateway) -> None:
    """Background requests pass every check a foreground one does — rate limits, the
    key's models, the model's existence — before they are stored or answered; a refused
    one leaves no row (and so no client text) in the database."""
    import sqlite3

    tenant = f"bg-rpm-{time.monotonic_ns()}"
    gw.create_tenant(tenant, rpm=1)
    c = gw.openai(gw.create_key(tenant)["key"])
    ok = c.responses.create(model="m", input="first", background=True)
    assert ok.status in ("queued", "in_progress", "completed")
    with pytest.raises(openai.RateLimitError):
        c.responses.create(model="m", input="second", background=True)
    narrow = f"bg-narrow-{time.monotonic_ns()}"
    gw.create_tenant(narrow)
    n = gw.openai(gw.create_key(narrow, allowed_models=["pair"])["key"])
    with pytest.raises(openai.PermissionDeniedError):
        n.responses.create(model="m", input="not mine", background=True)
    secret = "SSN 123-45-6789 " + "x" * 100_000
    with pytest.raises(openai.NotFoundError) as missing:
        n.responses.create(model=secret, input="x", background=True)
    assert len(str(missing.value)) < 2000  # the name is not echoed whole
    with sqlite3.connect(gw.db) as db:
        rows = db.execute(
            "SELECT tenant_id, model FROM responses WHERE tenant_id IN (?, ?)", (tenant, narrow)
        ).fetchall()
    assert rows == [(tenant, "m")]
