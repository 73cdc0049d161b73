"""A worker's view of its control plane (`serve --workers N`): what the control plane
reports of the engines, tool servers and revisions it runs, fetched every FOLLOW_S
from its internal server (api/internal.py), so each worker's /readyz says what one
gateway would. A worker that has not heard from its control plane for STALE_S is not
ready: its local models and tools are there."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import aiohttp
import orjson

from switchyard.control.components import Components
from switchyard.control.worker_live import worker_report
from switchyard.engines.bounded import read_bounded

log = logging.getLogger("switchyard")

FOLLOW_S = 1.0
STALE_S = 5.0
# Bytes of the control plane's report read at most (about 1 KB per model and engine):
# a broken control plane cannot make a worker hold an unbounded body. A report over it,
# or one that is not a JSON object, is as no answer: the view goes stale.
MAX_REPORT = 8 << 20


class ControlView(Components):
    control_view: dict[str, Any] | None = None  # the control plane's models report
    control_engines: dict[str, Any] | None = None  # its residency pool and engines
    _control_seen = 0.0

    def active_requests(self) -> int:
        """This process's requests between open and settle: the request driver's
        count (the composition root, gateway/, has the driver)."""
        raise NotImplementedError

    def engines_report(self) -> dict[str, Any]:
        """The residency pool and the managed engines: this process's own, or of a
        worker of several, the control plane's (where they run)."""
        if not self.role.worker:
            reg = self.registry
            return {
                "pool": reg.pool.describe(),
                "engines": {e.alias: e.describe() for e in reg.managed()},
            }
        if self.control_report() is None or self.control_engines is None:
            return {"pool": {}, "engines": {}, "control_plane": "unreachable"}
        return self.control_engines

    def control_report(self) -> dict[str, Any] | None:
        """The control plane's last report, or None when it is missing or stale."""
        if time.monotonic() - self._control_seen > STALE_S:
            return None
        return self.control_view

    async def _follow_control(self) -> None:
        """Every FOLLOW_S: the control plane's readiness report in, and this worker's
        own counts out (control/worker_live.py), so any worker's live view shows one
        gateway."""
        url = self.role.control_url + "/state/readiness"
        live_url = f"{self.role.control_url}/state/live/{self.role.index}"
        headers = {"authorization": f"Bearer {self.role.token}"}
        timeout = aiohttp.ClientTimeout(total=FOLLOW_S * 2)
        warned = False
        async with aiohttp.ClientSession(timeout=timeout) as session:
            while True:
                try:
                    report = worker_report(self.active_requests(), self.gates)
                    async with session.post(live_url, data=orjson.dumps(report), headers=headers):
                        pass  # what it answers says nothing this worker acts on
                    async with session.get(url, headers=headers) as r:
                        raw = await read_bounded(r, MAX_REPORT)
                    body = orjson.loads(raw) if r.status == 200 and raw is not None else None
                    if isinstance(body, dict) and isinstance(body.get("models"), dict):
                        self.control_view = body["models"]
                        engines = body.get("engines")
                        self.control_engines = engines if isinstance(engines, dict) else None
                        self._control_seen = time.monotonic()
                        warned = False
                except (aiohttp.ClientError, OSError, TimeoutError, orjson.JSONDecodeError) as exc:
                    if not warned:
                        log.warning("the control plane's readiness is unavailable: %s", exc)
                        warned = True
                await asyncio.sleep(FOLLOW_S)
