"""Hostile values against the stores on PostgreSQL, and the same values on SQLite (s73).

PostgreSQL refuses values SQLite takes: a NUL character in text, an index entry over
~2.7 kB. Defects these tests find (each failed before its fix):
- the ledger writer lost a whole batch to one row the database refused: every other
  request's usage row, trace and daily sum in the same transaction went with it
  (three tries, then dropped); an index entry too long (program_limit_exceeded, an
  OperationalError in psycopg) was taken for an outage, so the writer waited 30 s
  with every batch queued behind it before dropping it;
- a NUL in an admin value (a key's name, a tenant or key id in a path, a filter of
  /admin/usage, /admin/keys, /admin/tool-calls) was a 500 `internal_error` on
  PostgreSQL, where SQLite stored the name or answered 404 or an empty list: now a
  400 naming the NUL on both stores, and the gateway serves on;
- a row the writer dropped was only logged in the writer's process: the gateway's
  `dropped` count (/metrics `switchyard_ledger_rows_dropped`) stayed 0. The writer now
  tells it with each flush's answer.

Key holders' values that reach rows hold up on PostgreSQL (probed, no test kept):
model names (an unknown one is recorded as "(unknown model)"), `user` (control
characters refused), x-task-id, x-request-id and Idempotency-Key (bounded patterns),
metadata and message text with NULs (sealed bytes, JSON-escaped traces),
previous_response_id and response ids in paths, MCP call ids, invalid surrogates
(not valid JSON).
"""

from __future__ import annotations

import base64
import logging
import os
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import msgspec
import psycopg
import pytest

from support.gateways import Gateway, start_gateway
from support.postgres_server import Postgres, fresh
from support.stores import ledger_entry
from support.upstreams import Scripted
from switchyard.pipeline import RequestContext, RequestInput, Timings
from switchyard.request import NOT_READ
from switchyard.state import ledger_batch
from switchyard.state.ledger import Finished, UsageLedger, spawn_shared_writer
from switchyard.state.ledger_batch import write_batch
from switchyard.state.sealing import Sealer
from switchyard.state.sql import connect
from switchyard.state.traces import LedgerBatch, LedgerEntry, StoredRow

AT = 1_700_000_000.5


@pytest.fixture(scope="module")
def postgres() -> Iterator[Postgres]:
    server = Postgres()
    yield server
    server.stop()


def _entry(rid: str, task: str, tenant: str = "t1") -> LedgerEntry:
    return ledger_entry(request_id=rid, task_id=task, tenant_id=tenant, received_at=AT)


def _stored(rid: str, deployment: str) -> StoredRow:
    body = msgspec.Raw(b'{"id": "%s"}' % rid.encode())
    return StoredRow("t1", rid, AT, "completed", "m", deployment, None, 0, None, body, AT)


def _store(kind: str, postgres: Postgres) -> Any:
    if kind == "postgresql":
        return connect(fresh(postgres.url))
    return connect(str(Path(tempfile.mkdtemp(prefix="s73-")) / "sy.db"))


@pytest.mark.parametrize("kind", ["sqlite", "postgresql"])
def test_a_nul_in_one_row_loses_no_other_row_of_its_batch(kind: str, postgres: Postgres) -> None:
    """Three requests and two stored responses in one batch, a NUL in one request's
    task id and one response's deployment: every row, trace, stored response and
    daily sum is kept, the NUL made U+FFFD, alike on both stores (before: the whole
    batch dropped on PostgreSQL, the NUL stored as is on SQLite)."""
    conn = _store(kind, postgres)
    try:
        entries = [_entry("r1", "a"), _entry("r2", "b\x00c"), _entry("r3", "d")]
        responses = [_stored("resp_1", "x\x00y"), _stored("resp_2", "z")]
        batch = LedgerBatch({}, entries, responses)
        started = time.monotonic()
        assert write_batch(conn, batch, Sealer(b"k" * 32)) is True
        assert time.monotonic() - started < 5
        rows = conn.execute("SELECT request_id, task_id FROM usage ORDER BY request_id").fetchall()
        assert [tuple(r) for r in rows] == [("r1", "a"), ("r2", "b\ufffdc"), ("r3", "d")]
        traces = conn.execute("SELECT request_id FROM traces ORDER BY request_id").fetchall()
        assert [r[0] for r in traces] == ["r1", "r2", "r3"]
        daily = conn.execute(
            "SELECT requests, input_tokens, output_tokens, cost_usd FROM usage_daily"
        ).fetchall()
        assert [tuple(r) for r in daily] == [(3, 30, 15, 0.75)]
        kept = conn.execute("SELECT id, deployment FROM responses ORDER BY id").fetchall()
        assert [tuple(r) for r in kept] == [("resp_1", "x\ufffdy"), ("resp_2", "z")]
    finally:
        conn.close()


def test_a_row_too_long_to_index_is_dropped_alone_and_counted_without_a_wait(
    postgres: Postgres, caplog: pytest.LogCaptureFixture
) -> None:
    """A task id no B-tree entry holds (incompressible, 8 kB): its row alone is dropped,
    counted and logged by its request id without its content; the batch's other rows
    and their daily sums are kept, at once (before: taken for an outage, the writer
    waited 30 s, then dropped all three)."""
    conn = _store("postgresql", postgres)
    huge = base64.b64encode(os.urandom(6000)).decode()
    dropped = ledger_batch.DROPPED[0]
    try:
        batch = LedgerBatch({}, [_entry("r1", "a"), _entry("r2", huge), _entry("r3", "d")])
        started = time.monotonic()
        with caplog.at_level(logging.ERROR, logger="switchyard.ledger"):
            assert write_batch(conn, batch) is False
        assert time.monotonic() - started < 5
        rows = conn.execute("SELECT request_id FROM usage ORDER BY request_id").fetchall()
        assert [r[0] for r in rows] == ["r1", "r3"]
        daily = conn.execute("SELECT requests, cost_usd FROM usage_daily").fetchall()
        assert [tuple(r) for r in daily] == [(2, 0.5)]
        assert ledger_batch.DROPPED[0] == dropped + 1
        assert "ledger row r2 dropped" in caplog.text and huge[:40] not in caplog.text
    finally:
        conn.close()


@pytest.fixture(scope="module")
def gateways(postgres: Postgres, scripted: Scripted) -> Iterator[dict[str, Gateway]]:
    cfg = {
        "models": [{"alias": "m", "engine": {"kind": "openai", "base_url": scripted.url + "/v1"}}],
        "embeddings": {"enabled": False},
    }
    gws: dict[str, Gateway] = {}
    try:
        gws["postgresql"] = start_gateway(cfg, db=fresh(postgres.url))
        gws["sqlite"] = start_gateway(cfg)
        yield gws
    finally:
        for gw in gws.values():
            gw.proc.stop()


NUL_ADMIN = [
    ("POST", "/admin/keys", {"name": "a\x00b"}),
    ("GET", "/admin/tenants/a%00b", None),
    ("GET", "/admin/keys/a%00b", None),
    ("POST", "/admin/keys/a%00b/revoke", None),
    ("GET", "/admin/tenants?after=a%00", None),
    ("GET", "/admin/keys?tenant=a%00", None),
    ("GET", "/admin/usage?tenant=a%00", None),
    ("GET", "/admin/usage?key=a%00", None),
    ("GET", "/admin/requests/a%00", None),
    ("GET", "/admin/tool-calls?tenant=a%00", None),
    ("POST", "/admin/tool-calls", {"tenant": "a\x00", "call_id": "c\x00", "ran": True}),
]


@pytest.mark.parametrize("kind", ["sqlite", "postgresql"])
def test_a_nul_in_an_admin_value_is_a_400_on_both_stores(
    kind: str, gateways: dict[str, Gateway]
) -> None:
    """Each admin call with a NUL in a value it stores or looks up is refused with a 400
    naming the NUL, no database text, alike on both stores; the gateway serves on and
    its ledger still writes (before: 500s on PostgreSQL; on SQLite a key named with a
    NUL was stored, lookups answered 404 or 200)."""
    gw = gateways[kind]
    tenant = gw.create_tenant(f"s73-{kind}")["id"]
    for method, path, body in NUL_ADMIN:
        if body is not None and path == "/admin/keys":
            body = {**body, "tenant_id": tenant}
        r = httpx.request(method, gw.url + path, json=body, headers=gw.admin, timeout=30)
        assert r.status_code == 400, (path, r.status_code, r.text)
        err = r.json()["error"]
        assert err["type"] == "invalid_request_error" and "NUL" in err["message"], (path, err)
        assert "psycopg" not in r.text and "PostgreSQL" not in r.text
    names = [k.get("name") for k in httpx.get(
        gw.url + "/admin/keys", params={"tenant": tenant}, headers=gw.admin
    ).json()["data"]]  # fmt: skip
    assert names == []
    key = gw.create_key(tenant)["key"]
    task = f"s73-{kind}-{os.urandom(3).hex()}"
    r = httpx.post(
        gw.url + "/v1/chat/completions",
        json={"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
        headers={"Authorization": f"Bearer {key}", "x-task-id": task},
        timeout=30,
    )
    assert r.status_code == 200, r.text
    assert [row["task_id"] for row in gw.tenant_rows(tenant)] == [task]
    if kind == "postgresql":
        with psycopg.connect(gw.db) as c:
            got = c.execute("SELECT count(*) FROM usage WHERE tenant_id = %s", (tenant,))
            assert got.fetchone() == (1,)


def _finished(rid: str, task: str | None = None) -> Finished:
    now = time.perf_counter()
    ctx = RequestContext(
        RequestInput(rid, "chat.completions", time.time(), task_id=task),
        NOT_READ,
        Timings(now),
        now + 5,
    )
    ctx.timings.ended = now
    return Finished(ctx, "ok", 1, 1, 0.0)


@pytest.mark.parametrize("shared", [False, True], ids=["own-writer", "shared-writer"])
def test_rows_the_writer_drops_are_counted_by_the_gateway(postgres: Postgres, shared: bool) -> None:
    """A row the database refuses even made storable is dropped by the writer process;
    the gateway that recorded it counts it in `dropped` (its /metrics counter
    `switchyard_ledger_rows_dropped`), told with the writer's answer to its next flush.
    Before, the writer only logged it: the gateway reported 0 rows dropped."""
    url = fresh(postgres.url)
    huge = base64.b64encode(os.urandom(6000)).decode()  # no B-tree entry holds it
    sock_dir = Path(tempfile.mkdtemp(prefix="sy-s73-"))
    writer = spawn_shared_writer(url, str(sock_dir / "w.sock")) if shared else None
    led = UsageLedger(
        url, flush_s=0.005, writer_socket=str(sock_dir / "w.sock") if shared else None
    )
    try:
        led.record(_finished("kept-1"))
        led.record(_finished("refused", huge))
        led.record(_finished("kept-2"))
        led.flush()
        assert led.dropped == 1
        led.record(_finished("kept-3"))
        led.flush()
        assert led.dropped == 1  # counted once, not again with each answer
        conn = connect(url)
        try:
            ids = {r[0] for r in conn.execute("SELECT request_id FROM usage").fetchall()}
        finally:
            conn.close()
        assert ids == {"kept-1", "kept-2", "kept-3"}
    finally:
        led.close()
        if writer is not None:
            writer.stop()
        for p in sock_dir.iterdir():
            p.unlink()
        sock_dir.rmdir()
