"""A real `switchyard serve` on loopback: started with a config, an admin key and one
tenant's key, and the model entries and configs the tests give it."""

from __future__ import annotations

import contextlib
import os
import sqlite3
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import httpx
import yaml

from support.procs import STARTUP_TIMEOUT_S, Proc, free_port, wait_http
from support.upstreams import Scripted

ADMIN_KEY = "test-admin-" + os.urandom(8).hex()


class Gateway:
    """A running `switchyard serve` with its own SQLite file, an admin key, and one
    tenant + key created through the admin API (`self.key`)."""

    def __init__(self, proc: Proc, port: int, config: dict[str, Any] | None, db: str) -> None:
        self.proc = proc
        self.port = port
        self.config = config
        self.db = db
        self.url = f"http://127.0.0.1:{port}"
        self.key = "unset"

    @property
    def auth(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.key}"}

    @property
    def admin(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {ADMIN_KEY}"}

    def openai(self, key: str | None = None, **kw: Any) -> Any:
        from openai import OpenAI

        return OpenAI(base_url=self.url + "/v1", api_key=key or self.key, max_retries=0, **kw)

    def post(self, path: str, key: str | None = None, **kw: Any) -> httpx.Response:
        """POST with this gateway's key, or `key` when given."""
        auth = {"Authorization": f"Bearer {key}"} if key is not None else self.auth
        headers = {**auth, **kw.pop("headers", {})}
        return httpx.post(self.url + path, headers=headers, timeout=kw.pop("timeout", 60), **kw)

    def stream(self, body: dict[str, Any], path: str = "/v1/chat/completions", **kw: Any) -> Any:
        headers = {**self.auth, **kw.pop("headers", {})}
        return httpx.stream("POST", self.url + path, json=body, headers=headers, timeout=60, **kw)

    def create_tenant(self, tenant_id: str, **limits: Any) -> dict[str, Any]:
        r = httpx.post(
            self.url + "/admin/tenants", json={"id": tenant_id, **limits}, headers=self.admin
        )
        assert r.status_code == 201, r.text
        return dict(r.json())

    def new_tenant(self, prefix: str = "t", **limits: Any) -> tuple[str, str]:
        """A fresh tenant (`<prefix>-` and random hex) with `limits` and a key of its
        own: (tenant id, key)."""
        tenant = f"{prefix}-{os.urandom(4).hex()}"
        self.create_tenant(tenant, **limits)
        return tenant, str(self.create_key(tenant)["key"])

    def create_key(self, tenant_id: str, **fields: Any) -> dict[str, Any]:
        r = httpx.post(
            self.url + "/admin/keys", json={"tenant_id": tenant_id, **fields}, headers=self.admin
        )
        assert r.status_code == 201, r.text
        return dict(r.json())

    def approve(self, tenant: str, task: str | None, call_id: str) -> str:
        """An approval token for one tool call, issued through the admin API."""
        r = httpx.post(
            self.url + "/admin/approvals",
            json={"tenant": tenant, "task_id": task, "call_id": call_id, "approver": "ops-anna"},
            headers=self.admin,
        )
        assert r.status_code == 201, r.text
        return str(r.json()["token"])

    def trace(self, request_id: str, timeout_s: float = 20) -> dict[str, Any]:
        """A request's stored trace (the ledger writer commits it a moment after the
        reply, so this waits for it)."""
        deadline = time.monotonic() + timeout_s
        while True:
            r = httpx.get(f"{self.url}/admin/requests/{request_id}", headers=self.admin)
            if r.status_code == 200 or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert r.status_code == 200, r.text
        return dict(r.json())

    def usage(self, **query: Any) -> list[dict[str, Any]]:
        r = httpx.get(self.url + "/admin/usage", params=query, headers=self.admin)
        assert r.status_code == 200, r.text
        return list(r.json()["data"])

    def stored_rows(
        self,
        tenant: str,
        done: int | Callable[[list[dict[str, Any]]], bool] = 1,
        timeout_s: float = 10.0,
    ) -> list[dict[str, Any]]:
        """The tenant's ledger rows in the order received, once `done` (a count, or a
        test of the rows) holds, or what there is after `timeout_s`. Read from the
        gateway's SQLite file, not /admin/usage: that read first waits for every
        answered request to settle (after a settle that raised, its whole 5 s)."""
        enough = done if callable(done) else (lambda rows: len(rows) >= done)
        deadline = time.monotonic() + timeout_s
        query = "SELECT * FROM usage WHERE tenant_id = ? ORDER BY received_at"
        while True:
            with contextlib.closing(sqlite3.connect(f"file:{self.db}?mode=ro", uri=True)) as db:
                db.row_factory = sqlite3.Row
                rows = [dict(row) for row in db.execute(query, (tenant,))]
            if enough(rows) or time.monotonic() > deadline:
                return rows
            time.sleep(0.05)

    def tenant_rows(self, tenant: str, n: int = 1, timeout_s: float = 10.0) -> list[dict[str, Any]]:
        """The tenant's usage rows once there are `n` (a row is written a moment after
        its request is settled), or what there is after `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while True:
            rows = self.usage(tenant=tenant, limit=50)
            if len(rows) >= n or time.monotonic() > deadline:
                return rows
            time.sleep(0.05)


def start_gateway(
    config: dict[str, Any] | None,
    wait_ready: bool = True,
    env: dict[str, str] | None = None,
    db: str | None = None,
    ready_timeout_s: float | None = None,
    serve_args: tuple[str, ...] = (),
) -> Gateway:
    port = free_port()
    args = [sys.executable, "-m", "switchyard", "serve", "--port", str(port), *serve_args]
    if config is not None:
        fd, path = tempfile.mkstemp(suffix=".yaml", prefix="switchyard-")
        with os.fdopen(fd, "w") as f:
            yaml.safe_dump(config, f)
        args += ["--config", path]
    if db is None:
        db = tempfile.mkdtemp(prefix="switchyard-db-") + "/switchyard.db"
    proc = Proc(
        args,
        "gateway",
        env={"SWITCHYARD_SQLITE_PATH": db, "SWITCHYARD_ADMIN_KEY": ADMIN_KEY, **(env or {})},
    )
    gw = Gateway(proc, port, config, db)
    try:
        wait_http(gw.url + "/healthz", proc)
        if wait_ready:
            wait_http(gw.url + "/readyz", proc, ready_timeout_s or STARTUP_TIMEOUT_S)
        if (config or {}).get("auth", {}).get("mode") != "disabled":
            tenant = "t-" + os.urandom(3).hex()
            gw.create_tenant(tenant)
            gw.key = gw.create_key(tenant)["key"]
    except Exception:
        proc.stop()
        raise
    return gw


def local_model(alias: str = "smollm2-135m", **engine: Any) -> dict[str, Any]:
    return {
        "alias": alias,
        "revision": f"{alias}-rev",
        "engine": {"kind": "llamacpp", "gguf": "auto", "threads": 2, "ctx": 2048, **engine},
    }


# $1000 per million output tokens: 10 tokens cost exactly $0.01.
CHEAP_PRICE = {"input": 0.0, "output": 1000.0}


def version_alias(a_url: str, b_url: str, us: str = "us") -> dict[str, Any]:
    """`chat`, a version alias of two deployments on two scripted upstreams: `one`
    serves revision r1 in region `us`, `two` r2 in eu; weighted, no retries."""
    deployments = [
        ("one", "r1", us, a_url),
        ("two", "r2", "eu", b_url),
    ]
    return {
        "alias": "chat",
        "deployments": [
            {"name": n, "revision": r, "region": where, "engine": {"kind": "openai", "base_url": u + "/v1"}}
            for n, r, where, u in deployments
        ],
        "balance": {"strategy": "weighted", "prefix_affinity": False},
        "resilience": {"retries": 0},
    }  # fmt: skip


def claude_model(scripted: Scripted) -> dict[str, Any]:
    """The model `claude`: `scripted` spoken to as an Anthropic upstream (its Messages
    API), priced, tools supported, no retries."""
    return {
        "alias": "claude",
        "engine": {"kind": "anthropic", "base_url": scripted.url + "/v1", "model": "claude-x"},
        "capabilities": {"context_window": 200000, "supports_tools": True},
        "price": CHEAP_PRICE,
        "resilience": {"retries": 0},
    }


def cheap_config(scripted: Scripted, *more: dict[str, Any], **sections: Any) -> dict[str, Any]:
    """A gateway config whose model `cheap` is `scripted` at CHEAP_PRICE, then the
    models `more`; no embedding model; `sections` added at the top level."""
    cheap = {
        "alias": "cheap",
        "engine": {"kind": "openai", "base_url": scripted.url + "/v1"},
        "price": CHEAP_PRICE,
    }
    return {"models": [cheap, *more], "embeddings": {"enabled": False}, **sections}
