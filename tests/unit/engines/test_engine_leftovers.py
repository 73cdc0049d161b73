"""Stopping a managed engine stops what it started (engines/llamacpp_process.py): a
process the engine left running when it exited is asked to stop, then killed."""

from __future__ import annotations

import asyncio
import signal
import sys
import time

import psutil
import pytest

from switchyard.engines import llamacpp_process
from switchyard.engines.vllm import ManagedVllm

# An engine that starts a worker which does not stop with it (as vLLM's were seen to),
# prints the worker's pid, and exits on SIGTERM (Python's default for it).
# The worker says when it has set itself up.
ENGINE = """
import subprocess, sys, time
w = subprocess.Popen([sys.executable, "-c", WORKER], stdout=subprocess.PIPE)
w.stdout.readline()
print(w.pid, flush=True)
time.sleep(120)
"""
WORKER = "import time; print('ready', flush=True); time.sleep(120)"
WORKER_IGNORES_TERM = (
    "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
    "print('ready', flush=True); time.sleep(120)"
)


async def _engine_with_worker(worker: str) -> tuple[ManagedVllm, psutil.Process]:
    engine = ManagedVllm.__new__(ManagedVllm)  # what `_terminate` reads: its process
    engine.proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", f"WORKER = {worker!r}\n{ENGINE}", stdout=asyncio.subprocess.PIPE
    )
    assert engine.proc.stdout is not None
    line = await asyncio.wait_for(engine.proc.stdout.readline(), 30)
    return engine, psutil.Process(int(line))


def _gone(p: psutil.Process) -> bool:
    try:
        return not p.is_running() or p.status() == psutil.STATUS_ZOMBIE
    except psutil.Error:
        return True


async def _stopped(engine: ManagedVllm) -> None:
    assert engine.proc is not None and engine.proc.stdout is not None
    await engine.proc.stdout.read()  # to its end: the pipe is closed before the loop is


def test_a_worker_left_by_a_stopped_engine_is_stopped() -> None:
    async def main() -> None:
        engine, worker = await _engine_with_worker(WORKER)
        await engine._terminate()
        assert engine.proc is not None and engine.proc.returncode == -signal.SIGTERM
        assert _gone(worker)
        await _stopped(engine)

    asyncio.run(main())


def test_a_worker_that_ignores_sigterm_is_killed_after_the_grace(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(llamacpp_process, "LEFTOVER_GRACE_S", 0.5)

    async def main() -> None:
        engine, worker = await _engine_with_worker(WORKER_IGNORES_TERM)
        started = time.monotonic()
        await engine._terminate()
        assert _gone(worker)
        assert time.monotonic() - started < 10  # the grace, not the worker's 120 s
        await _stopped(engine)

    asyncio.run(main())
