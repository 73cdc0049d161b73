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
observe/pg.py's translation: the same SQL), so continuations survive a restart and
are shared by gateway processes on one database.

Background responses belong to the gateway instance that accepted them (`owner`, the
host and port, the same after a restart): at start, `fail_orphans` marks what this
instance had in flight as failed, saying why, since nothing runs it any more.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import logging
import os
import secrets
import socket
import sqlite3
import stat
import threading
import time
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import orjson
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from switchyard.config import ConfigError, Settings, store_target
from switchyard.errors import DatabaseUnavailable
from switchyard.observe.db import RESPONSES_SCHEMA
from switchyard.observe.pg import is_postgres

log = logging.getLogger("switchyard")
T = TypeVar("T")

IN_FLIGHT = ("queued", "in_progress")
KEY_FILE = "responses.key"
ORPHAN_REASON = "the gateway restarted while this response was in progress"
_MAX_BATCH = 512  # responses per commit
FLUSH_S = 0.01  # how long a commit waits for more responses to take (as the ledger's)
MAX_QUEUED = 10_000  # responses waiting for their commit; one more is refused (503)
OUTAGE_S = 30.0  # how long queued responses wait for a database that is down
_VERSION = b"\x01"  # a sealed blob: version, 12-byte nonce, ciphertext with its 16-byte tag
_NONCE = 12


@dataclass(slots=True)
class StoredResponse:
    id: str
    """The prefix `resp_` and 32 hex digits from the system's CSPRNG (`new_response_id`)."""
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
    """An unguessable id (128 random bits): knowing one id tells nothing of another."""
    return "resp_" + secrets.token_hex(16)


def instance_name(port: int) -> str:
    """This gateway instance as an owner of background responses: host and port, the
    same after a restart, distinct for gateways on one host."""
    return f"{socket.gethostname()}:{port}"


class SealError(Exception):
    """A stored body that does not open: sealed with another key, for another tenant or
    id, or altered."""


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


class Sealer:
    """AES-256-GCM over a body's JSON, a fresh random 96-bit nonce per seal, the tenant
    and id as associated data: a blob opens only under its own (tenant, id)."""

    def __init__(self, key: bytes) -> None:
        if len(key) != 32:
            raise ValueError("the key of stored responses is 32 bytes (AES-256)")
        self._aead = AESGCM(key)

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

    @staticmethod
    def _aad(tenant_id: str, rid: str) -> bytes:
        return f"{tenant_id}\0{rid}".encode()

    def seal(self, tenant_id: str, rid: str, obj: dict[str, Any]) -> bytes:
        nonce = secrets.token_bytes(_NONCE)
        data = orjson.dumps(obj)
        return _VERSION + nonce + self._aead.encrypt(nonce, data, self._aad(tenant_id, rid))

    def open(self, tenant_id: str, rid: str, blob: bytes) -> dict[str, Any]:
        blob = bytes(blob)
        if len(blob) < 1 + _NONCE + 16 or blob[:1] != _VERSION:
            raise SealError(f"stored response {rid}: not a sealed body")
        nonce, sealed = blob[1 : 1 + _NONCE], blob[1 + _NONCE :]
        try:
            data = self._aead.decrypt(nonce, sealed, self._aad(tenant_id, rid))
        except InvalidTag:
            raise SealError(
                f"stored response {rid} does not open with this gateway's key: sealed with "
                "another key (responses.encryption_key_env, responses.key), for another "
                "tenant or id, or altered"
            ) from None
        obj = orjson.loads(data)
        if not isinstance(obj, dict):
            raise SealError(f"stored response {rid}: the body is not an object")
        return obj


_COLUMNS = (
    "tenant_id, id, created_at, status, model, deployment, previous_response_id,"
    " background, owner, body"
)


class ResponseStore:
    """Stored responses in the gateway's database (SQLite or PostgreSQL). `io` runs the
    SQL and the sealing: an executor (the store's I/O thread, so a slow disk or a large
    conversation delays only the Responses requests, never the event loop) or None to
    run them in the caller (an in-memory database). A database that cannot be reached
    is `DatabaseUnavailable` (503), never a guess."""

    def __init__(
        self,
        conn: sqlite3.Connection,
        sealer: Sealer,
        owner: str,
        io: Executor | None = None,
        *,
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
        # Written behind the reply (see `create`): queued, and readable here at once,
        # until the commit that takes them lands.
        self._pending: list[StoredResponse] = []
        self._unwritten: dict[tuple[str, str], StoredResponse] = {}
        self._committer: asyncio.Task[None] | None = None
        self._max_queued = max_queued

    async def _run(self, what: str, fn: Callable[..., T], *args: Any) -> T:
        try:
            if self._io is None:
                return fn(*args)
            return await asyncio.get_running_loop().run_in_executor(self._io, fn, *args)
        except sqlite3.OperationalError as exc:  # PostgreSQL down: refused, not guessed
            log.error("store unavailable for %s: %s", what, exc)
            raise DatabaseUnavailable(f"the gateway's database is unavailable ({what})") from None

    async def create(self, r: StoredResponse) -> None:
        """Store a new response. With a disk it is written behind the reply: queued at
        once (readable here at once: `get` sees it), and committed with whatever else
        is queued within FLUSH_S, in one transaction (group commit: one take of the
        database's write lock, which the ledger writer shares, and one hop to the I/O
        thread, for many responses); other gateways on the database see it then (their
        `get` waits a moment for an id it does not find yet). What a crash
        leaves uncommitted is lost, as the ledger's last batch is; `drain` (the
        gateway's stop) writes it all. Without a disk (memory) it is written at once."""
        if self._io is None:
            self._create_many([r])
            return
        if len(self._pending) >= self._max_queued:  # the database is down or far behind
            raise DatabaseUnavailable(
                f"the gateway's database is not keeping up: {len(self._pending)} stored "
                "responses are waiting to be written"
            )
        self._unwritten[(r.tenant_id, r.id)] = r
        self._pending.append(r)
        if self._committer is None:
            self._committer = asyncio.get_running_loop().create_task(self._commit_pending())

    async def _commit_pending(self) -> None:
        """Commit what is queued, batch after batch, until nothing is; a database that
        is down is retried (the responses stay readable here) for OUTAGE_S, then what
        could not be written is dropped, and logged."""
        failing_since: float | None = None
        try:
            await asyncio.sleep(FLUSH_S)  # let a batch gather: one commit for many
            while self._pending:
                batch = self._pending[:_MAX_BATCH]
                try:
                    await self._run("storing responses", self._create_many, batch)
                except DatabaseUnavailable:
                    now = time.monotonic()
                    failing_since = failing_since or now
                    if now - failing_since < OUTAGE_S:
                        await asyncio.sleep(0.5)
                        continue
                    log.error("dropped %d stored responses: the database is down", len(batch))
                except Exception:
                    log.exception("dropped %d stored responses that did not write", len(batch))
                failing_since = None
                del self._pending[: len(batch)]
                for r in batch:
                    self._unwritten.pop((r.tenant_id, r.id), None)
        finally:
            self._committer = None

    async def drain(self, timeout_s: float = 10.0) -> None:
        """Wait until every queued response is committed (or `timeout_s` passed)."""
        task = self._committer
        if task is not None:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(asyncio.shield(task), timeout_s)

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

    def _create_many(self, responses: list[StoredResponse]) -> None:
        """Insert the responses in one transaction: all of them, or none."""
        now = time.time()
        rows = [
            (
                *(r.tenant_id, r.id, r.created_at, r.status, r.model, r.deployment),
                *(r.previous_response_id, int(r.background), r.owner),
                self.sealer.seal(r.tenant_id, r.id, r.body),
                now,
            )
            for r in responses
        ]
        with self._lock:
            self.conn.execute("BEGIN IMMEDIATE")
            try:
                self.conn.executemany(
                    f"INSERT INTO responses ({_COLUMNS}, updated_at)"
                    " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                    rows,
                )
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
