"""The MCP tool server of `switchyard bench tools`: written with the official SDK
(`MCPServer`), served over Streamable HTTP with JSON replies, doing as little as a tool
can, so what the benchmark measures is the path to it.

`python -m switchyard.bench.mcp_echo_server --port N`
"""

from __future__ import annotations

import argparse
import asyncio

from mcp.server.mcpserver import MCPServer

server = MCPServer("bench-tools")
_recorded = 0


@server.tool()
def echo(text: str) -> str:
    """Return the text (read-only)."""
    return text


@server.tool()
def record(text: str) -> str:
    """Count a call (a side effect: the gateway records it at most once)."""
    global _recorded
    _recorded += 1
    return f"{_recorded}: {text}"


@server.tool()
async def pause(ms: int, text: str = "") -> str:
    """Answer after `ms` milliseconds (at most 10 s): a tool of known duration, for the
    agent-task benchmark's tool steps (read-only)."""
    await asyncio.sleep(min(max(ms, 0), 10_000) / 1000)
    return text or f"paused {ms} ms"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--port", type=int, required=True)
    args = ap.parse_args()
    server.run("streamable-http", host="127.0.0.1", port=args.port, json_response=True)


if __name__ == "__main__":
    main()
