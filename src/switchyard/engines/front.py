"""The engine front: one process's managed local engines, served over HTTP to other
processes of the same gateway.

Why: with `switchyard serve --workers N` one control plane process owns the local
engines and their residency pool (engines/pool.py), and the N gateway workers must not
start N copies of an engine. Each worker reaches every local model the way Ray's
gateway replicas reach its engine applications (scale/ray_app.py): as an OpenAI
upstream at `{front}/{alias}/v1` with a bearer token (`remote_engines`; `{front}` is
where the app is served, e.g. the control plane's internal server at `/engines`), an
adapter named as the model and in the `serve_multiplexed_model_id` header
(engines/registry.py `MULTIPLEXED_MODEL_HEADER`). Because there is one pool, residency
(loaded models, active adapters, the adapter queue) is exact across the workers.

One request to one engine is `answer()`, the one copy of the rule that Ray's engine
deployment also runs: the token (compared in constant time, the header bounded), the
path allow-list, the body bound, the adapter (an unknown one is 404), the pool's hold
(`EngineTarget.hold`: acquire, then the adapter's turn), the forward to the engine's own
server on one aiohttp session, SSE relayed as it arrives (any other answer read whole,
within a bound), and the release of the hold on every ending. Errors are the OpenAI
error body (errors.py), never exception text.

Besides the OpenAI routes, the front forwards llama-server's `/tokenize` (at
`{front}/{name}/tokenize`, where the engine's own server has it beside `/v1`): the
gateway tokenizes the templated prompt of a `return_token_ids` reply on the server
that made it (engines/token_ids.py), and a worker's upstream for a local model is the
front (a `FrontedEngine`, which keeps the engine's spec so the worker knows what it
gives). The tokenizer is the base model's whatever adapter is active, so a tokenize
holds the engine (loaded, not evicted, while it runs) but takes no adapter's turn and
goes as it came.

Where the caller hangs up: under Ray, Serve cancels the handler when its client goes;
plain uvicorn does not, so `EngineFront` watches the connection while a request waits
(for a load, for its adapter's turn, for the engine's answer) and while it streams, and
cancels it when the worker is gone, so a killed worker leaves no hold behind.
`serve_front` runs an app on a free loopback port inside the caller's event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import socket
import time
from collections.abc import AsyncGenerator, Awaitable, Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import aiohttp
import orjson
import uvicorn
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from switchyard.aio import hung_up, until_gone
from switchyard.config import LlamaCppEngine, ModelConfig, OpenAIEngine, Settings, VllmEngine
from switchyard.engines.bounded import read_bounded
from switchyard.engines.llamacpp import ManagedLlamaCpp
from switchyard.engines.pool import BASE, EnginePool
from switchyard.engines.registry import MULTIPLEXED_MODEL_HEADER, Registry
from switchyard.engines.token_ids import FrontedEngine
from switchyard.errors import (
    AuthenticationError,
    ClientDisconnected,
    EngineNotReady,
    InvalidRequest,
    MethodNotAllowed,
    ModelNotFound,
    PayloadTooLarge,
    RouteNotFound,
    SwitchyardError,
    UpstreamError,
    UpstreamUnreachable,
)

__all__ = [
    "ENGINE_PATHS",
    "MAX_BODY",
    "TOKENIZE",
    "EngineFront",
    "EngineTarget",
    "Lease",
    "Relay",
    "RunningFront",
    "answer",
    "read_body",
    "read_reply",
    "remote_engines",
    "route_path",
    "serve_front",
    "split_path",
    "until_disconnect",
]

log = logging.getLogger("switchyard.engine")
T = TypeVar("T")

TOKENIZE = "/tokenize"  # llama-server's, at its root (engines/token_ids.py)
ENGINE_PATHS = frozenset(("/v1/chat/completions", "/v1/completions", "/v1/models", TOKENIZE))
MAX_BODY = 64 * 1024 * 1024  # the gateway bounds bodies far below this; a backstop
MAX_REPLY = MAX_BODY  # an engine's whole (not streamed) answer; far above any real one
ADAPTER_HEADER = "x-switchyard-engine-adapter"  # the adapter that answered
_JSON = {"content-type": "application/json"}
# Longer than the gateway's upstream client keeps an idle connection (30 s,
# engines/upstream.py): the client closes first, never reusing one closed under it.
_KEEP_ALIVE_S = 75


def remote_engines(
    settings: Settings, front_url: str, token_env: str, *, deployments: bool = True
) -> Settings:
    """`settings` as a gateway process that does not own the local engines sees them:
    every local model's engine becomes an OpenAI upstream at the engine front served at
    `front_url`, `{front_url}/{name}/v1` with the bearer key in `token_env`, `name` being
    the engine's name in the owner's pool (the alias; "alias/deployment" for one of a
    model's `deployments`, when `deployments`). Adapters stay: each is an alias over its
    base there, named as the model and sent with the multiplexing header
    (engines/registry.py). Each upstream is a `FrontedEngine` that keeps the engine's own
    spec (engines/token_ids.py reads it). Ray Serve has an engine application per model's
    own engine only (scale/serve_config.py), so it passes `deployments=False`."""
    base = front_url.rstrip("/")

    def remote(name: str, spec: LlamaCppEngine | VllmEngine) -> OpenAIEngine:
        policy = spec.scheduling_policy if isinstance(spec, VllmEngine) else "fcfs"
        return FrontedEngine(
            kind="openai",
            base_url=f"{base}/{name}/v1",
            model=name,
            api_key_env=token_env,
            max_connections=256,
            scheduling_policy=policy,
            managed=spec,
        )

    models: list[ModelConfig] = []
    for m in settings.models:
        if deployments and m.deployments:
            # A deployment keeps its placement location (`device`), which it would
            # otherwise lose with its managed engine (config/deployments.py `where`).
            deps = [
                d.model_copy(
                    update={
                        "engine": remote(f"{m.alias}/{d.name}", d.engine),
                        "location": d.where,
                    }
                )
                if isinstance(d.engine, LlamaCppEngine | VllmEngine)
                else d
                for d in m.deployments
            ]
            # `engine` is the first deployment's (config/models.py)
            m = m.model_copy(update={"deployments": deps, "engine": deps[0].engine})
        elif isinstance(m.engine, LlamaCppEngine | VllmEngine):
            m = m.model_copy(update={"engine": remote(m.alias, m.engine)})
        models.append(m)
    return settings.model_copy(update={"models": models})


def route_path(scope: Any) -> str:
    """The request's path below where its app is mounted (ASGI `root_path`; Starlette's
    Mount leaves `path` whole)."""
    path: str = scope["path"]
    root: str = scope.get("root_path", "")
    if root and path.startswith(root) and path[len(root) : len(root) + 1] in ("", "/"):
        return path[len(root) :]
    return path


def split_path(path: str) -> tuple[str, str]:
    """A request path as (what comes before `/v1/`, the engine route from `/v1/`), or,
    for a path without `/v1/` that ends in TOKENIZE, (what comes before, TOKENIZE);
    the route is "" for any other path."""
    at = path.find("/v1/")
    if at >= 0:
        return path[:at], path[at:]
    if path.endswith(TOKENIZE):
        return path[: -len(TOKENIZE)], TOKENIZE
    return path, ""


class Lease:
    """One request's hold on its engine in the pool (and on its adapter, or its base
    turn, when counted), given back exactly once whatever ends the request."""

    __slots__ = ("counted", "engine", "held", "pool")

    def __init__(self, pool: EnginePool, engine: ManagedLlamaCpp) -> None:
        self.pool = pool
        self.engine = engine
        self.counted: str | None = None  # the name the pool counts in adapter_in_flight
        self.held = True

    def release(self) -> None:
        if self.held:
            self.held = False
            self.pool.release(self.engine, self.counted)


@dataclass(slots=True)
class EngineTarget:
    """One local engine as the front serves it. `wait_s` bounds a request's wait for
    the engine's load and its adapter's turn (the caller's own deadline ends it sooner
    by hanging up); `on_adapter` hears each adapter request first (Ray's record of the
    adapters a replica serves)."""

    engine: ManagedLlamaCpp
    pool: EnginePool
    wait_s: float
    on_adapter: Callable[[str], Awaitable[object]] | None = None

    @property
    def adapters(self) -> frozenset[str]:
        return frozenset(a.name for a in self.engine.adapters)

    async def hold(self, body: bytes, adapter: str) -> tuple[bytes, Lease]:
        """Hold the engine with the request's adapter (or the base) active, as the
        residency pool decides: the body to send (for an engine with adapters, the model
        and adapter scales it serves the request with) and the lease to release. Raises
        the pool's refusals (503 with Retry-After) and 400 for a body that is no JSON
        object where it must be rewritten."""
        e = self.engine
        obj: dict[str, Any] | None = None
        if e.adapters:
            try:
                parsed = orjson.loads(body)
            except orjson.JSONDecodeError:
                raise InvalidRequest("the body is not JSON") from None
            if not isinstance(parsed, dict):
                raise InvalidRequest("the body is not a JSON object")
            obj = parsed
        if adapter and self.on_adapter is not None:
            await self.on_adapter(adapter)
        deadline = time.monotonic() + self.wait_s
        lease = await self.hold_engine()
        name = adapter or BASE  # BASE: a base request (its turn, if kept apart)
        try:
            if adapter or e.isolate_base:
                if self.pool.adapter_now(e, name) is None:
                    await self.pool.adapter(e, name, deadline - time.monotonic())
                lease.counted = name
        except BaseException:
            lease.release()
            raise
        if obj is None:
            return body, lease
        if e.kind == "vllm":
            obj["model"] = adapter or e.alias  # vLLM serves an adapter by its name
        else:
            obj["model"] = e.alias
            obj["lora"] = e.lora_scales(adapter or None)
        return orjson.dumps(obj), lease

    async def hold_engine(self) -> Lease:
        """Hold the engine alone (loaded, and not evicted until released), as the pool
        decides, with no adapter's turn; raises the pool's refusals."""
        await self.pool.acquire(self.engine, self.wait_s)
        return Lease(self.pool, self.engine)

    async def forward(
        self,
        method: str,
        route: str,
        body: bytes,
        adapter: str,
        session: aiohttp.ClientSession,
        headers: dict[str, str],
    ) -> Response:
        """The engine's answer to one request on `route` (in ENGINE_PATHS), the engine
        held for it (but for the model list) until the answer has been read or relayed:
        with the request's adapter, or for a tokenize alone (the body as it came, once it is
        one: `_check_tokenize`)."""
        lease: Lease | None = None
        if route == "/v1/models":
            if not self.engine.ready:
                raise EngineNotReady(
                    f"the model '{self.engine.alias}' is {self.engine.state.value}"
                )
        elif route == TOKENIZE:
            _check_tokenize(method, body)  # before the hold, which may load the engine
            lease = await self.hold_engine()
        else:
            body, lease = await self.hold(body, adapter)
            if adapter:
                headers = {**headers, ADAPTER_HEADER: adapter}
        try:
            upstream = await session.request(
                method,
                self.engine.base_url.removesuffix("/v1") + route,
                data=body or None,
                headers=_JSON,
            )
        except BaseException as exc:
            if lease is not None:
                lease.release()
            if isinstance(exc, aiohttp.ClientError | OSError):  # TimeoutError included
                log.warning("engine %s did not answer: %r", self.engine.alias, exc)
                raise UpstreamUnreachable(
                    f"the engine of '{self.engine.alias}' did not answer"
                ) from None
            raise
        ctype = upstream.headers.get("content-type", "application/json")
        if ctype.startswith("text/event-stream"):
            return Relay(upstream, lease, ctype, headers)
        try:
            data = await read_reply(upstream, MAX_REPLY)
        except aiohttp.ClientError as exc:
            log.warning("engine %s broke off its answer: %r", self.engine.alias, exc)
            raise UpstreamUnreachable(
                f"the engine of '{self.engine.alias}' broke off its answer"
            ) from None
        finally:
            upstream.release()
            if lease is not None:
                lease.release()
        return Response(data, status_code=upstream.status, media_type=ctype, headers=headers)


def _check_tokenize(method: str, body: bytes) -> None:
    """A tokenize is what the gateway sends (engines/upstream.py `tokenize`): a POST
    of a JSON object with the text as `content`; anything else is refused here (405,
    400), not after holding (perhaps loading) the engine to relay its parser's error."""
    if method != "POST":
        raise MethodNotAllowed("a tokenize is a POST")
    try:
        obj = orjson.loads(body)
    except orjson.JSONDecodeError:
        raise InvalidRequest("the body is not JSON") from None
    if not isinstance(obj, dict) or not isinstance(obj.get("content"), str):
        raise InvalidRequest("a tokenize is a JSON object with the text as 'content'")


class Relay(StreamingResponse):
    """An engine's event stream, relayed chunk by chunk as it arrives. Closing it (at
    the stream's end, when the caller hangs up, or when the handler is cancelled)
    gives back the engine's connection (dropped unless the stream ended, so the engine
    stops generating) and the hold, exactly once."""

    def __init__(
        self,
        upstream: aiohttp.ClientResponse,
        lease: Lease | None,
        ctype: str,
        headers: dict[str, str],
    ) -> None:
        self.upstream = upstream
        self.lease = lease
        self.finished = False
        self.chunks = self._chunks()
        super().__init__(
            self.chunks, status_code=upstream.status, media_type=ctype, headers=headers
        )

    async def _chunks(self) -> AsyncGenerator[bytes, None]:
        async for chunk in self.upstream.content.iter_any():
            yield chunk
        self.finished = True

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.close()

    async def close(self) -> None:
        with contextlib.suppress(RuntimeError):  # already running elsewhere: it ends there
            await self.chunks.aclose()
        if self.finished:
            self.upstream.release()
        else:
            self.upstream.close()
        if self.lease is not None:
            self.lease.release()

    def abandon(self) -> None:
        """Give back, at once, what a relay that never ran holds: the engine's
        connection dropped (the engine stops generating) and the hold released."""
        self.upstream.close()
        if self.lease is not None:
            self.lease.release()


async def read_reply(upstream: aiohttp.ClientResponse, limit: int) -> bytes:
    """An engine's whole answer, refused (502) past `limit` bytes (engines/bounded.py),
    so a broken engine cannot make the front hold an unbounded reply in memory."""
    data = await read_bounded(upstream, limit)
    if data is None:
        raise UpstreamError(f"the engine's answer is over {limit} bytes")
    return data


def _error(exc: SwitchyardError, headers: dict[str, str]) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status, headers={**headers, **exc.headers})


async def read_body(request: Request, limit: int) -> bytes:
    """The body, refused (413) past `limit` bytes: by its declared length before any
    of it is read, else as it arrives."""
    declared = request.headers.get("content-length", "")
    if declared.isascii() and declared.isdigit() and int(declared) > limit:
        raise PayloadTooLarge(f"the body is {int(declared)} bytes; the limit is {limit}")
    chunks: list[bytes] = []
    size = 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise PayloadTooLarge(f"the body exceeds the limit of {limit} bytes")
            chunks.append(chunk)
    except ClientDisconnect:
        raise ClientDisconnected("the caller left before its body arrived") from None
    return b"".join(chunks)


async def answer(
    request: Request,
    token: bytes,
    target: EngineTarget | None,
    route: str,
    adapter: str,
    session: aiohttp.ClientSession,
    headers: dict[str, str],
    watch: bool = False,
) -> Response:
    """One request to one local engine (`target`; None: no such engine) on `route`
    (split_path), for the adapter the caller named ("" for the base). `headers` go on
    every answer. With `watch`, the wait for the engine and its answer are cancelled
    when the caller hangs up (ClientDisconnected is raised: nobody is left to answer);
    a stream's own wait is the caller's to watch (EngineFront)."""
    given = request.headers.get("authorization", "")[:256].removeprefix("Bearer ")
    try:
        if not hmac.compare_digest(given.encode(), token):
            raise AuthenticationError("the engines answer the gateway only")
        if route not in ENGINE_PATHS:
            raise RouteNotFound("no such engine route")
        if target is None:
            raise ModelNotFound("no such local engine", param="model")
        body = await read_body(request, MAX_BODY)
        if adapter and adapter not in target.adapters:
            raise ModelNotFound(f"no adapter {adapter[:128]!r} on this engine", param="model")
        work = target.forward(request.method, route, body, adapter, session, headers)
        return await (until_disconnect(request.receive, work) if watch else work)
    except ClientDisconnected:
        raise
    except SwitchyardError as exc:
        return _error(exc, headers)


async def until_disconnect(receive: Callable[[], Awaitable[Any]], work: Awaitable[T]) -> T:
    """`work`'s result, or ClientDisconnected once the caller hangs up first (`work`
    cancelled and awaited: what it held is given back before this returns). Call only
    once the request's body has been read. An engine's stream that `work` came to as
    this wait was cancelled (uvicorn's shutdown cancels its handlers) is abandoned, not
    dropped: its connection and its hold in the pool go back."""
    return await until_gone(work, hung_up(receive), "the caller hung up", _abandon)


def _abandon(result: object) -> None:
    if isinstance(result, Relay):  # a whole answer holds nothing: read, hold released
        result.abandon()


class EngineFront:
    """The ASGI app: `/{name}/v1/chat/completions`, `/completions` and `/models`, and
    `/{name}/tokenize`, below where it is served, for each managed engine of `registry` (a model's own, and each
    of a model's deployments, by its name in the pool), each waiting at most its
    model's total timeout; for callers with `token`. One aiohttp session to the
    engines, opened on first use and closed by `close()` (or by the app's lifespan
    shutdown, where it is served on its own)."""

    def __init__(self, registry: Registry, token: str) -> None:
        self.targets: Mapping[str, EngineTarget] = {
            d.engine.alias: EngineTarget(d.engine, registry.pool, d.model.timeouts.total_s)
            for d in registry.every()
            if d.engine is not None and d.adapter is None
        }
        self.token = token.encode()
        self._session: aiohttp.ClientSession | None = None

    def session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=5),
                connector=aiohttp.TCPConnector(limit=1024),
            )
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        request = Request(scope, receive)
        head, route = split_path(route_path(scope))
        target = self.targets.get(head[1:])
        adapter = request.headers.get(MULTIPLEXED_MODEL_HEADER, "")[:256]
        response: Response | None = None
        try:
            response = await answer(
                request, self.token, target, route, adapter, self.session(), {}, watch=True
            )
            if isinstance(response, Relay):
                await until_disconnect(receive, response(scope, receive, send))
            else:
                await response(scope, receive, send)
        except (ClientDisconnected, ClientDisconnect, OSError):
            return  # the caller is gone: nobody to answer, nothing left held
        finally:
            if isinstance(response, Relay):
                await response.close()

    async def _lifespan(self, receive: Any, send: Any) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await self.close()
                await send({"type": "lifespan.shutdown.complete"})
                return


class _Embedded(uvicorn.Server):
    """uvicorn inside a process that has its own signal handling: the host's event
    loop runs it, and SIGINT / SIGTERM stay the host's."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


@dataclass(slots=True)
class RunningFront:
    """A front serving on loopback: `url` is what workers are given."""

    server: uvicorn.Server
    task: asyncio.Task[None]
    port: int
    url: str

    async def stop(self) -> None:
        self.server.should_exit = True
        with contextlib.suppress(asyncio.CancelledError):
            await self.task


async def serve_front(app: Any, host: str = "127.0.0.1") -> RunningFront:
    """Serve `app` on a free port of `host` in the running event loop, from a socket
    bound here (so the port is known before anyone is told it); returns once it
    accepts connections. Raises RuntimeError if it cannot start."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind((host, 0))
        sock.listen(1024)
    except OSError:
        sock.close()
        raise
    port = int(sock.getsockname()[1])
    config = uvicorn.Config(
        app,
        log_config=None,  # the host process's logging stays as it configured it
        access_log=False,
        lifespan="on",
        timeout_keep_alive=_KEEP_ALIVE_S,
        timeout_graceful_shutdown=5,
    )
    server = _Embedded(config)
    task = asyncio.create_task(server.serve(sockets=[sock]), name="engine-front")
    while not server.started:
        if task.done():
            sock.close()
            raise RuntimeError("the engine front did not start") from task.exception()
        await asyncio.sleep(0.01)
    return RunningFront(server, task, port, f"http://{host}:{port}")
