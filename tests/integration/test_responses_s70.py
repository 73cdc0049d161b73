"""Background responses' leases (state/responses.py): each gateway process owns what it
runs under a name of its own and renews one lease for all of it; what nothing runs any
more (its gateway crashed here or elsewhere, or stopped) is failed with the documented
reason and frees its tenant's place; an orderly stop is recorded as the gateway's
doing, not an upstream's. Over sockets against real gateways, and on the store itself
on SQLite (an older file upgraded) and on a real PostgreSQL server."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import os
import secrets
import signal
import socket
import sqlite3
import time
from pathlib import Path
from typing import Any

import httpx
import psycopg

from support.gateways import Gateway, start_gateway
from support.postgres_server import Postgres
from support.upstreams import Scripted
from switchyard.state.responses import (
    KEY_FILE,
    ORPHAN_REASON,
    ResponseStore,
    Sealer,
    StoredResponse,
    instance_name,
    new_response_id,
    owner_gone,
)
from switchyard.state.sql import connect


def _config(scripted: Scripted, **responses: Any) -> dict[str, Any]:
    model = {
        "alias": "one",
        "engine": {"kind": "openai", "base_url": scripted.url + "/v1"},
        "resilience": {"retries": 0},
    }
    return {
        "models": [model],
        "embeddings": {"enabled": False},
        "responses": {"max_background_per_tenant": 1, **responses},
    }


def _background(gw: Gateway, key: str) -> httpx.Response:
    body = {"model": "one", "input": "hi", "background": True}
    return gw.post("/v1/responses", key=key, json=body, timeout=30)


def _get(gw: Gateway, key: str, rid: str) -> dict[str, Any]:
    r = httpx.get(f"{gw.url}/v1/responses/{rid}", headers={"Authorization": f"Bearer {key}"})
    assert r.status_code == 200, r.text
    return dict(r.json())


def _row(db: str, rid: str) -> dict[str, Any]:
    """The response's plain columns, read from the gateway's SQLite file."""
    with contextlib.closing(sqlite3.connect(f"file:{db}?mode=ro", uri=True)) as conn:
        conn.row_factory = sqlite3.Row
        row = conn.execute(
            "SELECT status, owner, lease_until, updated_at FROM responses WHERE id = ?", (rid,)
        ).fetchone()
    assert row is not None, rid
    return dict(row)


def _sealer(db: str) -> Sealer:
    """The gateway's own key, from the key file beside its database."""
    return Sealer(base64.urlsafe_b64decode((Path(db).parent / KEY_FILE).read_text().strip()))


def test_a_running_response_is_its_process_s_and_its_lease_is_renewed(
    scripted: Scripted,
) -> None:
    gw = start_gateway(_config(scripted, lease_s=1))
    try:
        scripted.fault("delay:3000", count=1)
        r = _background(gw, gw.key)
        assert r.status_code == 200, r.text
        rid = r.json()["id"]
        first = _row(gw.db, rid)
        # Owned by this very process (host:pid:...), not by a host and port.
        host, pid, _, _ = first["owner"].split(":")
        assert (host, pid) == (socket.gethostname(), str(gw.proc.popen.pid))
        time.sleep(2.2)  # past two lease periods: it was renewed, nobody failed it
        later = _row(gw.db, rid)
        assert later["status"] == "in_progress"
        assert later["lease_until"] is not None and later["lease_until"] > time.time()
        assert later["lease_until"] > first["updated_at"] + 1  # renewed past its first
        deadline = time.monotonic() + 10
        while _get(gw, gw.key, rid)["status"] == "in_progress" and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _get(gw, gw.key, rid)["status"] == "completed"
    finally:
        gw.proc.stop()


def test_a_crashed_gateway_s_place_is_freed_by_one_that_was_already_running(
    scripted: Scripted,
) -> None:
    first = start_gateway(_config(scripted))  # the default lease (15 s): not what frees it
    second: Gateway | None = None
    try:
        second = start_gateway(_config(scripted), db=first.db)
        scripted.fault("hang", count=1)
        r = _background(first, first.key)
        assert r.status_code == 200, r.text
        rid = r.json()["id"]
        assert _background(second, first.key).status_code == 429  # the tenant's one place
        os.killpg(first.proc.popen.pid, signal.SIGKILL)
        first.proc.popen.wait(10)
        # The process that ran it is gone: its place is free at once, through a gateway
        # that was running all along, and the orphan reads failed, saying why.
        again = _background(second, first.key)
        assert again.status_code == 200, again.text
        orphan = _get(second, first.key, rid)
        assert (orphan["status"], orphan["error"]["message"]) == ("failed", ORPHAN_REASON)
        assert _row(first.db, rid)["status"] == "failed"
    finally:
        first.proc.stop()
        if second is not None:
            second.proc.stop()


def test_an_orderly_stop_fails_its_background_responses_and_records_them_cancelled(
    scripted: Scripted,
) -> None:
    gw = start_gateway(_config(scripted))
    tenant, key = gw.new_tenant("stop")
    try:
        scripted.fault("hang", count=1)
        r = _background(gw, key)
        assert r.status_code == 200, r.text
        rid = r.json()["id"]
    finally:
        gw.proc.stop()  # SIGTERM
    assert gw.proc.popen.returncode is not None
    store = ResponseStore(connect(gw.db), _sealer(gw.db), instance_name())
    stored = asyncio.run(store.get(tenant, rid))
    assert stored is not None and stored.status == "failed"
    response = stored.body["response"]
    assert response["status"] == "failed"
    assert response["error"] == {"code": "server_error", "message": ORPHAN_REASON}
    assert stored.body["conversation"] == [{"role": "user", "content": "hi"}]
    rows = gw.stored_rows(tenant, 1)
    # The gateway's own stop: the request is cancelled, no engine failed.
    assert [(row["status"], row["error_code"]) for row in rows] == [("cancelled", "cancelled")]
    store.conn.close()


# -- the store: leases on SQLite (an older file) and PostgreSQL ----------------------------


def _response(tenant: str, owner: str, status: str = "in_progress") -> StoredResponse:
    rid = new_response_id()
    return StoredResponse(
        id=rid,
        tenant_id=tenant,
        created_at=time.time(),
        status=status,
        model="m",
        deployment="m-a",
        previous_response_id=None,
        background=True,
        owner=owner,
        body={"response": {"id": rid, "status": status}, "input_items": [], "conversation": []},
    )


def test_an_older_sqlite_file_gets_the_lease_and_its_old_orphans_are_failed(
    tmp_path: Path,
) -> None:
    path = str(tmp_path / "old.db")
    conn = connect(path)  # the schema as it shipped: no lease column
    assert "lease_until" not in {row[1] for row in conn.execute("PRAGMA table_info(responses)")}
    sealer = Sealer(secrets.token_bytes(32))
    old = _response("t", "host:8000")  # an owner named as before, an hour ago
    body = sealer.seal("t", old.id, old.body)
    conn.execute(
        "INSERT INTO responses (tenant_id, id, created_at, updated_at, status, model,"
        " background, owner, body) VALUES (?, ?, ?, ?, 'in_progress', 'm', 1, ?, ?)",
        ("t", old.id, time.time() - 3600, time.time() - 3600, old.owner, body),
    )
    conn.close()
    store = ResponseStore(connect(path), sealer, instance_name(), lease_s=15)
    again = ResponseStore(connect(path), sealer, instance_name(), lease_s=15)  # added once
    columns = {row[1] for row in store.conn.execute("PRAGMA table_info(responses)")}
    assert "lease_until" in columns
    assert asyncio.run(store.active_background("t")) == 0  # nothing runs it: no place held
    got = asyncio.run(again.get("t", old.id))
    assert got is not None and got.status == "failed"
    assert got.body["response"]["error"]["message"] == ORPHAN_REASON
    assert not owner_gone(old.owner)  # an old name is judged by its lease alone


def test_leases_on_postgresql_lapse_unless_renewed() -> None:
    server = Postgres()
    try:
        name = f"sy_{os.urandom(4).hex()}"
        with psycopg.connect(server.url, autocommit=True) as c:
            c.execute(f"CREATE DATABASE {name}")
        dsn = server.url.rsplit("/", 1)[0] + "/" + name
        sealer = Sealer(secrets.token_bytes(32))
        # Two gateways on two hosts (their process ids mean nothing to each other).
        a = ResponseStore(connect(dsn), sealer, "host-a:1:0000aaaa:01", lease_s=2)
        b = ResponseStore(connect(dsn), sealer, "host-b:1:0000bbbb:02", lease_s=2)

        async def go() -> None:
            lapsed = _response("t", a.owner)
            await a.create(lapsed)
            a.conn.execute(  # written a minute ago, never renewed: a is gone
                "UPDATE responses SET updated_at = ? WHERE id = ?", (time.time() - 60, lapsed.id)
            )
            assert await b.active_background("t") == 0  # no place held by it
            got = await b.get("t", lapsed.id)
            assert got is not None and got.status == "failed"
            assert got.body["response"]["error"]["message"] == ORPHAN_REASON

            running = _response("t", a.owner)
            await a.create(running)
            work = asyncio.get_running_loop().create_future()
            a.hold(running, work)  # a runs it
            assert await a.renew() == 1  # one UPDATE for all a runs
            a.conn.execute(
                "UPDATE responses SET updated_at = ? WHERE id = ?", (time.time() - 60, running.id)
            )
            (until,) = a.conn.execute(
                "SELECT lease_until FROM responses WHERE id = ?", (running.id,)
            ).fetchone()
            assert time.time() < until <= time.time() + 2
            assert await b.sweep() == 0  # its renewed lease holds: b leaves it alone
            assert await b.active_background("t") == 1
            a.conn.execute(
                "UPDATE responses SET lease_until = ? WHERE id = ?", (time.time() - 1, running.id)
            )
            assert await b.sweep() == 1  # a stopped renewing: any gateway fails it
            assert await b.active_background("t") == 0
            work.cancel()
            await asyncio.sleep(0)
            assert await a.renew() == 0  # nothing runs in a any more: no write

        asyncio.run(go())
        a.conn.close()
        b.conn.close()
    finally:
        server.stop()
