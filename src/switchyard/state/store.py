"""The store: keys and tenants, idempotency, budgets (spend so far), the usage ledger,
traces and stored responses, behind one interface.

What the request path needs of it — a key lookup on an authentication-cache miss, an
idempotency claim or completion, the spend that seeds a budget — is awaitable and runs
off the event loop: `SqliteStore` does it on one I/O thread with its own connection, so
a slow disk delays only the requests that need the store, never the others. The ledger
is written by its own process (state/ledger.py). Control-plane calls (admin API, the
CLI, the first-run key) stay synchronous.

`MemoryStore` is the same schema and the same code in one in-memory SQLite database:
building a gateway on it opens no file and starts no process, which is what tests and
throwaway gateways want (`storage.backend: memory`; nothing survives a restart).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol, TypeVar

from switchyard.errors import DatabaseUnavailable
from switchyard.state.approvals import ApprovalStore
from switchyard.state.idempotency import IdempotencyStore
from switchyard.state.keys import KeyStore, Limits, Principal
from switchyard.state.ledger import (
    Finished,
    LedgerCounts,
    LedgerReads,
    Row,
    UsageLedger,
    batch_json,
    encoded_row,
    spent_since,
)
from switchyard.state.ledger_batch import decode_batch, write_batch
from switchyard.state.responses import ResponseStore, Sealer, instance_name
from switchyard.state.sql import SCHEMA, Connection, migrate
from switchyard.state.tool_calls import ToolCallRecords
from switchyard.state.traces import template_id

log = logging.getLogger("switchyard")
T = TypeVar("T")


class Ledger(Protocol):
    """The usage ledger and traces as the gateway writes and reads them: `UsageLedger`
    (state/ledger.py: a writer process commits to SQLite or PostgreSQL) or
    `MemoryLedger` (below: the store's in-memory database)."""

    @property
    def dropped(self) -> int: ...

    @property
    def repaired(self) -> int: ...

    def block_id(self, template: list[tuple[str, str, str, Any]]) -> str: ...

    def record(self, finished: Finished) -> None: ...

    def flush(self, timeout_s: float = 10.0) -> None: ...

    async def flush_async(self, timeout_s: float = 10.0) -> bool: ...

    def close(self) -> None: ...

    def reading(self) -> contextlib.AbstractContextManager[sqlite3.Connection]: ...


class Store:
    """What every store offers (see the module docstring)."""

    keys: KeyStore
    approvals: ApprovalStore
    idempotency: IdempotencyStore
    tool_calls: ToolCallRecords  # MCP side effects, at most once
    responses: ResponseStore
    ledger: Any  # a Ledger (UsageLedger or MemoryLedger); also rows, spent_since, read

    async def verify_key(self, plaintext: str) -> Principal | str:
        raise NotImplementedError

    async def spent_since(self, column: str, ident: str, since: float) -> float:
        raise NotImplementedError

    async def consume_approval(
        self, token: str, tenant: str, task_id: str | None, call_id: str, request_id: str
    ) -> tuple[str | None, str | None]:
        """ApprovalStore.consume, off the event loop where the store has a disk."""
        raise NotImplementedError

    async def consumed_approvals(
        self, tenant: str, task_id: str | None, call_ids: list[str]
    ) -> set[str]:
        """ApprovalStore.consumed, off the event loop where the store has a disk."""
        raise NotImplementedError

    async def give_back_approvals(self, tenant: str, request_id: str, call_ids: list[str]) -> int:
        """ApprovalStore.give_back, off the event loop where the store has a disk."""
        raise NotImplementedError

    def connection(self) -> contextlib.AbstractContextManager[sqlite3.Connection]:
        """A connection for reads and maintenance (admin API, retention)."""
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError


class SqliteStore(Store):
    """One SQLite file in WAL mode (storage.sqlite_path), shared with the CLI and with
    other gateway processes."""

    def __init__(
        self,
        path: str,
        defaults: Limits,
        idempotency_ttl_s: float,
        flush_s: float,
        max_disk_bytes: int = 0,
        *,
        sealer: Sealer | None = None,
        owner: str | None = None,
        response_retention_days: float = 30.0,
        writer_socket: str | None = None,
    ):
        """`sealer` seals stored responses (None: a key this process alone holds, so
        nothing it stores outlives it); `owner` names this gateway instance;
        `writer_socket`: the shared ledger writer to send rows to (one of several
        gateway processes of a host; `ledger.spawn_shared_writer`) instead of starting
        this process's own."""
        from switchyard.state.sql import connect

        self.path = path
        self._connect = connect
        self._io = ThreadPoolExecutor(1, thread_name_prefix="switchyard-store")
        self._io_local = threading.local()
        self._defaults = defaults
        self.keys = KeyStore(connect(path), defaults)
        self.approvals = ApprovalStore(connect(path))
        self.idempotency = IdempotencyStore(
            connect(path), idempotency_ttl_s, self._io, key=None if sealer is None else sealer.key
        )
        sealer = sealer or Sealer.ephemeral()
        self.tool_calls = ToolCallRecords(connect(path), sealer, self._io)
        self.ledger = UsageLedger(
            path, flush_s, max_disk_bytes, seal_key=sealer.key, writer_socket=writer_socket
        )
        self.responses = ResponseStore(
            connect(path),
            sealer,
            owner or instance_name(0),
            self._io,
            writer=self.ledger,  # new responses go with the usage rows' batches
            retention_days=response_retention_days,
        )

    def _io_keys(self) -> KeyStore:
        """The I/O thread's own key store (its own connection, used by it alone)."""
        keys = getattr(self._io_local, "keys", None)
        if keys is None:
            keys = self._io_local.keys = KeyStore(self._connect(self.path), self._defaults)
        return keys

    def _verify(self, plaintext: str) -> Principal | str:
        return self._io_keys().verify(plaintext)

    def _spent(self, column: str, ident: str, since: float) -> float:
        return spent_since(self._io_keys().conn, column, ident, since)

    async def _on_io(self, what: str, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)` on the I/O thread; a database that cannot be reached (PostgreSQL
        down) is 503 store_unavailable for the request, and logged once per call."""
        try:
            return await asyncio.get_running_loop().run_in_executor(self._io, fn, *args)
        except sqlite3.OperationalError as exc:
            log.error("store unavailable for %s: %s", what, exc)
            raise DatabaseUnavailable(f"the gateway's database is unavailable ({what})") from None

    async def verify_key(self, plaintext: str) -> Principal | str:
        return await self._on_io("the key lookup", self._verify, plaintext)

    async def spent_since(self, column: str, ident: str, since: float) -> float:
        return await self._on_io("the budget's spend", self._spent, column, ident, since)

    async def consume_approval(
        self, token: str, tenant: str, task_id: str | None, call_id: str, request_id: str
    ) -> tuple[str | None, str | None]:
        return await self._on_io(
            "the approval", self.approvals.consume, token, tenant, task_id, call_id, request_id
        )

    async def consumed_approvals(
        self, tenant: str, task_id: str | None, call_ids: list[str]
    ) -> set[str]:
        return await self._on_io(
            "the approvals", self.approvals.consumed, tenant, task_id, call_ids
        )

    async def give_back_approvals(self, tenant: str, request_id: str, call_ids: list[str]) -> int:
        return await self._on_io(
            "the approvals", self.approvals.give_back, tenant, request_id, call_ids
        )

    @contextlib.contextmanager
    def connection(self) -> Iterator[sqlite3.Connection]:
        conn = self._connect(self.path)
        try:
            yield conn
        finally:
            conn.close()

    def close(self) -> None:
        self.ledger.close()
        self._io.shutdown(wait=True)
        self.responses.conn.close()


def memory_connection() -> sqlite3.Connection:
    """A fresh in-memory database with the gateway's schema."""
    conn = sqlite3.connect(
        ":memory:", check_same_thread=False, isolation_level=None, factory=Connection
    )
    conn.row_factory = sqlite3.Row
    conn.execute("PRAGMA foreign_keys=ON")
    conn.executescript(SCHEMA)
    migrate(conn)
    return conn


class MemoryLedger(LedgerReads):
    """The usage ledger in the store's in-memory database: rows are serialised as the
    writer process would receive them and committed by the same `write_batch`, every
    `flush_s`, at a flush, or once 256 are queued."""

    def __init__(self, conn: sqlite3.Connection, lock: threading.RLock, flush_s: float) -> None:
        self.conn = conn
        self._lock = lock
        self.flush_s = flush_s
        self._batch: list[Row] = []
        self._templates: dict[str, Any] = {}
        self._counts = LedgerCounts()
        self._timer: asyncio.TimerHandle | None = None
        self.queued_bytes = 0

    @property
    def dropped(self) -> int:
        return self._counts.dropped

    @property
    def repaired(self) -> int:
        return self._counts.repaired

    def block_id(self, template: list[tuple[str, str, str, Any]]) -> str:
        bid = template_id(template)
        self._templates.setdefault(bid, template)
        return bid

    def record(self, finished: Finished) -> None:
        row = encoded_row(finished, self._counts)
        if row is None:
            return
        self._batch.append(row)
        if len(self._batch) >= 256:
            self.flush()
            return
        if self._timer is None:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:
                self.flush()
                return
            self._timer = loop.call_later(self.flush_s, self.flush)

    def flush(self, timeout_s: float = 10.0) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        batch, self._batch = self._batch, []
        if not batch:
            return
        decoded = decode_batch(
            batch_json(batch, self._templates)
        )  # as the writer process would receive it
        if decoded is None:
            return
        with self._lock:
            write_batch(self.conn, decoded)

    async def flush_async(self, timeout_s: float = 10.0) -> bool:
        self.flush()
        return True

    def close(self) -> None:
        self.flush()

    @contextlib.contextmanager
    def reading(self) -> Iterator[sqlite3.Connection]:
        self.flush()
        with self._lock:
            yield self.conn


class MemoryStore(Store):
    """Everything in one in-memory SQLite database, in this process (see the module
    docstring). Its calls never wait for a disk, so they run in the caller."""

    def __init__(
        self,
        defaults: Limits,
        idempotency_ttl_s: float,
        flush_s: float = 0.02,
        *,
        sealer: Sealer | None = None,
        owner: str | None = None,
        response_retention_days: float = 30.0,
    ):
        self.conn = memory_connection()
        self._lock = threading.RLock()
        self.keys = KeyStore(self.conn, defaults)
        self.approvals = ApprovalStore(self.conn)
        self.idempotency = IdempotencyStore(
            self.conn, idempotency_ttl_s, key=None if sealer is None else sealer.key
        )
        sealer = sealer or Sealer.ephemeral()
        self.tool_calls = ToolCallRecords(self.conn, sealer, None)
        self.responses = ResponseStore(
            self.conn,
            sealer,
            owner or instance_name(0),
            retention_days=response_retention_days,
        )
        self.ledger = MemoryLedger(self.conn, self._lock, flush_s)

    async def verify_key(self, plaintext: str) -> Principal | str:
        with self._lock:
            return self.keys.verify(plaintext, time.time())

    async def spent_since(self, column: str, ident: str, since: float) -> float:
        return self.ledger.spent_since(column, ident, since)

    async def consume_approval(
        self, token: str, tenant: str, task_id: str | None, call_id: str, request_id: str
    ) -> tuple[str | None, str | None]:
        with self._lock:
            return self.approvals.consume(token, tenant, task_id, call_id, request_id)

    async def consumed_approvals(
        self, tenant: str, task_id: str | None, call_ids: list[str]
    ) -> set[str]:
        with self._lock:
            return self.approvals.consumed(tenant, task_id, call_ids)

    async def give_back_approvals(self, tenant: str, request_id: str, call_ids: list[str]) -> int:
        with self._lock:
            return self.approvals.give_back(tenant, request_id, call_ids)

    @contextlib.contextmanager
    def connection(self) -> Iterator[sqlite3.Connection]:
        self.ledger.flush()
        with self._lock:
            yield self.conn

    def close(self) -> None:
        self.ledger.close()
