"""A scripted OpenAI-compatible upstream: instant fixed answers, and faults on request.

Benchmarks need an upstream whose own cost is tiny and constant, so that what they measure
is the gateway in front of it; tests need one that fails exactly the way they ask. This
server answers every generation request at once with the same tokens (response bytes are
built once and reused), and injects a fault when a request names one.

Faults (request header `x-scripted-fault`, else the `--fault` default, else the one set at
run time with `PUT /control/fault`), comma-separated, e.g. `delay:100,status:503`:

- `status:<code>`   answer with that HTTP status and an OpenAI error body
                    (`status:429` also sends `Retry-After: 1`)
- `busy:<s>`        answer 503 with `Retry-After: <s>` (an upstream at capacity)
- `delay:<ms>`      sleep before answering
- `hang`            never answer (waits until the client leaves, at most an hour)
- `drop-mid-stream` send half the tokens, then close the connection (no `[DONE]`;
                    a non-streaming reply is cut in half under its full Content-Length)
- `close`           close the connection without any response
- `slow:<ms>`       stream: wait this long before each event (a long generation)
- `stream-error:<code>` Messages streams only: half the events, then an `error`
                    event of that status's type (elsewhere it changes nothing)

Tool calls: `PUT /control/tool_calls` with `{"calls": [{"name", "arguments"}, ...]}`
makes every later chat reply call those tools (with `"until_result": true`, only until
the conversation ends with a tool result: an agent's step) (`finish_reason: "tool_calls"`; streamed
as OpenAI does: the id and name first, then the arguments in pieces); `{"calls": []}`
goes back to text. `GET /stats` also says how many streams are open now
(`open_streams`) and how many were closed by the client before their end (`aborted`).

Capacity (`--concurrency N --service-ms B --token-ms T`): at most N generation requests are
served at once, each holding its slot for B + T x (its output tokens) ms before it answers;
more wait in arrival order. A deployment of known capacity (N / mean service time), for
the scheduling benchmark (bench/scheduling.py). A prompt that contains `[[tokens:K]]` is
answered with K tokens (at most its max_tokens), so a workload sets each call's output
length below the cap it sends, as real generations end before their cap.

Anthropic's Messages API: `POST /v1/messages` answers in its wire format (a `message`, or
its SSE events with `stream: true`; text, or `tool_use` blocks for the tool calls above;
the faults above with error bodies in its shape, `status:529` its overloaded error) after
checking the request as the provider would (bench/scripted_messages.py).
`--anthropic-key KEY` makes it require `x-api-key: KEY`. `GET /control/last` shows the
last generation request's body (a Messages request's with its `x-api-key`,
`authorization` and `anthropic-version` headers).

Faults apply to the generation routes only, so `/health`, `/stats` and `/v1/models`
stay usable for readiness polling and counting. `GET /stats` says how many generation
requests arrived (faulted ones included: that is what a retry test counts);
`DELETE /stats` resets the count.

    python -m switchyard.bench.scripted_upstream --port 9001 --tokens 16
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import orjson
import uvicorn
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route, Router
from starlette.types import Receive, Scope, Send

from switchyard.bench import scripted_messages

FAULT_HEADER = b"x-scripted-fault"
MESSAGES_PATH = "/v1/messages"
GENERATION_PATHS = frozenset({"/v1/chat/completions", "/v1/completions", MESSAGES_PATH})
HANG_S = 3600.0
WORDS = ("Hello", " from", " the", " scripted", " upstream", ".")
DONE = b"data: [DONE]\n\n"
ABORT_KEY = "switchyard.scripted.abort"
LENGTH = re.compile(r"\[\[tokens:(\d{1,5})\]\]")
SLOW_KEY = "switchyard.scripted.slow"
STREAM_ERROR_KEY = "switchyard.scripted.stream_error"

Abort = Callable[[], Awaitable[None]]


@dataclass(frozen=True, slots=True)
class Fault:
    """A parsed fault: an optional delay, then at most one action."""

    delay_s: float = 0.0
    # "status", "echo", "hang", "drop-mid-stream", "close", "stream-error"
    action: str | None = None
    status: int = 0
    slow_s: float = 0.0  # between streamed events
    retry_after: str | None = None  # sent with a status answer


def parse_fault(spec: str) -> Fault:
    """Parse a fault spec such as `status:503` or `delay:100,drop-mid-stream`.

    Delays add up; a later action replaces an earlier one. Raises ValueError naming the part
    that is wrong, so a typo in a test fails loudly instead of silently not faulting.
    """
    delay_s = 0.0
    slow_s = 0.0
    action: str | None = None
    status = 0
    retry_after: str | None = None
    for part in (p.strip() for p in spec.split(",")):
        name, _, arg = part.partition(":")
        if name == "slow" and arg:
            try:
                slow_s = float(arg) / 1000.0
            except ValueError:
                raise ValueError(f"fault {part!r}: slow needs milliseconds") from None
        elif name == "delay" and arg:
            try:
                delay_s += float(arg) / 1000.0
            except ValueError:
                raise ValueError(f"fault {part!r}: delay needs milliseconds") from None
        elif name == "status" and arg:
            if not arg.isdigit() or not 100 <= int(arg) <= 599:
                raise ValueError(f"fault {part!r}: status needs an HTTP code 100-599")
            action, status = "status", int(arg)
        elif name == "busy" and arg:
            if not arg.isdigit():
                raise ValueError(f"fault {part!r}: busy needs whole seconds")
            action, status, retry_after = "status", 503, arg
        elif name == "stream-error" and arg:
            if not arg.isdigit() or not 400 <= int(arg) <= 599:
                raise ValueError(f"fault {part!r}: stream-error needs an HTTP error code 400-599")
            action, status = "stream-error", int(arg)
        elif name == "echo" and arg:  # an error whose message quotes the request
            if not arg.isdigit() or not 400 <= int(arg) <= 599:
                raise ValueError(f"fault {part!r}: echo needs an HTTP error code 400-599")
            action, status = "echo", int(arg)
        elif name in ("hang", "drop-mid-stream", "close") and not arg:
            action = name
        else:
            raise ValueError(
                f"unknown fault {part!r}; use status:<code>, busy:<s>, echo:<code>, "
                "stream-error:<code>, delay:<ms>, slow:<ms>, hang, drop-mid-stream or close"
            )
    return Fault(delay_s, action, status, slow_s, retry_after)


def _error_type(status: int) -> str:
    if status == 401:
        return "authentication_error"
    if status == 403:
        return "permission_error"
    if status == 404:
        return "not_found_error"
    if status == 429:
        return "rate_limit_error"
    return "server_error" if status >= 500 else "invalid_request_error"


def error_body(status: int, message: str) -> bytes:
    """An OpenAI-shaped error body, so clients parse it like a real upstream's."""
    err = {"message": message, "type": _error_type(status), "param": None, "code": None}
    return orjson.dumps({"error": err})


async def _send_json(
    send: Send, status: int, body: bytes, extra: list[tuple[bytes, bytes]]
) -> None:
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        *extra,
    ]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


async def _wait_disconnect(receive: Receive, timeout_s: float) -> None:
    """Wait until the client is gone (or the timeout), consuming any request body."""
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(timeout_s):
            while (await receive())["type"] != "http.disconnect":
                pass


async def _abort(send: Send, receive: Receive) -> None:
    """Close the client connection, sending nothing more.

    ASGI has no message for "drop the connection", so this reaches the server's transport
    through its bound `send` (uvicorn's request cycle keeps it as `.transport`). Bytes
    already written still go out first. Under a server without that attribute we raise,
    and the server closes the socket itself (or answers 500 if nothing was sent yet).
    """
    transport = getattr(getattr(send, "__self__", None), "transport", None)
    if transport is None:
        raise ConnectionAbortedError("scripted fault: dropping the connection")
    transport.close()
    # Returning only once the server saw the close keeps it from logging the
    # unfinished response as an application error.
    await _wait_disconnect(receive, 2.0)


class ScriptedUpstream:
    """The ASGI app. Counts and faults requests, then hands them to a Starlette router."""

    def __init__(
        self,
        tokens: int = 16,
        model_name: str = "scripted",
        fault: str | None = None,
        record: str | None = None,
        echo: bool = False,
        anthropic_key: str | None = None,
        concurrency: int | None = None,
        service_ms: float = 0.0,
        token_ms: float = 0.0,
    ) -> None:
        if tokens < 1:
            raise ValueError("tokens must be at least 1")
        if concurrency is not None and concurrency < 1:
            raise ValueError("concurrency must be at least 1")
        if service_ms < 0 or token_ms < 0:
            raise ValueError("service and token times must not be negative")
        self.concurrency = concurrency
        self.service_ms = service_ms
        self.token_ms = token_ms
        self._slots: asyncio.Semaphore | None = None  # made on first use (its loop)
        self.busy = 0  # requests holding a capacity slot now
        self.tokens = tokens
        self.record = record  # append every generation body received to this file
        self.echo = echo  # answer with the request's last message (a reply that quotes it)
        self.model_name = model_name
        self.anthropic_key = anthropic_key  # the x-api-key /v1/messages requires, if set
        self.last_request: dict[str, Any] | None = None  # GET /control/last
        self.requests = 0
        self.last_traceparent: str | None = None
        self.last_prompt: str | None = None
        self.created = int(time.time())
        self._default_fault = parse_fault(fault) if fault else None
        self.tool_calls: list[dict[str, Any]] = []  # PUT /control/tool_calls
        self.calls_until_result = False
        self.content: str | None = None  # PUT /control/content: every reply's text
        self.open_streams = 0
        # What /metrics reports (vLLM's format), as another client's load would show:
        # requests running and waiting, KV-cache usage; set with PUT /control/load.
        self.load: dict[str, float] = {"running": 0, "waiting": 0, "kv_cache_usage": 0.0}
        self.aborted = 0  # streams the client closed before their end
        self._runtime_fault: Fault | None = None
        self._runtime_left: int | None = None  # None: every request until changed
        self._events: dict[tuple[str, int], list[bytes]] = {}
        self._models = orjson.dumps(
            {
                "object": "list",
                "data": [
                    {
                        "id": model_name,
                        "object": "model",
                        "created": self.created,
                        "owned_by": "scripted",
                    }
                ],
            }
        )
        self._router = Router(
            routes=[
                Route("/v1/chat/completions", self._chat, methods=["POST"]),
                Route("/v1/completions", self._completions, methods=["POST"]),
                Route(MESSAGES_PATH, self._messages, methods=["POST"]),
                Route("/control/last", self._last, methods=["GET"]),
                Route("/v1/models", self._list_models, methods=["GET"]),
                Route("/health", self._health, methods=["GET"]),
                Route("/stats", self._stats, methods=["GET", "DELETE"]),
                Route("/control/fault", self._control, methods=["PUT"]),
                Route("/control/tool_calls", self._control_tools, methods=["PUT"]),
                Route("/control/content", self._control_content, methods=["PUT"]),
                Route("/control/load", self._control_load, methods=["PUT"]),
                Route("/metrics", self._metrics, methods=["GET"]),
            ]
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] not in GENERATION_PATHS:
            await self._router(scope, receive, send)
            return
        self.requests += 1
        for name, value in scope["headers"]:
            if name == b"traceparent":  # lets tests check trace propagation
                self.last_traceparent = value.decode("latin-1")
        errors = scripted_messages.error_body if scope["path"] == MESSAGES_PATH else error_body
        try:
            fault = self._fault_for(scope)
        except ValueError as exc:
            await _send_json(send, 400, errors(400, f"x-scripted-fault: {exc}"), [])
            return
        if self.record is not None or (fault is not None and fault.action == "echo"):
            raw = await _read_all(receive)
            if self.record is not None:
                with open(self.record, "ab") as f:
                    f.write(raw.replace(b"\n", b" ") + b"\n")
            receive = _replay_body(raw)
        if fault is not None:
            if fault.delay_s > 0:
                await asyncio.sleep(fault.delay_s)
            if fault.action == "echo":
                message = "scripted fault: cannot process " + raw.decode("utf-8", "replace")
                await _send_json(send, fault.status, errors(fault.status, message), [])
                return
            if fault.action == "status":
                extra = [(b"retry-after", b"1")] if fault.status == 429 else []
                if fault.retry_after is not None:
                    extra = [(b"retry-after", fault.retry_after.encode())]
                body = errors(fault.status, f"scripted fault: HTTP {fault.status}")
                await _send_json(send, fault.status, body, extra)
                return
            if fault.action == "hang":
                await _wait_disconnect(receive, HANG_S)
                return
            if fault.action == "close":
                await _abort(send, receive)
                return
            if fault.action == "drop-mid-stream":
                scope = {**scope, ABORT_KEY: lambda: _abort(send, receive)}
            if fault.action == "stream-error":
                scope = {**scope, STREAM_ERROR_KEY: fault.status}
            if fault.slow_s:
                scope = {**scope, SLOW_KEY: fault.slow_s}
        await self._router(scope, receive, send)

    def _fault_for(self, scope: Scope) -> Fault | None:
        for name, value in scope["headers"]:
            if name == FAULT_HEADER:
                return parse_fault(value.decode("latin-1"))
        if self._runtime_fault is not None:
            if self._runtime_left is None:
                return self._runtime_fault
            if self._runtime_left > 0:
                self._runtime_left -= 1
                return self._runtime_fault
        return self._default_fault

    # --- generation -------------------------------------------------------------------

    async def _chat(self, request: Request) -> Response:
        return await self._generate(request, "chat")

    async def _completions(self, request: Request) -> Response:
        return await self._generate(request, "text")

    async def _generate(self, request: Request, kind: str) -> Response:
        raw = await request.body()
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError:
            return _error(400, "the request body is not valid JSON")
        if not isinstance(body, dict):
            return _error(400, "the request body must be a JSON object")
        messages = body.get("messages")
        self.last_request = {"body": body}  # GET /control/last
        answered = False  # the conversation ends with a tool result
        if isinstance(messages, list) and messages and isinstance(messages[-1], dict):
            self.last_prompt = str(messages[-1].get("content"))  # what the upstream saw
            answered = messages[-1].get("role") == "tool"
        elif "prompt" in body:
            self.last_prompt = str(body["prompt"])
        n = self.tokens
        asked = LENGTH.search(self.last_prompt or "") if self.concurrency else None
        if asked is not None:
            n = max(1, int(asked.group(1)))
        limit = body.get("max_tokens", body.get("max_completion_tokens"))
        if isinstance(limit, int) and 0 <= limit < n:
            n = limit
        # Billed as an engine bills: the whole body as prompt, and every sequence it
        # asked for (n or best_of choices of each prompt) to the cap, or to the
        # upstream's own limit when no cap was sent.
        sequences = 1
        for name in ("n", "best_of"):
            v = body.get(name)
            if isinstance(v, int) and not isinstance(v, bool) and v > sequences:
                sequences = v
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            sequences *= len(prompt)
        prompt_tokens = _prompt_tokens(raw, body)
        usage = {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": n * sequences,
            "total_tokens": prompt_tokens + n * sequences,
        }
        if self.concurrency is not None:
            await self._serve(n * sequences)
        abort: Abort | None = request.scope.get(ABORT_KEY)
        calls = self.tool_calls if kind == "chat" else []
        if answered and self.calls_until_result:
            calls = []
        if body.get("stream"):
            options = body.get("stream_options")
            with_usage = isinstance(options, dict) and bool(options.get("include_usage"))
            tail = self._usage_event(kind, usage) + DONE if with_usage else DONE
            events = self._tool_events(calls) if calls else self._events_for(kind, n)
            return StreamingResponse(
                self._stream(events, n, tail, abort, request.scope.get(SLOW_KEY, 0.0)),
                media_type="text/event-stream",
            )
        reply = self._reply(kind, n, usage)
        if calls:
            reply["choices"][0]["message"] = {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": f"call_{i}",
                        "type": "function",
                        "function": {"name": c["name"], "arguments": c["arguments"]},
                    }
                    for i, c in enumerate(calls)
                ],
            }
            reply["choices"][0]["finish_reason"] = "tool_calls"
        return _whole(orjson.dumps(reply), abort)

    async def _serve(self, tokens: int) -> None:
        """Hold one of `concurrency` slots for the service time of `tokens` tokens."""
        if self._slots is None:
            assert self.concurrency is not None
            self._slots = asyncio.Semaphore(self.concurrency)
        async with self._slots:
            self.busy += 1
            try:
                await asyncio.sleep((self.service_ms + self.token_ms * tokens) / 1000)
            finally:
                self.busy -= 1

    async def _stream(
        self, events: list[bytes], n: int, tail: bytes, abort: Abort | None, slow_s: float = 0.0
    ) -> AsyncIterator[bytes]:
        if abort is not None:
            for event in events[: n // 2]:
                yield event
            await abort()
            return
        self.open_streams += 1
        finished = False
        try:
            for event in events:
                if slow_s:
                    await asyncio.sleep(slow_s)
                yield event
            yield tail
            finished = True
        finally:
            self.open_streams -= 1
            if not finished:
                self.aborted += 1

    def _tool_events(self, calls: list[dict[str, Any]]) -> list[bytes]:
        """Streamed tool calls as OpenAI sends them: per call, its id and name with
        empty arguments, then the arguments in two pieces; then the finish."""
        choices: list[dict[str, Any]] = []
        for i, c in enumerate(calls):
            args = c["arguments"]
            head = {"index": i, "id": f"call_{i}", "type": "function"}
            head["function"] = {"name": c["name"], "arguments": ""}
            delta: dict[str, Any] = {"tool_calls": [head]}
            if i == 0:
                delta = {"role": "assistant", "content": None, **delta}
            choices.append({"index": 0, "delta": delta, "finish_reason": None})
            half = len(args) // 2
            for piece in (args[:half], args[half:]):
                part = {"index": i, "function": {"arguments": piece}}
                choices.append({"index": 0, "delta": {"tool_calls": [part]}, "finish_reason": None})
        choices.append({"index": 0, "delta": {}, "finish_reason": "tool_calls"})
        return [b"data: " + orjson.dumps(self._chunk("chat", [c])) + b"\n\n" for c in choices]

    def _content(self, n: int) -> str:
        if self.content is not None:
            return self.content
        if self.echo and self.last_prompt:
            return f"You said: {self.last_prompt}"
        return "".join(WORDS[i % len(WORDS)] for i in range(n))

    def _reply(self, kind: str, n: int, usage: dict[str, int]) -> dict[str, Any]:
        finish = "length" if n < self.tokens else "stop"
        if kind == "chat":
            message = {"role": "assistant", "content": self._content(n)}
            choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": finish}
            obj, rid = "chat.completion", "chatcmpl-scripted"
        else:
            choice = {
                "index": 0,
                "text": self._content(n),
                "logprobs": None,
                "finish_reason": finish,
            }
            obj, rid = "text_completion", "cmpl-scripted"
        return {
            "id": rid,
            "object": obj,
            "created": self.created,
            "model": self.model_name,
            "choices": [choice],
            "usage": usage,
        }

    def _chunk(self, kind: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        chat = kind == "chat"
        return {
            "id": "chatcmpl-scripted" if chat else "cmpl-scripted",
            "object": "chat.completion.chunk" if chat else "text_completion",
            "created": self.created,
            "model": self.model_name,
            "choices": choices,
        }

    def _events_for(self, kind: str, n: int) -> list[bytes]:
        """The token events and the finish event for `n` tokens, built once per (kind, n)."""
        key = (kind, n)
        cached = self._events.get(key)
        if cached is not None:
            return cached
        choices: list[dict[str, Any]] = []
        for i in range(n):
            word = WORDS[i % len(WORDS)]
            if kind == "chat":
                delta = {"role": "assistant", "content": word} if i == 0 else {"content": word}
                choices.append(
                    {"index": 0, "delta": delta, "logprobs": None, "finish_reason": None}
                )
            else:
                choices.append({"index": 0, "text": word, "logprobs": None, "finish_reason": None})
        finish = "length" if n < self.tokens else "stop"
        if kind == "chat":
            choices.append({"index": 0, "delta": {}, "logprobs": None, "finish_reason": finish})
        else:
            choices.append({"index": 0, "text": "", "logprobs": None, "finish_reason": finish})
        events = [b"data: " + orjson.dumps(self._chunk(kind, [c])) + b"\n\n" for c in choices]
        self._events[key] = events
        return events

    def _usage_event(self, kind: str, usage: dict[str, int]) -> bytes:
        return b"data: " + orjson.dumps({**self._chunk(kind, []), "usage": usage}) + b"\n\n"

    # --- Anthropic's Messages API ------------------------------------------------------

    async def _messages(self, request: Request) -> Response:
        """`POST /v1/messages`: the provider's checks (key, version, body), then the
        scripted words, or tool_use blocks for the scripted tool calls."""
        headers = request.headers
        raw = await request.body()
        try:
            body: Any = orjson.loads(raw)
        except orjson.JSONDecodeError:
            body = None
        self.last_request = {
            "body": body,
            "headers": {
                name: headers.get(name)
                for name in ("x-api-key", "authorization", "anthropic-version")
            },
        }
        if self.anthropic_key is not None and headers.get("x-api-key") != self.anthropic_key:
            return _messages_error(401, "invalid x-api-key")
        if not headers.get("anthropic-version"):
            return _messages_error(400, "anthropic-version: header is required")
        why = scripted_messages.check_request(body)
        if why is not None:
            return _messages_error(400, why)
        self.last_prompt = scripted_messages.last_text(body["messages"])
        n = min(self.tokens, body["max_tokens"])
        calls = self.tool_calls
        if calls:
            pieces: list[str] = []
            stop_reason = "tool_use"
        else:
            text = self._content(n)
            if self.content is None and not self.echo:
                pieces = [WORDS[i % len(WORDS)] for i in range(n)]
            else:
                pieces = [text[: len(text) // 2], text[len(text) // 2 :]]
            stop_reason = "max_tokens" if n < self.tokens else "end_turn"
        usage = {"input_tokens": max(1, len(raw) // 4), "output_tokens": n}
        model = body["model"]
        if not body.get("stream"):
            reply = scripted_messages.message(model, pieces, calls, stop_reason, usage)
            return _whole(orjson.dumps(reply), request.scope.get(ABORT_KEY))
        events = scripted_messages.stream_events(model, pieces, calls, stop_reason, usage)
        failing = request.scope.get(STREAM_ERROR_KEY)
        if failing is not None:
            half = events[: len(events) // 2]
            events = [*half, scripted_messages.error_event(failing, "scripted stream error")]
        return StreamingResponse(
            self._stream(
                events[:-1],
                len(events) - 1,
                events[-1],
                request.scope.get(ABORT_KEY),
                request.scope.get(SLOW_KEY, 0.0),
            ),
            media_type="text/event-stream",
        )

    async def _last(self, request: Request) -> Response:
        """The last Messages request: its body and the headers that carry its key."""
        return Response(orjson.dumps(self.last_request), media_type="application/json")

    # --- plumbing ---------------------------------------------------------------------

    async def _list_models(self, request: Request) -> Response:
        return Response(self._models, media_type="application/json")

    async def _health(self, request: Request) -> Response:
        return Response(b'{"status":"ok"}', media_type="application/json")

    async def _stats(self, request: Request) -> Response:
        if request.method == "DELETE":
            self.requests = 0
        return Response(
            orjson.dumps(
                {
                    "requests": self.requests,
                    "last_traceparent": self.last_traceparent,
                    "last_prompt": self.last_prompt,
                    "open_streams": self.open_streams,
                    "aborted": self.aborted,
                }
            ),
            media_type="application/json",
        )

    async def _control_tools(self, request: Request) -> Response:
        try:
            body = orjson.loads(await request.body())
            self.tool_calls = _tool_call_list(body)
        except (orjson.JSONDecodeError, ValueError) as exc:
            return _error(400, f"control: {exc}")
        # "until_result": an agent's step: call the tools, then answer in text once the
        # conversation ends with a tool result.
        self.calls_until_result = bool(body.get("until_result"))
        return Response(orjson.dumps({"calls": self.tool_calls}), media_type="application/json")

    async def _control_load(self, request: Request) -> Response:
        """What /metrics reports from now on: `{"running": n, "waiting": n,
        "kv_cache_usage": 0-1}` (any of them)."""
        try:
            body = orjson.loads(await request.body())
            for name, value in body.items():
                if name not in self.load or not isinstance(value, int | float):
                    raise ValueError(f"{name!r}: a number, one of {sorted(self.load)}")
                self.load[name] = value
        except (orjson.JSONDecodeError, AttributeError, ValueError) as exc:
            return _error(400, f"control: {exc}")
        return Response(orjson.dumps(self.load), media_type="application/json")

    async def _metrics(self, request: Request) -> Response:
        """The load figures in vLLM's Prometheus format (engines/load.py reads them)."""
        labels = f'{{engine="0",model_name="{self.model_name}"}}'
        lines = []
        for name, kind, value in (
            ("num_requests_running", "gauge", self.load["running"]),
            ("num_requests_waiting", "gauge", self.load["waiting"]),
            ("kv_cache_usage_perc", "gauge", self.load["kv_cache_usage"]),
            ("prefix_cache_queries", "counter", self.requests),
            ("prefix_cache_hits", "counter", 0),
        ):
            suffix = "_total" if kind == "counter" else ""
            lines += [f"# TYPE vllm:{name} {kind}", f"vllm:{name}{suffix}{labels} {float(value)}"]
        return Response("\n".join(lines) + "\n", media_type="text/plain; version=0.0.4")

    async def _control_content(self, request: Request) -> Response:
        """Answer every later request with this text: `{"content": "..."}`; null: as before."""
        try:
            content = orjson.loads(await request.body()).get("content")
        except (orjson.JSONDecodeError, AttributeError) as exc:
            return _error(400, f"control: {exc}")
        if content is not None and not isinstance(content, str):
            return _error(400, "control: content must be a string or null")
        self.content = content
        return Response(orjson.dumps({"content": content}), media_type="application/json")

    async def _control(self, request: Request) -> Response:
        """Set the fault for later requests: `{"fault": "status:503", "count": 2}`.

        A gateway in between need not forward the fault header, so tests can script the
        upstream directly; `count` limits the fault to the next n requests (a retry test:
        fail once, then succeed); `{"fault": null}` clears it.
        """
        try:
            body = orjson.loads(await request.body())
            spec = body.get("fault")
            count = body.get("count")
            fault = parse_fault(spec) if spec else None
        except (orjson.JSONDecodeError, AttributeError, ValueError) as exc:
            return _error(400, f"control: {exc}")
        if count is not None and (not isinstance(count, int) or count < 0):
            return _error(400, "control: count must be a non-negative integer or null")
        self._runtime_fault, self._runtime_left = fault, count
        return Response(
            orjson.dumps({"fault": spec, "count": count}), media_type="application/json"
        )


IMAGE_TOKENS = 256  # what one image costs, whatever its encoding (as a vision engine bills)


def _prompt_tokens(raw: bytes, body: dict[str, Any]) -> int:
    """The prompt as billed: every byte of the body at 4 a token, except images, each
    billed at IMAGE_TOKENS."""
    size, images = len(raw), 0
    messages = body.get("messages")
    for m in messages if isinstance(messages, list) else []:
        content = m.get("content") if isinstance(m, dict) else None
        for part in content if isinstance(content, list) else []:
            if isinstance(part, dict) and part.get("type") == "image_url":
                images += 1
                size -= len(orjson.dumps(part))
    return max(1, max(0, size) // 4 + images * IMAGE_TOKENS)


def _tool_call_list(body: Any) -> list[dict[str, Any]]:
    calls = body.get("calls") if isinstance(body, dict) else None
    if not isinstance(calls, list):
        raise ValueError("calls must be a list")
    out = []
    for c in calls:
        if not isinstance(c, dict) or not isinstance(c.get("name"), str):
            raise ValueError("each call needs a name")
        args = c.get("arguments", {})
        out.append(
            {
                "name": c["name"],
                "arguments": args if isinstance(args, str) else orjson.dumps(args).decode(),
            }
        )
    return out


def _whole(payload: bytes, abort: Abort | None) -> Response:
    """A whole JSON reply; cut in half under its full Content-Length with
    `drop-mid-stream` (`abort` set)."""
    if abort is not None:
        return StreamingResponse(
            _cut(payload, abort),
            media_type="application/json",
            headers={"content-length": str(len(payload))},
        )
    return Response(payload, media_type="application/json")


def _messages_error(status: int, message: str) -> Response:
    body = scripted_messages.error_body(status, message)
    return Response(body, status_code=status, media_type="application/json")


def _error(status: int, message: str) -> Response:
    return Response(error_body(status, message), status_code=status, media_type="application/json")


async def _read_all(receive: Receive) -> bytes:
    chunks = []
    while True:
        message = await receive()
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(chunks)


def _replay_body(raw: bytes) -> Receive:
    """A receive that hands the body already read to the app once more."""
    sent = False

    async def receive() -> Any:
        nonlocal sent
        if sent:
            await asyncio.sleep(HANG_S)
        sent = True
        return {"type": "http.request", "body": raw, "more_body": False}

    return receive


async def _cut(payload: bytes, abort: Abort) -> AsyncIterator[bytes]:
    """Half a JSON reply under the full Content-Length, then the connection drops."""
    yield payload[: len(payload) // 2]
    await abort()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m switchyard.bench.scripted_upstream",
        description="A scripted OpenAI-compatible upstream for benchmarks and fault tests.",
    )
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=9001)
    ap.add_argument("--tokens", type=int, default=16, help="tokens in every answer")
    ap.add_argument("--model-name", default="scripted", help="model id the upstream reports")
    ap.add_argument("--fault", default=None, help="fault for every generation request")
    ap.add_argument("--record", default=None, help="append each generation body to this file")
    ap.add_argument("--echo", action="store_true", help="answer with the last message")
    ap.add_argument(
        "--anthropic-key", default=None, help="the x-api-key that /v1/messages requires"
    )
    ap.add_argument(
        "--tool-calls",
        default=None,
        help='comma-separated tool names every chat reply calls (arguments {"q": "x"})',
    )
    ap.add_argument(
        "--concurrency", type=int, default=None, help="requests served at once (capacity)"
    )
    ap.add_argument("--service-ms", type=float, default=0.0, help="per request, with a capacity")
    ap.add_argument("--token-ms", type=float, default=0.0, help="per output token, likewise")
    args = ap.parse_args(argv)
    try:
        app = ScriptedUpstream(
            tokens=args.tokens,
            model_name=args.model_name,
            fault=args.fault,
            record=args.record,
            echo=args.echo,
            anthropic_key=args.anthropic_key,
            concurrency=args.concurrency,
            service_ms=args.service_ms,
            token_ms=args.token_ms,
        )
    except ValueError as exc:
        ap.error(str(exc))
    if args.tool_calls:
        app.tool_calls = [
            {"name": n.strip(), "arguments": '{"q": "x"}'}
            for n in args.tool_calls.split(",")
            if n.strip()
        ]
    uvicorn.run(
        app,
        host=args.host,
        port=args.port,
        log_level="warning",
        access_log=False,
        timeout_graceful_shutdown=2,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
