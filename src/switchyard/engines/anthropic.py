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

This module is the client; the request translation is engines/anthropic_request.py and
the reply and stream translation engines/anthropic_reply.py, re-exported here.
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator
from typing import Any

import aiohttp
import orjson

from switchyard.config import Timeouts
from switchyard.engines.anthropic_reply import (
    ERROR_STATUS,
    STOP_REASONS,
    StreamTranslator,
    chat_usage,
    error_event,
    finish_reason,
    message_to_chat,
)
from switchyard.engines.anthropic_request import (
    DEFAULT_MAX_TOKENS,
    DEFAULT_ONLY,
    DROPPED,
    TRANSLATED,
    chat_to_messages,
)
from switchyard.engines.upstream import OpenAIUpstream, UpstreamReply, UpstreamStream
from switchyard.errors import InvalidRequest, SwitchyardError

__all__ = [
    "CHAT_PATH",
    "DEFAULT_MAX_TOKENS",
    "DEFAULT_ONLY",
    "DROPPED",
    "ERROR_STATUS",
    "MESSAGES_PATH",
    "STOP_REASONS",
    "TRANSLATED",
    "AnthropicStream",
    "AnthropicUpstream",
    "StreamTranslator",
    "chat_to_messages",
    "chat_usage",
    "error_event",
    "finish_reason",
    "message_to_chat",
]

MESSAGES_PATH = "/messages"
CHAT_PATH = "/chat/completions"


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
        chat = message_to_chat(reply.obj, str(body["model"]), int(time.time()))
        return UpstreamReply(reply.status, orjson.dumps(chat), reply.headers, chat)

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
