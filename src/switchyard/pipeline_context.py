"""The request context: one request's record as it passes the pipeline.

What the request is, fixed when it opens (`RequestInput`), and what the stages, the
executor and settle work out for it (`RequestContext`, with its parts `Timings`,
`CacheState`, `PiiState`, `AdmissionState`, `ExecutionState`); the decision each stage
records on it (`Decision`, read back as `decision_dict`); how it ended (`Status`,
`CacheOutcome`); and the gateway's request ids. The stages and the pipeline that
passes the context through them are in pipeline.py, which re-exports every name here.

Every record here is a msgspec struct rather than a dataclass: each request builds a
context, its input, timings, admission and execution state, and a struct's `__init__`
is native code (with dataclasses that was about four times the instructions).
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import Iterator, Mapping
from enum import StrEnum
from typing import TYPE_CHECKING, Any

import msgspec

from switchyard.aio import Receive
from switchyard.entropy import RandomPool
from switchyard.errors import TaskCancelled
from switchyard.identity import ANONYMOUS, Principal
from switchyard.outcomes import Outcome, Task
from switchyard.request import Embedding, Generation

if TYPE_CHECKING:  # annotations only: these live in the layers above (pyproject.toml)
    import numpy as np
    from opentelemetry.trace import Span

    from switchyard.config import ModelConfig
    from switchyard.decide.balance import Balancer
    from switchyard.decide.cache import CacheKeys, Entry
    from switchyard.decide.cacheability import Cacheability
    from switchyard.decide.placement import Placement
    from switchyard.engines.llamacpp import ManagedLlamaCpp
    from switchyard.engines.registry import Deployment
    from switchyard.engines.revisions import Lease
    from switchyard.errors import InvalidRequest
    from switchyard.policy.admission import DeploymentGate
    from switchyard.policy.cost import Cost
    from switchyard.policy.pii import MaskSession
    from switchyard.policy.tasks import TaskHold
    from switchyard.state.limits import Ask, ScopeLimits
    from switchyard.state.tasks import ToolCallNote


class RequestIds:
    """The gateway's own request ids, ordered in time and unguessable, as UUIDv7 is:
    the milliseconds since the epoch (12 hex digits), then 80 random bits from the OS's
    CSPRNG. Nobody can predict the next id or derive one from another; and since ids
    grow with time, the ledger's primary-key index takes each one at its right edge
    (random keys scattered every insert over the whole B-tree: measurably more work
    for the ledger writer at load). The random bits come from a pool (entropy.py: one
    `getrandom` per few hundred requests). The client's own id is kept beside it
    (`client_request_id`), never in its place: the gateway's id is the ledger's key."""

    def __init__(self) -> None:
        self._random = RandomPool()

    def __call__(self) -> str:
        return f"req_{int(time.time() * 1000):012x}{self._random.take(10).hex()}"


def new_request_id() -> str:
    """A one-off id (error paths before a gateway exists); see RequestIds."""
    return f"req_{int(time.time() * 1000):012x}{secrets.token_hex(10)}"


class Decision(msgspec.Struct, array_like=True, gc=False):
    """One stage's verdict. `t0` is the perf_counter time the stage began and `t1`
    when it decided; the wall-clock form is derived when the trace is read, off the
    request's path (`decision_dict`). A msgspec struct, encoded as the JSON array
    `[stage, outcome, reason, evidence, t0, t1]` (the stored trace's form), built about
    as fast as a tuple (a request records about fourteen) and never tracked by the
    collector (`gc=False`: it holds no reference back to anything that holds it)."""

    stage: str
    # Recorded as an `outcomes.Outcome` (its stage's enum member, or a tagged one such
    # as "route:reasoning", "reject:rpm"); the same plain string once read back.
    outcome: str
    reason: str  # human readable
    evidence: dict[str, Any] | None  # scores, candidates, thresholds; shared, never changed
    t0: float
    t1: float

    def __iter__(self) -> Iterator[Any]:
        """Unpacks as the stored array does (tests and tools read it so)."""
        return iter((self.stage, self.outcome, self.reason, self.evidence, self.t0, self.t1))

    def __getitem__(self, i: int) -> Any:
        return (self.stage, self.outcome, self.reason, self.evidence, self.t0, self.t1)[i]


def decision_dict(d: Decision | list[Any], base: float) -> dict[str, Any]:
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


class Status(StrEnum):
    """How a request ended (the ledger's `status`; pending and streaming while it runs)."""

    PENDING = "pending"
    STREAMING = "streaming"
    OK = "ok"
    ERROR = "error"
    INCOMPLETE = "incomplete"  # the upstream's stream broke off
    CANCELLED = "cancelled"  # the client left before the end


class CacheOutcome(StrEnum):
    """What the response cache (or an idempotency replay) did for a request."""

    HIT_EXACT = "hit-exact"
    HIT_SEMANTIC = "hit-semantic"
    MISS = "miss"
    BYPASS = "bypass"
    SHADOW_HIT = "shadow-hit"  # would have hit; the model answered (shadow mode)
    REPLAY = "idempotent_replay"


class CacheState(msgspec.Struct):
    """What the embed and cache stages worked out for a request, for the rest of it."""

    plan: tuple[Cacheability, CacheKeys | None] | None = None  # worked out once
    store_keys: CacheKeys | None = None  # when the reply may be stored
    similarity: float | None = None  # of the entry that hit (or would have)
    shadow_entry: Entry | None = None  # the would-be hit in shadow mode
    shadow_semantic: bool = False  # ...found by similarity (not an exact match)

    @property
    def wants_reply(self) -> bool:
        """The reply is to be stored, or compared with a shadow hit."""
        return self.store_keys is not None or self.shadow_entry is not None


class PiiState(msgspec.Struct):
    """What the pii stage leaves for the rest of the request."""

    session: MaskSession  # the placeholder mapping is held only here
    masked: Generation  # the request as cache keys, embeddings and the router see it
    restore: bool  # the upstream saw placeholders: the reply gets the raw values back
    found: dict[str, int] = {}  # PII kinds found, and how many


class Timings(msgspec.Struct):
    """Monotonic timestamps (perf_counter seconds) of one request's milestones."""

    received: float
    upstream_sent: float | None = None
    upstream_first_byte: float | None = None
    client_first_byte: float | None = None
    ended: float | None = None


class RequestInput(msgspec.Struct, frozen=True):
    """What the request is, read once when it opens and fixed for its life: the
    gateway's id, the endpoint, when it arrived and the client's headers with the
    values read from them (each bounded by `api.headers` as it was read). Stages may
    not change it (frozen); what they decide goes into the context or a record."""

    request_id: str
    endpoint: str  # "chat.completions" | "completions" | "embeddings"
    received_at: float  # unix seconds
    headers: Mapping[str, str] = {}  # the client's request headers
    task_id: str | None = None  # x-task-id
    parent_request_ids: tuple[str, ...] = ()  # x-parent-request-id
    client_request_id: str | None = None  # the client's own id (x-client-request-id)
    planned_steps: int | None = None  # x-task-planned-steps, for task accounting
    # The endpoint as the client called it when its protocol's codec decodes into
    # another's request ("messages" -> "chat.completions"); None = `endpoint`. The
    # ledger, traces and metrics name this one; the stages read `endpoint`.
    api: str | None = None

    @property
    def called(self) -> str:
        """The endpoint the client called (what the ledger and traces record)."""
        return self.api or self.endpoint


class AdmissionState(msgspec.Struct):
    """The admit, deployment-limit and queue stages' state: what this request holds
    until it is settled."""

    # (scopes, Ask, the stage that reserved): each stage settles its own on release
    reservations: list[tuple[list[ScopeLimits], Ask, str]] = []
    rate_headers: dict[str, str] = {}  # x-ratelimit-* to send
    gate: DeploymentGate | None = None  # the deployment slot held, released at settle
    queue_ms: float | None = None  # time spent waiting for that slot
    priority: int = 1  # its scheduling class (identity.PRIORITY_NAMES), as the queue took it
    # (engine, adapter name or None) held in the pool (residency), released at settle
    resident: tuple[ManagedLlamaCpp, str | None] | None = None
    # The lease on an RL-managed model's active revision (engines/revisions.py)
    lease: Lease | None = None
    # (balancer, deployment) when select balanced among several: in flight until settle
    balanced: tuple[Balancer, Deployment] | None = None
    # (balancer, deployment, whether an attempt was made) the request left for another
    # deployment: each settled as a failure
    left: list[tuple[Balancer, Deployment, bool]] = []


class ExecutionState(msgspec.Struct):
    """The executor's account of the upstream calls it made for this request, and
    what the request is charged once settled (`tokens_in`, `tokens_out`, `cost_usd`:
    the stages' releases settle reservations with them)."""

    attempts: int = 0
    fallback_from: str | None = None  # the alias the request was first sent to
    chunks: int = 0  # content events relayed to the client
    chunk_gaps: list[float] = []  # seconds between streamed writes
    usage: dict[str, Any] | None = None  # the upstream's usage object, once read
    reply_body: bytes | None = None  # a non-streamed reply whose usage is read at settle
    # A stream of several sequences: the choice indices it showed ending at `length`
    # (reply.relay; settle.proven_output bills each at its cap)
    cut: set[int] | None = None
    tokens_in: int = 0
    tokens_out: int = 0
    cost_usd: float = 0.0


class RequestContext(msgspec.Struct):
    input: RequestInput
    # The request as its protocol's codec decoded it (request.py); replaced, never
    # changed in place, by a stage that changes it.
    request: Generation | Embedding
    timings: Timings
    deadline: float  # perf_counter seconds
    principal: Principal = ANONYMOUS  # set by authentication (policy layer)
    alias: str | None = None
    pin: str | None = None  # the revision named as `alias@revision`
    model: ModelConfig | None = None
    deployment: Deployment | None = None
    stream: bool = False  # the request's `stream`
    include_usage: bool = False  # its `stream_options.include_usage`
    response: Entry | None = None  # a cached reply that answers (the cache stage)
    decisions: list[Decision] = []
    status: Status = Status.PENDING
    error_code: str | None = None
    prompt_estimate: int = 0
    max_tokens: int = 0  # the output cap per sequence, as sent upstream
    cost: Cost | None = None  # the request's prompt, sequences and cap
    cache: CacheOutcome | None = None  # cache / replay outcome for the ledger
    idempotency_key: str | None = None  # set while this request owns the key
    otel_span: Span | None = None  # the request's OpenTelemetry span, when tracing is on
    task: TaskHold | None = None  # the task's hold until settle
    task_deployments: dict[str, str] | None = None  # the task's deployment per alias
    # A Responses continuation: (the previous response's id, the deployment that served
    # it); select keeps it there while that deployment is eligible (affinity "response")
    previous: tuple[str, str | None] | None = None
    cancelled: bool = False  # its task was cancelled while it ran
    tools_blocked: int = 0  # tool calls removed from the reply (tools.on_forbidden_call)
    tool_notes: list[ToolCallNote] | None = None  # the reply's calls, for the task
    vector: np.ndarray | None = None  # the (masked) last user message's, for cache & router
    cache_state: CacheState | None = None  # set once the cache stages looked at it
    pii: PiiState | None = None  # set by the pii stage when it masked the request
    route: str | None = None
    route_score: float | None = None
    placement: Placement | None = None  # for an alias with a placement policy
    admission: AdmissionState = msgspec.field(default_factory=AdmissionState)
    run: ExecutionState = msgspec.field(default_factory=ExecutionState)
    finished: bool = False
    # (the request as decoded, the bytes it was decoded from when they are exactly it,
    # else None): while `request` is still that one, those bytes can go upstream.
    wire: tuple[Generation | Embedding, bytes | None] | None = None
    # (block id, index of its first decision, count) of each folded run of static
    # verdicts (Pipeline): stored compactly in the ledger, expanded on write.
    blocks: list[tuple[str, int, int]] = []
    media_ms: dict[str, float] | None = None  # the media stage's time per step
    media_shape: tuple[int, int, int, int] | None = None  # images, bytes, pixels in/out
    header_error: InvalidRequest | None = None  # a bad header's, raised once ctx exists
    # A foreground request's ASGI `receive` (its body read): a wait that may be long
    # (the queue) watches it and ends once the client has hung up; None: nobody waits.
    receive: Receive | None = None

    def record(
        self,
        stage: str,
        outcome: Outcome,
        reason: str,
        started: float,
        evidence: dict[str, Any] | None = None,
    ) -> None:
        """Append a decision for a stage that began at perf_counter time `started`."""
        self.decisions.append(
            Decision(stage, outcome, reason, evidence, started, time.perf_counter())
        )

    def succeeded(self) -> None:
        """Its work is done and it succeeded (its reply may still be on its way)."""
        self.status = Status.OK
        self.timings.ended = time.perf_counter()

    def stopped_by_task(self) -> TaskCancelled:
        """Record that this call's task was cancelled while it streamed, take back the
        cancellation that stopped the stream, and return the error the client is told."""
        current = asyncio.current_task()
        if current is not None and current.cancelling():
            current.uncancel()
        self.status = Status.CANCELLED
        self.error_code = TaskCancelled.code
        self.record(
            "task",
            Task.STOPPED,
            "the task was cancelled while this call streamed",
            time.perf_counter(),
        )
        return TaskCancelled(
            f"the task '{self.input.task_id}' was cancelled while this call streamed"
        )

    @property
    def generation(self) -> Generation:
        """The request, for the generation pipeline's stages (chat and completions)."""
        req = self.request
        assert type(req) is Generation, "a generation stage on an embeddings request"
        return req

    def masked(self) -> Generation:
        """The request as the cache, embeddings and the router may see it."""
        return self.pii.masked if self.pii is not None else self.generation

    @property
    def clock_base(self) -> float:
        """Add to a perf_counter time of this request to get unix seconds."""
        return self.input.received_at - self.timings.received

    def remaining_s(self) -> float:
        return self.deadline - time.perf_counter()
