"""The scripted upstream's ASGI app (`ScriptedUpstream`): it counts and faults generation
requests, then hands every request to a Starlette router of the generation, Messages,
stats and control routes. What it serves is described in `scripted_upstream.py`, which
runs it.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import AsyncIterator
from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route, Router
from starlette.types import Receive, Scope, Send

from switchyard.bench import scripted_messages
from switchyard.bench.scripted_upstream_bodies import (
    billed_prompt_tokens,
    error_response,
    messages_error,
    read_body,
    replay_body,
    tool_call_list,
    whole_reply,
)
from switchyard.bench.scripted_upstream_faults import (
    FAULT_HEADER,
    HANG_S,
    Abort,
    Fault,
    abort_connection,
    error_body,
    parse_fault,
    send_json,
    wait_disconnect,
)

MESSAGES_PATH = "/v1/messages"
GENERATION_PATHS = frozenset({"/v1/chat/completions", "/v1/completions", MESSAGES_PATH})
WORDS = ("Hello", " from", " the", " scripted", " upstream", ".")
DONE = b"data: [DONE]\n\n"
ABORT_KEY = "switchyard.scripted.abort"
LENGTH = re.compile(r"\[\[tokens:(\d{1,5})\]\]")
SLOW_KEY = "switchyard.scripted.slow"
STREAM_ERROR_KEY = "switchyard.scripted.stream_error"


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
        # Generation requests being answered now, and the most at once since the last
        # DELETE /stats (what a concurrency limit in front of it let through).
        self.in_flight = 0
        self.peak_in_flight = 0
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
        self.in_flight += 1
        self.peak_in_flight = max(self.peak_in_flight, self.in_flight)
        try:
            await self._answer(scope, receive, send)
        finally:
            self.in_flight -= 1

    async def _answer(self, scope: Scope, receive: Receive, send: Send) -> None:
        for name, value in scope["headers"]:
            if name == b"traceparent":  # lets tests check trace propagation
                self.last_traceparent = value.decode("latin-1")
        errors = scripted_messages.error_body if scope["path"] == MESSAGES_PATH else error_body
        try:
            fault = self._fault_for(scope)
        except ValueError as exc:
            await send_json(send, 400, errors(400, f"x-scripted-fault: {exc}"), [])
            return
        if self.record is not None or (fault is not None and fault.action == "echo"):
            raw = await read_body(receive)
            if self.record is not None:
                with open(self.record, "ab") as f:
                    f.write(raw.replace(b"\n", b" ") + b"\n")
            receive = replay_body(raw)
        if fault is not None:
            if fault.delay_s > 0:
                await asyncio.sleep(fault.delay_s)
            if fault.action == "echo":
                message = "scripted fault: cannot process " + raw.decode("utf-8", "replace")
                await send_json(send, fault.status, errors(fault.status, message), [])
                return
            if fault.action == "status":
                extra = [(b"retry-after", b"1")] if fault.status == 429 else []
                if fault.retry_after is not None:
                    extra = [(b"retry-after", fault.retry_after.encode())]
                body = errors(fault.status, f"scripted fault: HTTP {fault.status}")
                await send_json(send, fault.status, body, extra)
                return
            if fault.action == "hang":
                await wait_disconnect(receive, HANG_S)
                return
            if fault.action == "close":
                await abort_connection(send, receive)
                return
            if fault.action == "drop-mid-stream":
                scope = {**scope, ABORT_KEY: lambda: abort_connection(send, receive)}
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
            return error_response(400, "the request body is not valid JSON")
        if not isinstance(body, dict):
            return error_response(400, "the request body must be a JSON object")
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
        prompt_tokens = billed_prompt_tokens(raw, body)
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
        return whole_reply(orjson.dumps(reply), abort)

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
            return messages_error(401, "invalid x-api-key")
        if not headers.get("anthropic-version"):
            return messages_error(400, "anthropic-version: header is required")
        why = scripted_messages.check_request(body)
        if why is not None:
            return messages_error(400, why)
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
            return whole_reply(orjson.dumps(reply), request.scope.get(ABORT_KEY))
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
            self.peak_in_flight = self.in_flight
        return Response(
            orjson.dumps(
                {
                    "requests": self.requests,
                    "last_traceparent": self.last_traceparent,
                    "last_prompt": self.last_prompt,
                    "open_streams": self.open_streams,
                    "aborted": self.aborted,
                    "in_flight": self.in_flight,
                    "peak_in_flight": self.peak_in_flight,
                }
            ),
            media_type="application/json",
        )

    async def _control_tools(self, request: Request) -> Response:
        try:
            body = orjson.loads(await request.body())
            self.tool_calls = tool_call_list(body)
        except (orjson.JSONDecodeError, ValueError) as exc:
            return error_response(400, f"control: {exc}")
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
            return error_response(400, f"control: {exc}")
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
            return error_response(400, f"control: {exc}")
        if content is not None and not isinstance(content, str):
            return error_response(400, "control: content must be a string or null")
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
            return error_response(400, f"control: {exc}")
        if count is not None and (not isinstance(count, int) or count < 0):
            return error_response(400, "control: count must be a non-negative integer or null")
        self._runtime_fault, self._runtime_left = fault, count
        return Response(
            orjson.dumps({"fault": spec, "count": count}), media_type="application/json"
        )
