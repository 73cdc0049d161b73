"""A throwaway `redis-server` on a free loopback port."""

from __future__ import annotations

import subprocess
import tempfile
import time
from pathlib import Path

import redis

from support.procs import free_port
from switchyard.bench.policy import redis_server_argv


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
