"""The engine supervisor over real child processes that crash the ways engines do.

The subject is the real `ManagedLlamaCpp`; only the worker it starts is replaced, by a
small real program that dies at load or at the warm-up (killed by a real SIGSEGV, or
exiting with an error), so every path of "the engine cannot start" runs in seconds.
"""

from __future__ import annotations

import asyncio
import signal
import sys
import textwrap
import time
from pathlib import Path

import pytest

from switchyard.config import LlamaCppEngine
from switchyard.engines.llamacpp import EngineState, ManagedLlamaCpp, describe_exit

# Prints what a crashing llama.cpp prints, then dies by SIGSEGV before it listens.
CRASH_AT_LOAD = """
import os, signal, sys
print("load_tensors: AMX model buffer size = 95.00 MiB", file=sys.stderr, flush=True)
print("ggml_amx: repack tensor blk.0.attn_q.weight of type q4_1", file=sys.stderr, flush=True)
os.kill(os.getpid(), signal.SIGSEGV)
"""

# Answers /health like the worker, then dies by SIGSEGV on the warm-up request: what
# issue #16 saw (a one-token prompt would answer; a real prompt crashes).
CRASH_AT_WARMUP = """
import json, os, signal, socket, sys
from http.server import BaseHTTPRequestHandler, HTTPServer

fd = int(sys.argv[sys.argv.index("--fd") + 1])

class H(BaseHTTPRequestHandler):
    def do_GET(self):
        body = json.dumps({"status": "ok", "system_info": "CPU : AVX2 = 1 | AMX_INT8 = 1"})
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body.encode())

    def do_POST(self):
        print("ggml_compute_forward: evaluating 61 prompt tokens", file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGSEGV)

    def log_message(self, *a):
        pass

srv = HTTPServer(("127.0.0.1", 0), H, bind_and_activate=False)
srv.socket.close()
srv.socket = socket.socket(fileno=fd)
srv.serve_forever()
"""

EXIT_AT_LOAD = """
import sys
print("Traceback (most recent call last):", file=sys.stderr)
print("ValueError: Failed to load model from file: /models/x.gguf", file=sys.stderr)
sys.exit(1)
"""


class ScriptedWorker(ManagedLlamaCpp):
    """The real supervisor, starting a scripted program instead of llama.cpp."""

    def __init__(self, script: str, tmp: Path, **kw: object) -> None:
        gguf = tmp / "model.gguf"
        gguf.write_bytes(b"GGUF")
        spec = LlamaCppEngine(
            kind="llamacpp",
            runtime="worker",  # the scripted program speaks the worker's --fd protocol
            gguf=str(gguf),
            restart_backoff_s=0.05,
            startup_timeout_s=20,
        )
        super().__init__("crashy", spec, **kw)  # type: ignore[arg-type]
        self.script = tmp / "worker.py"
        self.script.write_text(textwrap.dedent(script))
        self.spawned = 0

    def worker_command(self, gguf: str, fd: int) -> list[str]:
        self.spawned += 1
        return [sys.executable, str(self.script), "--fd", str(fd)]


async def _settle(engine: ManagedLlamaCpp, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while engine.state not in (EngineState.FAILED, EngineState.READY):
        assert time.monotonic() < deadline, f"still {engine.state} after {timeout_s}s"
        await asyncio.sleep(0.02)


def _run_until_settled(engine: ScriptedWorker) -> None:
    async def go() -> None:
        engine.start()
        try:
            await _settle(engine)
            # A failed engine is not restarted again: nothing more is spawned.
            spawned = engine.spawned
            await asyncio.sleep(0.3)
            assert engine.spawned == spawned
        finally:
            await engine.stop()

    asyncio.run(asyncio.wait_for(go(), 60))


@pytest.mark.parametrize("limit", [1, 3])
def test_crash_at_load_ends_failed_after_the_configured_starts(tmp_path: Path, limit: int) -> None:
    engine = ScriptedWorker(CRASH_AT_LOAD, tmp_path, max_crash_restarts=limit)
    _run_until_settled(engine)
    info = engine.describe()
    assert info["state"] == "failed"
    assert engine.spawned == limit
    assert info["failed_starts"] == limit
    assert "killed by SIGSEGV while loading the model" in info["reason"]
    assert f"{limit} failed starts in a row" in info["reason"]
    # The last lines of the worker's stderr say what it was doing.
    assert any("repack tensor" in line for line in info["stderr_tail"])


def test_crash_at_warmup_is_named_and_keeps_the_system_info(tmp_path: Path) -> None:
    engine = ScriptedWorker(CRASH_AT_WARMUP, tmp_path, max_crash_restarts=2)
    _run_until_settled(engine)
    info = engine.describe()
    assert info["state"] == "failed" and engine.spawned == 2
    assert "killed by SIGSEGV while warming up" in info["reason"]
    assert info["system_info"] == "CPU : AVX2 = 1 | AMX_INT8 = 1"
    assert any("61 prompt tokens" in line for line in info["stderr_tail"])


def test_error_exit_at_load_reports_code_and_traceback(tmp_path: Path) -> None:
    engine = ScriptedWorker(EXIT_AT_LOAD, tmp_path, max_crash_restarts=2)
    _run_until_settled(engine)
    info = engine.describe()
    assert "exited with code 1 while loading the model" in info["reason"]
    assert info["stderr_tail"][-1].startswith("ValueError: Failed to load model")


def test_missing_model_file_fails_at_once(tmp_path: Path) -> None:
    engine = ScriptedWorker(CRASH_AT_LOAD, tmp_path)
    engine.spec = engine.spec.model_copy(update={"gguf": "/nonexistent"})
    _run_until_settled(engine)
    assert engine.spawned == 0
    assert "GGUF file not found: /nonexistent" in (engine.reason or "")


@pytest.mark.parametrize(
    ("code", "words"),
    [
        (-signal.SIGSEGV, "was killed by SIGSEGV"),
        (-signal.SIGKILL, "was killed by SIGKILL"),
        (-signal.SIGABRT, "was killed by SIGABRT"),
        (-200, "was killed by signal 200"),
        (1, "exited with code 1"),
        (0, "exited with code 0"),
        (None, "is still running"),
    ],
)
def test_exit_status_in_words(code: int | None, words: str) -> None:
    assert describe_exit(code) == words
