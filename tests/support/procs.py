"""Child processes on loopback: a free port, a process with its log, waiting for HTTP."""

from __future__ import annotations

import contextlib
import http.server
import os
import signal
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

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
    last: int | str | None = None
    while time.monotonic() < deadline:
        if proc.popen.poll() is not None:
            raise RuntimeError(f"{proc.name} exited early:\n{proc.output()[-4000:]}")
        try:
            r = httpx.get(url, timeout=2)
            if r.status_code == status:
                return
            last = f"{r.status_code} {r.text[:1500]}"  # what is not ready, if it says
        except httpx.HTTPError as exc:
            last = repr(exc)
        time.sleep(0.2)
    raise RuntimeError(
        f"{url} not {status} after {timeout_s}s (last: {last}):\n{proc.output()[-4000:]}"
    )


def worker_pids(supervisor_pid: int, marker: bytes = b"switchyard.scale.worker") -> list[int]:
    """The pids of a `serve --workers N` supervisor's workers: its children running
    scale/worker (or, with `marker`, its children whose command line holds that)."""
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read()
        except OSError:
            continue
        if ppid == supervisor_pid and marker in cmd:
            found.append(int(pid))
    return found


@contextlib.contextmanager
def http_server(handler: type[http.server.BaseHTTPRequestHandler]) -> Iterator[str]:
    """`handler` served on a free loopback port by a thread: its base URL, until the
    block ends."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def kill_workers(supervisor_pid: int, workers: int = 2) -> None:
    """SIGKILL every worker of a `serve --workers N` supervisor (whichever served a
    request dies with them); the supervisor starts them again."""
    pids = worker_pids(supervisor_pid)
    assert len(pids) == workers, pids
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
