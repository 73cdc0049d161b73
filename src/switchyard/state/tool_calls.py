"""Side-effecting tool calls run at most once, across gateway processes.

A call is identified by (tenant, call id). The first request to claim an id owns it
(an atomic INSERT in the shared store, SQLite or PostgreSQL, so the claim holds across
processes), with the task it was claimed in (a claim reports it: the service decides
what a repeat from another task needs); it then records the outcome:

* `done` with its result (sealed, state/sealing.py: nothing readable of a tool's
  result sits on disk): every repeat of the id gets that result without a new run;
* `in_doubt` when the outcome is unknown (a timeout or a lost connection after the
  call was sent): a repeat is refused, never re-run; an operator resolves it;
* `too_large` when it ran and answered with a result larger than
  `mcp.max_result_bytes`: the side effect happened (so it is not in doubt), but the
  result is neither stored nor given to anyone; a repeat is refused, never re-run;
* released (the row deleted) when the call certainly did not run (refused before it
  was sent, the server answered with a protocol error): a repeat runs it.

A repeat that arrives while the first is in flight waits for its outcome: woken by an
event in this process, by polling the store for another process's.
"""

from __future__ import annotations

import asyncio
import logging
import sqlite3
import threading
import time
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from switchyard.state.sql import on_io

log = logging.getLogger("switchyard")
T = TypeVar("T")
POLL_S = 0.05  # how often a repeat polls for another process's outcome


class Sealer(Protocol):
    def seal(self, tenant_id: str, rid: str, obj: dict[str, Any]) -> bytes: ...

    def open(self, tenant_id: str, rid: str, blob: bytes) -> dict[str, Any]: ...


@dataclass(frozen=True, slots=True)
class Claim:
    """What a claim found: `owner` (run it, then record the outcome), `done` (its
    `result`), `too_large` (it ran; its result was too large to keep), `in_doubt`,
    `resolved_ran`, `conflict` (the id was used for another tool or other arguments) or
    `in_flight` (the wait ran out while another request runs it)."""

    state: str
    result: dict[str, Any] | None = None
    request_id: str | None = None  # the request that ran (or runs) it
    # The task it was claimed in (None: outside any task): its stored result answers
    # that task's repeats; another task's needs an approval of its own
    # (mcp_service/__init__.py).
    task: str | None = None


def _rid(call_id: str) -> str:
    return "tool-call:" + call_id


class ToolCalls(Protocol):
    """Side-effecting tool calls, at most once: claimed, completed, released or in doubt.

    Implemented once, in SQL: `ToolCallRecords` (on SQLite, PostgreSQL or an in-memory SQLite
    database)."""

    async def claim(
        self,
        tenant: str,
        call_id: str,
        task: str | None,
        tool: str,
        digest: str,
        request_id: str,
        wait_until: float,
        stale_after_s: float = 3660.0,
    ) -> Claim: ...

    async def complete(self, tenant: str, call_id: str, result: dict[str, Any]) -> None: ...

    async def complete_too_large(self, tenant: str, call_id: str) -> None: ...

    async def doubt(self, tenant: str, call_id: str) -> None: ...

    async def release(self, tenant: str, call_id: str) -> None: ...

    def in_doubt(self, tenant: str | None, limit: int = 100) -> list[dict[str, Any]]: ...

    def resolve(self, tenant: str, call_id: str, ran: bool) -> bool: ...


class ToolCallRecords:
    """The `tool_calls` table. `io` runs the SQL (the store's I/O thread), or None to
    run it in the caller (an in-memory database)."""

    def __init__(self, conn: sqlite3.Connection, sealer: Sealer, io: Executor | None) -> None:
        self.conn = conn
        self.sealer = sealer
        self._io = io
        self._lock = threading.Lock()
        self._events: dict[tuple[str, str], asyncio.Event] = {}

    async def _run(self, fn: Callable[..., T], *args: Any) -> T:
        return await on_io(self._io, "the tool call's record", fn, *args)

    def _claim(
        self,
        tenant: str,
        call_id: str,
        call: tuple[str | None, str, str, str],
        stale_after_s: float,
    ) -> Claim:
        """`claim`'s one look at the table; `call`: (task, tool, digest, request id)."""
        task, tool, digest, request_id = call
        now = time.time()
        with self._lock:
            row = self.conn.execute(
                "SELECT tool, args_hash, state, request_id, result, updated_at, task_id"
                " FROM tool_calls"
                " WHERE tenant_id = ? AND call_id = ?",
                (tenant, call_id),
            ).fetchone()
            if (
                row is not None
                and row["state"] == "in_flight"
                and (row["updated_at"] < now - stale_after_s)
            ):  # its owner stopped mid-call: the outcome is unknown
                self.conn.execute(
                    "UPDATE tool_calls SET state = 'in_doubt', updated_at = ?"
                    " WHERE tenant_id = ? AND call_id = ? AND state = 'in_flight'",
                    (now, tenant, call_id),
                )
                return Claim("in_doubt", request_id=row["request_id"])
            if row is None:
                try:
                    self.conn.execute(
                        "INSERT INTO tool_calls (tenant_id, call_id, task_id, tool, args_hash,"
                        " state, request_id, created_at, updated_at)"
                        " VALUES (?, ?, ?, ?, ?, 'in_flight', ?, ?, ?)",
                        (tenant, call_id, task, tool, digest, request_id, now, now),
                    )
                    return Claim("owner")
                except sqlite3.IntegrityError:  # another process claimed it first
                    return Claim("in_flight")
        if row["tool"] != tool or row["args_hash"] != digest:
            return Claim("conflict", request_id=row["request_id"])
        if row["state"] == "done":
            result = self.sealer.open(tenant, _rid(call_id), bytes(row["result"]))
            return Claim("done", result, row["request_id"], row["task_id"])
        return Claim(str(row["state"]), request_id=row["request_id"], task=row["task_id"])

    async def claim(
        self,
        tenant: str,
        call_id: str,
        task: str | None,
        tool: str,
        digest: str,
        request_id: str,
        wait_until: float,
        stale_after_s: float = 3660.0,
    ) -> Claim:
        """Own the call id, or its recorded outcome; waits (until `wait_until`,
        perf_counter seconds) while another request runs it. A call in flight for longer
        than `stale_after_s` lost its owner (a gateway stopped mid-call): in doubt."""
        while True:
            call = (task, tool, digest, request_id)
            got = await self._run(self._claim, tenant, call_id, call, stale_after_s)
            if got.state == "owner":
                self._events[(tenant, call_id)] = asyncio.Event()
                return got
            if got.state != "in_flight":
                return got
            remaining = wait_until - time.perf_counter()
            if remaining <= 0:
                return got
            event = self._events.get((tenant, call_id))
            try:
                if event is not None:
                    await asyncio.wait_for(event.wait(), min(remaining, 1.0))
                else:
                    await asyncio.sleep(min(remaining, POLL_S))
            except TimeoutError:
                pass

    def _finish(self, tenant: str, call_id: str, state: str, result: dict[str, Any] | None) -> None:
        blob = self.sealer.seal(tenant, _rid(call_id), result) if result is not None else None
        with self._lock:
            self.conn.execute(
                "UPDATE tool_calls SET state = ?, result = ?, updated_at = ?"
                " WHERE tenant_id = ? AND call_id = ? AND state = 'in_flight'",
                (state, blob, time.time(), tenant, call_id),
            )

    def _release(self, tenant: str, call_id: str) -> None:
        with self._lock:
            self.conn.execute(
                "DELETE FROM tool_calls WHERE tenant_id = ? AND call_id = ? AND state = 'in_flight'",
                (tenant, call_id),
            )

    async def complete(self, tenant: str, call_id: str, result: dict[str, Any]) -> None:
        """The call ran and returned `result`: every repeat gets it."""
        try:
            await self._run(self._finish, tenant, call_id, "done", result)
        finally:
            self._wake(tenant, call_id)

    async def complete_too_large(self, tenant: str, call_id: str) -> None:
        """The call ran, and its result was larger than the gateway keeps: done, with
        no result for a repeat (which is refused, never re-run)."""
        try:
            await self._run(self._finish, tenant, call_id, "too_large", None)
        finally:
            self._wake(tenant, call_id)

    async def doubt(self, tenant: str, call_id: str) -> None:
        """The call may have run: never run again automatically."""
        try:
            await self._run(self._finish, tenant, call_id, "in_doubt", None)
        finally:
            self._wake(tenant, call_id)

    async def release(self, tenant: str, call_id: str) -> None:
        """The call certainly did not run: a repeat may run it."""
        try:
            await self._run(self._release, tenant, call_id)
        finally:
            self._wake(tenant, call_id)

    def _wake(self, tenant: str, call_id: str) -> None:
        event = self._events.pop((tenant, call_id), None)
        if event is not None:
            event.set()

    @staticmethod
    def forget_before(conn: sqlite3.Connection, cutoff: float) -> int:
        """Retention: drop the records of calls that finished (done, too large, or
        resolved by an operator) before `cutoff` (unix seconds); a repeat after that runs
        anew. Calls in doubt stay until an operator resolves them."""
        cur = conn.execute(
            "DELETE FROM tool_calls WHERE state IN ('done', 'too_large', 'resolved_ran')"
            " AND updated_at < ?",
            (cutoff,),
        )
        return max(0, int(cur.rowcount or 0))

    # -- the operator's side (admin API) ----------------------------------------
    def in_doubt(self, tenant: str | None, limit: int = 100) -> list[dict[str, Any]]:
        """Calls in doubt (a tenant's, or everyone's), newest first, without results."""
        sql = (
            "SELECT tenant_id, call_id, task_id, tool, request_id, created_at, updated_at"
            " FROM tool_calls WHERE state = 'in_doubt'"
        )
        args: tuple[Any, ...] = ()
        if tenant is not None:
            sql += " AND tenant_id = ?"
            args = (tenant,)
        with self._lock:
            rows = self.conn.execute(sql + f" ORDER BY updated_at DESC LIMIT {int(limit)}", args)
            return [dict(r) for r in rows.fetchall()]

    def resolve(self, tenant: str, call_id: str, ran: bool) -> bool:
        """An operator's word on a call in doubt: it ran (`ran`: repeats are refused as
        done, with no result to give) or it did not (released: a repeat runs it)."""
        with self._lock:
            if ran:
                cur = self.conn.execute(
                    "UPDATE tool_calls SET state = 'resolved_ran', updated_at = ?"
                    " WHERE tenant_id = ? AND call_id = ? AND state = 'in_doubt'",
                    (time.time(), tenant, call_id),
                )
            else:
                cur = self.conn.execute(
                    "DELETE FROM tool_calls WHERE tenant_id = ? AND call_id = ?"
                    " AND state = 'in_doubt'",
                    (tenant, call_id),
                )
            return bool(cur.rowcount == 1)
