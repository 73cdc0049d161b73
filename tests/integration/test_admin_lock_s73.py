"""An admin write while another connection holds the database locked (review s73e)."""

from __future__ import annotations

import concurrent.futures
import contextlib
import sqlite3
import time
from collections.abc import Iterator

import httpx

from support.gateways import Gateway


@contextlib.contextmanager
def _locked(gw: Gateway) -> Iterator[None]:
    db = sqlite3.connect(gw.db, timeout=1, isolation_level=None)
    db.execute("BEGIN EXCLUSIVE")
    try:
        yield
    finally:
        db.execute("ROLLBACK")
        db.close()


def test_an_admin_write_on_a_locked_database_is_503_and_stalls_nothing(gw: Gateway) -> None:
    """POST /admin/keys while another connection holds the database: 503
    store_unavailable (no exception text), and /healthz answers at once meanwhile.
    Before: 500 internal_error after 10 s, with the event loop blocked the whole time
    (every request of every tenant waited)."""
    tenant, _ = gw.new_tenant("s73-lock")
    with _locked(gw), concurrent.futures.ThreadPoolExecutor(1) as pool:
        write = pool.submit(
            httpx.post,
            gw.url + "/admin/keys",
            json={"tenant_id": tenant},
            headers=gw.admin,
            timeout=30,
        )
        time.sleep(0.5)
        t = time.monotonic()
        assert httpx.get(gw.url + "/healthz", timeout=30).status_code == 200
        assert time.monotonic() - t < 1.0, "the event loop waited for the admin write"
        r = write.result()
    assert r.status_code == 503, r.text
    assert r.json()["error"]["code"] == "store_unavailable"
    assert "OperationalError" not in r.text and gw.db not in r.text
