"""The store interface: an in-memory gateway starts nothing and opens no file when it
is built, yet serves a whole request (key, limits, budget, idempotency, ledger,
trace) through the real app; the SQLite store does its request-path I/O off the
event loop."""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
from pathlib import Path
from typing import Any

import httpx

from support.upstreams import Scripted
from switchyard.api.app import create_app
from switchyard.config import parse_settings
from switchyard.gateway import Gateway


def _open_files() -> set[str]:
    out = set()
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # closed since it was listed
            out.add(os.readlink(f"/proc/self/fd/{fd}"))
    return out


def _children() -> set[int]:
    kids: set[int] = set()
    for task in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{task}/children") as f:
            kids.update(int(p) for p in f.read().split())
    return kids


def _settings(tmp: Path, upstream: str, backend: str = "memory") -> Any:
    return parse_settings(
        {
            "models": [{"alias": "m", "engine": {"kind": "openai", "base_url": upstream + "/v1"}}],
            "embeddings": {"enabled": False},
            "storage": {"backend": backend, "sqlite_path": str(tmp / "never.db")},
        }
    )


def test_an_in_memory_gateway_starts_no_process_and_opens_no_file(tmp_path: Path) -> None:
    files, kids = _open_files(), _children()
    gw = Gateway(_settings(tmp_path, "http://127.0.0.1:9"))
    assert _children() == kids
    opened = {f for f in _open_files() - files if f.startswith("/")}
    assert opened == set(), opened
    assert not (tmp_path / "never.db").exists()
    gw.store.close()


def test_the_sqlite_store_is_what_starts_the_ledger_writer(tmp_path: Path) -> None:
    """The other side of the test above: the default store does open its file and
    start its writer, so the check above would see them."""
    kids = _children()
    gw = Gateway(_settings(tmp_path, "http://127.0.0.1:9", backend="sqlite"))
    try:
        assert len(_children() - kids) == 1
        assert (tmp_path / "never.db").exists()
    finally:
        gw.store.close()


def test_an_in_memory_gateway_serves_and_records_a_request(
    tmp_path: Path, scripted: Scripted
) -> None:
    async def run() -> None:
        app = create_app(_settings(tmp_path, scripted.url))
        gw: Gateway = app.state.gateway
        gw.keys.create_tenant("t", rpm=5, budget_usd=1.0)
        key = gw.keys.create_key("t")["key"]
        transport = httpx.ASGITransport(app=app)
        headers = {"Authorization": f"Bearer {key}", "Idempotency-Key": "once"}
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
        async with httpx.AsyncClient(transport=transport, base_url="http://gw") as client:
            first = await client.post("/v1/chat/completions", json=body, headers=headers)
            again = await client.post("/v1/chat/completions", json=body, headers=headers)
            bad = await client.post(
                "/v1/chat/completions", json=body, headers={"Authorization": "Bearer sk-nope"}
            )
        assert first.status_code == 200, first.text
        assert again.headers["x-switchyard-idempotent-replay"] == "true"
        assert again.json()["choices"] == first.json()["choices"]
        assert bad.status_code == 401
        await gw.service.settler.settled()
        rows = gw.ledger.rows(tenant_id="t")
        assert sorted(r["cache"] or "" for r in rows) == ["", "idempotent_replay"]
        assert {r["request_id"] for r in rows} == {
            first.headers["x-request-id"],
            again.headers["x-request-id"],
        }
        with gw.store.connection() as conn:
            traces = conn.execute("SELECT COUNT(*) FROM traces").fetchone()[0]
        assert traces == 2  # a request without a valid key is refused before any record
        gw.store.close()

    asyncio.run(run())


def test_the_sqlite_store_reads_keys_off_the_event_loop(tmp_path: Path) -> None:
    gw = Gateway(_settings(tmp_path, "http://127.0.0.1:9", backend="sqlite"))
    try:
        gw.keys.create_tenant("t")
        key = gw.keys.create_key("t")["key"]
        seen: list[str] = []
        verify = gw.store._verify  # type: ignore[attr-defined]

        def spy(plaintext: str) -> Any:
            seen.append(threading.current_thread().name)
            return verify(plaintext)

        gw.store._verify = spy  # type: ignore[attr-defined]

        async def run() -> Any:
            pending = gw.auth.authenticate({"authorization": f"Bearer {key}"})
            assert not isinstance(pending, type(gw.store.keys.verify(key)))  # a lookup
            principal = await pending  # type: ignore[misc]
            cached = gw.auth.authenticate({"authorization": f"Bearer {key}"})
            return principal, cached

        principal, cached = asyncio.run(run())
        assert principal.tenant_id == "t" and cached is principal
        assert len(seen) == 1 and seen[0].startswith("switchyard-store")
    finally:
        gw.store.close()
