"""Supervisor of one managed llama.cpp worker process.

Liveness (the process is up) and readiness (the model answered a one-token warm-up
over the same HTTP API the gateway uses) are separate states. A worker that dies is
restarted with exponential backoff; the gateway keeps serving other models meanwhile
and answers 503 with Retry-After for this one.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import os
import signal
import socket
import sys
import time
from typing import Any

import aiohttp

from switchyard.config import LlamaCppEngine
from switchyard.engines.assets import smollm2_gguf_path

log = logging.getLogger("switchyard.engine")


class EngineState(enum.StrEnum):
    STARTING = "starting"  # process being spawned
    LOADING = "loading"  # process alive, model not yet answering
    READY = "ready"
    RESTARTING = "restarting"  # died; waiting out the backoff
    STOPPED = "stopped"
    FAILED = "failed"  # cannot start at all (e.g. model file missing)


class ManagedLlamaCpp:
    def __init__(self, alias: str, spec: LlamaCppEngine) -> None:
        self.alias = alias
        self.spec = spec
        self.state = EngineState.STOPPED
        self.port: int | None = None
        self.proc: asyncio.subprocess.Process | None = None
        self.restarts = 0
        self.last_error: str | None = None
        self.ready_since: float | None = None
        self.cold_start_s: float | None = None
        self._task: asyncio.Task[None] | None = None
        self._stopping = False
        self._ready_event = asyncio.Event()

    # -- public state -------------------------------------------------------
    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1" if self.port else "http://127.0.0.1:0/v1"

    @property
    def live(self) -> bool:
        return self.proc is not None and self.proc.returncode is None

    @property
    def ready(self) -> bool:
        return self.state is EngineState.READY and self.live

    def describe(self) -> dict[str, Any]:
        return {
            "kind": "llamacpp",
            "state": self.state.value,
            "live": self.live,
            "ready": self.ready,
            "pid": self.proc.pid if self.live and self.proc else None,
            "upstream": self.base_url if self.port else None,
            "restarts": self.restarts,
            "cold_start_s": None if self.cold_start_s is None else round(self.cold_start_s, 3),
            "last_error": self.last_error,
        }

    async def wait_ready(self, timeout_s: float) -> bool:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._ready_event.wait(), timeout_s)
        return self.ready

    # -- lifecycle ------------------------------------------------------------
    def start(self) -> None:
        if self._task is None:
            self._stopping = False
            self._task = asyncio.create_task(self._supervise(), name=f"engine:{self.alias}")

    async def stop(self) -> None:
        self._stopping = True
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
            self._task = None
        await self._terminate()
        self.state = EngineState.STOPPED
        self._ready_event.clear()

    async def _terminate(self) -> None:
        proc = self.proc
        if proc is None or proc.returncode is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(proc.wait(), 10)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()

    async def _supervise(self) -> None:
        backoff = self.spec.restart_backoff_s
        while not self._stopping:
            try:
                gguf = smollm2_gguf_path() if self.spec.gguf == "auto" else self.spec.gguf
                if not os.path.exists(gguf):
                    raise FileNotFoundError(f"GGUF file not found: {gguf}")
            except Exception as exc:
                self.state = EngineState.FAILED
                self.last_error = str(exc)
                log.error("engine %s cannot start: %s", self.alias, exc)
                return
            started = time.perf_counter()
            await self._spawn(gguf)
            if await self._await_ready():
                self.cold_start_s = time.perf_counter() - started
                self.state = EngineState.READY
                self.ready_since = time.time()
                self._ready_event.set()
                backoff = self.spec.restart_backoff_s
                log.info(
                    "engine %s ready on port %s in %.1fs", self.alias, self.port, self.cold_start_s
                )
                assert self.proc is not None
                code = await self.proc.wait()
                self.last_error = f"worker exited with code {code}"
            else:
                await self._terminate()
            if self._stopping:
                return
            self._ready_event.clear()
            self.state = EngineState.RESTARTING
            self.restarts += 1
            log.warning(
                "engine %s down (%s); restarting in %.1fs", self.alias, self.last_error, backoff
            )
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, self.spec.restart_backoff_max_s)

    async def _spawn(self, gguf: str) -> None:
        self.state = EngineState.STARTING
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        sock.listen(128)
        self.port = sock.getsockname()[1]
        fd = sock.fileno()
        cmd = [
            sys.executable,
            "-m",
            "switchyard.engines.llamacpp_worker",
            "--gguf",
            gguf,
            "--ctx",
            str(self.spec.ctx),
            "--threads",
            str(self.spec.threads),
            "--fd",
            str(fd),
        ]
        if self.spec.chat_format:
            cmd += ["--chat-format", self.spec.chat_format]
        try:
            self.proc = await asyncio.create_subprocess_exec(*cmd, pass_fds=(fd,))
        finally:
            sock.close()  # the child holds its own copy
        self.state = EngineState.LOADING

    async def _await_ready(self) -> bool:
        """Poll until the worker answers a one-token chat completion, or give up."""
        deadline = time.perf_counter() + self.spec.startup_timeout_s
        warmup = {
            "model": self.alias,
            "messages": [{"role": "user", "content": "Hi"}],
            "max_tokens": 1,
        }
        timeout = aiohttp.ClientTimeout(total=30, sock_connect=1)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            while time.perf_counter() < deadline and not self._stopping:
                if not self.live:
                    assert self.proc is not None
                    self.last_error = (
                        f"worker exited with code {self.proc.returncode} while loading"
                    )
                    return False
                try:
                    async with session.post(self.base_url + "/chat/completions", json=warmup) as r:
                        if r.status == 200:
                            await r.read()
                            return True
                        self.last_error = f"warm-up answered HTTP {r.status}"
                except (aiohttp.ClientError, OSError, TimeoutError) as exc:
                    self.last_error = f"warm-up failed: {type(exc).__name__}"
                await asyncio.sleep(0.2)
        if not self._stopping:
            self.last_error = f"not ready within {self.spec.startup_timeout_s}s"
        return False
