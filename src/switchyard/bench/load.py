"""Sending requests: one pooled streaming client, and the closed- and open-loop drivers.

Closed loop: N workers, each sends its next request when its previous one returns, so the
offered load falls when the server slows down. Open loop: requests go out at times fixed
by an arrival schedule whether or not earlier ones have returned, so a server past its
capacity shows a growing queue instead of a politely slower client (no coordinated
omission). Each open-loop record keeps its scheduled and its actual send time; their
difference (send lag) shows when the harness itself could not keep up.

The drivers know nothing about requests: they call a `Job(index, scheduled_s, warmup)`,
which is one request for plain workloads and one whole task for agent workloads.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable, Coroutine, Iterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson

from switchyard.bench.metrics import RequestRecord
from switchyard.bench.workloads import RequestSpec

# Response headers worth keeping per request: they say who answered and how.
KEPT_HEADERS = (
    "x-request-id",
    "x-switchyard-model",
    "x-switchyard-revision",
    "x-switchyard-upstream",
    "x-switchyard-attempts",
    "x-switchyard-fallback",
    "x-switchyard-cache",
    "server-timing",
)

Job = Callable[[int, float | None, bool], Coroutine[Any, Any, None]]


class Clock:
    """Seconds since the run began (monotonic), plus the wall-clock time of that zero so
    records can be lined up with the gateway's traces."""

    def __init__(self) -> None:
        self.t0 = time.perf_counter()
        self.unix0 = time.time()

    def now(self) -> float:
        return time.perf_counter() - self.t0


@dataclass(slots=True)
class Target:
    """Where and how to send: the endpoint, model and everything that shapes a request."""

    endpoint: str
    model: str
    api_key: str | None = None
    api: str = "chat"  # chat | completions
    timeout_s: float = 300.0
    include_usage: bool = True
    sampling: dict[str, Any] = field(default_factory=dict)
    headers: dict[str, str] = field(default_factory=dict)

    @property
    def url(self) -> str:
        base = self.endpoint.rstrip("/")
        base = base.removesuffix("/v1")
        return base + ("/v1/chat/completions" if self.api == "chat" else "/v1/completions")


class Client:
    """One aiohttp session with an unbounded pool: a pool limit would queue requests in
    the client, hiding exactly the server queue an open-loop run is meant to show."""

    def __init__(self, target: Target, clock: Clock) -> None:
        self.target, self.clock = target, clock
        self.session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> Client:
        self.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, ttl_dns_cache=300),
            timeout=aiohttp.ClientTimeout(total=self.target.timeout_s),
        )
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self.session is not None:
            await self.session.close()

    def body(self, spec: RequestSpec) -> dict[str, Any]:
        t = self.target
        body: dict[str, Any] = {"model": t.model, "max_tokens": spec.max_tokens, "stream": True}
        if t.api == "chat":
            body["messages"] = spec.messages
        else:
            body["prompt"] = spec.prompt_text
        if t.include_usage:
            body["stream_options"] = {"include_usage": True}
        return body | t.sampling

    async def send(
        self, spec: RequestSpec, rec: RequestRecord, headers: dict[str, str] | None = None
    ) -> None:
        """Send one streaming request and fill `rec` in; never raises for request failures."""
        assert self.session is not None, "use the client as an async context manager"
        # The harness's id goes as the client's own; a gateway answers with its own id,
        # which then names the record (what its traces and x-parent-request-id use).
        h = {"content-type": "application/json", "x-client-request-id": rec.request_id}
        if self.target.api_key:
            h["authorization"] = f"Bearer {self.target.api_key}"
        h |= self.target.headers | (headers or {})
        data = orjson.dumps(self.body(spec))
        rec.max_tokens, rec.input_len, rec.prompt_text = (
            spec.max_tokens,
            spec.input_len,
            spec.prompt_text,
        )
        rec.sent_s = self.clock.now()
        try:
            async with self.session.post(self.target.url, data=data, headers=h) as resp:
                rec.status = resp.status
                rec.headers = {k: resp.headers[k] for k in KEPT_HEADERS if k in resp.headers}
                gateway_id = rec.headers.get("x-request-id")
                if gateway_id and resp.headers.get("x-client-request-id") == rec.request_id:
                    rec.request_id = gateway_id
                if resp.status != 200:
                    raw = await resp.read()
                    rec.error, rec.error_detail = f"http_{resp.status}", _message(raw)
                    rec.error_code = _code(raw)
                else:
                    await self._read_stream(resp, rec)
        except TimeoutError:
            rec.error = "timeout"
        except aiohttp.ClientConnectorError as exc:
            rec.error, rec.error_detail = "connect", str(exc)
        except (aiohttp.ServerDisconnectedError, aiohttp.ClientPayloadError) as exc:
            rec.error, rec.error_detail = "disconnect", str(exc)
        except aiohttp.ClientError as exc:
            rec.error, rec.error_detail = "client_error", f"{type(exc).__name__}: {exc}"
        except orjson.JSONDecodeError as exc:
            rec.error, rec.error_detail = "bad_stream", str(exc)
        rec.end_s = self.clock.now()
        rec.ok = rec.error is None

    async def _read_stream(self, resp: aiohttp.ClientResponse, rec: RequestRecord) -> None:
        """Parse SSE events as bytes arrive; every event completed by one network read gets
        that read's arrival time."""
        chat = self.target.api == "chat"
        buf, parts, done = b"", [], False
        async for data in resp.content.iter_any():
            t = self.clock.now()
            buf += data
            if b"\r" in buf:
                buf = buf.replace(b"\r\n", b"\n")
            *events, buf = buf.split(b"\n\n")
            for event in events:
                for line in event.split(b"\n"):
                    if not line.startswith(b"data:"):
                        continue
                    payload = line[5:].strip()
                    if payload == b"[DONE]":
                        done = True
                        continue
                    obj = orjson.loads(payload)
                    if not isinstance(obj, dict):
                        continue
                    if obj.get("error"):
                        rec.error, rec.error_detail = "stream_error", str(obj["error"])[:300]
                    piece = _content(obj, chat)
                    if piece:
                        if rec.first_token_s is None:
                            rec.first_token_s = t
                        rec.chunk_s.append(t)
                        parts.append(piece)
                    usage = obj.get("usage")
                    if isinstance(usage, dict) and usage.get("completion_tokens") is not None:
                        rec.output_tokens = int(usage["completion_tokens"])
                        rec.input_tokens = int(usage.get("prompt_tokens") or 0)
                        rec.token_source = "server"
        rec.text = "".join(parts)
        if not done and rec.error is None:
            rec.error = "incomplete_stream"


def _content(obj: dict[str, Any], chat: bool) -> str:
    out = ""
    for choice in obj.get("choices") or []:
        if chat:
            delta = choice.get("delta") or {}
            out += (delta.get("content") or "") + (delta.get("reasoning_content") or "")
        else:
            out += choice.get("text") or ""
    return out


def _code(raw: bytes) -> str | None:
    """The error body's `code` (OpenAI's shape), or None."""
    try:
        code = orjson.loads(raw)["error"]["code"]
    except Exception:
        return None
    return str(code) if code is not None else None


def _message(raw: bytes) -> str:
    try:
        return str(orjson.loads(raw)["error"]["message"])[:300]
    except Exception:
        return raw[:300].decode(errors="replace")


# --- arrivals ------------------------------------------------------------------------


def arrivals(
    rate: float, kind: str, burstiness: float, seed: int, ramp_up_s: float = 0.0
) -> Iterator[float]:
    """Scheduled send times (s) for rate `rate`/s. Gaps are gamma-distributed with shape
    `burstiness` and mean 1/rate (shape 1 is Poisson; lower is burstier), or constant.
    With a ramp-up the rate rises linearly from 0 to `rate` over `ramp_up_s`: arrivals of
    the steady process are mapped through the inverse of the ramped cumulative rate."""
    if rate <= 0:
        raise ValueError("rate must be positive")
    rng = random.Random(seed)
    s = 0.0
    while True:
        if ramp_up_s > 0 and s < ramp_up_s / 2:
            yield (2 * ramp_up_s * s) ** 0.5
        else:
            yield s + ramp_up_s / 2
        if kind == "constant":
            s += 1 / rate
        else:
            s += rng.gammavariate(burstiness, 1 / (rate * burstiness))


@dataclass(slots=True)
class _Budget:
    """When to stop: after `num` measured jobs, or `duration_s` after the first one."""

    warmup: int
    num: int | None
    duration_s: float | None
    ramp_up_s: float
    issued: int = 0
    measured: int = 0
    start: float | None = None

    def take(self, t: float) -> bool | None:
        """Claim the next job at time `t`: True for warm-up, False for measured, None when
        the run is over."""
        warm = self.issued < self.warmup or t < self.ramp_up_s
        if not warm:
            if self.num is not None and self.measured >= self.num:
                return None
            if self.start is None:
                self.start = t
            elif self.duration_s is not None and t - self.start >= self.duration_s:
                return None
            self.measured += 1
        self.issued += 1
        return warm


async def open_loop(
    job: Job,
    schedule: Iterator[float],
    clock: Clock,
    warmup: int,
    num: int | None,
    duration_s: float | None,
    ramp_up_s: float = 0.0,
) -> None:
    """Start each job at its scheduled time, never waiting for earlier ones."""
    budget = _Budget(warmup, num, duration_s, ramp_up_s)
    running: set[asyncio.Task[None]] = set()
    for at in schedule:
        warm = budget.take(at)
        if warm is None:
            break
        delay = at - clock.now()
        if delay > 0:
            await asyncio.sleep(delay)
        task = asyncio.create_task(job(budget.issued - 1, at, warm))
        running.add(task)
        task.add_done_callback(running.discard)
    await asyncio.gather(*list(running))


async def closed_loop(
    job: Job,
    concurrency: int,
    clock: Clock,
    warmup: int,
    num: int | None,
    duration_s: float | None,
    ramp_up_s: float = 0.0,
) -> None:
    """`concurrency` workers, each starting its next job when the last one ends; with a
    ramp-up, worker k starts at k/concurrency of it."""
    budget = _Budget(warmup, num, duration_s, ramp_up_s)

    async def worker(k: int) -> None:
        if ramp_up_s > 0:
            await asyncio.sleep(ramp_up_s * k / concurrency)
        while (warm := budget.take(clock.now())) is not None:
            await job(budget.issued - 1, None, warm)

    await asyncio.gather(*(worker(k) for k in range(concurrency)))
