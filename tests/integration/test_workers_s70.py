"""`serve --workers N` and the shared limiter, read as an unlucky operator would: what
is billed and recorded when a connection to Redis drops mid-reply, a worker dies, or
two supervisors share one Redis prefix. Real redis-server processes throughout; a Redis
"drop" is a loopback TCP relay that closes the client's side instead of passing on a
reply Redis has already sent (the script ran; the client never hears of it)."""

from __future__ import annotations

import asyncio
import os
import signal
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import TypeVar

import httpx
import msgspec
import pytest
import redis

from support.gateways import Gateway, cheap_config, start_gateway
from support.procs import kill_workers, worker_pids
from support.upstreams import Scripted
from switchyard.identity import Limits, Principal, TaskBudget
from switchyard.pipeline_context import RequestContext
from switchyard.policy import headers as request_headers
from switchyard.scale.worker import InFlight, journal_path, read_journal
from switchyard.scale.workers import journaled_request, worker_name
from switchyard.state.ledger import UsageLedger, spawn_shared_writer
from switchyard.state.ledger_batch import (
    ADD_DAILY,
    INSERT_USAGE,
    daily_rollups,
    usage_row,
    write_batch,
)
from switchyard.state.ledger_rows import Finished
from switchyard.state.limits import Ask, Billing, ScopeLimits, Verdict
from switchyard.state.limits_redis import RedisLimiter
from switchyard.state.sql import connect
from switchyard.state.tasks import TaskFirst
from switchyard.state.tasks_redis import RedisTaskStore
from switchyard.state.traces import LedgerBatch

T0 = 1_750_000_000.0  # 2025-06-15 15:06:40 UTC: far from a day boundary
HANG_S = 10.0
T = TypeVar("T")


class DroppingRelay:
    """A TCP relay to Redis that, once `drop_next_reply()` is armed, closes the
    client's connection when the next reply comes back from Redis, unsent."""

    def __init__(self, port: int) -> None:
        self._port = port
        self._armed = False
        self.dropped = 0
        self.server: asyncio.Server | None = None

    def drop_next_reply(self) -> None:
        self._armed = True

    async def start(self) -> str:
        self.server = await asyncio.start_server(self._relay, "127.0.0.1", 0)
        port = self.server.sockets[0].getsockname()[1]
        return f"redis://127.0.0.1:{port}/0"

    async def close(self) -> None:
        if self.server is not None:
            self.server.close()

    async def _relay(self, cr: asyncio.StreamReader, cw: asyncio.StreamWriter) -> None:
        sr, sw = await asyncio.open_connection("127.0.0.1", self._port)

        async def up() -> None:
            while data := await cr.read(65536):
                sw.write(data)
                await sw.drain()
            sw.close()

        async def down() -> None:
            while data := await sr.read(65536):
                if self._armed:  # Redis ran it and answered: the client never hears
                    self._armed = False
                    self.dropped += 1
                    break
                cw.write(data)
                await cw.drain()
            cw.close()
            sw.close()

        await asyncio.gather(up(), down(), return_exceptions=True)


def _port(url: str) -> int:
    return int(url.rsplit(":", 1)[1].split("/")[0])


def _with_relay(url: str, body: Callable[[DroppingRelay, str], Awaitable[T]]) -> T:
    async def main() -> T:
        relay = DroppingRelay(_port(url))
        via = await relay.start()
        try:
            async with asyncio.timeout(HANG_S):
                return await body(relay, via)
        finally:
            await relay.close()

    return asyncio.run(main())


@pytest.fixture
def prefix() -> str:
    return f"t{uuid.uuid4().hex[:8]}:"


# -- 3. a reply lost on a dropped connection: the retry must not reserve twice ---------


def test_reserve_whose_reply_is_lost_is_not_applied_twice(redis_url: str, prefix: str) -> None:
    """Redis runs a reserve, then the connection drops before its reply is read. The
    batcher's one retry on a connection error sends it again: before the fix the script
    ran twice (two requests in the rpm window, the tokens and the budget charged twice,
    two concurrency slots, one of which no settle ever frees)."""
    sc = [ScopeLimits("key:lost", rpm=100, tpm=1000, max_concurrency=2, budget_usd=1.0)]
    raw = redis.Redis.from_url(redis_url)

    async def body(relay: DroppingRelay, via: str) -> tuple[Verdict, Verdict]:
        lim = RedisLimiter(via, prefix=prefix, timeout_s=5)
        try:
            warm = Ask("warm", 10, 0.1)
            assert (await lim.reserve(sc, warm, now=T0)).allowed
            await lim.settle(sc, warm, 10, 0.1, now=T0)
            relay.drop_next_reply()
            lost = Ask("lost", 100, 0.25)
            verdict = await lim.reserve(sc, lost, now=T0)
            assert relay.dropped == 1
            assert raw.zcard(f"{prefix}rl:key:lost:inflight") == 1
            await lim.settle(sc, lost, 100, 0.25, now=T0)
            after = await lim.reserve(sc, Ask("after", 1, 0.0), now=T0)
            return verdict, after
        finally:
            await lim.close()

    try:
        verdict, after = _with_relay(redis_url, body)
        assert verdict.allowed
        # The lost reply's verdict is the state with its one reservation in it.
        assert verdict.state["key:lost"]["remaining_requests"] == 100 - 2
        assert verdict.state["key:lost"]["remaining_tokens"] == 1000 - 10 - 100
        assert raw.zcard(f"{prefix}rl:key:lost:req") == 3  # warm, lost once, after
        assert float(raw.get(f"{prefix}rl:key:lost:toktotal")) == 10 + 100 + 1
        state = after.state["key:lost"]
        assert state["budget_remaining_usd"] == pytest.approx(1.0 - 0.1 - 0.25)
        assert raw.zcard(f"{prefix}rl:key:lost:inflight") == 1  # `after` alone
        assert not list(raw.scan_iter(match=f"{prefix}rl:held:lost"))
    finally:
        raw.close()


def test_task_admission_whose_reply_is_lost_is_counted_once(redis_url: str, prefix: str) -> None:
    """The task store's client resends a script once on a connection error; an admit
    that Redis ran before the drop was applied again: the task counted two calls and
    twice the tokens for one, and its settle gave back one."""
    raw = redis.Redis.from_url(redis_url)
    first = TaskFirst(TaskBudget(calls=10, tokens=1000))

    async def body(relay: DroppingRelay, via: str) -> None:
        store = RedisTaskStore(via, prefix=prefix, timeout_s=5)
        try:
            warm = await store.admit(("acme", "t1"), first, "req_warm", 100, 0.0, T0)
            assert warm.allowed
            relay.drop_next_reply()
            adm = await store.admit(("acme", "t1"), first, "req_lost", 300, 0.0, T0)
            assert relay.dropped == 1 and adm.allowed
            state = raw.hgetall(f"{prefix}task:acme:t1")
            assert int(state[b"u_calls"]) == 2
            assert float(state[b"u_tokens"]) == 400
            await store.settle(("acme", "t1"), "req_lost", 50, 0.0)
            assert float(raw.hget(f"{prefix}task:acme:t1", "u_tokens")) == 150
        finally:
            await store.close()

    try:
        _with_relay(redis_url, body)
    finally:
        raw.close()


# -- 1 and 2: every request a dead worker was serving gets its row ----------------------


@pytest.fixture(scope="module")
def gw(scripted: Scripted) -> Iterator[Gateway]:
    g = start_gateway(cheap_config(scripted), serve_args=("--workers", "2"))
    yield g
    g.proc.stop()


def _serving_again(gw: Gateway, key: str) -> None:
    deadline = time.monotonic() + 30
    while True:
        try:
            r = gw.post("/v1/chat/completions", key, json=_BODY)
            if r.status_code == 200:
                return
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, "the workers did not come back"
        time.sleep(0.2)


_BODY = {"model": "cheap", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}


def test_a_dead_workers_request_under_no_limit_gets_its_row(
    gw: Gateway, scripted: Scripted
) -> None:
    """A key with no limits and a tenant with no budget: the limiter holds nothing for
    its requests, so before the fix the supervisor found no trace of a stream cut by
    its worker's death and wrote no row (the request had streamed; the ledger said
    nothing)."""
    tenant = "free-" + os.urandom(3).hex()
    gw.create_tenant(tenant)
    made = gw.create_key(tenant)
    scripted.fault("slow:300", count=1)
    body = {**_BODY, "stream": True, "max_tokens": 50}
    with gw.stream(body, headers={"Authorization": f"Bearer {made['key']}"}) as r:
        assert r.status_code == 200
        lost_id = r.headers["x-request-id"]
        lines = r.iter_lines()
        assert any(line.startswith("data: ") for line in lines)
        time.sleep(0.4)  # streaming: well inside the request
        kill_workers(gw.proc.popen.pid)
        with pytest.raises(httpx.HTTPError):
            for _ in lines:
                pass
    rows = gw.stored_rows(tenant, 1, timeout_s=30)
    assert [x["request_id"] for x in rows] == [lost_id]
    row = rows[0]
    assert (row["status"], row["error_code"]) == ("incomplete", "worker_exited")
    assert (row["tenant_id"], row["key_id"], row["model"]) == (tenant, made["id"], "cheap")
    assert row["endpoint"] == "chat.completions"
    # No limiter held anything for it, but its journal says what its cost plan was:
    # its output cap at the model's price, the most it may have used.
    assert row["cost_usd"] == pytest.approx(0.05)
    _serving_again(gw, made["key"])
    [decision] = gw.trace(lost_id)["decisions"]
    assert decision["outcome"] == "exited"
    assert decision["evidence"]["reserved_usd"] == pytest.approx(0.05)
    time.sleep(0.5)
    rows = gw.stored_rows(tenant, 2)
    assert sorted(x["status"] for x in rows) == ["incomplete", "ok"]  # no second lost row


def test_a_row_lost_between_settle_and_commit_is_written(gw: Gateway) -> None:
    """A request settles (its reservation given back) and its row is queued; the ledger
    writer has not committed it when its worker dies, and the frame holding the row
    dies with the writer (both SIGKILLed; the writer is stopped meanwhile so the order
    is sure). Before the fix the row was lost: no hold was left for the supervisor to
    find. Now the worker's journal still names the request with what it settled, and
    the supervisor writes its row to the writer started again."""
    tenant = "gap-" + os.urandom(3).hex()
    gw.create_tenant(tenant)
    made = gw.create_key(tenant)
    writer = worker_pids(gw.proc.popen.pid, b"--listen")
    assert len(writer) == 1, writer
    os.kill(writer[0], signal.SIGSTOP)
    try:
        r = gw.post("/v1/chat/completions", made["key"], json=_BODY)
        assert r.status_code == 200, r.text
        rid, usage = r.headers["x-request-id"], r.json()["usage"]
        time.sleep(0.3)  # settled, and its row sent to the (stopped) writer
        kill_workers(gw.proc.popen.pid)
        time.sleep(1.0)  # the supervisor bills the dead workers' journals
    finally:
        os.kill(writer[0], signal.SIGKILL)
        os.kill(writer[0], signal.SIGCONT)
    rows = gw.stored_rows(tenant, 1, timeout_s=30)
    assert [x["request_id"] for x in rows] == [rid], gw.proc.output()[-3000:]
    row = rows[0]
    assert (row["status"], row["error_code"]) == ("incomplete", "worker_exited")
    assert (row["input_tokens"], row["output_tokens"]) == (
        usage["prompt_tokens"],
        usage["completion_tokens"],
    )
    assert row["cost_usd"] == pytest.approx(usage["completion_tokens"] * 1000.0 / 1e6)
    assert row["cost_usd"] > 0
    _serving_again(gw, made["key"])
    evidence = gw.trace(rid)["decisions"][0]["evidence"]
    assert evidence["settled_status"] == "ok"
    time.sleep(0.5)
    assert len(gw.stored_rows(tenant, 2)) == 2  # the later request's, and no other


def test_a_dead_workers_row_never_replaces_its_own(tmp_path: Path) -> None:
    """The supervisor cannot tell whether a journaled row reached the writer (a worker
    killed after its row was committed, before the answer freed its journal slot). Its
    `worker_exited` row must not replace the row the request's own worker wrote, nor
    add to the daily sums again; where there is none, it is written and summed once."""
    conn = connect(str(tmp_path / "ledger.db"))
    facts = ["req_a", None, None, "acme", "k1", "chat.completions", "cheap", T0, False]
    own = journaled_request("w0-1", [*facts, ["ok", 5, 7, 0.007]], [], T0 + 1, True)
    own = msgspec.structs.replace(own, status="ok", error_code=None)
    lost_a = journaled_request("w0-1", [*facts, None], [], T0 + 2, True)
    other = ["req_b", None, None, "acme", "k1", "chat.completions", "cheap", T0, False]
    lost_b = journaled_request("w0-1", [*other, ["ok", 1, 2, 0.002]], [], T0 + 2, True)
    assert write_batch(conn, LedgerBatch({}, [own], []))
    assert write_batch(conn, LedgerBatch({}, [lost_a, lost_b], []))
    assert write_batch(conn, LedgerBatch({}, [lost_a, lost_b], []), again=True)
    rows = [
        tuple(r)
        for r in conn.execute(
            "SELECT request_id, status, error_code, cost_usd FROM usage ORDER BY request_id"
        )
    ]
    assert rows == [
        ("req_a", "ok", None, 0.007),
        ("req_b", "incomplete", "worker_exited", 0.002),
    ]
    daily = [
        tuple(r) for r in conn.execute("SELECT requests, output_tokens, cost_usd FROM usage_daily")
    ]
    assert daily == [(2, 9, pytest.approx(0.009))]
    # The other order: the supervisor's row first, the worker's own after it.
    later = ["req_c", None, None, "acme", "k1", "chat.completions", "cheap", T0, False]
    assert write_batch(
        conn, LedgerBatch({}, [journaled_request("w0-1", [*later, None], [], T0, True)], [])
    )
    real = journaled_request("w0-1", [*later, ["ok", 3, 4, 0.004]], [], T0 + 1, True)
    assert write_batch(
        conn, LedgerBatch({}, [msgspec.structs.replace(real, status="ok", error_code=None)], [])
    )
    row = conn.execute("SELECT status, error_code, cost_usd FROM usage WHERE request_id = 'req_c'")
    assert tuple(row.fetchone()) == ("ok", None, 0.004)
    daily = [
        tuple(r) for r in conn.execute("SELECT requests, errors, output_tokens FROM usage_daily")
    ]
    assert daily == [(3, 1, 13)]  # req_b's error; req_c counted once, as ok
    conn.close()


def test_a_row_sent_again_replaces_a_dead_workers_row_written_earlier(tmp_path: Path) -> None:
    """A `worker_exited` row written by a writer that has since been started again (it
    no longer knows it wrote one), then the request's own row in an `AGAIN` batch: the
    own row takes its place, and the daily sums hold the request once, as ok. Before,
    the `AGAIN` rule took the request for counted already and kept the lost row's sums
    (one error, its cost) under an ok row."""
    conn = connect(str(tmp_path / "ledger.db"))
    facts = ["req_again", None, None, "acme", "k1", "chat.completions", "cheap", T0, False]
    lost = journaled_request("w0-1", [*facts, ["ok", 1, 1, 0.5]], [], T0 + 1, True)
    conn.execute("BEGIN")  # as the earlier writer committed it
    conn.execute(INSERT_USAGE, usage_row(lost))
    conn.executemany(ADD_DAILY, daily_rollups([lost]))
    conn.execute("COMMIT")
    own = journaled_request("w0-1", [*facts, ["ok", 3, 4, 0.004]], [], T0 + 1, True)
    own = msgspec.structs.replace(own, status="ok", error_code=None)
    assert write_batch(conn, LedgerBatch({}, [own], []), again=True)
    row = conn.execute("SELECT status, error_code, cost_usd FROM usage")
    assert tuple(row.fetchone()) == ("ok", None, 0.004)
    daily = conn.execute(
        "SELECT requests, errors, input_tokens, output_tokens, cost_usd FROM usage_daily"
    )
    assert [tuple(r) for r in daily] == [(1, 0, 3, 4, pytest.approx(0.004))]
    conn.close()


@pytest.mark.parametrize("shared", [True, False], ids=["shared-writer", "own-writer"])
def test_the_journal_holds_a_request_until_its_row_is_committed(
    tmp_path: Path, shared: bool
) -> None:
    """The worker's journal, through the hooks a worker sets (`RequestService.on_open`
    is `opened`; `UsageLedger.on_record` is `recorded`) and a real ledger writer (a
    worker's: shared, on a socket; or a ledger's own, on a pipe): a
    request is in the file from its open (no model yet), with what it settled once its
    row is queued, and out of it once the writer has committed that row; with every
    slot taken a request goes unjournaled; a clean close keeps the file only while a
    request is in it."""
    db, sock = str(tmp_path / "ledger.db"), str(tmp_path / "l.sock")
    writer = spawn_shared_writer(db, sock) if shared else None
    ledger = UsageLedger(db, flush_s=60.0, writer_socket=sock if shared else None)
    path = journal_path(tmp_path, "w0-1-run")
    journal = InFlight(path, 2, ledger)
    ledger.on_record = journal.recorded
    principal = Principal("acme", "k1", ("*",), ("*",), Limits(), Limits())

    def opened(rid: str) -> RequestContext:
        ctx = request_headers.opened(
            rid, "chat.completions", {"x-task-id": "t1"}, time.perf_counter(), 1e9, principal
        )
        journal.opened(ctx)
        return ctx

    try:
        a = opened("req_a")
        at = a.input.received_at
        facts = ["req_a", None, "t1", "acme", "k1", "chat.completions"]
        assert list(read_journal(path)) == [[*facts, None, at, False, None, None]]
        before = path.read_bytes()
        a.alias = "cheap"
        ledger.record(Finished(a, "ok", 3, 4, 0.25, with_trace=False))
        done = ["ok", 3, 4, 0.25]
        assert list(read_journal(path)) == [[*facts, "cheap", at, False, done, None]]
        # Killed after the new text, before its slot's head: the earlier text is read.
        torn = tmp_path / "torn"
        torn.write_bytes(before[:4] + path.read_bytes()[4:])
        assert list(read_journal(torn)) == [[*facts, None, at, False, None, None]]
        b = opened("req_b")
        opened("req_c")  # the row of req_a is not committed: no slot is free
        assert journal.full == 1
        assert [r[0] for r in read_journal(path)] == ["req_a", "req_b"]
        ledger.flush()
        opened("req_d")  # req_a's row is committed: its slot is free again
        assert sorted(r[0] for r in read_journal(path)) == ["req_b", "req_d"]
        b.alias = "cheap"
        ledger.record(Finished(b, "error", 3, 0, 0.0, with_trace=False))
        ledger.flush()
        journal.close()  # req_d is open: the file stays, for the supervisor
        assert [r[0] for r in read_journal(path)] == ["req_d"]
    finally:
        ledger.close()
        if writer is not None:
            writer.stop()
    clean = InFlight(journal_path(tmp_path, "w1-2-run"), 2, ledger)
    clean.close()
    assert not journal_path(tmp_path, "w1-2-run").exists()


# -- 4. two supervisors counting in one Redis ----------------------------------------------


def test_another_supervisors_worker_keeps_its_holds(gw: Gateway) -> None:
    """Two hosts' `serve --workers N` share one Redis (`storage.redis_url`; the prefix is
    fixed), and pids repeat across hosts (containers start alike). A worker was named
    `w{index}-{pid}`: when this supervisor's worker died, its release ended the other
    supervisor's live worker's holds of the same name (its concurrency slots freed
    under a running request) and billed its requests as lost in this gateway's ledger.
    Names now carry the supervisor's run, so the other worker's hold is left alone."""
    url = f"unix://{Path(gw.db).parent}/run/redis.sock"
    tenant = "other-" + os.urandom(3).hex()
    gw.create_tenant(tenant)
    made = gw.create_key(tenant)  # for a request once the workers are back
    raw = redis.Redis.from_url(url)
    pids = worker_pids(gw.proc.popen.pid)
    foreign = [worker_name(i, pid, "0ther0ther00") for pid in pids for i in (0, 1)]

    async def hold() -> None:
        for name in foreign:
            lim = RedisLimiter(url, owner=name)
            billing = Billing(f"req_{name}", None, None, tenant, "k", "chat.completions",
                              "cheap", time.time(), 1, False)  # fmt: skip
            ask = Ask(f"req_{name}#admit", 10, 0.01, billing)
            sc = [ScopeLimits(f"key:{name}", max_concurrency=1)]
            assert (await lim.reserve(sc, ask)).allowed
            await lim.close()

    try:
        asyncio.run(hold())
        kill_workers(gw.proc.popen.pid)
        _serving_again(gw, made["key"])
        time.sleep(1.0)
        for name in foreign:
            assert raw.hlen(f"switchyard:rl:owner:{name}") == 1, name
            assert raw.zcard(f"switchyard:rl:key:{name}:inflight") == 1, name
        rows = gw.stored_rows(tenant, 1)
        assert [x["status"] for x in rows] == ["ok"]  # none billed for the other host
    finally:
        raw.close()
