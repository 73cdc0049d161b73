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
repeat computes again to find its reply. Nor is the request's plain digest (`body_hash`):
the body holds the client's text, raw, and a short prompt's PII (a phone number, a card
number) could be guessed offline against an unkeyed SHA-256 of it, so the `body_hash`
column holds its HMAC-SHA256 (`IdempotencyStore.stored_digest`). The HMACs' keys are
subkeys of the key the store is given: the gateway's key of stored responses
(state/responses.py), which every process on the store shares; without one, a key this
process alone holds.

A reply answers repeats for `idempotency.ttl_s` from its claim; past that the
retention pass deletes it (`forget_expired`, control/retention.py), and the byte budget
`observe.max_disk_mb` counts the table (state/traces.py `BUDGETED`).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import json
import logging
import secrets
import sqlite3
import threading
import time
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import msgspec

from switchyard.errors import (
    IdempotencyConflict,
    UpstreamTimeout,
)
from switchyard.request import Request
from switchyard.state.sql import IDEMPOTENCY_SCHEMA, is_sqlite, on_io

log = logging.getLogger("switchyard")

T = TypeVar("T")

# The sweep's index (`forget_expired`): the claims by their time. Made where the store
# opens its table, on a database made before the sweep existed too.
IDEMPOTENCY_INDEX = "CREATE INDEX IF NOT EXISTS idempotency_time ON idempotency(created_at)"


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
        # Two gateways starting at once on PostgreSQL may both make it: one wins.
        with contextlib.suppress(sqlite3.IntegrityError):
            self.conn.execute(IDEMPOTENCY_INDEX)
        self._lock = threading.Lock()
        self._io = io
        self._events: dict[tuple[str, str], asyncio.Event] = {}
        secret = key if key is not None else secrets.token_bytes(32)
        # A subkey: the key given may serve another purpose (sealing) as well.
        self._mac_key = hmac.new(secret, b"switchyard idempotency-key", hashlib.sha256).digest()
        self._body_key = hmac.new(secret, b"switchyard idempotency-body", hashlib.sha256).digest()

    def stored_key(self, key: str) -> str:
        """What the `key` column holds for a client's key: its HMAC-SHA256, in hex."""
        return hmac.new(self._mac_key, key.encode(), hashlib.sha256).hexdigest()

    def stored_digest(self, digest: str) -> str:
        """What the `body_hash` column holds for a request's digest (`body_hash`): its
        HMAC-SHA256, in hex, so the column cannot be tested against guessed bodies."""
        return hmac.new(self._body_key, digest.encode(), hashlib.sha256).hexdigest()

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
        key, digest = self.stored_key(key), self.stored_digest(digest)
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


def forget_expired(conn: sqlite3.Connection, ttl_s: float, now: float | None = None) -> int:
    """Delete the claims and replies older than `ttl_s` (idempotency.ttl_s): none of
    them answers a repeat any more (`IdempotencyStore._claim` treats such a row as
    absent), so each distinct key's reply would otherwise stay for ever. A claim still
    in flight that old is deleted too, as a repeat of its key would: its owner's
    `complete` then stores nothing. Returns how many rows."""
    now = time.time() if now is None else now
    if is_sqlite(conn):
        found = conn.execute(
            "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'idempotency'"
        ).fetchone()
        if found is None:  # a file no gateway has served from yet
            return 0
    cur = conn.execute("DELETE FROM idempotency WHERE created_at < ?", (now - ttl_s,))
    return max(int(cur.rowcount), 0)
