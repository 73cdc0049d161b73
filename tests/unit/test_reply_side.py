"""The request driver and the reply side, in process: in-memory state and a fake
engine behind the real gateway objects — no process, no file, no socket.

The property: one generated request, served once as a JSON reply and once as a
stream, gives the client the same text (PII restored the same way), records the same
decisions, writes the same usage row and stores the same cache entry. The reply
parts (tool gate, cache store, PII restore) and the stages' releases are the ones a
served gateway runs; only the engine is fake.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import orjson
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from switchyard.api.codecs import chat_completions
from switchyard.config import parse_settings
from switchyard.engines.upstream import UpstreamReply
from switchyard.gateway import Gateway
from switchyard.policy.auth import ANONYMOUS
from switchyard.reply import JsonReply, StreamReply, relay
from switchyard.state.ledger_rows import Finished

MODEL = "chat"
EMAIL = "jane.doe@example.com"


class FakeStream:
    """What the executor gets from a streaming upstream: the data of each read's
    events, then close()."""

    def __init__(self, chunks: list[bytes], split: int) -> None:
        self._chunks = chunks
        self._split = max(1, split)
        self.closed: bool | None = None

    async def data(self) -> AsyncIterator[list[bytes]]:
        for i in range(0, len(self._chunks), self._split):
            yield self._chunks[i : i + self._split]
        yield [b"[DONE]"]

    def close(self, complete: bool = False) -> None:
        self.closed = complete


class FakeEngine:
    """An OpenAI-compatible engine that answers with the last user message (as it was
    sent upstream: masked when the policy masks) and, when asked, a tool call."""

    def __init__(self, call: str | None, split: int) -> None:
        self.call = call
        self.split = split
        self.sent: list[dict[str, Any]] = []
        self.streams: list[FakeStream] = []

    async def close(self) -> None:  # the gateway closes its upstream clients on stop
        return None

    def _text(self, payload: bytes) -> str:
        body = orjson.loads(payload)
        self.sent.append(body)
        return f"You said: {body['messages'][-1]['content']}"

    def _usage(self, text: str) -> dict[str, int]:
        return {"prompt_tokens": 11, "completion_tokens": len(text) // 4 + 1, "total_tokens": 0}

    async def post(self, path: str, payload: bytes, *args: Any, **kwargs: Any) -> UpstreamReply:
        text = self._text(payload)
        message: dict[str, Any] = {"role": "assistant", "content": text}
        finish = "stop"
        if self.call is not None:
            message["content"] = None
            message["tool_calls"] = [_call(self.call)]
            finish = "tool_calls"
        reply = {
            "id": "chatcmpl-1",
            "object": "chat.completion",
            "created": 1,
            "model": MODEL,
            "choices": [{"index": 0, "message": message, "finish_reason": finish}],
            "usage": self._usage(text),
        }
        return UpstreamReply(200, orjson.dumps(reply), {"content-type": "application/json"})

    async def stream(self, path: str, payload: bytes, *args: Any, **kwargs: Any) -> FakeStream:
        text = self._text(payload)
        head = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": MODEL}

        def chunk(delta: dict[str, Any], finish: str | None = None) -> bytes:
            choice = {"index": 0, "delta": delta, "finish_reason": finish}
            return orjson.dumps({**head, "choices": [choice]})

        chunks = [chunk({"role": "assistant", "content": ""})]
        if self.call is not None:
            chunks.append(chunk({"tool_calls": [{"index": 0, **_call(self.call)}]}))
            chunks.append(chunk({}, "tool_calls"))
        else:
            # Pieces of 5 characters: a placeholder is split across chunks.
            chunks += [chunk({"content": text[i : i + 5]}) for i in range(0, len(text), 5)]
            chunks.append(chunk({}, "stop"))
        chunks.append(orjson.dumps({**head, "choices": [], "usage": self._usage(text)}))
        s = FakeStream(chunks, self.split)
        self.streams.append(s)
        return s


def _call(name: str) -> dict[str, Any]:
    return {
        "id": "call_1",
        "type": "function",
        "function": {"name": name, "arguments": '{"to": "x"}'},
    }


def _gateway(pii_mode: str, cache: bool, engine: FakeEngine) -> Gateway:
    raw: dict[str, Any] = {
        "models": [
            {
                "alias": MODEL,
                "revision": "r1",
                "engine": {"kind": "openai", "base_url": "http://127.0.0.1:9/v1"},
                "price": {"input": 1.0, "output": 2.0},
            }
        ],
        "embeddings": {"enabled": False},
        "auth": {"mode": "disabled", "bootstrap_dev_key": False},
        "storage": {"backend": "memory"},
        "pii": {"mode": pii_mode},
        "cache": {"enabled": cache, "semantic": False},
        "tools": {"check_outputs": True, "deny": ["send_email"]},
    }
    gw = Gateway(parse_settings(raw, "test"))
    for dep in gw.registry.every():
        dep.upstream = engine  # type: ignore[assignment]
    return gw


def _body(text: str, stream: bool, tools: bool) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": MODEL,
        "messages": [{"role": "user", "content": text}],
        "max_tokens": 32,
    }
    if tools:
        body["tools"] = [
            {"type": "function", "function": {"name": n, "parameters": {"type": "object"}}}
            for n in ("send_email", "lookup")
        ]
    if stream:
        body["stream"] = True
    return body


async def _serve(gw: Gateway, body: dict[str, Any]) -> tuple[str, Any]:
    """(what the client read, the settled Finished) of one request, driven through
    the request driver as the HTTP layer drives it."""
    seen: list[Finished] = []
    record = gw.ledger.record
    gw.ledger.record = lambda f: (seen.append(f), record(f))[1]  # type: ignore[method-assign]
    raw = orjson.dumps(body)

    async def read(_remaining: float) -> tuple[Any, bytes | None]:
        req, exact = chat_completions().decode(orjson.loads(raw))
        return req, raw if exact else None

    svc = gw.service
    ctx = svc.open("chat.completions", {}, time.perf_counter(), ANONYMOUS)
    reply = await svc.generate(ctx, read)
    if isinstance(reply, JsonReply):
        if reply.settle is not None:
            pending = reply.settle()
            if pending is not None:
                await pending
        obj = orjson.loads(reply.body)
        msg = obj["choices"][0]["message"]
        text = msg.get("content") or ""
        calls = [c["function"]["name"] for c in msg.get("tool_calls") or []]
    else:
        assert isinstance(reply, StreamReply) and reply.source is not None
        text, calls = "", []
        async for batch in relay(ctx, reply.source.data(), reply.side, reply.source.close):
            for d in batch:
                for c in orjson.loads(d).get("choices") or []:
                    delta = c.get("delta") or {}
                    text += delta.get("content") or ""
                    calls += [t["function"]["name"] for t in delta.get("tool_calls") or []]
        await reply.on_close()
    await gw.service.settler.settled()
    (finished,) = seen
    return f"{text}|{calls}", finished


def _normal(value: Any) -> Any:
    """Evidence without what differs between two runs of one request (timings)."""
    if isinstance(value, dict):
        return {k: _normal(v) for k, v in value.items() if not k.endswith(("_ms", "_s", "_at"))}
    if isinstance(value, list | tuple):
        return [_normal(v) for v in value]
    return value


def _record(f: Finished) -> dict[str, Any]:
    e = f.entry()
    row = {
        k: getattr(e, k)
        for k in (
            "endpoint",
            "model",
            "requested_model",
            "revision",
            "upstream",
            "status",
            "error_code",
            "attempts",
            "input_tokens",
            "output_tokens",
            "cost_usd",
            "cache",
            "fallback_from",
        )
    }
    ctx = f.ctx
    # The window's estimate counts the body's characters: `"stream": true` adds some.
    row["decisions"] = [
        (d[0], d[1], d[2], _normal(d[3]) if d[0] != "window" else None) for d in ctx.decisions
    ]
    row["blocks"] = [(b, i, n) for b, i, n in ctx.blocks]
    return row


def _cache_entries(gw: Gateway) -> list[bytes]:
    cache = gw.cache
    if cache is None:
        return []
    return sorted(e.body for e in cache.entries())


TEXTS = st.sampled_from(
    [
        "hello there",
        f"mail {EMAIL} please",
        f"{EMAIL}",
        "what is 2 + 2?",
        f"two: {EMAIL} and bob@example.org, thanks",
    ]
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    text=TEXTS,
    pii_mode=st.sampled_from(["observe_only", "mask_upstream"]),
    cache=st.booleans(),
    call=st.sampled_from([None, "send_email", "lookup"]),
    split=st.integers(1, 4),
)
def test_json_and_stream_give_the_same_reply_record_and_cache_entry(
    text: str, pii_mode: str, cache: bool, call: str | None, split: int
) -> None:
    async def both() -> tuple[Any, Any]:
        out = []
        for stream in (False, True):
            engine = FakeEngine(call, split)
            gw = _gateway(pii_mode, cache, engine)
            gw.start()
            try:
                client, finished = await _serve(gw, _body(text, stream, call is not None))
                out.append((client, _record(finished), _cache_entries(gw), engine))
            finally:
                await gw.stop()
        return out[0], out[1]

    (j_client, j_row, j_cache, j_engine), (s_client, s_row, s_cache, s_engine) = asyncio.run(both())
    assert j_client == s_client
    assert j_row == s_row
    assert j_cache == s_cache
    # What went upstream is what policy checked, both ways (masked in mask_upstream).
    sent = [m["messages"][-1]["content"] for m in j_engine.sent]
    assert sent == [m["messages"][-1]["content"] for m in s_engine.sent]
    if pii_mode == "mask_upstream" and EMAIL in text:
        assert EMAIL not in sent[0]
        if call is None:
            assert EMAIL in j_client  # restored for the client, whole or split in chunks
    for entry in j_cache:
        assert EMAIL.encode() not in entry  # never a raw value at rest
    if call == "send_email":  # denied: removed, in the reply and in the stream
        assert "send_email" not in j_client
        assert ("tool_calls", "blocked") in [(d[0], d[1].split(":")[0]) for d in j_row["decisions"]]
    assert all(s.closed for s in s_engine.streams)  # the stream ended complete


def test_a_refusal_releases_what_the_stages_took() -> None:
    """A request that fails after admission (here: the engine raises) gives its
    deployment slot back through the queue stage's release."""

    class Broken(FakeEngine):
        async def post(self, *args: Any, **kwargs: Any) -> UpstreamReply:
            raise RuntimeError("engine crashed")

    async def run() -> tuple[int, str]:
        engine = Broken(None, 1)
        gw = _gateway("observe_only", False, engine)
        gw.start()
        try:
            try:
                await _serve(gw, _body("hello", False, False))
            except Exception as exc:  # the driver re-raises for the HTTP layer
                err = type(exc).__name__
            gate = gw.gates[MODEL]
            return gate.in_flight, err
        finally:
            await gw.stop()

    in_flight, err = asyncio.run(run())
    assert err == "RuntimeError"
    assert in_flight == 0
