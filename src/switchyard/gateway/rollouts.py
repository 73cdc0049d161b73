"""RL serving (rl.models): a revision manager per RL-managed model and the rollout
service (rollouts.py, POST /v1/rollouts) over them.

The managers are built before the pipelines, which send an RL-managed alias's chat and
completions to its active revision; the rollout service after the request service,
which it drives.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from switchyard.config import Settings
from switchyard.observe.metrics import Metrics
from switchyard.policy.pii import PiiMasker
from switchyard.policy.stages import Reserver
from switchyard.service import RequestService

Persist = Callable[[dict[str, Any]], Awaitable[None]]
StoreRecords = Callable[[list[dict[str, Any]]], Awaitable[None]]


def build_revisions(
    settings: Settings, metrics: Metrics | None, persist: Persist
) -> dict[str, Any]:
    """A revision manager (engines/revisions.py) per RL-managed model, by alias;
    `persist` stores a revision's row."""
    from switchyard.engines.revisions import RevisionManager

    revisions: dict[str, Any] = {}
    by_alias = {m.alias: m for m in settings.models}
    for alias, rl_model in settings.rl.models.items():
        manager = RevisionManager(
            by_alias[alias],
            rl_model,
            settings.rl,
            settings.engines.max_crash_restarts,
            persist,
            metrics.revision_event if metrics is not None else None,
        )
        revisions[alias] = manager
    return revisions


def build_rollouts(
    settings: Settings,
    service: RequestService,
    reserver: Reserver,
    revisions: dict[str, Any],
    store_records: StoreRecords | None,
    pii: PiiMasker,
) -> Any:
    """The rollout service, when any model is RL-managed (rl.models)."""
    from switchyard.rollouts import RolloutService

    if not settings.rl.models:
        return None
    return RolloutService(
        settings,
        service,
        reserver,
        revisions,
        store_records,
        pii.mask,
        pii.contains_pii,
    )
