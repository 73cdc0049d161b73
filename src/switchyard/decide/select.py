"""Deployment selection: which configured deployment serves a model alias.

Pure: takes the alias and the deployments, returns the choice and the evidence.
Canary weights, health and region arrive with later capabilities; the shape of the
decision does not change.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from switchyard.engines.registry import Deployment
from switchyard.errors import ModelNotFound
from switchyard.outcomes import Kind, Tagged, tagged


@dataclass(frozen=True, slots=True)
class Selection:
    deployment: Deployment
    outcome: Tagged  # deployment:<alias>
    reason: str
    evidence: dict[str, Any]


def select_deployment(alias: str, deployments: Mapping[str, Deployment]) -> Selection:
    dep = deployments.get(alias)
    if dep is None:
        raise ModelNotFound.unknown(alias)
    evidence = {
        "candidates": [alias],
        "upstream": dep.label,
        "revision": dep.model.revision,
        "ready": dep.ready,
        "fallbacks": list(dep.model.fallbacks),
    }
    # Readiness is the executor's call: an unready model may still fall back.
    return Selection(dep, tagged(Kind.DEPLOYMENT, alias), "only deployment of the alias", evidence)
