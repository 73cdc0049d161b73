"""What a hostile key holder can make the gateway keep: many requests, each with a
distinct or large value in a field or header the gateway keeps somewhere. Over sockets
against real gateways in front of the scripted upstream (`--echo` where a client must
be able to make a reply as large as its prompt, as it can with any real model by
asking for a repetition). Growth is measured by what is countable: the gateway's
SQLite file (rows, their bytes, its pages in use), the series on /metrics and the
size of the gateway's log.

Defects these tests find (each fails on today's code):
- an `Idempotency-Key`'s stored reply is never removed: a row past `idempotency.ttl_s`
  is deleted only when a request repeats its key (state/idempotency.py
  `IdempotencyStore._claim`), and no retention pass sweeps the table
  (control/retention.py `Retention.enforce_retention`), so every distinct key keeps
  its whole reply in the database for ever;
- those replies are outside the byte budget `observe.max_disk_mb`: state/traces.py
  `BUDGETED` / `enforce_disk` delete traces, rollouts, stored responses and raw usage
  rows, never the `idempotency` table, so one tenant's idempotent requests keep the
  file over the budget, and the budget deletes every tenant's raw usage rows (their
  bill's detail) in vain;
- a tenant's stored responses (`/v1/responses`, `store` is the default) have no cap of
  their own, only the whole database's `observe.max_disk_mb`, whose pass deletes the
  oldest stored responses of every tenant (state/traces.py `enforce_disk`, in chunks
  of 2,000 rows): one tenant storing a few large responses deletes another tenant's
  stored response, which its owner can no longer retrieve or continue;
- past the budget, each step of `enforce_disk` deletes up to 2,000 of a table's oldest
  rows (its `chunk`), not "until 90 % of it is in use" as it says: one stored response
  too many deletes every stored response of every tenant (and every trace).

Gaps guarded (pass today; no other test measures growth): 500 requests with distinct
client values (unknown models on three protocols, pinned revisions, task, session
and idempotency keys, users, request timeouts, unknown paths and response ids, bad
parameters) add no series to /metrics and no line to the gateway's log, and no usage
row or trace row copies a large accepted header or field (a 32 KB `x-session-id`, a
512-character `user`, 16 metadata values of 512 characters).
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from support.gateways import Gateway, cheap_config, start_gateway
from support.procs import Proc
from support.upstreams import Scripted, start_scripted

BUDGET_MB = 1  # observe.max_disk_mb of the gateways that test the byte budget
QUICK = {"retention_interval_s": 0.5}  # a retention pass every half second
WIDE = {"context_window": 1_000_000}  # room for prompts of 100 KB
# How a cap of a tenant's own stored data may refuse one more (never a 200 or a 5xx
# other than 507 Insufficient Storage).
REFUSED = {403, 413, 429, 507}


def _model_wide(config: dict[str, Any]) -> dict[str, Any]:
    config["models"][0]["capabilities"] = WIDE
    return config


@pytest.fixture(scope="module")
def echo() -> Iterator[Scripted]:
    """A scripted upstream that answers with the request's last message."""
    proc, s = start_scripted("--echo")
    yield s
    proc.stop()


def _gateway(config: dict[str, Any]) -> Iterator[Gateway]:
    g = start_gateway(config)
    yield g
    g.proc.stop()


@pytest.fixture(scope="module")
def gw(scripted: Scripted) -> Iterator[Gateway]:
    """A gateway as configured by default, in front of the scripted upstream."""
    yield from _gateway(cheap_config(scripted))


@pytest.fixture(scope="module")
def gw_ttl(scripted: Scripted) -> Iterator[Gateway]:
    """Idempotency-Key replies kept one second, a retention pass every half second."""
    yield from _gateway(cheap_config(scripted, idempotency={"ttl_s": 1}, observe=QUICK))


@pytest.fixture(scope="module")
def gw_idem_disk(echo: Scripted) -> Iterator[Gateway]:
    """A 1 MiB byte budget, checked every half second; replies as large as prompts."""
    observe = {"max_disk_mb": BUDGET_MB, **QUICK}
    yield from _gateway(_model_wide(cheap_config(echo, observe=observe)))


@pytest.fixture(scope="module")
def gw_store_disk(echo: Scripted) -> Iterator[Gateway]:
    """The same, for stored responses (its own database: the tests do not share one)."""
    observe = {"max_disk_mb": BUDGET_MB, **QUICK}
    yield from _gateway(_model_wide(cheap_config(echo, observe=observe)))


@contextlib.contextmanager
def _db(gw: Gateway) -> Iterator[sqlite3.Connection]:
    with contextlib.closing(sqlite3.connect(f"file:{gw.db}?mode=ro", uri=True)) as db:
        yield db


def _bytes_in_use(gw: Gateway) -> int:
    """Bytes of the gateway's SQLite file that hold data (pages less free pages)."""
    with _db(gw) as db:
        size = db.execute("PRAGMA page_size").fetchone()[0]
        pages = db.execute("PRAGMA page_count").fetchone()[0]
        free = db.execute("PRAGMA freelist_count").fetchone()[0]
    return int((pages - free) * size)


def _count(gw: Gateway, sql: str, *args: Any) -> int:
    with _db(gw) as db:
        return int(db.execute(sql, args).fetchone()[0])


def _chat(text: str, **fields: Any) -> dict[str, Any]:
    return {
        "model": "cheap",
        "max_tokens": 4,
        "messages": [{"role": "user", "content": text}],
    } | fields


def _big(n: int = 50_000) -> str:
    """2n characters no one else sends (hex of random bytes): never a cache hit."""
    return os.urandom(n).hex()


# -- Idempotency-Key replies at rest ----------------------------------------------------


def _keyed(gw: Gateway, key: str, text: str) -> httpx.Response:
    """A chat request of `text` under an `Idempotency-Key` of its own."""
    headers = {"Idempotency-Key": f"k-{os.urandom(6).hex()}"}
    return gw.post("/v1/chat/completions", key=key, json=_chat(text), headers=headers)


def test_idempotency_replies_past_their_ttl_are_removed(gw_ttl: Gateway) -> None:
    tenant, key = gw_ttl.new_tenant("idem-ttl")
    for i in range(30):
        r = _keyed(gw_ttl, key, f"hello {i}")
        assert r.status_code == 200, r.text[:300]
    query = "SELECT COUNT(*) FROM idempotency WHERE tenant_id = ?"
    # Each key's reply is stored (the first may already be swept on a slow machine:
    # the TTL is one second).
    assert _count(gw_ttl, query, tenant) > 0
    # Past the one-second TTL and several retention passes, no stored reply can answer
    # anything any more: a repeat of its key runs anew. None should be left.
    deadline = time.monotonic() + 4.0
    while time.monotonic() < deadline and _count(gw_ttl, query, tenant):
        time.sleep(0.25)
    left = _count(gw_ttl, query, tenant)
    assert left == 0, f"{left} Idempotency-Key replies kept past idempotency.ttl_s (1 s)"


def test_idempotency_replies_are_under_the_byte_budget(gw_idem_disk: Gateway) -> None:
    gw = gw_idem_disk
    bystander, bkey = gw.new_tenant("bystander")
    r = gw.post("/v1/chat/completions", key=bkey, json=_chat("one billed request"))
    assert r.status_code == 200, r.text[:300]
    assert len(gw.stored_rows(bystander, 1)) == 1
    # Another tenant's requests, each with its own Idempotency-Key and a 100 KB
    # reply: 1.5 MB of replies against a 1 MiB budget.
    _, key = gw.new_tenant("flood")
    for i in range(15):
        r = _keyed(gw, key, f"repeat after me {i}: {_big()}")
        if r.status_code != 200:  # a cap of the tenant's own may refuse the rest
            assert r.status_code in REFUSED, r.text[:300]
            break
        assert len(r.content) > 100_000, len(r.content)
    time.sleep(2.0)  # the writer checks the budget every 0.5 s, retention likewise
    used = _bytes_in_use(gw)
    rows = _count(gw, "SELECT COUNT(*) FROM usage WHERE tenant_id = ?", bystander)
    assert used <= BUDGET_MB * 1024 * 1024 and rows == 1, (
        f"{used} bytes in use against a budget of {BUDGET_MB} MiB, "
        f"{_count(gw, 'SELECT COUNT(*) FROM idempotency')} stored replies; "
        f"the bystander tenant's usage rows left: {rows} of 1"
    )


# -- stored responses at rest -------------------------------------------------------------


def test_a_tenants_stored_responses_do_not_delete_another_tenants(gw_store_disk: Gateway) -> None:
    gw = gw_store_disk
    _, owner = gw.new_tenant("owner")
    r = gw.post("/v1/responses", key=owner, json={"model": "cheap", "input": "remember me"})
    assert r.status_code == 200, r.text[:300]
    kept = r.json()["id"]
    auth = {"Authorization": f"Bearer {owner}"}
    assert httpx.get(f"{gw.url}/v1/responses/{kept}", headers=auth).status_code == 200
    # Another tenant stores twelve responses of 100 KB prompts (each kept with its
    # input items and conversation): past the 1 MiB budget of the whole database.
    _, key = gw.new_tenant("hoarder")
    for i in range(12):
        body = {"model": "cheap", "input": f"{i} {_big()}", "max_output_tokens": 16}
        r = gw.post("/v1/responses", key=key, json=body)
        if r.status_code != 200:  # a cap of the tenant's own may refuse the rest
            assert r.status_code in REFUSED, r.text[:300]
            break
    time.sleep(2.0)  # the writer checks the budget every 0.5 s, retention likewise
    got = httpx.get(f"{gw.url}/v1/responses/{kept}", headers=auth)
    assert got.status_code == 200, (
        f"the owner's stored response is gone after another tenant stored 12: "
        f"{got.status_code} {got.text[:200]}"
    )
    assert got.json()["id"] == kept


def test_the_byte_budget_deletes_only_what_it_must(gw_store_disk: Gateway) -> None:
    """The budget deletes the oldest rows "until 90 % of it is in use": one stored
    response (about 50 KB at rest) past a 1 MiB budget costs a few of the oldest, not
    all of them. Responses are stored one at a time, each given time for a budget
    check, until a check deletes some; then what is left is counted."""
    gw = gw_store_disk
    _, key = gw.new_tenant("steady")
    count = "SELECT COUNT(*) FROM responses"
    time.sleep(1.0)  # whatever an earlier test left over the budget is dealt with
    before = _count(gw, count)
    for i in range(40):
        body = {"model": "cheap", "input": f"{i} {_big(6000)}", "max_output_tokens": 16}
        r = gw.post("/v1/responses", key=key, json=body)
        if r.status_code != 200:  # a cap of the tenant's own: the budget is never reached
            assert r.status_code in REFUSED, r.text[:300]
            assert _count(gw, count) == before, "rows deleted below the budget"
            return
        time.sleep(0.7)  # the writer and the retention pass check every 0.5 s
        now = _count(gw, count)
        if now < before + 1:  # a check deleted rows: look at what it left
            break
        before = now
    else:
        pytest.fail(f"no budget check deleted anything: {_bytes_in_use(gw)} bytes in use")
    assert now >= 3, (
        f"one response past the budget left {now} of {before + 1} stored responses "
        f"({_bytes_in_use(gw)} bytes in use against {BUDGET_MB} MiB, the target 90 %)"
    )


# -- what 500 distinct values leave behind ----------------------------------------------

N = 500
SESSION = 32_000  # an x-session-id the gateway accepts (it keeps a hash of a long one)


def _flood(gw: Gateway, key: str) -> None:
    """N requests, each with client values no other request has, over ten shapes."""
    auth = {"Authorization": f"Bearer {key}"}
    with httpx.Client(base_url=gw.url, headers=auth, timeout=30) as c:
        for i in range(N):
            tag = f"{i}-{os.urandom(3).hex()}"
            kind = i % 10
            if kind == 0:
                r = c.post("/v1/chat/completions", json=_chat("hi", model=f"model-{tag}"))
            elif kind == 1:
                r = c.post("/v1/chat/completions", json=_chat("hi", model=f"cheap@rev-{tag}"))
            elif kind == 2:
                body = {"model": f"claude-{tag}", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}  # fmt: skip
                r = c.post("/v1/messages", json=body)
            elif kind == 3:
                r = c.post("/v1/embeddings", json={"model": f"embed-{tag}", "input": "hi"})
            elif kind == 4:
                r = c.post(f"/v1/nothing-{tag}", json=_chat("hi"))
            elif kind == 5:
                r = c.get(f"/v1/responses/resp_{os.urandom(16).hex()}")
            elif kind == 6:
                r = c.post("/v1/chat/completions", json=_chat("hi", max_tokens=-1 - i))
            elif kind == 7:  # every header and field a client may choose, large
                headers = {
                    "x-session-id": f"s-{tag}-" + "s" * SESSION,
                    "x-task-id": f"task-{tag}"[:128],
                    "Idempotency-Key": f"idem-{tag}-" + "k" * 200,
                    "x-request-timeout": f"{20 + i / 1000:.3f}",
                }
                fields = {
                    "user": f"u-{tag}-" + "u" * 480,
                    "metadata": {f"k{j}-{i}": f"{tag}-" + "m" * 480 for j in range(16)},
                }
                r = c.post(
                    "/v1/chat/completions", json=_chat(f"hi {tag}", **fields), headers=headers
                )
            elif kind == 8:
                r = c.post("/v1/chat/completions", json=_chat(f"hi {tag}", user=f"user-{tag}"))
            else:
                r = c.get(f"/v1/tasks/task-{tag}")
            expected = {0: 404, 1: 404, 2: 404, 3: 404, 4: 404, 5: 404, 6: 400, 9: 404}
            assert r.status_code == expected.get(kind, 200), (kind, r.status_code, r.text[:300])


def _series(gw: Gateway) -> set[tuple[str, tuple[tuple[str, str], ...]]]:
    text = httpx.get(gw.url + "/metrics", headers=gw.admin, timeout=30).text
    return {
        (s.name, tuple(sorted(s.labels.items())))
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def _log_bytes(proc: Proc) -> int:
    return Path(proc.log.name).stat().st_size


@pytest.fixture(scope="module")
def flooded(gw: Gateway) -> dict[str, Any]:
    """One warm-up round of each shape (so every label set that may exist does), then
    the flood: the series and log size before and after, and the flooding tenant."""
    tenant, key = gw.new_tenant("flood")
    _flood(gw, key)  # warm-up: 500 requests too, so every status and shape is seen
    rows = gw.stored_rows(tenant, N * 8 // 10, timeout_s=20)  # the warm-up's rows
    assert rows
    series, log = _series(gw), _log_bytes(gw.proc)
    _flood(gw, key)
    return {
        "tenant": tenant,
        "series": (series, _series(gw)),
        "log": (log, _log_bytes(gw.proc)),
    }


def test_distinct_client_values_add_no_metrics_series(flooded: dict[str, Any]) -> None:
    before, after = flooded["series"]
    new = sorted(after - before)
    assert not new, f"{len(new)} series added by {N} requests: {new[:10]}"


def test_distinct_client_values_add_nothing_to_the_log(flooded: dict[str, Any]) -> None:
    before, after = flooded["log"]
    assert after - before < 1024, f"{after - before} bytes of log for {N} requests"


def test_no_row_at_rest_copies_a_large_header_or_field(
    gw: Gateway, flooded: dict[str, Any]
) -> None:
    tenant = flooded["tenant"]
    gw.stored_rows(tenant, 2 * N * 8 // 10, timeout_s=20)  # all but unknown paths, tasks
    with _db(gw) as db:
        cols = [r[1] for r in db.execute("PRAGMA table_info(usage)")]
        width = "+".join(f"coalesce(length(CAST({c} AS BLOB)), 0)" for c in cols)
        usage = db.execute(f"SELECT MAX({width}) FROM usage WHERE tenant_id = ?", (tenant,))
        widest_usage = usage.fetchone()[0]
        traces = db.execute(
            "SELECT COUNT(*), MAX(length(CAST(record AS BLOB))) FROM traces WHERE tenant_id = ?",
            (tenant,),
        )
        n_traces, widest_trace = traces.fetchone()
    assert n_traces >= N  # the big-header requests are among them
    # A 32 KB session id, 8 KB of metadata and a 512-character user were sent: a row
    # keeps at most their bounded traces (ids, hashes), a few KB at most.
    assert widest_usage < 1024, f"a usage row of {widest_usage} bytes"
    assert widest_trace < 8192, f"a trace of {widest_trace} bytes"
