"""`switchyard serve --workers N`: N gateway processes on one port, one control plane.

The supervisor (this module, the `switchyard serve` process) is the control plane and
starts, in order:

1. a private `redis-server` on a Unix socket under the gateway's home, when the config
   names no `storage.redis_url` (scale/private_redis.py): limits, budgets, task state,
   breakers and the response cache are counted there by every worker, as by several
   gateways anywhere (state/choose.py);
2. the one ledger writer, on a Unix socket every process writes through
   (state/ledger.py);
3. the control plane's gateway (`ProcessRole("control")`): it owns the managed
   engines and their residency pool, the first-run key, retention, the cache's
   encoder build and the deployment gates' state; it serves no client;
4. its internal server on a loopback port (api/internal.py): the gates
   (policy/admission_remote.py) and the engine front (engines/front.py), answering
   only the token given to the workers;
5. N workers (scale/worker.py), each with its own `SO_REUSEPORT` listener on the port,
   each a whole gateway whose local models are the engine front and whose gates with a
   concurrency limit are the control plane's.

A worker that exits is started again (after a growing pause if it keeps dying); before
that, what it held is given back: its gate slots (`Leases.release_worker`) and its
limit and budget reservations (`RedisLimiter.release_holds`); the engine front releases
a dead worker's residency when its connections close. The requests it was serving may
have gone upstream and streamed: each gets one usage row, `incomplete` with error
`worker_exited`, and its budgets keep what it reserved. Which requests: the worker's
in-flight journal (scale/worker.py `InFlight`) names every request it opened whose
row the ledger writer had not committed, so a request under no limit, or one that
settled and died before its row was written, is billed too: what it settled, if it
got that far (`journaled_request`); else the most it reserved (its holds, found by the
limiter's owner records, each extension of its reservation included: `lost_request`);
else what its journal says it reserved for each call that may have been billed; else 0. The ledger writer never lets such a
row replace a row the request's own worker committed (state/ledger_batch.py). A
journal is removed once its rows are committed, and kept (for the next start) if they
never are.

A supervisor killed with its workers (SIGKILL, the OOM killer, a host crash) bills
nothing more: the next supervisor started on the same home does, at its start and
every EARLIER_RUNS_S (`bill_earlier_runs`), for each journal in `run/inflight/` that
an earlier run's worker left, as for a dead worker of its own (holds in a shared Redis
included: they are found by the worker's name until their lease lapses). Dead for
sure, never guessed from a pid: a worker holds an exclusive lock on its journal for
its whole life, and a supervisor bills only a journal it can lock, holding the lock
until the rows are committed (scale/worker.py `claim_journal`); so two supervisors
never both bill one journal, and a live worker's is left alone.

The supervisor holds a bound socket on the port for its whole run, so the port
is taken (and `port: 0` resolved) once for all workers. SIGINT or SIGTERM stops the
workers first, then the control plane.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import os
import secrets
import shutil
import signal
import socket
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import uvicorn

from switchyard import outcomes
from switchyard.config import LlamaCppEngine, ProcessRole, Settings, VllmEngine
from switchyard.pipeline import Status
from switchyard.scale.worker import (
    READY_LINE,
    Claim,
    JournalBusy,
    claim_journal,
    journal_path,
)
from switchyard.state.ledger_batch import LOST
from switchyard.state.limits import Billing, Held
from switchyard.state.traces import LedgerEntry

log = logging.getLogger("switchyard.workers")

MAX_WORKERS = 256
STOP_GRACE_S = 8.0  # a worker's graceful stop (uvicorn's is 5 s), then SIGKILL
RESTART_PAUSE_S = (0.5, 1.0, 2.0, 5.0, 10.0, 30.0)  # after quick successive deaths
WORKER_EXITED = LOST  # the usage row's error code of a dead worker's request
COMMIT_TRIES, COMMIT_WAIT_S = 30, 10.0  # how long billed rows are waited for
EARLIER_RUNS_S = 10.0  # how often journals of an earlier run's workers are looked for


def usable_workers(value: int | str) -> int:
    """The number of workers `server.workers` (or `--workers`) asks for: `auto` is the
    cores this process may run on."""
    if value == "auto":
        return max(1, min(MAX_WORKERS, len(os.sched_getaffinity(0))))
    if isinstance(value, int) and 1 <= value <= MAX_WORKERS:
        return value
    raise ValueError(f"--workers: a number from 1 to {MAX_WORKERS}, or auto (got {value!r})")


def refusal(settings: Settings) -> str | None:
    """Why this config cannot run with several workers, or None."""
    if settings.storage.backend == "memory":
        return (
            "storage.backend: memory keeps keys, usage and replies in one process; "
            "--workers needs sqlite (the default) or postgres_dsn"
        )
    if settings.rl.models:
        return "RL-managed models (rl.models) are served by one process; use --workers 1"
    return None


def worker_settings(settings: Settings, control_url: str, redis_url: str, workers: int) -> Settings:
    """A worker's settings: every local model is the control plane's engine front,
    shared state is in `redis_url`, and it takes its share of `server.max_connections`
    (the kernel spreads connections evenly over the workers' listeners)."""
    from switchyard.engines.front import remote_engines
    from switchyard.scale.serve_config import ENGINE_TOKEN_ENV

    storage = settings.storage.model_copy(update={"redis_url": redis_url})
    share = max(1, math.ceil(settings.server.max_connections / max(1, workers)))
    server = settings.server.model_copy(update={"max_connections": share})
    settings = settings.model_copy(update={"storage": storage, "server": server})
    return remote_engines(settings, f"{control_url}/engines", ENGINE_TOKEN_ENV)


def has_local_engines(settings: Settings) -> bool:
    """Whether any model (or one of its deployments) runs on an engine managed here."""
    return any(
        isinstance(e, LlamaCppEngine | VllmEngine)
        for m in settings.models
        for e in [m.engine, *(d.engine for d in m.deployments)]
    )


def reserve_port(host: str, port: int) -> socket.socket:
    """A socket bound to (host, port) and kept, not listening: the port is ours (and
    `port: 0` picks one) for every worker's `SO_REUSEPORT` listener. A port another
    program holds fails here, once, with the system's message."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    return sock


class _Internal(uvicorn.Server):
    """The internal server inside the supervisor's loop: the supervisor handles the
    signals, not uvicorn."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class Worker:
    """One worker slot: its number, its current process and what it said."""

    def __init__(self, index: int, run: str = "") -> None:
        self.index = index
        self.run = run  # the supervisor's run: `worker_name`
        self.proc: asyncio.subprocess.Process | None = None
        self.ready = asyncio.Event()
        self.starts = 0
        self.deaths: list[float] = []

    @property
    def name(self) -> str:
        """Who holds its reservations and slots (config/process.py)."""
        return worker_name(self.index, self.proc.pid, self.run) if self.proc is not None else ""


def worker_name(index: int, pid: int, run: str) -> str:
    """A worker's name as holder of reservations, slots and its in-flight journal
    (scale/worker.py `journal_path`): its number, its pid, and its supervisor's run
    (random), so that two supervisors counting in one Redis under one prefix (two hosts,
    whose pids may be the same) never take each other's workers' holds for their own
    dead worker's."""
    return f"w{index}-{pid}-{run}"


class Supervisor:
    def __init__(
        self,
        settings: Settings,
        config: str | None,
        host: str,
        port: int,
        count: int,
        banner: Callable[[Any, str, int], str],
    ) -> None:
        self.settings = settings
        self.config = str(Path(config).resolve()) if config else None
        self.host = host
        self.port = port
        self.run_id = secrets.token_hex(6)
        self.workers = [Worker(i, self.run_id) for i in range(count)]
        self.banner = banner
        self.stopping = False
        self.redis: Any = None
        self.writer: Any = None  # the shared ledger writer (state/ledger.py)
        self.gateway: Any = None  # the control plane's Gateway
        self.leases: Any = None
        self.front: Any = None  # the engine front (engines/front.py), with local engines
        self.spec: dict[str, Any] = {}
        self._billing: set[asyncio.Task[None]] = set()  # rows waiting to be committed
        self._claimed: set[str] = set()  # journals whose rows wait for their commit
        self._busy: set[str] = set()  # earlier runs' journals found locked (logged once)

    @staticmethod
    def run_dir(settings: Settings) -> Path:
        """The run directory beside the gateway's SQLite file (sockets, metrics)."""
        from switchyard.scale.private_redis import gateway_home

        run = gateway_home(settings) / "run"
        run.mkdir(parents=True, exist_ok=True, mode=0o700)
        return run

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        held = reserve_port(self.host, self.port)
        self.port = held.getsockname()[1]
        try:
            # Given back in reverse: the workers, the control plane, the writer, Redis.
            async with contextlib.AsyncExitStack() as stack:
                settings = await self._shared_state(stack)
                await self._control_plane(stack, settings)
                await self.bill_earlier_runs()
                runs = [asyncio.create_task(self._keep(w)) for w in self.workers]
                runs.append(asyncio.create_task(self._watch()))
                runs.append(asyncio.create_task(self._announce()))
                await stop.wait()
                self.stopping = True
                await self._stop_workers()
                for w in self.workers:  # rows a stopped worker did not see committed
                    if w.proc is not None:
                        await self._release(w.name, w.proc.pid)
                if self._billing:  # then the control plane's ledger's close waits
                    _, late = await asyncio.wait(self._billing, timeout=STOP_GRACE_S)
                    for task in late:
                        task.cancel()
                for r in runs:
                    r.cancel()
                await asyncio.gather(*runs, return_exceptions=True)
        finally:
            held.close()
        return 0

    async def _shared_state(self, stack: contextlib.AsyncExitStack) -> Settings:
        """The private Redis (without `storage.redis_url`) and the one ledger writer;
        the settings every process of this gateway runs with."""
        from switchyard.config import store_target
        from switchyard.scale.private_redis import PrivateRedis
        from switchyard.state.ledger import spawn_shared_writer

        run = self.run_dir(self.settings)
        redis_url = self.settings.storage.redis_url
        if not redis_url:
            self.redis = PrivateRedis(run.parent)
            redis_url = self.redis.start()  # before anything serves: blocking is fine
            stack.callback(self.redis.stop)
        storage = self.settings.storage.model_copy(update={"redis_url": redis_url})
        settings = self.settings.model_copy(update={"storage": storage})
        self.spec = {
            "config": self.config,
            "host": self.host,
            "port": self.port,
            "redis_url": redis_url,
            "token": secrets.token_urlsafe(32),
            "ledger_socket": str(run / "ledger.sock"),
            "run_dir": str(run),
            "run": self.run_id,
            "workers": len(self.workers),
        }
        self.writer = await asyncio.to_thread(
            spawn_shared_writer,
            store_target(settings),
            self.spec["ledger_socket"],
            int(settings.observe.max_disk_mb * 1024 * 1024),
        )
        stack.callback(self.writer.stop)
        return settings

    async def _control_plane(self, stack: contextlib.AsyncExitStack, settings: Settings) -> None:
        """The control plane's gateway, and its internal server on a loopback port: the
        gates, the engine front, the MCP endpoint (api/internal.py)."""
        from switchyard.api.admin.live import tool_breakers
        from switchyard.api.internal import GateRoutes, internal_app
        from switchyard.api.mcp import McpEndpoint
        from switchyard.api.server import uvicorn_options
        from switchyard.gateway import Gateway
        from switchyard.policy.admission_remote import Leases

        token = self.spec["token"]
        role = ProcessRole("control", "control", 0, "", token, self.spec["ledger_socket"])
        self.gateway = gw = Gateway(settings, role)
        gw.start()
        stack.push_async_callback(gw.stop)
        self.leases = Leases(gw.gates)
        if has_local_engines(settings):
            from switchyard.engines.front import EngineFront

            self.front = EngineFront(gw.registry, token)
            stack.push_async_callback(self.front.close)
        mcp = None
        if gw.mcp is not None:
            mcp = McpEndpoint(
                gw.mcp, gw.auth, settings.server.max_body_bytes, settings.auth.mode == "disabled"
            )
            await stack.enter_async_context(mcp.running())
        routes = GateRoutes(
            self.leases,
            token,
            gw.readiness,
            gw.engines_report,
            lambda: tool_breakers(gw.mcp, time.monotonic()),  # shown by every worker
        )
        app = internal_app(routes, self.front, mcp)
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind(("127.0.0.1", 0))
        # The public port's HTTP limits too (header timeout and size, connection cap,
        # framing errors as error bodies): /mcp here answers API keys.
        server = _Internal(uvicorn.Config(app, lifespan="off", **uvicorn_options(settings.server)))
        serving = asyncio.create_task(server.serve(sockets=[sock]))

        async def stop_serving() -> None:
            server.should_exit = True
            await asyncio.gather(serving, return_exceptions=True)

        stack.push_async_callback(stop_serving)
        self.spec["control_url"] = f"http://127.0.0.1:{sock.getsockname()[1]}"

    async def _announce(self) -> None:
        """The banner, once every worker serves and the models are ready or settled."""
        for w in self.workers:
            await w.ready.wait()
        gw = self.gateway
        while not (gw.readiness()[0] or gw.startup_settled()):
            await asyncio.sleep(0.2)
        text = self.banner(gw, self.host, self.port)
        print(f"{text}  Workers: {len(self.workers)} processes on port {self.port}\n", flush=True)

    async def _keep(self, w: Worker) -> None:
        """Run worker `w`, and start it again whenever it exits while serving."""
        while not self.stopping:
            w.ready.clear()
            w.proc = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "switchyard.scale.worker",
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                # Its own session: a terminal's Ctrl-C reaches the supervisor alone,
                # which stops the workers first and the control plane after.
                start_new_session=True,
            )
            w.starts += 1
            name = w.name
            assert w.proc.stdin is not None and w.proc.stdout is not None
            w.proc.stdin.write(json.dumps({**self.spec, "index": w.index}).encode())
            w.proc.stdin.close()
            async for raw in w.proc.stdout:
                line = raw.decode(errors="replace").rstrip()
                if line == READY_LINE:
                    w.ready.set()
                elif line:
                    print(line, flush=True)
            code = await w.proc.wait()
            if self.stopping:
                return
            released = await self._release(name, w.proc.pid)
            w.deaths = [t for t in w.deaths if time.monotonic() - t < 60] + [time.monotonic()]
            pause = RESTART_PAUSE_S[min(len(w.deaths), len(RESTART_PAUSE_S)) - 1]
            log.error(
                "worker %d (pid %d) exited with %s; %s; starting it again in %.1f s",
                w.index,
                w.proc.pid,
                f"signal {-code}" if code < 0 else f"code {code}",
                released,
                pause,
            )
            await asyncio.sleep(pause)

    async def _watch(self) -> None:
        """Start the ledger writer and the private redis-server again if either dies.
        The workers' ledgers reconnect and re-send what was not committed; their Redis
        clients reconnect to the same socket, but what it counted is lost with it (until
        it is back, `policy.on_limiter_failure` decides)."""
        scanned = time.monotonic()
        while not self.stopping:
            await asyncio.sleep(1.0)
            if self.stopping:
                return
            if time.monotonic() - scanned >= EARLIER_RUNS_S:
                scanned = time.monotonic()
                await self.bill_earlier_runs()
            try:
                await asyncio.to_thread(self.writer.restart_if_dead)  # it logs why
            except Exception as exc:
                log.error("the ledger writer did not start again: %s", exc)
            if self.redis is not None and not self.redis.alive():
                log.error("the private redis-server exited; starting it again")
                try:
                    await asyncio.to_thread(self.redis.restart)
                except Exception as exc:
                    log.error("the private redis-server did not start again: %s", exc)

    async def bill_earlier_runs(self) -> None:
        """Bill the journals in `run/inflight/` that workers of an earlier run left
        (their supervisor was killed with them: SIGKILL, the OOM killer, a host
        crash), as a dead worker's (`_release`), each once: only a journal this
        process can lock is a dead worker's (scale/worker.py `claim_journal`); one
        still locked (its worker, or another supervisor billing it) is left alone,
        and looked at again every EARLIER_RUNS_S."""
        folder = Path(self.spec["run_dir"]) / "inflight"
        try:
            names = sorted(os.listdir(folder))
        except OSError:  # none yet
            return
        ours = f"-{self.run_id}"
        self._busy &= set(names)  # gone meanwhile: its worker ended cleanly
        for name in names:
            if name.endswith(ours) or name in self._claimed:
                continue
            try:
                said = await self._release(name, None)
            except Exception:  # one bad journal must not stop the others, or the start
                log.exception("could not bill the journal %s of an earlier run", name)
                continue
            if said is not None:
                log.warning("worker %s of an earlier run is gone: %s", name, said)

    async def _release(self, name: str, pid: int | None) -> str | None:
        """Give back what a dead worker held; says what. `pid` None: a worker of an
        earlier run, found by its journal (`bill_earlier_runs`): dead for sure only if
        its journal can be locked, and nothing is done (None) otherwise."""
        try:
            claim = claim_journal(journal_path(self.spec["run_dir"], name))
        except JournalBusy:
            if pid is None:
                if name not in self._busy:
                    self._busy.add(name)
                    log.info("the journal of worker %s is locked: it still runs", name)
                return None
            claim = None  # another supervisor on this home is billing it
        if pid is None and claim is None:
            return None  # billed and removed by another supervisor meanwhile
        self._busy.discard(name)
        try:
            slots, held, rows = await self._give_back(name, pid, claim)
        except BaseException:
            if claim is not None:
                claim.close(billed=False)  # kept for the next start
            raise
        if pid is None and not (held or rows):
            return None  # an idle worker's journal: nothing to say
        return (
            f"gave back {slots} gate slot(s) and {held} reservation(s); billed "
            f"{rows} request(s) it was serving whose rows were not committed"
        )

    async def _give_back(
        self, name: str, pid: int | None, claim: Claim | None
    ) -> tuple[int, int, int]:
        """`_release`: the gate slots, holds and task reservations of worker `name`
        given back, and the rows of its requests billed (from `claim`, its journal);
        how many of each."""
        if pid is not None and os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
            from prometheus_client import multiprocess

            multiprocess.mark_process_dead(pid)  # its live gauges leave the sums
        slots = self.leases.release_worker(name) if self.leases is not None else 0
        limiter = getattr(self.gateway, "limiter", None)
        release = getattr(limiter, "release_holds", None)
        held: list[Held] = []
        if release is not None:
            try:
                held = await release(name)
            except Exception as exc:  # Redis away: the leases lapse on their own
                log.error("could not give back worker %s's reservations: %s", name, exc)
        rows = self._lost_rows(name, held, claim.records if claim is not None else [])
        self._bill(rows, claim)
        tasks = getattr(self.gateway, "tasks", None)
        release_tasks = getattr(tasks, "release_owner", None)
        if release_tasks is not None:
            try:
                await release_tasks(name)
            except Exception as exc:
                log.error("could not give back worker %s's task reservations: %s", name, exc)
        return slots, len(held), len(rows)

    def _lost_rows(
        self, name: str, held: list[Held], journal: list[list[Any]]
    ) -> list[LedgerEntry]:
        """One usage row per request of the dead worker `name` that its journal names
        (`journal`: scale/worker.py `read_journal`) or whose holds `held` were still
        unsettled (a request the journal had no room for)."""
        by_request: dict[str, list[Held]] = {}
        for h in held:
            if h.billing is None:  # recorded by a version that kept no billing
                log.error("worker %s's reservation %s: no usage row", name, h.reservation)
                continue
            by_request.setdefault(h.billing.request_id, []).append(h)
        traced = self.settings.observe.traces
        ended = time.time()
        rows = [
            journaled_request(name, rec, by_request.pop(rec[0], []), ended, traced)
            for rec in journal
        ]
        return rows + [lost_request(name, holds, ended, traced) for holds in by_request.values()]

    def _bill(self, rows: list[LedgerEntry], claim: Claim | None = None) -> None:
        """Write `rows` through the control plane's ledger, and see them committed: a
        writer that dies first (its connection's loss is seen only as the ledger is
        pumped) gets them again from that ledger, as `AGAIN`. The journal they came
        from (`claim`) stays locked until then, and is removed once they are committed
        (kept, for the next start, if they never are)."""
        ledger = getattr(self.gateway, "ledger", None)
        if ledger is None or not rows:
            if claim is not None:
                claim.close(billed=not rows)
            return
        for row in rows:
            ledger.record_entry(row)
        if claim is not None:
            self._claimed.add(claim.name)
        task = asyncio.get_running_loop().create_task(self._committed(ledger, claim))
        self._billing.add(task)
        task.add_done_callback(self._billing.discard)

    async def _committed(self, ledger: Any, claim: Claim | None) -> None:
        billed = False
        try:
            for _ in range(COMMIT_TRIES):
                if await ledger.flush_async(timeout_s=COMMIT_WAIT_S):
                    billed = True
                    return
            log.error("rows of a dead worker's requests not committed after %d tries", COMMIT_TRIES)
        finally:
            if claim is not None:
                self._claimed.discard(claim.name)
                claim.close(billed)

    async def _stop_workers(self) -> None:
        procs = [w.proc for w in self.workers if w.proc is not None and w.proc.returncode is None]
        for p in procs:
            with contextlib.suppress(ProcessLookupError):
                p.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(asyncio.gather(*(p.wait() for p in procs)), STOP_GRACE_S)
        except TimeoutError:
            for p in procs:
                if p.returncode is None:
                    with contextlib.suppress(ProcessLookupError):
                        p.kill()
            await asyncio.gather(*(p.wait() for p in procs))


def journaled_request(
    worker: str, rec: list[Any], holds: list[Held], ended: float, traced: bool
) -> LedgerEntry:
    """The usage row of a request the dead worker's journal names (`rec`: scale/worker.py
    `read_journal`): billed what it settled when its row had been queued (`done`),
    else the most its `holds` reserved, else 0."""
    rid, client_id, task, tenant, key, endpoint, model, received, stream, done, *more = rec
    if done is None and holds:
        return lost_request(worker, holds, ended, traced)
    facts = Billing(rid, client_id, task, tenant, key, endpoint, model, received, 0, bool(stream))
    reserved = _reserved(more[0] if more else None)
    if done is None and reserved is not None:  # no hold (no limit), or lost with Redis
        prompt, output, usd, calls = reserved
        reason = f"worker {worker} exited before the request ended; billed what it reserved"
        evidence = {"reserved_tokens": prompt + output, "reserved_usd": usd, "calls_billed": calls}
        return _lost(worker, facts, prompt, output, usd, ended, traced, reason, evidence)
    if done is None:
        reason = f"worker {worker} exited before the request ended; it reserved nothing"
        return _lost(worker, facts, 0, 0, 0.0, ended, traced, reason, {"reserved_usd": 0.0})
    status, tokens_in, tokens_out, cost = done
    reason = f"worker {worker} exited before the request's row was written; billed what it settled"
    evidence = {"settled_status": status, "settled_usd": cost}
    return _lost(worker, facts, tokens_in, tokens_out, cost, ended, traced, reason, evidence)


def _reserved(value: Any) -> tuple[int, int, float, int] | None:
    """A journal's reservation (`InFlight._facts`: prompt tokens, output tokens, USD,
    for each call that may have been billed, and how many calls; an earlier version's
    has no count: one), when it is one: counts a request could have, a finite cost (a
    journal is the worker's own file, but one torn or old is read as nothing)."""
    if type(value) is not list or len(value) not in (3, 4):
        return None
    prompt, output, usd, *more = value
    calls = more[0] if more else 1
    if not all(type(n) is int and 0 <= n < 2**31 for n in (prompt, output, calls)):
        return None
    if type(usd) not in (int, float) or not 0 <= usd < 1e9:
        return None
    return prompt, output, float(usd), max(1, calls)


def lost_request(worker: str, holds: list[Held], ended: float, traced: bool) -> LedgerEntry:
    """The usage row of a request whose worker died holding `holds` (its reservations,
    each with the request's billing): status `incomplete`, error `worker_exited`,
    billed what the reserving stage that held the most reserved in all.

    Each reserving stage (admit, deployment_limits) reserved the request's whole
    estimate (one prompt and its output cap) in its first hold (`{id}#{stage}`), and
    one more call's worth in a hold of its own (`{id}#{stage}+{n}`) before each further
    upstream call after one that may have been billed (policy/stages_admission.py
    `Reserver.extend`). So a stage's holds together are one prompt and cap for each
    call the request may have been billed for: the cut ones, and the one under way
    when the worker died (settle.py bills a call cut by a cancel the same way). That
    is what they stay charged in Redis (`RedisLimiter.release_holds` ends each hold
    as used in full, every extension included), and the row bills the same, so the
    ledger and the budget agree. The stages are not added up: each holds the one
    request's calls."""
    b = holds[0].billing
    assert b is not None
    stages: dict[str, list[Held]] = {}
    mine = f"{b.request_id}#"
    for h in holds:
        name = h.reservation
        stage = name[len(mine) :].partition("+")[0] if name.startswith(mine) else name
        stages.setdefault(stage, []).append(h)
    top = max(
        stages.values(),
        key=lambda hs: (sum(h.cost_usd for h in hs), sum(h.tokens for h in hs)),
    )
    tokens, usd = sum(h.tokens for h in top), sum(h.cost_usd for h in top)
    prompt = sum(min(b.prompt_tokens, h.tokens) for h in top)
    reason = f"worker {worker} exited before the request ended; billed what it reserved"
    evidence = {
        "reserved_tokens": tokens,
        "reserved_usd": usd,
        "calls_billed": len(top),
        "reservations": sorted(h.reservation for h in holds),
    }
    return _lost(worker, b, prompt, tokens - prompt, usd, ended, traced, reason, evidence)


def _lost(
    worker: str,
    b: Billing,
    tokens_in: int,
    tokens_out: int,
    cost: float,
    ended: float,
    traced: bool,
    reason: str,
    evidence: dict[str, Any],
) -> LedgerEntry:
    """A dead worker's request's usage row: status `incomplete`, error `worker_exited`,
    with a one-decision trace (`worker: exited`) when traces are kept."""
    lasted = max(0.0, ended - b.received_at)
    decisions = None
    if traced:  # clock: seconds since it was received
        evidence = {"worker": worker, **evidence}
        decisions = [["worker", str(outcomes.Worker.EXITED), reason, evidence, lasted, lasted]]
    return LedgerEntry(
        request_id=b.request_id,
        client_request_id=b.client_request_id,
        task_id=b.task_id,
        parent_request_ids=(),
        tenant_id=b.tenant_id,
        key_id=b.key_id,
        endpoint=b.endpoint,
        model=b.model,
        requested_model=b.model,
        revision=None,
        upstream=None,
        status=str(Status.INCOMPLETE),
        error_code=WORKER_EXITED,
        attempts=0,
        input_tokens=tokens_in,
        output_tokens=tokens_out,
        cost_usd=cost,
        cache=None,
        fallback_from=None,
        planned_steps=None,
        stream=b.stream,
        received_at=b.received_at,
        queue_ms=None,
        t_received=0.0,
        t_upstream_sent=None,
        t_upstream_first_byte=None,
        t_client_first_byte=None,
        t_ended=lasted,
        clock_base=b.received_at,
        decisions=decisions,
    )


def serve_workers(
    settings: Settings,
    config: str | None,
    host: str,
    port: int,
    count: int,
    banner: Callable[[Any, str, int], str],
) -> int:
    """`switchyard serve --workers N` (see the module doc); the exit status."""
    why = refusal(settings)
    if why is not None:
        print(f"switchyard: {why}", file=sys.stderr)
        return 2
    # /metrics sums every worker (prometheus_client's multiprocess mode), read when the
    # metrics module is first imported: so before anything imports the gateway.
    if not os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        folder = Supervisor.run_dir(settings) / "metrics"
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(mode=0o700)
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = str(folder)
    print(
        f"switchyard: starting {count} workers on http://{host}:{port}; loading models "
        "(see /readyz)",
        flush=True,
    )
    try:
        return asyncio.run(Supervisor(settings, config, host, port, count, banner).run())
    except OSError as exc:
        print(f"switchyard: {exc}", file=sys.stderr)
        return 1
