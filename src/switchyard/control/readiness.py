"""Readiness (/readyz, the CLI's start banner): whether every required model can
serve, the embedding model is loaded and the router (if on) is built; what each
model, deployment, revision and tool server reports."""

from __future__ import annotations

import time
from typing import Any

from switchyard.config import ModelConfig, OpenAIEngine
from switchyard.control.follow import ControlView


class Readiness(ControlView):
    def readiness(self) -> tuple[bool, dict[str, Any]]:
        """Ready when every required model (models[].required, default all) can serve,
        the embedding model is loaded and the router (if on) is built."""
        now = time.monotonic()
        models = {}
        ready = True
        for alias, d in self.registry.deployments.items():
            deps = self.registry.replicas.get(alias)
            if deps is not None:  # several deployments: serviceable while one is
                each = {}
                for r in deps:
                    each[r.replica.name if r.replica else r.name] = {
                        **r.describe(),
                        "breaker": self.executor.breakers[r.name].describe(now),
                    }
                up = any(r.ready or r.loadable for r in deps)
                models[alias] = {
                    "kind": "deployments",
                    "ready": up,
                    "strategy": d.model.balance.strategy,
                    "required": d.model.required,
                    "deployments": each,
                }
                if d.model.required and not up:
                    ready = False
                continue
            models[alias] = d.describe()
            models[alias]["breaker"] = self.executor.breakers[alias].describe(now)
            if d.model.required and not (d.ready or d.loadable):
                ready = False
        for alias, manager in self.revisions.items():
            active = manager.active
            up = active is not None and active.engine is not None and active.engine.ready
            models[f"{alias} (rollouts)"] = {
                "kind": "rl",
                "ready": up,
                "active_revision": active.revision if active is not None else None,
            }
            ready = ready and up
        if self.embedder is not None:
            models[self.settings.embeddings.alias] = self.embedder.describe()
            ready = ready and self.embedder.ready
        if self.mcp is not None:  # reported; a tool server down fails only its own calls
            for name, server in self.mcp.servers.describe().items():
                models[f"mcp:{name}"] = server
        if self.settings.router.enabled:
            models["router"] = {
                "ready": self.router is not None,
                "policy_version": self.settings.router.policy_version,
            }
            ready = ready and self.router is not None
        if self.role.worker:
            ready = self._with_control(models) and ready
        return ready, models

    def _with_control(self, models: dict[str, Any]) -> bool:
        """Of several workers: the control plane's report for what runs there (local
        models and their adapters, tool servers), this worker's breakers kept; not
        ready while the control plane is not heard from (control/follow.py)."""
        report = self.control_report()
        if report is None:
            models["control_plane"] = {"ready": False, "state": "unreachable"}
            return False
        ready = True
        for key, entry in report.items():
            if key.startswith("mcp:"):
                models[key] = entry
                continue
            d = self.registry.deployments.get(key)
            if d is None or key not in models or not self._runs_there(d.model):
                continue
            own = models[key]
            models[key] = {**entry, "breaker": own["breaker"]} if "breaker" in own else entry
            if d.model.required and not entry.get("ready"):
                ready = False
        return ready

    def _runs_there(self, model: ModelConfig) -> bool:
        """Whether `model` (or one of its deployments) is served by the control plane's
        engine front."""
        front = self.role.control_url
        return any(
            isinstance(e, OpenAIEngine) and e.base_url.startswith(front)
            for e in [model.engine, *(x.engine for x in model.deployments)]
        )

    def startup_settled(self) -> bool:
        """Every model has an outcome: ready, or failed and no longer restarted; so
        what start produced can be told to the user (cli's banner)."""
        for d in self.registry.every():
            if d.engine is not None and not (d.ready or d.failed or d.loadable):
                return False
        if self.embedder is not None and self.embedder.state in ("loading", "stopped"):
            return False
        if self.settings.router.enabled and self.router is None:
            return self.embedder is not None and not self.embedder.ready
        return True

    def failed_models(self) -> dict[str, str]:
        """Models that cannot serve, with the reason in plain words."""
        out: dict[str, str] = {}
        for d in self.registry.every():
            if d.failed and d.engine is not None and d.adapter is None:
                out[d.name] = d.engine.reason or d.engine.last_error or "unknown"
        if self.embedder is not None and self.embedder.state == "failed":
            out[self.settings.embeddings.alias] = self.embedder.last_error or "unknown"
        return out
