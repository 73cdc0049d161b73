"""The store on PostgreSQL (storage.postgres_dsn): a real server started here, the same
store code as on SQLite (state/sql_pg.py), and gateways sharing it."""

from __future__ import annotations

import concurrent.futures
import json
import os
import random
import sqlite3
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from support.gateways import ADMIN_KEY, Gateway, start_gateway
from support.postgres_server import Postgres, fresh
from support.stores import fill_store, ledger_entry
from support.upstreams import Scripted, start_scripted
from switchyard.state import sql_pg
from switchyard.state.ledger_batch import write_batch
from switchyard.state.ledger_reads import spent_since, usage_rows
from switchyard.state.sql import connect
from switchyard.state.traces import LedgerBatch, LedgerEntry
from switchyard.state.weights import cut_weight, read_weights, write_weights


@pytest.fixture(scope="module")
def postgres() -> Iterator[Postgres]:
    server = Postgres()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def server(postgres: Postgres) -> str:
    return postgres.url


def test_translation_of_the_sqlite_dialect() -> None:
    t = sql_pg.translate
    assert t("SELECT * FROM tenants WHERE id = ?", True) == "SELECT * FROM tenants WHERE id = %s"
    assert t("SELECT 1 WHERE 'a%' = ?", True) == "SELECT 1 WHERE 'a%%' = %s"
    assert t("SELECT 1", False) == "SELECT 1"
    assert t("BEGIN IMMEDIATE", False) == "BEGIN"
    assert (
        t("INSERT OR IGNORE INTO trace_templates (id, template) VALUES (?, ?)", True)
        == "INSERT INTO trace_templates (id, template) VALUES (%s, %s) ON CONFLICT DO NOTHING"
    )
    assert t("INSERT OR REPLACE INTO traces (request_id, status) VALUES (?, ?)", True) == (
        "INSERT INTO traces (request_id, status) VALUES (%s, %s)"
        " ON CONFLICT (request_id) DO UPDATE SET status = EXCLUDED.status"
    )
    assert sql_pg.ddl("a REAL, b INTEGER, c BLOB, realm TEXT") == (
        "a DOUBLE PRECISION, b BIGINT, c BYTEA, realm TEXT"
    )
    assert sql_pg.redact("postgresql://sy:s3cret@db:5432/x") == "postgresql://sy:***@db:5432/x"
    assert sql_pg.redact("postgresql://sy@db/x") == "postgresql://sy@db/x"
    assert sql_pg.redact("/var/lib/sy.db") == "/var/lib/sy.db"


# -- the same rows on both databases ------------------------------------------------------

_entry = st.builds(
    lambda rid, tenant, key, model, inp, out, cost, status, at, decided: ledger_entry(
        request_id=f"r{rid}",
        task_id=f"task-{rid % 3}",
        tenant_id=tenant,
        key_id=key,
        model=model,
        requested_model=model,
        status=status,
        error_code=None if status == "ok" else "upstream_error",
        input_tokens=inp,
        output_tokens=out,
        cost_usd=cost,
        received_at=at,
        decisions=[["select", "deployment:m", "why", None, 0.0, 0.001]] if decided else None,
    ),
    st.integers(0, 12),  # request ids repeat: a row written again replaces the first
    st.sampled_from(["t1", "t2", None]),
    st.sampled_from(["k1", "k2", None]),
    st.sampled_from(["m", "n"]),
    st.integers(0, 5000),
    st.integers(0, 5000),
    st.sampled_from([0.0, 0.25, 1e-6]),
    st.sampled_from(["ok", "error"]),
    st.sampled_from([1_700_000_000.5, 1_700_050_000.25, 1_700_100_000.0]),  # three UTC days
    st.booleans(),
)


def _read(conn: Any) -> dict[str, Any]:
    return {
        "rows": sorted(
            (tuple(sorted(r.items())) for r in usage_rows(conn, None, None, None, 1000)),
            key=repr,
        ),
        "daily": sorted(tuple(r) for r in conn.execute("SELECT * FROM usage_daily").fetchall()),
        "spent": [
            round(spent_since(conn, col, ident, 1_700_000_000.0), 9)
            for col, ident in (("tenant_id", "t1"), ("key_id", "k2"))
        ],
        "traces": sorted(
            tuple(r) for r in conn.execute("SELECT request_id, status FROM traces").fetchall()
        ),
    }


def test_ledger_batches_read_back_the_same_from_sqlite_and_postgresql(server: str) -> None:
    """Generated batches (request ids repeating, three days, costs, errors, traces or
    none) committed by the ledger writer's `write_batch` into a SQLite file and into
    PostgreSQL read back the same usage rows, daily rollups, spend and traces."""

    @settings(max_examples=25, deadline=None)
    @given(st.lists(st.lists(_entry, min_size=1, max_size=8), min_size=1, max_size=4))
    def check(batches: list[list[LedgerEntry]]) -> None:
        with tempfile.TemporaryDirectory() as tmp:
            lite = connect(str(Path(tmp) / "sy.db"))
            post = connect(fresh(server))
            try:
                for entries in batches:
                    batch = LedgerBatch({}, entries)
                    assert write_batch(lite, batch) and write_batch(post, batch)  # type: ignore[arg-type]
                assert _read(lite) == _read(post)
            finally:
                lite.close()
                post.close()

    check()


def test_the_byte_budget_on_postgresql_deletes_oldest_traces_then_rows(server: str) -> None:
    """observe.max_disk_mb on PostgreSQL counts the rows' own bytes (its files do not
    shrink on DELETE): past it the oldest traces go, then the oldest usage rows, down
    to 90 %; the daily rollups stay."""
    from switchyard.state.traces import BUDGETED, enforce_disk, row_bytes

    conn = connect(fresh(server))
    fill_store(conn, 1500, "x" * 1500)

    def in_use() -> float:
        return sum(n * mean for n, mean in (row_bytes(conn, t, at=at) for t, at, _ in BUDGETED))

    budget = 1024 * 1024
    assert in_use() > 2 * budget
    assert enforce_disk(conn, budget) > 0
    assert budget * 0.8 <= in_use() <= budget
    assert conn.execute("SELECT COUNT(*) FROM traces").fetchone()[0] == 0
    assert conn.execute("SELECT COUNT(*) FROM rollouts").fetchone()[0] == 0
    (oldest,) = conn.execute("SELECT MIN(received_at) FROM usage").fetchone()
    (newest,) = conn.execute("SELECT MAX(received_at) FROM usage").fetchone()
    assert oldest > 1_800_000_000.0 and newest == 1_800_000_000.0 + 1499
    assert conn.execute("SELECT cost_usd FROM usage_daily").fetchone()[0] == 9.5
    assert enforce_disk(conn, budget) == 0  # under budget: nothing more
    conn.close()


def test_errors_come_back_as_sqlite3s(server: str) -> None:
    conn = connect(fresh(server))
    try:
        conn.execute("INSERT INTO tenants (id, created_at) VALUES (?, ?)", ("a", 1.0))
        with pytest.raises(sqlite3.IntegrityError):
            conn.execute("INSERT INTO tenants (id, created_at) VALUES (?, ?)", ("a", 2.0))
        row = conn.execute("SELECT id, created_at FROM tenants").fetchone()
        assert row["id"] == "a" and row[1] == 1.0 and dict(row) == {"id": "a", "created_at": 1.0}
    finally:
        conn.close()
    with pytest.raises(sqlite3.OperationalError):
        connect("postgresql://nobody@127.0.0.1:1/none")


def test_a_canary_cut_is_reported_once_on_postgresql_too(server: str) -> None:
    """`cut_weight`'s conditional upsert says which write cut the canary on PostgreSQL
    as on SQLite (tests/unit/state/test_canary_weights.py): the first, not the others."""
    dsn = fresh(server)
    conns = [connect(dsn) for _ in range(3)]
    try:
        assert [cut_weight(c, "chat", "canary", "error rate 1.00") for c in conns] == [
            True,
            False,
            False,
        ]
        write_weights(conns[1], "chat", {"canary": 1.0}, "promoted again")
        assert cut_weight(conns[2], "chat", "canary", "again") is True
        assert read_weights(conns[0])["chat"]["canary"]["reason"] == "again"
    finally:
        for c in conns:
            c.close()


# -- gateways on one PostgreSQL -------------------------------------------------------------


@pytest.fixture(scope="module")
def upstream() -> Iterator[Scripted]:
    proc, s = start_scripted()
    yield s
    proc.stop()


def _config(upstream: Scripted) -> dict[str, Any]:
    return {
        "models": [{"alias": "m", "engine": {"kind": "openai", "base_url": upstream.url + "/v1"}}],
        "embeddings": {"enabled": False},
    }


def _chat(gw: Gateway, key: str, **headers: str) -> httpx.Response:
    return httpx.post(
        gw.url + "/v1/chat/completions",
        json={"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
        headers={"Authorization": f"Bearer {key}", **headers},
        timeout=30,
    )


def test_two_gateways_share_keys_ledger_traces_and_idempotency(
    server: str, upstream: Scripted
) -> None:
    db = fresh(server)
    one = start_gateway(_config(upstream), db=db)
    two = start_gateway(_config(upstream), db=db)
    try:
        # A key made through one gateway is served by the other.
        one.create_tenant("acme")
        key = one.create_key("acme")["key"]
        task = f"task-{time.monotonic_ns()}"
        steps = [_chat(gw, key, **{"x-task-id": task}) for gw in (one, two, one)]
        assert [r.status_code for r in steps] == [200, 200, 200], steps[-1].text
        # The ledger writer got the database by its environment, not its command line.
        writers = [
            p
            for p in Path("/proc").glob("[0-9]*")
            if b"switchyard.observe.ledger_writer" in _cmdline(p)
        ]
        assert writers and all(db.encode() not in _cmdline(p) for p in writers)
        # Both gateways' rows land in PostgreSQL ...
        ids = {r.headers["x-request-id"] for r in steps}
        with psycopg.connect(db) as c:
            deadline = time.monotonic() + 20  # the writer commits a moment after
            while True:
                got = {
                    r[0]
                    for r in c.execute("SELECT request_id FROM usage WHERE task_id = %s", (task,))
                }
                if got == ids or time.monotonic() > deadline:
                    break
                time.sleep(0.1)
        assert got == ids
        # ... and the task's trace, steps from both, reads back through the CLI.
        shown = subprocess.run(
            [sys.executable, "-m", "switchyard", "trace", "show", task, "--db", db, "--json"],
            capture_output=True,
            text=True,
            timeout=60,
            env={**os.environ, "SWITCHYARD_ADMIN_KEY": ADMIN_KEY},
        )
        assert shown.returncode == 0, shown.stderr
        report = json.loads(shown.stdout)
        assert {r["request_id"] for r in report["requests"]} == ids
        assert report["task"]["llm_calls"] == 3
        # One Idempotency-Key sent to both at once: one upstream call, one answer.
        before = upstream.requests()
        upstream.fault("delay:400", count=2)
        idem = {"Idempotency-Key": f"k-{time.monotonic_ns()}"}
        with concurrent.futures.ThreadPoolExecutor(2) as ex:
            replies = list(ex.map(lambda gw: _chat(gw, key, **idem), (one, two)))
        assert [r.status_code for r in replies] == [200, 200], [r.text for r in replies]
        assert replies[0].json()["id"] == replies[1].json()["id"]
        assert upstream.requests() == before + 1
    finally:
        one.proc.stop()
        two.proc.stop()


def _cmdline(p: Path) -> bytes:
    try:
        return (p / "cmdline").read_bytes()
    except OSError:
        return b""


def test_deployment_weights_set_on_one_gateway_apply_on_another(
    server: str, upstream: Scripted
) -> None:
    """The canary weights of #27 in the shared store: a rollback through one gateway's
    admin API moves the traffic of a gateway on another machine (here: process)."""
    db = fresh(server)
    cfg = {
        "models": [
            {
                "alias": "chat",
                "revision": "r1",
                "deployments": [
                    {
                        "name": "stable",
                        "engine": {"kind": "openai", "base_url": upstream.url + "/v1"},
                    },
                    {
                        "name": "canary",
                        "revision": "r2",
                        "canary": True,
                        "engine": {"kind": "openai", "base_url": upstream.url + "/v1"},
                    },
                ],
                "balance": {"strategy": "weighted", "affinity": False},
            }
        ],
        "embeddings": {"enabled": False},
    }
    one = start_gateway(cfg, db=db)
    two = start_gateway(cfg, db=db)
    try:
        r = httpx.post(one.url + "/admin/models/chat/rollback", headers=one.admin)
        assert r.status_code == 200 and r.json()["weights"] == {"stable": 1.0, "canary": 0.0}
        deadline = time.monotonic() + 20  # read by every gateway every 2 s
        while True:
            deps = httpx.get(two.url + "/readyz").json()["models"]["chat"]["deployments"]
            if deps["canary"]["weight"] == 0.0 or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert deps["canary"]["weight"] == 0.0 and deps["stable"]["weight"] == 1.0
        revs = {
            httpx.post(
                two.url + "/v1/chat/completions",
                json={"model": "chat", "messages": [{"role": "user", "content": "hi"}]},
                headers={"Authorization": f"Bearer {two.key}"},
                timeout=30,
            ).headers["x-switchyard-revision"]
            for _ in range(8)
        }
        assert revs == {"r1"}
    finally:
        one.proc.stop()
        two.proc.stop()


def test_a_gateway_whose_postgresql_is_unreachable_says_so(upstream: Scripted) -> None:
    port = random.randint(20000, 30000)
    gw_proc = subprocess.run(
        [sys.executable, "-m", "switchyard", "serve", "--port", "0"],
        capture_output=True,
        text=True,
        timeout=60,
        env={
            **os.environ,
            "SWITCHYARD_SQLITE_PATH": f"postgresql://sy:s3cret@127.0.0.1:{port}/none",
            "SWITCHYARD_ADMIN_KEY": ADMIN_KEY,
        },
    )
    assert gw_proc.returncode != 0
    err = gw_proc.stderr
    assert "PostgreSQL" in err and "unreachable" in err, err[-2000:]
    assert "s3cret" not in err and "Traceback" not in err, err[-2000:]


def test_a_postgresql_restart_refuses_what_needs_it_and_loses_no_usage_row(
    postgres: Postgres, upstream: Scripted
) -> None:
    db = fresh(postgres.url)
    gw = start_gateway(_config(upstream), db=db)
    try:
        gw.create_tenant("acme")
        cached = gw.create_key("acme")["key"]
        fresh_key = gw.create_key("acme")["key"]  # never used before the outage
        assert _chat(gw, cached).status_code == 200
        postgres.stop()
        try:
            # A key the gateway has not cached needs the database: 503, named.
            r = _chat(gw, fresh_key)
            assert r.status_code == 503, r.text
            assert r.json()["error"]["code"] == "store_unavailable" and "Retry-After" in r.headers
            assert "Traceback" not in r.text and "psycopg" not in r.text
            # A cached key is served; its usage row waits in the ledger writer.
            during = _chat(gw, cached)
            assert during.status_code == 200, during.text
        finally:
            postgres.start()
        rid = during.headers["x-request-id"]
        with psycopg.connect(db) as c:
            deadline = time.monotonic() + 40  # the writer retries for up to 30 s
            while not c.execute("SELECT 1 FROM usage WHERE request_id = %s", (rid,)).fetchone():
                assert time.monotonic() < deadline, "the row written during the outage was lost"
                time.sleep(0.2)
        assert _chat(gw, fresh_key).status_code == 200  # reconnected
    finally:
        gw.proc.stop()


def test_revisions_and_rollout_records_are_stored_alike_on_both_stores(
    server: str, tmp_path: Path
) -> None:
    """The RL tables (observe/rollouts.py) through the same SQL on SQLite and
    PostgreSQL: revisions upserted and read back, records stored once per sample id,
    exported in pages in order with their filters, and aged out by retention."""
    from switchyard.observe.rollouts import (
        enforce_rollout_retention,
        export_rollouts,
        read_revisions,
        write_revision,
        write_rollouts,
    )

    def record(i: int, rev: str) -> dict[str, Any]:
        return {
            "sample_id": f"s-{i:03d}",
            "request_id": f"r-{i // 4}",
            "tenant_id": "t1" if i % 3 else "t2",
            "finished_at": 1_800_000_000.0 + i // 2,  # pairs share a time: ids break ties
            "provenance": {"model": "smol", "revision": rev},
            "token_ids": [i, i + 1],
            "text": f"sample {i} ✓",
        }

    def run(conn: Any) -> dict[str, Any]:
        base = {"alias": "smol", "kind": "base", "path": "/w/a.gguf", "sha256": "a" * 64,
                "reason": "", "created_at": 1.0}  # fmt: skip
        write_revision(conn, {**base, "revision": "v1", "state": "prepared",
                              "updated_at": 1.0, "history": [{"state": "prepared"}]})  # fmt: skip
        write_revision(conn, {**base, "revision": "v1", "state": "active", "reason": "ok",
                              "updated_at": 2.0,
                              "history": [{"state": "prepared"}, {"state": "active"}]})  # fmt: skip
        write_revision(conn, {**base, "revision": "v2", "state": "rejected", "reason": "x" * 2000,
                              "created_at": 3.0, "updated_at": 3.0, "history": []})  # fmt: skip
        records = [record(i, "v1" if i < 30 else "v2") for i in range(50)]
        stored = write_rollouts(conn, records)
        again = write_rollouts(conn, [{**records[0], "text": "changed"}])  # kept as it was
        out = {
            "revisions": read_revisions(conn, "smol"),
            "stored": (stored, again),
            "all": list(export_rollouts(conn, batch=7)),
            "since": [r["sample_id"] for r in export_rollouts(conn, 1_800_000_010.0, batch=3)],
            "v2_t2": [
                r["sample_id"]
                for r in export_rollouts(conn, revision="v2", tenant_id="t2", batch=2)
            ],
            "aged": enforce_rollout_retention(conn, 1.0, now=1_800_000_020.0 + 86400),
        }
        out["left"] = [r["sample_id"] for r in export_rollouts(conn)]
        return out

    lite, post = connect(str(tmp_path / "rl.db")), connect(fresh(server))
    try:
        a, b = run(lite), run(post)
    finally:
        lite.close()
        post.close()
    assert a == b
    revs = {r["revision"]: r for r in a["revisions"]}
    assert revs["v1"]["state"] == "active" and len(revs["v1"]["history"]) == 2
    assert revs["v2"]["state"] == "rejected" and len(revs["v2"]["reason"]) == 1000
    assert a["stored"] == (50, 1)
    assert [r["sample_id"] for r in a["all"]] == [f"s-{i:03d}" for i in range(50)]
    assert a["all"][0]["text"] == "sample 0 ✓"  # the first write stands
    assert a["since"] == [f"s-{i:03d}" for i in range(20, 50)]
    assert a["v2_t2"] == [f"s-{i:03d}" for i in range(30, 50) if i % 3 == 0]
    assert a["aged"] == 40 and a["left"] == [f"s-{i:03d}" for i in range(40, 50)]
