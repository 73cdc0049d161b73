"""Task analysis and trace rendering: step graphs, critical paths and their text views.

The numbers are chosen so each expectation is exact: a diamond A -> {B, C} -> D where C
is the longer branch, a chain with a gap, parallel steps, broken parent links.
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from switchyard.observe.render import render_request, render_task
from switchyard.observe.tasks import analyze_task

T0 = 1795939062.123  # a realistic epoch: float noise must not leak into the numbers


def rec(
    rid: str,
    start_ms: float,
    duration_ms: float | None,
    parents: list[str] | None = None,
    *,
    queue_ms: float | None = 1.0,
    upstream_ms: float | None = None,
    **over: Any,
) -> dict[str, Any]:
    """A trace record received `start_ms` after T0; upstream defaults to duration - 5."""
    if upstream_ms is None and duration_ms is not None:
        upstream_ms = duration_ms - 5
    record: dict[str, Any] = {
        "request_id": rid,
        "task_id": "task-1",
        "parent_request_ids": parents or [],
        "tenant_id": "acme",
        "key_id": "key_1",
        "endpoint": "chat.completions",
        "model": "smol",
        "revision": "r1",
        "upstream": "http://127.0.0.1:9/v1",
        "status": "ok",
        "error_code": None,
        "attempts": 1,
        "input_tokens": 20,
        "output_tokens": 16,
        "cost_usd": 0.0,
        "cache": None,
        "fallback_from": None,
        "planned_steps": None,
        "received_at": T0 + start_ms / 1000,
        "timings": {
            "queue_ms": queue_ms,
            "upstream_first_byte_ms": None,
            "client_first_byte_ms": None,
            "upstream_ms": upstream_ms,
            "duration_ms": duration_ms,
        },
        "decisions": [],
    }
    record.update(over)
    return record


def diamond(explicit: bool = True) -> list[dict[str, Any]]:
    """A [0,50] -> B [50,100] and C [50,170] in parallel -> D [170,250]."""

    def p(*ids: str) -> list[str]:
        return list(ids) if explicit else []

    return [
        rec("A", 0, 50),
        rec("B", 50, 50, p("A")),
        rec("C", 50, 120, p("A")),
        rec("D", 170, 80, p("B", "C")),
    ]


def steps_by_id(analysis: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {s["request_id"]: s for s in analysis["steps"]}


# -- critical path ---------------------------------------------------------------------


def test_diamond_with_explicit_parents_follows_the_longer_branch() -> None:
    a = analyze_task(diamond())
    assert a["critical_path"] == ["A", "C", "D"]
    assert a["e2e_ms"] == 250.0
    assert a["critical_path_ms"] == 250.0
    assert a["started_at"] == T0
    assert a["ended_at"] == pytest.approx(T0 + 0.25)
    steps = steps_by_id(a)
    assert [s["request_id"] for s in a["steps"]] == ["A", "B", "C", "D"]
    assert steps["D"]["parents"] == ["B", "C"]
    assert not steps["D"]["inferred"]
    assert steps["A"]["parents"] == []
    assert {r: s["on_critical_path"] for r, s in steps.items()} == {
        "A": True,
        "B": False,
        "C": True,
        "D": True,
    }
    assert (steps["C"]["start_ms"], steps["C"]["end_ms"]) == (50.0, 170.0)


def test_diamond_inferred_from_timing_gives_the_same_path() -> None:
    a = analyze_task(diamond(explicit=False))
    assert a["critical_path"] == ["A", "C", "D"]
    assert a["critical_path_ms"] == 250.0
    steps = steps_by_id(a)
    assert all(s["inferred"] for s in a["steps"])
    assert steps["D"]["parents"] == ["B", "C"]  # A precedes it through B and C


@pytest.mark.parametrize("explicit", [True, False])
def test_overlapping_steps_are_parallel(explicit: bool) -> None:
    steps = steps_by_id(analyze_task(diamond(explicit)))
    assert steps["B"]["parents"] == ["A"]
    assert steps["C"]["parents"] == ["A"]


def test_a_chains_steps_each_list_the_one_before() -> None:
    """A task of N sequential steps lists N - 1 links (a report linear in its steps),
    not every earlier step under each."""
    a = analyze_task([rec(f"s{i:03}", 10 * i, 5) for i in range(300)])
    steps = a["steps"]
    assert [s["parents"] for s in steps] == [[]] + [[f"s{i:03}"] for i in range(299)]
    assert a["critical_path"] == [f"s{i:03}" for i in range(300)]


def _path_over_every_earlier_step(records: list[dict[str, Any]]) -> list[str]:
    """The critical path as the definition gives it when every step that ended before
    a step started (within 1 ms) is its parent: the oracle for the reduced links."""
    spans = {
        r["request_id"]: (
            round((r["received_at"] - T0) * 1000, 3),
            round((r["received_at"] - T0) * 1000 + r["timings"]["duration_ms"], 3),
        )
        for r in records
    }
    order = sorted(spans, key=lambda i: (spans[i][0], i))

    def latest(ids: list[str]) -> str:
        return min(ids, key=lambda i: (-spans[i][1], spans[i][0], i))

    current = latest(order)
    path = [current]
    while True:
        before = order[: order.index(current)]
        parents = [i for i in before if spans[i][1] <= spans[current][0] + 1.0]
        if not parents:
            return path[::-1]
        current = latest(parents)
        path.append(current)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(0, 400), st.integers(0, 120)),
        min_size=1,
        max_size=25,
    )
)
def test_reduced_links_give_the_critical_path_every_earlier_step_gives(
    spans: list[tuple[int, int]],
) -> None:
    """Generated tasks of inferred steps (starts and durations in whole ms, ties and
    zero durations included): the critical path over the reduced links is the one over
    every earlier step, and no listed parent started after another listed one ended."""
    records = [rec(f"r{i:02}", start, dur) for i, (start, dur) in enumerate(spans)]
    a = analyze_task(records)
    assert a["critical_path"] == _path_over_every_earlier_step(records)
    by_id = {s["request_id"]: s for s in a["steps"]}
    for step in a["steps"]:
        for p in step["parents"]:
            assert by_id[p]["end_ms"] <= step["start_ms"] + 1.0


def test_chain_with_a_gap_counts_the_gap() -> None:
    a = analyze_task([rec("A", 0, 50), rec("B", 80, 50)])
    assert a["critical_path"] == ["A", "B"]
    assert a["e2e_ms"] == 130.0
    assert a["critical_path_ms"] == 130.0  # 50 + 30 gap + 50
    assert steps_by_id(a)["B"]["parents"] == ["A"]


def test_path_starting_after_the_task_is_shorter_than_e2e() -> None:
    # X opens the task but nothing waits on it; P -> Q is what finishes last.
    a = analyze_task([rec("X", 0, 30), rec("P", 5, 45), rec("Q", 50, 50, ["P"])])
    assert a["critical_path"] == ["P", "Q"]
    assert a["critical_path_ms"] == 95.0
    assert a["e2e_ms"] == 100.0


def test_small_overlap_within_tolerance_is_still_a_dependency() -> None:
    a = analyze_task([rec("A", 0, 50), rec("B", 49.5, 10)])
    assert steps_by_id(a)["B"]["parents"] == ["A"]
    assert a["critical_path"] == ["A", "B"]


def test_ties_go_to_the_earliest_start_then_request_id() -> None:
    # B and C both end at 100; B started earlier. C2 and C tie fully: request id decides.
    a = analyze_task([rec("A", 0, 10), rec("B", 10, 90), rec("C", 20, 80), rec("D", 100, 10)])
    assert a["critical_path"] == ["A", "B", "D"]
    b = analyze_task([rec("A", 0, 10), rec("C2", 10, 90), rec("C1", 10, 90), rec("D", 100, 10)])
    assert b["critical_path"] == ["A", "C1", "D"]


def test_single_step() -> None:
    a = analyze_task([rec("only", 0, 42.5)])
    assert a["critical_path"] == ["only"]
    assert a["critical_path_ms"] == a["e2e_ms"] == 42.5
    assert a["llm_calls"] == a["steps_executed"] == 1
    assert a["steps"][0]["parents"] == []
    assert a["steps"][0]["on_critical_path"]


def test_empty_task_is_an_error() -> None:
    with pytest.raises(ValueError):
        analyze_task([])


def test_records_of_two_tasks_are_an_error() -> None:
    with pytest.raises(ValueError, match="several tasks"):
        analyze_task([rec("A", 0, 10), rec("B", 20, 10, task_id="task-2")])


# -- broken links and missing data -----------------------------------------------------


def test_parent_cycle_is_broken_by_start_order() -> None:
    # A names B and B names A: only B -> A (A started first) is kept; S names itself.
    a = analyze_task([rec("A", 0, 50, ["B"]), rec("B", 60, 50, ["A"]), rec("S", 200, 5, ["S"])])
    steps = steps_by_id(a)
    assert steps["A"]["parents"] == []
    assert steps["A"]["inferred"]
    assert steps["B"]["parents"] == ["A"]
    assert not steps["B"]["inferred"]
    assert steps["S"]["parents"] == ["B"]  # its only parent was itself: inferred (A: via B)
    assert a["critical_path"] == ["A", "B", "S"]


def test_parents_outside_the_task_are_ignored() -> None:
    a = analyze_task([rec("A", 0, 50), rec("B", 60, 50, ["elsewhere", "A"]), rec("C", 0, 5)])
    steps = steps_by_id(a)
    assert steps["B"]["parents"] == ["A"]  # not C, although C also ended before B
    assert not steps["B"]["inferred"]


def test_missing_timings_do_not_break_the_analysis() -> None:
    no_timings = rec("A", 0, None, timings=None)
    partial = rec("B", 10, None, upstream_ms=30.0)  # cut short: no duration
    a = analyze_task([no_timings, partial])
    steps = steps_by_id(a)
    assert steps["A"]["duration_ms"] == 0.0
    assert steps["A"]["gateway_ms"] == 0.0
    assert steps["B"]["duration_ms"] == 30.0  # the latest timing it has
    assert steps["B"]["parents"] == ["A"]
    assert a["e2e_ms"] == 40.0


# -- totals ----------------------------------------------------------------------------


def test_planned_versus_executed() -> None:
    records = [
        rec("A", 0, 10, planned_steps=3),
        rec("B", 20, 10, planned_steps=5),
        rec("C", 40, 10),
    ]
    a = analyze_task(records)
    assert (a["steps_executed"], a["steps_planned"]) == (3, 5)
    assert analyze_task([rec("A", 0, 10)])["steps_planned"] is None


def test_retries_fallbacks_cache_and_usage_totals() -> None:
    records = [
        rec("A", 0, 10, attempts=3, cache="miss", cost_usd=0.25),
        rec("B", 20, 10, attempts=2, fallback_from="big", cost_usd=0.5, cache="hit-exact"),
        rec("C", 40, 10, cache="hit-semantic", status="error", error_code="upstream_timeout"),
        rec("D", 60, 10, attempts=None, cache="idempotent_replay", input_tokens=None),
    ]
    a = analyze_task(records)
    assert a["retries"] == 3
    assert a["fallbacks"] == 1
    assert a["cache_hits"] == 2  # exact and semantic hits; a replay or miss is none
    assert a["statuses"] == {"error": 1, "ok": 3}
    assert (a["input_tokens"], a["output_tokens"]) == (60, 64)
    assert a["cost_usd"] == 0.75
    assert a["llm_calls"] == 4


def test_gateway_ms_is_what_queue_and_upstream_leave() -> None:
    a = analyze_task(
        [
            rec("A", 0, 100, queue_ms=10, upstream_ms=70),
            rec("B", 200, 100, queue_ms=None, upstream_ms=None, timings={"duration_ms": 100}),
            rec("C", 400, 50, queue_ms=30, upstream_ms=40),  # inconsistent: clamp at 0
        ]
    )
    steps = steps_by_id(a)
    assert (steps["A"]["queue_ms"], steps["A"]["upstream_ms"]) == (10.0, 70.0)
    assert steps["A"]["gateway_ms"] == 20.0
    assert steps["B"]["gateway_ms"] == 100.0
    assert steps["C"]["gateway_ms"] == 0.0


# -- rendering -------------------------------------------------------------------------


def _step_rows(text: str) -> dict[str, str]:
    """Step rows by request id: the token after the status column and any tree branch."""
    rows = {}
    for line in text.splitlines():
        if line[:2] in {"* ", "  "} and "+" in line[:12]:
            words = line[2:].split()
            rid = words[6] if words[6] != "`-" else words[7]
            rows[rid] = line
    return rows


@pytest.mark.parametrize("explicit", [True, False])
def test_render_task_marks_exactly_the_critical_steps(explicit: bool) -> None:
    records = diamond(explicit)
    text = render_task(analyze_task(records), records)
    rows = _step_rows(text)
    assert sorted(rows) == ["A", "B", "C", "D"]
    assert {rid for rid, line in rows.items() if line.startswith("*")} == {"A", "C", "D"}
    assert "critical path: A -> C -> D (250.0 ms of 250.0 ms)" in text
    assert "also after: B" in rows["D"]  # D hangs under C, the parent it waited for
    assert "`- D" in rows["D"] and "`- C" in rows["C"]
    assert render_task(analyze_task(records), records) == text  # stable


def test_render_task_header_and_step_split() -> None:
    records = [rec("A", 0, 100, queue_ms=10, upstream_ms=70, planned_steps=4, attempts=2)]
    text = render_task(analyze_task(records), records)
    header = text.splitlines()[0]
    assert "e2e 100.0 ms" in header
    assert "calls 1" in header
    assert "1 executed / 4 planned" in header
    assert "retries 1" in text
    row = _step_rows(text)["A"]
    assert row.split()[1:6] == ["+0.0", "100.0", "10.0", "70.0", "20.0"]
    assert "attempts 2" in row


def test_render_request_shows_each_decision() -> None:
    decisions = [
        {
            "stage": "authenticate",
            "outcome": "ok",
            "reason": "valid API key",
            "evidence": {"key_id": "key_1", "note": "x" * 200},
            "started_at": T0,
            "duration_ms": 0.02,
        },
        {
            "stage": "route",
            "outcome": "fallback",
            "reason": "primary breaker open",
            "evidence": {"from": "big", "candidates": ["smol", "tiny"]},
            "started_at": T0,
            "duration_ms": 0.4,
        },
    ]
    record = rec("req_ab", 0, 85.2, fallback_from="big", decisions=decisions)
    text = render_request(record)
    lines = text.splitlines()
    assert lines[0].startswith("request req_ab  smol@r1 via http://127.0.0.1:9/v1  ok  85.2 ms")
    assert "fallback from big" in lines[0]
    assert "tokens 20 in / 16 out" in lines[0]
    auth = next(i for i, line in enumerate(lines) if "authenticate" in line)
    assert "(0.02 ms)" in lines[auth] and lines[auth].endswith("valid API key")
    assert "key_id=key_1" in lines[auth + 1]
    assert "x" * 50 not in lines[auth + 1]  # long evidence is cut
    route = next(line for line in lines if line.lstrip().startswith("route"))
    assert "fallback" in route and route.endswith("primary breaker open")
    assert 'candidates=["smol","tiny"]' in text
