"""Deployment weights of the models with several deployments (canaries): set by the
admin API (promote, rollback, explicit weights), cut by the selector when a canary
fails its checks, stored (state/weights.py) and read back by every gateway process."""

from __future__ import annotations

import asyncio
import logging

from switchyard.control.components import Components
from switchyard.decide.balance import ROLLED_BACK
from switchyard.engines.registry import Deployment
from switchyard.errors import InvalidRequest, ModelNotFound
from switchyard.state.weights import REFRESH_S as WEIGHTS_REFRESH_S
from switchyard.state.weights import cut_weight, read_weights, write_weights

log = logging.getLogger("switchyard")


class Weights(Components):
    def refresh_weights(self) -> None:
        """Apply the weights stored by any process (state/weights.py)."""
        with self.store.connection() as conn:
            stored = read_weights(conn)
        for alias, rows in stored.items():
            b = self.balancers.get(alias)
            if b is not None:
                changed = b.set_weights({n: r["weight"] for n, r in rows.items()})
                for name, w in changed.items():
                    log.info(
                        "deployment %s: weight %g (%s)",
                        name,
                        w,
                        rows[name.split("/")[-1]]["reason"],
                    )

    async def _weights_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(WEIGHTS_REFRESH_S)
            try:
                await loop.run_in_executor(None, self.refresh_weights)
            except Exception as exc:  # a locked or missing table must not stop the gateway
                log.warning("reading deployment weights failed: %s", exc)

    def set_weights(self, alias: str, weights: dict[str, float], reason: str) -> dict[str, float]:
        """Set and store an alias's weights (admin API); returns them all, by name."""
        b = self.balancers.get(alias)
        if b is None:
            raise ModelNotFound(f"the model '{alias}' has no deployments to weigh")
        names = {d.replica.name for d in b.deployments if d.replica is not None}
        unknown = sorted(set(weights) - names)
        if unknown:
            raise InvalidRequest(
                f"unknown deployments of '{alias}': {', '.join(unknown)} "
                f"(it has: {', '.join(sorted(names))})",
                param="weights",
            )
        if not any(w > 0 for w in {**b.weights(), **weights}.values()):
            raise InvalidRequest(
                "at least one deployment must keep a positive weight", param="weights"
            )
        with self.store.connection() as conn:
            write_weights(conn, alias, weights, reason)
        b.set_weights(weights)
        log.warning("model %s: weights %s (%s)", alias, weights, reason)
        return b.weights()

    def _canary_cut(self, alias: str, dep: Deployment, why: str) -> None:
        """A canary this process's guard cut (its weight here is 0 already): stored for
        every process, and logged and counted by the one whose write cut it
        (`cut_weight`), so N workers finding one breach report it once. A store that
        fails still gets the cut reported here."""
        short = dep.replica.name if dep.replica is not None else dep.name
        b = self.balancers.get(alias)
        # A cut that left nothing rolled the alias back here (Balancer.rolled_back):
        # stored too, or every process's refresh would read the promote's zeros again.
        rollback = b.rollback() if b is not None and why.endswith(ROLLED_BACK) else None

        def store() -> bool:
            with self.store.connection() as conn:
                cut = cut_weight(conn, alias, short, why)
                if rollback is not None:
                    write_weights(conn, alias, rollback, why)
                return cut

        def stored(fut: asyncio.Future[bool]) -> None:
            exc = fut.exception()
            if exc is not None:
                log.error("storing a deployment weight failed: %s", exc)
            elif not fut.result():
                log.info(
                    "model %s: %s was cut by another gateway process already (here: %s)",
                    alias,
                    dep.name,
                    why,
                )
                return
            log.error("model %s: %s", alias, why)
            if self.metrics is not None:
                self.metrics.canary_cuts.labels(alias, dep.name).inc()

        asyncio.get_running_loop().run_in_executor(None, store).add_done_callback(stored)
