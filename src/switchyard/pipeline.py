"""The request pipeline: one `RequestContext` passed through explicit stages.

On the way in each stage records a `Decision` on the context and may end the request
by raising a `SwitchyardError` (reject) or by setting `ctx.response` (e.g. a cache
hit). Stages that are still pass-throughs record that they were skipped, so later
capabilities slot in without rewiring and the decision trace always has the same shape.

On the way out the same stages see the reply (`Stage.reply`: a whole reply, each
stream event, a cache hit, an idempotent replay — one `ReplyPart` whatever the
transport) and, on every ending, give back what they took (`Stage.release`), both in
reverse stage order (`Pipeline.reply_side`, `Pipeline.unwind`).

The request context the stages share, and the decisions they record on it, are in
pipeline_context.py; this module re-exports them, so every layer imports one module.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

from switchyard.identity import Principal
from switchyard.outcomes import Outcome
from switchyard.pipeline_context import (
    AdmissionState,
    CacheOutcome,
    CacheState,
    Decision,
    ExecutionState,
    PiiState,
    RequestContext,
    RequestIds,
    RequestInput,
    Status,
    Timings,
    decision_dict,
    new_request_id,
)

if TYPE_CHECKING:  # annotations only: these live in the layers above (pyproject.toml)
    from switchyard.config import ModelConfig
    from switchyard.engines.registry import Deployment

__all__ = [
    "CALL",
    "COUNT",
    "AdmissionState",
    "CacheOutcome",
    "CacheState",
    "Decision",
    "ExecutionState",
    "PiiState",
    "Pipeline",
    "Pipelines",
    "ReplyPart",
    "ReplySide",
    "RequestContext",
    "RequestIds",
    "RequestInput",
    "Stage",
    "Status",
    "Timings",
    "Verdict",
    "View",
    "decision_dict",
    "new_request_id",
]


COUNT = "messages.count_tokens"  # the endpoint of a request whose tokens are counted
# The endpoint of a request that names no model and generates nothing (a stored
# response read, deleted or cancelled): admitted as one call of the key's.
CALL = "call"


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

    template: list[tuple[str, str, str, dict[str, Any] | None]]
    sets: tuple[tuple[str, Any], ...]
    end: int
    block: str | None  # the ledger's id for the template (compact traces)


@dataclass(slots=True)
class _ViewPlan:
    """The segments of one View, by the stage each starts at (None until a request
    reaches it there), and the parts of the View that a stage's work or a deployment's
    state may change while a request runs, which are checked before each segment."""

    principal: Principal  # kept so its id stays this principal's while the plan is cached
    alias: str | None
    ready: bool | None  # the alias's deployment's, when there is one
    label: str | None
    segments: list[_Segment | None]


class Pipeline:
    """Runs the stages in order and stops early when one answers. Consecutive stages
    whose verdict is static for the request's View are folded into one precomputed
    block (worked out once per View and cached): the folded run records exactly what
    the stage-by-stage run (`decide_stepwise`) records, which tests/unit/test_pipeline_fold.py
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
        self._plans: dict[tuple[Any, ...], _ViewPlan] = {}

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

    def _view_plan(
        self, ctx: RequestContext, alias: str | None, ready: bool | None, label: str | None
    ) -> _ViewPlan:
        """The plan of the request's View (the deployment's `ready` and `label` as read
        by the caller)."""
        p = ctx.principal
        inp = ctx.input
        key = (inp.endpoint, alias, id(p), ready, label, inp.task_id is not None)
        plan = self._plans.get(key)
        if plan is None or plan.principal is not p:
            if len(self._plans) >= self._MAX_PLANS:  # principals come and go as keys change
                self._plans.clear()
            plan = _ViewPlan(p, alias, ready, label, [None] * len(self.stages))
            self._plans[key] = plan
        return plan

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
        return _Segment(template, tuple(sets), end, block)

    def decide(self, ctx: RequestContext) -> Awaitable[None] | None:
        """Run the stages; None when they decided without waiting."""
        pending, i, plan = self._step(ctx, 0, None)
        return None if pending is None else self._resume(ctx, pending, i, plan)

    async def _resume(
        self, ctx: RequestContext, pending: Awaitable[None] | None, i: int, plan: _ViewPlan | None
    ) -> None:
        while pending is not None:
            await pending
            if ctx.response is not None:
                return
            pending, i, plan = self._step(ctx, i, plan)

    def _step(
        self, ctx: RequestContext, i: int, plan: _ViewPlan | None
    ) -> tuple[Awaitable[None] | None, int, _ViewPlan | None]:
        """Run from stage `i` until a stage waits (its awaitable, the next stage's index
        and the plan last used, for the next call) or the stages are done (None)."""
        n = len(self.stages)
        deployments = self._deployments
        while i < n:
            # What of the View may have changed since the last segment: the alias (the
            # route stage sets it) and its deployment's state; the endpoint, the
            # principal and the task are the request's for its life.
            alias = ctx.alias
            dep = deployments.get(alias) if alias is not None else None
            ready = label = None
            if dep is not None:
                ready = dep.ready
                label = dep.label
            if (
                plan is None
                or alias != plan.alias  # equal, seldom the same: each request decodes its own
                or ready is not plan.ready
                or label != plan.label
                or ctx.principal is not plan.principal
            ):
                plan = self._view_plan(ctx, alias, ready, label)
            seg = plan.segments[i]
            if seg is None:
                seg = plan.segments[i] = self._plan(self.view(ctx), i)
            template = seg.template
            if template:
                # One reading: a block's verdicts were decided before the request came.
                t = time.perf_counter()
                decisions = ctx.decisions
                if seg.block is not None:
                    ctx.blocks.append((seg.block, len(decisions), len(template)))
                append = decisions.append  # a loop: cheaper than a list built and added
                for stage, outcome, reason, evidence in template:
                    append(Decision(stage, outcome, reason, evidence, t, t))
                for name, value in seg.sets:
                    setattr(ctx, name, value)
            i = seg.end
            if i == n:
                break
            pending = self.stages[i].work(ctx)
            i += 1
            if pending is not None:
                return pending, i, plan
            if ctx.response is not None:
                break
        return None, n, plan

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


@dataclass(slots=True)
class Pipelines:
    """The stage sequences, per endpoint kind (`of` names the one a request settles
    through, by its endpoint)."""

    generation: Pipeline  # chat.completions and completions
    embeddings: Pipeline
    counting: Pipeline  # messages.count_tokens: authorize and admit, nothing upstream
    calls: Pipeline  # CALL: admit only (no model to authorize), nothing upstream

    def of(self, endpoint: str) -> Pipeline:
        if endpoint == "embeddings":
            return self.embeddings
        if endpoint == CALL:
            return self.calls
        return self.counting if endpoint == COUNT else self.generation
