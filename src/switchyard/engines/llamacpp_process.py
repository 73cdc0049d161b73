"""One managed engine process: its command line, its launch, its warm-up, its end.

The supervisor (engines/llamacpp.py) decides when a process starts, restarts or stops;
this module does it: the command line of llama-server (or the one-request-at-a-time
Python worker), the spawn on a fresh loopback port (in a session of its own, so a
terminal's Ctrl-C, which reaches the gateway's whole process group, leaves the engine
serving while the gateway drains, and the gateway's shutdown stops it; with the
kernel's parent-death signal, so no orphan keeps a model in memory), the stderr pump
that passes the engine's log through and keeps its last lines, the wait for /health
and the warm-up (a chat prompt of realistic length that must generate several
tokens), and the termination. Exit statuses are described in words (`describe_exit`).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import os
import shutil
import signal
import socket
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import psutil

from switchyard.config import LlamaCppEngine, ManagedEngine
from switchyard.engines.llamacpp_state import AdapterFile, EngineState

# The warm-up: a system prompt and a question of the length agents send (about 60
# prompt tokens with the chat template), generating `warmup_tokens` tokens. A one-token
# prompt can pass where every real prompt crashes (issue #16: AMX on some Xeons).
WARMUP_MESSAGES = [
    {
        "role": "system",
        "content": "You are a concise assistant for a platform team. Answer in one short "
        "sentence, and say so plainly when you do not know.",
    },
    {
        "role": "user",
        "content": "Our gateway sends requests to a local model and to a hosted one. In "
        "one sentence, why would we check that the local model can answer before we "
        "send it traffic?",
    },
]
STDERR_LINES = 20  # kept per worker; the last ones explain a crash
_LINE_CHARS = 400


def describe_exit(code: int | None) -> str:
    """A worker's exit status in words: 'was killed by SIGSEGV', 'exited with code 1'."""
    if code is None:
        return "is still running"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"was killed by {name}"
    return f"exited with code {code}"


def llama_server_binary(spec: LlamaCppEngine) -> str:
    """The llama-server to run: the configured path, else the one make installed next
    to this Python (scripts/build-llama-server.sh), else one on PATH."""
    if spec.binary != "auto":
        return spec.binary
    beside = Path(sys.executable).parent / "llama-server"
    if beside.exists():
        return str(beside)
    found = shutil.which("llama-server")
    if found:
        return found
    raise FileNotFoundError(
        "llama-server is not installed (make builds it with scripts/build-llama-server.sh); "
        "or set the model's engine.runtime to 'worker'"
    )


def rss_mb(pid: int) -> float | None:
    """A process's resident memory in MiB (Linux), or None."""
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            for line in f:
                if line.startswith(b"VmRSS:"):
                    return int(line.split()[1]) / 1024.0
    except (OSError, ValueError, IndexError):
        return None
    return None


def cpu_ticks(pid: int) -> int | None:
    """A process's CPU time so far (user + system, in clock ticks; Linux), or None."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        return int(fields[11]) + int(fields[12])  # utime, stime: fields 14 and 15
    except (OSError, ValueError, IndexError):
        return None


def _info_line(line: str) -> bool:
    """A llama-server log line below warning level ("0.05.015 I srv ...") or the
    continuation of one."""
    if line.startswith(("\t", " ")):
        return True
    parts = line.split(" ", 2)
    return len(parts) > 1 and parts[1] in ("I", "D", "T")


class EngineProcess:
    """The process half of a managed engine, the base of its supervisor
    (ManagedLlamaCpp): launching, watching and stopping one process. Other engines
    (engines/vllm.py) override the hooks marked below."""

    # Set by the supervisor (ManagedLlamaCpp.__init__), which owns this state.
    alias: str
    spec: ManagedEngine
    parent_death_signal: str
    own_session: bool  # started in a session of its own (see the spawn)
    state: EngineState
    port: int | None
    proc: asyncio.subprocess.Process | None
    generation: int
    last_error: str | None
    stderr_tail: collections.deque[str]
    system_info: str | None
    adapter_ids: dict[str, int]
    adapter_loaded_at: dict[str, float]
    _pump: asyncio.Task[None] | None
    _stopping: bool

    # -- the process ----------------------------------------------------------
    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1" if self.port else "http://127.0.0.1:0/v1"

    @property
    def live(self) -> bool:
        return self.proc is not None and self.proc.returncode is None

    # -- hooks (per engine kind) ------------------------------------------------
    @property
    def llama(self) -> LlamaCppEngine:
        assert isinstance(self.spec, LlamaCppEngine)
        return self.spec

    def command(self, model: str, binary: str, port: int, loras: list[AdapterFile]) -> list[str]:
        return self.server_command(binary, model, port, [a.path for a in loras])

    def info_line(self, line: str) -> bool:
        """A log line below warning level, kept out of the gateway's log once ready."""
        return self.spec_runtime() == "server" and _info_line(line)

    def spec_runtime(self) -> str:
        return self.llama.runtime

    async def after_health(self, session: aiohttp.ClientSession) -> bool:
        """Once the server answers /health, before the warm-up: llama-server's adapters
        start at scale 0 globally (a request that names none must get the base)."""
        if not self.adapter_ids:
            return True
        zero = [{"id": i, "scale": 0.0} for i in self.adapter_ids.values()]
        try:
            async with session.post(
                self.base_url.removesuffix("/v1") + "/lora-adapters", json=zero
            ) as r:
                if r.status != 200:
                    self.last_error = f"setting the adapters' scales answered {r.status}"
                    return False
        except (aiohttp.ClientError, OSError, TimeoutError) as exc:
            self.last_error = f"setting the adapters' scales failed ({type(exc).__name__})"
            return False
        return True

    def env(self) -> dict[str, str] | None:
        """The engine process's environment (None: the gateway's own)."""
        return None

    # -- launch, readiness, termination -----------------------------------------
    async def _terminate(self) -> None:
        proc = self.proc
        if proc is None or proc.returncode is not None:
            return
        # What it started, known while they are still its descendants: once it exits
        # they are reparented and nothing names them as the engine's any more.
        started = _descendants(proc.pid)
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(proc.wait(), 10)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()
        if self.own_session:  # what is left of the group it led goes with it
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
        # Outside a session of its own (vLLM) its workers were seen to outlive it for
        # seconds at most of a core: asked to stop, then killed after a grace.
        await stop_leftovers(started, LEFTOVER_GRACE_S)

    def server_command(self, binary: str, gguf: str, port: int, loras: list[str]) -> list[str]:
        """llama-server with `parallel` slots of `ctx` tokens each (continuous batching
        is its default), its /metrics and /slots on, and the adapters loaded unapplied:
        each request names the one it uses."""
        spec = self.llama
        cmd = [
            binary,
            "--model",
            gguf,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--alias",
            self.alias,
            "--ctx-size",
            str(spec.ctx * spec.parallel),
            "--parallel",
            str(spec.parallel),
            "--threads",
            str(spec.threads),
            "--threads-batch",
            str(spec.threads),
            "--metrics",
            "--slots",
            "--no-webui",
            "--verbosity",
            "4",
        ]
        if not spec.extra_buffer_types:
            cmd.append("--no-repack")
        for path in loras:
            cmd += ["--lora", path]
        if loras:
            cmd.append("--lora-init-without-apply")
        return cmd

    def worker_command(self, gguf: str, fd: int) -> list[str]:
        spec = self.llama
        cmd = [
            sys.executable,
            "-m",
            "switchyard.engines.llamacpp_worker",
            "--gguf",
            gguf,
            "--ctx",
            str(spec.ctx),
            "--threads",
            str(spec.threads),
            "--fd",
            str(fd),
        ]
        if spec.chat_format:
            cmd += ["--chat-format", spec.chat_format]
        if spec.extra_buffer_types:
            cmd.append("--extra-buffer-types")
        return cmd

    async def _spawn(self, model: str, binary: str, loras: list[AdapterFile]) -> None:
        self.state = EngineState.STARTING
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        self.stderr_tail.clear()
        self.system_info = None
        self.adapter_ids = {}
        try:
            if binary:
                # llama-server binds its own port: the one just picked, freed for it
                # (another process taking it in between fails this start, which is
                # retried on a new port like any failed start).
                sock.close()
                cmd = self.command(model, binary, self.port, loras)
                # If the gateway dies without stopping it, the kernel signals the
                # server (Linux's parent-death signal, set by util-linux's setpriv
                # before it execs the server), so no orphan keeps a model in memory.
                setpriv = shutil.which("setpriv")
                if setpriv is not None:
                    cmd = [setpriv, "--pdeathsig", self.parent_death_signal, "--", *cmd]
                # llama-server in a session of its own (`own_session`): a terminal's
                # Ctrl-C (SIGINT to the foreground process group) reaches the gateway,
                # which drains its requests and then stops the engine (`_terminate`),
                # instead of killing the engine under them. (The Python worker blocks
                # SIGINT itself.)
                self.proc = await asyncio.create_subprocess_exec(
                    *cmd,
                    stdin=asyncio.subprocess.DEVNULL,
                    stderr=asyncio.subprocess.PIPE,
                    stdout=asyncio.subprocess.DEVNULL,
                    env=self.env(),
                    start_new_session=self.own_session,
                )
                self.adapter_ids = {a.name: i for i, a in enumerate(loras)}
                now = time.monotonic()
                self.adapter_loaded_at = {a.name: now for a in loras}
            else:
                sock.listen(128)
                fd = sock.fileno()
                self.proc = await asyncio.create_subprocess_exec(
                    *self.worker_command(model, fd), pass_fds=(fd,), stderr=asyncio.subprocess.PIPE
                )
        finally:
            sock.close()  # the worker holds its own copy
        self.generation += 1
        assert self.proc.stderr is not None
        self._pump = asyncio.create_task(self._pump_stderr(self.proc.stderr))
        self.state = EngineState.LOADING

    async def _pump_stderr(self, stream: asyncio.StreamReader) -> None:
        """Pass the engine's stderr through to ours, keeping the last lines. llama-server
        runs at verbosity 4, the level at which it states its instruction sets; once it
        is ready only its warnings and errors are passed on (its per-request info
        lines are kept in the tail, which explains a crash)."""
        prefix = f"[engine {self.alias}] "
        while True:
            try:
                raw = await stream.readline()
            except ValueError:  # a line over the reader's limit: take what is there
                raw = await stream.read(65536)
            if not raw:
                return
            line = raw.decode("utf-8", "replace").rstrip()
            if not line:
                continue
            at = line.find("system_info:")
            if at >= 0:  # llama-server's account of its instruction sets, at start
                self.system_info = line[at + len("system_info:") :].strip()[:_LINE_CHARS]
            self.stderr_tail.append(line[:_LINE_CHARS])
            if self.state is EngineState.READY and self.info_line(line):
                continue
            with contextlib.suppress(Exception):
                sys.stderr.write(prefix + line + "\n")
                sys.stderr.flush()

    async def _drain_stderr(self) -> None:
        """After the worker exited: wait (briefly) for its last stderr lines."""
        pump, self._pump = self._pump, None
        if pump is None:
            return
        try:
            await asyncio.wait_for(pump, 2)
        except (TimeoutError, asyncio.CancelledError):
            pump.cancel()

    def _died(self, phase: str) -> bool:
        if self.live:
            return False
        assert self.proc is not None
        self.last_error = f"worker {describe_exit(self.proc.returncode)} while {phase}"
        return True

    async def _await_ready(self) -> bool:
        """Wait until the worker's server answers, then send the warm-up: a chat prompt
        of realistic length that must generate `warmup_tokens` tokens. False (with the
        reason in last_error) if the worker dies, fails the warm-up or runs out of time."""
        deadline = time.perf_counter() + self.spec.startup_timeout_s
        warmup = {
            "model": self.alias,
            "messages": WARMUP_MESSAGES,
            "max_tokens": self.spec.warmup_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
        }
        timeout = aiohttp.ClientTimeout(total=30, sock_connect=1)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            health: dict[str, Any] | None = None
            while health is None:  # loading: the server listens once the model loaded
                if self._stopping or self._died("loading the model"):
                    return False
                if time.perf_counter() >= deadline:
                    self.last_error = (
                        f"the model did not load within {self.spec.startup_timeout_s}s"
                    )
                    return False
                try:
                    async with session.get(self.base_url.removesuffix("/v1") + "/health") as r:
                        if r.status == 200:  # vLLM answers with an empty body
                            raw = await r.read()
                            try:
                                parsed = orjson.loads(raw) if raw.strip() else {}
                            except ValueError:
                                parsed = {}
                            health = parsed if isinstance(parsed, dict) else {}
                except (aiohttp.ClientError, OSError, TimeoutError, ValueError):
                    pass
                if health is None:
                    await asyncio.sleep(0.2)
            if health.get("system_info"):  # the worker says it here; the server on stderr
                self.system_info = str(health["system_info"])
            if not await self.after_health(session):
                return False
            remaining = max(1.0, deadline - time.perf_counter())
            try:
                async with session.post(
                    self.base_url + "/chat/completions",
                    json=warmup,
                    timeout=aiohttp.ClientTimeout(total=remaining, sock_connect=1),
                ) as r:
                    raw = await r.read()
                    status = r.status
            except (aiohttp.ClientError, OSError, TimeoutError) as exc:
                # Give the exit a moment to be seen: a crash breaks the connection first.
                if self.proc is not None:
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(asyncio.shield(self.proc.wait()), 1)
                if not self._died("warming up (a multi-token chat prompt)"):
                    self.last_error = f"the warm-up request failed ({type(exc).__name__})"
                return False
            if status != 200:
                self.last_error = f"the warm-up request answered HTTP {status}"
                return False
            try:
                usage = orjson.loads(raw)["usage"]
                generated = int(usage["completion_tokens"])
            except (ValueError, KeyError, TypeError):
                self.last_error = "the warm-up reply was not a chat completion"
                return False
            if generated < 2:
                self.last_error = f"the warm-up generated {generated} token(s), not several"
                return False
            return True


LEFTOVER_GRACE_S = 5.0


def _descendants(pid: int) -> list[psutil.Process]:
    """Every process `pid` started, and theirs (none once it is gone)."""
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return []


async def stop_leftovers(procs: list[psutil.Process], grace_s: float) -> None:
    """Stop those of `procs` still running: SIGTERM, then SIGKILL after `grace_s`. A
    psutil.Process knows its start time, so a pid reused since is never signalled."""
    alive = [p for p in procs if _running(p)]
    for p in alive:
        with contextlib.suppress(psutil.Error):
            p.terminate()
    deadline = time.monotonic() + grace_s
    while alive and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
        alive = [p for p in alive if _running(p)]
    for p in alive:
        with contextlib.suppress(psutil.Error):
            p.kill()
    deadline = time.monotonic() + 1.0  # SIGKILL is not refused, but takes a moment
    while alive and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
        alive = [p for p in alive if _running(p)]


def _running(p: psutil.Process) -> bool:
    """Still running: not gone, not a pid reused since, not a zombie (one that has
    exited and waits for whoever adopted it to read its status)."""
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False
