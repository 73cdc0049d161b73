"""The MCP tool servers behind `/mcp` (config `mcp.servers`), reached with the official
`mcp` SDK's client session; a Streamable HTTP server's `tools/call`s then go over the
gateway's own kept-alive connection on that session (engines/mcp_forward.py: the SDK's
per-call machinery cost more than the call's governance).

Each server has a supervisor task that owns its connection: it starts a `command`
server (stdio) or connects to a `url` server (Streamable HTTP), initializes the
session, lists its tools, then pings it every few seconds. When the process dies or
the connection fails, the state becomes `failed` with the reason, and the supervisor
reconnects (restarting the process) after a backoff that doubles up to 30 s. A stdio
server's replies are read within `max_reply_bytes` a line (engines/mcp_stdio.py): a
longer one is discarded as it arrives and its call ends `too_large`, while the
connection lives on.
Credentials are environment references resolved here, at connect time: they go to
the server (its environment or headers) and nowhere else.

Calls go through `call()`: at most `max_concurrency` at once per server, each within
its timeout. Which errors mean "may have run" is the caller's business
(`CallOutcome.sent`), as is the server's circuit breaker (mcp_service/ sets
`breaker`; its state is part of `describe()`, so `/readyz` shows it).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import tempfile
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import orjson

from switchyard.config import McpServerConfig
from switchyard.engines.mcp_forward import (
    ConnectFailed,
    HttpForwarder,
    SessionLost,
    result_refusal,
)

log = logging.getLogger("switchyard.mcp")
SEP = "__"  # `<server>__<tool>`
# What a server's tools/list may put in the catalog every client is handed: at most this
# many tools and bytes of them (a hostile or broken server listing thousands would make
# each client's tools/list megabytes), each named as the MCP specification allows.
MAX_TOOLS = 512
MAX_CATALOG_BYTES = 2 << 20
TOOL_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,128}")
PING_S = 2.0
MAX_BACKOFF_S = 30.0
STDERR_TAIL = 2000


def bounded_catalog(
    server: str, listed: Iterable[tuple[str, dict[str, Any]]]
) -> dict[str, dict[str, Any]]:
    """The tools a server listed that the catalog keeps, in its order: validly named
    ones, within `MAX_TOOLS` and `MAX_CATALOG_BYTES` (their JSON); what is left out is
    logged, never silently lost."""
    kept: dict[str, dict[str, Any]] = {}
    size = skipped = 0
    for name, tool in listed:
        if not TOOL_NAME.fullmatch(name) or name in kept or len(kept) >= MAX_TOOLS:
            skipped += 1
            continue
        size += len(orjson.dumps(tool))
        if size > MAX_CATALOG_BYTES:
            skipped += 1
            continue
        kept[name] = tool
    if skipped:
        log.warning(
            "MCP server %s: %d listed tools left out of the catalog (a bad or repeated name, "
            "or past %d tools or %d bytes)",
            server,
            skipped,
            MAX_TOOLS,
            MAX_CATALOG_BYTES,
        )
    return kept


@dataclass(frozen=True, slots=True)
class CallOutcome:
    """A forwarded call's end: its `result` (the CallToolResult as JSON), or `error`
    (code, message) with `sent`: whether the request may have reached the server
    (a timeout or a lost connection after sending leaves the outcome unknown)."""

    result: dict[str, Any] | None = None
    error: tuple[int, str] | None = None
    sent: bool = False
    timed_out: bool = False
    # The server failed with an error of its own (an HTTP 5xx, a JSON-RPC internal
    # error): the request reached it, so it may have run.
    server_error: bool = False
    # It ran, and its reply was larger than the gateway reads (`max_result_bytes`).
    too_large: bool = False
    # It ran, and its result cannot be passed on as it came (mcp_forward.result_refusal:
    # nested too deep, an integer past 64 bits): why.
    unpassable: str | None = None

    @property
    def failed(self) -> bool:
        """Counts against the server's breaker: a timeout, a lost connection, a server
        error or a malformed result. A result (even one with `isError`, the tool's own
        failure, or one too large or otherwise unfit to pass on) and a refusal of the
        request (invalid params) show a working server."""
        if self.result is not None or self.too_large or self.unpassable is not None:
            return False
        return self.sent or self.server_error


class ServerUnavailable(Exception):
    """The server is not connected: nothing was sent."""


class McpServer:
    """One configured server: its connection, state and tools."""

    def __init__(self, cfg: McpServerConfig) -> None:
        self.cfg = cfg
        self.name = cfg.name
        self.state = "starting"  # starting | ready | failed | stopped
        self.restarts = 0
        self.last_error: str | None = None
        self.tools: dict[str, dict[str, Any]] = {}  # tool name -> its definition (JSON)
        self.in_flight = 0
        # The server's circuit breaker (state/breakers_memory.py's CircuitBreaker), set by the
        # tool service, which opens and closes it; shown here.
        self.breaker: Any = None
        self._session: Any = None
        # A Streamable HTTP server's tools/call path (engines/mcp_forward.py), on the
        # session the SDK opened; None for stdio servers and until it is ready.
        self._forward: HttpForwarder | None = None
        self._session_id: str | None = None  # as the server named it to the SDK
        # Reply bytes read from a tool server per call, over HTTP and over stdio (a
        # longer message line is discarded as it is read: engines/mcp_stdio.py); the tool
        # service sets it from mcp.max_result_bytes, with room for the JSON-RPC envelope.
        self.max_reply_bytes = 16 * 1024 * 1024
        self._slots = asyncio.Semaphore(cfg.max_concurrency)
        self._task: asyncio.Task[None] | None = None
        self._ready = asyncio.Event()
        self._stderr: Any = None

    def describe(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "kind": "stdio" if self.cfg.command else "http",
            "state": self.state,
            "ready": self.state == "ready",
            "restarts": self.restarts,
            "tools": len(self.tools),
            "in_flight": self.in_flight,
            "last_error": self.last_error,
        }
        if self.breaker is not None:
            out["breaker"] = self.breaker.describe(time.monotonic())
        unpriced = self.unknown_prices()
        if unpriced:
            out["unknown_prices"] = unpriced
        return out

    def unknown_prices(self) -> list[str]:
        """The tools `tool_prices` names that the server does not list (once it has
        listed its tools): their prices are never charged."""
        if not self.tools:
            return []
        return sorted(t for t in self.cfg.tool_prices if t not in self.tools)

    def start(self) -> None:
        self._task = asyncio.create_task(self._supervise(), name=f"mcp-{self.name}")

    async def stop(self) -> None:
        self.state = "stopped"
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
        if self._stderr is not None:
            self._stderr.close()

    async def wait_ready(self, timeout_s: float) -> bool:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._ready.wait(), timeout_s)
        return self.state == "ready"

    async def _supervise(self) -> None:
        backoff = self.cfg.restart_backoff_s
        while True:
            started = time.monotonic()
            try:
                await self._connect_and_watch()
            except asyncio.CancelledError:
                raise
            except BaseException as exc:  # any failure: reported, then retried
                self.last_error = self._redact(_reason(exc, self._stderr_tail()))
            self._session = None
            self._ready.clear()
            if self.state == "stopped":
                return
            self.state = "failed"
            log.warning("MCP server %s failed: %s", self.name, self.last_error)
            if time.monotonic() - started > 60:  # it had been up a while: start over
                backoff = self.cfg.restart_backoff_s
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, MAX_BACKOFF_S)
            self.restarts += 1

    def _transport(self) -> contextlib.AbstractAsyncContextManager[Any]:
        cfg = self.cfg
        if cfg.command is not None:
            from mcp.client.stdio import StdioServerParameters

            from switchyard.engines.mcp_stdio import bounded_stdio_client

            if self._stderr is None:
                # Kept for the server's life: its stderr tail explains a failure.
                self._stderr = tempfile.TemporaryFile("w+", prefix=f"mcp-{self.name}-")  # noqa: SIM115
            params = StdioServerParameters(
                command=cfg.command[0], args=cfg.command[1:], env=cfg.credentials(cfg.env)
            )
            return bounded_stdio_client(params, self._stderr, self.max_reply_bytes)
        import httpx2
        from mcp.client.streamable_http import streamable_http_client

        assert cfg.url is not None
        self._session_id = None

        async def note_session(response: Any) -> None:
            sid = response.headers.get("mcp-session-id")
            if sid is not None and len(sid) <= 256:
                self._session_id = sid

        client = httpx2.AsyncClient(
            headers=cfg.credentials(cfg.headers_env),
            timeout=httpx2.Timeout(cfg.timeout_s + 5, read=300),
            event_hooks={"response": [note_session]},
        )
        return _with_client(client, streamable_http_client(cfg.url, http_client=client))

    async def _connect_and_watch(self) -> None:
        from mcp import ClientSession

        async with self._transport() as (read, write), ClientSession(read, write) as session:
            init = await asyncio.wait_for(session.initialize(), self.cfg.timeout_s)
            listed = await asyncio.wait_for(session.list_tools(), self.cfg.timeout_s)
            self.tools = bounded_catalog(
                self.name,
                (
                    (t.name, t.model_dump(by_alias=True, mode="json", exclude_none=True))
                    for t in listed.tools
                ),
            )
            cfg = self.cfg
            forward = None
            if cfg.url is not None:
                forward = HttpForwarder(
                    cfg.url,
                    cfg.credentials(cfg.headers_env),
                    self._session_id,
                    str(init.protocol_version),
                    self.max_reply_bytes,
                )
            try:
                self._forward = forward
                self._session = session
                self.state = "ready"
                self.last_error = None
                self._ready.set()
                log.info("MCP server %s ready: %d tools", self.name, len(self.tools))
                unpriced = self.unknown_prices()
                if unpriced:  # a price for a tool the server does not have: a typo?
                    log.warning(
                        "MCP server %s: tool_prices names tools it does not list, which "
                        "are never charged: %s",
                        self.name,
                        ", ".join(unpriced),
                    )
                while True:
                    await asyncio.sleep(PING_S)
                    if forward is not None and forward.lost:
                        raise RuntimeError("the server no longer knows the session")
                    await asyncio.wait_for(session.send_ping(), max(PING_S, 5.0))
            finally:
                self._forward = None
                if forward is not None:
                    await asyncio.shield(forward.close())

    def _redact(self, text: str) -> str:
        """`text` without the server's credentials (its stderr may print them)."""
        cfg = self.cfg
        for value in {**cfg.credentials(cfg.env), **cfg.credentials(cfg.headers_env)}.values():
            if len(value) >= 4:
                text = text.replace(value, "***")
        return text

    def _stderr_tail(self) -> str:
        f = self._stderr
        if f is None:
            return ""
        with contextlib.suppress(OSError, ValueError):
            f.seek(0, 2)
            size = f.tell()
            f.seek(max(0, size - STDERR_TAIL))
            return str(f.read()).strip()
        return ""

    async def call(
        self, tool: str, arguments: Mapping[str, Any], meta: dict[str, Any] | None, timeout_s: float
    ) -> CallOutcome:
        """Forward one tools/call within `timeout_s` (waiting for a slot counts);
        raises ServerUnavailable when nothing could be sent."""
        from mcp import MCPError
        from mcp_types import CONNECTION_CLOSED, INTERNAL_ERROR, REQUEST_TIMEOUT

        from switchyard.engines.mcp_stdio import OversizedReply, UnpassableReply

        deadline = time.perf_counter() + timeout_s
        try:
            if self._slots.locked():  # wait for a slot, within the timeout
                await asyncio.wait_for(self._slots.acquire(), timeout_s)
            else:  # a free slot: taken at once, without wait_for's task
                await self._slots.acquire()
        except TimeoutError:
            raise ServerUnavailable(
                f"all {self.cfg.max_concurrency} call slots of server '{self.name}' stayed busy"
            ) from None
        try:
            session = self._session
            if session is None or self.state != "ready":
                raise ServerUnavailable(f"tool server '{self.name}' is {self.state}")
            remaining = deadline - time.perf_counter()
            if remaining <= 0:
                raise ServerUnavailable("no time left for the call")
            self.in_flight += 1
            forward = self._forward
            if forward is not None:
                try:
                    return await self._call_http(forward, tool, arguments, meta, remaining)
                finally:
                    self.in_flight -= 1
            try:
                result = await session.call_tool(
                    tool, dict(arguments), read_timeout_seconds=remaining, meta=meta
                )
            except MCPError as exc:
                if isinstance(exc.data, OversizedReply):  # it ran; its reply was not read
                    return CallOutcome(
                        error=(exc.code, "result too large"), sent=True, too_large=True
                    )
                if isinstance(exc.data, UnpassableReply):  # it ran; its result is unfit
                    unfit = exc.data.why
                    return CallOutcome(error=(exc.code, unfit), sent=True, unpassable=unfit)
                if exc.code == REQUEST_TIMEOUT:
                    return CallOutcome(error=(exc.code, "timed out"), sent=True, timed_out=True)
                if exc.code == CONNECTION_CLOSED:
                    return CallOutcome(error=(exc.code, "connection lost"), sent=True)
                if exc.code == INTERNAL_ERROR:  # an HTTP 5xx, or the server's own failure
                    return CallOutcome(
                        error=(exc.code, str(exc.message)[:500]), sent=True, server_error=True
                    )
                return CallOutcome(error=(exc.code, str(exc.message)[:500]))
            except (OSError, EOFError, RuntimeError) as exc:
                log.warning("MCP server %s: call failed: %s", self.name, type(exc).__name__)
                return CallOutcome(error=(CONNECTION_CLOSED, "connection lost"), sent=True)
            except ValueError:  # pydantic's ValidationError: it ran, and answered nonsense
                log.warning("MCP server %s: a malformed result of %s", self.name, tool)
                return CallOutcome(
                    error=(INTERNAL_ERROR, "malformed result"), sent=True, server_error=True
                )
            finally:
                self.in_flight -= 1
            try:
                dumped = result.model_dump(by_alias=True, mode="json", exclude_none=True)
            except ValueError:  # pydantic's serializer: nested past 255 levels
                dumped = None
            why = result_refusal(dumped) if dumped is not None else "it nests too deep"
            if why is not None:
                return CallOutcome(error=(INTERNAL_ERROR, why), sent=True, unpassable=why)
            return CallOutcome(result=dumped)
        finally:
            self._slots.release()

    async def _call_http(
        self,
        forward: HttpForwarder,
        tool: str,
        arguments: Mapping[str, Any],
        meta: dict[str, Any] | None,
        timeout_s: float,
    ) -> CallOutcome:
        try:
            result, error, how = await forward.call(tool, dict(arguments), meta, timeout_s)
        except (SessionLost, ConnectFailed) as exc:
            raise ServerUnavailable(f"tool server '{self.name}': {exc}") from None
        if result is not None:
            return CallOutcome(result=result)
        assert error is not None
        if how == "refused":
            return CallOutcome(error=error)
        if how == "unpassable":
            return CallOutcome(error=error, sent=True, unpassable=error[1])
        return CallOutcome(
            error=error,
            sent=True,
            timed_out=how == "timeout",
            server_error=how in ("server_error", "malformed"),
            too_large=how == "too_large",
        )


@contextlib.asynccontextmanager
async def _with_client(client: Any, transport: Any) -> Any:
    async with client, transport as streams:
        yield streams[0], streams[1]


def _reason(exc: BaseException, stderr: str) -> str:
    """A failure in words for the operator (the admin's readiness view, the log), never
    a secret: exception types and messages from the SDK and the OS, and the server's
    stderr tail, as one line: what the server wrote is escaped (a newline or a terminal
    escape in it could otherwise forge log lines of the gateway's own)."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:  # the SDK's task groups
        exc = exc.exceptions[0]
    text = f"{type(exc).__name__}: {exc}"[:300] if str(exc) else type(exc).__name__
    if isinstance(exc, TimeoutError):
        text = "did not answer in time"
    if stderr:
        text = f"{text}; stderr: {stderr[-500:]}"
    return text.encode("unicode_escape").decode("ascii")


class McpServers:
    """Every configured server, and the namespaced tool names across them."""

    def __init__(self, configs: list[McpServerConfig]) -> None:
        self.servers = {c.name: McpServer(c) for c in configs}

    def start(self) -> None:
        for s in self.servers.values():
            s.start()

    async def stop(self) -> None:
        await asyncio.gather(*(s.stop() for s in self.servers.values()))

    def resolve(self, name: str) -> tuple[McpServer, str] | None:
        """(server, its own tool name) for a namespaced name `<server>__<tool>`."""
        server, sep, tool = name.partition(SEP)
        s = self.servers.get(server)
        if not sep or s is None or not tool:
            return None
        return s, tool

    def catalog(self) -> list[dict[str, Any]]:
        """Every server's tools (as last listed) under their namespaced names; a call to
        one whose server is down fails without being sent."""
        out = []
        for s in self.servers.values():
            for name, tool in s.tools.items():
                out.append({**tool, "name": s.name + SEP + name})
        return out

    def describe(self) -> dict[str, Any]:
        return {name: s.describe() for name, s in self.servers.items()}
