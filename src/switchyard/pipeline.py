"""The request pipeline: one `RequestContext` passed through explicit stages.

Each stage records a `Decision` on the context and may end the request by raising a
`SwitchyardError` (reject) or by setting `ctx.response` (e.g. a cache hit). Stages
that are still pass-throughs record that they were skipped, so later capabilities slot
in without rewiring and the decision trace always has the same shape.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from switchyard.config import ModelConfig
    from switchyard.engines.registry import Deployment


class RequestIds:
    """The gateway's own request ids, ordered in time and unguessable, as UUIDv7 is:
    the milliseconds since the epoch (12 hex digits), then 80 random bits from the OS's
    CSPRNG. Nobody can predict the next id or derive one from another; and since ids
    grow with time, the ledger's primary-key index takes each one at its right edge
    (random keys scattered every insert over the whole B-tree: measurably more work
    for the ledger writer at load). The random bits are read 256 ids at a time, one
    `os.urandom` call per 256 requests. The client's own id is kept beside it
    (`client_request_id`), never in its place: the gateway's id is the ledger's key."""

    _BATCH = 256

    def __init__(self) -> None:
        self._pool = b""
        self._at = 0

    def __call__(self) -> str:
        at = self._at
        if at >= len(self._pool):
            self._pool, at = secrets.token_bytes(10 * self._BATCH), 0
        self._at = at + 10
        return f"req_{int(time.time() * 1000):012x}{self._pool[at : at + 10].hex()}"


def new_request_id() -> str:
    """A one-off id (error paths before a gateway exists); see RequestIds."""
    return f"req_{int(time.time() * 1000):012x}{secrets.token_hex(10)}"


# One stage's verdict: (stage, outcome, reason, evidence, t0, t1), where t0 is the
# perf_counter time the stage began and t1 when it decided; the wall-clock form is
# derived when the trace is read, off the request's path. A plain tuple: a request
# records about fourteen, and a tuple is built ~3x faster than a slotted dataclass
# and goes into the stored trace as it is.
Decision = tuple[str, str, str, dict[str, Any] | None, float, float]


def decision_dict(d: Decision, base: float) -> dict[str, Any]:
    """The documented form of a decision, given `base` = received_at - timings.received
    of its request (`RequestContext.clock_base`)."""
    stage, outcome, reason, evidence, t0, t1 = d
    return {
        "stage": stage,
        "outcome": outcome,
        "reason": reason,
        "evidence": evidence if evidence is not None else {},
        "started_at": base + t0,
        "duration_ms": round((t1 - t0) * 1000.0, 3),
    }


@dataclass(slots=True)
class Timings:
    """Monotonic timestamps (perf_counter seconds) of one request's milestones."""

    received: float
    upstream_sent: float | None = None
    upstream_first_byte: float | None = None
    client_first_byte: float | None = None
    ended: float | None = None


@dataclass(slots=True)
class RequestContext:
    request_id: str
    endpoint: str  # "chat.completions" | "completions" | "embeddings"
    body: dict[str, Any]  # replaced (never edited in place) by stages that change it
    received_at: float  # unix seconds
    timings: Timings
    deadline: float  # perf_counter seconds
    task_id: str | None = None
    parent_request_ids: list[str] = field(default_factory=list)
    principal: Any = None  # set by authentication (policy layer)
    headers: Any = None  # the client's request headers
    alias: str | None = None
    model: ModelConfig | None = None
    deployment: Deployment | None = None
    stream: bool = False
    include_usage: bool = False
    response: Any = None  # set by a stage that answers without an upstream call
    decisions: list[Decision] = field(default_factory=list)
    status: str = "pending"
    usage: dict[str, Any] | None = None
    attempts: int = 0
    error_code: str | None = None
    chunks: int = 0  # content events relayed to the client
    prompt_estimate: int = 0
    max_tokens: int = 0
    fallback_from: str | None = None
    cache: str | None = None  # cache / replay outcome for the ledger
    idempotency_key: str | None = None  # set while this request owns the key
    planned_steps: int | None = None  # x-task-planned-steps, for task accounting
    chunk_gaps: list[float] = field(default_factory=list)  # seconds between streamed writes
    otel_span: Any = None  # the request's OpenTelemetry span, when tracing is on
    vector: Any = None  # embedding of the (masked) last user message, shared by cache & router
    cache_keys: Any = None  # CacheKeys when the reply may be stored
    cache_similarity: float | None = None
    cache_plan: Any = None  # (Cacheability, CacheKeys) once worked out for this request
    shadow_entry: Any = None  # the would-be hit in shadow mode
    collected: list[bytes] | None = None  # streamed data events kept for the cache
    pii: Any = None  # the request's PII mask session (mapping held only here)
    masked_body: dict[str, Any] | None = None  # what cache keys, embeddings, traces see
    restore_pii: bool = False  # placeholders in the reply go back to the raw values
    route: str | None = None
    route_score: float | None = None
    queue_ms: float | None = None
    reservations: list[tuple[Any, Any]] = field(default_factory=list)  # (scopes, Ask)
    rate_headers: dict[str, str] = field(default_factory=dict)
    gate: Any = None  # the deployment slot held, released at settle
    finished: bool = False
    wire: tuple[dict[str, Any], bytes] | None = None  # (parsed body, the bytes it came from)
    reply_body: bytes | None = None  # a non-streamed reply whose usage is read at settle
    # (block id, index of its first decision) when a run of decisions is one of the
    # ledger's known blocks (traces.BLOCK_STAGES): stored compactly, expanded on write.
    block: tuple[int, int] | None = None
    client_request_id: str | None = None  # the client's own id (x-client-request-id)
    header_error: Any = None  # an InvalidRequest for a header, raised once ctx exists

    def record(
        self,
        stage: str,
        outcome: str,
        reason: str,
        started: float,
        evidence: dict[str, Any] | None = None,
    ) -> None:
        """Append a decision for a stage that began at perf_counter time `started`."""
        self.decisions.append((stage, outcome, reason, evidence, started, time.perf_counter()))

    @property
    def clock_base(self) -> float:
        """Add to a perf_counter time of this request to get unix seconds."""
        return self.received_at - self.timings.received

    def remaining_s(self) -> float:
        return self.deadline - time.perf_counter()


# A stage either decides synchronously (returns None) or returns an awaitable; stages
# that never wait are plain functions, which saves a coroutine per stage per request.
Stage = Callable[[RequestContext], Awaitable[None] | None]


class Pipeline:
    """Runs the decision stages in order; stops early when a stage answers."""

    def __init__(self, stages: Sequence[tuple[str, Stage]]) -> None:
        self.stages = list(stages)

    @property
    def names(self) -> list[str]:
        return [name for name, _ in self.stages]

    async def decide(self, ctx: RequestContext) -> None:
        for _name, stage in self.stages:
            pending = stage(ctx)
            if pending is not None:
                await pending
            if ctx.response is not None:
                return
