"""The control plane of one gateway: what acts on the components once the composition
root (switchyard.gateway) has built them. The data plane keeps serving with what it
has while this is slow or down.

    lifecycle.py   start and stop: engines, tool servers, background loops
    readiness.py   /readyz: required models, embeddings, router, tool servers
    retention.py   traces, rollouts, stored responses, tool-call records past retention
    busy.py        engine busy time for the cost report
    weights.py     deployment weights: canaries, promote / rollback, canary cuts
    cancels.py     agent task cancels, fanned out to the calls in flight
    revisions.py   RL revisions and rollouts in the store
    router.py      the semantic router, built once the embedding model has loaded
    components.py  the components it acts on, with their types

`ControlPlane` joins them; `Gateway` is a ControlPlane over the components it builds.
The admin API (api/admin/) and the CLI call these same methods and stores.
"""

from __future__ import annotations

from switchyard.control.busy import BUSY_FLUSH_S
from switchyard.control.cancels import Cancels
from switchyard.control.lifecycle import Lifecycle

__all__ = ["BUSY_FLUSH_S", "ControlPlane"]


class ControlPlane(Lifecycle, Cancels):
    """Start, stop, readiness and the operations on a running gateway (admin API)."""

    def __init__(self) -> None:
        self._busy_flushed = {}
