"""MCP tool servers as the gateway tests drive them: their run logs, waiting until a
server and the gateway's view of it are ready, and the official SDK's client session
on a gateway's /mcp."""

from __future__ import annotations

import os
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path
from typing import Any

import httpx
import httpx2
from mcp import ClientSession
from mcp.client.streamable_http import streamable_http_client

from support.gateways import Gateway, cheap_config, start_gateway
from support.mcp_http import tool_runs
from support.paths import MCP_TOOL_SERVER
from support.procs import Proc, free_port


class Tools:
    """The two tool servers' logs: one JSON line per run of a tool."""

    def __init__(self) -> None:
        d = tempfile.mkdtemp(prefix="mcp-tools-")
        self.stdio_log = os.path.join(d, "stdio.log")
        self.http_log = os.path.join(d, "http.log")
        self.spans = os.path.join(d, "spans.jsonl")  # the gateway's OpenTelemetry spans
        for p in (self.stdio_log, self.http_log):
            Path(p).touch()

    runs = staticmethod(tool_runs)


def wait_for_port(port: int, proc: Proc) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            httpx.get(f"http://127.0.0.1:{port}/mcp", timeout=1)
            return
        except httpx.HTTPError:
            if proc.popen.poll() is not None:
                raise RuntimeError(proc.output()) from None
            time.sleep(0.1)
    raise RuntimeError("the MCP server did not start:\n" + proc.output())


@contextmanager
def http_tool_server(tools: Tools) -> Iterator[str]:
    """The test MCP tool server over Streamable HTTP (its runs logged in
    `tools.http_log`): its /mcp URL once it answers, stopped afterwards."""
    port = free_port()
    proc = Proc([sys.executable, MCP_TOOL_SERVER, "http", tools.http_log, str(port)], "mcp-http")
    try:
        wait_for_port(port, proc)
        yield f"http://127.0.0.1:{port}/mcp"
    finally:
        proc.stop()


def wait_tools_ready(g: Gateway, names: tuple[str, ...] = ("crm", "web", "flaky")) -> None:
    deadline = time.monotonic() + 60
    models: dict[str, Any] = {}
    while time.monotonic() < deadline:
        models = httpx.get(g.url + "/readyz", headers=g.admin).json()["models"]
        if all(models.get(f"mcp:{n}", {}).get("ready") for n in names):
            return
        time.sleep(0.2)
    raise RuntimeError(f"tool servers not ready: {models}\n{g.proc.output()[-3000:]}")


class _Answers(httpx2.AsyncBaseTransport):
    """Plain HTTP that also keeps each POST's whole reply body once the SDK has read it,
    so a test can wait for an answer the SDK itself drops (a cancelled call's)."""

    def __init__(self, bodies: list[bytes]) -> None:
        self.inner = httpx2.AsyncHTTPTransport()
        self.bodies = bodies

    async def handle_async_request(self, request: httpx2.Request) -> httpx2.Response:
        response = await self.inner.handle_async_request(request)
        if request.method != "POST":
            return response
        stream, bodies = response.stream, self.bodies
        assert isinstance(stream, httpx2.AsyncByteStream)
        inner: httpx2.AsyncByteStream = stream

        class Kept(httpx2.AsyncByteStream):
            async def __aiter__(self) -> AsyncIterator[bytes]:
                parts = []
                async for part in inner:
                    parts.append(part)
                    yield part
                bodies.append(b"".join(parts))

            async def aclose(self) -> None:
                await inner.aclose()

        return httpx2.Response(
            response.status_code,
            headers=response.headers,
            stream=Kept(),
            extensions=response.extensions,
        )

    async def aclose(self) -> None:
        await self.inner.aclose()


@asynccontextmanager
async def session(
    g: Gateway, key: str | None = None, bodies: list[bytes] | None = None, **headers: str
) -> AsyncIterator[Any]:
    """The SDK's client session on the gateway's /mcp; `bodies`, when given, collects
    every POST's reply body as the SDK reads it."""
    auth = {"Authorization": f"Bearer {key or g.key}"}
    transport = _Answers(bodies) if bodies is not None else None
    async with (
        httpx2.AsyncClient(headers={**auth, **headers}, timeout=60, transport=transport) as http,
        streamable_http_client(g.url + "/mcp", http_client=http) as (read, write),
        ClientSession(read, write) as s,
    ):
        await s.initialize()
        yield s


def text(result: Any) -> str:
    return str(result.content[0].text)


@contextmanager
def tool_gateway(
    scripted: Any, tools: Tools, registry: list[dict[str, Any]], *models: dict[str, Any]
) -> Iterator[Gateway]:
    """A gateway whose model `cheap` (then `models`) is the scripted upstream, with one
    MCP tool server `web` (`tools`) under `registry`, ready; the upstream's scripted tool
    calls are cleared when it stops."""
    with http_tool_server(tools) as url:
        config = cheap_config(
            scripted,
            *models,
            mcp={"servers": [{"name": "web", "url": url}]},
            tools={"registry": registry},
        )
        g = start_gateway(config)
        try:
            wait_tools_ready(g, ("web",))
            yield g
        finally:
            httpx.put(scripted.url + "/control/tool_calls", json={"calls": []})
            g.proc.stop()


def proposed_call(
    gw: Gateway, scripted_url: str, key: str, task: str, name: str, args: Any
) -> dict[str, Any]:
    """The model (the scripted upstream at `scripted_url`) proposes `name(args)` in
    `task`: the tool call as the gateway relayed it, its id the gateway's own."""
    calls = [{"name": name, "arguments": args}]
    assert httpx.put(scripted_url + "/control/tool_calls", json={"calls": calls}).is_success
    try:
        r = httpx.post(
            gw.url + "/v1/chat/completions",
            json={"model": "cheap", "messages": [{"role": "user", "content": "mail the cfo"}]},
            headers={"Authorization": f"Bearer {key}", "x-task-id": task},
            timeout=30,
        )
    finally:
        httpx.put(scripted_url + "/control/tool_calls", json={"calls": []})
    assert r.status_code == 200, r.text
    call: dict[str, Any] = r.json()["choices"][0]["message"]["tool_calls"][0]
    assert call["function"]["name"] == name, call
    assert call["id"].startswith("call_sya_"), call
    return call
