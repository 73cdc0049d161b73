"""The Anthropic Messages routes: `POST /v1/messages` and `/v1/messages/count_tokens`.

A Messages request is decoded by its codec (api/messages_codec.py) into the internal
request and runs through the same driver as a chat completion (service.generate:
keys, limits and budgets, PII, cache, routing, selection, placement, retries and
fallbacks, idempotency, task and tool governance, traces, usage rows under the
endpoint `messages`); its reply is turned into the Messages shape here
(api/messages_reply.py), and its errors into Anthropic's error body (api/app.py).
The key comes as `x-api-key` or `Authorization: Bearer`; `anthropic-version` and
`anthropic-beta` are accepted and not needed.
"""

from __future__ import annotations

import time

import orjson
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from switchyard.api.body import header_map
from switchyard.api.messages_codec import COUNT_CODEC, MessagesCodec
from switchyard.api.messages_reply import MessageEvents, error_event, to_message
from switchyard.api.openai import CTX_KEY, OpenAIRoutes, json_response, stream_response, watched
from switchyard.api.sse import replayed, translated
from switchyard.identity import Principal
from switchyard.pipeline import COUNT, RequestContext
from switchyard.policy.cost import prompt_tokens
from switchyard.reply import Reply, StreamReply, relay, stream_chunks
from switchyard.request import Generation

PREFIX = "/v1/messages"  # the routes whose errors take Anthropic's shape (api/app.py)


def served_model(ctx: RequestContext) -> str:
    """The model a Messages reply names: the alias that answered (after routing and
    fallbacks), else the one asked for."""
    dep = ctx.deployment
    return dep.alias if dep is not None else (ctx.alias or ctx.generation.model)


def to_messages_response(reply: Reply, ctx: RequestContext) -> Response:
    """The driver's reply (a chat completion, or its stream) in the Messages shape."""
    model = served_model(ctx)
    if isinstance(reply, StreamReply):
        cost = ctx.cost
        events = MessageEvents(model, cost.prompt if cost is not None else 0)
        source = reply.source
        content = (
            translated(
                ctx, relay(ctx, watched(ctx, source).data(), reply.side, source.close), events
            )
            if source is not None
            else replayed(stream_chunks(reply.cached or {}), events)
        )
        return stream_response(reply, content, error_event)
    chat = orjson.loads(reply.body)
    return json_response(
        reply, orjson.dumps(to_message(chat if isinstance(chat, dict) else {}, model))
    )


class AnthropicRoutes:
    """The Messages routes, beside the OpenAI ones (whose body reader they share)."""

    def __init__(self, openai: OpenAIRoutes) -> None:
        self.openai = openai
        self.service = openai.service
        self.gw = openai.gw
        self.codec = MessagesCodec()

    def routes(self) -> list[Route]:
        return [
            Route(PREFIX, self.messages, methods=["POST"]),
            Route(PREFIX + "/count_tokens", self.count_tokens, methods=["POST"]),
        ]

    async def _principal(self, headers: dict[str, str]) -> Principal:
        principal = self.service.auth.authenticate(headers, x_api_key=True)  # before costly work
        if not isinstance(principal, Principal):
            principal = await principal
        return principal

    async def messages(self, request: Request) -> Response:
        """Create a message (Anthropic Messages API), streamed or not."""
        received = time.perf_counter()
        headers = header_map(request.scope)
        principal = await self._principal(headers)
        service = self.service
        ctx = service.open("chat.completions", headers, received, principal, api="messages")
        request.scope[CTX_KEY] = ctx  # for the error mapping (app.py)
        ctx.receive = request.receive  # a wait in the queue ends if the client hangs up
        reply = await service.generate(ctx, self.openai.reader(request, headers, self.codec))
        return to_messages_response(reply, ctx)

    async def count_tokens(self, request: Request) -> Response:
        """Count a Messages request's input tokens: the gateway's own estimate, the one
        its token limits reserve (an upper bound of what the engine will count). A
        request of the key's like any other (service.counted): the same model rules,
        held to its rpm and concurrency, recorded; nothing goes upstream."""
        received = time.perf_counter()
        headers = header_map(request.scope)
        principal = await self._principal(headers)
        service = self.service
        ctx = service.open(COUNT, headers, received, principal)
        request.scope[CTX_KEY] = ctx  # for the error mapping (app.py)
        image_tokens = self.gw.settings.policy.image_tokens

        def count(req: Generation) -> int:
            return prompt_tokens(req, None, image_tokens)[0]

        n = await service.counted(ctx, self.openai.reader(request, headers, COUNT_CODEC), count)
        return Response(orjson.dumps({"input_tokens": n}), media_type="application/json")
