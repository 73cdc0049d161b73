"""Retention: traces, rollouts, stored responses, finished tool calls' records and
`Idempotency-Key` replies older than their settings allow are removed in the
background, and the store kept under its disk cap (observe.max_disk_mb)."""

from __future__ import annotations

import asyncio
import logging
import time

from switchyard.control.components import Components
from switchyard.state.idempotency import forget_expired
from switchyard.state.responses import enforce_response_retention
from switchyard.state.traces import enforce_disk, enforce_retention

log = logging.getLogger("switchyard")


class Retention(Components):
    async def _retention_loop(self) -> None:
        obs = self.settings.observe
        loop = asyncio.get_running_loop()
        while True:
            try:
                if self.settings.storage.backend == "memory":  # no disk to wait for
                    n = self.enforce_retention()
                else:
                    n = await loop.run_in_executor(None, self.enforce_retention)
                if n:
                    log.info(
                        "retention removed %d records (traces, rollouts, stored responses,"
                        " idempotency replies)",
                        n,
                    )
            except Exception as exc:  # retention must never take the gateway down
                log.warning("retention failed: %s", exc)
            if self.embedder is not None:
                await loop.run_in_executor(None, self.embedder.mark_in_use)
            await asyncio.sleep(obs.retention_interval_s)

    def enforce_retention(self, now: float | None = None) -> int:
        """Remove what is past its retention (and over the disk cap); how many records."""
        obs = self.settings.observe
        with self.store.connection() as conn:
            n = enforce_retention(conn, obs.traces_retention_days, obs.traces_max_rows, now)
            if self.settings.rl.models:
                from switchyard.observe.rollouts import enforce_rollout_retention

                n += enforce_rollout_retention(conn, self.settings.rl.retention_days, now)
            n += enforce_response_retention(conn, self.settings.responses.retention_days, now)
            # Replies past idempotency.ttl_s answer no repeat: gone, not kept for ever.
            n += forget_expired(conn, self.settings.idempotency.ttl_s, now)
            if self.mcp is not None:  # finished tool calls' records, with their results
                n += self.mcp.records.forget_before(
                    conn, (now or time.time()) - obs.traces_retention_days * 86400
                )
            if self.settings.storage.backend == "memory":
                return n
            return n + enforce_disk(conn, int(obs.max_disk_mb * 1024 * 1024))
