"""/admin/engines and /admin/models/{alias}/weights, /promote, /rollback: the
residency pool and managed engines, and the deployment weights of a model with
several deployments (canaries), set through the control plane (control/weights.py)."""

from __future__ import annotations

import time
from typing import Any, Protocol

from starlette.requests import Request
from starlette.responses import Response

from switchyard.api.admin.guard import Guard
from switchyard.api.admin.params import as_json, read_fields
from switchyard.decide.balance import Balancer
from switchyard.engines.registry import Registry
from switchyard.errors import InvalidRequest, ModelNotFound

MAX_DEPLOYMENTS = 256  # names one weights change may give
MAX_NAME = 128  # characters of a deployment's name


class EngineServices(Protocol):
    registry: Registry
    balancers: dict[str, Balancer]

    def engines_report(self) -> dict[str, Any]: ...

    def set_weights(
        self, alias: str, weights: dict[str, float], reason: str
    ) -> dict[str, float]: ...


class Engines:
    """The engines' state and the models' deployment weights."""

    def __init__(self, services: EngineServices, guard: Guard) -> None:
        self.s = services
        self.guard = guard

    async def engines(self, request: Request) -> Response:
        """The residency pool, every managed engine (state, memory, adapters) and what
        each engine last said of its own load (engines.state_interval_s), by deployment."""
        self.guard(request)
        reg = self.s.registry
        now = time.monotonic()
        return as_json(
            {
                **self.s.engines_report(),  # of several workers: the control plane's
                "load": {
                    d.name: d.live.engine.describe(now)
                    for d in reg.every()
                    if d.live.engine is not None
                },
            }
        )

    def balancer(self, request: Request) -> Balancer:
        alias = request.path_params["alias"]
        b = self.s.balancers.get(alias)
        if b is None:
            raise ModelNotFound(f"the model '{alias[:128]}' has no deployments to weigh")
        return b

    async def model_weights(self, request: Request) -> Response:
        """GET: every deployment's weight now; POST {"weights": {name: w}, "reason"}."""
        self.guard(request)
        b = self.balancer(request)
        if request.method == "POST":
            body = await read_fields(request, ("weights", "reason"))
            weights = body.get("weights")
            if (
                not isinstance(weights, dict)
                or not 0 < len(weights) <= MAX_DEPLOYMENTS
                or not all(
                    isinstance(k, str)
                    and 0 < len(k) <= MAX_NAME  # echoed when unknown: bounded
                    and isinstance(v, int | float)
                    and not isinstance(v, bool)
                    and 0 <= v <= 1e6
                    for k, v in weights.items()
                )
            ):
                raise InvalidRequest(
                    f"'weights' must map at most {MAX_DEPLOYMENTS} deployment names "
                    f"({MAX_NAME} characters) to numbers from 0 to 1000000",
                    param="weights",
                )
            reason = body.get("reason")
            # Logged and kept in the weights' history: a newline or a terminal's control
            # sequence would forge lines there, so only printable text is taken.
            if reason is not None and not (isinstance(reason, str) and reason.isprintable()):
                raise InvalidRequest("'reason' must be printable text", param="reason")
            why = reason[:200] if reason else "set by the admin API"
            self.s.set_weights(b.alias, {k: float(v) for k, v in weights.items()}, why)
        return as_json({"model": b.alias, "weights": b.weights(), "config": b.config_weights()})

    async def model_move(self, request: Request) -> Response:
        """promote: the canaries take all the traffic; rollback: they take none."""
        self.guard(request)
        b = self.balancer(request)
        action = request.path_params["action"]
        if not b.canaries():
            raise InvalidRequest(f"the model '{b.alias}' has no canary deployment")
        weights = b.promote() if action == "promote" else b.rollback()
        self.s.set_weights(b.alias, weights, f"{action} by the admin API")
        return as_json({"model": b.alias, "weights": b.weights(), "config": b.config_weights()})

    async def model_move_checked(self, request: Request) -> Response:
        """promote: the canaries take all the traffic; rollback: they take none."""
        if request.path_params["action"] not in ("promote", "rollback"):
            self.guard(request)
            raise InvalidRequest("use /admin/models/{alias}/promote or /rollback")
        return await self.model_move(request)
