"""Hostile peers on the other side of the gateway: an upstream that answers what no engine
should (usage counts out of range, bodies that are no chat completion, stream events that
are no JSON, an odd `Retry-After`, a body or an SSE line that never ends), and a client
that holds a stream's resources and leaves. Over sockets against a real gateway in front
of a hostile upstream (tests/support/hostile_upstream.py: each model of the config is one
scripted reply), the client-side shapes being covered by test_hostile*.py.

Defects these tests found (each fails on today's code):
- usage counts an upstream reports are taken unchecked (settle.py `Settler._charge`,
  then metrics and the ledger). A string (`int("lots")`) makes settling raise, as do a
  float or a count past 64 bits on Messages: the client gets a 500 (200 on chat
  completions), no ledger row is written (the request is free), and the tenant's
  concurrency slot is never given back: every later request of a `max_concurrency: 1`
  tenant is refused 429, in a stream and a background response too. Where settling
  does not raise, -1,000,000 tokens are billed -$1000, which sets the tenant's budget
  spend back to zero (state/limits_memory.py `settle` floors it; the ledger's sum, which
  seeds budgets after a restart, keeps the -$1000), and 10**30 tokens $1e27; Responses
  answers 500 for a float or a count past 64 bits while its ledger row says `ok`;
- a 2xx reply that is not a JSON object (HTML, an array, a number, bytes that are not
  UTF-8, an SSE stream to a request that did not stream) is relayed as a 200 on chat
  completions; Responses and Messages answer an array or a number as an empty reply
  (200) and the rest with a 500;
- a stream event that is not a JSON object, where the gateway reads it, cuts the
  client's connection without an error event (chat: an event mentioning `"usage"`,
  which reply.relay parses with orjson unguarded; Responses and Messages: any such
  event, as api/sse.translated catches msgspec's ValidationError only), and the ledger
  says the client cancelled, or `ok`;
- a 429's `Retry-After` reaches the client as the upstream wrote it, thousands of digits
  or any text (engines/upstream.py `_upstream_error`; its 503 branch bounds it);
- a reply body is read whole, without a bound (engines/upstream.py `OpenAIUpstream.post`,
  `UpstreamStream.data`): a reply that never ends holds gigabytes in the gateway until
  the deadline (5 GB in 8 s, measured), and an SSE line that never ends is gathered with
  a copy of all of it per read;
- a tool server's `tools/list` is taken whole (engines/mcp_servers.py, the SDK's
  `list_tools`) and handed to every client's `tools/list` on /mcp: 12.5 MB from 5,000
  tools, where a tool call's result is bounded (`mcp.max_result_bytes`).

Gaps guarded (pass today; no other test covers them): a client that leaves a stream
whose upstream never sends `[DONE]` and keeps its connection gives back its tenant's
concurrency slot, the upstream connection is closed, and the ledger has one row for it;
three cancels racing on a background response, and one after it ended, settle it once
and give its slot back.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from support.gateways import Gateway, start_gateway
from support.hostile_upstream import Hostile, Reply, flood, hostile_upstream, json_reply, sse_reply
from support.mcp_http import ScriptedToolServer, in_session, open_session
from support.mcp_sessions import wait_tools_ready
from support.procs import http_server

MB = 1 << 20
PRICE = {"input": 0.0, "output": 1000.0}  # $1000 a million output tokens: 10 cost $0.01
LEAKS = ("Traceback", "Error:", "orjson", "msgspec", "internal_error")


def _chat(usage: dict[str, Any] | None = None) -> bytes:
    body: dict[str, Any] = {
        "id": "c1",
        "object": "chat.completion",
        "created": 1,
        "model": "m",
        "choices": [
            {"index": 0, "message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop"}
        ],
    }
    if usage is not None:
        body["usage"] = usage
    return json.dumps(body).encode()


def _event(data: bytes | dict[str, Any]) -> bytes:
    return b"data: " + (data if isinstance(data, bytes) else json.dumps(data).encode()) + b"\n\n"


CHUNK = _event({"id": "c1", "object": "chat.completion.chunk", "choices": [
    {"index": 0, "delta": {"content": "hey"}}
]})  # fmt: skip
DONE = _event(b"[DONE]")

USAGES: dict[str, dict[str, Any]] = {
    "usage-negative": {"prompt_tokens": 0, "completion_tokens": -1_000_000, "total_tokens": 0},
    "usage-huge": {"prompt_tokens": 0, "completion_tokens": 10**30, "total_tokens": 10**30},
    "usage-string": {"prompt_tokens": "lots", "completion_tokens": "x", "total_tokens": "y"},
    "usage-float": {"prompt_tokens": 1e308, "completion_tokens": 1.5, "total_tokens": 3},
}
NOT_OBJECTS: dict[str, bytes] = {
    "body-html": b"<html><body>502 Bad Gateway</body></html>",
    "body-array": b"[1, 2, 3]",
    "body-not-utf8": b'{"choices": [{"index": 0, "message": {"content": "\xff\xfe"}}]}',
    "body-sse": CHUNK + DONE,
}
BAD_EVENTS: dict[str, bytes] = {
    "event-usage-broken": b'{"usage": nope',
    "event-usage-array": b'["usage"]',
    "event-not-json": b"hello world",
    "event-not-utf8": b'{"choices": [{"index": 0, "delta": {"content": "\xff\xfe"}}]}',
    "event-usage-strings": b'{"choices": [], "usage": {"prompt_tokens": "a", "completion_tokens": "b"}}',
}
FLOOD_JSON = 256 * MB  # a reply 32 times the request body cap: no bound lets it through
FLOOD_LINE = 64 * MB

REPLIES: dict[str, Reply] = {
    "honest": json_reply(_chat({"prompt_tokens": 5, "completion_tokens": 10, "total_tokens": 15})),
    **{name: json_reply(_chat(usage)) for name, usage in USAGES.items()},
    **{name: json_reply(body) for name, body in NOT_OBJECTS.items()},
    **{name: sse_reply(CHUNK, _event(data), DONE) for name, data in BAD_EVENTS.items()},
    "retry-after-long": json_reply(b'{"error": {"message": "slow down"}}', 429, {"Retry-After": "9" * 4000}),
    "retry-after-text": json_reply(b'{"error": {"message": "slow down"}}', 429, {"Retry-After": "soon, or never <b>"}),
    "flood-json": flood(b"", b" " * 65536, FLOOD_JSON, "application/json"),
    "flood-line": flood(b'data: {"x": "', b"a" * 65536, FLOOD_LINE, "text/event-stream"),
    "never-done": sse_reply(CHUNK, hold=True),
    "hang": sse_reply(hold=True),  # a status line, then nothing
}  # fmt: skip


@pytest.fixture(scope="module")
def up() -> Iterator[Hostile]:
    with hostile_upstream(REPLIES) as hostile:
        yield hostile


class _HugeCatalog(ScriptedToolServer):
    """A tool server whose `tools/list` is 5,000 tools of a 2.5 KB description each:
    about 12.5 MB, where the gateway's own requests may be 8 MB (`server.max_body_bytes`)."""

    name = "huge"
    tools = [
        {"name": f"t{i}", "description": "d" * 2500, "inputSchema": {"type": "object"}}
        for i in range(5_000)
    ]


@pytest.fixture(scope="module")
def catalog() -> Iterator[str]:
    with http_server(_HugeCatalog) as url:
        yield url + "/mcp"


@pytest.fixture(scope="module")
def gw(up: Hostile, catalog: str) -> Iterator[Gateway]:
    models = [
        {
            "alias": name,
            "engine": {"kind": "openai", "base_url": up.base_url(name)},
            "price": PRICE,
            # No retries: each reply is seen once. A flood that is not cut ends at a
            # deadline of 1.5 s.
            "resilience": {"retries": 0},
            "timeouts": {"connect_s": 1.5, "first_byte_s": 1.5, "total_s": 1.5}
            if name.startswith("flood")
            else {"connect_s": 2, "first_byte_s": 10, "total_s": 10},
        }
        for name in REPLIES
    ]
    g = start_gateway(
        {
            "models": models,
            "embeddings": {"enabled": False},
            "mcp": {"servers": [{"name": "huge", "url": catalog}]},
        }
    )
    yield g
    g.proc.stop()


Rows = list[dict[str, Any]]


def _rows(gw: Gateway, tenant: str, done: int | Callable[[Rows], bool]) -> Rows:
    """The tenant's ledger rows once `done` holds, from the SQLite file (Gateway.stored_rows)."""
    return gw.stored_rows(tenant, done, timeout_s=5)


def _has_honest(rows: Rows) -> bool:
    """A reply of `honest` is in the rows: a request made after it is settled."""
    return any(row["model"] == "honest" for row in rows)


def _body(route: str, model: str, stream: bool = False) -> dict[str, Any]:
    if route == "/v1/responses":
        return {"model": model, "input": "hi", "max_output_tokens": 16, "stream": stream}
    return {
        "model": model,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 16,
        "stream": stream,
    }


ROUTES = ["/v1/chat/completions", "/v1/responses", "/v1/messages"]


def _post(gw: Gateway, key: str, route: str, model: str, **kw: Any) -> httpx.Response:
    return gw.post(route, key=key, json=_body(route, model), timeout=30, **kw)


def _error_code(r: httpx.Response) -> str:
    return str(r.json()["error"].get("code"))


# -- usage counts the gateway cannot bill ---------------------------------------------------


def test_negative_usage_is_no_refund_of_a_budget(gw: Gateway) -> None:
    """A tenant with a $0.10 budget spends $0.05 (five honest replies of $0.01), then an
    upstream reports -1,000,000 completion tokens. Today that is billed -$1000: the
    ledger takes the negative cost, and settling it sets the tenant's spend back to
    zero (state/limits_memory.py `settle` floors it there), so the budget starts over:
    14 replies of $0.01 pass a $0.10 budget. Counts below zero bill nothing below zero,
    and what honest replies cost stays within the budget."""
    tenant, key = gw.new_tenant("t", budget_usd=0.10)
    chat = "/v1/chat/completions"
    assert [_post(gw, key, chat, "honest").status_code for _ in range(5)] == [200] * 5
    r = _post(gw, key, chat, "usage-negative")
    assert r.status_code in (200, 502), r.text
    served = 5 + sum(_post(gw, key, chat, "honest").status_code == 200 for _ in range(10))
    rows = _rows(gw, tenant, 16)
    assert served * 0.01 <= 0.10 + 1e-9, f"{served} replies of $0.01 on a $0.10 budget"
    assert all(row["cost_usd"] >= 0 for row in rows), [row["cost_usd"] for row in rows]


@pytest.mark.parametrize(
    ("reply", "route"),
    [
        (reply, route)
        for reply in USAGES
        for route in ROUTES
        # Chat completions bills a float count as its integer part: no defect there.
        if not (reply == "usage-float" and route == "/v1/chat/completions")
    ],
)
def test_usage_counts_out_of_range_neither_fail_nor_leak(
    gw: Gateway, route: str, reply: str
) -> None:
    """Negative counts, counts past 64 bits, strings and floats in an upstream's `usage`,
    for a tenant that may hold one request at a time (what each does today, by route:
    the module docstring). Each is answered without a 500, its slot is given back (the
    next request is served), and it is billed once, at no less than nothing and no
    more than a bound (16 tokens of output cost $0.016; the bound here is $1)."""
    tenant, key = gw.new_tenant("t", max_concurrency=1)
    r = _post(gw, key, route, reply)
    assert r.status_code != 500, r.text
    assert not any(leak in r.text for leak in LEAKS), r.text
    after = _post(gw, key, route, "honest")
    assert after.status_code == 200, f"the slot was not given back: {after.text}"
    rows = _rows(gw, tenant, _has_honest)
    hostile = [row for row in rows if row["model"] == reply]
    assert len(hostile) == 1, rows
    assert 0 <= hostile[0]["cost_usd"] <= 1.0, hostile[0]


# -- replies that are no chat completion ----------------------------------------------------


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("reply", list(NOT_OBJECTS))
def test_a_reply_that_is_no_json_object_is_a_502(gw: Gateway, route: str, reply: str) -> None:
    """A 2xx whose body is HTML, a JSON array, bytes that are not UTF-8, or an SSE
    stream to a request that did not ask for one: today chat completions relays it as
    a 200 (the client gets `[1, 2, 3]` or the HTML), Responses and Messages make the
    array an empty answer and the rest a 500. It is the upstream's fault:
    502 `upstream_error`, in the route's error shape."""
    _, key = gw.new_tenant("t")
    r = _post(gw, key, route, reply)
    assert r.status_code == 502, (r.status_code, r.text[:300])
    assert _error_code(r) == "upstream_error", r.text
    assert not any(leak in r.text for leak in LEAKS), r.text


def _read_stream(gw: Gateway, key: str, route: str, model: str) -> str:
    """The whole stream as text; a transport error (the gateway cut the connection
    without finishing its chunked body) fails the test."""
    with httpx.stream(
        "POST",
        gw.url + route,
        json=_body(route, model, stream=True),
        headers={"Authorization": f"Bearer {key}"},
        timeout=30,
    ) as r:
        assert r.status_code == 200, r.read()
        try:
            return "".join(r.iter_text())
        except httpx.TransportError as exc:
            pytest.fail(f"the gateway cut the stream without an error event: {exc!r}")


# Chat completions relays the data of an event it does not read as it came: text, or
# bytes that are not UTF-8, pass through it (the client's JSON parser meets them).
UNREAD_BY_CHAT = {"event-not-json", "event-not-utf8"}


@pytest.mark.parametrize(
    ("reply", "route"),
    [
        (reply, route)
        for reply in BAD_EVENTS
        for route in ROUTES
        if not (reply in UNREAD_BY_CHAT and route == "/v1/chat/completions")
    ],
)
def test_a_stream_event_that_is_no_json_object_ends_in_an_error_event(
    gw: Gateway, route: str, reply: str
) -> None:
    """An event whose data is broken JSON, an array, plain text, not UTF-8, or usage of
    strings, where the gateway reads it, for a tenant that may hold one request at a
    time. Today an unhandled exception ends the response mid-chunk (the client sees a
    transport error, not the protocol's error event; the ledger says `cancelled` or
    `ok`), or, for usage of strings on chat completions, the stream completes but no
    ledger row is written and the slot is never given back. Either the stream completes
    and is billed once, or it ends in an `upstream_error` event and its ledger row says
    `incomplete`; either way the slot is given back."""
    tenant, key = gw.new_tenant("t", max_concurrency=1)
    text = _read_stream(gw, key, route, reply)
    after = _post(gw, key, "/v1/chat/completions", "honest")
    assert after.status_code == 200, f"the slot was not given back: {after.text}"
    rows = _rows(gw, tenant, _has_honest)  # written after the stream's, if that one is
    streamed = [row for row in rows if row["model"] == reply]
    assert len(streamed) == 1, f"the stream's ledger rows: {streamed}"
    row = streamed[0]
    if row["status"] != "ok":
        assert (row["status"], row["error_code"]) == ("incomplete", "upstream_error"), row
        # The gateway's error event ends it; or, on chat completions, the upstream's
        # events are relayed as they came, its `[DONE]` before any finish included
        # (recorded incomplete: tests/integration/test_streams_s72.py).
        relayed = route == "/v1/chat/completions" and text.endswith("data: [DONE]\n\n")
        # (on Responses the `error` event before `response.failed` carries the code)
        last_two = "\n\n".join(text.rsplit("\n\n", 3)[-3:])
        assert relayed or "upstream_error" in last_two, text[-500:]
    assert not any(leak in text for leak in LEAKS), text[-500:]


# -- headers an upstream sends --------------------------------------------------------------


@pytest.mark.parametrize("reply", ["retry-after-long", "retry-after-text"])
def test_an_upstream_retry_after_reaches_the_client_bounded(gw: Gateway, reply: str) -> None:
    """A 429 with `Retry-After` of 4,000 digits, or of text: today the client gets it
    as the upstream wrote it. What the client is told to wait is a number of seconds of
    at most six digits (as the 503 branch already bounds it), or nothing."""
    _, key = gw.new_tenant("t")
    r = _post(gw, key, "/v1/chat/completions", reply)
    assert r.status_code == 429, r.text
    told = r.headers.get("retry-after")
    assert told is None or (told.isdigit() and len(told) <= 6), told[:80]


# -- bodies that never end ------------------------------------------------------------------


def _rss_mb(pid: int) -> float:
    """The resident size of process `pid` now, in MB."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS for {pid}")


def test_a_reply_that_never_ends_is_cut_at_a_bound(gw: Gateway, up: Hostile) -> None:
    """A 200 that sends 256 MB of JSON whitespace and then holds its connection. Today
    the gateway reads it all into memory (its resident size grows by the whole flood;
    an endless one grew it by 5 GB in 8 s) and answers 504 at the deadline. It stops
    reading at a bound: the flood is never held whole, the answer is 502."""
    _, key = gw.new_tenant("t")
    pid = gw.proc.popen.pid
    before = _rss_mb(pid)
    answer: list[httpx.Response] = []
    client = threading.Thread(
        target=lambda: answer.append(_post(gw, key, "/v1/chat/completions", "flood-json"))
    )
    client.start()
    deadline = time.monotonic() + 10
    while not (up.written("flood-json") or up.gone("flood-json") or answer):
        assert time.monotonic() < deadline, "the flood neither went out nor was cut"
        time.sleep(0.02)
    grown = _rss_mb(pid) - before
    client.join(20)
    assert grown < FLOOD_JSON / MB / 2, f"the gateway grew by {grown:.0f} MB"
    assert answer and answer[0].status_code == 502, answer and answer[0].text


def test_an_sse_line_that_never_ends_is_cut_at_a_bound(gw: Gateway) -> None:
    """A stream whose first event never ends: 64 MB without a blank line, then the
    connection held. Today the gateway gathers it with a copy of all it has per read,
    until the deadline ends it as `upstream_timeout`. It stops at a bound on one
    event, and the client's stream ends in `upstream_error`."""
    _, key = gw.new_tenant("t")
    text = _read_stream(gw, key, "/v1/chat/completions", "flood-line")
    assert "upstream_error" in text and "upstream_timeout" not in text, text[-300:]


# -- a client that holds a stream and leaves ------------------------------------------------


def test_a_client_gone_from_a_stream_that_never_ends_frees_its_slot(
    gw: Gateway, up: Hostile
) -> None:
    """Gap: the upstream sends one chunk, never `[DONE]`, and keeps its connection; the
    tenant may hold one request at a time. The client reads the first chunk and hangs
    up: the upstream connection is closed, the ledger has one row (cancelled), and the
    tenant's next request is served, not refused for concurrency."""
    tenant, key = gw.new_tenant("t", max_concurrency=1)
    raw = json.dumps(_body("/v1/chat/completions", "never-done", stream=True)).encode()
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(raw)}\r\n\r\n"
    )
    with socket.create_connection(("127.0.0.1", gw.port), timeout=10) as s:
        s.sendall(head.encode() + raw)
        got = b""
        while b'"hey"' not in got:
            piece = s.recv(4096)
            assert piece, got
            got += piece
        assert got.startswith(b"HTTP/1.1 200"), got
    deadline = time.monotonic() + 10
    while not up.gone("never-done"):
        assert time.monotonic() < deadline, "the upstream connection was never closed"
        time.sleep(0.05)
    assert _post(gw, key, "/v1/chat/completions", "honest").status_code == 200
    rows = _rows(gw, tenant, 2)
    assert sorted(row["status"] for row in rows) == ["cancelled", "ok"], rows


def test_a_background_response_cancelled_thrice_is_settled_once(gw: Gateway) -> None:
    """Gap: test_responses_api cancels each background response once. Here three
    cancels race on one whose upstream hangs after its status line, and a fourth comes
    after it ended, for a tenant that may hold one request at a time: each answers
    `cancelled`, the ledger has one row for it (cancelled), and the slot is given back."""
    tenant, key = gw.new_tenant("t", max_concurrency=1)
    body = {"model": "hang", "input": "hi", "background": True}
    r = gw.post("/v1/responses", key=key, json=body, timeout=30)
    assert r.status_code == 200, r.text
    cancel = f"/v1/responses/{r.json()['id']}/cancel"
    with ThreadPoolExecutor(3) as pool:
        racing = list(pool.map(lambda _: gw.post(cancel, key=key, timeout=30), range(3)))
    late = gw.post(cancel, key=key, timeout=30)
    for answer in [*racing, late]:
        assert answer.status_code == 200, answer.text
        assert answer.json()["status"] == "cancelled", answer.text
    assert _post(gw, key, "/v1/chat/completions", "honest").status_code == 200
    rows = _rows(gw, tenant, 6)  # and each cancel's own (responses.cancel, a call: no model)
    cancels = [row["status"] for row in rows if row["endpoint"] == "responses.cancel"]
    assert cancels == ["ok"] * 4, rows
    assert sorted(
        (row["model"], row["status"]) for row in rows if row["endpoint"] != "responses.cancel"
    ) == [("hang", "cancelled"), ("honest", "ok")], rows


# -- a tool server's catalog ----------------------------------------------------------------


def test_a_tool_servers_catalog_is_bounded(gw: Gateway) -> None:
    """A tool server lists 5,000 tools, 12.5 MB of catalog. Today the gateway takes it
    whole (the SDK's `list_tools`, engines/mcp_servers.py, reads it without a bound) and
    every client's `tools/list` on /mcp is answered with all of it. What the gateway
    takes from a tool server is bounded as what it reads from a tool call is: its answer
    to a client stays under the gateway's own request cap (8 MB)."""
    wait_tools_ready(gw, ("huge",))
    sid = open_session(gw, gw.key)
    listing = {"jsonrpc": "2.0", "id": 2, "method": "tools/list"}
    r = httpx.post(gw.url + "/mcp", headers=in_session(gw.key, sid), json=listing, timeout=30)
    assert r.status_code == 200, r.text[:300]
    assert len(r.content) < 8_000_000, f"tools/list answered {len(r.content) / MB:.0f} MB"
