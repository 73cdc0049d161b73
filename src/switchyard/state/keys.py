"""Tenants and API keys, stored in SQLite; a key is shown once and kept as a hash.

Keys are 256-bit random tokens, so a plain SHA-256 is enough to store them (no
password stretching needed: nothing to brute-force). The CLI and the admin API call
the same `KeyStore` methods.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import secrets
import sqlite3
import threading
import time
from typing import Any, Protocol

from switchyard.errors import Conflict, InvalidRequest, NotFound
from switchyard.identity import PRIORITY_NAMES, STANDARD, Limits, Principal, TaskBudget

KEY_PREFIX = "sk-sy-"
TENANT_ID = re.compile(r"^[a-z0-9][a-z0-9_-]{0,62}$")
LIMIT_FIELDS = ("rpm", "tpm", "max_concurrency", "budget_usd", "budget_period")


def hash_key(plaintext: str) -> str:
    return hashlib.sha256(plaintext.encode()).hexdigest()


def _limits(row: sqlite3.Row, defaults: Limits | None = None) -> Limits:
    d = defaults or Limits()
    return Limits(
        rpm=row["rpm"] if row["rpm"] is not None else d.rpm,
        tpm=row["tpm"] if row["tpm"] is not None else d.tpm,
        max_concurrency=row["max_concurrency"]
        if row["max_concurrency"] is not None
        else d.max_concurrency,
        budget_usd=row["budget_usd"] if row["budget_usd"] is not None else d.budget_usd,
        budget_period=row["budget_period"] or d.budget_period,
    )


MAX_LIMIT = 10**12  # rpm, tpm, max_concurrency
# The largest integer SQLite stores (a larger one fails the write): the bound of every
# number an admin call sets (api/admin/params.py), a budget's in USD among them.
MAX_INT = 2**63 - 1


def _check_limits(values: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k in ("rpm", "tpm", "max_concurrency"):
        v = values.get(k)
        if v is not None and (
            not isinstance(v, int) or isinstance(v, bool) or not 1 <= v <= MAX_LIMIT
        ):  # bounded: SQLite stores at most a signed 64-bit integer
            raise InvalidRequest(f"'{k}' must be an integer from 1 to {MAX_LIMIT}", param=k)
        out[k] = v
    b = values.get("budget_usd")
    # Finite: the command line's float takes "nan" (SQLite stores NULL: the default
    # budget) and "inf" (no budget, shown as one); JSON has neither.
    if b is not None and (
        not isinstance(b, int | float)
        or isinstance(b, bool)
        or not math.isfinite(b)
        or not 0 <= b <= MAX_INT
    ):
        raise InvalidRequest(
            f"'budget_usd' must be a finite number from 0 to {MAX_INT}", param="budget_usd"
        )
    out["budget_usd"] = b
    p = values.get("budget_period")
    if p is not None and p not in ("day", "month"):
        raise InvalidRequest("'budget_period' must be 'day' or 'month'", param="budget_period")
    out["budget_period"] = p
    return out


TASK_BUDGET_FIELDS = {
    "calls": int,
    "tokens": int,
    "cost_usd": float,
    "wall_s": float,
    "tool_calls": int,
}


def _check_task_budget(v: Any) -> str | None:
    """A tenant's or key's `task_budget` ({calls, tokens, cost_usd, wall_s, tool_calls},
    each optional and > 0) as the JSON stored, or None."""
    if v is None:
        return None
    why = (
        "'task_budget' must be an object of calls, tokens, tool_calls (integers), "
        "cost_usd, wall_s (> 0)"
    )
    if not isinstance(v, dict) or not set(v) <= set(TASK_BUDGET_FIELDS):
        raise InvalidRequest(why, param="task_budget")
    for name, value in v.items():
        kind = TASK_BUDGET_FIELDS[name]
        ok = isinstance(value, int) if kind is int else isinstance(value, int | float)
        if not ok or isinstance(value, bool) or not 0 < value <= 1e12:
            raise InvalidRequest(why, param="task_budget")
    return json.dumps(v, sort_keys=True) if v else None


def _check_priority(v: Any) -> str | None:
    """A tenant's or key's scheduling class: interactive, standard or batch (None: a
    tenant's is standard, a key's its tenant's)."""
    if v is not None and v not in PRIORITY_NAMES:
        raise InvalidRequest(
            "'priority' must be one of interactive, standard, batch", param="priority"
        )
    return v


def _rank(name: str | None) -> int:
    return PRIORITY_NAMES.index(name) if name in PRIORITY_NAMES else STANDARD


# What `update_tenant` and `update_key` may change.
UPDATABLE = (*LIMIT_FIELDS, "priority")


def _task_budget(raw: str | None) -> TaskBudget | None:
    return TaskBudget.of(json.loads(raw)) if raw else None


MAX_LABELS = 32
MAX_NAME = 128


def _check_labels(v: Any) -> dict[str, Any]:
    """A tenant's or key's labels: an object of at most MAX_LABELS, each name at most 64
    characters and each value a string of at most 256, or for `regions` (a tenant's data
    boundary: models[].data_boundary) a list of region names. Checked here, where they
    are written: a shape `verify` cannot read would fail each of the keys' requests, or
    (a `regions` that is not a list) drop the tenant's boundary."""
    if v is None:
        return {}
    why = (
        f"'labels' must be an object of at most {MAX_LABELS} names (64 characters) with "
        "string values (256 characters), and `regions` a list of region names"
    )
    if not isinstance(v, dict) or len(v) > MAX_LABELS:
        raise InvalidRequest(why, param="labels")
    for name, value in v.items():
        if len(name) > 64:
            raise InvalidRequest(why, param="labels")
        if name == "regions":
            if not isinstance(value, list) or not all(
                isinstance(r, str) and 0 < len(r) <= 64 for r in value
            ):
                raise InvalidRequest(why, param="labels")
        elif not isinstance(value, str) or len(value) > 256:
            raise InvalidRequest(why, param="labels")
    return v


def _check_expires_at(v: Any) -> float | None:
    """A key's expiry: unix seconds, a finite number (None: it never expires)."""
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int | float) or not 0 < v < 1e11:
        raise InvalidRequest(
            "'expires_at' must be a time in unix seconds (or use expires_in_s)",
            param="expires_at",
        )
    return float(v)


def _check_name(v: Any) -> str | None:
    if v is not None and (not isinstance(v, str) or len(v) > MAX_NAME):
        raise InvalidRequest(f"'name' must be a string of at most {MAX_NAME}", param="name")
    return v


def _regions(labels: Any) -> tuple[str, ...] | None:
    """A tenant's data boundary from its stored labels: None without `regions`. One
    written before labels were checked that is not a list of names admits no region
    (refused, never unbounded)."""
    if not isinstance(labels, dict) or "regions" not in labels:
        return None
    regions = labels["regions"]
    if not isinstance(regions, list) or not all(isinstance(r, str) for r in regions):
        return ()
    return tuple(regions)


def _patterns(v: Any, name: str) -> list[str]:
    if v is None:
        return ["*"] if name == "allowed_models" else []
    if not isinstance(v, list) or not all(isinstance(x, str) and x for x in v):
        raise InvalidRequest(f"'{name}' must be a list of names or wildcards", param=name)
    return list(v)


class Keys(Protocol):
    """Tenants and API keys: the admin API's and the CLI's calls, and the key lookup on
    an authentication-cache miss (`verify`).

    Implemented once, in SQL: `KeyStore` (on SQLite, PostgreSQL or an in-memory SQLite
    database)."""

    def create_tenant(self, tenant_id: str, **values: Any) -> dict[str, Any]: ...

    def update_tenant(self, tenant_id: str, /, **values: Any) -> dict[str, Any]: ...

    def get_tenant(self, tenant_id: str) -> dict[str, Any]: ...

    def list_tenants(
        self, limit: int | None = None, after: str | None = None
    ) -> list[dict[str, Any]]: ...

    def create_key(self, tenant_id: str, **values: Any) -> dict[str, Any]: ...

    def get_key(self, key_id: str) -> dict[str, Any]: ...

    def list_keys(
        self, tenant_id: str | None = None, limit: int | None = None, after: str | None = None
    ) -> list[dict[str, Any]]: ...

    def update_key(self, key_id: str, /, **values: Any) -> dict[str, Any]: ...

    def revoke_key(self, key_id: str) -> dict[str, Any]: ...

    def verify(self, plaintext: str, now: float | None = None) -> Principal | str: ...

    def count_tenants(self) -> int: ...


class KeyStore:
    def __init__(self, conn: sqlite3.Connection, tenant_defaults: Limits | None = None) -> None:
        self.conn = conn
        self.defaults = tenant_defaults or Limits()
        self._lock = threading.Lock()

    # -- tenants --------------------------------------------------------------
    def create_tenant(self, tenant_id: str, **values: Any) -> dict[str, Any]:
        # The whole id (`match`'s `$` also takes a trailing newline): every caller,
        # the admin API and the command line alike.
        if not isinstance(tenant_id, str) or not TENANT_ID.fullmatch(tenant_id):
            raise InvalidRequest("tenant id must be 1-63 chars of a-z, 0-9, '-' or '_'", param="id")
        lim = _check_limits(values)
        models = _patterns(values.get("allowed_models"), "allowed_models")
        labels = _check_labels(values.get("labels"))
        task_budget = _check_task_budget(values.get("task_budget"))
        priority = _check_priority(values.get("priority"))
        with self._lock:
            try:
                self.conn.execute(
                    "INSERT INTO tenants (id, created_at, rpm, tpm, max_concurrency, budget_usd,"
                    " budget_period, allowed_models, labels, task_budget, priority)"
                    " VALUES (?,?,?,?,?,?,?,?,?,?,?)",
                    (
                        tenant_id,
                        time.time(),
                        lim["rpm"],
                        lim["tpm"],
                        lim["max_concurrency"],
                        lim["budget_usd"],
                        lim["budget_period"],
                        json.dumps(models),
                        json.dumps(labels),
                        task_budget,
                        priority,
                    ),
                )
            except sqlite3.IntegrityError:
                raise Conflict(f"tenant '{tenant_id}' already exists") from None
        return self.get_tenant(tenant_id)

    def update_tenant(self, tenant_id: str, /, **values: Any) -> dict[str, Any]:
        """Change a tenant's limits or priority: only the fields given (a None clears a
        limit back to the default, and a priority back to standard). A gateway applies
        it when it next reads the tenant's keys (its key cache, auth.key_cache_s)."""
        self.get_tenant(tenant_id)
        self._update("tenants", tenant_id, values)
        return self.get_tenant(tenant_id)

    def _update(self, table: str, ident: str, values: dict[str, Any]) -> None:
        unknown = sorted(set(values) - set(UPDATABLE))
        if unknown:
            raise InvalidRequest(
                f"'{unknown[0]}' cannot be changed here (only {', '.join(UPDATABLE)})",
                param=unknown[0],
            )
        if not values:
            raise InvalidRequest(f"nothing to change: give one of {', '.join(UPDATABLE)}")
        checked = _check_limits(values)
        checked["priority"] = _check_priority(values.get("priority"))
        names = [k for k in UPDATABLE if k in values]  # a fixed list: no name from the caller
        with self._lock:
            self.conn.execute(
                f"UPDATE {table} SET {', '.join(f'{k} = ?' for k in names)} WHERE id = ?",
                (*(checked[k] for k in names), ident),
            )

    def get_tenant(self, tenant_id: str) -> dict[str, Any]:
        row = self.conn.execute("SELECT * FROM tenants WHERE id = ?", (tenant_id,)).fetchone()
        if row is None:
            raise NotFound(f"tenant '{tenant_id}' does not exist")
        return self._tenant_dict(row)

    def list_tenants(
        self, limit: int | None = None, after: str | None = None
    ) -> list[dict[str, Any]]:
        """Tenants by id: those after the id `after` (a page's last), at most `limit`
        (None: every one, for the CLI)."""
        sql, args = "SELECT * FROM tenants", list[Any]()
        if after is not None:
            sql, args = sql + " WHERE id > ?", [after]
        sql += " ORDER BY id"
        if limit is not None:
            sql, args = sql + " LIMIT ?", [*args, limit]
        rows = self.conn.execute(sql, args).fetchall()
        return [self._tenant_dict(r) for r in rows]

    def _tenant_dict(self, row: sqlite3.Row) -> dict[str, Any]:
        eff = _limits(row, self.defaults)
        return {
            "id": row["id"],
            "created_at": row["created_at"],
            "allowed_models": json.loads(row["allowed_models"]),
            "labels": json.loads(row["labels"]),
            "limits": {k: row[k] for k in LIMIT_FIELDS},
            "effective_limits": {k: getattr(eff, k) for k in LIMIT_FIELDS},
            "task_budget": json.loads(row["task_budget"]) if row["task_budget"] else None,
            "priority": row["priority"] or PRIORITY_NAMES[STANDARD],
        }

    # -- keys -----------------------------------------------------------------
    def create_key(self, tenant_id: str, **values: Any) -> dict[str, Any]:
        """Create a key; the plaintext is in the result and nowhere else, ever."""
        self.get_tenant(tenant_id)
        lim = _check_limits(values)
        models = _patterns(values.get("allowed_models"), "allowed_models")
        adapters = _patterns(values.get("allowed_adapters"), "allowed_adapters")
        expires = _check_expires_at(values.get("expires_at"))
        key_name = _check_name(values.get("name"))
        labels = _check_labels(values.get("labels"))
        ttl = values.get("expires_in_s")
        if ttl is not None:
            # Held to what `expires_at` is (a bool is no number): the time it makes.
            if isinstance(ttl, bool) or not isinstance(ttl, int | float) or not 0 < ttl < 1e10:
                raise InvalidRequest(
                    "'expires_in_s' must be a positive number of seconds", param="expires_in_s"
                )
            if expires is not None:
                raise InvalidRequest(
                    "give 'expires_at' or 'expires_in_s', not both", param="expires_in_s"
                )
            expires = _check_expires_at(time.time() + float(ttl))
        pin = values.get("may_pin_revisions", False)
        device = values.get("may_report_device_state", False)
        for name, flag in (("may_pin_revisions", pin), ("may_report_device_state", device)):
            if not isinstance(flag, bool):
                raise InvalidRequest(f"'{name}' must be true or false", param=name)
        task_budget = _check_task_budget(values.get("task_budget"))
        priority = _check_priority(values.get("priority"))
        plaintext = KEY_PREFIX + secrets.token_urlsafe(32)
        key_id = "key_" + secrets.token_hex(6)
        with self._lock:
            self.conn.execute(
                "INSERT INTO api_keys (id, tenant_id, hash, prefix, name, created_at, expires_at,"
                " allowed_models, allowed_adapters, may_pin_revisions, may_report_device_state,"
                " rpm, tpm, max_concurrency, budget_usd, budget_period, labels, task_budget,"
                " priority) VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
                (
                    key_id,
                    tenant_id,
                    hash_key(plaintext),
                    plaintext[:10],
                    key_name,
                    time.time(),
                    expires,
                    json.dumps(models),
                    json.dumps(adapters),
                    int(pin),
                    int(device),
                    lim["rpm"],
                    lim["tpm"],
                    lim["max_concurrency"],
                    lim["budget_usd"],
                    lim["budget_period"],
                    json.dumps(labels),
                    task_budget,
                    priority,
                ),
            )
        out = self.get_key(key_id)
        out["key"] = plaintext
        return out

    def get_key(self, key_id: str) -> dict[str, Any]:
        row = self.conn.execute("SELECT * FROM api_keys WHERE id = ?", (key_id,)).fetchone()
        if row is None:
            raise NotFound(f"key '{key_id}' does not exist")
        return self._key_dict(row)

    def list_keys(
        self, tenant_id: str | None = None, limit: int | None = None, after: str | None = None
    ) -> list[dict[str, Any]]:
        """Keys by creation (of `tenant_id`'s, or every tenant's): those after the key
        `after` (a page's last), at most `limit` (None: every one, for the CLI)."""
        where: list[str] = []
        args: list[Any] = []
        if tenant_id:
            where.append("tenant_id = ?")
            args.append(tenant_id)
        if after is not None:
            row = self.conn.execute(
                "SELECT created_at FROM api_keys WHERE id = ?", (after,)
            ).fetchone()
            if row is None:
                raise InvalidRequest("'after' must be the id of a listed key", param="after")
            where.append("(created_at > ? OR (created_at = ? AND id > ?))")
            args += [row["created_at"], row["created_at"], after]
        sql = "SELECT * FROM api_keys" + (" WHERE " + " AND ".join(where) if where else "")
        sql += " ORDER BY created_at, id"
        if limit is not None:
            sql, args = sql + " LIMIT ?", [*args, limit]
        rows = self.conn.execute(sql, args).fetchall()
        return [self._key_dict(r) for r in rows]

    def update_key(self, key_id: str, /, **values: Any) -> dict[str, Any]:
        """Change a key's limits or priority (see `update_tenant`); a key's priority
        only lowers its tenant's."""
        self.get_key(key_id)
        self._update("api_keys", key_id, values)
        return self.get_key(key_id)

    def revoke_key(self, key_id: str) -> dict[str, Any]:
        with self._lock:
            cur = self.conn.execute(
                "UPDATE api_keys SET revoked_at = ? WHERE id = ? AND revoked_at IS NULL",
                (time.time(), key_id),
            )
        if cur.rowcount == 0:
            self.get_key(key_id)  # 404 when it does not exist; else it was already revoked
        return self.get_key(key_id)

    def _key_dict(self, row: sqlite3.Row) -> dict[str, Any]:
        return {
            "id": row["id"],
            "tenant_id": row["tenant_id"],
            "prefix": row["prefix"],
            "name": row["name"],
            "created_at": row["created_at"],
            "expires_at": row["expires_at"],
            "revoked": row["revoked_at"] is not None,
            "revoked_at": row["revoked_at"],
            "allowed_models": json.loads(row["allowed_models"]),
            "allowed_adapters": json.loads(row["allowed_adapters"]),
            "may_pin_revisions": bool(row["may_pin_revisions"]),
            "may_report_device_state": bool(row["may_report_device_state"]),
            "limits": {k: row[k] for k in LIMIT_FIELDS},
            "labels": json.loads(row["labels"]),
            "task_budget": json.loads(row["task_budget"]) if row["task_budget"] else None,
            "priority": row["priority"],  # None: its tenant's
        }

    # -- verification ------------------------------------------------------------
    def verify(self, plaintext: str, now: float | None = None) -> Principal | str:
        """The key's principal, or the reason it is refused."""
        now = time.time() if now is None else now
        row = self.conn.execute(
            "SELECT k.*, t.rpm AS t_rpm, t.tpm AS t_tpm, t.max_concurrency AS t_conc,"
            " t.budget_usd AS t_budget, t.budget_period AS t_period,"
            " t.allowed_models AS t_models, t.labels AS t_labels,"
            " t.task_budget AS t_task_budget, t.priority AS t_priority"
            " FROM api_keys k JOIN tenants t ON t.id = k.tenant_id"
            " WHERE k.hash = ?",
            (hash_key(plaintext),),
        ).fetchone()
        if row is None:
            return "the API key is not valid"
        if row["revoked_at"] is not None:
            return "the API key has been revoked"
        expires = row["expires_at"]
        # One written before expiries were checked that is not a number has expired.
        if expires is not None and (not isinstance(expires, int | float) or expires <= now):
            return "the API key has expired"
        d = self.defaults
        tenant_limits = Limits(
            rpm=row["t_rpm"] if row["t_rpm"] is not None else d.rpm,
            tpm=row["t_tpm"] if row["t_tpm"] is not None else d.tpm,
            max_concurrency=row["t_conc"] if row["t_conc"] is not None else d.max_concurrency,
            budget_usd=row["t_budget"] if row["t_budget"] is not None else d.budget_usd,
            budget_period=row["t_period"] or d.budget_period,
        )
        task_budget = _task_budget(row["t_task_budget"])
        key_task_budget = _task_budget(row["task_budget"])
        if key_task_budget is not None:
            task_budget = (
                key_task_budget if task_budget is None else task_budget.lower(key_task_budget)
            )
        return Principal(
            regions=_regions(json.loads(row["t_labels"])),
            tenant_id=row["tenant_id"],
            key_id=row["id"],
            key_models=tuple(json.loads(row["allowed_models"])),
            tenant_models=tuple(json.loads(row["t_models"])),
            key_adapters=tuple(json.loads(row["allowed_adapters"])),
            may_pin_revisions=bool(row["may_pin_revisions"]),
            may_report_device_state=bool(row["may_report_device_state"]),
            key_limits=_limits(row),
            tenant_limits=tenant_limits,
            labels=json.loads(row["labels"]),
            task_budget=task_budget,
            # The lower class of the two (a larger index): a key never raises its tenant's.
            priority=max(_rank(row["t_priority"]), _rank(row["priority"])),
            expires_at=expires,
        )

    def count_tenants(self) -> int:
        return int(self.conn.execute("SELECT COUNT(*) FROM tenants").fetchone()[0])
