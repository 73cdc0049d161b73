"""One worker process of `switchyard serve --workers N` (started by scale/workers.py).

The supervisor writes the worker's spec down its stdin (JSON, then EOF): the config
file, the worker's number, the Redis URL, the control plane's internal URL and token,
and the shared ledger writer's socket. Nothing of it is on the command line or in the
environment of other processes. The worker then:

- builds the gateway with the worker's settings (`worker_settings`: local engines are
  the control plane's engine front, shared state in Redis) and role (config/process.py);
- listens on the gateway's port with its own `SO_REUSEPORT` socket, so the kernel
  spreads new connections over the workers evenly (uvicorn's `--workers` shares one
  listening socket, where whichever process wakes first takes the connection);
- says `ready` on stdout once serving, and stops when the supervisor does (SIGTERM, or
  its parent gone);
- keeps its in-flight journal (`InFlight`): every request it opened whose usage row
  the ledger writer has not committed yet, in a file the supervisor reads should the
  worker die, so that each such request gets its row (scale/workers.py); it holds an
  exclusive `flock` on that file for its whole life, so that a supervisor (its own, or
  the next one started on the home after both died) bills only a dead worker's journal
  (`claim_journal`).

    python -m switchyard.scale.worker   (spec on stdin)
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import logging
import mmap
import os
import signal
import socket
import sys
import threading
import time
from collections import deque
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orjson

from switchyard import outcomes
from switchyard.execute.executor import MAY_HAVE_GENERATED

if TYPE_CHECKING:
    from switchyard.pipeline_context import RequestContext
    from switchyard.state.ledger import UsageLedger
    from switchyard.state.ledger_rows import Finished

READY_LINE = "switchyard-worker-ready"
log = logging.getLogger("switchyard.workers")

# The in-flight journal: fixed slots of SLOT bytes, each a 4-byte little-endian head
# (0: free; else the length of the text, its top bit the half of the slot that holds
# it) and two halves of HALF bytes, each room for one JSON text (`InFlight`).
SLOT = 2048
HALF = (SLOT - 4) // 2
_TOP = 1 << 31
REFRESH_S = 0.2  # how often the open requests' model and stream are written again
_ATTEMPT_OK = outcomes.Attempt.OK


def journal_path(run_dir: str | Path, worker: str) -> Path:
    """Where worker `worker` (its name: `worker_name`) keeps its in-flight journal."""
    return Path(run_dir) / "inflight" / worker


class InFlight:
    """The requests of this worker whose usage row is not committed yet, in a file
    mapped into memory (`journal_path`): what the supervisor bills should the worker
    die before their rows are in the ledger (`read_journal`, scale/workers.py).

    A request is written into a free slot when it opens (`opened`, the request
    service's `on_open`: its ids, tenant, key, endpoint, arrival), again when its row is
    queued (`recorded`, the ledger's `on_record`: its status, tokens and cost), and its
    slot is freed once the ledger writer has answered the flush that covers that row
    (`UsageLedger.queued_flush`, checked as later requests open and every REFRESH_S).
    Every REFRESH_S the model, stream and reservation of the requests still open are
    written again if they changed (an alias is known only once the body is read, a
    reservation once the request's cost is planned, and it grows with each further
    upstream call after one that may have been billed: `billed_calls`). All of it is
    memory writes, no system call per request; after a SIGKILL the kernel keeps the file's
    pages, and the supervisor reads them. A text is written into the half of its slot
    not in use, then the head names it: a worker killed mid-write leaves the slot's
    earlier text, or none. With every slot taken, a request goes unjournaled (counted
    in `full`, logged once)."""

    def __init__(self, path: Path, slots: int, ledger: UsageLedger) -> None:
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.path = path
        self._ledger = ledger
        # Locked for the worker's whole life (the kernel drops the lock when it dies):
        # a supervisor bills only a journal it can lock (`claim_journal`). One that
        # claimed the file between its creation and this lock removed it: made again.
        while True:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
                if os.fstat(fd).st_nlink:
                    os.ftruncate(fd, 0)
                    os.ftruncate(fd, slots * SLOT)
                    self._map = mmap.mmap(fd, slots * SLOT)
                    break
            except BaseException:
                os.close(fd)
                raise
            os.close(fd)
        self._fd = fd
        self._free = list(range(slots - 1, -1, -1))  # the lowest first: few pages touched
        # request id -> [slot, its context, what of it was written (`_known`)]
        self._open: dict[str, list[Any]] = {}
        self._recorded: deque[tuple[int, int]] = deque()  # (flush number, slot)
        self.full = 0
        self._refresher: asyncio.Task[None] | None = None

    def _write(self, slot: int, text: bytes) -> None:
        n = len(text)
        if n > HALF:
            return  # ids are bounded far below (128 characters each); kept as it was
        m, off = self._map, slot * SLOT
        half = 0 if m[off + 3] & 0x80 else 1  # the other one
        at = off + 4 + half * HALF
        m[at : at + n] = text
        m[off : off + 4] = (n | _TOP * half).to_bytes(4, "little")

    def _clear(self, slot: int) -> None:
        off = slot * SLOT
        self._map[off : off + 4] = b"\0\0\0\0"
        self._free.append(slot)

    @staticmethod
    def _facts(ctx: RequestContext, done: list[Any] | None) -> bytes:
        i, p, cost, model = ctx.input, ctx.principal, ctx.cost, ctx.model
        # What admission reserves for it, once its cost is planned (the window stage),
        # for each upstream call that may have been billed (`billed_calls`): the most
        # it may use, billed should it die mid-way with nothing settled.
        if cost is None or model is None:
            reserved = None
        else:
            n = billed_calls(ctx)
            reserved = [cost.prompt * n, cost.output * n, cost.usd(model.price) * n, n]
        return orjson.dumps(
            [
                *(i.request_id, i.client_request_id, i.task_id, p.tenant_id, p.key_id),
                *(i.called, ctx.alias, i.received_at, ctx.stream, done, reserved),
            ]
        )

    @staticmethod
    def _known(ctx: RequestContext) -> tuple[Any, ...]:
        """What the journal says of an open request that can change as it runs (the
        calls it may be billed change only as a call starts: `billed_calls`)."""
        return (
            ctx.alias,
            ctx.stream,
            ctx.cost is not None and ctx.model is not None,
            ctx.run.attempts,
        )

    def opened(self, ctx: RequestContext) -> None:
        """A request opened: its slot holds it until its row is committed."""
        self._commits(read=False)
        if not self._free:
            self.full += 1
            if self.full == 1:
                log.error("in-flight journal full: requests go unjournaled (%s)", self.path)
            return
        slot = self._free.pop()
        self._open[ctx.input.request_id] = [slot, ctx, self._known(ctx)]
        self._write(slot, self._facts(ctx, None))
        if self._refresher is None:
            with contextlib.suppress(RuntimeError):  # no loop: none to refresh on
                self._refresher = asyncio.get_running_loop().create_task(self._refresh())

    def recorded(self, finished: Finished) -> None:
        """The request's row is queued: its slot says what it used, until committed."""
        ctx = finished.ctx
        held = self._open.pop(ctx.input.request_id, None)
        if held is None:  # not journaled (full), or not opened by the request service
            return
        slot = held[0]
        done = [finished.status, finished.input_tokens, finished.output_tokens, finished.cost_usd]
        self._write(slot, self._facts(ctx, done))
        self._recorded.append((self._ledger.queued_flush(), slot))

    def _commits(self, read: bool) -> None:
        """Free the slots of rows the writer has committed (`read`: read its answers
        waiting first, a system call; else only those the ledger has read)."""
        recorded, committed = self._recorded, self._ledger.committed
        while recorded and committed(recorded[0][0], read):
            self._clear(recorded.popleft()[1])

    async def _refresh(self) -> None:
        """Every REFRESH_S: free what is committed, write again what changed; ends
        when nothing is left (the next request opened starts it again)."""
        try:
            while self._open or self._recorded:
                await asyncio.sleep(REFRESH_S)
                self._commits(read=True)
                for held in self._open.values():
                    slot, ctx, written = held
                    now = self._known(ctx)
                    if now != written:
                        held[2] = now
                        self._write(slot, self._facts(ctx, None))
        finally:
            self._refresher = None

    def close(self) -> None:
        """At a clean exit: the file goes when every row in it is committed; otherwise
        it stays, for the supervisor."""
        if self._refresher is not None:
            self._refresher.cancel()
        self._commits(read=True)
        empty = not self._open and not self._recorded
        self._map.close()
        if empty:
            with contextlib.suppress(OSError):
                self.path.unlink()
        os.close(self._fd)  # the lock goes: the journal is the supervisors' now


def billed_calls(ctx: RequestContext) -> int:
    """The upstream calls of a request that may have been billed should its worker die
    now, as settle.py would bill them had the request been cancelled: each
    non-streamed call cut while the upstream had it (timed out, broke off:
    `MAY_HAVE_GENERATED`), the one under way (counted in `run.attempts`, not yet
    recorded) and one that answered; at least one, the reservation (a stream, a
    request's first call). Each extension of its reservation (`Reserver.extend`)
    paid for one of them before the call after it was made."""
    run = ctx.run
    if ctx.stream or run.attempts < 2:
        return 1
    cut = recorded = answered = 0
    for d in ctx.decisions:
        evidence = d.evidence
        if d.stage != "attempt" or evidence is None or "attempt" not in evidence:
            continue  # a skip (breaker open, no time left) called nothing
        recorded += 1
        if evidence.get("class") in MAY_HAVE_GENERATED:
            cut += 1
        elif d.outcome == _ATTEMPT_OK:
            answered = 1
    return max(1, cut + answered + (1 if recorded < run.attempts else 0))


def read_journal(path: Path) -> Iterator[list[Any]]:
    """The requests a dead worker's journal holds: [request id, client request id,
    task id, tenant, key, endpoint, model, received_at, stream, done, reserved], `done`
    None for a request still open, else [status, input tokens, output tokens, cost];
    `reserved` None before its cost is planned, else [prompt tokens, output tokens,
    cost, calls]: what it reserved for each call that may have been billed
    (`billed_calls`), times their number."""
    try:
        data = path.read_bytes()
    except OSError:
        return
    yield from journal_records(data)


def journal_records(data: bytes) -> Iterator[list[Any]]:
    """`read_journal` of a journal's bytes `data` (a record of 10 members is one an
    earlier version wrote, without its reservation)."""
    for off in range(0, len(data) - SLOT + 1, SLOT):
        head = int.from_bytes(data[off : off + 4], "little")
        n = head & (_TOP - 1)
        if not 0 < n <= HALF:
            continue
        at = off + 4 + (HALF if head & _TOP else 0)
        try:
            rec = orjson.loads(data[at : at + n])
        except orjson.JSONDecodeError:
            continue
        if isinstance(rec, list) and len(rec) in (10, 11) and isinstance(rec[0], str):
            yield rec


class JournalBusy(Exception):
    """A journal whose lock another process holds: its worker lives (or another
    supervisor is billing it)."""


class Claim:
    """A dead worker's journal, locked by this process (`claim_journal`): its
    `records` (`read_journal`), held until `close`."""

    def __init__(self, path: Path, fd: int, data: bytes) -> None:
        self.path = path
        self.name = path.name
        self.records = list(journal_records(data))
        self._fd: int | None = fd

    def close(self, billed: bool) -> None:
        """Let go of the journal: removed first when `billed` (its rows committed),
        else kept for the next supervisor to bill."""
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        try:
            if billed:
                with contextlib.suppress(OSError):
                    self.path.unlink()
        finally:
            os.close(fd)


def claim_journal(path: Path) -> Claim | None:
    """The journal at `path` (`journal_path`), if its worker is dead for sure: a
    worker holds an exclusive `flock` on its journal for its whole life, so a journal
    this process can lock (without waiting) is no live worker's, whatever its pid
    says now (pids are reused). The lock is kept until the `Claim` is closed, so no
    other supervisor bills it meanwhile. None when there is no journal there (never
    made, removed at a clean exit, or billed and removed by another supervisor, also
    between this open and this lock: the file locked must still be the one at
    `path`). Raises JournalBusy when another process holds its lock."""
    try:
        fd = os.open(path, os.O_RDWR)
    except FileNotFoundError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise JournalBusy(str(path)) from None
        held = os.fstat(fd)
        try:
            now = os.stat(path)
        except FileNotFoundError:
            now = None
        same = now is not None and (now.st_dev, now.st_ino) == (held.st_dev, held.st_ino)
        if not held.st_nlink or not same:
            os.close(fd)
            return None
        data = bytearray()
        while chunk := os.pread(fd, 1 << 20, len(data)):
            data += chunk
        return Claim(path, fd, bytes(data))
    except BaseException:
        with contextlib.suppress(OSError):
            os.close(fd)
        raise


def reuseport_socket(host: str, port: int) -> socket.socket:
    """A listening socket on (host, port) that other workers' sockets share."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def _die_with_parent(parent: int) -> None:
    """Stop (as on SIGTERM) when the supervisor is gone: a worker never outlives it."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def main() -> int:
    import uvicorn

    from switchyard.api.app import create_app
    from switchyard.api.server import uvicorn_options
    from switchyard.config import ProcessRole, load_settings
    from switchyard.scale.serve_config import ENGINE_TOKEN_ENV
    from switchyard.scale.workers import worker_name, worker_settings

    spec: dict[str, Any] = json.loads(sys.stdin.buffer.read())
    _die_with_parent(os.getppid())
    logging.basicConfig(
        level=os.environ.get("SWITCHYARD_LOG_LEVEL", "INFO"),
        format=f"%(asctime)s %(levelname)s %(name)s [w{spec['index']}]: %(message)s",
    )
    # The control plane's engine front takes this token (the remote engines read it).
    os.environ[ENGINE_TOKEN_ENV] = spec["token"]
    settings = worker_settings(
        load_settings(spec["config"]), spec["control_url"], spec["redis_url"], spec["workers"]
    )
    role = ProcessRole(
        "worker",
        worker_name(int(spec["index"]), os.getpid(), spec.get("run", "")),
        int(spec["index"]),
        spec["control_url"],
        spec["token"],
        spec.get("ledger_socket"),
    )
    app = create_app(settings, role=role)
    journal = None
    if spec.get("run_dir"):
        gateway = app.state.gateway
        slots = max(1024, 2 * settings.server.max_connections)
        journal = InFlight(journal_path(spec["run_dir"], role.name), slots, gateway.ledger)
        gateway.service.on_open = journal.opened
        gateway.ledger.on_record = journal.recorded
    sock = reuseport_socket(spec["host"], int(spec["port"]))
    server = uvicorn.Server(uvicorn.Config(app, **uvicorn_options(settings.server)))

    def announce() -> None:
        while not server.started and not server.should_exit:
            time.sleep(0.05)
        if server.started:
            print(READY_LINE, flush=True)

    threading.Thread(target=announce, name="ready", daemon=True).start()
    try:
        server.run(sockets=[sock])
    finally:
        if journal is not None:
            journal.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
