"""Each worker's own counts, reported to the control plane (control/worker_live.py,
api/internal.py's /state/live): what a worker sends is kept whole or refused whole,
a worker that stops reporting drops out, and only the workers' token is answered."""

from __future__ import annotations

import time
from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from starlette.testclient import TestClient

from switchyard.api.internal import GateRoutes, internal_app
from switchyard.control.worker_live import (
    MAX_REPORT,
    BadReport,
    WorkerReports,
    others,
    report_of,
    worker_report,
)
from switchyard.policy.admission import DeploymentGate
from switchyard.policy.admission_remote import Leases, RemoteGate

TOKEN = "t0ken"
AUTH = {"authorization": f"Bearer {TOKEN}"}

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**63 - 1)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3)
    ),
    max_leaves=12,
)


def _counted(report: dict[str, Any]) -> bool:
    def count(v: object) -> bool:
        return type(v) is int and 0 <= v < 1 << 31

    return (
        set(report) == {"active_requests", "queues"}
        and count(report["active_requests"])
        and all(
            set(q) == {"in_flight", "queued"} and count(q["in_flight"]) and count(q["queued"])
            for q in report["queues"].values()
        )
    )


@settings(max_examples=300)
@given(
    data=st.one_of(
        json_values,
        st.fixed_dictionaries(
            {"active_requests": json_values, "queues": json_values},
            optional={"extra": json_values},
        ),
        st.fixed_dictionaries(
            {
                "active_requests": st.integers(-5, 2**40),
                "queues": st.dictionaries(
                    st.text(max_size=300),
                    st.fixed_dictionaries(
                        {
                            "in_flight": st.integers(-5, 2**40) | json_values,
                            "queued": st.integers(-5, 2**40),
                        }
                    ),
                    max_size=4,
                ),
            }
        ),
    )
)
def test_a_report_is_kept_as_counts_or_refused_whole(data: Any) -> None:
    try:
        kept = report_of(orjson.loads(orjson.dumps(data)))
    except BadReport:
        return
    assert _counted(kept)
    assert kept["active_requests"] == data["active_requests"]
    assert kept["queues"] == {
        k: {"in_flight": v["in_flight"], "queued": v["queued"]} for k, v in data["queues"].items()
    }


def test_what_is_not_a_report_is_refused() -> None:
    for raw in (
        b"[]",
        b'{"active_requests": -1, "queues": {}}',
        b'{"active_requests": true, "queues": {}}',
        b'{"active_requests": 1.0, "queues": {}}',
        b'{"active_requests": 1}',
        b'{"active_requests": 1, "queues": {"m": {"in_flight": 1}}}',
        b'{"active_requests": 1, "queues": {"' + b"m" * 300 + b'": {"in_flight": 1, "queued": 0}}}',
    ):
        with pytest.raises(BadReport):
            report_of(orjson.loads(raw))


def test_a_worker_reports_its_requests_and_only_its_unlimited_gates() -> None:
    unlimited = DeploymentGate("open", None, 0, "fcfs")
    remote = RemoteGate(DeploymentGate("m", 2, 4, "fcfs"), "http://127.0.0.1:9", TOKEN, "w0-1")
    report = worker_report(3, {"open": unlimited, "m": remote})
    assert report == {"active_requests": 3, "queues": {"open": {"in_flight": 0, "queued": 0}}}
    assert report_of(orjson.loads(orjson.dumps(report))) == report


def test_a_worker_that_stops_reporting_drops_out_and_a_restarted_one_replaces_its_own() -> None:
    reports = WorkerReports(stale_s=0.3)
    one = {"active_requests": 1, "queues": {}}
    reports.put(0, one)
    reports.put(1, {"active_requests": 5, "queues": {}})
    reports.put(1, {"active_requests": 2, "queues": {}})  # worker 1 started again
    assert reports.fresh() == {"0": one, "1": {"active_requests": 2, "queues": {}}}
    time.sleep(0.2)
    reports.put(0, one)
    time.sleep(0.2)  # worker 1 last heard 0.4 s ago
    assert reports.fresh() == {"0": one}


def test_a_worker_adds_the_others_reports_not_its_own() -> None:
    live = {
        "workers": {
            "0": {"active_requests": 9, "queues": {}},
            "1": {"active_requests": 2, "queues": {"open": {"in_flight": 2, "queued": 0}}},
            "2": {"active_requests": "lots", "queues": {}},  # not a report: left out
        }
    }
    assert others(live, 0) == [live["workers"]["1"]]
    assert others({"workers": []}, 0) == []


def _client() -> tuple[TestClient, GateRoutes]:
    routes = GateRoutes(Leases({}), TOKEN, breakers=lambda: {"mcp:crm": "closed"})
    return TestClient(internal_app(routes, None)), routes


def test_the_control_plane_keeps_each_workers_last_report_and_shows_them() -> None:
    client, _ = _client()
    report = {"active_requests": 2, "queues": {"open": {"in_flight": 2, "queued": 1}}}
    r = client.post("/state/live/3", content=orjson.dumps(report), headers=AUTH)
    assert r.status_code == 200, r.text
    r = client.get("/state/live", headers=AUTH)
    assert r.json() == {"workers": {"3": report}, "breakers": {"mcp:crm": "closed"}}


def test_the_control_plane_refuses_bad_reports_with_an_error_body_and_keeps_nothing() -> None:
    client, routes = _client()
    good = orjson.dumps({"active_requests": 1, "queues": {}})
    for path, body, headers, status in (
        ("/state/live/0", good, {}, 401),
        ("/state/live/0", good, {"authorization": "Bearer nope"}, 401),
        ("/state/live/-1", good, AUTH, 400),
        ("/state/live/1024", good, AUTH, 400),
        ("/state/live/" + "9" * 40, good, AUTH, 400),
        ("/state/live/%D9%A3", good, AUTH, 400),  # a digit, not an ASCII one
        ("/state/live/0", b"{", AUTH, 400),
        ("/state/live/0", b'{"active_requests": -1, "queues": {}}', AUTH, 400),
        ("/state/live/0", b"", AUTH, 400),
        ("/state/live/0", b"x" * (MAX_REPORT + 1), AUTH, 400),
    ):
        r = client.post(path, content=body, headers=headers)
        assert r.status_code == status, (path, body[:40], r.text)
        assert r.json()["error"]["message"]
        assert "Traceback" not in r.text
    assert routes.reports.fresh() == {}
    r = client.get("/state/live", headers={"authorization": "Bearer nope"})
    assert r.status_code == 401 and "workers" not in r.json()


def test_a_body_without_a_length_is_refused_once_it_passes_the_bound() -> None:
    """Sent in chunks (no content-length): counted as it arrives, refused past the
    bound, nothing kept."""
    client, routes = _client()

    def chunks() -> Any:
        yield b'{"active_requests": 1, "queues": {}, "pad": "'
        for _ in range(MAX_REPORT // 4096 + 2):
            yield b"x" * 4096
        yield b'"}'

    r = client.post("/state/live/0", content=chunks(), headers=AUTH)
    assert r.status_code == 400 and r.json()["error"]["message"] == "body too large"
    assert routes.reports.fresh() == {}
