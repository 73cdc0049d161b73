"""PostgreSQL as the store (`storage.postgres_dsn`): the same tables, the same code.

The stores (keys and tenants, approvals, idempotency, the ledger writer, traces,
deployment weights) are written once, against Python's `sqlite3` interface and in
SQLite's dialect. `PgConnection` offers that interface over psycopg, so every store
runs unchanged on either database (a second copy of each store's SQL would drift):

- each statement is translated once (cached): `?` placeholders become `%s`,
  `INSERT OR IGNORE` becomes `ON CONFLICT DO NOTHING`, `INSERT OR REPLACE` an upsert
  on the table's primary key, `BEGIN IMMEDIATE` a plain `BEGIN`;
- DDL types: `REAL` is `DOUBLE PRECISION` (PostgreSQL's `REAL` is 4 bytes, too few for
  a unix time), `INTEGER` is `BIGINT`, `BLOB` is `BYTEA`; a boolean is bound as 0/1;
- rows answer by index and by column name, as `sqlite3.Row` does;
- psycopg's errors are raised as sqlite3's classes (`IntegrityError` for a unique
  violation, `OperationalError` for a lost or refused connection, `DatabaseError`
  for the rest), so each caller's handling holds as it is; a value PostgreSQL cannot
  hold (a NUL character in text, a key too long for an index) is `UnstorableValue`,
  the one error SQLite's connections raise for a NUL too (state/sql.py): a 400 to a
  client, never an outage (a 503, or the ledger writer waiting for the database);
- the schema (db.SCHEMA, its migrations as `ADD COLUMN IF NOT EXISTS`, the rollups)
  is made once per process and database, under an advisory lock, so gateways and
  CLIs starting together do not race on `CREATE TABLE`.

Connections are in autocommit mode, as the SQLite ones (`isolation_level=None`):
statements commit at once unless a caller opens a transaction with `BEGIN`.
"""

from __future__ import annotations

import functools
import re
import sqlite3
import threading
from collections.abc import Iterable, Sequence
from typing import Any

from switchyard.errors import UnstorableValue

SCHEMES = ("postgresql://", "postgres://")
# The upsert key of each table a statement may INSERT OR REPLACE into.
PRIMARY_KEYS = {"usage": ("request_id",), "traces": ("request_id",)}
TOO_LONG_MESSAGE = "a value is too long for the gateway's database to index"
_LOCK_ID = 0x5357_5944  # pg_advisory_lock: "SWYD"
_made: set[str] = set()  # databases whose schema this process has made
_made_lock = threading.Lock()


class StoreUnavailable(sqlite3.OperationalError):
    """The PostgreSQL server cannot be reached or refuses the connection; the message
    names its host, port and database, never the password."""


def is_postgres(target: str) -> bool:
    """Whether a storage target is a PostgreSQL connection URI (else a SQLite path)."""
    return target.startswith(SCHEMES)


def redact(target: str) -> str:
    """The target as it may be logged or shown: a URI without its password."""
    if not is_postgres(target):
        return target
    return re.sub(r"^(\w+://[^:/@]*):[^@/]*@", r"\1:***@", target)


class Row(tuple[Any, ...]):
    """A result row by index (`row[0]`, unpacking) and by name (`row["id"]`, `dict(row)`)."""

    __slots__ = ()
    names: tuple[str, ...] = ()

    def __getitem__(self, key: Any) -> Any:
        if isinstance(key, str):
            return tuple.__getitem__(self, self.names.index(key))
        return tuple.__getitem__(self, key)

    def keys(self) -> list[str]:
        return list(self.names)


@functools.lru_cache(maxsize=64)
def _row_class(names: tuple[str, ...]) -> type[Row]:
    return type("Row", (Row,), {"__slots__": (), "names": names})


def _row_factory(cursor: Any) -> Any:
    desc = cursor.description
    if desc is None:
        return tuple
    cls = _row_class(tuple(c.name for c in desc))
    return cls


_INSERT = re.compile(
    r"^\s*INSERT\s+OR\s+(IGNORE|REPLACE)\s+INTO\s+(\w+)\s*\(([^)]*)\)", re.I | re.S
)


@functools.lru_cache(maxsize=512)
def translate(sql: str, bound: bool) -> str:
    """`sql` (SQLite's dialect, as this project writes it) in PostgreSQL's; `bound`:
    parameters are passed, so `%` is escaped and `?` becomes `%s`."""
    head = sql.lstrip()[:20].upper()
    if head.startswith("BEGIN"):
        return "BEGIN"
    m = _INSERT.match(sql)
    if m is not None:
        mode, table, cols = m.group(1).upper(), m.group(2), m.group(3)
        sql = "INSERT INTO " + sql[m.start(2) :]
        if mode == "IGNORE":
            sql += " ON CONFLICT DO NOTHING"
        else:
            key = PRIMARY_KEYS[table]
            names = [c.strip() for c in cols.split(",") if c.strip() not in key]
            sets = ", ".join(f"{c} = EXCLUDED.{c}" for c in names)
            sql += f" ON CONFLICT ({', '.join(key)}) DO UPDATE SET {sets}"
    if bound:
        sql = sql.replace("%", "%%").replace("?", "%s")
    return sql


def ddl(script: str) -> str:
    """SQLite DDL with PostgreSQL's types."""
    script = re.sub(r"\bREAL\b", "DOUBLE PRECISION", script)
    script = re.sub(r"\bINTEGER\b", "BIGINT", script)
    return re.sub(r"\bBLOB\b", "BYTEA", script)


def _errors() -> tuple[Any, Any, Any, Any]:
    import psycopg
    from psycopg import errors

    return psycopg.Error, errors.IntegrityError, psycopg.OperationalError, errors.DataError


def _first(exc: Exception) -> str:
    """The first line of a psycopg error (libpq's messages name hosts, not passwords)."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _where(dsn: str) -> str:
    """host:port/database of a URI, for messages."""
    from psycopg.conninfo import conninfo_to_dict

    try:
        d = conninfo_to_dict(dsn)
    except Exception:
        return "(an unreadable URI)"
    return f"at {d.get('host', 'localhost')}:{d.get('port', 5432)}/{d.get('dbname', '')}"


def _as_sqlite(exc: Exception) -> Exception:
    _, integrity, operational, data = _errors()
    message = _first(exc)
    if isinstance(exc, data) and "NUL" in message:  # psycopg refuses it before sending
        return UnstorableValue()
    if getattr(exc, "sqlstate", None) == "54000":  # program_limit_exceeded: an index
        # entry too large (an OperationalError in psycopg, but no outage: the same
        # row fails the same way every time)
        return UnstorableValue(TOO_LONG_MESSAGE)
    if isinstance(exc, integrity):
        return sqlite3.IntegrityError(message)
    if isinstance(exc, operational):
        return sqlite3.OperationalError(message)
    if isinstance(exc, data):  # a value of the statement's, not the database
        return OverflowError(message) if "out of range" in message else sqlite3.DataError(message)
    return sqlite3.DatabaseError(message)


class PgConnection:
    """The part of `sqlite3.Connection` the stores use, over one psycopg connection."""

    def __init__(self, dsn: str, connect_timeout_s: float = 10.0) -> None:
        import psycopg
        from psycopg.adapt import Dumper
        from psycopg.pq import Format

        class _BoolAsInt(Dumper):  # the schema's flags are integers, as in SQLite
            format = Format.TEXT
            oid = psycopg.adapters.types["int8"].oid

            def dump(self, obj: Any) -> bytes:
                return b"1" if obj else b"0"

        self.dsn = dsn
        self._timeout = max(1, int(connect_timeout_s))
        self._dumper = _BoolAsInt
        self._conn = self._open()
        self.row_factory: Any = None  # set by callers for sqlite3; rows are Row here

    def _open(self) -> Any:
        import psycopg

        try:
            conn = psycopg.connect(
                self.dsn, autocommit=True, row_factory=_row_factory, connect_timeout=self._timeout
            )
        except psycopg.Error as exc:
            raise StoreUnavailable(
                f"PostgreSQL {_where(self.dsn)} is unreachable: {_first(exc)}"
            ) from None
        conn.adapters.register_dumper(bool, self._dumper)
        return conn

    def _live(self) -> Any:
        """The connection, opened again when the last one broke (the server restarted
        or the network dropped): the statement that found it broken failed, the next
        one reconnects (a transaction it was in went with it)."""
        if self._conn.closed or self._conn.broken:
            self._conn = self._open()
        return self._conn

    def execute(self, sql: str, params: Sequence[Any] | None = ()) -> Any:
        bound = bool(params)
        try:
            return self._live().execute(translate(sql, bound), params if bound else None)
        except Exception as exc:
            if isinstance(exc, _errors()[0]):
                raise _as_sqlite(exc) from None
            raise

    def executemany(self, sql: str, seq: Iterable[Sequence[Any]]) -> Any:
        rows = list(seq)
        cur = self._live().cursor()
        if not rows:
            return cur
        try:
            cur.executemany(translate(sql, True), rows)
        except Exception as exc:
            if isinstance(exc, _errors()[0]):
                raise _as_sqlite(exc) from None
            raise
        return cur

    def executescript(self, script: str) -> Any:
        """Statements without parameters, DDL included (its types translated)."""
        return self.execute(ddl(script), None)

    @property
    def in_transaction(self) -> bool:
        from psycopg.pq import TransactionStatus

        return self._conn.info.transaction_status != TransactionStatus.IDLE

    def commit(self) -> None:
        if self.in_transaction:
            self.execute("COMMIT", None)

    def close(self) -> None:
        self._conn.close()

    @staticmethod
    def safe_row(row: tuple[Any, ...]) -> tuple[Any, ...]:
        """`row` with integers beyond BIGINT held at its bounds (SQLite keeps them as
        text; a BIGINT column cannot)."""
        hi = 2**63 - 1
        return tuple(
            max(-hi, min(hi, v)) if isinstance(v, int) and not -hi <= v <= hi else v for v in row
        )


def connect(dsn: str) -> PgConnection:
    """A connection with the schema in place (made once per process and database)."""
    conn = PgConnection(dsn)
    if dsn not in _made:
        with _made_lock:
            if dsn not in _made:
                make_schema(conn)
                _made.add(dsn)
    return conn


def make_schema(conn: PgConnection) -> None:
    from switchyard.state.sql import (
        IDEMPOTENCY_SCHEMA,
        LATE_INDEXES,
        MIGRATIONS,
        SCHEMA,
        USAGE_DAILY,
    )

    conn.execute(f"SELECT pg_advisory_lock({_LOCK_ID})", None)
    try:
        conn.executescript(SCHEMA)
        conn.executescript(IDEMPOTENCY_SCHEMA)
        for table, column, kind in MIGRATIONS:
            conn.executescript(f"ALTER TABLE {table} ADD COLUMN IF NOT EXISTS {column} {kind}")
        conn.executescript(LATE_INDEXES)
        conn.executescript(
            USAGE_DAILY.replace("CREATE TABLE ", "CREATE TABLE IF NOT EXISTS ").replace(
                "CREATE INDEX ", "CREATE INDEX IF NOT EXISTS "
            )
        )
    finally:
        conn.execute(f"SELECT pg_advisory_unlock({_LOCK_ID})", None)
