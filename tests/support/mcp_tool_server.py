"""A real MCP tool server for the /mcp tests, written with the official SDK (`MCPServer`).

`python tests/support/mcp_tool_server.py stdio LOG` or `... http LOG PORT` (the tests
take its path from `support.paths.MCP_TOOL_SERVER`). Every run of a tool appends one
line to LOG (`tool args`), so a test can count what actually ran. Over
HTTP, a `tools/call` of `explode` is answered with an HTTP 500 before the tool runs,
as a failing server (or the proxy in front of it) answers.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from typing import Any

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
def big(n: int, to: str = "") -> str:
    """Answer with `n` characters (a side effect too: it runs, then answers big)."""
    _ran("big", n=n, to=to)
    return "x" * n


@server.tool()
def explode() -> str:
    """Never runs over HTTP (see the module docstring)."""
    _ran("explode")
    return "boom"


def failing_on_explode(app: Any) -> Any:
    """`app`, except that a tools/call of `explode` gets an HTTP 500."""

    async def wrapped(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["method"] != "POST":
            await app(scope, receive, send)
            return
        chunks, more = [], True
        while more:
            message = await receive()
            chunks.append(message.get("body", b""))
            more = message.get("more_body", False)
        body = b"".join(chunks)
        try:
            call = json.loads(body)
        except ValueError:
            call = None
        if isinstance(call, dict) and (call.get("params") or {}).get("name") == "explode":
            await send({"type": "http.response.start", "status": 500, "headers": []})
            await send({"type": "http.response.body", "body": b"internal error"})
            return
        sent = False

        async def replay() -> Any:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await app(scope, replay, send)

    return wrapped


@server.tool()
def whoami() -> str:
    """Whether the credential the gateway injects arrived (never its value)."""
    _ran("whoami")
    return "token ok" if os.environ.get("CRM_TOKEN") == "s3cret-token" else "no token"


if __name__ == "__main__":
    if sys.argv[1] == "stdio":
        server.run("stdio")
    else:
        import uvicorn

        app = server.streamable_http_app(json_response=True)
        uvicorn.run(
            failing_on_explode(app), host="127.0.0.1", port=int(sys.argv[3]), log_level="warning"
        )
