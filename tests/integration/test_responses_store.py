"""Stored responses (state/responses.py): sealed at rest with AES-GCM under a key kept
out of the database, keyed by (tenant, id), kept for `responses.retention_days`, on
SQLite and on a real PostgreSQL server shared by two stores (two gateways)."""

from __future__ import annotations

import asyncio
import base64
import os
import secrets
import signal
import socket
import stat
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import psycopg
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from support.postgres_server import Postgres
from support.stores import fill_store
from switchyard.config import ConfigError, Settings, parse_settings
from switchyard.errors import DatabaseUnavailable
from switchyard.gateway import Gateway
from switchyard.state.ledger import UsageLedger
from switchyard.state.responses import (
    KEY_FILE,
    ORPHAN_REASON,
    ResponseStore,
    Sealer,
    StoredResponse,
    encode_key,
    enforce_response_retention,
    new_response_id,
)
from switchyard.state.sealing import SealError
from switchyard.state.sql import connect
from switchyard.state.traces import BUDGETED, bytes_in_use, enforce_disk, row_bytes

DAY = 86400.0


def _settings(tmp: Path, backend: str = "sqlite", **responses: Any) -> Settings:
    return parse_settings(
        {
            "models": [
                {"alias": "m", "engine": {"kind": "openai", "base_url": "http://127.0.0.1:9/v1"}}
            ],
            "embeddings": {"enabled": False},
            "storage": {"backend": backend, "sqlite_path": str(tmp / "home" / "gw.db")},
            "responses": responses,
        }
    )


@pytest.fixture(autouse=True)
def _no_db_override(monkeypatch: pytest.MonkeyPatch) -> None:
    """The key's home follows the database in use: no outside override here."""
    monkeypatch.delenv("SWITCHYARD_SQLITE_PATH", raising=False)


def _response(
    tenant: str = "t",
    *,
    status: str = "completed",
    background: bool = False,
    owner: str | None = None,
    created_at: float | None = None,
    text: str = "hello",
) -> StoredResponse:
    rid = new_response_id()
    return StoredResponse(
        id=rid,
        tenant_id=tenant,
        created_at=time.time() if created_at is None else created_at,
        status=status,
        model="m",
        deployment="m-a",
        previous_response_id=None,
        background=background,
        owner=owner,
        body={
            "response": {"id": rid, "status": status, "output_text": text},
            "input_items": [{"role": "user", "content": text}],
            "conversation": [{"role": "user", "content": text}],
        },
    )


def run(coro: Any) -> Any:
    return asyncio.run(coro)


# -- sealing -----------------------------------------------------------------------

_json = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**63 - 1)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(st.characters(exclude_categories=("Cs",))),  # JSON from the wire: no lone surrogates
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=24,
)
_bodies = st.dictionaries(st.text(max_size=8), _json, max_size=5)
SEALER = Sealer.ephemeral()


@settings(max_examples=60, deadline=None)
@given(body=_bodies, tenant=st.text(min_size=1, max_size=12), data=st.data())
def test_a_sealed_body_opens_only_as_itself_under_its_tenant_and_id(
    body: dict[str, Any], tenant: str, data: st.DataObject
) -> None:
    rid = new_response_id()
    blob = SEALER.seal(tenant, rid, body)
    assert SEALER.open(tenant, rid, blob) == body
    assert SEALER.seal(tenant, rid, body) != blob  # a fresh nonce every time
    # One altered byte anywhere (version, nonce, ciphertext, tag) and it does not open.
    i = data.draw(st.integers(0, len(blob) - 1), label="byte")
    flip = data.draw(st.integers(1, 255), label="mask")
    tampered = blob[:i] + bytes([blob[i] ^ flip]) + blob[i + 1 :]
    with pytest.raises(SealError):
        SEALER.open(tenant, rid, tampered)
    with pytest.raises(SealError):
        SEALER.open(tenant, rid, blob[: data.draw(st.integers(0, len(blob) - 1), label="cut")])
    with pytest.raises(SealError, match="another tenant"):
        SEALER.open(tenant + "x", rid, blob)
    with pytest.raises(SealError):
        SEALER.open(tenant, new_response_id(), blob)
    with pytest.raises(SealError):
        Sealer.ephemeral().open(tenant, rid, blob)


def test_response_ids_are_long_random_and_distinct() -> None:
    ids = {new_response_id() for _ in range(1000)}
    assert len(ids) == 1000
    for rid in ids:
        assert rid.startswith("resp_") and len(rid) - len("resp_") >= 32
        int(rid.removeprefix("resp_"), 16)


# -- the key -----------------------------------------------------------------------


def test_the_key_file_is_made_0600_on_first_start_and_reused(tmp_path: Path) -> None:
    s = _settings(tmp_path)
    path = tmp_path / "home" / KEY_FILE
    old = os.umask(0)  # the mode must not depend on the umask
    try:
        first = Sealer.from_settings(s)
    finally:
        os.umask(old)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert list(path.parent.iterdir()) == [path]  # no temporary file left beside it
    key = path.read_bytes()
    blob = first.seal("t", "resp_1", {"a": 1})
    again = Sealer.from_settings(s)  # the next start
    assert path.read_bytes() == key
    assert again.open("t", "resp_1", blob) == {"a": 1}


def test_a_key_file_others_may_read_is_refused(tmp_path: Path) -> None:
    s = _settings(tmp_path)
    Sealer.from_settings(s)
    path = tmp_path / "home" / KEY_FILE
    path.chmod(0o640)
    with pytest.raises(ConfigError, match=r"chmod 600 .*responses\.key"):
        Sealer.from_settings(s)
    path.chmod(0o604)
    with pytest.raises(ConfigError, match="chmod 600"):
        Sealer.from_settings(s)
    path.chmod(0o600)
    Sealer.from_settings(s)


def test_a_damaged_key_file_is_refused(tmp_path: Path) -> None:
    s = _settings(tmp_path)
    Sealer.from_settings(s)
    path = tmp_path / "home" / KEY_FILE
    path.write_text("too short\n")
    with pytest.raises(ConfigError, match=r"responses\.key does not hold a key"):
        Sealer.from_settings(s)


def test_the_key_from_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    s = _settings(tmp_path, encryption_key_env="SY_TEST_RESPONSES_KEY")
    with pytest.raises(ConfigError, match=r"SY_TEST_RESPONSES_KEY.*not set"):
        Sealer.from_settings(s)
    for bad in ("not a key", base64.b64encode(b"k" * 16).decode(), "x" * 44):
        monkeypatch.setenv("SY_TEST_RESPONSES_KEY", bad)
        with pytest.raises(ConfigError, match="SY_TEST_RESPONSES_KEY"):
            Sealer.from_settings(s)
    key = secrets.token_bytes(32)
    monkeypatch.setenv("SY_TEST_RESPONSES_KEY", encode_key(key))  # URL-safe
    blob = Sealer.from_settings(s).seal("t", "resp_1", {"a": 1})
    monkeypatch.setenv("SY_TEST_RESPONSES_KEY", base64.b64encode(key).decode())  # standard
    assert Sealer.from_settings(s).open("t", "resp_1", blob) == {"a": 1}
    assert Sealer(key).open("t", "resp_1", blob) == {"a": 1}
    assert not (tmp_path / "home").exists()  # no key file made


def test_an_inline_key_is_not_a_variable_name(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="encryption_key_env"):
        _settings(tmp_path, encryption_key_env=base64.b64encode(b"k" * 32).decode())


def test_an_in_memory_store_keeps_its_key_in_memory(tmp_path: Path) -> None:
    s = _settings(tmp_path, backend="memory")
    a, b = Sealer.from_settings(s), Sealer.from_settings(s)
    with pytest.raises(SealError):
        b.open("t", "resp_1", a.seal("t", "resp_1", {}))
    assert not (tmp_path / "home").exists()


def test_the_key_lives_beside_the_database_in_use(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SWITCHYARD_SQLITE_PATH", str(tmp_path / "elsewhere" / "x.db"))
    Sealer.from_settings(_settings(tmp_path))
    assert (tmp_path / "elsewhere" / KEY_FILE).exists()
    assert not (tmp_path / "home").exists()


# -- the store on SQLite -------------------------------------------------------------


@pytest.fixture
def io() -> Iterator[ThreadPoolExecutor]:
    pool = ThreadPoolExecutor(1, thread_name_prefix="test-store")
    yield pool
    pool.shutdown(wait=True)


def _sqlite_store(
    tmp_path: Path, io: ThreadPoolExecutor | None, owner: str = "host:1", **kw: Any
) -> ResponseStore:
    sealer = Sealer.from_settings(_settings(tmp_path))
    return ResponseStore(connect(str(tmp_path / "home" / "gw.db")), sealer, owner, io, **kw)


def test_create_get_update_delete_on_sqlite(tmp_path: Path, io: ThreadPoolExecutor) -> None:
    store = _sqlite_store(tmp_path, io)

    async def go() -> None:
        r = _response("t", status="in_progress", background=True, owner=store.owner)
        await store.create(r)
        got = await store.get("t", r.id)
        assert got == r
        assert await store.get("u", r.id) is None  # another tenant's id: not found
        assert await store.get("t", new_response_id()) is None
        r.status, r.deployment, r.owner = "completed", "m-b", None
        r.body["response"]["status"] = "completed"
        r.body["conversation"].append({"role": "assistant", "content": "hi there"})
        await store.update(r)
        assert await store.get("t", r.id) == r
        assert await store.delete("u", r.id) is False  # not theirs to delete
        assert await store.get("t", r.id) == r
        assert await store.delete("t", r.id) is True
        assert await store.get("t", r.id) is None
        assert await store.delete("t", r.id) is False

    run(go())


def test_stored_responses_survive_a_restart(tmp_path: Path) -> None:
    first = _sqlite_store(tmp_path, None)
    r = _response("t", text="remember me")
    run(first.create(r))
    first.conn.close()
    again = _sqlite_store(tmp_path, None)  # a new process: the key file, the same file
    assert run(again.get("t", r.id)) == r


def test_retention_hides_and_deletes_old_responses(tmp_path: Path) -> None:
    store = _sqlite_store(tmp_path, None, retention_days=2)
    now = time.time()
    old = _response("t", created_at=now - 3 * DAY)
    fresh = _response("t", created_at=now - 1 * DAY)
    run(store.create(old))
    run(store.create(fresh))
    assert run(store.get("t", old.id)) is None  # past retention, even before it is deleted
    assert run(store.get("t", fresh.id)) == fresh
    assert enforce_response_retention(store.conn, 2, now) == 1
    assert enforce_response_retention(store.conn, 2, now) == 0
    ids = [r[0] for r in store.conn.execute("SELECT id FROM responses")]
    assert ids == [fresh.id]


def test_active_background_counts_a_tenants_queued_and_running_ones(tmp_path: Path) -> None:
    store = _sqlite_store(tmp_path, None)

    async def go() -> None:
        rows = [
            _response("t", status="queued", background=True, owner="a:1"),
            _response("t", status="in_progress", background=True, owner="b:2"),
            _response("t", status="completed", background=True, owner="a:1"),
            _response("t", status="in_progress"),  # not background
            _response("u", status="in_progress", background=True, owner="a:1"),
        ]
        for r in rows:
            await store.create(r)
        assert await store.active_background("t") == 2
        assert await store.active_background("u") == 1
        assert await store.active_background("v") == 0
        rows[0].status = "cancelled"
        await store.update(rows[0])
        assert await store.active_background("t") == 1

    run(go())


def test_fail_orphans_fails_only_this_instances_in_flight_responses(tmp_path: Path) -> None:
    store = _sqlite_store(tmp_path, None, owner="host:8000")

    async def go() -> tuple[list[StoredResponse], list[StoredResponse]]:
        mine = [
            _response("t", status="queued", background=True, owner="host:8000"),
            _response("u", status="in_progress", background=True, owner="host:8000"),
        ]
        others = [
            _response("t", status="in_progress", background=True, owner="host:8001"),
            _response("t", status="completed", background=True, owner="host:8000"),
            _response("t", status="in_progress"),
        ]
        for r in mine + others:
            await store.create(r)
        return mine, others

    mine, others = run(go())
    assert store.fail_orphans() == 2
    assert store.fail_orphans() == 0
    for r in mine:
        got = run(store.get(r.tenant_id, r.id))
        assert got is not None and got.status == "failed"
        assert got.body["response"]["status"] == "failed"
        assert got.body["response"]["error"] == {"code": "server_error", "message": ORPHAN_REASON}
        assert "restarted" in ORPHAN_REASON
        assert got.body["conversation"] == r.body["conversation"]  # the rest as it was
    for r in others:
        assert run(store.get(r.tenant_id, r.id)) == r


def test_nothing_readable_of_a_conversation_is_on_disk(tmp_path: Path) -> None:
    store = _sqlite_store(tmp_path, None)
    marker = "plaintext-marker-" + secrets.token_hex(8)
    visible = "visible-model-" + secrets.token_hex(8)  # a plain column, to prove the scan sees
    r = _response("t", text=marker)
    r.model = visible
    run(store.create(r))
    r.body["conversation"].append({"role": "assistant", "content": marker * 3})
    run(store.update(r))
    assert run(store.get("t", r.id)) == r  # the real text comes back
    files = [p for p in (tmp_path / "home").iterdir() if p.name.startswith("gw.db")]
    assert any(p.name.endswith("-wal") for p in files)  # the WAL is scanned too
    data = b"".join(p.read_bytes() for p in files)
    assert visible.encode() in data
    for form in (marker.encode(), marker.encode("utf-16-le"), marker[::-1].encode()):
        assert form not in data
    key = (tmp_path / "home" / KEY_FILE).read_text().strip().encode()
    assert key not in data


# -- the byte budget and the gateway ------------------------------------------------


def _fill_responses(store: ResponseStore, n: int, first_at: float = 1_800_000_000.0) -> None:
    for i in range(n):  # each create is its own transaction (the store's group commit)
        run(store.create(_response("t", created_at=first_at + i, text="x" * 1400)))


def test_the_byte_budget_deletes_responses_after_traces_and_before_usage(tmp_path: Path) -> None:
    store = _sqlite_store(tmp_path, None, retention_days=1e6)
    fill_store(store.conn, 1200, "x" * 1500)
    _fill_responses(store, 1200)
    # Traces and rollout records are about half the data: keeping 40 % of it takes
    # some stored responses too, never a usage row.
    budget = int(bytes_in_use(store.conn) * 0.45)
    assert enforce_disk(store.conn, budget, chunk=100) > 0
    assert bytes_in_use(store.conn) <= budget
    count = {
        t: store.conn.execute(f"SELECT COUNT(*) FROM {t}").fetchone()[0]
        for t in ("traces", "rollouts", "responses", "usage")
    }
    assert count["traces"] == 0 and count["rollouts"] == 0
    assert 0 < count["responses"] < 1200
    assert count["usage"] == 1200
    (oldest,) = store.conn.execute("SELECT MIN(created_at) FROM responses").fetchone()
    assert oldest == 1_800_000_000.0 + 1200 - count["responses"]  # the oldest went


def test_the_gateway_wires_the_store_retention_and_orphans(tmp_path: Path) -> None:
    s = _settings(tmp_path, backend="memory", retention_days=1)
    gw = Gateway(s)
    assert gw.responses is gw.store.responses
    assert gw.responses.owner.startswith(f"{socket.gethostname()}:{os.getpid()}:")

    async def go() -> None:
        old = _response("t", created_at=time.time() - 2 * DAY)
        orphan = _response("t", status="in_progress", background=True, owner=gw.responses.owner)
        elsewhere = _response("t", status="in_progress", background=True, owner="other:1")
        for r in (old, orphan, elsewhere):
            await gw.responses.create(r)
        gw.start()
        try:
            got = await gw.responses.get("t", orphan.id)
            assert got is not None and got.status == "failed"
            assert (await gw.responses.get("t", elsewhere.id)) == elsewhere
            assert gw.enforce_retention() >= 1
            with gw.store.connection() as conn:
                ids = {row[0] for row in conn.execute("SELECT id FROM responses")}
            assert ids == {orphan.id, elsewhere.id}
        finally:
            await gw.stop()

    run(go())


# -- PostgreSQL: two gateways, one database ------------------------------------------


@pytest.fixture(scope="module")
def postgres() -> Iterator[Postgres]:
    server = Postgres()
    yield server
    server.stop()


def _fresh(server: str) -> str:
    name = f"sy_{os.urandom(4).hex()}"
    with psycopg.connect(server, autocommit=True) as c:
        c.execute(f"CREATE DATABASE {name}")
    return server.rsplit("/", 1)[0] + "/" + name


def test_the_store_on_postgresql_is_shared_by_two_gateways(postgres: Postgres) -> None:
    dsn = _fresh(postgres.url)
    key = secrets.token_bytes(32)  # one key for both, as responses.encryption_key_env gives
    io_a, io_b = ThreadPoolExecutor(1), ThreadPoolExecutor(1)
    a = ResponseStore(connect(dsn), Sealer(key), "host-a:8000", io_a, retention_days=2)
    b = ResponseStore(connect(dsn), Sealer(key), "host-b:8000", io_b, retention_days=2)
    marker = "pg-marker-" + secrets.token_hex(8)

    async def go() -> tuple[StoredResponse, StoredResponse]:
        r = _response("t", status="in_progress", background=True, owner=a.owner, text=marker)
        await a.create(r)  # written behind: the other gateway waits for its commit
        assert await b.get("t", r.id, settle_s=5.0) == r  # and continues from it
        assert await b.get("u", r.id) is None
        assert await b.active_background("t") == 1
        r.status, r.owner = "completed", None
        r.body["conversation"].append({"role": "assistant", "content": "done"})
        await b.update(r)
        assert await a.get("t", r.id) == r
        assert await a.active_background("t") == 0
        mine = _response("t", status="queued", background=True, owner=b.owner)
        theirs = _response("t", status="in_progress", background=True, owner=a.owner)
        old = _response("t", created_at=time.time() - 3 * DAY)
        for x in (mine, theirs, old):
            await a.create(x)
        await a.drain()
        assert await a.get("t", old.id) is None
        return mine, theirs

    try:
        mine, theirs = run(go())
        assert b.fail_orphans() == 1  # b restarted: only its own
        got = run(a.get("t", mine.id))
        assert got is not None and got.status == "failed"
        assert got.body["response"]["error"]["message"] == ORPHAN_REASON
        assert run(a.get("t", theirs.id)) == theirs
        assert enforce_response_retention(a.conn, 2) == 1
        (sealed,) = a.conn.execute(
            "SELECT body FROM responses WHERE status = 'completed'"
        ).fetchone()
        assert marker.encode() not in bytes(sealed)
        assert run(b.delete("t", mine.id)) and run(a.get("t", mine.id)) is None
    finally:
        io_a.shutdown()
        io_b.shutdown()
        a.conn.close()
        b.conn.close()


def test_the_byte_budget_on_postgresql_counts_stored_responses(postgres: Postgres) -> None:
    dsn = _fresh(postgres.url)
    store = ResponseStore(connect(dsn), Sealer.ephemeral(), "h:1", retention_days=1e6)
    fill_store(store.conn, 300, "x" * 1500)
    _fill_responses(store, 300)

    def in_use() -> float:
        return sum(n * m for n, m in (row_bytes(store.conn, t, at=at) for t, at, _ in BUDGETED))

    assert row_bytes(store.conn, "responses", at="created_at")[0] == 300
    budget = int(in_use() * 0.45)
    assert enforce_disk(store.conn, budget) > 0
    count = {
        t: store.conn.execute(f"SELECT COUNT(*) FROM {t}").fetchone()[0]
        for t in ("traces", "rollouts", "responses", "usage")
    }
    assert count["traces"] == 0 and count["rollouts"] == 0
    assert 0 < count["responses"] < 300 and count["usage"] == 300
    store.conn.close()


def test_postgresql_down_is_store_unavailable_then_recovers(postgres: Postgres) -> None:
    dsn = _fresh(postgres.url)
    store = ResponseStore(connect(dsn), Sealer.ephemeral(), "h:1")
    r = _response()
    run(store.create(r))
    postgres.stop()
    try:
        with pytest.raises(DatabaseUnavailable):
            run(store.get("t", r.id))
    finally:
        postgres.start()
    assert run(store.get("t", r.id)) == r  # reconnected
    store.conn.close()


def _with_writer(
    tmp_path: Path, io: ThreadPoolExecutor, **kw: Any
) -> tuple[ResponseStore, UsageLedger]:
    key = Sealer.from_settings(_settings(tmp_path)).key  # the writer seals with it
    ledger = UsageLedger(str(tmp_path / "home" / "gw.db"), flush_s=0.02, seal_key=key)
    return _sqlite_store(tmp_path, io, writer=ledger, **kw), ledger


def test_creates_go_with_the_ledgers_batches_to_its_writer_process(
    tmp_path: Path, io: ThreadPoolExecutor
) -> None:
    """Write-behind through the ledger's writer process: a created response is readable
    here at once, and this process runs no insert of its own; once drained every one is
    in the database, sealed, as another connection sees it; from then on it is read
    from the database (another gateway's update shows here)."""
    store, ledger = _with_writer(tmp_path, io)
    statements: list[str] = []
    store.conn.set_trace_callback(statements.append)
    made = [_response("t", text="writer-marker") for _ in range(64)]
    other = connect(str(tmp_path / "home" / "gw.db"))

    async def go() -> None:
        await asyncio.gather(*(store.create(r) for r in made))
        assert (await store.get("t", made[0].id)) == made[0]  # before its commit too
        await store.drain()

    try:
        run(go())
        rows = other.execute("SELECT id, body FROM responses WHERE tenant_id = 't'").fetchall()
        assert {row[0] for row in rows} == {r.id for r in made}
        assert not any(b"writer-marker" in bytes(row[1]) for row in rows)
        assert not [s for s in statements if "INSERT" in s.upper()]
        other.execute("UPDATE responses SET status = 'cancelled' WHERE id = ?", (made[1].id,))
        got = run(store.get("t", made[1].id))
        assert got is not None and got.status == "cancelled"
    finally:
        ledger.close()


def test_a_store_that_falls_behind_refuses_rather_than_buffering_without_end(
    tmp_path: Path, io: ThreadPoolExecutor
) -> None:
    """While the writer takes nothing (its process stopped), at most `max_queued`
    responses wait in memory; the next create is a 503, and the queued ones are written
    once it moves again."""
    store, ledger = _with_writer(tmp_path, io, max_queued=3)
    made = [_response("t") for _ in range(3)]
    proc = ledger._proc
    assert proc is not None
    os.kill(proc.pid, signal.SIGSTOP)

    async def go() -> None:
        for r in made:
            await store.create(r)
        await asyncio.sleep(0.1)  # their batch is sent, not committed
        with pytest.raises(DatabaseUnavailable):  # what a Responses request asks first
            store.check_room()
        with pytest.raises(DatabaseUnavailable):
            await store.create(_response("t"))
        os.kill(proc.pid, signal.SIGCONT)
        await store.drain()

    try:
        run(go())
    finally:
        os.kill(proc.pid, signal.SIGCONT)
        ledger.close()
    other = connect(str(tmp_path / "home" / "gw.db"))
    ids = {row[0] for row in other.execute("SELECT id FROM responses")}
    assert ids == {r.id for r in made}


def test_a_writer_without_the_key_writes_nothing_of_a_response(
    tmp_path: Path, io: ThreadPoolExecutor
) -> None:
    """The writer seals new responses with the key its gateway sends it when it starts;
    one that got none drops them (logged) rather than write anything unsealed."""
    ledger = UsageLedger(str(tmp_path / "home" / "gw.db"), flush_s=0.02)  # no seal_key
    store = _sqlite_store(tmp_path, io, writer=ledger)
    r = _response("t", text="unsealed-marker")

    async def go() -> None:
        await store.create(r)
        await store.drain()

    try:
        run(go())
    finally:
        ledger.close()
    db = (tmp_path / "home" / "gw.db").read_bytes()
    assert b"unsealed-marker" not in db
    other = connect(str(tmp_path / "home" / "gw.db"))
    assert other.execute("SELECT COUNT(*) FROM responses").fetchone()[0] == 0
