"""Upstreams the gateways under test forward to: the scripted instant upstream (with its
fault switch) and a standalone llama.cpp worker."""

from __future__ import annotations

import sys

import httpx

from support.procs import Proc, free_port, wait_http


class Scripted:
    """The scripted upstream (`switchyard.bench.scripted_upstream`) at `url`, and its
    control switches: the reply's content, injected faults, the request count."""

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
