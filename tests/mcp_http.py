"""MCP over plain HTTP for the tests that must send what an SDK never would: open a
session on a gateway's /mcp, the headers of a request in it, and count a test tool
server's runs from its log (one JSON line per run)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx

from conftest import Gateway

ACCEPT = {"accept": "application/json, text/event-stream", "content-type": "application/json"}
VERSION = "2025-06-18"


def in_session(key: str, sid: str, **more: str) -> dict[str, str]:
    """The headers of a JSON-RPC request in the MCP session `sid`, with `key`."""
    return {
        "authorization": f"Bearer {key}",
        **ACCEPT,
        "mcp-session-id": sid,
        "mcp-protocol-version": VERSION,
        **more,
    }


def open_session(g: Gateway, key: str) -> str:
    """Initialize a session with `key` and confirm it; its id."""
    auth = {"authorization": f"Bearer {key}"}
    r = httpx.post(
        g.url + "/mcp",
        headers={**auth, **ACCEPT},
        json={
            "jsonrpc": "2.0",
            "id": 1,
            "method": "initialize",
            "params": {
                "protocolVersion": VERSION,
                "capabilities": {},
                "clientInfo": {"name": "hostile", "version": "1"},
            },
        },
        timeout=30,
    )
    assert r.status_code == 200, r.text
    sid = r.headers["mcp-session-id"]
    r = httpx.post(
        g.url + "/mcp",
        headers=in_session(key, sid),
        json={"jsonrpc": "2.0", "method": "notifications/initialized"},
        timeout=30,
    )
    assert r.status_code == 202, r.text
    return sid


def tool_runs(path: str, tool: str, **args: Any) -> int:
    """How many times a test tool server's log says `tool` ran with `args`."""
    lines = [json.loads(x) for x in Path(path).read_text().splitlines() if x]
    return sum(
        1
        for x in lines
        if x["tool"] == tool and all(x["args"].get(k) == v for k, v in args.items())
    )
