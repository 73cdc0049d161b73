"""/admin/models/{alias}/revisions: the revision lifecycle of an RL-managed model
(engines/revisions.py): register, validate, activate, roll back."""

from __future__ import annotations

import asyncio
import time
from typing import Any, Protocol

from starlette.requests import Request
from starlette.responses import Response

from switchyard.api.admin.guard import Guard
from switchyard.api.admin.params import as_json, read_fields
from switchyard.errors import InvalidRequest, ModelNotFound


class RevisionServices(Protocol):
    revisions: dict[str, Any]  # RevisionManager by alias (rl.models)


def wait_s(body: dict[str, Any]) -> float:
    """The body's `wait_s`: seconds from 0 to 600 (0 when absent), checked before any
    work is started, so a bad one leaves nothing behind."""
    value = body.get("wait_s", 0)
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value <= 600:
        raise InvalidRequest("'wait_s' must be a number of seconds from 0 to 600", param="wait_s")
    return float(value)


async def wait_for(rev: Any, seconds: float, states: tuple[str, ...]) -> None:
    """Answer once the revision reached one of `states`, or after `seconds`."""
    end = time.monotonic() + seconds
    while rev.state not in states and time.monotonic() < end:
        await asyncio.sleep(0.01)


class Revisions:
    """An RL-managed model's revisions."""

    def __init__(self, services: RevisionServices, guard: Guard) -> None:
        self.s = services
        self.guard = guard

    def revisions_of(self, request: Request) -> Any:
        manager = self.s.revisions.get(request.path_params["alias"])
        if manager is None:
            raise ModelNotFound(
                f"the model '{request.path_params['alias'][:128]}' has no managed revisions "
                "(rl.models)"
            )
        return manager

    async def revisions(self, request: Request) -> Response:
        """GET: the model's revisions; POST: register one (loaded, validated and, if
        asked, activated in the background; wait_s waits for the outcome)."""
        self.guard(request)
        manager = self.revisions_of(request)
        if request.method == "GET":
            return as_json(manager.describe())
        body = await read_fields(
            request, ("revision", "kind", "path", "sha256", "activate", "wait_s")
        )
        seconds = wait_s(body)
        rev = await manager.register({k: v for k, v in body.items() if k != "wait_s"})
        target = ("active", "rejected") if body.get("activate") else ("validated", "rejected")
        await wait_for(rev, seconds, target)
        return as_json(rev.describe(), 201)

    async def revision(self, request: Request) -> Response:
        """One revision of an RL-managed model: its state, checks and provenance."""
        self.guard(request)
        return as_json(self.revisions_of(request).get(request.path_params["revision"]).describe())

    async def revision_activate(self, request: Request) -> Response:
        """Make a validated revision the one new requests lease."""
        self.guard(request)
        manager = self.revisions_of(request)
        rev = await manager.activate(request.path_params["revision"])
        return as_json({**manager.describe(), "activated": rev.revision})

    async def revision_rollback(self, request: Request) -> Response:
        """Go back to the previously active revision."""
        self.guard(request)
        manager = self.revisions_of(request)
        rev = await manager.rollback()
        return as_json({**manager.describe(), "activated": rev.revision})
