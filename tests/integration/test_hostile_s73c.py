"""A hostile suite against the s73 landings (helper s73c2), over sockets: one real gateway
under `pii.mode: mask_upstream` before the scripted upstream, which shows the last body
it received (`GET /control/last`).

Defects these tests find (each failed before its fix):
- the PII masker reads a text with its JSON escapes decoded (commit 1cbf5f2), and when
  it found anything it sent the decoded text upstream: every other escape of the text
  was rewritten too. A user asking what `\\u00e9` or `\\/` means, in a message that also
  held an address, had the question sent as `é` and `/`; a tool call's arguments lost
  their own escapes. Now a span found in the decoded reading masks the characters it
  was read from (the escape included) and the rest of the text goes out as written
  (policy/pii.py `_json_view`);
- the folded view (same commit) maps each span of what the detectors read back to the
  text; two spans that end and start inside one character's reading (`℅` read `c/o`)
  both took that character, so a reply repeating their placeholders was restored with
  it twice. It is masked once now, by the first span (`PiiMasker._find`);
- the trailing-slash redirect (commit 8e6152b) flipped the slash of the raw path while
  it asked the routes about the decoded one: `/v1/models%2F` (read `/v1/models/`) was
  sent a 307 to `/v1/models%2F/` (read `/v1/models//`), a path no route answers. A path
  whose last character came encoded is now a 404 (api/app.py `_slash_flipped`);
- admin writes moved off the event loop (commit 27c3b66), the admin reads did not:
  /admin/usage, /admin/cost, /admin/requests and /admin/tasks read the database on the
  event loop, so a table another session holds locked (PostgreSQL: a migration, a
  `VACUUM FULL`, an operator's `LOCK TABLE`) stalled every tenant's requests, /healthz
  included, for as long as the lock was held. They read on threads of their own now,
  apart from the admin writes' thread, so a key's revoke is not queued behind a read
  that waits (api/admin/params.py `read_off_loop`).
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import psycopg
import pytest

from support.gateways import Gateway, cheap_config, start_gateway
from support.postgres_server import Postgres, fresh
from support.upstreams import Scripted

# Written as the client writes them: a backslash, then `u00e9` (the JSON body carries
# `\\\\u00e9`), and an escaped solidus.
QUESTION = "What do the escapes \\u00e9 and \\/ stand for in a JSON string?"


@pytest.fixture(scope="module")
def gw(scripted: Scripted) -> Iterator[Gateway]:
    g = start_gateway(cheap_config(scripted, pii={"mode": "mask_upstream"}))
    yield g
    g.proc.stop()


def _marker() -> str:
    return f"s73c-{os.urandom(4).hex()}"


def _chat(gw: Gateway, messages: list[dict[str, Any]]) -> httpx.Response:
    body = {"model": "cheap", "max_tokens": 5, "messages": messages}
    return gw.post("/v1/chat/completions", json=body, headers={"Cache-Control": "no-store"})


def _sent(scripted: Scripted, marker: str) -> dict[str, Any]:
    """The upstream's last body, which must be this test's request (its marker)."""
    body = dict(httpx.get(scripted.url + "/control/last").json()["body"])
    assert marker in json.dumps(body), body
    return body


def test_a_masked_text_keeps_its_other_json_escapes_as_written(
    gw: Gateway, content: Scripted
) -> None:
    """A message holding an address and a question about escapes goes upstream with the
    address masked and the question as the client wrote it; the reply's placeholder is
    restored to the address. Before: the question went upstream as `é` and `/`."""
    marker = _marker()
    text = f"{marker} Write to bob@example.com. {QUESTION}"
    content.content("I wrote to <EMAIL_1>.")
    r = _chat(gw, [{"role": "user", "content": text}])
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == "I wrote to bob@example.com."
    sent = _sent(content, marker)["messages"][0]["content"]
    assert sent == f"{marker} Write to <EMAIL_1>. {QUESTION}", sent


def test_tool_call_arguments_keep_their_escapes_but_the_masked_address(
    gw: Gateway, scripted: Scripted
) -> None:
    """A tool call's arguments with an address written with an escape: the address
    (escape and all) is masked, the other escapes stay as written (`caf\\u00e9`, an
    astral character as a surrogate pair), and the arguments are the same JSON.
    Before: `café` and the emoji went upstream decoded."""
    marker = _marker()
    arguments = (
        '{"to": "alice\\u0040example.com", "note": "caf\\u00e9 \\ud83d\\ude00", "id": "'
        + marker
        + '"}'
    )
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "send", "arguments": arguments},
    }
    messages = [
        {"role": "user", "content": "send it"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sent"},
    ]
    r = _chat(gw, messages)
    assert r.status_code == 200, r.text
    sent = _sent(scripted, marker)["messages"][1]["tool_calls"][0]["function"]["arguments"]
    assert sent == (
        '{"to": "<EMAIL_1>", "note": "caf\\u00e9 \\ud83d\\ude00", "id": "' + marker + '"}'
    ), sent
    assert json.loads(sent)["note"] == "caf\u00e9 \U0001f600"


def test_a_character_read_as_two_spans_ends_is_restored_once(
    gw: Gateway, content: Scripted
) -> None:
    """`℅` (care of) is read `c/o`: the first address's detector reads its `c`, the
    second's its `o`. The character is masked once, by the first placeholder, so the
    reply that repeats both placeholders is restored to the client's own text. Before:
    both placeholders held it, and the restored reply said `℅℅`."""
    marker = _marker()
    pair = "bob@example.com\u2105bob@example.com"
    content.content("<EMAIL_1><EMAIL_2>")
    r = _chat(gw, [{"role": "user", "content": f"{marker} {pair}"}])
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == pair
    sent = _sent(content, marker)["messages"][0]["content"]
    assert sent == f"{marker} <EMAIL_1><EMAIL_2>", sent


@pytest.mark.parametrize("path", ["/v1/models%2F", "/v1/models%2f", "/admin/requests%2F"])
def test_a_path_ending_in_an_encoded_slash_is_no_redirect(gw: Gateway, path: str) -> None:
    """The raw path's last character was `%2F`: no route answers the path one slash
    away from what the client sent, so it is a 404, not a 307 to another 404. Before:
    307 to `<path>/`, which read `/v1/models//` and answered 404."""
    r = httpx.get(gw.url + path, headers=gw.auth, follow_redirects=False)
    assert r.status_code == 404, (r.status_code, r.headers.get("location"))
    assert r.json()["error"]["code"] == "not_found", r.text
    # A plain trailing slash still moves to the route, by its path alone.
    r = httpx.get(gw.url + "/v1/models/", headers=gw.auth, follow_redirects=False)
    assert (r.status_code, r.headers["location"]) == (307, "/v1/models")


@pytest.fixture(scope="module")
def pg_gw(scripted: Scripted) -> Iterator[tuple[Gateway, str]]:
    """A gateway on PostgreSQL, and its database's URI."""
    server = Postgres()
    try:
        dsn = fresh(server.url)
        g = start_gateway(cheap_config(scripted), db=dsn)
        try:
            yield g, dsn
        finally:
            g.proc.stop()
    finally:
        server.stop()


@pytest.mark.parametrize(
    ("path", "table"),
    [
        ("/admin/usage", "usage"),
        ("/admin/cost?since=30d", "usage"),
        ("/admin/requests", "traces"),
        ("/admin/tasks", "usage"),
    ],
)
def test_an_admin_read_of_a_locked_table_stalls_no_request(
    pg_gw: tuple[Gateway, str], path: str, table: str
) -> None:
    """While another session holds the ledger's table locked, an admin read waits for
    it, and meanwhile /healthz and a chat request answer at once and an admin write (a
    new key) is made. Before: the read waited on the event loop, and every request
    waited with it until the lock was let go (3 s here)."""
    gw, dsn = pg_gw
    tenant, _ = gw.new_tenant("s73c-lock")
    with psycopg.connect(dsn) as lock, concurrent.futures.ThreadPoolExecutor(2) as pool:
        lock.execute(f"LOCK TABLE {table} IN ACCESS EXCLUSIVE MODE")
        release = threading.Timer(3.0, lock.rollback)
        release.start()
        try:
            read = pool.submit(httpx.get, gw.url + path, headers=gw.admin, timeout=30)
            time.sleep(0.5)
            t = time.monotonic()
            assert httpx.get(gw.url + "/healthz", timeout=30).status_code == 200
            body = {
                "model": "cheap",
                "max_tokens": 5,
                "messages": [{"role": "user", "content": "hi"}],
            }
            assert gw.post("/v1/chat/completions", json=body, timeout=30).status_code == 200
            made = httpx.post(
                gw.url + "/admin/keys", json={"tenant_id": tenant}, headers=gw.admin, timeout=30
            )
            waited = time.monotonic() - t
            assert made.status_code == 201, made.text
            assert waited < 1.5, f"requests waited {waited:.1f}s for an admin read"
            assert not read.done(), "the read did not wait for the lock"
            r = read.result()
        finally:
            release.join()
    assert r.status_code == 200, r.text
