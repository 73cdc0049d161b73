"""Fixtures that start real processes on loopback: gateways, workers, upstreams."""

from __future__ import annotations

import contextlib
import os
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
import yaml

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


class Gateway:
    def __init__(self, proc: Proc, port: int, config: dict[str, Any] | None) -> None:
        self.proc = proc
        self.port = port
        self.config = config
        self.url = f"http://127.0.0.1:{port}"

    def openai(self, **kw: Any) -> Any:
        from openai import OpenAI

        return OpenAI(base_url=self.url + "/v1", api_key="test-key", max_retries=0, **kw)


def start_gateway(config: dict[str, Any] | None, wait_ready: bool = True) -> Gateway:
    port = free_port()
    args = [sys.executable, "-m", "switchyard", "serve", "--port", str(port)]
    if config is not None:
        fd, path = tempfile.mkstemp(suffix=".yaml", prefix="switchyard-")
        with os.fdopen(fd, "w") as f:
            yaml.safe_dump(config, f)
        args += ["--config", path]
    proc = Proc(args, "gateway")
    gw = Gateway(proc, port, config)
    try:
        wait_http(gw.url + "/healthz", proc)
        if wait_ready:
            wait_http(gw.url + "/readyz", proc)
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
