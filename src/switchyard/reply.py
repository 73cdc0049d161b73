"""The internal reply model: what the request driver hands the API layer.

A reply is a whole JSON answer (`JsonReply`) or a stream (`StreamReply`); which
deployment served it, and why, travels as `x-switchyard-*` headers (`served_raw_headers`).
`relay` drives a stream's lifecycle: each upstream event's data passes the request's
reply side (pipeline.ReplySide: the tool gate, the cache, PII restore) and comes out
as the data to send; the wire framing is the protocol's (api/sse.py).
"""

from __future__ import annotations

import asyncio
import re
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
import orjson

from switchyard.engines.registry import Deployment
from switchyard.engines.upstream import UpstreamStream
from switchyard.errors import SwitchyardError, UpstreamError
from switchyard.pipeline import CacheOutcome, ReplySide, RequestContext, Status


@dataclass(slots=True)
class JsonReply:
    """A JSON answer. `settle` (when set) is called once its bytes are sent: the
    client does not wait for the ledger, metrics and trace of its own request."""

    body: bytes
    headers: list[tuple[bytes, bytes]]  # lower-case names, encoded
    settle: Callable[[], Awaitable[None] | None] | None = None
    status: int = 200


@dataclass(slots=True)
class StreamReply:
    """A server-sent event stream: the upstream's (`source`, passed through the
    request's reply side) or a cached completion replayed (`cached`). `on_close` runs
    once the stream ends, however it ends."""

    ctx: RequestContext
    headers: dict[str, str]
    on_close: Callable[[], Awaitable[None]]
    source: UpstreamStream | None = None  # the executor's upstream stream
    cached: dict[str, Any] | None = None
    side: ReplySide | None = None


Reply = JsonReply | StreamReply


def reply_object(body: bytes) -> dict[str, Any] | None:
    """A JSON reply as an object, or None if it is not one."""
    try:
        obj = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    return obj if isinstance(obj, dict) else None


def translated_reply(ctx: RequestContext, body: bytes) -> dict[str, Any]:
    """A whole chat reply that a protocol turns into its own shape, parsed ({} when it
    is not an object; raises on bytes that are not JSON). When they are the bytes
    whose usage settling would read (`through` passed them on as they came), their
    usage is kept now, so the reply is parsed once, not twice."""
    obj = orjson.loads(body)
    if not isinstance(obj, dict):
        return {}
    run = ctx.run
    if run.usage is None and run.reply_body is body:
        usage = obj.get("usage")
        run.usage = usage if isinstance(usage, dict) else None
    return obj


def through(ctx: RequestContext, side: ReplySide | None, body: bytes) -> bytes | Awaitable[bytes]:
    """A whole reply through the request's reply side: at once (the bytes as they
    came) when no part wants it — its usage is then read when the request is settled,
    after the bytes are on their way — else an awaitable of the bytes to send (the
    reply parsed once, its usage kept so settling need not parse it again)."""
    ctx.run.reply_body = body  # settling reads its usage, or what its choices prove
    obj = reply_object(body) if side is not None and side.wants(body) else None
    if side is None or obj is None:
        return body
    usage = obj.get("usage")
    ctx.run.usage = usage if isinstance(usage, dict) else None
    return _whole(side, obj, body)


async def _whole(side: ReplySide, obj: dict[str, Any], body: bytes) -> bytes:
    out = await side.whole(obj, body)
    return body if out is obj else orjson.dumps(out)


@dataclass(slots=True)
class ToolCallPiece:
    """A piece of one streamed tool call: its id and name come with its first piece;
    `index` a key whatever the upstream sent (`_pieces`: a list or object by its text)."""

    index: Any
    call_id: str
    name: str
    arguments: str


class ChatChunk(msgspec.Struct):
    """A chat completion chunk as the protocols that turn chunks into their own events
    read it: the members they use; decoding its bytes (`read_chunk`) skips the others
    (object, created, model, ...) unread, which is cheaper than building them."""

    id: Any = None
    choices: Any = None
    usage: Any = None


# A chunk's bytes as a ChatChunk: msgspec.DecodeError if they are not JSON,
# msgspec.ValidationError (a DecodeError) if they are JSON but not an object.
read_chunk = msgspec.json.Decoder(ChatChunk).decode


# What one chat completion chunk carries, read once (for the protocols that turn
# chunks into their own events): (its usage, its text, its tool-call pieces, its
# finish reason, its refusal text). A plain tuple, unpacked where it is read: the
# translation runs it for every chunk of every stream, and a tuple is made and taken
# apart with no Python call (a dataclass's __init__ cost more than reading the chunk did).
ChunkParts = tuple[dict[str, Any] | None, str, Sequence[ToolCallPiece], str | None, str]


def _parts(
    usage: dict[str, Any] | None, text: Any, calls: Any, finish: Any, refusal: Any = None
) -> ChunkParts:
    """The parts of a chunk from the members of its choice 0 as either reading found
    them (None: missing), whatever is malformed left empty: the one rule of
    `chunk_parts` and `typed_parts`."""
    return (
        usage,
        text if type(text) is str else "",
        _pieces(calls) if type(calls) is list and calls else (),
        finish if type(finish) is str and finish else None,
        refusal if type(refusal) is str else "",
    )


def _first(index: Any) -> bool:
    """Whether a choice of this `index` is choice 0, the one the client asked for: its
    index is the number 0, or it has none (an upstream that leaves it out sends one)."""
    return index is None or (type(index) is int and index == 0)


def chunk_parts(chunk: ChatChunk) -> ChunkParts:
    """(usage, text, tool-call pieces, finish, refusal) of a chat completion chunk's
    choice 0 (the answer the Messages and Responses clients asked for: a choice of
    another index, which an upstream may send beside it, is no part of it), whatever is
    missing or malformed left empty (None, "", (), None, ""). Run for every chunk of
    every translated stream: exact type checks, nothing built but the tuple (and the
    pieces of a chunk with calls)."""
    usage = chunk.usage
    if type(usage) is not dict:
        usage = None
    choices = chunk.choices
    if type(choices) is not list or not choices:
        return _parts(usage, None, None, None)
    choice = choices[0]
    if type(choice) is not dict or not (
        (i := choice.get("index")) is None or (type(i) is int and i == 0)  # _first, inline
    ):
        # (rare: choice 0 is not first) the first object of index 0, if any
        choice = next((c for c in choices if type(c) is dict and _first(c.get("index"))), None)
        if choice is None:
            return _parts(usage, None, None, None)
    delta = choice.get("delta")
    if type(delta) is not dict:
        return _parts(usage, None, None, choice.get("finish_reason"))
    return _parts(
        usage,
        delta.get("content"),
        delta.get("tool_calls"),
        choice.get("finish_reason"),
        delta.get("refusal"),
    )


class _Delta(msgspec.Struct, gc=False):
    content: Any = None
    tool_calls: Any = None
    refusal: Any = None


class _Choice(msgspec.Struct, gc=False):
    index: Any = None
    delta: _Delta | None = None
    finish_reason: Any = None


class TypedChunk(msgspec.Struct, gc=False):
    """A chat completion chunk of the usual shape (its choices objects, each delta an
    object), typed as far as `chunk_parts` reads it: decoded straight into these
    structs (`read_typed`), without a dict for its choice or its delta. Data of any
    other shape is refused (msgspec.ValidationError) and read by `read_chunk`."""

    choices: list[_Choice] | None = None
    usage: dict[str, Any] | None = None


read_typed = msgspec.json.Decoder(TypedChunk).decode


def typed_parts(chunk: TypedChunk) -> ChunkParts:
    """The parts of a chunk read typed: what `chunk_parts(read_chunk(...))` gives for
    the same data (property-tested), its members through the same rule (`_parts`)."""
    usage, choices = chunk.usage, chunk.choices
    if not choices:
        return _parts(usage, None, None, None)
    choice = choices[0]
    if not ((i := choice.index) is None or (type(i) is int and i == 0)):  # _first, inline
        # (rare: choice 0 is not first) the first of index 0
        found = next((c for c in choices if _first(c.index)), None)
        if found is None:
            return _parts(usage, None, None, None)
        choice = found
    delta = choice.delta
    if delta is None:
        return _parts(usage, None, None, choice.finish_reason)
    return _parts(usage, delta.content, delta.tool_calls, choice.finish_reason, delta.refusal)


def _pieces(calls: list[Any]) -> list[ToolCallPiece]:
    out = []
    for call in calls:
        if isinstance(call, dict):
            named = call.get("function")
            fn: dict[str, Any] = named if isinstance(named, dict) else {}
            piece = fn.get("arguments")
            index = call.get("index", 0)
            out.append(
                ToolCallPiece(
                    # An index that is no key (a list, an object) is known by its text.
                    repr(index) if type(index) is list or type(index) is dict else index,
                    str(call.get("id") or ""),
                    str(fn.get("name") or ""),
                    piece if isinstance(piece, str) else "",
                )
            )
    return out


def first_choice(reply: dict[str, Any]) -> dict[str, Any]:
    """Choice 0 of a whole reply (a chat completion or a completion), the answer the
    client asked for: the first object of index 0 (or of none: an upstream that leaves
    the index out sends one choice), wherever it sits in `choices`, as the stream's
    `chunk_parts` reads a chunk's; {} when there is none. An upstream that sends its
    choices out of order (index 1 first) is still read for choice 0. The one reading
    of a whole reply's choice 0 (Responses, Messages, a cached reply replayed)."""
    choices = reply.get("choices")
    if type(choices) is not list or not choices:
        return {}
    choice = choices[0]
    if isinstance(choice, dict) and _first(choice.get("index")):
        return choice  # the usual reply: choice 0 first
    return next((c for c in choices if isinstance(c, dict) and _first(c.get("index"))), {})


def stream_chunks(chat: dict[str, Any]) -> list[ChatChunk]:
    """A whole chat completion (a cache hit, replayed as a stream) as the chunks a
    stream of it carries: its text, each tool call, the finish reason, the usage. The
    protocols that translate stream chunks (Messages, Responses) replay a hit through
    the same translation as a live stream."""
    choice = first_choice(chat)
    msg = choice.get("message")
    msg = msg if isinstance(msg, dict) else {}
    out: list[ChatChunk] = []
    text = msg.get("content")
    if isinstance(text, str) and text:
        out.append(ChatChunk(choices=[{"index": 0, "delta": {"content": text}}]))
    refusal = msg.get("refusal")
    if isinstance(refusal, str) and refusal:
        out.append(ChatChunk(choices=[{"index": 0, "delta": {"refusal": refusal}}]))
    calls = msg.get("tool_calls")
    for k, call in enumerate(calls if isinstance(calls, list) else ()):
        if isinstance(call, dict):
            delta = {"tool_calls": [{**call, "index": k}]}
            out.append(ChatChunk(choices=[{"index": 0, "delta": delta}]))
    finish = choice.get("finish_reason")
    out.append(ChatChunk(choices=[{"index": 0, "delta": {}, "finish_reason": finish or "stop"}]))
    out.append(ChatChunk(choices=[], usage=chat.get("usage")))
    return out


class _UsageOf(msgspec.Struct, gc=False):
    """A JSON reply as settling reads it: its `usage` member, every other member
    skipped without building it."""

    usage: Any = None


_read_usage = msgspec.json.Decoder(_UsageOf).decode


def reply_usage(body: bytes) -> dict[str, Any] | None:
    """The `usage` object of a JSON reply, or None (not JSON, not an object, no usage
    object). Read once per JSON reply at settle, so its members beside `usage` are
    skipped, not built: a quarter of parsing the whole reply. For a well-formed reply
    this is what `reply_object(body)["usage"]` gives (property-tested); a reply that is
    malformed only outside `usage` (a byte that is not UTF-8, a number beyond a
    float, in a member skipped) still has its usage read, where the whole parse
    found none and settling fell back to the estimate."""
    try:
        usage = _read_usage(body).usage
    except msgspec.DecodeError:  # ValidationError too: a reply that is no object
        return None
    return usage if isinstance(usage, dict) else None


def answered_headers(model: str, revision: str | None) -> list[tuple[bytes, bytes]]:
    """`x-switchyard-model` and `-revision` of a cached answer: the model (a routed
    alias's route) and revision that answered when it was stored."""
    out = [(b"x-switchyard-model", model.encode("latin-1"))]
    if revision:
        out.append((b"x-switchyard-revision", revision.encode("latin-1")))
    return out


def _deployment_headers(dep: Deployment) -> list[tuple[bytes, bytes]]:
    """`x-switchyard-model`, `-revision` and `-upstream` of a deployment, encoded once.
    `-upstream` is the deployment's configured name (Deployment.served_by), never its
    URL: clients learn which deployment answered, not the operator's addresses."""
    label = dep.served_by
    cached = dep.encoded_headers
    if cached is None or cached[0] != label:
        cached = dep.encoded_headers = (
            label,
            [
                (b"x-switchyard-model", dep.alias.encode("latin-1")),
                (b"x-switchyard-revision", dep.model.revision.encode("latin-1")),
                (b"x-switchyard-upstream", label.encode("latin-1")),
            ],
        )
        if dep.adapter is not None:  # the adapter and its revision, beside the base's
            cached[1].append((b"x-switchyard-adapter", dep.adapter.name.encode("latin-1")))
            cached[1].append(
                (b"x-switchyard-adapter-revision", dep.adapter.revision.encode("latin-1"))
            )
    return cached[1]


def served_raw_headers(ctx: RequestContext) -> list[tuple[bytes, bytes]]:
    """What served the request, as response headers (lower-case names, encoded)."""
    h = [(b"x-request-id", ctx.input.request_id.encode("latin-1"))]
    if ctx.input.client_request_id is not None:  # validated: ASCII
        h.append((b"x-client-request-id", ctx.input.client_request_id.encode("latin-1")))
    if ctx.cache is not None:
        h.append((b"x-switchyard-cache", ctx.cache.encode("latin-1")))
        cs = ctx.cache_state
        sim = cs.similarity if cs is not None else None
        if sim is not None and ctx.cache != CacheOutcome.HIT_EXACT:
            h.append((b"x-switchyard-cache-similarity", b"%.4f" % sim))
    if ctx.admission.rate_headers:
        # ASCII by construction (policy/admit.rate_headers: fixed names, numbers), so
        # the default codec gives latin-1's bytes without latin-1's lookup by name: a
        # dozen encodings per request (~3.7k instructions less with the list).
        h += [(k.encode(), v.encode()) for k, v in ctx.admission.rate_headers.items()]
    if ctx.route is not None:
        h.append((b"x-switchyard-route", ctx.route.encode("latin-1")))
        if ctx.route_score is not None:
            h.append((b"x-switchyard-route-score", b"%.4f" % ctx.route_score))
    if ctx.tools_blocked:
        h.append((b"x-switchyard-tools-blocked", b"%d" % ctx.tools_blocked))
    cost = ctx.cost
    if cost is not None and cost.reason is not None and ctx.run.attempts:
        # The output cap the gateway sent, and why: the client's was absent or too big.
        h.append((b"x-switchyard-max-tokens", b"%d; reason=%s" % (cost.cap, cost.reason.encode())))
    placed = ctx.placement
    if placed is not None:
        h.append((b"x-switchyard-placement", f"{placed.mode}; reason={placed.reason}".encode()))
    dep = ctx.deployment
    if dep is not None:
        h.extend(_deployment_headers(dep))
        h.append((b"x-switchyard-attempts", b"%d" % ctx.run.attempts))
        if ctx.run.fallback_from is not None:
            h.append(
                (
                    b"x-switchyard-fallback",
                    f"{ctx.run.fallback_from} -> {dep.alias}".encode("latin-1"),
                )
            )
    t = ctx.timings
    if t.upstream_sent is not None and t.upstream_first_byte is not None:
        now = time.perf_counter()
        gw = (t.upstream_sent - t.received) * 1000
        up = (t.upstream_first_byte - t.upstream_sent) * 1000
        total = (now - t.received) * 1000
        timing = b"gateway;dur=%.2f, upstream;dur=%.2f, total;dur=%.2f" % (gw, up, total)
        if ctx.admission.queue_ms:
            timing = b"queue;dur=%.2f, " % ctx.admission.queue_ms + timing
        if ctx.media_ms:
            media = ", ".join(f"media_{k};dur={v:.2f}" for k, v in ctx.media_ms.items())
            timing = media.encode("ascii") + b", " + timing
        h.append((b"server-timing", timing))
    return h


def served_headers(ctx: RequestContext) -> dict[str, str]:
    """`served_raw_headers` as a dict, for responses built from one."""
    return {k.decode("latin-1"): v.decode("latin-1") for k, v in served_raw_headers(ctx)}


def _switchyard_headers(raw: list[tuple[bytes, bytes]]) -> dict[str, str]:
    return {
        k.decode("latin-1"): v.decode("latin-1") for k, v in raw if k.startswith(b"x-switchyard")
    }


def switchyard_headers(raw: list[tuple[bytes, bytes]]) -> dict[str, str]:
    """The `x-switchyard-*` headers of a reply (what an idempotent replay repeats)."""
    return {
        k.decode("latin-1"): v.decode("latin-1") for k, v in raw if k.startswith(b"x-switchyard")
    }


class _Ended(msgspec.Struct):
    index: Any = None
    finish_reason: Any = None


class _Choices(msgspec.Struct):
    choices: list[_Ended] = []


_read_choices = msgspec.json.Decoder(_Choices).decode


def cut_choices(data: bytes) -> set[int]:
    """The indices of a chat completion's (or a stream chunk's) choices that ended with
    `length`; none when it is not in that shape."""
    try:
        choices = _read_choices(data).choices
    except msgspec.DecodeError:  # ValidationError too: choices not in the reply's shape
        return set()
    return {
        c.index if type(c.index) is int else -1 - k
        for k, c in enumerate(choices)
        if c.finish_reason == "length"
    }


# Whether a stream event's bytes may finish a choice (a `finish_reason` that is a
# string, not null), whatever the upstream's spacing. A text's quotes are escaped in
# its JSON, so only a member matches. A search costs about what the relay's other byte
# checks cost together (~3.5k instructions an event): a one-choice stream asks it only
# of its last events (`_TAIL`), a stream of several choices of every event until
# choice 0 has finished (its finish may come long before the others end).
_finishing = re.compile(rb'"finish_reason"\s*:\s*"').search
# The events before `[DONE]` that may hold a one-choice stream's finish: the finish
# chunk, the usage chunk (or both in one), a trailing event or two of an engine's own.
_TAIL = 4


def _finishes(data: bytes) -> bool:
    """Whether a stream event finishes choice 0: the first choice of index 0 (or of
    none, as `chunk_parts` reads it) has a `finish_reason` that is a non-empty string.
    Read only for the rare event whose bytes show a finish (`_finishing`)."""
    try:
        ended: list[Any] = _read_choices(data).choices
    except msgspec.ValidationError:  # choices not all objects: read as they are
        obj = reply_object(data)
        return obj is not None and _said_finish(first_choice(obj).get("finish_reason"))
    except msgspec.DecodeError:
        return False
    for c in ended:
        if _first(c.index):
            return _said_finish(c.finish_reason)
    return False


def _said_finish(finish: Any) -> bool:
    return type(finish) is str and finish != ""


def _error_event(data: bytes) -> bool:
    """Whether a stream event is an upstream's `error` object (an engine that broke off
    its answer mid-stream: vLLM, llama.cpp send one, then may send `[DONE]`)."""
    try:
        obj = orjson.loads(data)
    except orjson.JSONDecodeError:
        return False
    return type(obj) is dict and "error" in obj


# The data of the `[DONE]` event: what reply.relay passes on after the last chunk of
# a stream whose choice 0 never finished (the upstream's own end, relayed as it came).
DONE_DATA = b"[DONE]"


async def relay(
    ctx: RequestContext, data: AsyncIterator[list[bytes]], side: ReplySide | None, close: Any
) -> AsyncIterator[list[bytes]]:
    """A stream's lifecycle: the data of each upstream read's events, through the
    reply side, as the data to send in one write. The status is OK before the last
    write (which then carries the end), unless the upstream ended a stream that is not
    a whole answer: an `error` object then `[DONE]`, or `[DONE]` before choice 0 said
    it finished (no `finish_reason`: the answer is truncated), which are relayed as
    they came and recorded INCOMPLETE (the latter's `[DONE]` passed on as data,
    DONE_DATA: the translation ends both as broken); an upstream that broke off or the task's
    cancel ends it by raising the SwitchyardError the client is to be told, with the
    status set. The usage chunk that the gateway asked for on the client's behalf is
    dropped unless the client asked for it too. `close(complete)` ends the upstream
    call (a stream that did not finish drops the connection: the engine stops)."""
    done = False
    broken = False  # the upstream sent an `error` event: relayed, and not a success
    # Choice 0 said it finished (its `finish_reason`): `[DONE]` before that ends an
    # answer the engine never finished, a truncated one, not a success.
    finished = False
    tail: deque[bytes] = deque(maxlen=_TAIL)  # a one-choice stream's last events
    last = 0.0
    run = ctx.run
    include_usage = ctx.include_usage
    # Several sequences: the choices cut at their cap are noted (settle.proven_output),
    # since an engine's usage may count only one of them.
    proving = ctx.cost is not None and ctx.cost.sequences >= 2
    ctx.status = Status.STREAMING
    try:
        async for batch in data:
            out: list[bytes] = []
            for d in batch:
                if d == b"[DONE]":  # (a constant: DONE_DATA's global read, per event)
                    done = True
                    break
                if not proving:
                    tail.append(d)
                elif not finished and _finishing(d) is not None:
                    finished = _finishes(d)
                if proving and b'"length"' in d:
                    cut = cut_choices(d)
                    if cut:
                        run.cut = cut if run.cut is None else run.cut | cut
                # A text's quotes are escaped in its JSON: only a member is `"error"`.
                if b'"error"' in d and not broken:
                    broken = _error_event(d)
                for piece in side.event(d) if side is not None else (d,):
                    if b'"usage"' in piece:
                        try:
                            obj = orjson.loads(piece)
                        except orjson.JSONDecodeError:  # the upstream's: relayed as it came
                            obj = None
                        usage = obj.get("usage") if type(obj) is dict else None
                        if usage:  # checked where it is billed (usage.counts)
                            run.usage = usage
                            if not include_usage and not obj.get("choices"):
                                continue  # asked for by the gateway, not by the client
                    out.append(piece)
            if done and not proving:  # (once a stream) its finish among its last events,
                # newest first: the finish is usually the one before the usage chunk
                finished = any(_finishing(e) is not None and _finishes(e) for e in reversed(tail))
            unfinished = done and not broken and not finished
            if done:
                if side is not None:
                    out.extend(side.end(not broken))
                if broken or unfinished:  # relayed as it came, recorded as what it was
                    ctx.status, ctx.error_code = Status.INCOMPLETE, UpstreamError.code
                else:
                    ctx.status = Status.OK  # the end goes out in the same write
            run.chunks += len(out)
            if unfinished:
                # `[DONE]` passed on as data after the last chunk: a chat client gets
                # the bytes the upstream sent (api/sse.py `frame` adds no `[DONE]` of
                # its own to a stream that is not OK); a translated stream ends there
                # as broken (api/sse.py `translated`: the protocol's error events).
                out.append(DONE_DATA)
            if out or done:
                now = time.perf_counter()
                if ctx.timings.client_first_byte is None:
                    ctx.timings.client_first_byte = now
                else:
                    run.chunk_gaps.append(now - last)
                last = now
                yield out
            if done:
                break
        if not done:
            raise UpstreamError("the upstream ended the stream before it was complete")
    except SwitchyardError as exc:
        ctx.status = Status.INCOMPLETE
        ctx.error_code = exc.code  # what the client was told, in the ledger too
        raise
    except asyncio.CancelledError:
        if not ctx.cancelled:
            raise  # the client left, or shutdown
        # The task was cancelled (DELETE /v1/tasks/{id}): the client is told so, and
        # the upstream is closed below, so the engine stops generating.
        raise ctx.stopped_by_task() from None
    finally:
        if ctx.status == Status.STREAMING:
            ctx.status = Status.CANCELLED  # the client left before the end
        ctx.timings.ended = time.perf_counter()
        aclose = getattr(data, "aclose", None)
        if aclose is not None:
            await aclose()
        close(done)
