"""MCP over plain HTTP for the tests that must send what an SDK never would: open a
session on a gateway's /mcp, the headers of a request in it, and count a test tool
server's runs from its log (one JSON line per run)."""

from __future__ import annotations

import http.server
import json
from pathlib import Path
from typing import Any

import httpx

from support.gateways import Gateway

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


def initialize(client: str = "hostile") -> dict[str, Any]:
    """The JSON-RPC `initialize` request that opens a session."""
    return {
        "jsonrpc": "2.0",
        "id": 1,
        "method": "initialize",
        "params": {
            "protocolVersion": VERSION,
            "capabilities": {},
            "clientInfo": {"name": client, "version": "1"},
        },
    }


def open_session(g: Gateway, key: str) -> str:
    """Initialize a session with `key` and confirm it; its id."""
    auth = {"authorization": f"Bearer {key}"}
    r = httpx.post(g.url + "/mcp", headers={**auth, **ACCEPT}, json=initialize(), timeout=30)
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


class ScriptedToolServer(http.server.BaseHTTPRequestHandler):
    """A Streamable HTTP MCP server (JSON replies) that a test scripts: it answers
    `initialize` as `name` and `tools/list` with `tools`, and `tools/call` with what
    `call` returns (None: `call` wrote its own reply); notifications get 202."""

    name = "scripted"
    tools: list[dict[str, Any]] = []

    def call(self, msg: dict[str, Any]) -> Any:
        return {}

    def do_POST(self) -> None:
        msg = json.loads(self.rfile.read(int(self.headers["content-length"])))
        if "id" not in msg:  # a notification
            self.send_response(202)
            self.send_header("content-length", "0")
            self.end_headers()
            return
        method = msg["method"]
        result: Any = {}
        if method == "initialize":
            result = {
                "protocolVersion": msg["params"]["protocolVersion"],
                "capabilities": {"tools": {}},
                "serverInfo": {"name": self.name, "version": "1"},
            }
        elif method == "tools/list":
            result = {"tools": self.tools}
        elif method == "tools/call":
            result = self.call(msg)
            if result is None:
                return
        self.reply(
            200,
            "application/json",
            json.dumps({"jsonrpc": "2.0", "id": msg["id"], "result": result}).encode(),
        )

    def reply(self, status: int, ctype: str, body: bytes) -> None:
        self.send_response(status)
        self.send_header("content-type", ctype)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        self.send_response(405)
        self.send_header("content-length", "0")
        self.end_headers()

    do_DELETE = do_GET

    def log_message(self, *args: Any) -> None:
        pass
