"""Hostile input against the surfaces test_hostile_s67.py leaves out: the admin API's
writes of tenants and keys (fields of the wrong type), `/mcp` requests whose JSON-RPC id
is of a type no request may have, and the approvals and tasks of one tenant as another
tenant's key meets them on `/mcp`. Over sockets against a real gateway in front of the
scripted instant upstream and a real MCP tool server (Streamable HTTP, the official SDK).

Defects these tests found (each failed on the code before its fix, this stop):
- `POST /admin/keys` stores an `expires_at` that is not a time as it came: a string
  ("tomorrow", or an RFC 3339 text) makes a key every request of which is a 500
  (authentication compares it with the clock), a list or object is a 500 at once,
  and `true` is taken as 1.0 (a key expired since 1970);
- `POST /admin/tenants` stores `labels` that are not an object (a list, a string, a
  number): every request of every key of that tenant is then a 500;
- `labels.regions` that is not a list (`"eu"`) is stored and then ignored: the tenant
  meant to be held to its regions is served by a deployment in any region;
- a `tools/call` whose id is null, a boolean, an object or an array (no request's id
  may be: the MCP specification allows a string or an integer) gets `202 Accepted` and
  no answer at all, as if it were a notification: the client waits for a reply that
  never comes.

Gaps guarded (pass today; no other test covers them end to end):
- another tenant's approval token, sent on `/mcp` for the same call id, runs nothing
  and does not spend the token: its own tenant's call then runs with it, once;
- another tenant's tool calls under the same `x-task-id` count against a task of their
  own, never against the first tenant's `tool_calls` budget.
"""

from __future__ import annotations

import asyncio
import os
import re
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from mcp import MCPError

from support.gateways import Gateway
from support.mcp_http import in_session, open_session
from support.mcp_sessions import (
    Tools,
    session,
    text,
    tool_gateway,
)
from support.upstreams import Scripted

# What no client should ever see: Python's exception names and texts.
LEAKS = re.compile(r"Traceback|Error\b|Exception|SQLite|\.py\b")
CHAT = {"model": "cheap", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]}
REGISTRY = [
    {"name": "web__lookup", "class": "read_only"},
    {"name": "web__send_email", "class": "side_effect", "requires_approval": True},
]


@pytest.fixture(scope="module")
def gw(scripted: Scripted, tools: Tools) -> Iterator[Gateway]:
    with tool_gateway(scripted, tools, REGISTRY) as g:
        yield g


def _tenant(gw: Gateway) -> tuple[str, str]:
    tid = "hb" + os.urandom(4).hex()
    gw.create_tenant(tid)
    return tid, str(gw.create_key(tid)["key"])


def _auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def _chat(gw: Gateway, key: str, **headers: str) -> httpx.Response:
    return httpx.post(
        gw.url + "/v1/chat/completions", json=CHAT, headers={**_auth(key), **headers}, timeout=30
    )


def _refused(r: httpx.Response, param: str) -> None:
    """An OpenAI-shaped 400 naming `param`, with no exception text."""
    assert r.status_code == 400, (r.status_code, r.text[:300])
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param, error
    assert not LEAKS.search(r.text), r.text


# -- the admin API's writes ------------------------------------------------------------


@pytest.mark.parametrize("expires_at", ["tomorrow", "2026-12-01T00:00:00Z", [1], {"at": 1}, True])
def test_a_key_whose_expiry_is_not_a_time_is_refused(gw: Gateway, expires_at: Any) -> None:
    """`expires_at` is unix seconds: anything else is a 400 naming it, never a key that
    fails every request it authenticates (nor a 500 at its creation)."""
    tid = "hb" + os.urandom(4).hex()
    gw.create_tenant(tid)
    r = httpx.post(
        gw.url + "/admin/keys",
        json={"tenant_id": tid, "expires_at": expires_at},
        headers=gw.admin,
        timeout=30,
    )
    if r.status_code == 201:  # what a client of that key gets, for the failure's message
        use = _chat(gw, r.json()["key"])
        pytest.fail(
            f"created a key expiring at {r.json()['expires_at']!r}: {use.status_code} {use.text[:200]}"
        )
    _refused(r, "expires_at")


@pytest.mark.parametrize("labels", [["eu"], "eu", 5])
def test_tenant_labels_that_are_not_an_object_are_refused(gw: Gateway, labels: Any) -> None:
    """`labels` is an object (its `regions` are read on every authentication): any other
    JSON value is a 400, never a tenant whose every request is a 500."""
    tid = "hb" + os.urandom(4).hex()
    r = httpx.post(
        gw.url + "/admin/tenants", json={"id": tid, "labels": labels}, headers=gw.admin, timeout=30
    )
    if r.status_code == 201:
        use = _chat(gw, str(gw.create_key(tid)["key"]))
        pytest.fail(f"created a tenant labelled {labels!r}: {use.status_code} {use.text[:200]}")
    _refused(r, "labels")


@pytest.mark.parametrize("regions", [["eu"], "eu", {"eu": True}])
def test_a_regions_label_never_widens_the_tenants_boundary(gw: Gateway, regions: Any) -> None:
    """A tenant labelled with regions is served only inside them, whatever the label's
    shape: a label the gateway cannot read as a list of regions is refused when it is
    written, or holds the tenant's requests back; never is it dropped in silence. The
    only deployment here is in region `local`, outside "eu"."""
    tid = "hb" + os.urandom(4).hex()
    r = httpx.post(
        gw.url + "/admin/tenants",
        json={"id": tid, "labels": {"regions": regions}},
        headers=gw.admin,
        timeout=30,
    )
    if r.status_code != 201:
        _refused(r, "labels")
        return
    served = _chat(gw, str(gw.create_key(tid)["key"]))
    assert served.status_code != 200, f"regions {regions!r}: served outside them"
    assert served.status_code < 500 or served.json()["error"]["code"] != "internal_error"


# -- /mcp --------------------------------------------------------------------------------


@pytest.mark.parametrize("rid", [None, True, {"id": 1}, [1]])
def test_an_mcp_request_whose_id_no_request_may_have_is_answered(
    gw: Gateway, tools: Tools, rid: Any
) -> None:
    """A `tools/call` with an id that is not a string or an integer is an invalid
    request: answered with a JSON-RPC error (its id null), not taken for a notification
    (202, no body) that leaves the client waiting; and the tool does not run."""
    _, key = _tenant(gw)
    sid = open_session(gw, key)
    q = "odd-id-" + os.urandom(4).hex()
    call = {
        "jsonrpc": "2.0",
        "id": rid,
        "method": "tools/call",
        "params": {"name": "web__lookup", "arguments": {"q": q}},
    }
    r = httpx.post(gw.url + "/mcp", json=call, headers=in_session(key, sid), timeout=30)

    assert r.status_code in (200, 400), (r.status_code, r.text[:200])
    reply = r.json()
    assert reply["jsonrpc"] == "2.0" and reply["id"] is None, reply
    assert reply["error"]["code"] in (-32600, -32602), reply
    assert not LEAKS.search(r.text), r.text
    assert Tools.runs(tools.http_log, "lookup", q=q) == 0


def test_another_tenants_approval_runs_nothing_and_is_not_spent(gw: Gateway, tools: Tools) -> None:
    """An approval is its tenant's: tenant B sending A's token for the same call id is
    refused as unapproved, the tool does not run, and the token is still A's to use."""
    a, key_a = _tenant(gw)
    _, key_b = _tenant(gw)
    call_id = "call_sya_" + os.urandom(6).hex()
    to = f"{call_id}@example.com"
    token = gw.approve(a, None, call_id)
    approval = {"x-switchyard-approval": token}

    async def calls() -> tuple[MCPError, str]:
        args, meta = {"to": to, "body": "hi"}, {"call_id": call_id}
        async with session(gw, key_b, **approval) as s:
            with pytest.raises(MCPError) as refused:
                await s.call_tool("web__send_email", args, meta=meta)
        async with session(gw, key_a, **approval) as s:
            done = await s.call_tool("web__send_email", args, meta=meta)
        return refused.value, text(done)

    refused, done = asyncio.run(calls())

    assert refused.data["code"] == "approval_required", refused.data
    assert done == f"sent to {to}"
    assert Tools.runs(tools.http_log, "send_email", to=to) == 1


def test_another_tenants_tool_calls_never_spend_a_tasks_budget(gw: Gateway, tools: Tools) -> None:
    """Tasks are per tenant on `/mcp` as on the model routes: B's tool calls under A's
    task id go to a task of B's own, and A's `tool_calls` budget of one is left whole."""
    _, key_a = _tenant(gw)
    _, key_b = _tenant(gw)
    task = "shared-" + os.urandom(4).hex()
    first = _chat(gw, key_a, **{"x-task-id": task, "x-task-budget": "tool_calls=1"})
    assert first.status_code == 200, first.text
    q = "task-" + os.urandom(4).hex()

    async def call(key: str) -> str:
        async with session(gw, key, **{"x-task-id": task}) as s:
            return text(await s.call_tool("web__lookup", {"q": q}))

    for _ in range(2):
        assert asyncio.run(call(key_b)) == f"found: {q}"
    mine = httpx.get(f"{gw.url}/v1/tasks/{task}", headers=_auth(key_a), timeout=10).json()
    assert mine["used"]["tool_calls"] == 0, mine
    assert asyncio.run(call(key_a)) == f"found: {q}"
    assert Tools.runs(tools.http_log, "lookup", q=q) == 3
