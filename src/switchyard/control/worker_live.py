"""What each worker counts of its own (`serve --workers N`), reported to the control
plane so that any worker's /admin/live shows one gateway.

A worker's requests in flight and the counts of its gates without a `max_concurrency`
(those admit locally, policy/admission_remote.py) live in that worker alone. Each
worker sends them with its follow of the control plane (control/follow.py, every
FOLLOW_S); the control plane keeps the last report of each worker by its number, so a
restarted worker replaces its own, and one not heard from for STALE_S (a worker that
died) drops out. A worker's live view adds the other workers' last reports to its own
counts of now: the others' are at most about a second old.

The control plane reads what workers send as untrusted input: bounded in size, and a
report that is not the shape below is refused whole (400), never half kept.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from switchyard.policy.admission_remote import RemoteGate, control_json

STALE_S = 5.0
MAX_REPORT = 256 << 10  # bytes of one report: about 2,000 gates
MAX_GATES = 2048
MAX_NAME = 256
MAX_WORKERS = 1024  # worker numbers 0..MAX_WORKERS-1 (serve --workers caps far lower)
LIVE_TIMEOUT_S = 2.0
MAX_LIVE = MAX_WORKERS * 4096  # bytes of the control plane's answer read at most


class BadReport(ValueError):
    """A worker's report that is not the shape a report has."""


def _count(value: object) -> bool:
    return type(value) is int and 0 <= value < 1 << 31


def worker_report(active: int, gates: Mapping[str, Any]) -> dict[str, Any]:
    """This worker's own counts: its requests in flight, and each gate's that admits
    locally (no `max_concurrency`: not a RemoteGate, whose slots the control plane
    counts itself)."""
    return {
        "active_requests": active,
        "queues": {
            name: {"in_flight": g.in_flight, "queued": g.queued}
            for name, g in gates.items()
            if not isinstance(g, RemoteGate)
        },
    }


def report_of(data: object) -> dict[str, Any]:
    """A worker's report (parsed JSON, at most MAX_REPORT bytes of it: api/internal.py
    reads it) checked for its shape: a copy of what it counts, or BadReport."""
    if not isinstance(data, dict) or not _count(data.get("active_requests")):
        raise BadReport("active_requests: a count is required")
    queues = data.get("queues")
    if not isinstance(queues, dict) or len(queues) > MAX_GATES:
        raise BadReport(f"queues: an object of at most {MAX_GATES} gates")
    out: dict[str, dict[str, int]] = {}
    for name, q in queues.items():
        if len(name) > MAX_NAME:
            raise BadReport("queues: a gate's name is too long")
        if not (isinstance(q, dict) and _count(q.get("in_flight")) and _count(q.get("queued"))):
            raise BadReport("queues: each gate has in_flight and queued counts")
        out[name] = {"in_flight": q["in_flight"], "queued": q["queued"]}
    return {"active_requests": data["active_requests"], "queues": out}


class WorkerReports:
    """The control plane's last report of each worker, by the worker's number."""

    def __init__(self, stale_s: float = STALE_S) -> None:
        self.stale_s = stale_s
        self._last: dict[int, tuple[float, dict[str, Any]]] = {}

    def put(self, index: int, report: dict[str, Any]) -> None:
        self._last[index] = (time.monotonic(), report)

    def fresh(self) -> dict[str, dict[str, Any]]:
        """Every worker's report heard within `stale_s`, by its number (as text: a
        JSON object's keys); the stale ones are forgotten."""
        cutoff = time.monotonic() - self.stale_s
        for index in [i for i, (seen, _) in self._last.items() if seen < cutoff]:
            del self._last[index]
        return {str(i): r for i, (_, r) in sorted(self._last.items())}


def others(live: Mapping[str, Any], index: int) -> list[dict[str, Any]]:
    """The other workers' reports in the control plane's answer (`/state/live`), read
    as untrusted: a report not of a report's shape is left out."""
    workers = live.get("workers")
    out: list[dict[str, Any]] = []
    for key, report in (workers if isinstance(workers, dict) else {}).items():
        if key == str(index):
            continue  # this worker's own counts are read now, not as last reported
        try:
            out.append(report_of(report))
        except BadReport:
            continue
    return out


async def host_live(
    control_url: str, token: str, timeout_s: float = LIVE_TIMEOUT_S
) -> dict[str, Any] | None:
    """The control plane's `/state/live` (the workers' last reports, its tool servers'
    breakers), or None when it does not answer in `timeout_s` or sends more than
    MAX_LIVE bytes."""
    data = await control_json(control_url, "/state/live", token, MAX_LIVE, timeout_s, "live counts")
    return data if isinstance(data, dict) else None
