"""The ledger's writer process: commits batches of usage rows and traces to SQLite.

The gateway serialises each batch once, on its event loop, and writes it down a pipe;
everything after that (parsing, binding, SQLite, the WAL's disk writes) happens here,
in another process. A writer thread in the gateway's own process cost the event loop
more than its share of the CPU: every SQLite call released and re-took the GIL, so the
loop and the writer handed it back and forth several times per request (~3.5 futex
calls per request at one client; none with the ledger off).

Frames: one kind byte, a 4-byte big-endian length, the payload.
- `B`: a `traces.LedgerBatch` as JSON: `entries`, one `LedgerEntry` (a flat array) per
  request, each made into its usage row and, unless its decisions are null, its trace
  record, all committed in one transaction; `blocks`, the templates of the folded runs
  of decisions those entries refer to (`traces.expand_decisions`); `responses`, the
  stored responses (sealed) made meanwhile, inserted in the same transaction.
- `A`: a `B` sent again after a writer died (shared writer only): the dead one may have
  committed it, so its rows already present add nothing to the daily sums
  (state/ledger_batch.py says why that is exact).
- `F`: an 8-byte sequence number: answered (the same frame) once everything before it
  is committed.
- `K`: the 32-byte key stored responses are sealed with (state/sealing.py), the
  first frame of a gateway that stores responses; never on a command line or in an
  environment.
- `S` (or end of input): commit what came before, then exit (shared: close that
  gateway's connection).

Two ways to run it:

    python -m switchyard.observe.ledger_writer PATH [MAX_BYTES]
    python -m switchyard.observe.ledger_writer --listen SOCKET PATH [MAX_BYTES]

The first is one gateway process's own writer: frames on stdin, answers on stdout
(state/ledger.py starts it). The second is the one writer for every gateway process of
a host (`serve --workers N`): the control plane starts it (`ledger.spawn_shared_writer`)
and it listens on the Unix socket SOCKET (mode 0600), each gateway process connected
with its own frames, answers and key. It writes `R` on stdout once it listens and lives
as long as its stdin: when its owner closes it (or dies), it closes every connection
and exits; the gateways send what it had not answered to its successor. One process,
one connection to the database, one batch at a time: N gateways never mean N writers
contending for SQLite's lock. Frames are read from every connection as they come (at
most `_RECV` bytes of one connection before the next), so a busy gateway does not hold
back the others' acknowledgements for long.

PATH `-` reads the database from SWITCHYARD_LEDGER_DB (a PostgreSQL URI is passed so,
not on the command line, which every user of the machine can read).
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import selectors
import signal
import socket
import sqlite3
import stat
import sys
import time
from typing import BinaryIO

from switchyard.state.ledger_batch import (
    AGAIN,
    BATCH,
    DROPPED,
    FLUSH,
    HEADER,
    KEY,
    READY,
    STOP,
    decode_batch,
    flushed,
    frame,
    read_frame,
    write_batch,
)
from switchyard.state.sealing import Sealer
from switchyard.state.sql import connect, is_sqlite
from switchyard.state.traces import enforce_disk

log = logging.getLogger("switchyard.ledger")

# How long a batch waits for a database that cannot be reached before it is dropped.
OUTAGE_S = 30.0
# How often the writer checks the byte budget (observe.max_disk_mb) between batches.
DISK_CHECK_S = 0.5


class _Writer:
    """The writer's one connection to the database and what a batch does to it."""

    def __init__(self, path: str, max_bytes: int) -> None:
        self.conn = connect(path)
        self._sqlite = is_sqlite(self.conn)
        self._max_bytes = max_bytes
        self._checked = 0.0

    def commit(self, payload: bytes, sealer: Sealer | None, again: bool = False) -> int:
        """Commit one batch frame; the rows of it dropped (`ledger_batch.DROPPED`: the
        database refused them). With a byte budget, the writer keeps the file under
        it as it writes (`traces.enforce_disk`, at most every DISK_CHECK_S): it is the
        one process that adds rows, so the budget holds within a fraction of a second
        of load instead of growing until the gateway's next retention pass."""
        batch = decode_batch(payload)
        before = DROPPED[0]
        if batch is not None:
            write_batch(self.conn, batch, sealer, again)
        now = time.monotonic()
        # PostgreSQL's budget counts rows (COUNT(*)): the gateways' retention
        # pass checks it, every observe.retention_interval_s.
        if self._max_bytes and self._sqlite and now - self._checked >= DISK_CHECK_S:
            self._checked = now
            try:
                enforce_disk(self.conn, self._max_bytes)
            except sqlite3.Error as exc:  # the next check tries again
                log.warning("byte budget not enforced: %s", exc)
        return DROPPED[0] - before


def serve(path: str, source: BinaryIO, acks: BinaryIO, max_bytes: int = 0) -> None:
    """Commit batches until the end of the input (one gateway process's own writer).
    `max_bytes`: the byte budget (`_Writer.commit`)."""
    writer = _Writer(path, max_bytes)
    sealer: Sealer | None = None
    lost = 0  # rows of this gateway's the database refused: told with each answer
    try:
        while True:
            got = read_frame(source)
            if got is None or got[0] == STOP:
                return
            kind, payload = got
            if kind == BATCH:
                lost += writer.commit(payload, sealer)
            elif kind == KEY:
                sealer = Sealer(payload)
            elif kind == FLUSH:
                acks.write(frame(FLUSH, flushed(payload, lost)))
                acks.flush()
    finally:
        writer.conn.close()


# -- the shared writer ------------------------------------------------------------------
_RECV = 1 << 20  # bytes read from one connection before the next one's turn


class _Client:
    """One gateway process's connection: what it sent that is not a whole frame yet,
    the answers it has not taken yet, and the key its stored responses are sealed with."""

    __slots__ = ("inbox", "lost", "outbox", "sealer", "sock")

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.inbox = bytearray()
        self.outbox = bytearray()
        self.sealer: Sealer | None = None
        self.lost = 0  # its rows the database refused (`flushed`)


def listen(socket_path: str) -> socket.socket:
    """A listening Unix socket at `socket_path`, mode 0600 from its creation (the umask
    is this process's own). A socket left by a writer that was killed is replaced; one a
    live writer listens on is not (two writers would split the gateways between them)."""
    with contextlib.suppress(FileNotFoundError):
        if stat.S_ISSOCK(os.stat(socket_path).st_mode):
            probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                probe.connect(socket_path)
            except ConnectionRefusedError:
                os.unlink(socket_path)  # nobody listens: a dead writer's
            else:
                raise SystemExit(f"a ledger writer already listens on {socket_path}")
            finally:
                probe.close()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    umask = os.umask(0o177)
    try:
        sock.bind(socket_path)
    finally:
        os.umask(umask)
    sock.listen(128)
    sock.setblocking(False)
    return sock


def _frames(writer: _Writer, client: _Client) -> bool:
    """Act on every whole frame the client has sent; False when it said `S` (or sent
    a key that is not one)."""
    buf, pos = client.inbox, 0
    try:
        while len(buf) - pos >= HEADER.size:
            kind, size = HEADER.unpack_from(buf, pos)
            end = pos + HEADER.size + size
            if len(buf) < end:
                break
            # One copy (a slice of the bytearray, then bytes of it, were two): a batch
            # is about a megabyte, and each copy a fresh allocation faulted in page by
            # page (measured: ~1.6 us of the writer's CPU per row, then ~0.04).
            with memoryview(buf) as view:
                payload = bytes(view[pos + HEADER.size : end])
            pos = end
            if kind in (BATCH, AGAIN):
                client.lost += writer.commit(payload, client.sealer, again=kind == AGAIN)
            elif kind == FLUSH:
                client.outbox += frame(FLUSH, flushed(payload, client.lost))
            elif kind == KEY:
                try:
                    client.sealer = Sealer(payload)
                except ValueError as exc:  # that gateway's bug: the others go on
                    log.error("a gateway's ledger connection closed: %s", exc)
                    return False
            elif kind == STOP:
                return False
        return True
    finally:
        del buf[:pos]


def serve_shared(
    path: str, socket_path: str, control: int, ready: BinaryIO, max_bytes: int = 0
) -> None:
    """Commit the batches of every gateway process connected to `socket_path` until
    the `control` descriptor (the owner's pipe) ends; `ready` gets `R` once it listens.
    A connection's frames are acted on in order and its answers go back to it alone, so
    `F` means what it means on a pipe: that gateway's rows before it are committed."""
    writer = _Writer(path, max_bytes)
    listener = listen(socket_path)
    inode = os.stat(socket_path).st_ino
    sel = selectors.DefaultSelector()
    sel.register(listener, selectors.EVENT_READ, None)
    sel.register(control, selectors.EVENT_READ, control)
    ready.write(frame(READY))
    ready.flush()

    def drop(client: _Client) -> None:
        sel.unregister(client.sock)
        client.sock.close()

    def answer(client: _Client) -> None:
        """Send the answers waiting, as far as the connection takes them now."""
        try:
            sent = client.sock.send(client.outbox) if client.outbox else 0
        except BlockingIOError:
            sent = 0
        except OSError:  # the gateway is gone; it sends again to whoever listens next
            drop(client)
            return
        del client.outbox[:sent]
        events = selectors.EVENT_READ | (selectors.EVENT_WRITE if client.outbox else 0)
        if sel.get_key(client.sock).events != events:
            sel.modify(client.sock, events, client)

    try:
        while True:
            for key, events in sel.select():
                if key.data is None:
                    with contextlib.suppress(BlockingIOError, InterruptedError):
                        while True:
                            sock, _ = listener.accept()
                            sock.setblocking(False)
                            sel.register(sock, selectors.EVENT_READ, _Client(sock))
                elif key.data is control:
                    if not os.read(control, 4096):
                        return  # the owner is done (or gone)
                else:
                    client: _Client = key.data
                    if events & selectors.EVENT_READ:
                        try:
                            data = client.sock.recv(_RECV)
                        except (BlockingIOError, InterruptedError):
                            data = None
                        except OSError:
                            data = b""
                        if data == b"":  # a part of a frame it sent is not acted on
                            drop(client)
                            continue
                        if data:
                            client.inbox += data
                            if not _frames(writer, client):
                                answer(client)
                                drop(client)
                                continue
                    answer(client)
    finally:
        for key in list(sel.get_map().values()):
            if isinstance(key.data, _Client):
                key.data.sock.close()
        sel.close()
        listener.close()
        with contextlib.suppress(OSError):
            if os.stat(socket_path).st_ino == inode:  # still ours, not a successor's
                os.unlink(socket_path)
        writer.conn.close()


def main() -> None:
    # The writer lives as long as its pipe: Ctrl-C or a SIGTERM sent to the whole
    # process group must not cut it off before the gateway has sent its last batch.
    # (The shared writer: before its owner has stopped the gateways and closed it.)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    # A batch parses into a few thousand short-lived lists and dicts, all freed by
    # reference counting once committed; at the default threshold (700) the collector
    # would scan each batch several times while it is being built (measured: a parse
    # cost ~6x its own time). Cycles are rare here (an error's traceback), so the
    # collector runs seldom, over what outlives a batch.
    gc.freeze()
    gc.set_threshold(100_000, 50, 50)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    args = sys.argv[1:]
    socket_path = None
    if args[0] == "--listen":
        socket_path, args = args[1], args[2:]
    max_bytes = int(args[1]) if len(args) > 1 else 0
    path = args[0] if args[0] != "-" else os.environ["SWITCHYARD_LEDGER_DB"]
    if socket_path is None:
        serve(path, sys.stdin.buffer, sys.stdout.buffer, max_bytes)
    else:
        serve_shared(path, socket_path, sys.stdin.fileno(), sys.stdout.buffer, max_bytes)


if __name__ == "__main__":
    main()
