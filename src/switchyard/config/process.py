"""What one gateway process is among several (`switchyard serve --workers N`): not a
setting a user writes, but what the supervisor (scale/workers.py) tells each process it
starts, next to the settings.

- `single`: the one process of `switchyard serve` (the default): it owns everything.
- `control`: the control plane of N workers: it owns the managed engines, MCP stdio
  servers' lifecycle, retention, the first-run key and the deployment gates' state; it
  serves no client.
- `worker`: one of the N processes serving the port: everything a request needs runs
  here, and what must be counted once is asked of Redis (limits, budgets, tasks,
  breakers, the cache) or of the control plane (gates, engines).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True, slots=True)
class ProcessRole:
    kind: Literal["single", "control", "worker"] = "single"
    name: str = ""
    """Who holds this process's reservations and slots: `w{index}-{pid}-{run}` for a worker
    (a restarted worker is a new holder), `control` for the control plane."""
    index: int = 0
    """A worker's number (0..N-1), the same after a restart: what it owns that outlives
    it (its background responses) is named by it."""
    control_url: str = ""
    """A worker's way to the control plane's internal server (api/internal.py)."""
    token: str = ""
    """The bearer token of the control plane's internal server."""
    ledger_socket: str | None = None
    """The one ledger writer's socket, shared by every process; None: the process
    starts its own writer."""

    @property
    def worker(self) -> bool:
        return self.kind == "worker"


SINGLE = ProcessRole()
