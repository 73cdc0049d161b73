"""Approvals of tool calls (`ApprovalStore`): issued, single-use, expiring, in the
gateway's database. Which tool results need one is policy (policy/tool_calls_approvals.py).
"""

from __future__ import annotations

import hashlib
import secrets
import sqlite3
import threading
import time
from collections.abc import Sequence
from typing import Any, Protocol

from switchyard.errors import InvalidRequest
from switchyard.ids import ID_PATTERN

APPROVAL_PREFIX = "apr-sy-"
# Call ids per query of `consumed` (a request brings at most policy's MAX_TOOL_RESULTS).
_CONSUMED_CHUNK = 256


def _hash(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


class Approvals(Protocol):
    """Approvals of tool calls: issued, consumed once.

    Implemented once, in SQL: `ApprovalStore` (on SQLite, PostgreSQL or an in-memory SQLite
    database)."""

    def issue(
        self,
        tenant: str,
        task_id: str | None,
        call_id: str,
        approver: str,
        ttl_s: float,
        now: float | None = None,
    ) -> dict[str, Any]: ...

    def consume(
        self,
        token: str,
        tenant: str,
        task_id: str | None,
        call_id: str,
        request_id: str,
        now: float | None = None,
    ) -> tuple[str | None, str | None]: ...

    def consumed(self, tenant: str, task_id: str | None, call_ids: Sequence[str]) -> set[str]: ...

    def give_back(self, tenant: str, request_id: str, call_ids: Sequence[str]) -> int: ...


class ApprovalStore:
    """Approvals of tool calls, in the gateway's database (table `approvals`): a token
    is shown once and kept as a hash, scoped to (tenant, task, call id), single-use
    and expiring. The CLI and the admin API issue them; the gateway consumes them."""

    def __init__(self, conn: sqlite3.Connection) -> None:
        self.conn = conn
        self._lock = threading.Lock()

    def issue(
        self,
        tenant: str,
        task_id: str | None,
        call_id: str,
        approver: str,
        ttl_s: float,
        now: float | None = None,
    ) -> dict[str, Any]:

        now = time.time() if now is None else now
        for name, value, longest in (
            ("tenant", tenant, 63),
            ("call_id", call_id, 128),
            ("approver", approver, 128),
        ):
            # Printable: each is logged and rendered in traces, where a newline or a
            # terminal's control sequence would forge lines.
            if (
                not isinstance(value, str)
                or not 0 < len(value) <= longest
                or not value.isprintable()
            ):
                raise InvalidRequest(
                    f"'{name}' must be 1 to {longest} printable characters", param=name
                )
        if task_id is not None and not (isinstance(task_id, str) and ID_PATTERN.fullmatch(task_id)):
            raise InvalidRequest("'task_id' must be a task id", param="task_id")
        if (
            not isinstance(ttl_s, int | float)
            or isinstance(ttl_s, bool)
            or not 0 < ttl_s <= 30 * 86400
        ):
            raise InvalidRequest("'ttl_s' must be seconds in (0, 2592000]", param="ttl_s")
        token = APPROVAL_PREFIX + secrets.token_urlsafe(24)
        with self._lock:
            self.conn.execute(
                "INSERT INTO approvals (token_hash, tenant_id, task_id, call_id, approver,"
                " created_at, expires_at) VALUES (?,?,?,?,?,?,?)",
                (_hash(token), tenant, task_id, call_id, approver, now, now + ttl_s),
            )
        return {
            "object": "approval",
            "token": token,
            "tenant": tenant,
            "task_id": task_id,
            "call_id": call_id,
            "approver": approver,
            "expires_at": now + ttl_s,
        }

    def consume(
        self,
        token: str,
        tenant: str,
        task_id: str | None,
        call_id: str,
        request_id: str,
        now: float | None = None,
    ) -> tuple[str | None, str | None]:
        """(approver, None) when the token approves this call (and is now used), else
        (None, why)."""
        now = time.time() if now is None else now
        with self._lock:
            row = self.conn.execute(
                "SELECT tenant_id, task_id, call_id, approver, expires_at, used_at"
                " FROM approvals WHERE token_hash = ?",
                (_hash(token),),
            ).fetchone()
            # Another tenant's token is answered as one that does not exist: what a
            # tenant is told never says a token is someone else's.
            if row is None or row[0] != tenant:
                return None, "unknown approval token"
            _, r_task, r_call, approver, expires_at, used_at = tuple(row)
            if r_call != call_id or (r_task is not None and r_task != task_id):
                return None, "the approval is for another task or call"
            if used_at is not None:
                return None, "the approval was already used"
            if expires_at <= now:
                return None, "the approval has expired"
            cur = self.conn.execute(
                "UPDATE approvals SET used_at = ?, used_by = ? WHERE token_hash = ? AND used_at IS NULL",
                (now, request_id, _hash(token)),
            )
            if cur.rowcount != 1:  # another process used it meanwhile
                return None, "the approval was already used"
        return str(approver), None

    def consumed(self, tenant: str, task_id: str | None, call_ids: Sequence[str]) -> set[str]:
        """The call ids among `call_ids` for which an approval that `consume` would
        have taken for this tenant and task was already used: a call approved once
        stays approved for the later turns of its conversation, which carry its
        result as history. A task-wide approval (task None) counts in any task, as
        in `consume`."""
        ids = list(dict.fromkeys(call_ids))
        found: set[str] = set()
        for start in range(0, len(ids), _CONSUMED_CHUNK):
            chunk = ids[start : start + _CONSUMED_CHUNK]
            marks = ",".join("?" * len(chunk))
            with self._lock:
                rows = self.conn.execute(
                    "SELECT DISTINCT call_id FROM approvals WHERE tenant_id = ?"
                    " AND used_at IS NOT NULL AND (task_id IS NULL OR task_id = ?)"
                    f" AND call_id IN ({marks})",
                    (tenant, task_id, *chunk),
                ).fetchall()
            found.update(str(row[0]) for row in rows)
        return found

    def give_back(self, tenant: str, request_id: str, call_ids: Sequence[str]) -> int:
        """Undo what `consume` did for `request_id` on these call ids: the request was
        refused before anything went upstream (a 429 at admission, a full queue), so
        its approvals approved nothing yet and its retry presents the same tokens.
        Only the approvals that request used are given back; returns how many."""
        ids = list(dict.fromkeys(call_ids))
        back = 0
        for start in range(0, len(ids), _CONSUMED_CHUNK):
            chunk = ids[start : start + _CONSUMED_CHUNK]
            marks = ",".join("?" * len(chunk))
            with self._lock:
                cur = self.conn.execute(
                    "UPDATE approvals SET used_at = NULL, used_by = NULL WHERE tenant_id = ?"
                    f" AND used_by = ? AND call_id IN ({marks})",
                    (tenant, request_id, *chunk),
                )
            back += max(0, int(cur.rowcount or 0))
        return back
