"""Deployments: how requests are spread over the registry's engines and upstreams.

The registry (engines/registry.py) and the executor (execute/executor.py) are built by
their own constructors; here are what sits between them and the stages: a balancer per
alias with several deployments (its canary guard's window shared when there is Redis),
a placer per alias placed at the edge or in the cloud, and a gate (concurrency, queue)
per model, which its adapters share.
"""

from __future__ import annotations

from collections.abc import Callable

from switchyard.config import SINGLE, ProcessRole, Settings
from switchyard.decide.balance import Balancer
from switchyard.decide.placement import Placer
from switchyard.engines.registry import Deployment, Registry, others_at
from switchyard.execute.executor import Executor
from switchyard.policy.admission import DeploymentGate
from switchyard.policy.admission_remote import RemoteGate
from switchyard.state.guard import GuardShare


def build_balancers(
    registry: Registry,
    executor: Executor,
    guard_share: GuardShare | None = None,
    on_cut: Callable[[str, Deployment, str], None] | None = None,
) -> dict[str, Balancer]:
    """An alias with several deployments picks one per request (decide/balance.py); its
    canary guard judges over every process's window through `guard_share`, and reports
    a cut judged there (not on a request) to `on_cut`."""
    balancers = {
        alias: Balancer(
            alias,
            deps,
            deps[0].model.balance,
            executor.breakers,
            guard_share=guard_share,
            on_cut=on_cut,
        )
        for alias, deps in registry.replicas.items()
    }
    # A true cycle: the balancers read the executor's breakers (which the executor
    # builds), and the executor's fallbacks and failover balance too.
    executor.balancers = balancers
    return balancers


def build_guard_share(settings: Settings) -> GuardShare | None:
    """The canary guards' windows shared by every gateway process, in Redis when
    `storage.redis_url` is set and a model has a guard (state/guard_redis.py); else None
    (each process judges its own)."""
    if settings.storage.redis_url and any(m.canary_guard for m in settings.models):
        from switchyard.state.guard_redis import SharedGuard  # Redis's client only when used

        return SharedGuard(settings.storage.redis_url, settings.storage.redis_timeout_s)
    return None


def build_placers(settings: Settings, balancers: dict[str, Balancer]) -> dict[str, Placer]:
    """Edge or cloud per request among an alias's deployments (decide/placement.py)."""
    return {
        m.alias: Placer(m.alias, m.placement)
        for m in settings.models
        if m.placement is not None and m.alias in balancers
    }


def build_gates(
    settings: Settings, registry: Registry, role: ProcessRole = SINGLE
) -> dict[str, DeploymentGate]:
    """Each model's concurrency gate and queue (policy/admission.py), by alias; an
    adapter's alias names its base's gate. In a worker of several, a gate with a
    concurrency limit is the control plane's (policy/admission_remote.py)."""
    gates: dict[str, DeploymentGate] = {
        m.alias: DeploymentGate(
            m.alias,
            m.limits.max_concurrency,
            m.limits.queue,
            settings.scheduling.policy,
            settings.scheduling.aging_s,
            settings.scheduling.admit_headroom,
        )
        for m in settings.models
    }
    # A true cycle: what a gate counts as other clients' load excludes its own
    # requests, which only the built gate can tell.
    for alias, gate in gates.items():  # other clients' load on its engines
        deps = registry.replicas.get(alias) or [registry.deployments[alias]]
        gate.others = others_at(deps, _in_flight(gate))
    if role.worker:
        for alias, gate in gates.items():
            if gate.max_concurrency is not None:
                remote = RemoteGate(gate, role.control_url, role.token, role.name)
                gates[alias] = remote  # type: ignore[assignment]  # the queue stage's interface
    for a in settings.adapters:  # an adapter runs in its base's slots
        gates[a.name] = gates[a.base]
    return gates


def _in_flight(gate: DeploymentGate) -> Callable[[], int]:
    """The requests holding `gate`'s slots now."""
    return lambda: gate.in_flight
