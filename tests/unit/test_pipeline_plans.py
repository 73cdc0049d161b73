"""The folded pipeline looks again at what a stage's work may change mid-request.

A request's View is read once per block of static verdicts, and the plan of blocks is
kept while the View stays the same; a stage's work that changes the alias (the route
stage) or a deployment whose state changes between two blocks must make the next
block the one for the View as it now is, as the stage-by-stage run decides.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

from switchyard import outcomes
from switchyard.pipeline import (
    Pipeline,
    RequestContext,
    RequestInput,
    Stage,
    Timings,
    Verdict,
    View,
)
from switchyard.request import Generation


@dataclass
class _Dep:
    """What the pipeline reads of a deployment to key its plans."""

    ready: bool
    label: str


class _Static(Stage):
    """Static for every View: says whether the alias's deployment was ready."""

    def __init__(self, name: str) -> None:
        self.name = name

    def static(self, view: View) -> Verdict | None:
        dep: Any = view.deployment
        state = "none" if dep is None else f"ready={dep.ready}"
        return Verdict(outcomes.Route.EXPLICIT, f"{view.alias} {state}")


class _Work(Stage):
    """Works on every request: sets the alias to `alias`, or a deployment's state to
    `ready` (what each request's work does is the test's to say)."""

    name = "work"

    def __init__(self, dep: _Dep | None = None) -> None:
        self.alias: str | None = None
        self.ready = True
        self._dep = dep

    def work(self, ctx: RequestContext) -> None:
        if self.alias is not None:
            ctx.alias = self.alias
        if self._dep is not None:
            self._dep.ready = self.ready
        ctx.record(self.name, outcomes.Route.EXPLICIT, "worked", time.perf_counter())


def _ctx(alias: str) -> RequestContext:
    now = time.perf_counter()
    ctx = RequestContext(
        RequestInput("r", "chat.completions", time.time()),
        Generation(model=alias),
        Timings(now),
        now + 5,
    )
    ctx.alias = alias
    return ctx


def _reasons(pipeline: Pipeline, alias: str, stepwise: bool = False) -> list[str]:
    ctx = _ctx(alias)
    if stepwise:
        asyncio.run(pipeline.decide_stepwise(ctx))
    else:
        assert pipeline.decide(ctx) is None
    return [d.reason for d in ctx.decisions]


def test_a_block_after_a_stage_that_changed_the_alias_is_the_new_aliass() -> None:
    deps: dict[str, Any] = {"a": _Dep(True, "up-a"), "b": _Dep(False, "up-b")}
    work = _Work()
    pipeline = Pipeline([_Static("before"), work, _Static("after")], deployments=deps)
    for to, after in (("b", "b ready=False"), ("c", "c none"), ("b", "b ready=False")):
        work.alias = to  # the same View before the work, another one after it
        assert _reasons(pipeline, "a") == ["a ready=True", "worked", after]
        assert _reasons(pipeline, "a", stepwise=True) == ["a ready=True", "worked", after]


def test_a_block_after_a_deployment_changed_state_is_the_new_states() -> None:
    dep = _Dep(True, "up-a")
    work = _Work(dep)
    deps: dict[str, Any] = {"a": dep}
    pipeline = Pipeline([_Static("before"), work, _Static("after")], deployments=deps)
    for ready in (False, True, False):
        dep.ready = True  # the same View before the work, its state changed by it or not
        work.ready = ready
        assert _reasons(pipeline, "a") == ["a ready=True", "worked", f"a ready={ready}"]
