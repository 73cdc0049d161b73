"""The stage pipelines: the stages of policy/stages.py and decide/stages.py, in order.

`build_pipelines` orders one gateway's components into the generation pipeline (chat,
completions, Responses, Messages) and the embeddings pipeline that the request service
(service.py) runs for every request. It builds nothing that outlives the pipelines
except the defaults it fills in (a task store, the calls in flight, the prompt overhead).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from switchyard.config import Price, Settings
from switchyard.decide.balance import Balancer
from switchyard.decide.cache import ResponseCache
from switchyard.decide.candidate import CandidateCheck
from switchyard.decide.candidate import from_config as candidate_check
from switchyard.decide.placement import Placer
from switchyard.decide.stages import (
    Cache,
    CachePlanner,
    Embed,
    Place,
    Residency,
    Route,
    Select,
    Tools,
)
from switchyard.embed import EmbeddingService
from switchyard.engines.pool import EnginePool
from switchyard.engines.registry import Deployment
from switchyard.execute.embeddings import pii_stages
from switchyard.media.process import MediaProcessor
from switchyard.media.stage import Media
from switchyard.observe.metrics import Metrics
from switchyard.pipeline import Pipeline, Pipelines
from switchyard.policy.admission import DeploymentGate
from switchyard.policy.cost import PromptOverhead
from switchyard.policy.pii import PiiMasker
from switchyard.policy.stages import (
    Admit,
    Authorize,
    ConsumeApproval,
    ConsumedApprovals,
    DeploymentLimits,
    GiveBackApprovals,
    Pii,
    Queue,
    Reserver,
    Task,
    ToolResults,
    Window,
    embedding_estimate,
    generation_estimate,
)
from switchyard.policy.tasks import Running
from switchyard.policy.tool_calls import ToolPolicy
from switchyard.state.tasks import TaskStore
from switchyard.state.tasks_memory import MemoryTaskStore


def _counted_estimate(_: Any) -> tuple[int, int, None]:
    """A count reserves no tokens and costs nothing: it is one call of the key's."""
    return 0, 0, None


async def _no_approvals(*_: Any) -> tuple[str | None, str | None]:
    return None, "no approval store"


def build_pipelines(
    s: Settings,
    deployments: Mapping[str, Deployment],
    reserver: Reserver,
    gates: Mapping[str, DeploymentGate],
    masker: PiiMasker,
    cache: ResponseCache | None,
    embedder: EmbeddingService | None,
    router: Callable[[], Any],
    register_block: Callable[[list[Any]], str] | None = None,
    media: MediaProcessor | None = None,
    metrics: Metrics | None = None,
    pool: EnginePool | None = None,
    balancers: Mapping[str, Balancer] | None = None,
    tasks: TaskStore | None = None,
    running: Running | None = None,
    consume_approval: ConsumeApproval | None = None,
    placers: Mapping[str, Placer] | None = None,
    overhead: PromptOverhead | None = None,
    revisions: Mapping[str, Any] | None = None,
    consumed_approvals: ConsumedApprovals | None = None,
    give_back_approvals: GiveBackApprovals | None = None,
    check: CandidateCheck | None = None,
    on_canary_cut: Callable[[str, Deployment, str], None] | None = None,
    sessions: Any = None,
) -> Pipelines:
    """The stages, in order (DESIGN.md: the request pipeline). Evidence that is the
    same for every request of a model is built once and shared (recorded evidence
    is never changed afterwards)."""
    models = {m.alias: m for m in s.served_models()}
    named = {m.alias: {"model": m.alias} for m in s.models}
    routed = s.router.routed_aliases if s.router.enabled else ()
    overhead = overhead or PromptOverhead(s.policy.prompt_overhead_tokens)
    estimate = generation_estimate(models, {a: [r.model for r in s.router.routes] for a in routed})
    planner = CachePlanner(s, revisions)
    t = s.tasks
    tasks = tasks or MemoryTaskStore(t.max_tasks, t.idle_ttl_s, t.max_tool_calls)
    running = running or Running()
    embed_estimate = embedding_estimate(
        Price(input=s.embeddings.price, output=0.0),
        (lambda: embedder.max_tokens) if embedder is not None else (lambda: None),
    )
    # The checks a semantic candidate must pass (decide/candidate.py), loaded once (the
    # gateway passes its own, which a background build may complete: encoder_build.py).
    if check is None and cache is not None and s.cache.semantic:
        check = candidate_check(s.cache, s.embeddings)
    if cache is not None:
        cache.checks = check.describe() if check is not None else "exact hits only"
    generation = Pipeline(
        [
            # First: it reads the body (the size of what is asked), so the static
            # stages after it fold into one block.
            Window(s, models, overhead),
            Authorize(named, {a.name: a for a in s.adapters}, routed),
            ToolResults(
                ToolPolicy(s.tools),
                tasks,
                consume_approval or _no_approvals,
                consumed_approvals,
                give_back_approvals,
            ),
            Task(s, tasks, running, estimate),
            Admit(reserver, estimate),
            Pii(s, masker, cache is not None),
            Embed(s, embedder, cache, planner, router),
            Cache(s, cache, planner, check, embedder),
            Route(s, router, named),
            Tools(s, embedder, ToolPolicy(s.tools) if s.tools.check_outputs else None),
            Select(
                deployments,
                balancers,
                tasks,
                placers,
                metrics.placed if metrics else None,
                metrics,
                on_canary_cut,
                sessions,
            ),
            *([Media(media, metrics)] if media is not None else []),
            DeploymentLimits(reserver, estimate),
            Queue(gates),
            *([Residency(pool, revisions)] if pool is not None else []),
            Place(),
        ],
        models,
        # An alias with several deployments has none fixed: its stages look at the
        # one select chose for each request.
        {a: d for a, d in deployments.items() if a not in (balancers or {})},
        register_block,
    )
    alias = s.embeddings.alias
    embeddings = Pipeline(
        [
            Authorize({alias: {"model": alias}}),
            Task(s, tasks, running, embed_estimate),
            Admit(reserver, embed_estimate),
            *pii_stages(s, masker),  # `block` refuses PII; other modes embed as sent
        ]
    )
    # A request whose tokens are counted (`messages/count_tokens`): the model's rules and
    # the key's and tenant's limits as for a generation, reserving nothing but the call.
    counting = Pipeline(
        [
            Authorize(named, {a.name: a for a in s.adapters}, routed),
            Admit(reserver, _counted_estimate),
        ]
    )
    # A call that names no model (a stored response read, deleted or cancelled): the
    # key's and tenant's limits, reserving nothing but the call.
    calls = Pipeline([Admit(reserver, _counted_estimate)])
    return Pipelines(generation, embeddings, counting, calls)
