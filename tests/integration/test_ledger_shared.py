"""One ledger writer for several gateway processes (issue 50, `serve --workers N`).

A shared writer (`spawn_shared_writer`) listens on a Unix socket; every gateway process's
`UsageLedger(writer_socket=...)` sends it the frames it would send its own writer. These
tests drive real writer processes over real sockets into one SQLite file: ledgers in
separate processes lose and duplicate no row, a writer killed mid-stream and started
again loses none, a batch sent again adds nothing twice, and the socket is private.
"""

from __future__ import annotations

import asyncio
import io
import os
import signal
import socket
import sqlite3
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest

from switchyard.pipeline import RequestContext, RequestInput, Timings
from switchyard.request import NOT_READ
from switchyard.state.ledger import (
    Finished,
    LedgerCounts,
    UsageLedger,
    batch_json,
    encoded_row,
    spawn_shared_writer,
)
from switchyard.state.ledger_batch import (
    AGAIN,
    BATCH,
    FLUSH,
    FLUSHED,
    HEADER,
    decode_batch,
    frame,
    read_frame,
    write_batch,
)
from switchyard.state.sealing import Sealer
from switchyard.state.sql import connect
from switchyard.state.traces import StoredRow

# A worker process: its own ledger on the shared writer, rows recorded on its event loop.
WORKER = """
import asyncio, sys, time
from switchyard.pipeline import RequestContext, RequestInput, Timings
from switchyard.request import NOT_READ
from switchyard.state.ledger import Finished, UsageLedger

db, sock, name, n = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
ledger = UsageLedger(db, flush_s=0.005, writer_socket=sock)

async def main() -> bool:
    for i in range(n):
        now = time.perf_counter()
        ctx = RequestContext(
            RequestInput(f"{name}-{i}", "chat.completions", time.time()),
            NOT_READ, Timings(now), now + 5,
        )
        ctx.timings.ended = now
        ledger.record(Finished(ctx, "ok", 1, 1, 0.0))
        if i % 50 == 0:
            await asyncio.sleep(0.002)
    return await ledger.flush_async(timeout_s=60)

ok = asyncio.run(main())
ledger.close()
print(ok, ledger.dropped)
"""


@pytest.fixture
def sock_dir() -> Iterator[Path]:
    """A short directory for the socket (a Unix socket's path is under 108 bytes)."""
    d = Path(tempfile.mkdtemp(prefix="sy-ledger-"))
    yield d
    for p in d.iterdir():
        p.unlink()
    d.rmdir()


def _finished(request_id: str) -> Finished:
    now = time.perf_counter()
    ctx = RequestContext(
        RequestInput(request_id, "chat.completions", time.time()), NOT_READ, Timings(now), now + 5
    )
    ctx.timings.ended = now
    return Finished(ctx, "ok", 1, 1, 0.0)


def _counts(db: Path) -> tuple[int, int, int]:
    """Usage rows, distinct request ids, and the requests the daily sums count."""
    conn = sqlite3.connect(db)
    try:
        rows, distinct = conn.execute(
            "SELECT count(*), count(DISTINCT request_id) FROM usage"
        ).fetchone()
        daily = conn.execute("SELECT coalesce(sum(requests), 0) FROM usage_daily").fetchone()[0]
        return rows, distinct, daily
    finally:
        conn.close()


def test_three_gateway_processes_write_through_one_writer_without_loss_or_duplicates(
    tmp_path: Path, sock_dir: Path
) -> None:
    db, sock = tmp_path / "l.db", str(sock_dir / "w.sock")
    writer = spawn_shared_writer(str(db), sock)
    n = 1500
    try:
        workers = [
            subprocess.Popen(
                [sys.executable, "-c", WORKER, str(db), sock, f"w{k}", str(n)],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for k in range(3)
        ]
        outs = [w.communicate(timeout=120) for w in workers]
        assert [w.returncode for w in workers] == [0, 0, 0], [e for _, e in outs]
        assert [o.split() for o, _ in outs] == [["True", "0"]] * 3  # committed, none dropped
        # One writer process served them all: none of the workers started its own.
        assert _counts(db) == (3 * n, 3 * n, 3 * n)
    finally:
        assert writer.stop() == 0
    assert not os.path.exists(sock)  # a writer that stops removes its socket


def test_a_shared_writer_killed_mid_stream_loses_no_row_and_the_ledgers_carry_on(
    tmp_path: Path, sock_dir: Path
) -> None:
    """Two ledgers record on one loop. The writer is stopped (frames pile up unread in
    its socket and unanswered in the ledgers), killed, and started again by its owner:
    the ledgers connect again and send what was not answered; every row is there once,
    and counted once in the daily sums."""
    db, sock = tmp_path / "l.db", str(sock_dir / "w.sock")
    writer = spawn_shared_writer(str(db), sock)
    ledgers = [UsageLedger(str(db), flush_s=0.005, writer_socket=sock) for _ in range(2)]
    recorded: list[str] = []

    async def record(rounds: int, tag: str) -> None:
        for i in range(rounds):
            for k, led in enumerate(ledgers):
                rid = f"{tag}-{k}-{i}"
                led.record(_finished(rid))
                recorded.append(rid)
            if i % 20 == 0:
                await asyncio.sleep(0.006)  # the batch timers fire

    async def main() -> tuple[set[str], int]:
        await record(300, "before")
        assert all([await led.flush_async(timeout_s=30) for led in ledgers])
        acknowledged = set(recorded)
        os.kill(writer.proc.pid, signal.SIGSTOP)
        await record(300, "during")  # written into the socket, never answered
        await asyncio.sleep(0.05)
        in_flight = sum(led.queued_bytes for led in ledgers)
        os.kill(writer.proc.pid, signal.SIGKILL)
        writer.proc.wait(10)
        await record(100, "dead")  # no writer at all: the ledgers keep the frames
        return acknowledged, in_flight

    try:
        acknowledged, in_flight = asyncio.run(main())
        assert in_flight > 0  # frames were waiting for answers when it was killed
        writer.stop()  # reaps it (and closes its pipes)
        writer = spawn_shared_writer(str(db), sock)  # its owner starts it again

        async def after() -> list[bool]:
            for i in range(100):
                for k, led in enumerate(ledgers):
                    led.record(_finished(f"after-{k}-{i}"))
                    recorded.append(f"after-{k}-{i}")
                if i % 20 == 0:
                    await asyncio.sleep(0.006)
            return [await led.flush_async(timeout_s=60) for led in ledgers]

        assert asyncio.run(after()) == [True, True]
        conn = sqlite3.connect(db)
        ids = {r[0] for r in conn.execute("SELECT request_id FROM usage")}
        conn.close()
        assert acknowledged <= ids
        assert _counts(db) == (len(recorded), len(recorded), len(recorded))
        assert ids == set(recorded)
        assert [led.dropped for led in ledgers] == [0, 0]
        assert [led.queued_bytes for led in ledgers] == [0, 0]  # every frame answered
    finally:
        for led in ledgers:
            led.close()
        writer.stop()


def _read_ack(conn: socket.socket) -> int:
    data = b""
    while len(data) < HEADER.size + FLUSHED.size:
        chunk = conn.recv(64)
        assert chunk, "the writer closed the connection"
        data += chunk
    kind, _ = HEADER.unpack_from(data)
    assert kind == FLUSH
    return int(FLUSHED.unpack_from(data, HEADER.size)[0])


def test_a_batch_sent_again_to_a_new_writer_adds_nothing_twice(
    tmp_path: Path, sock_dir: Path
) -> None:
    """The frames a gateway sends again after a writer died may have been committed
    by it: their rows are written again unchanged and the daily sums do not count them
    twice; the rows it had not committed count once."""
    db, sock = tmp_path / "l.db", str(sock_dir / "w.sock")
    counts = LedgerCounts()
    first = [encoded_row(_finished(f"once-{i}"), counts) for i in range(3)]
    assert all(r is not None for r in first)
    writer = spawn_shared_writer(str(db), sock)
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
            conn.connect(sock)
            payload = batch_json(first, {}, [])  # type: ignore[arg-type]
            conn.sendall(frame(BATCH, payload) + frame(FLUSH, (1).to_bytes(8, "big")))
            assert _read_ack(conn) == 1
        assert _counts(db) == (3, 3, 3)
        # The same batch again, with a row the dead writer never got.
        more = [*first, encoded_row(_finished("late"), counts)]
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
            conn.connect(sock)
            payload = batch_json(more, {}, [])  # type: ignore[arg-type]
            conn.sendall(frame(AGAIN, payload) + frame(FLUSH, (2).to_bytes(8, "big")))
            assert _read_ack(conn) == 2
        assert _counts(db) == (4, 4, 4)
    finally:
        writer.stop()


def test_rows_a_dead_writer_committed_without_answering_are_counted_once(
    tmp_path: Path, sock_dir: Path
) -> None:
    """A writer that commits a gateway's batch and dies before it answers: the ledger
    sends the batch again to the next writer, marked as possibly committed, and the
    daily sums count its rows once. (The first writer is this test: it commits what it
    reads with the writer's own `write_batch` and closes without answering.)"""
    db, sock = tmp_path / "l.db", str(sock_dir / "w.sock")
    dying = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    dying.bind(sock)
    dying.listen(1)
    ledger = UsageLedger(str(db), flush_s=0.005, writer_socket=sock)
    writer = None
    try:
        for i in range(10):
            ledger.record(_finished(f"c-{i}"))
        ledger.flush(timeout_s=0.3)  # sent; never answered
        conn, _ = dying.accept()
        stream = io.BytesIO(conn.recv(1 << 20))  # all of it: the flush wrote it whole
        db_conn = connect(str(db))
        while (got := read_frame(stream)) is not None:
            if got[0] == BATCH:
                batch = decode_batch(got[1])
                assert batch is not None and write_batch(db_conn, batch)
        db_conn.close()
        assert _counts(db) == (10, 10, 10)
        conn.close()
        dying.close()
        os.unlink(sock)
        writer = spawn_shared_writer(str(db), sock)
        ledger.record(_finished("c-late"))
        ledger.flush(timeout_s=30)
        assert _counts(db) == (11, 11, 11)
        assert ledger.queued_bytes == 0
    finally:
        ledger.close()
        dying.close()
        if writer is not None:
            writer.stop()


def test_the_socket_is_private_and_one_writer_listens_on_it(tmp_path: Path, sock_dir: Path) -> None:
    db, sock = tmp_path / "l.db", str(sock_dir / "w.sock")
    writer = spawn_shared_writer(str(db), sock)
    try:
        assert stat.S_IMODE(os.stat(sock).st_mode) == 0o600
        with pytest.raises(RuntimeError, match="did not start listening"):
            spawn_shared_writer(str(db), sock)  # a live writer's socket is not taken
        assert writer.proc.poll() is None
    finally:
        writer.stop()


def test_stored_responses_are_sealed_with_each_connections_key(
    tmp_path: Path, sock_dir: Path
) -> None:
    """The key goes down each connection (never a command line or environment); the
    shared writer seals each gateway's responses with that gateway's key."""
    db, sock = tmp_path / "l.db", str(sock_dir / "w.sock")
    sealer = Sealer(os.urandom(32))
    writer = spawn_shared_writer(str(db), sock)
    ledger = UsageLedger(str(db), flush_s=0.005, seal_key=sealer.key, writer_socket=sock)
    try:
        seen = b"".join(
            Path(f"/proc/{writer.proc.pid}/{f}").read_bytes() for f in ("cmdline", "environ")
        )
        assert sealer.key not in seen and sealer.key.hex().encode() not in seen
        body = msgspec.Raw(b'{"a": 1}')
        row = StoredRow(
            "t1", "resp_1", time.time(), "completed", "m", None, None, 0, None, body, 0.0
        )
        seq = ledger.store_response(row)
        ledger.flush()
        assert ledger.committed(seq)
        conn = sqlite3.connect(db)
        blob = conn.execute("SELECT body FROM responses WHERE id = 'resp_1'").fetchone()[0]
        conn.close()
        assert sealer.open("t1", "resp_1", blob) == {"a": 1}
    finally:
        ledger.close()
        writer.stop()
