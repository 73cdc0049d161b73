"""The inert-content shortcut records exactly what the five stages would have decided."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from switchyard.config import parse_settings
from switchyard.gateway import Gateway
from switchyard.pipeline import Pipeline, RequestContext
from switchyard.policy.auth import ANONYMOUS


def _gateway(tmp_path: Path, **extra: object) -> Gateway:
    cfg = {
        "models": [
            {"alias": "m", "engine": {"kind": "openai", "base_url": "http://127.0.0.1:9/v1"}}
        ],
        "embeddings": {"enabled": False},
        "storage": {"sqlite_path": str(tmp_path / "g.db")},
        **extra,
    }
    return Gateway(parse_settings(cfg))


def _decide(gw: Gateway, pipeline: Pipeline) -> list[tuple[str, str, str, object]]:
    async def run() -> RequestContext:
        ctx = gw.new_context("chat.completions", {}, time.perf_counter(), ANONYMOUS)
        ctx.body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
        ctx.alias = "m"
        await pipeline.decide(ctx)
        ctx.gate.release()
        return ctx

    ctx = asyncio.run(run())
    return [
        (stage, outcome, reason, evidence or {})
        for stage, outcome, reason, evidence, _, _ in ctx.decisions
    ]


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
