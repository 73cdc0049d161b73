"""One pooled async HTTP client per OpenAI-compatible upstream.

Managed local engines speak the same API over loopback, so the gateway has a single
upstream code path; an Anthropic-protocol upstream (engines/anthropic.py) is this client
with a translation on each side. Transport failures are translated here, once, into the error
hierarchy: unreachable → 502, timeout → 504, broken reply → 502.

An upstream is not trusted to be well-behaved: a whole reply is read within
`MAX_REPLY_BYTES` (an error's within `MAX_ERROR_BYTES`), a 2xx reply that is not a JSON
object (or a completion with no choice 0) is a broken reply, one stream event may hold
at most `MAX_EVENT_BYTES`, and a `Retry-After` reaches the client only as a short whole
number of seconds. A stream from a managed engine's worker (`UpstreamStream.watch`)
that breaks because the worker died is `EngineCrashed`, not a nameless broken stream.
"""

from __future__ import annotations

import asyncio
import math
import re
from collections.abc import AsyncGenerator, Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import aiohttp
import orjson

from switchyard.config import Timeouts
from switchyard.engines.bounded import read_bounded
from switchyard.errors import (
    ContextLengthExceeded,
    EngineCrashed,
    SwitchyardError,
    UpstreamError,
    UpstreamOverloaded,
    UpstreamRateLimited,
    UpstreamStatusError,
    UpstreamTimeout,
    UpstreamUnreachable,
)

MAX_REPLY_BYTES = 64 << 20  # a whole reply: n choices with logprobs fit many times
MAX_ERROR_BYTES = 64 << 10  # an error's body: only its message is read (1,000 chars)
MAX_EVENT_BYTES = 4 << 20  # one stream event (engines send a token or a call piece)


@dataclass(slots=True)
class UpstreamReply:
    status: int
    body: bytes
    headers: Mapping[str, str]  # the upstream's, as received (not copied)
    obj: dict[str, Any] | None = None  # the body parsed (post checks it is an object)


async def _read(resp: aiohttp.ClientResponse, limit: int) -> bytes | None:
    """The whole body within `limit` bytes (None past it): read at once when its
    declared length is within the bound and it is not compressed (the usual reply: a
    compressed body's declared length says nothing of what it inflates to), else
    counted as it comes."""
    declared = resp.content_length
    if declared is not None and declared <= limit and "Content-Encoding" not in resp.headers:
        return await resp.read()
    return await read_bounded(resp, limit)


def _retry_after(value: str | None) -> str | None:
    """An upstream's `Retry-After` when it is a whole number of seconds of at most six
    digits; anything else (a date, text, thousands of digits) is not passed on."""
    if value is None:
        return None
    value = value.strip()
    return value if value.isdigit() and len(value) <= 6 else None


# The request member that holds the prompt, by the path it is sent to: what a refusal
# of the prompt's length names as its `param`.
_PROMPT_PARAM = {
    "/chat/completions": "messages",
    "/completions": "prompt",
    "/messages": "messages",
    "/responses": "input",
    "/embeddings": "input",
}
# The paths whose whole reply answers in `choices`: one without choice 0 (no `choices`,
# an empty list, only other indexes) holds no answer, and is a broken reply, never a
# 200 with nothing in it, billed at the estimate.
_CHOICE_PATHS = frozenset({"/chat/completions", "/completions"})


def _has_choice_0(reply: dict[str, Any]) -> bool:
    """Whether a whole reply holds choice 0: an object of index 0, or of no index (an
    upstream that leaves it out sends one choice), anywhere in `choices`, as
    reply.py `first_choice` reads it."""
    choices = reply.get("choices")
    if type(choices) is not list:
        return False
    for c in choices:
        if isinstance(c, dict):
            index = c.get("index")
            if index is None or (type(index) is int and index == 0):
                return True
    return False


# The words engines refuse a prompt past their context with (lowercased): vLLM's and
# OpenAI's "This model's maximum context length is N tokens ...", llama-server's
# "request (N tokens) exceeds the available context size (M tokens)", Anthropic's
# "prompt is too long: N tokens > M maximum".
_CONTEXT_WORDS = (
    "maximum context length",
    "exceeds the available context size",
    "context length exceeded",
    "prompt is too long",
)
_CONTEXT_KINDS = frozenset({"exceed_context_size_error", "context_length_exceeded"})
# The statuses an engine refuses a prompt past its context with: 400 (llama-server's
# `exceed_context_size_error`, vLLM's, OpenAI's and Anthropic's), 413 (a proxy or
# provider that answers "too large"). Another 4xx (401, 403, 404, 422, ...) is its
# own failure even when its words mention the context.
_CONTEXT_STATUSES = frozenset({400, 413})
# llama-server's refusal of a request member: "Field 'n': Value must be between ...".
_FIELD = re.compile(r"Field '([A-Za-z_][A-Za-z0-9_.]{0,63})'")


def _count(value: Any) -> int | None:
    """A token count an engine reports beside its error, when it is one."""
    return value if type(value) is int and 0 <= value < 1 << 31 else None


def _context_refusal(
    status: int, detail: dict[str, Any], message: str, name: str, path: str | None
) -> ContextLengthExceeded | None:
    """The upstream's 400 or 413 as `context_length_exceeded` when it says the prompt (with
    the output it may write) does not fit the model's context: llama-server's
    `exceed_context_size_error`, OpenAI's `context_length_exceeded` code, the words
    vLLM, llama-server and Anthropic use for it. The client is told in the gateway's
    own words, with llama-server's counts when it gives them (integers); `param`
    names the prompt's member on the path it was sent to."""
    if status not in _CONTEXT_STATUSES:
        return None
    kinds = (detail.get("type"), detail.get("code"))
    text = message[:1000].lower()
    if not any(k in _CONTEXT_KINDS for k in kinds if isinstance(k, str)) and not any(
        w in text for w in _CONTEXT_WORDS
    ):
        return None
    window, prompt = _count(detail.get("n_ctx")), _count(detail.get("n_prompt_tokens"))
    if window is not None and prompt is not None:
        said = (
            f"this model's maximum context length is {window} tokens; the prompt has "
            f"{prompt} tokens"
        )
    else:
        said = f"the request does not fit the context window of upstream {name}"
    param = _PROMPT_PARAM.get(path or "")
    return ContextLengthExceeded(
        f"{said}; shorten the {param or 'prompt'}", param=param, detail=message[:1000]
    )


def _upstream_error(
    status: int, body: bytes, name: str, headers: Any = None, path: str | None = None
) -> SwitchyardError:
    """Map a non-2xx upstream reply onto our error hierarchy: one mapping for both
    protocols. OpenAI's body `{"error": {"message", "param"}}` and Anthropic's
    `{"type": "error", "error": {"type", "message"}}` both carry the message under
    `error`; Anthropic's 529 (`overloaded_error`) is a 503 by another number. A 400 or
    413 that says the prompt is past the model's context is `context_length_exceeded`
    (`path`, the upstream path the request went to, names its prompt member)."""
    message = f"upstream {name} answered HTTP {status}"
    param = None
    fields: dict[str, Any] = {}
    try:
        detail = orjson.loads(body).get("error")
        if isinstance(detail, dict) and detail.get("message"):
            message = str(detail["message"])
            param = detail.get("param")
            fields = detail
        elif isinstance(detail, str):
            message = detail
    except (orjson.JSONDecodeError, AttributeError):
        pass
    retry_after = _retry_after(headers.get("Retry-After") if headers is not None else None)
    err: SwitchyardError
    # The upstream's own words go to the log and the (PII-masked) trace. A client sees
    # them only for a 4xx, where they say what is wrong with its own request (a bad
    # parameter), bounded; a server error's text is the upstream's internals, so the
    # client gets a stable message.
    detail = message[:1000]
    if status == 429:
        err = UpstreamRateLimited(
            f"upstream {name} is rate limiting",
            headers={"Retry-After": retry_after} if retry_after else None,
            detail=detail,
        )
        err.retry_class = "429"
    elif 400 <= status < 500 and status != 408:
        context = _context_refusal(status, fields, message, name, path)
        if context is not None:
            return context
        if isinstance(param, str):
            param = param[:64]
        else:  # llama-server names the member it refuses only in its message
            field = _FIELD.match(message)
            param = field.group(1) if field is not None else None
        return UpstreamStatusError(status, message[:500], param=param, detail=detail)
    elif status in (408, 504):
        err = UpstreamTimeout(f"upstream {name} timed out", detail=detail)
        err.retry_class = "504"
    elif status in (503, 529) and retry_after:
        err = UpstreamOverloaded(
            f"upstream {name} is at capacity; retry after {retry_after} s",
            headers={"Retry-After": retry_after},
            detail=detail,
        )
        err.retry_class = "503"
    else:
        err = UpstreamError(f"upstream {name} failed with HTTP {status}", detail=detail)
        cls = 503 if status == 529 else status
        err.retry_class = str(cls) if cls in (500, 502, 503) else "500"
    if retry_after:
        err.retry_after_s = float(retry_after)
    return err


class OpenAIUpstream:
    """A pooled client for one upstream. `base_url` may move (a restarted worker)."""

    def __init__(
        self,
        name: str,
        base_url: Callable[[], str],
        api_key: str | None = None,
        max_connections: int = 256,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        """`headers` go with every request in place of `Authorization: Bearer
        <api_key>` (another protocol's way to send its key)."""
        self.name = name
        self._base_url = base_url
        self._headers = {"Content-Type": "application/json"}
        if headers is not None:
            self._headers.update(headers)
        elif api_key:
            self._headers["Authorization"] = f"Bearer {api_key}"
        self._max_connections = max_connections
        self._session: aiohttp.ClientSession | None = None
        self._timeouts: dict[int, aiohttp.ClientTimeout] = {}  # by total, in ms
        self._limits: tuple[Timeouts, float, float, float] | None = None

    @property
    def base_url(self) -> str:
        return self._base_url()

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            connector = aiohttp.TCPConnector(
                limit=self._max_connections, keepalive_timeout=30, ttl_dns_cache=300
            )
            self._session = aiohttp.ClientSession(
                connector=connector, headers=self._headers, auto_decompress=True
            )
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    def _timeout(self, t: Timeouts, remaining_s: float | None) -> aiohttp.ClientTimeout:
        """The attempt's timeouts: never past the request's deadline. The total is
        rounded down to the millisecond and the object reused for that value (a
        ClientTimeout is a frozen dataclass, ~2 us to build), so requests arriving in
        the same millisecond share one."""
        limits = self._limits
        if limits is None or limits[0] is not t:  # one model's timeouts, read once
            limits = self._limits = (t, t.total_s, t.connect_s, t.first_byte_s)
            self._timeouts.clear()
        total_s = limits[1]
        total = total_s if remaining_s is None else max(0.001, min(total_s, remaining_s))
        ms = math.floor(total * 1000)
        cached = self._timeouts.get(ms)
        if cached is None:
            if len(self._timeouts) >= 1024:
                self._timeouts.clear()
            cached = self._timeouts[ms] = aiohttp.ClientTimeout(
                total=max(0.001, ms / 1000), sock_connect=limits[2], sock_read=limits[3]
            )
        return cached

    async def post(
        self,
        path: str,
        payload: bytes,
        timeouts: Timeouts,
        remaining_s: float | None = None,
        extra_headers: dict[str, str] | None = None,
    ) -> UpstreamReply:
        """POST and read the whole reply; raises on transport failure or non-2xx."""
        url = self.base_url + path
        try:
            async with self._client().post(
                url,
                data=payload,
                timeout=self._timeout(timeouts, remaining_s),
                headers=extra_headers,
            ) as resp:
                if resp.status >= 300:
                    error = await _read(resp, MAX_ERROR_BYTES)
                    raise _upstream_error(resp.status, error or b"", self.name, resp.headers, path)
                body = await _read(resp, MAX_REPLY_BYTES)
                if body is None:
                    raise self._broken(f"a reply over {MAX_REPLY_BYTES} bytes")
                try:
                    obj = orjson.loads(body)
                except orjson.JSONDecodeError:
                    obj = None
                if not isinstance(obj, dict):
                    raise self._broken("a reply that is not a JSON object")
                if path in _CHOICE_PATHS and not _has_choice_0(obj):
                    raise self._broken("a reply with no choice 0")
                return UpstreamReply(resp.status, body, resp.headers, obj)
        except SwitchyardError:
            raise
        except BaseException as exc:
            raise self._translate(exc) from None

    async def tokenize(self, text: str, timeout_s: float) -> list[int] | None:
        """`text` as llama-server tokenizes a prompt (special tokens parsed, BOS as the
        model adds it), or None when the server does not answer so."""
        url = self.base_url.removesuffix("/v1") + "/tokenize"
        body = {"content": text, "add_special": True, "parse_special": True}
        try:
            async with self._client().post(
                url,
                data=orjson.dumps(body),
                timeout=aiohttp.ClientTimeout(total=max(0.001, timeout_s)),
            ) as resp:
                if resp.status != 200:
                    return None
                got = orjson.loads(await resp.read()).get("tokens")
        except (aiohttp.ClientError, OSError, TimeoutError, ValueError, AttributeError):
            return None
        if isinstance(got, list) and all(type(i) is int for i in got):
            return got
        return None

    async def stream(
        self,
        path: str,
        payload: bytes,
        timeouts: Timeouts,
        remaining_s: float | None = None,
        extra_headers: dict[str, str] | None = None,
    ) -> UpstreamStream:
        """POST and return once the status line arrived; the caller reads the events."""
        return UpstreamStream(
            await self._open(path, payload, timeouts, remaining_s, extra_headers), self
        )

    async def _open(
        self,
        path: str,
        payload: bytes,
        timeouts: Timeouts,
        remaining_s: float | None,
        extra_headers: dict[str, str] | None,
    ) -> aiohttp.ClientResponse:
        """POST a streaming request: its response once a 2xx status line arrived;
        raises on transport failure or non-2xx."""
        url = self.base_url + path
        try:
            resp = await self._client().post(
                url,
                data=payload,
                timeout=self._timeout(timeouts, remaining_s),
                headers=extra_headers,
            )
        except BaseException as exc:
            raise self._translate(exc) from None
        if resp.status >= 300:
            try:
                body = await _read(resp, MAX_ERROR_BYTES)
            except BaseException as exc:
                resp.release()
                raise self._translate(exc) from None
            resp.release()
            raise _upstream_error(resp.status, body or b"", self.name, resp.headers, path)
        return resp

    def _broken(self, what: str) -> UpstreamError:
        """A 2xx reply the gateway cannot pass on (retried as a 502 is)."""
        err = UpstreamError(f"upstream {self.name} sent {what}")
        err.retry_class = "502"
        return err

    def _translate(self, exc: BaseException) -> BaseException:
        if isinstance(exc, asyncio.CancelledError):
            return exc
        err: SwitchyardError
        if isinstance(
            exc,
            aiohttp.ClientConnectorError | ConnectionRefusedError | aiohttp.ConnectionTimeoutError,
        ):
            err = UpstreamUnreachable(
                f"upstream {self.name} is unreachable", detail=f"{type(exc).__name__}: {exc}"
            )
            err.retry_class = "connect"
        elif isinstance(exc, asyncio.TimeoutError | aiohttp.ServerTimeoutError):
            err = UpstreamTimeout(f"upstream {self.name} did not answer in time")
            err.retry_class = "timeout"
        elif isinstance(exc, aiohttp.ClientError | OSError):
            err = UpstreamError(
                f"upstream {self.name} broke the connection",
                detail=f"{type(exc).__name__}: {exc}",
            )
            err.retry_class = "broken"
        else:
            return exc
        return err


class WatchedEngine(Protocol):
    """A managed engine whose worker a stream may outlive (engines/llamacpp.py)."""

    generation: int

    async def exited_since(self, generation: int, wait_s: float = ...) -> bool: ...


class UpstreamStream:
    """An open streaming reply. Iterate `events()`; always `close()` (cancels upstream)."""

    def __init__(self, resp: aiohttp.ClientResponse, upstream: OpenAIUpstream) -> None:
        self._resp = resp
        self._upstream = upstream
        self.headers: Mapping[str, str] = resp.headers
        self._engine: tuple[WatchedEngine, int, str] | None = None
        self._closed = False

    def watch(self, engine: WatchedEngine, generation: int, alias: str) -> None:
        """The stream comes from the worker `generation` of a managed `engine`: a
        connection that breaks because that worker died is then `EngineCrashed`, named
        for `alias` (as a whole reply's is, execute/executor.py), not a nameless broken
        connection."""
        self._engine = (engine, generation, alias)

    async def _failure(self, exc: BaseException) -> BaseException:
        """What a failed read raises: the transport's error, or `EngineCrashed` when
        the connection broke because the watched worker died under it."""
        err = self._upstream._translate(exc)
        watched = self._engine
        if (
            watched is not None
            and not self._closed  # not a connection this side dropped (a client gone)
            and isinstance(err, SwitchyardError)
            and err.retry_class in ("connect", "broken")
            and await watched[0].exited_since(watched[1])
        ):
            crashed = EngineCrashed(
                f"the local engine of '{watched[2]}' crashed while streaming this reply; "
                "it is restarting",
                detail=err.detail,
            )
            crashed.retry_class = err.retry_class
            return crashed
        return err

    async def data(self) -> AsyncGenerator[list[bytes], None]:
        """Yield the data of the SSE events of each network read (comments and events
        without data left out; a multi-line data field joined by newlines).

        Events that arrive together are handed over together, so the relay can pass
        them on in one write. Raises a SwitchyardError if the transport fails.
        """
        buf = b""
        try:
            async for chunk in self._resp.content.iter_any():
                buf += chunk
                if b"\r" in buf:
                    buf = buf.replace(b"\r\n", b"\n")
                if b"\n\n" not in buf:
                    if len(buf) > MAX_EVENT_BYTES:  # an event that never ends
                        raise self._upstream._broken(f"a stream event over {MAX_EVENT_BYTES} bytes")
                    continue
                *complete, buf = buf.split(b"\n\n")
                out = [d for d in map(event_data, complete) if d is not None]
                if out:
                    yield out
        except BaseException as exc:
            raise await self._failure(exc) from None
        if buf.strip():
            last = event_data(buf)
            if last is not None:
                yield [last]

    def close(self, complete: bool = False) -> None:
        """Release a finished stream's connection for reuse; otherwise drop it, so the
        upstream sees the disconnect and stops generating."""
        self._closed = True
        if complete:
            self._resp.release()
        else:
            self._resp.close()


def event_data(event: bytes) -> bytes | None:
    """The data of one SSE event (without its blank line); None for comments and
    events without data."""
    if event.startswith(b"data:") and b"\n" not in event:
        return event[5:].strip()
    parts = [line[5:].strip() for line in event.split(b"\n") if line.startswith(b"data:")]
    return b"\n".join(parts) if parts else None


def dumps(obj: Any) -> bytes:
    return orjson.dumps(obj)
