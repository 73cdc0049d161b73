"""`switchyard bench hotpath`: drives both apps for real and refuses a broken path."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from switchyard.bench.hotpath import Driver
from switchyard.pipeline import Decision


def test_hotpath_measures_both_apps_and_writes_a_result(tmp_path: Path) -> None:
    out = tmp_path / "hotpath.json"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "switchyard.bench.hotpath",
            "--requests",
            "400",
            "--blocks",
            "2",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "switchyard's own work" in done.stdout
    result = json.loads(out.read_text())
    for target in ("switchyard_us", "floor_us"):
        blocks = result["timed"][target]["blocks"]
        assert len(blocks) == 2 and all(b > 0 for b in blocks)
    assert result["workload"] == {
        "requests": 400,
        "blocks": 2,
        "tokens": 16,
        "targets": ["switchyard", "realistic"],
    }
    assert result["instructions"] is None  # not asked for


@pytest.mark.parametrize(
    ("mode", "ratio", "targets"),
    [
        ("--governed", "governed / gov-off (min):", {"gov-off_us", "governed_us"}),
        ("--placement", "placed / balanced (min):", {"balanced_us", "placed_us"}),
    ],
)
def test_hotpath_modes_measure_their_pair_of_targets(
    tmp_path: Path, mode: str, ratio: str, targets: set[str]
) -> None:
    """--governed: governance on and off; --placement: an alias with and without a policy."""
    out = tmp_path / "hotpath.json"
    done = subprocess.run(
        [
            *(sys.executable, "-m", "switchyard.bench.hotpath", mode),
            *("--requests", "300", "--blocks", "2", "--out", str(out)),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert ratio in done.stdout
    assert set(json.loads(out.read_text())["timed"]) == {*targets, "floor_us"}


def test_hotpath_protocols_drives_each_protocol_streamed_and_not(tmp_path: Path) -> None:
    """--protocols: chat, Responses (stored) and Messages, each streamed and not, every
    reply checked for its protocol's ending; each one's ratio to chat of its kind."""
    out = tmp_path / "hotpath.json"
    done = subprocess.run(
        [
            *(sys.executable, "-m", "switchyard.bench.hotpath", "--protocols"),
            *("--requests", "300", "--blocks", "2", "--out", str(out)),
        ],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 0, done.stderr
    for ratio in (
        "responses / realistic (min):",
        "responses-stream / chat-stream (min):",
        "messages / realistic (min):",
        "messages-stream / chat-stream (min):",
    ):
        assert ratio in done.stdout
    timed = json.loads(out.read_text())["timed"]
    assert set(timed) == {
        *(f"{t}_us" for t in ("realistic", "chat-stream", "responses", "responses-stream")),
        *("messages_us", "messages-stream_us", "floor_us"),
    }


def test_the_stream_driver_finds_the_ending_in_any_write_of_a_reply() -> None:
    """A streamed reply's ending comes in its last write: the check is per reply, and
    a stream that stops short of it is refused."""

    async def streamed(scope: dict[str, Any], receive: Any, send: Any) -> None:
        assert (await receive())["type"] == "http.request"
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"data: {}\n\n", "more_body": True})
        if scope["path"] == "/whole":
            await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})

    driver = Driver(b"{}", "/whole")
    driver.expect = b"data: [DONE]"
    asyncio.run(driver.drive(streamed, 2))
    driver.check()
    short = Driver(b"{}", "/short")
    short.expect = b"data: [DONE]"
    asyncio.run(short.drive(streamed, 2))
    with pytest.raises(RuntimeError, match="2 replies lacked"):
        short.check()


def test_the_governed_driver_refuses_replies_without_the_idempotency_key() -> None:
    """The governed mode checks that each reply's side-effecting call got its key."""

    async def ungoverned(scope: dict[str, Any], receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b'{"id":"call_1"}'})

    driver = Driver(b"{}")
    driver.expect = b'"id":"call_sy_'
    asyncio.run(driver.drive(ungoverned, 2))
    with pytest.raises(RuntimeError, match="2 replies lacked"):
        driver.check()


def test_driver_refuses_answers_that_are_not_200() -> None:
    """A path that fails fast must not be reported as a fast path."""

    async def broken(scope: dict[str, Any], receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 502, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    driver = Driver(b"{}")
    asyncio.run(driver.drive(broken, 3))
    with pytest.raises(RuntimeError, match="502"):
        driver.check()


def _served(tmp_path: Path, n: int) -> tuple[Any, list[Any]]:
    """Drive n chat requests through the real app (instant upstream reply); return the
    gateway's metrics and the contexts it settled, once their rows are committed."""
    from switchyard.bench.harness import chat_body
    from switchyard.bench.hotpath import _reply, _switchyard_app

    async def run() -> tuple[Any, list[Any]]:
        app, gw = await _switchyard_app(tmp_path, _reply(4))
        seen: list[Any] = []
        finish_now = gw.service.settle_now

        def keep(ctx: Any) -> Any:
            seen.append(ctx)
            return finish_now(ctx)

        gw.service.settle_now = keep  # type: ignore[method-assign]
        try:
            await Driver(chat_body(False, 4)).drive(app, n)
            await gw.service.settler.settled()
        finally:
            await gw.stop()
        return gw.metrics, seen

    return asyncio.run(run())


def test_first_attempt_metrics_shape_equals_the_one_read_from_decisions(tmp_path: Path) -> None:
    """The metrics shortcut for a request served on its first attempt counts exactly
    what reading its decisions counts (requests driven through the real app)."""
    metrics, seen = _served(tmp_path, 3)
    assert len(seen) == 3
    for ctx in seen:
        fast = metrics.first_attempt_shape(ctx, "scripted", "anonymous", "ok")
        assert fast is not None
        assert sorted(map(repr, fast)) == sorted(
            map(repr, metrics.scanned_shape(ctx, "scripted", "anonymous", "ok"))
        )
    routed = seen[0]  # as if the router had chosen a route
    routed.route = "reasoning"
    routed.decisions = [
        Decision(s, "route:reasoning" if s == "route" else o, r, e, t0, t1)
        for s, o, r, e, t0, t1 in routed.decisions
    ]
    fast = metrics.first_attempt_shape(routed, "scripted", "anonymous", "ok")
    assert sorted(map(repr, fast)) == sorted(
        map(repr, metrics.scanned_shape(routed, "scripted", "anonymous", "ok"))
    )
    retried = seen[1]  # two attempts: only the decisions can tell
    retried.run.attempts = 2
    assert metrics.first_attempt_shape(retried, "scripted", "anonymous", "ok") is None
    assert metrics.first_attempt_shape(seen[2], "scripted", "anonymous", "error") is None


def test_compact_decision_blocks_are_stored_as_the_full_trace(tmp_path: Path) -> None:
    """The pipeline's folded blocks go down the ledger's pipe as one compact item
    each; the stored trace holds every decision as it was recorded (stage, outcome,
    reason, evidence and times), so no reader can tell."""
    from switchyard.state.sql import connect
    from switchyard.state.traces import get_request, ledger_entry

    _, seen = _served(tmp_path, 3)
    assert len(seen) == 3
    conn = connect(str(tmp_path / "hotpath.db"))
    for ctx in seen:
        # window (the request's own), authorize..deployment_limits, then queue (the
        # request's own), then residency (a remote deployment's skip) and place
        assert [count for _, _, count in ctx.blocks] == [11, 2]
        sent = ledger_entry(ctx, "ok", 1, 1, 0.0, True)
        assert len(sent.blocks) == 2  # the blocks went compactly, by reference
        assert sent.decisions is not None
        assert len(sent.decisions) == len(ctx.decisions) - 13
        stored = get_request(conn, ctx.input.request_id)
        assert stored is not None
        base = ctx.clock_base
        want = [
            (stage, outcome, reason, evidence or {}, base + t0, round((t1 - t0) * 1000, 3))
            for stage, outcome, reason, evidence, t0, t1 in ctx.decisions
        ]
        got = [
            (
                d["stage"],
                d["outcome"],
                d["reason"],
                d["evidence"],
                d["started_at"],
                d["duration_ms"],
            )
            for d in stored["decisions"]
        ]
        assert got == want
        assert [d[0] for d in got][2:17] == [
            "window", "authorize", "tool_results", "task", "admit", "pii", "embed", "cache", "route",
            "tools", "select", "deployment_limits", "queue", "residency", "place",
        ]  # fmt: skip
    conn.close()
