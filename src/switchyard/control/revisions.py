"""RL revisions and rollouts in the store: a revision manager's rows written as its
revisions change, read back at start (each manager brings its revisions up again),
and the rollout records written behind their replies (observe/rollouts.py)."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from switchyard.control.components import Components

log = logging.getLogger("switchyard")


class RevisionRecords(Components):
    async def _persist_revision(self, row: dict[str, Any]) -> None:
        from switchyard.observe.rollouts import write_revision

        def write() -> None:
            with self.store.connection() as conn:
                write_revision(conn, row)

        await asyncio.to_thread(write)

    async def _store_rollouts(self, records: list[dict[str, Any]]) -> None:
        from switchyard.observe.rollouts import write_rollouts

        def write() -> None:
            with self.store.connection() as conn:
                write_rollouts(conn, records)

        await asyncio.to_thread(write)

    async def _boot_revisions(self) -> None:
        from switchyard.observe.rollouts import read_revisions

        def read() -> list[dict[str, Any]]:
            with self.store.connection() as conn:
                return read_revisions(conn)

        stored = await asyncio.to_thread(read)
        for alias, manager in self.revisions.items():
            try:
                await manager.boot([r for r in stored if r["alias"] == alias])
            except Exception:
                log.exception("the revisions of %s could not be brought up", alias)
