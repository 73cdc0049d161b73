"""MCP tool servers as the gateway tests drive them: their run logs, waiting until a
server and the gateway's view of it are ready, and the official SDK's client session
on a gateway's /mcp."""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import httpx2
from mcp import ClientSession
from mcp.client.streamable_http import streamable_http_client

from support.gateways import Gateway
from support.mcp_http import tool_runs
from support.procs import Proc


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


def wait_tools_ready(g: Gateway, names: tuple[str, ...] = ("crm", "web", "flaky")) -> None:
    deadline = time.monotonic() + 60
    models: dict[str, Any] = {}
    while time.monotonic() < deadline:
        models = httpx.get(g.url + "/readyz", headers=g.admin).json()["models"]
        if all(models.get(f"mcp:{n}", {}).get("ready") for n in names):
            return
        time.sleep(0.2)
    raise RuntimeError(f"tool servers not ready: {models}\n{g.proc.output()[-3000:]}")


@asynccontextmanager
async def session(g: Gateway, key: str | None = None, **headers: str) -> AsyncIterator[Any]:
    auth = {"Authorization": f"Bearer {key or g.key}"}
    async with (
        httpx2.AsyncClient(headers={**auth, **headers}, timeout=60) as http,
        streamable_http_client(g.url + "/mcp", http_client=http) as (read, write),
        ClientSession(read, write) as s,
    ):
        await s.initialize()
        yield s


def text(result: Any) -> str:
    return str(result.content[0].text)
