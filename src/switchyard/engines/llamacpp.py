"""Supervisor of one managed llama.cpp process: llama.cpp's own server (`llama-server`,
the default runtime) or the one-request-at-a-time Python worker.

Liveness (the process is up) and readiness (the model generated several tokens for a
chat prompt of realistic length, over the same HTTP API the gateway uses) are separate
states. A worker that served and then died is restarted with exponential backoff; the
gateway keeps serving other models meanwhile and answers 503 with Retry-After for this
one. A worker that dies (or never answers) before it is ready `max_crash_restarts`
times in a row is `failed`: it is not restarted, and its reason (the exit signal by
name, the last lines of its stderr) is in /readyz, in the log and in the 503
`engine_failed` its requests get.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import enum
import hashlib
import logging
import os
import shutil
import signal
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from switchyard.config import LlamaCppEngine, ManagedEngine
from switchyard.engines.assets import smollm2_gguf_path

log = logging.getLogger("switchyard.engine")

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


def sha256_file(path: str | os.PathLike[str]) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


@dataclass(frozen=True, slots=True)
class AdapterFile:
    """An adapter an engine loads at start: its id in the server is its position."""

    name: str
    path: str
    sha256: str
    revision: str


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


def _info_line(line: str) -> bool:
    """A llama-server log line below warning level ("0.05.015 I srv ...") or the
    continuation of one."""
    if line.startswith(("\t", " ")):
        return True
    parts = line.split(" ", 2)
    return len(parts) > 1 and parts[1] in ("I", "D", "T")


class EngineState(enum.StrEnum):
    COLD = "cold"  # not loaded; the pool loads it on demand
    STARTING = "starting"  # process being spawned
    LOADING = "loading"  # process alive, model not yet answering
    READY = "ready"
    RESTARTING = "restarting"  # died; waiting out the backoff
    STOPPED = "stopped"
    FAILED = "failed"  # cannot start: file missing, or crashed max_crash_restarts times


class ManagedLlamaCpp:
    """The supervisor of one managed engine process. llama.cpp's server (or worker) is
    this class; other engines (engines/vllm.py) override the hooks marked below."""

    kind = "llamacpp"
    # What the kernel sends the server when the gateway dies without stopping it.
    # SIGKILL: llama-server keeps nothing worth a graceful exit once its gateway is
    # gone, and its SIGTERM handler, which waits for its HTTP loop, was seen to leave
    # it alive for over 20 s on a loaded machine (tests/test_observe.py, kill -9).
    parent_death_signal = "KILL"

    def __init__(
        self,
        alias: str,
        spec: ManagedEngine,
        max_crash_restarts: int = 3,
        adapters: tuple[AdapterFile, ...] = (),
    ) -> None:
        self.alias = alias
        self.spec = spec
        self.max_crash_restarts = max_crash_restarts
        self.adapters = adapters
        # The adapters the running server loaded, by name -> its id there; those whose
        # file failed its checksum are refused (name -> why) and the base still serves.
        self.adapter_ids: dict[str, int] = {}
        self.adapter_errors: dict[str, str] = {}
        self.adapter_in_flight: dict[str, int] = {}  # requests now using each adapter
        # Adapter residency (engines/pool.py): the ones to load at start (at most
        # max_adapters; the others are cold on disk), when each was loaded and last
        # used, the requests waiting for an active slot (in order), the adapters
        # being loaded, and the requests that hold the engine while they wait.
        self.adapter_set: list[str] = [a.name for a in adapters[: spec.max_adapters]]
        self.adapter_loaded_at: dict[str, float] = {}
        self.adapter_last_used: dict[str, float] = {}
        self.adapter_waiters: collections.deque[asyncio.Event] = collections.deque()
        self.adapter_loading: set[str] = set()
        self.adapter_pending = 0
        self.adapter_lock = asyncio.Lock()  # one adapter load per engine at a time
        # Set while the engine drains and restarts to change its adapters (llama-server
        # loads adapters only at start): new requests wait for it.
        self.draining: asyncio.Event | None = None
        self.state = EngineState.COLD if spec.lazy else EngineState.STOPPED
        self.port: int | None = None
        self.proc: asyncio.subprocess.Process | None = None
        self.generation = 0  # one per spawned worker: tells a request which one it used
        self.restarts = 0
        self.failed_starts = 0  # consecutive, reset once a worker is ready
        self.last_error: str | None = None
        self.reason: str | None = None  # why the engine is failed, in plain words
        self.stderr_tail: collections.deque[str] = collections.deque(maxlen=STDERR_LINES)
        self.system_info: str | None = None
        self.ready_since: float | None = None
        self.cold_start_s: float | None = None
        self._task: asyncio.Task[None] | None = None
        self._pump: asyncio.Task[None] | None = None
        self._stopping = False
        self._ready_event = asyncio.Event()
        self._settled = asyncio.Event()  # ready or failed: startup has an outcome
        # Residency (engines/pool.py): when it was loaded and last used, requests now
        # using it, its measured memory.
        self.loaded_at: float | None = None
        self.last_used = 0.0
        self.in_flight = 0
        # Busy time: seconds with at least one request held on it (from residency to
        # the end of its reply), for the cost report's utilization (observe/cost.py).
        self.busy_s = 0.0
        self.busy_since: float | None = None
        self.loads = 0
        self.memory_mb: float | None = None

    # -- public state -------------------------------------------------------
    def busy_now(self, now: float | None = None) -> float:
        """Busy seconds since start, the current busy stretch included."""
        if self.busy_since is None:
            return self.busy_s
        return self.busy_s + (time.monotonic() if now is None else now) - self.busy_since

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1" if self.port else "http://127.0.0.1:0/v1"

    @property
    def live(self) -> bool:
        return self.proc is not None and self.proc.returncode is None

    @property
    def ready(self) -> bool:
        return self.state is EngineState.READY and self.live

    @property
    def failed(self) -> bool:
        return self.state is EngineState.FAILED

    @property
    def cold(self) -> bool:
        return self.state is EngineState.COLD

    @property
    def loading(self) -> bool:
        return self._task is not None and not self.ready and not self.failed

    def measure(self) -> float | None:
        """Its process's resident memory now (MiB), kept as memory_mb."""
        if self.live and self.proc is not None:
            mb = rss_mb(self.proc.pid)
            if mb is not None:
                self.memory_mb = mb
        return self.memory_mb

    # -- hooks (per engine kind) ------------------------------------------------
    @property
    def llama(self) -> LlamaCppEngine:
        assert isinstance(self.spec, LlamaCppEngine)
        return self.spec

    def runtime_info(self) -> dict[str, Any]:
        spec = self.llama
        return {
            "runtime": spec.runtime,
            "parallel": spec.parallel if spec.runtime == "server" else 1,
            "extra_buffer_types": spec.extra_buffer_types,
        }

    def resolve(self) -> tuple[str, str]:
        """(the model file, the server binary or "" for the worker); raises with why
        the engine cannot be started (FileNotFoundError: not restarted)."""
        spec = self.llama
        gguf = smollm2_gguf_path() if spec.gguf == "auto" else spec.gguf
        if not os.path.exists(gguf):
            raise FileNotFoundError(f"the model file cannot be used: GGUF file not found: {gguf}")
        return gguf, llama_server_binary(spec) if spec.runtime == "server" else ""

    def command(self, model: str, binary: str, port: int, loras: list[AdapterFile]) -> list[str]:
        return self.server_command(binary, model, port, [a.path for a in loras])

    def adapter_digest_path(self, a: AdapterFile) -> str:
        """The file whose sha256 the registry holds for this adapter."""
        return a.path

    def estimated_mb(self) -> float | None:
        """Memory before the first load, from the model file and its KV cache."""
        from switchyard.engines.pool import estimate_gguf_mb

        spec = self.llama
        try:
            path = smollm2_gguf_path() if spec.gguf == "auto" else spec.gguf
        except Exception:
            return None
        tokens = spec.ctx * (spec.parallel if spec.runtime == "server" else 1)
        return estimate_gguf_mb(path, tokens)

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

    def adapter_file(self, name: str) -> AdapterFile | None:
        return next((a for a in self.adapters if a.name == name), None)

    async def swap_adapter(self, evict: str | None, load: AdapterFile) -> bool:
        """Unload `evict` and load `load` in the running server, at run time. False:
        this engine loads adapters only at start (llama-server), so the pool drains and
        restarts it with its new set. Raises RuntimeError with why on a failure."""
        return False

    @property
    def isolate_base(self) -> bool:
        """Whether base requests must not share a batch with adapter requests (they
        take turns: engines/pool.py). llama-server mixes them correctly."""
        return False

    def lora_scales(self, adapter: str | None) -> list[dict[str, Any]]:
        """A request's `lora` list: every loaded adapter with its scale, 1 for
        `adapter` and 0 for the rest (all 0 for the base). Always the full list:
        llama-server applies an empty list as "every adapter at its global scale", which
        is 1 for an adapter loaded at start."""
        ident = self.adapter_ids.get(adapter) if adapter is not None else None
        return [
            {"id": i, "scale": 1.0 if i == ident else 0.0}
            for i in sorted(self.adapter_ids.values())
        ]

    def env(self) -> dict[str, str] | None:
        """The engine process's environment (None: the gateway's own)."""
        return None

    def describe(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            **self.runtime_info(),
            "state": self.state.value,
            "live": self.live,
            "ready": self.ready,
            "pid": self.proc.pid if self.live and self.proc else None,
            "upstream": self.base_url if self.port else None,
            "restarts": self.restarts,
            "failed_starts": self.failed_starts,
            "cold_start_s": None if self.cold_start_s is None else round(self.cold_start_s, 3),
            "last_error": self.last_error,
            "reason": self.reason,
            "stderr_tail": list(self.stderr_tail)[-8:] if self.failed else [],
            "system_info": self.system_info,
            "pinned": self.spec.pinned,
            "lazy": self.spec.lazy,
            "loads": self.loads,
            "in_flight": self.in_flight,
            "busy_s": round(self.busy_now(), 3),
            "memory_mb": None if self.memory_mb is None else round(self.memory_mb, 1),
            "max_adapters": self.spec.max_adapters,
            "max_active_adapters": self.spec.active_adapters,
            "adapters_waiting": len(self.adapter_waiters),
            "adapters": {
                a.name: {
                    "revision": a.revision,
                    "state": self.adapter_state(a.name),
                    "in_flight": self.adapter_in_flight.get(a.name, 0),
                    "error": self.adapter_errors.get(a.name),
                }
                for a in self.adapters
            },
        }

    def adapter_state(self, name: str) -> str:
        """hot (loaded, a request uses it now), warm (loaded, idle), loading, cold (on
        disk: not loaded in the running engine, or the engine is not running), refused
        (its file failed its checksum)."""
        if name in self.adapter_errors:
            return "refused"
        if name in self.adapter_loading:
            return "loading"
        if name not in self.adapter_ids or not self.live:
            return "cold"
        return "hot" if self.adapter_in_flight.get(name, 0) > 0 else "warm"

    async def wait_ready(self, timeout_s: float) -> bool:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._ready_event.wait(), timeout_s)
        return self.ready

    async def exited_since(self, generation: int, wait_s: float = 0.5) -> bool:
        """Whether the worker of `generation` has exited: the request that used it saw
        a broken connection, and the worker's death may take a moment to be noticed."""
        if generation != self.generation:
            return True  # a newer worker was spawned: that one is gone
        proc = self.proc
        if proc is None:
            return True
        if proc.returncode is None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(proc.wait()), wait_s)
        return proc.returncode is not None

    # -- lifecycle ------------------------------------------------------------
    def start(self) -> None:
        if self._task is None:
            if self.state is EngineState.COLD:
                self.state = EngineState.STARTING  # loading from now on, for waiters
            self._stopping = False
            self._task = asyncio.create_task(self._supervise(), name=f"engine:{self.alias}")

    async def unload(self) -> None:
        """Stop the process and leave the engine cold: the pool loads it again on demand."""
        await self.stop()
        if self.state is not EngineState.FAILED:
            self.state = EngineState.COLD
        self.loaded_at = None

    async def stop(self) -> None:
        self._stopping = True
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
            self._task = None
        await self._terminate()
        await self._drain_stderr()
        if self.state is not EngineState.FAILED:
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

    def _fail(self, reason: str) -> None:
        self.state = EngineState.FAILED
        self.reason = reason
        self._settled.set()
        tail = "\n".join(f"    {line}" for line in list(self.stderr_tail)[-8:])
        log.error(
            "engine %s FAILED and will not be restarted: %s%s",
            self.alias,
            reason,
            f"\n  last lines of its stderr:\n{tail}" if tail else "",
        )

    async def _supervise(self) -> None:
        backoff = self.spec.restart_backoff_s
        while not self._stopping:
            try:
                model, binary = await asyncio.to_thread(self.resolve)
            except Exception as exc:
                self.last_error = str(exc)
                self._fail(
                    str(exc)
                    if isinstance(exc, FileNotFoundError)
                    else (f"the engine cannot be started: {exc}")
                )
                return
            started = time.perf_counter()
            loras = await asyncio.to_thread(self._checked_adapters)
            await self._spawn(model, binary, loras)
            if await self._await_ready():
                self.cold_start_s = time.perf_counter() - started
                self.loads += 1
                self.loaded_at = self.last_used = time.monotonic()
                self.measure()
                self.state = EngineState.READY
                self.ready_since = time.time()
                self.failed_starts = 0
                self._ready_event.set()
                self._settled.set()
                backoff = self.spec.restart_backoff_s
                log.info(
                    "engine %s ready on port %s in %.1fs (%s)",
                    self.alias,
                    self.port,
                    self.cold_start_s,
                    self.system_info or "system info unknown",
                )
                assert self.proc is not None
                code = await self.proc.wait()
                await self._drain_stderr()
                self.last_error = f"worker {describe_exit(code)} while serving"
            else:
                await self._terminate()
                await self._drain_stderr()
                if self._stopping:
                    return
                self.failed_starts += 1
                if self.failed_starts >= self.max_crash_restarts:
                    self._fail(f"{self.last_error} ({self.failed_starts} failed starts in a row)")
                    return
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

    def _checked_adapters(self) -> list[AdapterFile]:
        """The adapters of the set to load whose file is there and matches its sha256
        (checked before every load); the others are refused by name, with why, and
        the base serves on."""
        ok: list[AdapterFile] = []
        self.adapter_errors = {}
        for a in self.adapters:
            if a.name not in self.adapter_set:
                continue  # cold: checked when it is loaded
            why = self.adapter_refusal(a)
            if why is None:
                ok.append(a)
            else:
                self.adapter_errors[a.name] = why
                log.error("engine %s: adapter %s refused: %s", self.alias, a.name, why)
        return ok

    def adapter_refusal(self, a: AdapterFile) -> str | None:
        """Why `a`'s file may not be loaded (unreadable, or not the registered sha256),
        or None."""
        try:
            digest = sha256_file(self.adapter_digest_path(a))
        except OSError as exc:
            return f"cannot read {a.path}: {exc.strerror or exc}"
        if digest != a.sha256:
            return (
                f"checksum mismatch: {a.path} has sha256 {digest[:16]}..., "
                f"the registry says {a.sha256[:16]}..."
            )
        return None

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
                self.proc = await asyncio.create_subprocess_exec(
                    *cmd,
                    stdin=asyncio.subprocess.DEVNULL,
                    stderr=asyncio.subprocess.PIPE,
                    stdout=asyncio.subprocess.DEVNULL,
                    env=self.env(),
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
