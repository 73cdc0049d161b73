"""The request pipeline: one `RequestContext` passed through explicit stages.

On the way in each stage records a `Decision` on the context and may end the request
by raising a `SwitchyardError` (reject) or by setting `ctx.response` (e.g. a cache
hit). Stages that are still pass-throughs record that they were skipped, so later
capabilities slot in without rewiring and the decision trace always has the same shape.

On the way out the same stages see the reply (`Stage.reply`: a whole reply, each
stream event, a cache hit, an idempotent replay — one `ReplyPart` whatever the
transport) and, on every ending, give back what they took (`Stage.release`), both in
reverse stage order (`Pipeline.reply_side`, `Pipeline.unwind`).
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING, Any, NamedTuple

import msgspec

from switchyard.entropy import RandomPool
from switchyard.identity import ANONYMOUS, Principal
from switchyard.outcomes import Outcome
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
    from switchyard.policy.limits import Ask, ScopeLimits
    from switchyard.policy.pii import MaskSession
    from switchyard.policy.tasks import TaskHold, ToolCallNote


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


@dataclass(slots=True)
class CacheState:
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


@dataclass(slots=True)
class PiiState:
    """What the pii stage leaves for the rest of the request."""

    session: MaskSession  # the placeholder mapping is held only here
    masked: Generation  # the request as cache keys, embeddings and the router see it
    restore: bool  # the upstream saw placeholders: the reply gets the raw values back
    found: dict[str, int] = field(default_factory=dict)  # PII kinds found, and how many


@dataclass(slots=True)
class Timings:
    """Monotonic timestamps (perf_counter seconds) of one request's milestones."""

    received: float
    upstream_sent: float | None = None
    upstream_first_byte: float | None = None
    client_first_byte: float | None = None
    ended: float | None = None


@dataclass(frozen=True, slots=True)
class RequestInput:
    """What the request is, read once when it opens and fixed for its life: the
    gateway's id, the endpoint, when it arrived and the client's headers with the
    values read from them (each bounded by `api.headers` as it was read). Stages may
    not change it (frozen); what they decide goes into the context or a record."""

    request_id: str
    endpoint: str  # "chat.completions" | "completions" | "embeddings"
    received_at: float  # unix seconds
    headers: Mapping[str, str] = field(default_factory=dict)  # the client's request headers
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


@dataclass(slots=True)
class AdmissionState:
    """The admit, deployment-limit and queue stages' state: what this request holds
    until it is settled."""

    # (scopes, Ask, the stage that reserved): each stage settles its own on release
    reservations: list[tuple[list[ScopeLimits], Ask, str]] = field(default_factory=list)
    rate_headers: dict[str, str] = field(default_factory=dict)  # x-ratelimit-* to send
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
    left: list[tuple[Balancer, Deployment, bool]] = field(default_factory=list)


@dataclass(slots=True)
class ExecutionState:
    """The executor's account of the upstream calls it made for this request, and
    what the request is charged once settled (`tokens_in`, `tokens_out`, `cost_usd`:
    the stages' releases settle reservations with them)."""

    attempts: int = 0
    fallback_from: str | None = None  # the alias the request was first sent to
    chunks: int = 0  # content events relayed to the client
    chunk_gaps: list[float] = field(default_factory=list)  # seconds between streamed writes
    usage: dict[str, Any] | None = None  # the upstream's usage object, once read
    reply_body: bytes | None = None  # a non-streamed reply whose usage is read at settle
    tokens_in: int = 0
    tokens_out: int = 0
    cost_usd: float = 0.0


@dataclass(slots=True)
class RequestContext:
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
    decisions: list[Decision] = field(default_factory=list)
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
    admission: AdmissionState = field(default_factory=AdmissionState)
    run: ExecutionState = field(default_factory=ExecutionState)
    finished: bool = False
    # (the request as decoded, the bytes it was decoded from when they are exactly it,
    # else None): while `request` is still that one, those bytes can go upstream.
    wire: tuple[Generation | Embedding, bytes | None] | None = None
    # (block id, index of its first decision, count) of each folded run of static
    # verdicts (Pipeline): stored compactly in the ledger, expanded on write.
    blocks: list[tuple[str, int, int]] = field(default_factory=list)
    media_ms: dict[str, float] | None = None  # the media stage's time per step
    media_shape: tuple[int, int, int, int] | None = None  # images, bytes, pixels in/out
    header_error: InvalidRequest | None = None  # a bad header's, raised once ctx exists

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


# -- stages and the pipeline that folds them ---------------------------------------


@dataclass(frozen=True, slots=True)
class Verdict:
    """What a stage decides for every request in one `View`, known before any request
    arrives: its outcome, reason and evidence (shared by the requests that record it,
    so never changed afterwards) and the context fields it sets (`sets`)."""

    outcome: Outcome
    reason: str
    evidence: dict[str, Any] | None = None
    sets: tuple[tuple[str, Any], ...] = ()


class View(NamedTuple):
    """What a stage's static part may depend on: the endpoint, the model asked for
    (and its config and deployment), who asks, and whether the request belongs to an
    agent task (`x-task-id`). Nothing of the request's body."""

    endpoint: str
    alias: str | None
    principal: Principal
    model: ModelConfig | None
    deployment: Deployment | None
    in_task: bool = False


# Fields a static verdict may not set: the View is read from them, and a block of
# verdicts is decided for one View.
_VIEW_FIELDS = frozenset({"endpoint", "alias", "principal"})


class ReplyPart:
    """One stage's work on one request's reply, whatever the transport. The parts of a
    request's stages are chained in reverse stage order (`ReplySide`), so the stage
    nearest the upstream sees the reply first, as it came:

    - `wants(body)`: whether a whole reply needs this part (a cheap look at the bytes:
      when no part wants it, the reply is never parsed);
    - `whole(obj)`: a whole reply (a JSON answer, a cache hit, an idempotent replay),
      returned changed or as it came;
    - `event(data)`: one stream event's data, returned as the events to send in its
      place (None: unchanged);
    - `end(ok)`: the stream ended (`ok`: complete): the events it held back;
    - `after(ok)`: once a stream ended, the work that may wait (storing the reply).
    """

    __slots__ = ()

    def wants(self, body: bytes) -> bool:
        return True

    async def whole(self, obj: dict[str, Any]) -> dict[str, Any]:
        return obj

    def event(self, data: bytes) -> list[bytes] | None:
        return None

    def end(self, ok: bool) -> list[bytes]:
        return []

    def after(self, ok: bool) -> Awaitable[None] | None:
        return None


class ReplySide:
    """The reply parts of one request, in the order the reply passes them."""

    __slots__ = ("parts",)

    def __init__(self, parts: list[ReplyPart]) -> None:
        self.parts = parts

    def wants(self, body: bytes) -> bool:
        """Whether any part needs this whole reply (when none does, it is not parsed)."""
        for part in self.parts:  # noqa: SIM110 - a loop: any() over a generator is slower
            if part.wants(body):
                return True
        return False

    async def whole(self, obj: dict[str, Any], body: bytes | None = None) -> dict[str, Any]:
        """`obj` through every part (that wants `body`, the bytes it was parsed from)."""
        for part in self.parts:
            if body is None or part.wants(body):
                obj = await part.whole(obj)
        return obj

    def event(self, data: bytes) -> list[bytes]:
        return self._through(0, [data])

    def _through(self, start: int, events: list[bytes]) -> list[bytes]:
        parts = self.parts
        for i in range(start, len(parts)):
            part = parts[i]
            out: list[bytes] = []
            for data in events:
                got = part.event(data)
                if got is None:
                    out.append(data)
                else:
                    out.extend(got)
            events = out
        return events

    def end(self, ok: bool) -> list[bytes]:
        """What the parts held back, each part's through the parts after it."""
        out: list[bytes] = []
        for i, part in enumerate(self.parts):
            held = part.end(ok)
            if held:
                out.extend(self._through(i + 1, held))
        return out

    async def after(self, ok: bool) -> None:
        for part in self.parts:
            pending = part.after(ok)
            if pending is not None:
                await pending


class Stage:
    """One stage, with up to four parts (DESIGN.md: the request lifecycle).

    - `static` is the one place where the stage says when its verdict does not depend
      on the request (from settings, principal and deployment state): it returns that
      `Verdict`, or None when `work` must look at the request.
    - `work` decides for one request: it records its decision (`ctx.record`), may set
      `ctx.response` to answer, and raises a `SwitchyardError` to refuse; it returns
      an awaitable only when it has to wait. The pipeline calls `work` only where
      `static` returned None, so `work` never restates the static rules.
    - `reply` returns this stage's `ReplyPart` for the request's reply, or None when
      it has nothing to do on the way out (asked for every reply, folded or not).
    - `release` gives back what the stage took for the request (a reservation, a slot,
      a lease), on every ending, in reverse stage order, exactly once (the driver
      unwinds a request once: `ctx.finished`; what was taken stays on the context
      for its record); it runs
      without waiting and returns an awaitable only for what must wait (settling a
      shared counter). It reads the request's charge from `ctx.run`.
    """

    name: str = "stage"

    def static(self, view: View) -> Verdict | None:
        return None

    def work(self, ctx: RequestContext) -> Awaitable[None] | None:
        raise NotImplementedError

    def reply(self, ctx: RequestContext) -> ReplyPart | None:
        return None

    def release(self, ctx: RequestContext) -> Awaitable[None] | None:
        return None


@dataclass(slots=True)
class _Segment:
    """From stage `start` on: the verdicts of the static stages that follow one
    another there (a block, recorded at once) and the stage that ends it (`end`,
    which works on the request; len(stages) when none does)."""

    principal: Principal  # kept so its id stays this principal's while the plan is cached
    template: list[tuple[str, str, str, dict[str, Any] | None]]
    sets: tuple[tuple[str, Any], ...]
    end: int
    block: str | None  # the ledger's id for the template (compact traces)


class Pipeline:
    """Runs the stages in order and stops early when one answers. Consecutive stages
    whose verdict is static for the request's View are folded into one precomputed
    block (worked out once per View and cached): the folded run records exactly what
    the stage-by-stage run (`decide_stepwise`) records, which tests/test_pipeline_fold.py
    checks over generated configurations, principals and deployment states."""

    _MAX_PLANS = 4096

    def __init__(
        self,
        stages: Sequence[Stage],
        models: Mapping[str, ModelConfig] | None = None,
        deployments: Mapping[str, Deployment] | None = None,
        register_block: Callable[[list[Any]], str] | None = None,
    ) -> None:
        self.stages = list(stages)
        # Only the stages that have a reply or release part are asked, last first.
        self._replying = [s for s in reversed(self.stages) if type(s).reply is not Stage.reply]
        self._releasing = [s for s in reversed(self.stages) if type(s).release is not Stage.release]
        self._models = models if models is not None else {}
        self._deployments = deployments if deployments is not None else {}
        self._register = register_block
        self._plans: dict[tuple[Any, ...], _Segment] = {}

    @property
    def names(self) -> list[str]:
        return [s.name for s in self.stages]

    def reply_side(self, ctx: RequestContext) -> ReplySide | None:
        """The request's reply parts, nearest the upstream first; None when no stage
        has anything to do on its way out."""
        parts = None
        for stage in self._replying:
            part = stage.reply(ctx)
            if part is not None:
                parts = [part] if parts is None else [*parts, part]
        return None if parts is None else ReplySide(parts)

    def unwind(self, ctx: RequestContext) -> list[Awaitable[None]] | None:
        """Every stage's release, last stage first: what needs no waiting is given back
        at once; what must wait is returned (None when nothing does), to be awaited in
        the same order (settle.Settler)."""
        waiting = None
        for stage in self._releasing:
            pending = stage.release(ctx)
            if pending is not None:
                waiting = [pending] if waiting is None else [*waiting, pending]
        return waiting

    def view(self, ctx: RequestContext) -> View:
        alias = ctx.alias
        return View(
            ctx.input.endpoint,
            alias,
            ctx.principal,
            self._models.get(alias) if alias is not None else None,
            self._deployments.get(alias) if alias is not None else None,
            ctx.input.task_id is not None,
        )

    def _segment(self, ctx: RequestContext, start: int) -> _Segment:
        alias = ctx.alias
        dep = self._deployments.get(alias) if alias is not None else None
        p = ctx.principal
        key = (
            start,
            ctx.input.endpoint,
            alias,
            id(p),
            dep.ready if dep is not None else None,
            dep.label if dep is not None else None,
            ctx.input.task_id is not None,
        )
        seg = self._plans.get(key)
        if seg is not None and seg.principal is p:
            return seg
        seg = self._plan(self.view(ctx), start)
        if len(self._plans) >= self._MAX_PLANS:  # principals come and go as keys change
            self._plans.clear()
        self._plans[key] = seg
        return seg

    def _plan(self, view: View, start: int) -> _Segment:
        template: list[tuple[str, str, str, dict[str, Any] | None]] = []
        sets: list[tuple[str, Any]] = []
        end = start
        while end < len(self.stages):
            stage = self.stages[end]
            v = stage.static(view)
            if v is None:
                break
            assert _VIEW_FIELDS.isdisjoint(f for f, _ in v.sets), stage.name
            template.append((stage.name, v.outcome, v.reason, v.evidence))
            sets.extend(v.sets)
            end += 1
        # Only a configured model's blocks get a ledger id: the ledger keeps every
        # template it is given, and a client may name any number of unknown models.
        known = view.model is not None
        block = self._register(template) if template and known and self._register else None
        return _Segment(view.principal, template, tuple(sets), end, block)

    def decide(self, ctx: RequestContext) -> Awaitable[None] | None:
        """Run the stages; None when they decided without waiting."""
        pending, i = self._step(ctx, 0)
        return None if pending is None else self._resume(ctx, pending, i)

    async def _resume(self, ctx: RequestContext, pending: Awaitable[None] | None, i: int) -> None:
        while pending is not None:
            await pending
            if ctx.response is not None:
                return
            pending, i = self._step(ctx, i)

    def _step(self, ctx: RequestContext, i: int) -> tuple[Awaitable[None] | None, int]:
        """Run from stage `i` until a stage waits (its awaitable and the next stage's
        index) or the stages are done (None)."""
        n = len(self.stages)
        while i < n:
            seg = self._segment(ctx, i)
            if seg.template:
                t0 = time.perf_counter()
                decisions = ctx.decisions
                if seg.block is not None:
                    ctx.blocks.append((seg.block, len(decisions), len(seg.template)))
                t1 = time.perf_counter()
                decisions += [Decision(s, o, r, e, t0, t1) for s, o, r, e in seg.template]
                for name, value in seg.sets:
                    setattr(ctx, name, value)
            i = seg.end
            if i == n:
                break
            pending = self.stages[i].work(ctx)
            i += 1
            if pending is not None:
                return pending, i
            if ctx.response is not None:
                break
        return None, n

    async def decide_stepwise(self, ctx: RequestContext) -> None:
        """Every stage on its own, its static part asked for each request: what the
        folded run stands for (the property test's reference)."""
        for stage in self.stages:
            v = stage.static(self.view(ctx))
            if v is None:
                pending = stage.work(ctx)
                if pending is not None:
                    await pending
            else:
                t = time.perf_counter()
                ctx.record(stage.name, v.outcome, v.reason, t, v.evidence)
                for name, value in v.sets:
                    setattr(ctx, name, value)
            if ctx.response is not None:
                return
