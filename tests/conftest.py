"""Fixtures that start real processes on loopback: gateways, workers, upstreams."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
import yaml
from hypothesis import settings as hypothesis_settings

from switchyard.bench.policy import redis_server_argv

# Property tests draw the same examples in every run (CI must be reproducible); set
# HYPOTHESIS_PROFILE=explore to draw new ones while developing.
hypothesis_settings.register_profile("ci", derandomize=True)
hypothesis_settings.register_profile("explore", derandomize=False)
hypothesis_settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

STARTUP_TIMEOUT_S = 240  # generous: only catches hangs


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Proc:
    """A child process with a log file; stopped (and reaped) by `stop()`."""

    def __init__(self, args: list[str], name: str, env: dict[str, str] | None = None) -> None:
        self.name = name
        # Kept open for the child's lifetime; read back by output().
        self.log = tempfile.NamedTemporaryFile(prefix=f"{name}-", suffix=".log", delete=False)  # noqa: SIM115
        self.popen = subprocess.Popen(
            args,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
            start_new_session=True,
        )

    def output(self) -> str:
        return Path(self.log.name).read_text(errors="replace")

    def stop(self) -> None:
        if self.popen.poll() is None:
            self.popen.terminate()
            try:
                self.popen.wait(15)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(5)
        # Anything the process left behind (workers) goes with its session.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.popen.pid, 9)


def wait_http(
    url: str, proc: Proc, timeout_s: float = STARTUP_TIMEOUT_S, status: int = 200
) -> None:
    deadline = time.monotonic() + timeout_s
    last = None
    while time.monotonic() < deadline:
        if proc.popen.poll() is not None:
            raise RuntimeError(f"{proc.name} exited early:\n{proc.output()[-4000:]}")
        try:
            r = httpx.get(url, timeout=2)
            if r.status_code == status:
                return
            last = r.status_code
        except httpx.HTTPError as exc:
            last = repr(exc)
        time.sleep(0.2)
    raise RuntimeError(
        f"{url} not {status} after {timeout_s}s (last: {last}):\n{proc.output()[-4000:]}"
    )


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


def start_gateway(
    config: dict[str, Any] | None,
    wait_ready: bool = True,
    env: dict[str, str] | None = None,
    db: str | None = None,
    ready_timeout_s: float | None = None,
) -> Gateway:
    port = free_port()
    args = [sys.executable, "-m", "switchyard", "serve", "--port", str(port)]
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


def start_worker() -> tuple[Proc, int]:
    """A standalone llama.cpp worker: a second, real OpenAI-compatible upstream."""
    port = free_port()
    proc = Proc(
        [
            sys.executable,
            "-m",
            "switchyard.engines.llamacpp_worker",
            "--port",
            str(port),
            "--ctx",
            "2048",
        ],
        "worker",
    )
    try:
        wait_http(f"http://127.0.0.1:{port}/health", proc)
    except Exception:
        proc.stop()
        raise
    return proc, port


@pytest.fixture(scope="session")
def default_gateway() -> Iterator[Gateway]:
    """`switchyard serve` with the embedded default config, shared by read-only tests."""
    gw = start_gateway(None)
    yield gw
    gw.proc.stop()


@pytest.fixture(scope="session")
def second_worker() -> Iterator[int]:
    proc, port = start_worker()
    yield port
    proc.stop()


def local_model(alias: str = "smollm2-135m", **engine: Any) -> dict[str, Any]:
    return {
        "alias": alias,
        "revision": f"{alias}-rev",
        "engine": {"kind": "llamacpp", "gguf": "auto", "threads": 2, "ctx": 2048, **engine},
    }


def start_redis() -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    proc = subprocess.Popen(
        redis_server_argv("redis-server", port, Path(tempfile.mkdtemp(prefix="redis-"))),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    client = redis.Redis(port=port, socket_timeout=1)
    deadline = time.monotonic() + 20
    while True:
        try:
            if client.ping():
                break
        except redis.exceptions.ConnectionError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise RuntimeError("redis-server did not start") from None
            time.sleep(0.05)
    client.close()
    return proc, f"redis://127.0.0.1:{port}/0"


def stop_redis(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


def postgres_binary(name: str) -> str:
    """A PostgreSQL server program (Debian keeps them under /usr/lib/postgresql)."""
    found = sorted(Path("/usr/lib/postgresql").glob(f"*/bin/{name}"))
    if found:
        return str(found[-1])
    path = shutil.which(name)
    if path is None:
        raise RuntimeError(f"{name} not found: `make sysdeps` installs postgresql")
    return path


class Postgres:
    """A throwaway PostgreSQL server on a free loopback port (trust auth, no fsync), its
    data in a temporary folder; `stop()` and `start()` again keep the data and port.
    As root, it runs as the `postgres` user (initdb refuses root)."""

    def __init__(self) -> None:
        self.port = free_port()
        self.root = Path(tempfile.mkdtemp(prefix="pg-"))
        self.url = f"postgresql://switchyard@127.0.0.1:{self.port}/postgres"
        self._as: list[str] = []
        if os.geteuid() == 0:
            shutil.chown(self.root, "postgres")
            # setpriv execs (no wrapper process), so a signal reaches the server itself.
            self._as = ["setpriv", "--reuid=postgres", "--regid=postgres", "--init-groups"]
        subprocess.run(
            [
                *(*self._as, postgres_binary("initdb"), "-D", str(self.root / "data")),
                *("-U", "switchyard", "--auth=trust", "-E", "UTF8", "--no-sync"),
            ],
            check=True,
            capture_output=True,
            timeout=120,
        )
        self.proc: subprocess.Popen[bytes] | None = None
        self.start()

    def start(self) -> None:
        import psycopg

        self.proc = subprocess.Popen(
            [
                *(*self._as, postgres_binary("postgres"), "-D", str(self.root / "data")),
                *("-p", str(self.port), "-k", str(self.root), "-c", "listen_addresses=127.0.0.1"),
                *("-c", "fsync=off", "-c", "synchronous_commit=off", "-c", "full_page_writes=off"),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 30
        while True:
            try:
                psycopg.connect(self.url, connect_timeout=2).close()
                return
            except psycopg.OperationalError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.proc.kill()
                    raise RuntimeError("postgres did not start") from None
                time.sleep(0.1)

    def stop(self) -> None:
        """A fast shutdown (SIGINT: clients are disconnected), then SIGKILL."""
        proc = self.proc
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)


class Scripted:
    def __init__(self, port: int) -> None:
        self.url = f"http://127.0.0.1:{port}"

    def content(self, text: str | None) -> None:
        """Every later reply says `text` (None: the scripted words again)."""
        r = httpx.put(self.url + "/control/content", json={"content": text})
        assert r.status_code == 200, r.text

    def fault(self, spec: str, count: int = 1) -> None:
        r = httpx.put(self.url + "/control/fault", json={"fault": spec, "count": count})
        assert r.status_code == 200, r.text

    def requests(self) -> int:
        return int(httpx.get(self.url + "/stats").json()["requests"])


def start_scripted(*extra: str) -> tuple[Proc, Scripted]:
    port = free_port()
    proc = Proc(
        [sys.executable, "-m", "switchyard.bench.scripted_upstream", "--port", str(port), *extra],
        "scripted",
    )
    wait_http(f"http://127.0.0.1:{port}/health", proc)
    return proc, Scripted(port)


# $1000 per million output tokens: 10 tokens cost exactly $0.01.
CHEAP_PRICE = {"input": 0.0, "output": 1000.0}


def cheap_config(scripted: Scripted, *more: dict[str, Any], **sections: Any) -> dict[str, Any]:
    """A gateway config whose model `cheap` is `scripted` at CHEAP_PRICE, then the
    models `more`; no embedding model; `sections` added at the top level."""
    cheap = {
        "alias": "cheap",
        "engine": {"kind": "openai", "base_url": scripted.url + "/v1"},
        "price": CHEAP_PRICE,
    }
    return {"models": [cheap, *more], "embeddings": {"enabled": False}, **sections}


@pytest.fixture(scope="module")
def scripted() -> Iterator[Scripted]:
    proc, s = start_scripted()
    yield s
    proc.stop()


@pytest.fixture(scope="module")
def two() -> Iterator[tuple[Scripted, Scripted]]:
    """Two scripted upstreams for a module's gateways (two deployments of one alias)."""
    pa, a = start_scripted()
    pb, b = start_scripted()
    yield a, b
    pa.stop()
    pb.stop()


@pytest.fixture(scope="session")
def embed() -> Any:
    """all-MiniLM-L6-v2 from the installed wheel, loaded once for the whole run:
    unit-normalised float32 vectors, like the gateway's embedding service."""
    import numpy as np
    from sentence_transformers import SentenceTransformer

    from switchyard.engines.assets import minilm_model_path

    model = SentenceTransformer(minilm_model_path(), device="cpu")

    def fn(texts: list[str]) -> Any:
        vecs = model.encode(texts, normalize_embeddings=True, convert_to_numpy=True)
        return np.asarray(vecs, np.float32)

    return fn


def fill_store(conn: Any, n: int, filler: str, first_at: float = 1_800_000_000.0) -> None:
    """`n` traces, `n` rollout records and `n` usage rows of ~1.5 KB (`filler` in their
    upstream column or record), one a second from `first_at`, and one daily rollup: a
    store to put over its byte budget."""
    from switchyard.observe.traces import insert_args, insert_sql

    conn.execute("BEGIN")
    for i in range(n):
        at = first_at + i
        rec = {"request_id": f"r{i}", "task_id": None, "tenant_id": "t", "status": "ok",
               "received_at": at, "pad": filler}  # fmt: skip
        conn.execute(insert_sql(), insert_args(rec))
        conn.execute(
            "INSERT INTO usage (request_id, tenant_id, endpoint, status, received_at, upstream)"
            " VALUES (?, 't', 'chat', 'ok', ?, ?)",
            (f"r{i}", at, filler),
        )
        conn.execute(
            "INSERT INTO rollouts (sample_id, request_id, model, revision, created_at, record)"
            " VALUES (?, ?, 'm', 'r', ?, ?)",
            (f"s{i}", f"r{i}", at, filler),
        )
    conn.execute(
        "INSERT INTO usage_daily (day, tenant_id, requests, cost_usd)"
        " VALUES ('2027-01-15', 't', ?, 9.5)",
        (n,),
    )
    conn.execute("COMMIT")
