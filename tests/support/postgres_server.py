"""A throwaway PostgreSQL server on a free loopback port."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

from support.procs import free_port


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


def fresh(server: str) -> str:
    """A new, empty database on the server: its URI."""
    import psycopg

    name = f"sy_{os.urandom(4).hex()}"
    with psycopg.connect(server, autocommit=True) as c:
        c.execute(f"CREATE DATABASE {name}")
    return server.rsplit("/", 1)[0] + "/" + name
