"""Stored responses of the Responses API: tenant data, sealed at rest, kept for a while.

A stored response is keyed by (tenant, id) with an unguessable id, so another tenant's
id finds nothing (404, never 403: its existence is not told). What the store filters
on (status, model, owner, times) is plain; the body (the response object, its input
items and the whole conversation a continuation sends upstream) is sealed with
AES-256-GCM under a key that never sits in the database, bound to its tenant and id
(a row copied under another tenant or id does not open). The real text can thus go
upstream on a continuation while nothing readable of it is on disk; traces keep only
their PII-masked copies, as for every request.

The key comes from the environment variable `responses.encryption_key_env` names, or
from `responses.key` beside the SQLite file, made on first start with mode 0600
(gateways on several machines sharing PostgreSQL must be given one key through the
environment). Rows live in the gateway's database (SQLite, or PostgreSQL through
state/sql_pg.py's translation: the same SQL), so continuations survive a restart and
are shared by gateway processes on one database.

Background responses belong to the gateway instance that accepted them (`owner`, the
host and port, the same after a restart): at start, `fail_orphans` marks what this
instance had in flight as failed, saying why, since nothing runs it any more.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import logging
import os
import secrets
import socket
import sqlite3
import stat
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Executor
from pathlib import Path
from typing import Any, Protocol, TypeVar

import msgspec
import orjson

from switchyard.config import ConfigError, Settings, store_target
from switchyard.errors import DatabaseUnavailable
from switchyard.state import sealing
from switchyard.state.ledger import UsageLedger
from switchyard.state.ledger_batch import INSERT_RESPONSES
from switchyard.state.sealing import SealError
from switchyard.state.sql import RESPONSES_SCHEMA, on_io
from switchyard.state.sql_pg import is_postgres
from switchyard.state.traces import StoredRow

log = logging.getLogger("switchyard")
T = TypeVar("T")

IN_FLIGHT = ("queued", "in_progress")
KEY_FILE = "responses.key"
ORPHAN_REASON = "the gateway restarted while this response was in progress"
MAX_QUEUED = 10_000  # responses waiting for their commit; one more is refused (503)


class StoredResponse(msgspec.Struct):
    """A stored response (a struct: one is made per stored request, at a quarter of a
    dataclass's keyword `__init__`)."""

    id: str
    """The prefix `resp_`, the milliseconds since the epoch in 12 hex digits, then 20
    hex digits from the system's CSPRNG (`new_response_id`, api/responses_codec.py's
    `IdPool.timed`)."""
    tenant_id: str
    created_at: float
    """Unix seconds."""
    status: str
    """queued | in_progress | completed | failed | cancelled | incomplete."""
    model: str
    """The alias the client asked for."""
    deployment: str | None
    """The deployment that served it: where a continuation's state is warm."""
    previous_response_id: str | None
    background: bool
    owner: str | None
    """The gateway instance running it (background), else None."""
    body: dict[str, Any]
    """Sealed at rest: {"response": ..., "input_items": [...], "conversation": [...]};
    opaque to the store (only `fail_orphans` edits its response)."""


def new_response_id() -> str:
    """A one-off response id (the routes make theirs with `IdPool.timed`): ordered in
    time and unguessable, 80 random bits after the milliseconds since the epoch, so
    knowing one id tells nothing of another but when it was made."""
    return f"resp_{int(time.time() * 1000):012x}{secrets.token_hex(10)}"


def instance_name(port: int) -> str:
    """This gateway instance as an owner of background responses: host and port, the
    same after a restart, distinct for gateways on one host."""
    return f"{socket.gethostname()}:{port}"


def _decode_key(text: str) -> bytes | None:
    """32 bytes from base64, URL-safe or standard, padded or not; None if it is not."""
    s = "".join(text.split()).replace("-", "+").replace("_", "/")
    try:
        raw = base64.b64decode(s + "=" * (-len(s) % 4), validate=True)
    except (binascii.Error, ValueError):
        return None
    return raw if len(raw) == 32 else None


def encode_key(key: bytes) -> str:
    """How a key is written (the key file, an environment variable): URL-safe base64."""
    return base64.urlsafe_b64encode(key).decode()


def key_home(settings: Settings) -> Path | None:
    """The gateway's home, where its key file lives: the SQLite file's folder (the
    database it really uses, SWITCHYARD_SQLITE_PATH included; `storage.sqlite_path`'s
    on PostgreSQL). None: an in-memory store, whose key lives and dies with it."""
    if settings.storage.backend == "memory":
        return None
    target = store_target(settings)
    if is_postgres(target):
        target = settings.storage.sqlite_path
    if target == ":memory:":
        return None
    return Path(os.path.expandvars(os.path.expanduser(target))).parent


def _read_key_file(path: Path) -> bytes:
    mode = stat.S_IMODE(path.stat().st_mode)
    if mode & 0o077:
        raise ConfigError(
            f"{path} (the key of stored responses) may be read by group or others "
            f"(mode {mode:04o}): chmod 600 {path}"
        )
    key = _decode_key(path.read_text(encoding="ascii", errors="replace"))
    if key is None:
        raise ConfigError(
            f"{path} does not hold a key of stored responses (32 bytes in base64); "
            "restore it, or remove it to start over (stored responses become unreadable)"
        )
    return key


def _key_file(home: Path) -> bytes:
    """The key in `home`/responses.key, made (0600) on first start. A new key is written
    to a private temporary file and linked into place, so a second gateway starting at
    the same moment reads one whole key, never half of one or a different one."""
    path = home / KEY_FILE
    if path.exists():
        return _read_key_file(path)
    home.mkdir(parents=True, exist_ok=True)
    tmp = home / f".{KEY_FILE}.{os.getpid()}.{secrets.token_hex(4)}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.fchmod(fd, 0o600)  # whatever the umask
        os.write(fd, (encode_key(secrets.token_bytes(32)) + "\n").encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    try:
        os.link(tmp, path)
        log.info("made the key of stored responses: %s (mode 0600; keep it with backups)", path)
    except FileExistsError:
        pass  # another gateway made it first: use that one
    finally:
        tmp.unlink()
    return _read_key_file(path)


class Sealer(sealing.Sealer):
    """The sealer of stored responses (state/sealing.py) with its key from the
    gateway's settings."""

    @classmethod
    def ephemeral(cls) -> Sealer:
        """A random key held in this process only (an in-memory store)."""
        return cls(secrets.token_bytes(32))

    @classmethod
    def from_settings(cls, settings: Settings) -> Sealer:
        """The key `responses.encryption_key_env` names, else the home's key file (made on
        first start), else (an in-memory store) a random one. A bad key stops the start
        with a `ConfigError` that names its variable or file."""
        env = settings.responses.encryption_key_env
        if env:
            value = os.environ.get(env)
            if not value:
                raise ConfigError(
                    f"responses.encryption_key_env names {env}, which is not set: put 32 "
                    "random bytes in base64 there (e.g. `openssl rand -base64 32`)"
                )
            key = _decode_key(value)
            if key is None:
                raise ConfigError(
                    f"{env} (responses.encryption_key_env) is not a key: it must hold 32 bytes "
                    "in base64 (e.g. `openssl rand -base64 32`)"
                )
            return cls(key)
        home = key_home(settings)
        if home is None:
            return cls.ephemeral()
        if is_postgres(store_target(settings)):
            log.warning(
                "stored responses are sealed with %s: gateways on other machines sharing this "
                "PostgreSQL database cannot open them unless they get the same key "
                "(responses.encryption_key_env)",
                home / KEY_FILE,
            )
        return cls(_key_file(home))


_COLUMNS = (
    "tenant_id, id, created_at, status, model, deployment, previous_response_id,"
    " background, owner, body"
)


class Responses(Protocol):
    """Stored responses of the Responses API.

    Implemented once, in SQL: `ResponseStore` (on SQLite, PostgreSQL or an in-memory SQLite
    database)."""

    async def create(self, r: StoredResponse) -> None: ...

    def check_room(self) -> None: ...

    async def drain(self, timeout_s: float = 10.0) -> None: ...

    async def get(
        self, tenant_id: str, rid: str, settle_s: float = 0.0
    ) -> StoredResponse | None: ...

    async def update(self, r: StoredResponse) -> None: ...

    async def delete(self, tenant_id: str, rid: str) -> bool: ...

    async def active_background(self, tenant_id: str) -> int: ...

    def fail_orphans(self) -> int: ...


class ResponseStore:
    """Stored responses in the gateway's database (SQLite or PostgreSQL).

    New responses go to `writer`, the usage ledger's writer process, sealed: inserted in
    the transaction of the batch of usage rows they came with, so storing a response
    costs the gateway process no commit, no lock and no thread (see `create`). Without a
    writer (an in-memory database, a tool) they are inserted at once. Reads, updates
    and deletes run their SQL on `io` (the store's I/O thread, so a slow disk or a large
    conversation delays only the Responses requests, never the event loop) or, with
    None, in the caller. A database that cannot be reached is `DatabaseUnavailable`
    (503), never a guess."""

    def __init__(
        self,
        conn: sqlite3.Connection,
        sealer: Sealer,
        owner: str,
        io: Executor | None = None,
        *,
        writer: UsageLedger | None = None,
        retention_days: float = 30.0,
        max_queued: int = MAX_QUEUED,
    ) -> None:
        self.conn = conn
        self.sealer = sealer
        self.owner = owner
        self.retention_s = retention_days * 86400
        self.conn.executescript(RESPONSES_SCHEMA)
        self._lock = threading.Lock()
        self._io = io
        self._writer = writer
        # Handed to the writer and not yet committed, readable here meanwhile; with the
        # writer's flush number that answers once they are, oldest first.
        self._unwritten: dict[tuple[str, str], StoredResponse] = {}
        self._waiting: deque[tuple[int, tuple[str, str]]] = deque()
        self._max_queued = max_queued

    async def _run(self, what: str, fn: Callable[..., T], *args: Any) -> T:
        return await on_io(self._io, what, fn, *args)

    async def create(self, r: StoredResponse) -> None:
        """Store a new response. With a writer it is written behind the reply: sealed
        here, handed to the ledger's writer process with the batch being gathered, and
        readable in this process at once (`get` sees it) until that batch is committed;
        other gateways on the database see it then (their `get` waits a moment for an
        id it does not find yet). What a crash leaves uncommitted is lost, as the
        ledger's last batch is; the gateway's stop writes it all. A writer that falls
        `max_queued` responses behind refuses more (503) rather than holding them
        without end. Without a writer it is inserted at once."""
        writer = self._writer
        if writer is None:
            await self._run("storing a response", self._create_many, [r])
            return
        if len(self._unwritten) >= self._max_queued:  # pruned when asked before the call
            self._prune()
        self._refuse_if_full(writer)
        key = (r.tenant_id, r.id)
        body = msgspec.Raw(orjson.dumps(r.body))  # the writer seals it
        seq = writer.store_response(self._row(r, body, time.time()))
        self._unwritten[key] = r
        self._waiting.append((seq, key))

    def check_room(self) -> None:
        """Refuse (503) while the writer is too far behind to take one more response:
        asked before a response that will be stored is generated, so a refusal costs no
        model call, and again when it is stored."""
        writer = self._writer
        if writer is None:
            return
        self._prune()
        self._refuse_if_full(writer)

    def _refuse_if_full(self, writer: UsageLedger) -> None:
        if len(self._unwritten) >= self._max_queued or writer.behind():
            raise DatabaseUnavailable(
                f"the gateway's database is not keeping up: {len(self._unwritten)} stored "
                "responses are waiting to be written"
            )

    def _prune(self) -> None:
        """Forget the responses the writer has committed (they are read from the
        database from now on, where another gateway's update shows)."""
        waiting, writer = self._waiting, self._writer
        if not waiting or writer is None or not writer.committed(waiting[0][0]):
            return
        while waiting and writer.committed(waiting[0][0]):
            self._unwritten.pop(waiting.popleft()[1], None)

    async def drain(self, timeout_s: float = 10.0) -> None:
        """Wait until every response handed to the writer is committed (or `timeout_s`
        passed)."""
        if self._writer is not None and self._waiting:
            await self._writer.flush_async(timeout_s)
            self._prune()

    async def get(self, tenant_id: str, rid: str, settle_s: float = 0.0) -> StoredResponse | None:
        """None: no such id for this tenant (another tenant's included) or past retention.
        One written here and not yet committed is found at once; `settle_s`: an id not
        found is looked for again for that long (another gateway's recent response)."""
        queued = self._unwritten.get((tenant_id, rid))
        if queued is not None:
            return queued
        deadline = time.monotonic() + settle_s
        while True:
            got = await self._run("a stored response", self._get, tenant_id, rid, time.time())
            if got is not None or time.monotonic() >= deadline:
                return got
            await asyncio.sleep(0.02)

    async def update(self, r: StoredResponse) -> None:
        """Its status, deployment, owner and body (sealed again), as of now."""
        if (r.tenant_id, r.id) in self._unwritten:
            await self.drain()  # its insert first
        await self._run("updating a stored response", self._update, r)

    async def delete(self, tenant_id: str, rid: str) -> bool:
        if (tenant_id, rid) in self._unwritten:
            await self.drain()  # its insert first
        return await self._run("deleting a stored response", self._delete, tenant_id, rid)

    async def active_background(self, tenant_id: str) -> int:
        """The tenant's background responses queued or in progress, on every gateway
        sharing the database (what `responses.max_background_per_tenant` caps)."""
        return await self._run("the background responses", self._active, tenant_id)

    @staticmethod
    def _row(r: StoredResponse, body: Any, now: float) -> StoredRow:
        return StoredRow(
            r.tenant_id,
            r.id,
            r.created_at,
            r.status,
            r.model,
            r.deployment,
            r.previous_response_id,
            int(r.background),
            r.owner,
            body,
            now,
        )

    def _create_many(self, responses: list[StoredResponse]) -> None:
        """Insert the responses in one transaction: all of them, or none."""
        now = time.time()
        seal = self.sealer.seal
        rows = [
            msgspec.structs.astuple(self._row(r, seal(r.tenant_id, r.id, r.body), now))
            for r in responses
        ]
        with self._lock:
            self.conn.execute("BEGIN IMMEDIATE")
            try:
                self.conn.executemany(INSERT_RESPONSES, rows)
                self.conn.execute("COMMIT")
            except BaseException:
                if self.conn.in_transaction:
                    self.conn.execute("ROLLBACK")
                raise

    def _get(self, tenant_id: str, rid: str, now: float) -> StoredResponse | None:
        with self._lock:
            row = self.conn.execute(
                f"SELECT {_COLUMNS} FROM responses WHERE tenant_id = ? AND id = ?"
                " AND created_at >= ?",
                (tenant_id, rid, now - self.retention_s),
            ).fetchone()
        if row is None:
            return None
        return StoredResponse(
            id=row["id"],
            tenant_id=row["tenant_id"],
            created_at=float(row["created_at"]),
            status=row["status"],
            model=row["model"],
            deployment=row["deployment"],
            previous_response_id=row["previous_response_id"],
            background=bool(row["background"]),
            owner=row["owner"],
            body=self.sealer.open(tenant_id, rid, row["body"]),
        )

    def _update(self, r: StoredResponse) -> None:
        blob = self.sealer.seal(r.tenant_id, r.id, r.body)
        with self._lock:
            self.conn.execute(
                "UPDATE responses SET status = ?, deployment = ?, owner = ?, body = ?,"
                " updated_at = ? WHERE tenant_id = ? AND id = ?",
                (r.status, r.deployment, r.owner, blob, time.time(), r.tenant_id, r.id),
            )

    def _delete(self, tenant_id: str, rid: str) -> bool:
        with self._lock:
            cur = self.conn.execute(
                "DELETE FROM responses WHERE tenant_id = ? AND id = ?", (tenant_id, rid)
            )
        return cur.rowcount > 0

    def _active(self, tenant_id: str) -> int:
        with self._lock:
            (n,) = self.conn.execute(
                "SELECT COUNT(*) FROM responses WHERE tenant_id = ? AND background = 1"
                " AND status IN ('queued', 'in_progress')",
                (tenant_id,),
            ).fetchone()
        return int(n)

    def fail_orphans(self) -> int:
        """At start: what this instance had queued or in progress is failed, its response
        saying why (nothing runs it any more). Other instances' rows are theirs. Returns
        how many."""
        with self._lock:
            rows = self.conn.execute(
                "SELECT tenant_id, id, body FROM responses WHERE owner = ?"
                " AND status IN ('queued', 'in_progress')",
                (self.owner,),
            ).fetchall()
        failed = 0
        for row in rows:
            tenant_id, rid = row["tenant_id"], row["id"]
            try:
                body = self.sealer.open(tenant_id, rid, row["body"])
            except SealError as exc:  # its status column still says it failed
                log.warning("an orphaned response's body was left as it was: %s", exc)
                blob = bytes(row["body"])
            else:
                response = body.get("response")
                if not isinstance(response, dict):
                    response = body["response"] = {}
                response["status"] = "failed"
                response["error"] = {"code": "server_error", "message": ORPHAN_REASON}
                blob = self.sealer.seal(tenant_id, rid, body)
            with self._lock:  # only if still in flight here (not finished meanwhile)
                cur = self.conn.execute(
                    "UPDATE responses SET status = 'failed', body = ?, updated_at = ?"
                    " WHERE tenant_id = ? AND id = ? AND owner = ?"
                    " AND status IN ('queued', 'in_progress')",
                    (blob, time.time(), tenant_id, rid, self.owner),
                )
            failed += max(cur.rowcount, 0)
        if failed:
            log.warning("%d response(s) in flight at the last stop were marked failed", failed)
        return failed


def enforce_response_retention(
    conn: sqlite3.Connection, retention_days: float, now: float | None = None
) -> int:
    """Delete stored responses older than `responses.retention_days`; returns count."""
    now = time.time() if now is None else now
    cur = conn.execute(
        "DELETE FROM responses WHERE created_at < ?", (now - retention_days * 86400,)
    )
    return max(int(cur.rowcount), 0)
