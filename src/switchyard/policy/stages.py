"""Policy stages: authorize, tool_results, task, admit (key and tenant limits), PII
masking, deployment limits and the deployment's queue.

Each stage's `static` is the one place that says when it decides the same for every
request of a View (pipeline.View); `work` handles the rest (see pipeline.Stage).

The authorize stage lives here; each other family in its own module beside it, and
this module names them all (what the pipelines and the services import):
stages_admission.py (window, admit, deployment_limits, their shared Reserver and the
estimates), stages_queue.py (queue), stages_pii.py (pii), stages_task.py (task and the
task's refusals), stages_tool_results.py (tool_results).
"""

from __future__ import annotations

import time
from collections.abc import Collection, Mapping
from typing import Any

from switchyard import outcomes
from switchyard.config import AdapterConfig
from switchyard.errors import AdapterNotAllowed, ModelNotFound
from switchyard.pipeline import RequestContext, Stage, Verdict, View
from switchyard.policy.auth import authorize_model
from switchyard.policy.stages_admission import NO_LIMITS as NO_LIMITS
from switchyard.policy.stages_admission import Admit as Admit
from switchyard.policy.stages_admission import DeploymentLimits as DeploymentLimits
from switchyard.policy.stages_admission import Estimate as Estimate
from switchyard.policy.stages_admission import Reserver as Reserver
from switchyard.policy.stages_admission import SpentSince as SpentSince
from switchyard.policy.stages_admission import Window as Window
from switchyard.policy.stages_admission import embedding_estimate as embedding_estimate
from switchyard.policy.stages_admission import generation_estimate as generation_estimate
from switchyard.policy.stages_admission import minimal_answer as minimal_answer
from switchyard.policy.stages_pii import Pii as Pii
from switchyard.policy.stages_queue import NO_WAIT as NO_WAIT
from switchyard.policy.stages_queue import Queue as Queue
from switchyard.policy.stages_task import Task as Task
from switchyard.policy.stages_task import task_error as task_error
from switchyard.policy.stages_task import task_refusal_reason as task_refusal_reason
from switchyard.policy.stages_tool_results import ConsumeApproval as ConsumeApproval
from switchyard.policy.stages_tool_results import ConsumedApprovals as ConsumedApprovals
from switchyard.policy.stages_tool_results import GiveBackApprovals as GiveBackApprovals
from switchyard.policy.stages_tool_results import ToolResults as ToolResults
from switchyard.request import UNKNOWN_MODEL

UNKNOWN_EVIDENCE = {"model": UNKNOWN_MODEL}


class Authorize(Stage):
    """The key may use the model. `named` holds the models this pipeline serves, with
    the evidence recorded for each (built once, shared by every request)."""

    name = "authorize"
    ROUTED = Verdict(outcomes.Authorize.SKIP, "a routed alias: the router chooses the model")

    def __init__(
        self,
        named: Mapping[str, dict[str, Any]],
        adapters: Mapping[str, AdapterConfig] | None = None,
        routed: Collection[str] = (),
    ) -> None:
        # `routed`: the aliases the router owns (decide/stages.py Route), which name no
        # model of their own; any other name outside `named` is refused here, first, so
        # a request for a model there is none of costs no admission, PII scan or cache.
        self._routed = frozenset(routed)
        self._named = dict(named)
        self._adapters = dict(adapters or {})
        for name, a in self._adapters.items():
            self._named[name] = {"model": name, "adapter": name, "base": a.base}
        self._allowed = {
            a: Verdict(outcomes.Authorize.ALLOWED, "the key may use this model", e)
            for a, e in self._named.items()
        }

    def static(self, view: View) -> Verdict | None:
        allowed = self._allowed.get(view.alias or "")
        if allowed is None:
            # Unknown models are 404 for everyone (work); no need to reveal key scopes.
            return self.ROUTED if view.alias in self._routed else None
        if not view.principal.may_use(view.alias or ""):
            return None
        adapter = self._adapters.get(view.alias or "")
        if adapter is not None and view.principal.adapter_refusal(
            adapter.name, adapter.allowed_tenants
        ):
            return None
        return allowed

    def work(self, ctx: RequestContext) -> None:
        assert ctx.alias is not None
        t = time.perf_counter()
        if ctx.alias not in self._named:  # (its name is the client's free text: unrecorded)
            unknown = "the gateway serves no model of this name"
            ctx.record(self.name, outcomes.Authorize.REJECT_UNKNOWN, unknown, t, UNKNOWN_EVIDENCE)
            raise ModelNotFound.unknown(ctx.alias)
        authorize_model(ctx.principal, ctx.alias)  # raises: static let this through
        adapter = self._adapters.get(ctx.alias)
        if adapter is not None:
            why = ctx.principal.adapter_refusal(adapter.name, adapter.allowed_tenants)
            if why is not None:
                raise AdapterNotAllowed(why, param="model")
        ctx.record(
            self.name,
            outcomes.Authorize.ALLOWED,
            "the key may use this model",
            t,
            self._named[ctx.alias],
        )
