"""A real MCP tool server for the /mcp tests, written with the official SDK (`MCPServer`).

`python tests/mcp_tool_server.py stdio LOG` or `... http LOG PORT`. Every run of a tool
appends one line to LOG (`tool args`), so a test can count what actually ran.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time

from mcp.server.mcpserver import MCPServer

LOG = sys.argv[2]
server = MCPServer("test-tools")


def _ran(tool: str, **args: object) -> None:
    with open(LOG, "a") as f:
        f.write(json.dumps({"tool": tool, "args": args, "at": time.time()}) + "\n")


@server.tool()
def lookup(q: str) -> str:
    """Look a word up (read-only)."""
    _ran("lookup", q=q)
    return f"found: {q}"


@server.tool()
async def send_email(to: str, body: str) -> str:
    """Send an email (a side effect): takes a moment, so repeats overlap it."""
    _ran("send_email", to=to)
    await asyncio.sleep(0.5)
    return f"sent to {to}"


@server.tool()
def pay(amount: int) -> str:
    """Pay an amount (a side effect that needs an approval)."""
    _ran("pay", amount=amount)
    return f"paid {amount}"


@server.tool()
async def hang(seconds: float) -> str:
    """Take `seconds` to answer."""
    _ran("hang", seconds=seconds)
    try:
        await asyncio.sleep(seconds)
    except asyncio.CancelledError:  # the client sent notifications/cancelled
        _ran("hang_cancelled", seconds=seconds)
        raise
    return "woke up"


@server.tool()
def crash() -> str:
    """Die at once, as a server that crashes does, saying too much on the way."""
    _ran("crash")
    print(f"fatal: token={os.environ.get('CRM_TOKEN')}", file=sys.stderr, flush=True)
    os._exit(3)


@server.tool()
def whoami() -> str:
    """Whether the credential the gateway injects arrived (never its value)."""
    _ran("whoami")
    return "token ok" if os.environ.get("CRM_TOKEN") == "s3cret-token" else "no token"


if __name__ == "__main__":
    if sys.argv[1] == "stdio":
        server.run("stdio")
    else:
        server.run("streamable-http", host="127.0.0.1", port=int(sys.argv[3]), json_response=True)
