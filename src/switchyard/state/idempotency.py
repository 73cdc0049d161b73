"""Idempotency keys: a request that may be repeated runs upstream at most once.

Same API key (execute/idempotent.py scopes each key to it) + same `Idempotency-Key` +
same body within the TTL returns the stored reply (or waits for the one in flight)
without a new upstream call; the same key with a different body is refused (422).
Ownership is taken with an atomic INSERT in SQLite, so it holds across gateway
processes sharing the database; waiters in this process are woken by an event, others
poll. Only successful replies are stored: a
failed attempt releases the key so the client's retry runs again.

A client's key is never stored as sent (it is free text: a pasted credential fits it):
the `key` column holds an HMAC-SHA256 of it (`IdempotencyStore.stored_key`), which a
repeat computes again to find its reply. The HMAC's key is the one the store is given
(a subkey of it), else one of its own that every process on the database shares:
`idempotency.key` beside a SQLite file (made 0600 on first start, as the key of stored
responses is), or, on a database without a file (in memory, PostgreSQL), one kept in
the database (`idempotency_secret`).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import hashlib
import hmac
import json
import logging
import os
import secrets
import sqlite3
import threading
import time
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import msgspec

from switchyard.errors import (
    IdempotencyConflict,
    UpstreamTimeout,
)
from switchyard.request import Request
from switchyard.state.sql import IDEMPOTENCY_SCHEMA, on_io

if TYPE_CHECKING:
    from switchyard.state.sealing import Sealer

log = logging.getLogger("switchyard")

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class StoredReply:
    status: int
    headers: dict[str, str]
    body: bytes


_canonical = msgspec.json.Encoder(order="sorted").encode


def body_hash(req: Request) -> str:
    """What a repeat of the key must match: the request, canonical (sorted keys, a
    member sent as null the same as one not sent)."""
    return hashlib.sha256(_canonical(req)).hexdigest()


class Idempotency(Protocol):
    """Claims of `Idempotency-Key`s and their stored replies.

    Implemented once, in SQL: `IdempotencyStore` (on SQLite, PostgreSQL or an in-memory SQLite
    database)."""

    async def begin(
        self, tenant: str, key: str, digest: str, deadline: float
    ) -> StoredReply | None: ...

    async def complete(self, tenant: str, key: str, reply: StoredReply) -> None: ...

    async def release(self, tenant: str, key: str) -> None: ...


def idempotency_key(sealer: Sealer | None) -> bytes | None:
    """The key Idempotency-Keys are hashed with at rest: derived from the key of stored
    responses (shared by every process on the store; `responses.encryption_key_env` or
    the gateway home's), never that key itself. None without one: the store's own."""
    if sealer is None:
        return None
    return hmac.new(sealer.key, b"switchyard idempotency keys", hashlib.sha256).digest()


class IdempotencyStore:
    """`io` runs the SQL: an executor (the store's I/O thread, so a slow disk delays
    only the requests that carry a key, never the event loop) or None to run it in
    the caller (an in-memory database, which never waits for a disk)."""

    def __init__(
        self,
        conn: sqlite3.Connection,
        ttl_s: float,
        io: Executor | None = None,
        key: bytes | None = None,
    ) -> None:
        self.conn = conn
        self.ttl_s = ttl_s
        self.conn.executescript(IDEMPOTENCY_SCHEMA)
        self._lock = threading.Lock()
        self._io = io
        self._events: dict[tuple[str, str], asyncio.Event] = {}
        secret = key if key is not None else _own_key(conn)
        # A subkey: the key given may serve another purpose (sealing) as well.
        self._mac_key = hmac.new(secret, b"switchyard idempotency-key", hashlib.sha256).digest()

    def stored_key(self, key: str) -> str:
        """What the `key` column holds for a client's key: its HMAC-SHA256, in hex."""
        return hmac.new(self._mac_key, key.encode(), hashlib.sha256).hexdigest()

    async def _run(self, fn: Callable[..., T], *args: Any) -> T:
        return await on_io(self._io, "the Idempotency-Key's claim", fn, *args)

    def _claim(self, tenant: str, key: str, digest: str) -> StoredReply | str:
        """'owner' if we now own the key, 'wait' if another request does, or the reply."""
        now = time.time()
        with self._lock:
            row = self.conn.execute(
                "SELECT body_hash, state, status, headers, body, created_at FROM idempotency"
                " WHERE tenant_id = ? AND key = ?",
                (tenant, key),
            ).fetchone()
            if row is not None and row["created_at"] < now - self.ttl_s:
                self.conn.execute(
                    "DELETE FROM idempotency WHERE tenant_id = ? AND key = ?", (tenant, key)
                )
                row = None
            if row is None:
                try:
                    self.conn.execute(
                        "INSERT INTO idempotency (tenant_id, key, body_hash, state, created_at)"
                        " VALUES (?, ?, ?, 'in_flight', ?)",
                        (tenant, key, digest, now),
                    )
                    return "owner"
                except sqlite3.IntegrityError:
                    return "wait"  # another process won the race
            if row["body_hash"] != digest:
                raise IdempotencyConflict(
                    "this Idempotency-Key was already used with a different request body",
                    param="Idempotency-Key",
                )
            if row["state"] == "done":
                return StoredReply(row["status"], json.loads(row["headers"]), bytes(row["body"]))
            return "wait"

    async def begin(
        self, tenant: str, key: str, digest: str, deadline: float
    ) -> StoredReply | None:
        """None: the caller owns the key and must `complete` or `release` it.
        A StoredReply: answer with it. Waits for an in-flight owner until `deadline`
        (perf_counter seconds)."""
        key = self.stored_key(key)
        while True:
            got = await self._run(self._claim, tenant, key, digest)
            if isinstance(got, StoredReply):
                return got
            if got == "owner":
                self._events[(tenant, key)] = asyncio.Event()
                return None
            remaining = deadline - time.perf_counter()
            if remaining <= 0:
                raise UpstreamTimeout(
                    "the deadline passed while waiting for the request in flight with this "
                    "Idempotency-Key"
                )
            event = self._events.get((tenant, key))
            try:
                if event is not None:
                    await asyncio.wait_for(event.wait(), min(remaining, 1.0))
                else:
                    await asyncio.sleep(min(remaining, 0.05))  # owner is another process
            except TimeoutError:
                pass

    async def complete(self, tenant: str, key: str, reply: StoredReply) -> None:
        key = self.stored_key(key)
        await self._run(self._complete, tenant, key, reply)
        self._wake(tenant, key)

    async def release(self, tenant: str, key: str) -> None:
        """The owner failed: forget the key so a repeat runs again."""
        key = self.stored_key(key)
        await self._run(self._release, tenant, key)
        self._wake(tenant, key)

    def _complete(self, tenant: str, key: str, reply: StoredReply) -> None:
        with self._lock:
            self.conn.execute(
                "UPDATE idempotency SET state = 'done', status = ?, headers = ?, body = ?"
                " WHERE tenant_id = ? AND key = ?",
                (reply.status, json.dumps(reply.headers), reply.body, tenant, key),
            )

    def _release(self, tenant: str, key: str) -> None:
        with self._lock:
            self.conn.execute(
                "DELETE FROM idempotency WHERE tenant_id = ? AND key = ? AND state = 'in_flight'",
                (tenant, key),
            )

    def _wake(self, tenant: str, key: str) -> None:
        event = self._events.pop((tenant, key), None)
        if event is not None:
            event.set()


KEY_FILE = "idempotency.key"
_SECRET_SCHEMA = (
    "CREATE TABLE IF NOT EXISTS idempotency_secret (id INTEGER PRIMARY KEY, secret TEXT NOT NULL)"
)


def _own_key(conn: sqlite3.Connection) -> bytes:
    """The store's own HMAC key, shared by every process on its database: the key file
    beside a SQLite file, else a key kept in the database itself."""
    path = _sqlite_file(conn)
    if path is not None:
        return _key_file(path.parent)
    conn.executescript(_SECRET_SCHEMA)
    fresh = base64.urlsafe_b64encode(secrets.token_bytes(32)).decode()
    # The first process to insert wins; every process then reads the same key.
    conn.execute(
        "INSERT OR IGNORE INTO idempotency_secret (id, secret) VALUES (1, ?)",
        (fresh,),
    )
    row = conn.execute("SELECT secret FROM idempotency_secret WHERE id = 1").fetchone()
    key = _decode(row["secret"])
    if key is None:
        raise ValueError("the idempotency_secret table does not hold a key")
    return key


def _sqlite_file(conn: sqlite3.Connection) -> Path | None:
    """The file of a SQLite connection's main database; None in memory or on PostgreSQL."""
    if not isinstance(conn, sqlite3.Connection):
        return None
    for row in conn.execute("PRAGMA database_list").fetchall():
        if row[1] == "main":
            return Path(row[2]) if row[2] else None
    return None


def _decode(text: str) -> bytes | None:
    try:
        raw = base64.urlsafe_b64decode(text.strip().encode())
    except (binascii.Error, ValueError):
        return None
    return raw if len(raw) == 32 else None


def _key_file(home: Path) -> bytes:
    """The key in `home`/idempotency.key, made (0600) on first start: written to a
    private temporary file and linked into place, so that a second process starting at
    the same moment reads one whole key, never half of one or another."""
    path = home / KEY_FILE
    if not path.exists():
        tmp = home / f".{KEY_FILE}.{os.getpid()}.{secrets.token_hex(4)}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.fchmod(fd, 0o600)  # whatever the umask
            os.write(
                fd, (base64.urlsafe_b64encode(secrets.token_bytes(32)).decode() + "\n").encode()
            )
            os.fsync(fd)
        finally:
            os.close(fd)
        try:
            os.link(tmp, path)
        except FileExistsError:
            pass  # another process made it first: use that one
        finally:
            tmp.unlink()
    key = _decode(path.read_text(encoding="ascii", errors="replace"))
    if key is None:
        raise ValueError(
            f"{path} does not hold a key (32 bytes in base64): remove it to start over "
            "(the Idempotency-Keys in flight are then forgotten)"
        )
    return key
