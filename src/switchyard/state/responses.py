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

Background responses belong to the gateway process that accepted them (`owner`: its
host, process id and a random part, `instance_name`, never the same twice) and hold a
lease on their row (`lease_until`) that their owner renews while it runs them: one
UPDATE per process every third of `responses.lease_s`, for all its rows (`renew`). A
row whose lease has lapsed, or whose owner was a process of this host that no longer
exists, has nothing running it: any gateway on the store fails it, saying why
(ORPHAN_REASON), at its start and every `responses.lease_s` (`fail_orphans`, `sweep`),
or when it reads it (`get`); `active_background` does not count it. A gateway that
stops fails its own first (`abandon`), its work cancelled, not blamed on the upstream.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import hashlib
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
# The cancel message of a background response's work cut by its gateway's stop
# (`abandon`): it is failed with ORPHAN_REASON, not stored as the client's cancel.
STOPPING = "the gateway is stopping"
LEASE_S = 15.0  # responses.lease_s's default
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


def _pid_scope() -> str:
    """This kernel's boot and this process's pid namespace, as 8 hex digits: processes
    with the same scope see each other's process ids. '' where it is not known (not
    Linux): no owner is then judged by its process id, only by its lease."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text(encoding="ascii").strip()
        space = os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""
    return hashlib.sha256(f"{boot} {space}".encode()).hexdigest()[:8]


_SCOPE = _pid_scope()


def instance_name(port: int | None = None) -> str:
    """This gateway process as an owner of background responses, never the same twice:
    `host:pid:scope:random` (a restarted gateway, another port or a worker of several
    is another owner; `port` is not part of it and kept for callers that pass one)."""
    return f"{socket.gethostname()}:{os.getpid()}:{_SCOPE}:{secrets.token_hex(4)}"


def owner_gone(owner: str | None) -> bool:
    """Whether `owner` was a process of this kernel and pid namespace that exists no
    more (killed, crashed, stopped): then nothing runs its responses, whatever their
    lease says. False when it cannot be told (another host or namespace, an older
    owner name, a process id in use again): its lease decides."""
    parts = (owner or "").split(":")
    if len(parts) != 4 or not _SCOPE or parts[2] != _SCOPE or not parts[1].isdigit():
        return False
    pid = int(parts[1])
    if pid == os.getpid():
        return False  # this process (another store of it): alive
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:  # another user's process: it exists
        return False
    try:  # a zombie (dead, not yet reaped) runs nothing
        stat_line = Path(f"/proc/{pid}/stat").read_text(encoding="ascii", errors="replace")
    except OSError:
        return True  # gone between the two looks
    return stat_line.rpartition(")")[2].split()[:1] == ["Z"]


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
    " background, owner, body, updated_at, lease_until"
)
# A row's lease: until `lease_until`, renewed by its owner; a row not renewed yet (just
# inserted by the ledger's writer) holds one of the judge's `lease_s` from its write.
_LEASE = "COALESCE(lease_until, updated_at + ?)"
_IN_FLIGHT = "status IN ('queued', 'in_progress')"


def add_lease_column(conn: sqlite3.Connection) -> None:
    """The `lease_until` column, added to a database made before it (SQLite, or
    PostgreSQL through state/sql_pg.py), once; another process adding it first wins."""
    if isinstance(conn, sqlite3.Connection):
        have = {row[1] for row in conn.execute("PRAGMA table_info(responses)")}
        if "lease_until" not in have:
            with contextlib.suppress(sqlite3.OperationalError):  # another process won
                conn.execute("ALTER TABLE responses ADD COLUMN lease_until REAL")
        return
    found = conn.execute(
        "SELECT 1 FROM information_schema.columns WHERE table_schema = current_schema()"
        " AND table_name = 'responses' AND column_name = 'lease_until'"
    ).fetchone()
    if found is None:
        conn.executescript("ALTER TABLE responses ADD COLUMN IF NOT EXISTS lease_until REAL")


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

    def hold(self, r: StoredResponse, work: asyncio.Future[Any]) -> None: ...

    async def renew(self) -> int: ...

    async def sweep(self) -> int: ...

    async def abandon(self, timeout_s: float = 5.0) -> int: ...


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
        lease_s: float = LEASE_S,
    ) -> None:
        self.conn = conn
        self.sealer = sealer
        self.owner = owner
        self.retention_s = retention_days * 86400
        self.lease_s = lease_s
        """How long a background row stays this owner's without a renewal
        (`responses.lease_s`): renewed every third of it; judged by it on rows not
        renewed yet."""
        self.conn.executescript(RESPONSES_SCHEMA)
        add_lease_column(self.conn)
        # This process's background responses running here, and their work: their
        # leases renewed (`renew`), cut at a stop (`abandon`).
        self._held: dict[tuple[str, str], asyncio.Future[Any]] = {}
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
        found is looked for again for that long (another gateway's recent response).
        One committed meanwhile is read from the database (`_prune` first): the byte
        budget or a retention pass may have deleted it there, and it is then gone here
        too, as after a restart, never served from this process's memory alone."""
        self._prune()
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
        sharing the database (what `responses.max_background_per_tenant` caps): this
        owner's, and others' that still run (a lapsed lease or a process of this host
        that is gone runs nothing: such a row is failed, not counted)."""
        return await self._run("the background responses", self._active, tenant_id)

    def hold(self, r: StoredResponse, work: asyncio.Future[Any]) -> None:
        """`r`, stored and committed, runs here as `work` until that ends: its lease is
        renewed with this owner's others, and a stop cuts it (`abandon`)."""
        key = (r.tenant_id, r.id)
        self._held[key] = work
        work.add_done_callback(lambda _: self._held.pop(key, None))

    async def renew(self) -> int:
        """Renew the leases of this owner's background rows in flight, all in one
        UPDATE (none while nothing runs here): they stay this owner's for `lease_s`
        more. Returns how many rows it renewed."""
        if not self._held:
            return 0
        return await self._run("renewing background leases", self._renew, time.time())

    async def sweep(self) -> int:
        """Fail other owners' orphans (`fail_orphans`' second half), off the event loop:
        what crashed or stopped elsewhere since this gateway started."""
        return await self._run("failing orphaned responses", self._fail_others, time.time())

    async def abandon(self, timeout_s: float = 5.0) -> int:
        """At a stop, before the upstream clients close: this process's background
        responses still running are cut (their work cancelled with STOPPING: the
        upstream call stops, the request is recorded cancelled, the response stored
        failed with ORPHAN_REASON by its work), then whatever of this owner's is still
        in flight is failed here with that reason. Returns how many rows this failed."""
        work = list(self._held.values())
        for w in work:
            w.cancel(STOPPING)
        if work:
            await asyncio.wait(work, timeout=timeout_s)
        return await self._run("failing this gateway's responses", self._fail_own)

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
        row = self._select(tenant_id, rid, now)
        if row is None:
            return None
        if row["background"] and row["status"] in IN_FLIGHT and self._orphaned(row, now):
            self._fail([row], now, with_body=True)  # nothing runs it: failed now, and read as such
            row = self._select(tenant_id, rid, now)
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

    def _select(self, tenant_id: str, rid: str, now: float) -> Any:
        with self._lock:
            return self.conn.execute(
                f"SELECT {_COLUMNS} FROM responses WHERE tenant_id = ? AND id = ?"
                " AND created_at >= ?",
                (tenant_id, rid, now - self.retention_s),
            ).fetchone()

    def _orphaned(self, row: Any, now: float) -> bool:
        """Whether nothing runs another owner's row in flight: its lease lapsed, or its
        owner was a process of this host that is gone."""
        if row["owner"] == self.owner:
            return False
        lease = row["lease_until"]
        until = float(lease) if lease is not None else float(row["updated_at"]) + self.lease_s
        return until < now or owner_gone(row["owner"])

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
        """Its background rows in flight (a few: at most the cap, through a partial
        index) less those nothing runs, which are failed here: the place a crashed
        gateway held is free as soon as this tenant asks for one."""
        now = time.time()
        with self._lock:
            rows = self.conn.execute(
                "SELECT tenant_id, id, owner, lease_until, updated_at FROM responses"
                f" WHERE tenant_id = ? AND background = 1 AND {_IN_FLIGHT}",
                (tenant_id,),
            ).fetchall()
        orphans = [row for row in rows if self._orphaned(row, now)]
        return len(rows) - (self._fail(orphans, now) if orphans else 0)

    def _renew(self, now: float) -> int:
        with self._lock:
            cur = self.conn.execute(
                f"UPDATE responses SET lease_until = ? WHERE owner = ? AND {_IN_FLIGHT}",
                (now + self.lease_s, self.owner),
            )
        return max(cur.rowcount, 0)

    def fail_orphans(self) -> int:
        """At start: background responses in flight that nothing runs are failed, their
        response saying why (ORPHAN_REASON): this owner's (a store given the owner
        name of an earlier run) and other owners' whose lease lapsed or whose process
        on this host is gone. Others' live rows are theirs. Returns how many."""
        now = time.time()
        failed = self._fail_own() + self._fail_others(now)
        if failed:
            log.warning("%d response(s) in flight at a gateway's stop were marked failed", failed)
        return failed

    def _fail_own(self) -> int:
        with self._lock:
            rows = self.conn.execute(
                f"SELECT tenant_id, id, owner, body FROM responses WHERE owner = ? AND {_IN_FLIGHT}",
                (self.owner,),
            ).fetchall()
        return self._fail(rows, None, with_body=True)

    def _fail_others(self, now: float) -> int:
        with self._lock:
            rows = self.conn.execute(
                "SELECT tenant_id, id, owner, lease_until, updated_at FROM responses"
                f" WHERE background = 1 AND {_IN_FLIGHT} AND owner <> ?",
                (self.owner,),
            ).fetchall()
        return self._fail([row for row in rows if self._orphaned(row, now)], now)

    def _fail(self, rows: list[Any], now: float | None, with_body: bool = False) -> int:
        """Fail `rows` (tenant_id, id, owner; body `with_body`) with ORPHAN_REASON, each only
        if still in flight under the same owner and, with `now` and an owner that may be
        alive, its lease still lapsed then (an owner renewing meanwhile keeps it)."""
        failed = 0
        for row in rows:
            tenant_id, rid, owner = row["tenant_id"], row["id"], row["owner"]
            sealed = row["body"] if with_body else None
            if sealed is None:  # read only for the rows failed (a conversation may be large)
                with self._lock:
                    found = self.conn.execute(
                        "SELECT body FROM responses WHERE tenant_id = ? AND id = ?",
                        (tenant_id, rid),
                    ).fetchone()
                if found is None:
                    continue
                sealed = found["body"]
            try:
                body = self.sealer.open(tenant_id, rid, sealed)
            except SealError as exc:  # its status column still says it failed
                log.warning("an orphaned response's body was left as it was: %s", exc)
                blob = bytes(sealed)
            else:
                response = body.get("response")
                if not isinstance(response, dict):
                    response = body["response"] = {}
                response["status"] = "failed"
                response["error"] = {"code": "server_error", "message": ORPHAN_REASON}
                blob = self.sealer.seal(tenant_id, rid, body)
            sql = (
                "UPDATE responses SET status = 'failed', body = ?, updated_at = ?"
                f" WHERE tenant_id = ? AND id = ? AND owner = ? AND {_IN_FLIGHT}"
            )
            args: tuple[Any, ...] = (blob, time.time(), tenant_id, rid, owner)
            if now is not None and not owner_gone(owner):
                sql += f" AND {_LEASE} < ?"
                args += (self.lease_s, now)
            with self._lock:  # only if still in flight so (not finished meanwhile)
                cur = self.conn.execute(sql, args)
            failed += max(cur.rowcount, 0)
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
