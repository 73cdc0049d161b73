"""Engine busy time: each local engine's busy seconds, stored every BUSY_FLUSH_S for
the build-vs-buy report (observe/cost.py)."""

from __future__ import annotations

import asyncio
import logging
import time

from switchyard.control.components import Components
from switchyard.observe.cost import record_busy

log = logging.getLogger("switchyard")
BUSY_FLUSH_S = 10.0  # how often engine busy time goes to the store (observe/cost.py)


class BusyTime(Components):
    _busy_flushed: dict[str, float]  # engine alias -> busy seconds stored

    async def _busy_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(BUSY_FLUSH_S)
            try:
                await loop.run_in_executor(None, self.flush_busy)
            except Exception as exc:  # a missed flush is added to the next one
                log.warning("could not record engine busy time: %s", exc)

    def flush_busy(self) -> None:
        """Store each local engine's busy seconds since the last flush (cost report)."""
        now, wall = time.monotonic(), time.time()
        deltas = []
        for e in self.registry.managed():
            total = e.busy_now(now)
            delta = total - self._busy_flushed.get(e.alias, 0.0)
            if delta > 0:
                deltas.append((e.alias, total, delta))
        if not deltas:
            return
        with self.store.connection() as conn:
            conn.execute("BEGIN IMMEDIATE")
            try:
                for alias, _, delta in deltas:
                    record_busy(conn, alias, wall, delta)
                conn.execute("COMMIT")
            except BaseException:
                conn.execute("ROLLBACK")
                raise
        for alias, total, _ in deltas:
            self._busy_flushed[alias] = total
