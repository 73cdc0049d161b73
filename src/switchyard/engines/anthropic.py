"""An Anthropic-protocol upstream: chat completions translated onto the Messages API.

The gateway's internal reply is the chat-completions reply and its stream chunks, so an
upstream that speaks Anthropic's Messages API (`POST {base_url}/messages`) is reached by
translating at this edge only: the chat payload the executor built goes out as a
Messages request, and the `message` (or its SSE events) comes back as a
`chat.completion` (or `chat.completion.chunk` data, ending with `[DONE]`). Every stage
upstream of here, and the relay, sees what an OpenAI upstream would give. Pooling,
timeouts, transport errors and the HTTP error mapping are `OpenAIUpstream`'s.

The translation functions are pure (no I/O, no clock: `created` is passed in) so they
can be tested on their own. What cannot be translated is refused with a 400 naming the
field before anything is sent; fields with no meaning in the Messages API are dropped
(`DROPPED`); nothing unknown is forwarded, since the Messages API refuses unknown keys.
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator, Mapping
from typing import Any

import aiohttp
import orjson

from switchyard.config import Timeouts
from switchyard.engines.upstream import (
    OpenAIUpstream,
    UpstreamReply,
    UpstreamStream,
    _upstream_error,
)
from switchyard.errors import InvalidRequest, SwitchyardError, UpstreamError

MESSAGES_PATH = "/messages"
CHAT_PATH = "/chat/completions"
# The Messages API requires max_tokens; the gateway always sends its cap (policy/cost.py),
# so this applies only to a payload that reached here without one.
DEFAULT_MAX_TOKENS = 4096

# Chat fields that become Messages fields.
TRANSLATED = frozenset(
    {
        "model",
        "messages",
        "max_tokens",
        "max_completion_tokens",
        "stop",
        "temperature",
        "top_p",
        "top_k",
        "user",
        "tools",
        "tool_choice",
        "parallel_tool_calls",
        "stream",
        "stream_options",
    }
)
# Chat fields with no meaning in the Messages API, dropped: sampling knobs it lacks
# (seed, penalties, token-id biases of another tokenizer) and OpenAI's own storage,
# tiering and caching hints.
DROPPED = frozenset(
    {
        "seed",
        "frequency_penalty",
        "presence_penalty",
        "logit_bias",
        "service_tier",
        "store",
        "metadata",
        "prediction",
        "reasoning_effort",
        "verbosity",
        "prompt_cache_key",
        "safety_identifier",
    }
)


# Chat fields refused unless at their default: the Messages API cannot do what they ask.
DEFAULT_ONLY = frozenset(
    {
        "n",
        "logprobs",
        "top_logprobs",
        "response_format",
        "functions",
        "function_call",
        "audio",
        "modalities",
        "return_token_ids",
    }
)


def _default_only(name: str, value: Any) -> bool:
    """Whether a chat field that only has its default meaning here is at its default."""
    if value is None:
        return True
    if name == "n":
        return value == 1
    if name in ("logprobs", "return_token_ids"):
        return value is False
    if name == "top_logprobs":
        return value == 0
    if name == "response_format":
        return isinstance(value, dict) and value.get("type") == "text"
    if name == "modalities":
        return value == ["text"]
    if name in ("functions", "function_call"):
        return value == []
    return False  # audio


STOP_REASONS = {
    "end_turn": "stop",
    "stop_sequence": "stop",
    "pause_turn": "stop",
    "max_tokens": "length",
    "model_context_window_exceeded": "length",
    "tool_use": "tool_calls",
    "refusal": "content_filter",
}

# The HTTP status of each Messages-API error type, for an `error` event in a stream
# (which has no status of its own): mapped then like an HTTP error (_upstream_error).
ERROR_STATUS = {
    "invalid_request_error": 400,
    "authentication_error": 401,
    "billing_error": 402,
    "permission_error": 403,
    "not_found_error": 404,
    "request_too_large": 413,
    "rate_limit_error": 429,
    "api_error": 500,
    "timeout_error": 504,
    "overloaded_error": 529,
}


def _refuse(message: str, param: str | None = None) -> InvalidRequest:
    return InvalidRequest(
        f"{message} (this model's upstream speaks Anthropic's Messages API)", param=param
    )


# -- chat request -> Messages request ---------------------------------------------------


def chat_to_messages(
    obj: Mapping[str, Any], default_max_tokens: int = DEFAULT_MAX_TOKENS
) -> dict[str, Any]:
    """A chat-completions request as a Messages request. Raises InvalidRequest (400)
    naming what cannot be translated."""
    for name, value in obj.items():
        if name in TRANSLATED or name in DROPPED:
            continue
        if name in DEFAULT_ONLY:
            if not _default_only(name, value):
                raise _refuse(f"'{name}' cannot be honoured", param=name)
            continue
        raise _refuse(f"'{name}' has no equivalent in the Messages API", param=name)
    system, turns = _conversation(obj.get("messages"))
    out: dict[str, Any] = {
        "model": obj.get("model"),
        "max_tokens": _max_tokens(obj, default_max_tokens),
        "messages": turns,
    }
    if system:
        out["system"] = system
    stop = obj.get("stop")
    if isinstance(stop, str):
        out["stop_sequences"] = [stop]
    elif isinstance(stop, list) and stop:
        out["stop_sequences"] = stop
    for name in ("temperature", "top_p", "top_k"):
        if obj.get(name) is not None:
            out[name] = obj[name]
    user = obj.get("user")
    if isinstance(user, str) and user:
        out["metadata"] = {"user_id": user}
    tools = obj.get("tools")
    if tools:
        out["tools"] = [_tool(t, f"tools[{i}]") for i, t in enumerate(_list(tools, "tools"))]
        choice = _tool_choice(obj.get("tool_choice"), obj.get("parallel_tool_calls"))
        if choice is not None:
            out["tool_choice"] = choice
    if obj.get("stream") is True:
        out["stream"] = True
    return out


def _list(value: Any, where: str) -> list[Any]:
    if not isinstance(value, list):
        raise _refuse(f"'{where}' must be a list", param=where)
    return value


def _max_tokens(obj: Mapping[str, Any], default: int) -> int:
    """The smaller of the two output caps that is set: the tighter bound asked for."""
    caps = [
        v
        for v in (obj.get("max_tokens"), obj.get("max_completion_tokens"))
        if isinstance(v, int) and not isinstance(v, bool)
    ]
    return min(caps) if caps else default


def _conversation(messages: Any) -> tuple[str | list[dict[str, Any]] | None, list[dict[str, Any]]]:
    """(system, turns): system and developer messages become the top-level `system`;
    the rest become alternating user and assistant turns, `role: tool` messages user
    turns of `tool_result` blocks, and consecutive turns of one role one turn."""
    system: list[dict[str, Any]] = []
    turns: list[dict[str, Any]] = []
    for i, m in enumerate(_list(messages, "messages")):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise _refuse(f"'{where}' must be an object", param=where)
        role = m.get("role")
        if role in ("system", "developer"):
            system += _text_blocks(m.get("content"), where)
            continue
        if role == "user":
            blocks = _user_blocks(m.get("content"), where)
        elif role == "assistant":
            blocks = _assistant_blocks(m, where)
        elif role == "tool":
            blocks, role = [_tool_result(m, where)], "user"
        else:
            raise _refuse(f"'{where}.role' {role!r} cannot be translated", param=f"{where}.role")
        if not blocks:
            continue  # the Messages API refuses empty turns
        if turns and turns[-1]["role"] == role:
            turns[-1]["content"].extend(blocks)
        else:
            turns.append({"role": role, "content": blocks})
    for turn in turns:
        turn["content"] = _compact(turn["content"])
    return (_compact(system) if system else None), turns


def _compact(blocks: list[dict[str, Any]]) -> str | list[dict[str, Any]]:
    """A lone plain text block as a string, as a person would write it."""
    if len(blocks) == 1 and blocks[0].keys() == {"type", "text"}:
        return str(blocks[0]["text"])
    return blocks


def _text_block(part: Mapping[str, Any], where: str) -> dict[str, Any] | None:
    text = part.get("text")
    if not isinstance(text, str):
        raise _refuse(f"'{where}.text' must be a string", param=f"{where}.text")
    if not text:
        return None
    block: dict[str, Any] = {"type": "text", "text": text}
    if isinstance(part.get("cache_control"), dict):  # prompt caching, as Anthropic takes it
        block["cache_control"] = part["cache_control"]
    return block


def _text_blocks(content: Any, where: str) -> list[dict[str, Any]]:
    """Text-only content (system, developer, assistant): a string or text parts."""
    if content is None or content == "":
        return []
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    out = []
    for j, part in enumerate(_list(content, f"{where}.content")):
        at = f"{where}.content[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("text", "refusal"):
            raise _refuse(f"'{at}' of type {kind!r} cannot be translated here", param=at)
        block = _text_block({"text": part.get("refusal")} if kind == "refusal" else part, at)
        if block is not None:
            out.append(block)
    return out


def _user_blocks(content: Any, where: str) -> list[dict[str, Any]]:
    """A user message's content: text and image parts."""
    if not isinstance(content, list):
        return _text_blocks(content, where)
    out = []
    for j, part in enumerate(content):
        at = f"{where}.content[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text":
            block = _text_block(part, at)
            if block is not None:
                out.append(block)
        elif kind == "image_url":
            out.append(_image(part.get("image_url"), at))
        else:
            raise _refuse(f"'{at}' of type {kind!r} cannot be translated", param=at)
    return out


def _image(image: Any, where: str) -> dict[str, Any]:
    """An image part: a data: URL becomes a base64 source, an http(s) URL a url source."""
    url = image.get("url") if isinstance(image, dict) else image
    if not isinstance(url, str):
        raise _refuse(f"'{where}.image_url.url' must be a string", param=f"{where}.image_url")
    if url.startswith("data:"):
        head, sep, data = url[5:].partition(",")
        media_type, _, encoding = head.partition(";")
        if not sep or encoding != "base64" or not media_type:
            raise _refuse(
                f"'{where}.image_url' must be a base64 data URL (data:<type>;base64,...)",
                param=f"{where}.image_url",
            )
        source = {"type": "base64", "media_type": media_type, "data": data}
    elif url.startswith(("http://", "https://")):
        source = {"type": "url", "url": url}
    else:
        raise _refuse(f"'{where}.image_url' must be a data: or http(s) URL", param=where)
    return {"type": "image", "source": source}


def _assistant_blocks(m: Mapping[str, Any], where: str) -> list[dict[str, Any]]:
    """An assistant message: its text, then a `tool_use` block per tool call."""
    out = _text_blocks(m.get("content"), where)
    calls = m.get("tool_calls")
    for j, call in enumerate(_list(calls, f"{where}.tool_calls") if calls else []):
        at = f"{where}.tool_calls[{j}]"
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or call.get("type", "function") != "function":
            raise _refuse(f"'{at}' is not a function call", param=at)
        args = fn.get("arguments")
        try:
            parsed = orjson.loads(args) if isinstance(args, str) and args.strip() else {}
        except orjson.JSONDecodeError:
            parsed = None
        if not isinstance(parsed, dict):
            raise _refuse(
                f"'{at}.function.arguments' must be a JSON object (it becomes the tool "
                "call's input)",
                param=f"{at}.function.arguments",
            )
        out.append(
            {"type": "tool_use", "id": call.get("id"), "name": fn.get("name"), "input": parsed}
        )
    return out


def _tool_result(m: Mapping[str, Any], where: str) -> dict[str, Any]:
    """A `role: tool` message as a `tool_result` block for its call."""
    block: dict[str, Any] = {"type": "tool_result", "tool_use_id": m.get("tool_call_id")}
    content = m.get("content")
    if isinstance(content, list):
        parts = _user_blocks(content, where)
        if parts:
            block["content"] = parts
    elif isinstance(content, str) and content:
        block["content"] = content
    elif content not in (None, ""):
        raise _refuse(f"'{where}.content' must be a string or parts", param=f"{where}.content")
    return block


def _tool(t: Any, where: str) -> dict[str, Any]:
    fn = t.get("function") if isinstance(t, dict) else None
    if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(fn, dict):
        raise _refuse(f"'{where}' must be a function tool", param=where)
    params = fn.get("parameters")
    out: dict[str, Any] = {"name": fn.get("name")}
    if fn.get("description"):
        out["description"] = fn["description"]
    out["input_schema"] = params if params else {"type": "object", "properties": {}}
    return out


def _tool_choice(choice: Any, parallel: Any) -> dict[str, Any] | None:
    """`tool_choice` (auto, none, required, a named function) and `parallel_tool_calls:
    false` as Anthropic's tool_choice."""
    out: dict[str, Any]
    if choice is None:
        if parallel is not False:
            return None
        out = {"type": "auto"}
    elif choice == "auto":
        out = {"type": "auto"}
    elif choice == "none":
        return {"type": "none"}
    elif choice == "required":
        out = {"type": "any"}
    elif (
        isinstance(choice, dict)
        and choice.get("type") == "function"
        and isinstance(choice.get("function"), dict)
        and isinstance(choice["function"].get("name"), str)
    ):
        out = {"type": "tool", "name": choice["function"]["name"]}
    else:
        raise _refuse("'tool_choice' cannot be translated", param="tool_choice")
    if parallel is False:
        out["disable_parallel_tool_use"] = True
    return out


# -- Messages reply -> chat reply -------------------------------------------------------


def _count(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


def chat_usage(usage: Any) -> dict[str, Any]:
    """Messages usage as chat usage: the prompt counts every input token, those read
    from and written to the provider's prompt cache included (they are billed)."""
    u = usage if isinstance(usage, dict) else {}
    cached = _count(u.get("cache_read_input_tokens"))
    prompt = _count(u.get("input_tokens")) + cached + _count(u.get("cache_creation_input_tokens"))
    completion = _count(u.get("output_tokens"))
    out: dict[str, Any] = {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }
    if cached:
        out["prompt_tokens_details"] = {"cached_tokens": cached}
    return out


def finish_reason(stop_reason: Any) -> str:
    return STOP_REASONS.get(stop_reason, "stop") if isinstance(stop_reason, str) else "stop"


def _arguments(value: Any) -> str:
    return orjson.dumps(value if value is not None else {}).decode()


def message_to_chat(msg: Any, model: str, created: int) -> dict[str, Any]:
    """A Messages `message` as a `chat.completion`: text blocks joined as the content,
    `tool_use` blocks as tool calls (thinking and server-tool blocks have no place in
    a chat completion). `model` stands in when the reply names none."""
    if not isinstance(msg, dict) or not isinstance(msg.get("content"), list):
        raise UpstreamError("the upstream's reply is not a Messages-API message")
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    for block in msg["content"]:
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            texts.append(str(block.get("text", "")))
        elif kind == "tool_use":
            fn = {"name": block.get("name"), "arguments": _arguments(block.get("input"))}
            calls.append({"id": block.get("id"), "type": "function", "function": fn})
    message: dict[str, Any] = {
        "role": "assistant",
        "content": "".join(texts) if texts or not calls else None,
    }
    if calls:
        message["tool_calls"] = calls
    return {
        "id": msg.get("id"),
        "object": "chat.completion",
        "created": created,
        "model": msg.get("model") or model,
        "choices": [
            {
                "index": 0,
                "message": message,
                "logprobs": None,
                "finish_reason": finish_reason(msg.get("stop_reason")),
            }
        ],
        "usage": chat_usage(msg.get("usage")),
    }


def error_event(data: Mapping[str, Any], name: str) -> SwitchyardError:
    """A stream's `error` event as the error an HTTP reply of its type would give."""
    err = data.get("error")
    kind = err.get("type") if isinstance(err, dict) else None
    status = ERROR_STATUS.get(kind, 500) if isinstance(kind, str) else 500
    return _upstream_error(status, orjson.dumps(data), name)


# -- Messages stream -> chat chunks -----------------------------------------------------


class StreamTranslator:
    """Messages SSE events in, chat.completion.chunk data out, exactly as an OpenAI
    upstream streams: a role delta first, text as `delta.content`, each tool call as
    its id and name with empty arguments and then the arguments in pieces, a chunk
    with the finish reason, the usage chunk when asked, and `[DONE]`."""

    def __init__(self, model: str, created: int, include_usage: bool, name: str = "") -> None:
        self.model = model
        self.created = created
        self.include_usage = include_usage
        self.name = name  # the upstream's, for errors
        self.id = "msg"
        self.usage: dict[str, Any] = {}
        self.stop_reason: Any = None
        self.finished = False  # the finish chunk went out
        self.done = False  # message_stop: [DONE] went out
        self._tools: dict[int, int] = {}  # content block index -> tool call index
        self._args: set[int] = set()  # tool blocks that sent a piece of arguments

    def _chunk(self, delta: dict[str, Any], finish: str | None = None) -> bytes:
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        return orjson.dumps(
            {
                "id": self.id,
                "object": "chat.completion.chunk",
                "created": self.created,
                "model": self.model,
                "choices": [choice],
            }
        )

    def _tool_delta(self, block: int, call: dict[str, Any]) -> bytes:
        return self._chunk({"tool_calls": [{"index": self._tools[block], **call}]})

    def feed(self, event_type: str, data: Mapping[str, Any]) -> list[bytes]:
        """The chunk data one event gives (often none). Raises the mapped
        SwitchyardError on an `error` event: the stream is broken, never a success."""
        if self.done:
            return []
        if event_type == "message_start":
            msg = data.get("message")
            msg = msg if isinstance(msg, dict) else {}
            if isinstance(msg.get("id"), str):
                self.id = msg["id"]
            if isinstance(msg.get("model"), str) and msg["model"]:
                self.model = msg["model"]
            if isinstance(msg.get("usage"), dict):
                self.usage.update(msg["usage"])
            return [self._chunk({"role": "assistant", "content": ""})]
        index = data.get("index")
        if event_type == "content_block_start" and isinstance(index, int):
            block = data.get("content_block")
            kind = block.get("type") if isinstance(block, dict) else None
            if kind == "text" and block and block.get("text"):
                return [self._chunk({"content": block["text"]})]
            if kind == "tool_use" and block:
                self._tools[index] = len(self._tools)
                head = {
                    "id": block.get("id"),
                    "type": "function",
                    "function": {"name": block.get("name"), "arguments": ""},
                }
                out = [self._tool_delta(index, head)]
                if block.get("input"):  # a provider that sends the input whole
                    self._args.add(index)
                    args = {"arguments": _arguments(block["input"])}
                    out.append(self._tool_delta(index, {"function": args}))
                return out
            return []
        if event_type == "content_block_delta" and isinstance(index, int):
            delta = data.get("delta")
            kind = delta.get("type") if isinstance(delta, dict) else None
            if kind == "text_delta" and delta and delta.get("text"):
                return [self._chunk({"content": delta["text"]})]
            if kind == "input_json_delta" and delta and index in self._tools:
                piece = delta.get("partial_json")
                if isinstance(piece, str) and piece:
                    self._args.add(index)
                    return [self._tool_delta(index, {"function": {"arguments": piece}})]
            return []  # thinking, signatures, citations: not part of a chat completion
        if event_type == "content_block_stop" and isinstance(index, int):
            if index in self._tools and index not in self._args:
                self._args.add(index)  # a call without input: its arguments are {}
                return [self._tool_delta(index, {"function": {"arguments": "{}"}})]
            return []
        if event_type == "message_delta":
            delta = data.get("delta")
            if isinstance(delta, dict) and delta.get("stop_reason") is not None:
                self.stop_reason = delta["stop_reason"]
            if isinstance(data.get("usage"), dict):  # cumulative counts
                self.usage.update({k: v for k, v in data["usage"].items() if v is not None})
            return self._finish()
        if event_type == "message_stop":
            out = self._finish()
            if self.include_usage:
                usage = {
                    "id": self.id,
                    "object": "chat.completion.chunk",
                    "created": self.created,
                    "model": self.model,
                    "choices": [],
                    "usage": chat_usage(self.usage),
                }
                out.append(orjson.dumps(usage))
            self.done = True
            out.append(b"[DONE]")
            return out
        if event_type == "error":
            raise error_event(data, self.name)
        return []  # ping, and event types added later (the API may add them)

    def _finish(self) -> list[bytes]:
        if self.finished:
            return []
        self.finished = True
        return [self._chunk({}, finish_reason(self.stop_reason))]

    def feed_data(self, raw: bytes) -> list[bytes]:
        """One SSE event's data (its `type` names the event, as the event line does)."""
        try:
            data = orjson.loads(raw)
        except orjson.JSONDecodeError:
            data = None
        if not isinstance(data, dict) or not isinstance(data.get("type"), str):
            raise UpstreamError(
                f"upstream {self.name} sent a stream event that is not a Messages-API event"
            )
        return self.feed(data["type"], data)


# -- the client --------------------------------------------------------------------------


class AnthropicUpstream(OpenAIUpstream):
    """A pooled client for one Messages-API upstream, with the interface the executor
    uses on an OpenAI upstream: `post` and `stream` take the chat payload and give the
    chat reply. The key goes in `x-api-key` with `anthropic-version`; never in
    `Authorization`."""

    def __init__(
        self,
        name: str,
        base_url: str,
        api_key: str | None,
        anthropic_version: str,
        max_connections: int = 256,
        default_max_tokens: int = DEFAULT_MAX_TOKENS,
    ) -> None:
        headers = {"anthropic-version": anthropic_version}
        if api_key:
            headers["x-api-key"] = api_key
        super().__init__(name, lambda: base_url, None, max_connections, headers=headers)
        self.default_max_tokens = default_max_tokens

    def _request(
        self, path: str, payload: bytes, stream: bool
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        """(the chat payload, its Messages request); chat completions only."""
        if path != CHAT_PATH:
            raise InvalidRequest(
                "this model's upstream speaks Anthropic's Messages API, which serves chat "
                "only: use /v1/chat/completions"
            )
        try:
            chat = orjson.loads(payload)
        except orjson.JSONDecodeError:
            chat = None
        if not isinstance(chat, dict):
            raise InvalidRequest("the request body must be a JSON object")
        body = chat_to_messages(chat, self.default_max_tokens)
        body.pop("stream", None)
        if stream:
            body["stream"] = True
        return chat, body

    async def post(
        self,
        path: str,
        payload: bytes,
        timeouts: Timeouts,
        remaining_s: float | None = None,
        extra_headers: dict[str, str] | None = None,
    ) -> UpstreamReply:
        _, body = self._request(path, payload, stream=False)
        reply = await super().post(
            MESSAGES_PATH, orjson.dumps(body), timeouts, remaining_s, extra_headers
        )
        try:
            msg = orjson.loads(reply.body)
        except orjson.JSONDecodeError:
            msg = None
        chat = message_to_chat(msg, str(body["model"]), int(time.time()))
        return UpstreamReply(reply.status, orjson.dumps(chat), reply.headers)

    async def stream(
        self,
        path: str,
        payload: bytes,
        timeouts: Timeouts,
        remaining_s: float | None = None,
        extra_headers: dict[str, str] | None = None,
    ) -> UpstreamStream:
        chat, body = self._request(path, payload, stream=True)
        options = chat.get("stream_options")
        include_usage = isinstance(options, dict) and options.get("include_usage") is True
        translator = StreamTranslator(
            str(body["model"]), int(time.time()), include_usage, self.name
        )
        resp = await self._open(
            MESSAGES_PATH, orjson.dumps(body), timeouts, remaining_s, extra_headers
        )
        return AnthropicStream(resp, self, translator)

    async def tokenize(self, text: str, timeout_s: float) -> list[int] | None:
        """A Messages-API upstream has no tokenizer endpoint the gateway can use."""
        return None


class AnthropicStream(UpstreamStream):
    """A Messages SSE stream read as chat-completion chunk data."""

    def __init__(
        self, resp: aiohttp.ClientResponse, upstream: OpenAIUpstream, translator: StreamTranslator
    ) -> None:
        super().__init__(resp, upstream)
        self.translator = translator

    async def data(self) -> AsyncGenerator[list[bytes], None]:
        """The chunk data of each network read's events; raises the mapped error on an
        `error` event or an event that is not one."""
        events = super().data()
        feed = self.translator.feed_data
        try:
            async for batch in events:
                out: list[bytes] = []
                try:
                    for item in batch:
                        out += feed(item)
                except SwitchyardError:
                    if out:  # what came before the error in the same read goes out first
                        yield out
                    raise
                if out:
                    yield out
        finally:
            await events.aclose()
