"""The floor: a proxy that only forwards, built on Switchyard's own stack.

A gateway's latency over a direct call mixes two costs: the hop every Python proxy pays
(one more HTTP server, one more pooled client, one more copy of every byte) and what the
gateway's decisions add. This proxy pays only the first, with the same libraries Switchyard
uses (FastAPI on uvicorn, one aiohttp ClientSession with a TCPConnector pool), so
`switchyard bench overhead` can tell the two apart.

With `--bare` the two routes are served straight from the ASGI call, skipping FastAPI's
middleware and routing (as Switchyard's own model routes do, `api/app.py`), and uvicorn
does not rewrite client addresses from proxy headers: the stricter floor.

Bodies go to the upstream byte for byte and replies come back as they are; a reply that is
an event stream is relayed chunk by chunk as it arrives. Nothing is parsed.

    python -m switchyard.bench.passthrough_proxy --port 9002 --upstream http://127.0.0.1:9001/v1
"""

from __future__ import annotations

import argparse
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import orjson
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

# The same timeouts Switchyard applies to an upstream by default.
TIMEOUT = aiohttp.ClientTimeout(total=300, sock_connect=2, sock_read=60)
HEADERS = {"Content-Type": "application/json"}


def _bad_gateway(exc: BaseException) -> Response:
    err = {
        "message": f"upstream failed: {type(exc).__name__}: {exc}",
        "type": "server_error",
        "param": None,
        "code": None,
    }
    return Response(orjson.dumps({"error": err}), status_code=502, media_type="application/json")


async def _relay(resp: aiohttp.ClientResponse) -> AsyncIterator[bytes]:
    """Yield the upstream's bytes as they arrive. If the client leaves, drop the upstream
    connection (so it stops generating); if the upstream breaks, the error propagates and
    the server cuts the client's stream, exactly as the upstream cut ours."""
    complete = False
    try:
        async for chunk in resp.content.iter_any():
            yield chunk
        complete = True
    finally:
        if complete:
            resp.release()
        else:
            resp.close()


ROUTES = {"/v1/chat/completions": "/chat/completions", "/v1/completions": "/completions"}


class _BareApp(FastAPI):
    forward: Any

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            path = ROUTES.get(scope["path"])
            if path is not None:
                scope["app"] = self
                response = await self.forward(Request(scope, receive, send), path)
                await response(scope, receive, send)
                return
        await super().__call__(scope, receive, send)


def create_app(upstream: str, max_connections: int = 256, bare: bool = False) -> FastAPI:
    """The proxy app; `upstream` is a base URL such as http://127.0.0.1:9001/v1."""
    base = upstream.rstrip("/")

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        connector = aiohttp.TCPConnector(
            limit=max_connections, keepalive_timeout=30, ttl_dns_cache=300
        )
        async with aiohttp.ClientSession(connector=connector, headers=HEADERS) as session:
            app.state.session = session
            yield

    app = (_BareApp if bare else FastAPI)(
        title="passthrough", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None
    )

    async def forward(request: Request, path: str) -> Response:
        session: aiohttp.ClientSession = request.app.state.session
        body = await request.body()
        try:
            resp = await session.post(base + path, data=body, timeout=TIMEOUT)
        except (aiohttp.ClientError, OSError, TimeoutError) as exc:
            return _bad_gateway(exc)
        ctype = resp.headers.get("Content-Type", "application/json")
        if ctype.startswith("text/event-stream"):
            return StreamingResponse(_relay(resp), status_code=resp.status, media_type=ctype)
        try:
            data = await resp.read()
        except (aiohttp.ClientError, OSError, TimeoutError) as exc:
            return _bad_gateway(exc)
        finally:
            resp.release()
        return Response(data, status_code=resp.status, media_type=ctype)

    if isinstance(app, _BareApp):
        app.forward = forward
        return app

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await forward(request, "/chat/completions")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await forward(request, "/completions")

    return app


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m switchyard.bench.passthrough_proxy",
        description="A do-nothing pass-through proxy: the floor for gateway overhead.",
    )
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=9002)
    ap.add_argument("--upstream", required=True, help="base URL, e.g. http://127.0.0.1:9001/v1")
    ap.add_argument("--max-connections", type=int, default=256)
    ap.add_argument(
        "--bare", action="store_true", help="serve the routes from the ASGI call (see above)"
    )
    args = ap.parse_args(argv)
    if not args.upstream.startswith(("http://", "https://")):
        ap.error("--upstream must start with http:// or https://")
    uvicorn.run(
        create_app(args.upstream, args.max_connections, args.bare),
        host=args.host,
        port=args.port,
        log_level="warning",
        access_log=False,
        proxy_headers=not args.bare,
        server_header=not args.bare,
        timeout_graceful_shutdown=5,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
