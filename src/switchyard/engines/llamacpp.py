"""Supervisor of one managed llama.cpp process: llama.cpp's own server (`llama-server`,
the default runtime) or the one-request-at-a-time Python worker.

Liveness (the process is up) and readiness (the model generated several tokens for a
chat prompt of realistic length, over the same HTTP API the gateway uses) are separate
states. A worker that served and then died is restarted with exponential backoff; the
gateway keeps serving other models meanwhile and answers 503 with Retry-After for this
one. A serving worker that stays alive but stops answering (stopped, deadlocked) is
found by its /health going silent while its CPU time stands still for `hang_s`,
killed, and restarted the same way (`_serve`). A worker that dies (or never answers) before it is ready `max_crash_restarts`
times in a row is `failed`: it is not restarted, and its reason (the exit signal by
name, the last lines of its stderr) is in /readyz, in the log and in the 503
`engine_failed` its requests get.

The process itself (command line, spawn, stderr pump, warm-up, termination) is
engines/llamacpp_process.py's, and the lifecycle states and adapter files are
engines/llamacpp_state.py's; their public names are re-exported here.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import os
import time
from typing import Any

import aiohttp

from switchyard.config import ManagedEngine
from switchyard.engines.assets import smollm2_gguf_path
from switchyard.engines.llamacpp_process import (
    STDERR_LINES,
    WARMUP_MESSAGES,
    EngineProcess,
    cpu_ticks,
    describe_exit,
    llama_server_binary,
    rss_mb,
)
from switchyard.engines.llamacpp_state import AdapterFile, EngineState, sha256_file

__all__ = [
    "STDERR_LINES",
    "WARMUP_MESSAGES",
    "AdapterFile",
    "EngineProcess",
    "EngineState",
    "ManagedLlamaCpp",
    "describe_exit",
    "llama_server_binary",
    "rss_mb",
    "sha256_file",
]

log = logging.getLogger("switchyard.engine")


class ManagedLlamaCpp(EngineProcess):
    """The supervisor of one managed engine process. llama.cpp's server (or worker) is
    this class; other engines (engines/vllm.py) override the hooks marked below and
    in its base, EngineProcess (engines/llamacpp_process.py), which runs the process."""

    kind = "llamacpp"
    # What the kernel sends the server when the gateway dies without stopping it.
    # SIGKILL: llama-server keeps nothing worth a graceful exit once its gateway is
    # gone, and its SIGTERM handler, which waits for its HTTP loop, was seen to leave
    # it alive for over 20 s on a loaded machine (tests/integration/test_observe.py, kill -9).
    parent_death_signal = "KILL"
    # A serving worker is asked for /health every `health_every_s`; one that neither
    # answers nor uses CPU time for `hang_s` is hung, killed and restarted (`_serve`).
    health_every_s = 2.0
    hang_s = 12.0
    # In a session of its own, so a terminal's Ctrl-C leaves it serving until the
    # gateway has drained and stops it (engines/llamacpp_process.py).
    own_session = True

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
                code, hung_s = await self._serve()
                await self._drain_stderr()
                self.last_error = (
                    f"worker stopped answering its health check (and using CPU) for "
                    f"{hung_s:.0f}s while serving; killed"
                    if hung_s is not None
                    else f"worker {describe_exit(code)} while serving"
                )
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

    async def _serve(self) -> tuple[int | None, float | None]:
        """Wait while the ready worker serves: (its exit code, None) once it exits, or,
        when it is hung, (the code, the seconds it was silent) after it is killed.

        Hung: for `hang_s` it answered no `/health` (any answer counts, a 503
        included) and used no CPU time: a stopped, deadlocked or frozen process, alive
        and answering nothing. A busy server may leave /health waiting for an HTTP
        thread for as long as a generation runs, but its CPU time grows, so it is
        never taken for hung. A hung worker is restarted as a crashed one is, so its
        requests get 503 `engine_not_ready` at once, and the one under way
        `engine_crashed`, instead of each waiting out its own timeout while /readyz
        says ready."""
        proc = self.proc
        assert proc is not None
        waiter = asyncio.ensure_future(proc.wait())
        url = self.base_url.removesuffix("/v1") + "/health"
        heard = time.monotonic()  # its last answer, or the last time its CPU time grew
        ticks = cpu_ticks(proc.pid)
        try:
            timeout = aiohttp.ClientTimeout(total=self.health_every_s)
            async with aiohttp.ClientSession(timeout=timeout) as session:
                while True:
                    done, _ = await asyncio.wait({waiter}, timeout=self.health_every_s)
                    if done:
                        return waiter.result(), None
                    try:
                        async with session.get(url) as r:
                            await r.read()
                        heard = time.monotonic()
                    except (aiohttp.ClientError, OSError, TimeoutError):
                        now_ticks = cpu_ticks(proc.pid)
                        if now_ticks is None or now_ticks != ticks:
                            # Working (or no /proc to tell: never taken for hung).
                            ticks = now_ticks
                            heard = time.monotonic()
                    silent = time.monotonic() - heard
                    if silent >= self.hang_s and not waiter.done():
                        log.error(
                            "engine %s has answered nothing and used no CPU for %.0fs; "
                            "killing it to restart it",
                            self.alias,
                            silent,
                        )
                        with contextlib.suppress(ProcessLookupError):
                            proc.kill()
                        return await waiter, silent
        finally:
            if not waiter.done():
                waiter.cancel()

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
