"""What the control plane acts on: the components the composition root
(switchyard.gateway) builds, named with their types so each concern's module can
use them."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from switchyard.config import ProcessRole, Settings
from switchyard.decide.balance import Balancer
from switchyard.decide.cache import ResponseCache
from switchyard.decide.candidate import CandidateCheck
from switchyard.embed import EmbeddingService
from switchyard.engines.registry import Registry
from switchyard.execute.executor import Executor
from switchyard.media.process import MediaProcessor
from switchyard.observe.metrics import Metrics
from switchyard.observe.otel import Tracing
from switchyard.policy.auth import Authenticator
from switchyard.policy.cost import PromptOverhead
from switchyard.policy.tasks import Running
from switchyard.state.guard import GuardShare
from switchyard.state.keys import KeyStore
from switchyard.state.limits import Limiter
from switchyard.state.responses import ResponseStore
from switchyard.state.store import Store
from switchyard.state.tasks import TaskKey, TaskStore

if TYPE_CHECKING:
    from switchyard.state.affinity_redis import SessionAffinity
    from switchyard.state.overhead_redis import SharedOverhead


class Components:
    """The built components the control plane starts, stops and reports on."""

    settings: Settings
    role: ProcessRole
    registry: Registry
    revisions: dict[str, Any]  # RevisionManager by alias (engines/revisions.py)
    embedder: EmbeddingService | None
    store: Store
    keys: KeyStore
    responses: ResponseStore
    limiter: Limiter
    metrics: Metrics | None
    tracing: Tracing | None
    executor: Executor
    balancers: dict[str, Balancer]
    cache: ResponseCache | None
    router: Any  # decide/router.py's Router once built (control/router.py), else None
    dev_key: str | None
    tasks: TaskStore
    running: Running
    media: MediaProcessor | None
    candidates: CandidateCheck | None
    mcp: Any  # the MCP tool gateway (mcp_service/), None without tool servers
    overhead: PromptOverhead
    overhead_share: SharedOverhead | None
    auth: Authenticator  # its verified keys, and the key changes of other processes
    sessions: SessionAffinity | None
    guard_share: GuardShare | None  # the canary guards' windows shared (state/guard.py)
    gates: dict[str, Any]  # DeploymentGate (or a worker's RemoteGate) by alias

    def stop_task(self, key: TaskKey) -> list[str]:
        """A cancelled task here: its calls in flight are stopped (their ids), and every
        model's queue gate stops counting its remaining planned steps as admitted work,
        which would otherwise refuse new tasks 503 `overloaded` until the cancelled
        task's own deadline (policy/admission.py)."""
        stopped = self.running.stop(key)
        for gate in self.gates.values():  # an adapter's alias names its base's gate
            forget = getattr(gate, "forget_task", None)  # a worker's RemoteGate has none
            if forget is not None:
                forget(key)
        return stopped
