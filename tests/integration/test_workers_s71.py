"""`serve --workers N` killed whole (supervisor and workers at once: SIGKILL, the OOM
killer, a host crash): the requests its workers were serving are billed by the next
supervisor started on the same home, from the journals the dead workers left in
`run/inflight/`, exactly once; a journal whose worker still lives is never billed.

Before the fix nobody read those journals: a stream cut by the crash had no usage row,
ever (its tenant's spend and the ledger said nothing of it).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sqlite3
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
import redis

from support.gateways import Gateway, cheap_config, start_gateway
from support.procs import worker_pids
from support.upstreams import Scripted
from switchyard.config import load_settings
from switchyard.identity import Limits, Principal
from switchyard.policy import headers as request_headers
from switchyard.scale.worker import InFlight, JournalBusy, claim_journal, journal_path
from switchyard.scale.workers import Supervisor
from switchyard.state.ledger import UsageLedger

_BODY = {"model": "cheap", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 50}
_BILLED = "of an earlier run"  # the supervisor's log line for a journal it billed
_RESERVED = _BODY["max_tokens"] * 1000.0 / 1_000_000  # its output cap at CHEAP_PRICE


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _crash(gw: Gateway) -> list[int]:
    """SIGKILL the whole gateway at once, as a host crash would: the supervisor, its
    workers, its ledger writer and its private redis-server, all stopped first so that
    none sees another die (a supervisor would bill its dead worker itself). Returns the
    workers' pids."""
    sup = gw.proc.popen.pid
    workers = worker_pids(sup)
    assert len(workers) == 2, workers
    others = worker_pids(sup, b"--listen") + worker_pids(sup, b"redis")
    everyone = [sup, *workers, *others]
    for pid in everyone:
        os.kill(pid, signal.SIGSTOP)
    for pid in everyone:
        os.kill(pid, signal.SIGKILL)
    gw.proc.popen.wait(10)
    deadline = time.monotonic() + 10
    while any(_alive(pid) for pid in everyone):
        assert time.monotonic() < deadline, "the killed processes did not go"
        time.sleep(0.05)
    return workers


def _crashed_mid_stream(gw: Gateway, scripted: Scripted, key: str) -> tuple[str, list[int]]:
    """A stream of `key`'s open on `gw` when the whole gateway is SIGKILLed (`_crash`):
    its request id, and the pids of the workers killed."""
    scripted.fault("slow:300", count=1)
    with gw.stream(_BODY | {"stream": True}, headers={"Authorization": f"Bearer {key}"}) as r:
        assert r.status_code == 200
        lost_id = r.headers["x-request-id"]
        lines = r.iter_lines()
        assert any(line.startswith("data: ") for line in lines)
        time.sleep(0.5)  # streaming, its model and reservation written to the journal
        dead = _crash(gw)
        with pytest.raises(httpx.HTTPError):  # cut by the crash, not ended
            for _ in lines:
                pass
    return lost_id, dead


def _journals(gw: Gateway) -> list[str]:
    folder = Path(gw.db).parent / "run" / "inflight"
    return sorted(os.listdir(folder)) if folder.exists() else []


def _daily_requests(db: str, tenant: str) -> int:
    with contextlib.closing(sqlite3.connect(f"file:{db}?mode=ro", uri=True)) as conn:
        row = conn.execute(
            "SELECT COALESCE(SUM(requests), 0) FROM usage_daily WHERE tenant_id = ?", (tenant,)
        ).fetchone()
    return int(row[0])


def _workers(scripted: Scripted, db: str | None = None) -> Gateway:
    return start_gateway(cheap_config(scripted), db=db, serve_args=("--workers", "2"))


def test_a_crashed_gateways_stream_is_billed_once_by_the_next_start(scripted: Scripted) -> None:
    """A stream is open when the whole gateway is SIGKILLed; the next `serve --workers
    2` on the same home bills it (`incomplete`, `worker_exited`, its tenant and key)
    from its dead worker's journal and removes the journal; a second crash and start
    bills nothing more. While the first gateway lives, its workers' journals are
    locked: no one else may claim them."""
    first = _workers(scripted)
    later: list[Gateway] = []
    try:
        tenant = "crash-" + os.urandom(3).hex()
        first.create_tenant(tenant)
        made = first.create_key(tenant)
        key = made["key"]
        live = [n for n in _journals(first) if n.startswith("w")]
        assert len(live) == 2, live
        for name in live:  # a live worker holds its journal's lock
            with pytest.raises(JournalBusy):
                claim_journal(journal_path(Path(first.db).parent / "run", name))
        lost_id, dead = _crashed_mid_stream(first, scripted, key)
        left = _journals(first)
        assert sorted(n.split("-")[1] for n in left) == sorted(str(p) for p in dead)
        assert first.stored_rows(tenant, 1, timeout_s=1) == []  # nobody billed it yet

        second = _workers(scripted, db=first.db)
        later.append(second)
        rows = second.stored_rows(tenant, 1, timeout_s=30)
        assert [x["request_id"] for x in rows] == [lost_id], second.proc.output()[-3000:]
        row = rows[0]
        assert (row["status"], row["error_code"]) == ("incomplete", "worker_exited")
        assert (row["tenant_id"], row["model"], row["endpoint"]) == (
            tenant,
            "cheap",
            "chat.completions",
        )
        assert row["key_id"] == made["id"]
        # Its holds died with the private Redis; its journal kept what it reserved.
        assert row["cost_usd"] == pytest.approx(_RESERVED), row
        deadline = time.monotonic() + 10
        while set(left) & set(_journals(second)):  # unlinked once committed
            assert time.monotonic() < deadline, _journals(second)
            time.sleep(0.05)
        assert second.proc.output().count(_BILLED) == 1, second.proc.output()[-3000:]
        assert _daily_requests(first.db, tenant) == 1

        _crash(second)  # nothing in flight: its workers leave empty journals
        third = _workers(scripted, db=first.db)
        later.append(third)
        r = third.post("/v1/chat/completions", key, json=_BODY)
        assert r.status_code == 200, r.text
        rows = third.stored_rows(tenant, 2, timeout_s=30)
        assert sorted((x["request_id"] == lost_id, x["status"]) for x in rows) == [
            (False, "ok"),
            (True, "incomplete"),
        ]
        assert _BILLED not in third.proc.output()
        assert _daily_requests(first.db, tenant) == 2
        deadline = time.monotonic() + 10
        while len(_journals(third)) != 2:  # the second gateway's journals are gone
            assert time.monotonic() < deadline, _journals(third)
            time.sleep(0.05)
    finally:
        for g in [first, *later]:
            g.proc.stop()


def test_a_crashed_gateways_holds_in_a_shared_redis_are_billed_as_reserved(
    scripted: Scripted, redis_url: str
) -> None:
    """With `storage.redis_url` the dead workers' holds outlive the crash (their owner
    records lapse only after the limiter's lease): the next start gives them back by
    the dead worker's name and bills the cut stream what it reserved (its output cap
    at the model's price), not 0, and its budget keeps that spend."""
    config = cheap_config(scripted, storage={"redis_url": redis_url})
    start = lambda db=None: start_gateway(config, db=db, serve_args=("--workers", "2"))  # noqa: E731
    first = start()
    later: list[Gateway] = []
    raw = redis.Redis.from_url(redis_url)
    try:
        tenant = "held-" + os.urandom(3).hex()
        first.create_tenant(tenant, budget_usd=1.0, budget_period="day")
        key = first.create_key(tenant)["key"]
        lost_id, dead = _crashed_mid_stream(first, scripted, key)
        owners = [k.decode() for k in raw.scan_iter(match="switchyard:rl:owner:*")]
        mine = [o for o in owners if any(f"-{pid}-" in o for pid in dead)]
        assert len(mine) == 1, owners  # the dead stream's worker's holds, still there

        second = start(first.db)
        later.append(second)
        rows = second.stored_rows(tenant, 1, timeout_s=30)
        assert [x["request_id"] for x in rows] == [lost_id], second.proc.output()[-3000:]
        row = rows[0]
        assert (row["status"], row["error_code"]) == ("incomplete", "worker_exited")
        assert row["cost_usd"] == pytest.approx(_RESERVED)
        assert raw.hlen(mine[0]) == 0
        r = httpx.get(second.url + "/admin/tenants", params={"limit": 1000}, headers=second.admin)
        [t] = [t for t in r.json()["data"] if t["id"] == tenant]
        assert float(t["budget_used_usd"]) == pytest.approx(_RESERVED)
    finally:
        raw.close()
        for g in [first, *later]:
            g.proc.stop()


# -- the scan itself: two supervisors on one home, a live journal -----------------------


def _open(journal: InFlight, rid: str, tenant: str) -> None:
    principal = Principal(tenant, "k1", ("*",), ("*",), Limits(), Limits())
    ctx = request_headers.opened(rid, "chat.completions", {}, time.perf_counter(), 1e9, principal)
    ctx.alias = "cheap"
    journal.opened(ctx)


def _supervisor(run: Path, db: Path) -> Supervisor:
    """A supervisor as far as billing goes: its run directory and its control plane's
    ledger (a real ledger and writer, on its own database)."""
    sup = Supervisor(load_settings(None), None, "127.0.0.1", 0, 1, lambda *a: "")
    sup.spec = {"run_dir": str(run)}
    sup.gateway = SimpleNamespace(ledger=UsageLedger(str(db)))
    return sup


def _billed(db: Path) -> list[tuple[Any, ...]]:
    with contextlib.closing(sqlite3.connect(db)) as conn:
        return [
            tuple(r)
            for r in conn.execute(
                "SELECT request_id, tenant_id, status, error_code FROM usage ORDER BY request_id"
            )
        ]


def test_two_supervisors_on_one_home_bill_a_dead_journal_once_and_a_live_one_never(
    tmp_path: Path,
) -> None:
    """Two supervisors start on one home at once, each with its own ledger (so that
    the ledger writer's own rule against a second `worker_exited` row cannot hide a
    double billing): a dead worker's journal is billed by exactly one of them and
    removed; a journal whose worker lives (its lock held) is billed by neither and
    stays; once its worker is gone, a later scan bills it, once."""
    run = tmp_path / "run"
    ledgers = [tmp_path / "a.db", tmp_path / "b.db"]
    sups = [_supervisor(run, db) for db in ledgers]
    dead = InFlight(journal_path(run, "w0-101-0ld0ld0ld0ld"), 4, sups[0].gateway.ledger)
    _open(dead, "req_dead", "acme")
    dead.close()  # its request still open: the file stays, its lock is gone
    alive = InFlight(journal_path(run, "w1-102-0ld0ld0ld0ld"), 4, sups[0].gateway.ledger)
    _open(alive, "req_alive", "acme")

    async def scan_together() -> None:
        await asyncio.gather(*(s.bill_earlier_runs() for s in sups))
        for s in sups:  # the rows committed, the journals they came from unlinked
            await asyncio.gather(*s._billing)

    try:
        asyncio.run(scan_together())
        rows = _billed(ledgers[0]) + _billed(ledgers[1])
        assert rows == [("req_dead", "acme", "incomplete", "worker_exited")]
        assert not journal_path(run, "w0-101-0ld0ld0ld0ld").exists()
        assert journal_path(run, "w1-102-0ld0ld0ld0ld").exists()

        asyncio.run(scan_together())  # again: nothing more
        assert _billed(ledgers[0]) + _billed(ledgers[1]) == rows

        alive.close()  # its worker ends with the request open
        asyncio.run(scan_together())
        rows = _billed(ledgers[0]) + _billed(ledgers[1])
        assert sorted(rows) == [
            ("req_alive", "acme", "incomplete", "worker_exited"),
            ("req_dead", "acme", "incomplete", "worker_exited"),
        ]
        assert os.listdir(run / "inflight") == []
    finally:
        for s in sups:
            s.gateway.ledger.close()


def test_a_claimed_journal_is_kept_until_billed(tmp_path: Path) -> None:
    """A journal claimed by one supervisor is locked against every other claim until
    it is let go: kept (its rows never committed) it is claimed again, whole, by the
    next; removed once billed, nobody finds it again."""
    run = tmp_path / "run"
    ledger = UsageLedger(str(tmp_path / "l.db"))
    try:
        path = journal_path(run, "w0-7-0ld0ld0ld0ld")
        journal = InFlight(path, 2, ledger)
        _open(journal, "req_kept", "acme")
        journal.close()
        first = claim_journal(path)
        assert first is not None and [r[0] for r in first.records] == ["req_kept"]
        with pytest.raises(JournalBusy):
            claim_journal(path)
        first.close(billed=False)
        again = claim_journal(path)
        assert again is not None and [r[0] for r in again.records] == ["req_kept"]
        again.close(billed=True)
        assert not path.exists()
        assert claim_journal(path) is None
    finally:
        ledger.close()
