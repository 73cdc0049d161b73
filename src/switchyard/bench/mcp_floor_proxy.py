"""The floor of `switchyard bench tools`: an MCP proxy that only forwards.

Switchyard's added latency over calling an MCP server directly mixes two costs: the hop
any Python proxy pays (one more HTTP server, one more pooled client, one more copy of
every byte) and what the gateway's governance adds. This proxy pays only the first, on
the stack Switchyard's `/mcp` uses (uvicorn with uvloop and httptools, a raw ASGI app,
one aiohttp ClientSession with kept-alive connections), so the bench can tell the two
apart. It parses nothing: each POST's body and MCP headers go to the server as they
are, and the reply's status, body and session id come back.

`python -m switchyard.bench.mcp_floor_proxy --port N --upstream http://127.0.0.1:M/mcp`
"""

from __future__ import annotations

import argparse
from typing import Any

import aiohttp
import uvicorn
from starlette.types import Receive, Scope, Send

PASSED = (b"content-type", b"accept", b"mcp-session-id", b"mcp-protocol-version")


class FloorProxy:
    """The ASGI app: POST (and DELETE) to the upstream, byte for byte."""

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream
        self.http: aiohttp.ClientSession | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            while (message := await receive())["type"] != "lifespan.shutdown":
                if message["type"] == "lifespan.startup":
                    self.http = aiohttp.ClientSession(
                        connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=4.0)
                    )
                    await send({"type": "lifespan.startup.complete"})
            if self.http is not None:
                await self.http.close()
            await send({"type": "lifespan.shutdown.complete"})
            return
        assert self.http is not None
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        headers = {k.decode(): v.decode() for k, v in scope["headers"] if k in PASSED}
        async with self.http.request(
            scope["method"], self.upstream, data=body, headers=headers
        ) as resp:
            data = await resp.read()
            out: list[Any] = [(b"content-length", str(len(data)).encode())]
            for name in ("content-type", "mcp-session-id"):
                if name in resp.headers:
                    out.append((name.encode(), resp.headers[name].encode()))
            await send({"type": "http.response.start", "status": resp.status, "headers": out})
            await send({"type": "http.response.body", "body": data})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--upstream", required=True, help="the MCP server's URL")
    args = ap.parse_args()
    uvicorn.run(
        FloorProxy(args.upstream),
        host="127.0.0.1",
        port=args.port,
        loop="uvloop",
        http="httptools",
        access_log=False,
        log_level="warning",
    )


if __name__ == "__main__":
    main()
