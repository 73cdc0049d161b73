"""The shortcuts record exactly what the stages they stand for would have decided: the
inert-content step (five stages) and the one-step decision (authorize → place)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from switchyard.config import parse_settings
from switchyard.gateway import Gateway
from switchyard.pipeline import Pipeline, RequestContext
from switchyard.policy.auth import ANONYMOUS
from switchyard.policy.keys import Limits, Principal


def _gateway(tmp_path: Path, model: dict[str, object] | None = None, **extra: object) -> Gateway:
    cfg = {
        "models": [
            {
                "alias": "m",
                "engine": {"kind": "openai", "base_url": "http://127.0.0.1:9/v1"},
                **(model or {}),
            }
        ],
        "embeddings": {"enabled": False},
        "storage": {"sqlite_path": str(tmp_path / "g.db")},
        **extra,
    }
    return Gateway(parse_settings(cfg))


Verdict = tuple[str, str, str, object]


def _verdicts(ctx: RequestContext) -> list[Verdict]:
    return [
        (stage, outcome, reason, evidence or {})
        for stage, outcome, reason, evidence, _, _ in ctx.decisions
    ]


def _decide(gw: Gateway, pipeline: Pipeline) -> list[Verdict]:
    async def run() -> RequestContext:
        ctx = gw.new_context("chat.completions", {}, time.perf_counter(), ANONYMOUS)
        ctx.body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
        ctx.alias = "m"
        await pipeline.decide(ctx)
        ctx.gate.release()
        return ctx

    return _verdicts(asyncio.run(run()))


def _one_step(gw: Gateway, principal: Principal = ANONYMOUS) -> tuple[bool, RequestContext]:
    """Whether gw.decide decided in one step, and the context it decided."""
    ctx = gw.new_context("chat.completions", {}, time.perf_counter(), principal)
    ctx.body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    ctx.alias = "m"
    pending = gw.decide(ctx)
    if pending is not None:  # the stages ran one by one
        asyncio.run(pending)  # type: ignore[arg-type]
    return pending is None, ctx


def _stage_by_stage(gw: Gateway, principal: Principal = ANONYMOUS) -> RequestContext:
    ctx = gw.new_context("chat.completions", {}, time.perf_counter(), principal)
    ctx.body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    ctx.alias = "m"
    asyncio.run(gw.pipeline.decide(ctx))
    return ctx


def test_shortcut_matches_the_stages_it_replaces(tmp_path: Path) -> None:
    gw = _gateway(tmp_path)
    assert "pii..tools" in gw.pipeline.names  # this configuration takes the shortcut
    full = Pipeline(
        [
            ("authorize", gw._authorize),
            ("admit", gw._admit),
            ("pii", gw._pii),
            ("embed", gw._embed),
            ("cache", gw._cache),
            ("route", gw._route),
            ("tools", gw._tools),
            ("select", gw._select),
            ("queue", gw._queue),
            ("place", gw._place),
        ]
    )
    shortcut, stages = _decide(gw, gw.pipeline), _decide(gw, full)
    assert shortcut == stages  # same stages, outcomes, reasons and evidence, in order
    assert [d[0] for d in shortcut][3:8] == ["pii", "embed", "cache", "route", "tools"]


def test_any_content_policy_runs_the_real_stages(tmp_path: Path) -> None:
    for extra in (
        {"pii": {"mode": "block"}},
        {"pii": {"models": {"m": "mask_upstream"}}},
        {"tools": {"deny": ["rm"]}},
        {"cache": {"enabled": True, "semantic": False}},
    ):
        gw = _gateway(tmp_path, **extra)
        assert "pii..tools" not in gw.pipeline.names, extra
        assert {"pii", "embed", "cache", "route", "tools"} <= set(gw.pipeline.names)


def test_one_step_decision_matches_the_stages(tmp_path: Path) -> None:
    for i, (model, cap) in enumerate((({}, None), ({"limits": {"max_concurrency": 4}}, 4))):
        gw = _gateway(tmp_path / str(i), model)
        at_once, fast = _one_step(gw)
        assert at_once, model
        staged = _stage_by_stage(gw)
        # The same stages, outcomes, reasons and evidence, in order (the gate's
        # in_flight counts the first request's slot, still held).
        assert _verdicts(fast)[:-2] == _verdicts(staged)[:-2]
        q_fast, q_staged = _verdicts(fast)[-2], _verdicts(staged)[-2]
        assert q_fast[:3] == q_staged[:3] == ("queue", "admitted", "waited 0.0 ms for a slot")
        assert q_fast[3] == {"in_flight": 1, "queued": 0, "max_concurrency": cap}
        assert q_staged[3] == {**q_fast[3], "in_flight": 2}  # type: ignore[dict-item]
        assert _verdicts(fast)[-1] == _verdicts(staged)[-1]
        assert [d[0] for d in fast.decisions][-11:] == [
            "authorize", "admit", "pii", "embed", "cache", "route",
            "tools", "select", "deployment_limits", "queue", "place",
        ]  # fmt: skip
        assert (fast.deployment, fast.model, fast.gate) == (
            staged.deployment,
            staged.model,
            staged.gate,
        )
        assert fast.gate.in_flight == 2
        # All decided within one interval, inside the request's own time.
        times = {(d[4], d[5]) for d in fast.decisions[-11:]}
        assert len(times) == 1
        ((t0, t1),) = times
        assert fast.timings.received <= t0 <= t1


def test_one_step_declines_what_a_stage_would_decide_otherwise(tmp_path: Path) -> None:
    limited = Limits(rpm=10)
    cases: list[tuple[dict[str, object], Principal]] = [
        ({"limits": {"rpm": 100}}, ANONYMOUS),  # deployment rate limits: the limiter decides
        ({}, Principal("t", "k", (), (), limited, Limits())),  # the key has limits
        ({}, Principal("t", "k", ("other",), (), Limits(), Limits())),  # may not use m
        ({"limits": {"max_concurrency": 1}}, ANONYMOUS),  # the gate is full: it queues
    ]
    for i, (model, principal) in enumerate(cases):
        gw = _gateway(tmp_path / str(i), model)
        if model.get("limits") == {"max_concurrency": 1}:
            assert gw.gates["m"].try_acquire() is not None  # someone holds the one slot
        ctx = gw.new_context("chat.completions", {}, time.perf_counter(), principal)
        ctx.body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
        ctx.alias = "m"
        before = list(ctx.decisions)
        assert gw._decide_at_once(ctx) is False, (model, principal)
        assert ctx.decisions == before and ctx.gate is None and ctx.deployment is None
        assert gw.gates["m"].in_flight == (
            1 if model.get("limits") == {"max_concurrency": 1} else 0
        )
