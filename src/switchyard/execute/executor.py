"""Execution: send the prepared request to the selected deployment.

One attempt for now; retries, backoff inside the deadline, breakers and fallbacks
arrive with the resilience capability and plug in here without touching the API.
"""

from __future__ import annotations

import time

import orjson

from switchyard.engines.upstream import UpstreamReply, UpstreamStream
from switchyard.errors import UpstreamTimeout
from switchyard.pipeline import RequestContext

PATHS = {"chat.completions": "/chat/completions", "completions": "/completions"}


def upstream_payload(ctx: RequestContext) -> bytes:
    """The client's body with the upstream's model name; streams always ask for usage."""
    assert ctx.deployment is not None
    body = dict(ctx.body)
    body["model"] = ctx.deployment.upstream_model
    if ctx.stream:
        opts = dict(body.get("stream_options") or {})
        opts["include_usage"] = True  # we account usage even when the client does not ask
        body["stream_options"] = opts
    return orjson.dumps(body)


def _check_deadline(ctx: RequestContext) -> float:
    remaining = ctx.remaining_s()
    if remaining <= 0:
        raise UpstreamTimeout("the request deadline passed before the upstream call")
    return remaining


async def execute(ctx: RequestContext) -> UpstreamReply:
    dep = ctx.deployment
    assert dep is not None
    remaining = _check_deadline(ctx)
    ctx.attempts += 1
    ctx.timings.upstream_sent = time.perf_counter()
    reply = await dep.upstream.post(
        PATHS[ctx.endpoint], upstream_payload(ctx), dep.model.timeouts, remaining
    )
    ctx.timings.upstream_first_byte = time.perf_counter()
    return reply


async def execute_stream(ctx: RequestContext) -> UpstreamStream:
    dep = ctx.deployment
    assert dep is not None
    remaining = _check_deadline(ctx)
    ctx.attempts += 1
    ctx.timings.upstream_sent = time.perf_counter()
    stream = await dep.upstream.stream(
        PATHS[ctx.endpoint], upstream_payload(ctx), dep.model.timeouts, remaining
    )
    ctx.timings.upstream_first_byte = time.perf_counter()
    return stream
