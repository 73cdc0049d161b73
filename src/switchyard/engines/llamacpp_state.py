"""The names a managed engine's parts share: its lifecycle states and its adapter files.

`EngineState` is the supervisor's state machine (engines/llamacpp.py), read by the
residency pool (engines/pool.py) and the readiness report; `AdapterFile` is an adapter
an engine loads at start, identified by the sha256 of its file (`sha256_file`), which is
checked before every load.
"""

from __future__ import annotations

import enum
import hashlib
import os
from dataclasses import dataclass


def sha256_file(path: str | os.PathLike[str]) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


@dataclass(frozen=True, slots=True)
class AdapterFile:
    """An adapter an engine loads at start: its id in the server is its position."""

    name: str
    path: str
    sha256: str
    revision: str


class EngineState(enum.StrEnum):
    COLD = "cold"  # not loaded; the pool loads it on demand
    STARTING = "starting"  # process being spawned
    LOADING = "loading"  # process alive, model not yet answering
    READY = "ready"
    RESTARTING = "restarting"  # died; waiting out the backoff
    STOPPED = "stopped"
    FAILED = "failed"  # cannot start: file missing, or crashed max_crash_restarts times
