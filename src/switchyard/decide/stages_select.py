"""Where the request runs: which deployment serves its alias (`Select`, with balancing,
placement and the canary guard), whether the local engine and adapter are resident
(`Residency`), and local or remote (`Place`).

Select and Residency hold what they take (a balanced deployment, an engine, a revision's
lease) until their release part. The public face is decide/stages.py, which re-exports
these names.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

from msgspec import structs

from switchyard import outcomes
from switchyard.decide.balance import PIN_CHARS, Balancer, affinity_key, prompt_prefix
from switchyard.decide.placement import (
    Change,
    Placement,
    Placer,
    parse_device_state,
    parse_network,
    read_sensors,
)
from switchyard.decide.select import select_deployment
from switchyard.engines.pool import BASE, EnginePool
from switchyard.engines.pool import Residency as EngineResidency
from switchyard.engines.registry import Deployment
from switchyard.errors import (
    InvalidRequest,
    ModelNotFound,
    PlacementRefused,
    RegionNotAllowed,
    RevisionPinNotAllowed,
    SwitchyardError,
)
from switchyard.identity import Principal
from switchyard.pipeline import RequestContext, Stage, Verdict, View
from switchyard.request import to_json


class Select(Stage):
    """Which deployment serves the alias (decide/select.py)."""

    name = "select"

    def __init__(
        self,
        deployments: Mapping[str, Deployment],
        balancers: Mapping[str, Balancer] | None = None,
        tasks: Any = None,
        placers: Mapping[str, Placer] | None = None,
        on_place: Callable[[str, Placement, list[Change]], None] | None = None,
        metrics: Any = None,
        on_canary_cut: Callable[[str, Deployment, str], None] | None = None,
        sessions: Any = None,
    ) -> None:
        self._deployments = deployments
        self._balancers = balancers or {}
        self._tasks = tasks  # the task store: a task's deployment, for every process
        self._placers = placers or {}  # aliases with a placement policy
        self._on_place = on_place  # metrics
        self._metrics = metrics  # observe/metrics.Metrics: placement's estimate error
        # (alias, deployment, why) when the canary guard cut a deployment (the gateway
        # stores the weight, logs and counts it)
        self._on_canary_cut = on_canary_cut
        # Sessions' deployments shared by every process (state/affinity_redis.py), or None.
        self._sessions = sessions

    def static(self, view: View) -> Verdict | None:
        if view.deployment is None or view.alias is None:
            return None  # work refuses it, or balances among several deployments
        if view.alias in self._balancers:
            return None
        if region_refusal(view.principal, (view.deployment,)) is not None:
            return None  # work refuses it, recorded with its reason
        sel = select_deployment(view.alias, self._deployments)
        dep = sel.deployment
        return Verdict(
            sel.outcome, sel.reason, sel.evidence, (("deployment", dep), ("model", dep.model))
        )

    def work(self, ctx: RequestContext) -> Awaitable[None] | None:
        t = time.perf_counter()
        balancer = self._balancers.get(ctx.alias or "")
        if balancer is not None:
            return self._balance(ctx, balancer, t)
        sel = select_deployment(ctx.alias or "", self._deployments)  # raises ModelNotFound
        admit_model(ctx, None, sel.deployment, t)
        ctx.deployment = sel.deployment
        ctx.model = sel.deployment.model
        ctx.record(self.name, sel.outcome, sel.reason, t, sel.evidence)
        return None

    def _balance(self, ctx: RequestContext, balancer: Balancer, t: float) -> Awaitable[None] | None:
        admit_model(ctx, balancer, None, t)
        p = ctx.principal
        boundary = balancer.deployments[0].model.data_boundary
        if p is not None:
            boundary = p.boundary(boundary)
        cfg = balancer.cfg
        prefix = (
            prompt_prefix(ctx.generation, cfg.prefix_min_chars, cfg.prefix_chars)
            if cfg.prefix_affinity
            else None
        )
        remembered = ctx.task_deployments.get(balancer.alias) if ctx.task_deployments else None
        affinity = affinity_key(ctx.input.task_id, ctx.generation, ctx.input.headers)
        if ctx.previous is not None:  # a Responses continuation: where its state is warm
            affinity, remembered = ("response", ctx.previous[0]), ctx.previous[1]
        if (
            self._sessions is not None
            and affinity is not None
            and affinity[0] == "session"
            and cfg.affinity
        ):  # where any process sent this session: asked before balancing
            return self._with_session(ctx, balancer, t, boundary, prefix, affinity)
        return self._choose(ctx, balancer, t, boundary, prefix, affinity, remembered)

    async def _with_session(
        self,
        ctx: RequestContext,
        balancer: Balancer,
        t: float,
        boundary: list[str] | None,
        prefix: str | None,
        affinity: tuple[str, str],
    ) -> None:
        p = ctx.principal
        tenant = p.tenant_id if p is not None else None
        remembered = await self._sessions.get(balancer.alias, tenant, affinity[1])
        pending = self._choose(ctx, balancer, t, boundary, prefix, affinity, remembered)
        if pending is not None:
            await pending
        dep = ctx.deployment
        if dep is not None and dep.name != remembered:  # for its next request, anywhere
            await self._sessions.put(balancer.alias, tenant, affinity[1], dep.name)

    def _choose(
        self,
        ctx: RequestContext,
        balancer: Balancer,
        t: float,
        boundary: list[str] | None,
        prefix: str | None,
        affinity: tuple[str, str] | None,
        remembered: str | None,
    ) -> Awaitable[None] | None:
        p = ctx.principal
        hold = ctx.task
        placer = self._placers.get(balancer.alias)
        placed = self._place(ctx, balancer, placer, boundary) if placer is not None else None
        dep, reason, evidence = balancer.choose(
            tenant=p.tenant_id if p is not None else None,
            affinity=affinity,
            prefix=prefix,
            pin=ctx.pin,
            regions=boundary,
            tokens=ctx.max_tokens or 256,
            remembered=remembered,
            location=placed.location if placed is not None else None,
            only=placed.only if placed is not None else None,
        )
        if placed is not None and placed.stay and dep.location != "device":
            balancer.settled(dep, None, None)  # never sent: the data may not leave
            why = f"{placed.why}, and no device deployment is eligible now"
            ctx.record(self.name, outcomes.Select.REJECT_PLACEMENT, why, t, evidence)
            raise PlacementRefused(f"the request may not leave the device: {why}")
        ctx.admission.balanced = (balancer, dep)
        ctx.deployment = dep
        ctx.model = dep.model
        evidence["upstream"] = dep.label
        evidence["revision"] = dep.model.revision
        ctx.record(
            self.name, outcomes.tagged(outcomes.Kind.DEPLOYMENT, dep.name), reason, t, evidence
        )
        if hold is not None and self._tasks is not None and dep.name != remembered:
            # The task's deployment for this alias, for its later steps in any process.
            return self._tasks.set_deployment(hold.key, balancer.alias, dep.name)
        return None

    def release(self, ctx: RequestContext) -> None:
        """The balanced deployment is no longer in flight: it learns the request's
        latency, placement its estimate's error and the canary guard the outcome; each
        deployment the request left for another is settled as a failure."""
        adm = ctx.admission
        held = adm.balanced
        if held is not None:  # kept on the request: its metrics name the deployment
            balancer, dep = held
            tm = ctx.timings
            ttft = tpot = None
            if tm.upstream_sent is not None and tm.upstream_first_byte is not None:
                ttft = tm.upstream_first_byte - tm.upstream_sent
                n = ctx.run.chunks
                if n > 1:
                    tpot = ((tm.ended or time.perf_counter()) - tm.upstream_first_byte) / (n - 1)
            balancer.settled(dep, ttft, tpot)
            placed = ctx.placement
            if (
                placed is not None
                and placed.estimate_ms is not None
                and self._metrics is not None
                and ctx.error_code is None
            ):  # how far placement's estimate was from what the request took
                observed = (tm.ended or time.perf_counter()) - tm.received
                self._metrics.placement_error.labels(balancer.alias, placed.location).observe(
                    observed - placed.estimate_ms / 1000.0
                )
            if balancer.guard is not None:
                self._guard(ctx, balancer, dep, ctx.error_code is None)
        for balancer, dep, attempted in adm.left:  # failed over from these
            balancer.settled(dep, None, None)
            if attempted and balancer.guard is not None:
                self._guard(ctx, balancer, dep, False)

    def _guard(self, ctx: RequestContext, balancer: Balancer, dep: Deployment, ok: bool) -> None:
        """The request's outcome at `dep`, for its alias's canary guard."""
        t = time.perf_counter()
        e2e_ms = (t - ctx.timings.received) * 1000.0
        cut = balancer.guard_check(dep, ok, e2e_ms, time.monotonic())
        if cut is not None:
            ctx.record(
                "canary", outcomes.Canary.CUT, cut, t, {"deployment": dep.name, "weight": 0.0}
            )
            if self._on_canary_cut is not None:
                self._on_canary_cut(balancer.alias, dep, cut)

    def _place(
        self, ctx: RequestContext, balancer: Balancer, placer: Placer, regions: list[str] | None
    ) -> Placement | None:
        """Where the request runs (decide/placement.py): recorded as the `place` decision,
        with the device conditions it changed; the balancer then picks within it."""
        t = time.perf_counter()
        h = ctx.input.headers
        p = ctx.principal
        reports = p is None or p.may_report_device_state
        ignored = []
        raw_state = h.get("x-switchyard-device-state")
        raw_net = h.get("x-switchyard-network")
        state = parse_device_state(raw_state) if raw_state is not None and reports else None
        network = parse_network(raw_net) if raw_net is not None and reports else None
        if not reports:
            ignored = [n for n, v in (("device-state", raw_state), ("network", raw_net)) if v]
        if state is None:
            state = read_sensors()
        boundary = h.get("x-switchyard-data-boundary")
        private = None
        if boundary is not None:
            if boundary.strip().lower() != "device":
                raise InvalidRequest(
                    "header x-switchyard-data-boundary: the only value is 'device'",
                    param="x-switchyard-data-boundary",
                )
            private = "x-switchyard-data-boundary: device"
        elif placer.cfg.pii_stays_local and ctx.pii is not None and ctx.pii.found:
            private = f"PII found ({', '.join(sorted(ctx.pii.found))})"
        now = time.monotonic()
        changes = placer.observe(state, now)
        for c in changes:
            word = "entered" if c.active else "ended"
            ctx.record(
                "place",
                outcomes.tagged(
                    outcomes.Kind.ENTER if c.active else outcomes.Kind.EXIT, c.condition
                ),
                f"the device's {c.condition} condition {word}",
                t,
                {
                    "value": c.value,
                    "limits": getattr(placer.cfg, _LIMITS[c.condition]).model_dump(),
                },
            )
        eligible = balancer.eligible(regions, now)
        body_bytes = len(to_json(ctx.request)) if network is not None else 0
        placed = placer.decide(
            device=[d for d in eligible if d.location == "device"],
            cloud=[d for d in eligible if d.location == "cloud"],
            private=private,
            state=state,
            network=network,
            nbytes=body_bytes,
            tokens=ctx.max_tokens or 256,
            remaining_ms=ctx.remaining_s() * 1000.0,
            route=ctx.route,
        )
        if placed is None:
            return None
        evidence = {**placed.evidence, "reason": placed.reason}
        if ignored:
            evidence["ignored_headers"] = ignored  # this key may not report device state
        if placed.mode == outcomes.Place.REFUSED:
            ctx.record("place", outcomes.Place.REJECT_PRIVACY, placed.why, t, evidence)
            raise PlacementRefused(
                f"the request may not leave the device ({placed.why}) and no device "
                "deployment can serve it now"
            )
        cap = placed.max_tokens
        if cap is not None and (ctx.max_tokens == 0 or ctx.max_tokens > cap):
            req = ctx.generation
            if req.max_completion_tokens is not None:
                ctx.request = structs.replace(req, max_completion_tokens=cap)
            else:
                ctx.request = structs.replace(req, max_tokens=cap)
            ctx.max_tokens = cap
            evidence["max_tokens"] = cap
        ctx.placement = placed
        ctx.record("place", placed.mode, placed.why, t, evidence)
        if self._on_place is not None:
            self._on_place(balancer.alias, placed, changes)
        return placed


_LIMITS = {"thermal": "thermal_c", "battery": "battery_pct", "memory": "memory_pct"}


def admit_model(
    ctx: RequestContext,
    balancer: Balancer | None,
    dep: Deployment | None,
    t: float,
    revisions: Any = None,
) -> None:
    """Select's rules for the request's model before a deployment is chosen, one place
    for every endpoint that names a model (/v1/messages/count_tokens chooses none but
    is held to them): a pin needs a key that may pin (403 `revision_pin_not_allowed`,
    `admit_pin`) and a revision the alias serves (404); the deployments left (the pin's,
    the alias's, or `dep`) must have one inside the caller's regions, or it is a
    permission the tenant lacks (403, not a not-ready a client would retry); a pin of
    an RL-managed model (`revisions`: its revision manager) must name its active
    revision (404, `active_pin_refusal`). A refusal is recorded as a `select` decision
    with its reason."""
    p = ctx.principal
    pin = ctx.pin
    admit_pin(ctx, t)
    deps: Sequence[Deployment] = (dep,) if dep is not None else ()
    if balancer is not None:
        deps = balancer.deployments
        if pin is not None:
            allowed = p.boundary(deps[0].model.data_boundary) if p is not None else None
            try:
                deps = balancer.pinned(pin, allowed)
            except ModelNotFound as exc:
                evidence = {"pin": pin[:PIN_CHARS]}
                ctx.record(Select.name, outcomes.Select.REJECT, exc.message, t, evidence)
                raise
    outside = region_refusal(p, deps)
    if outside is not None:
        alias = deps[0].alias
        where = {"regions": sorted({d.model.region for d in deps}), "pin": pin}
        ctx.record(Select.name, outcomes.Select.REJECT_REGION, outside, t, where)
        # The client is told why, not where the model runs (/v1/models hides it from
        # this tenant); the decision above keeps the regions for the operator.
        raise RegionNotAllowed(
            f"the model '{alias}'{f' at revision {pin!r}' if pin else ''} may not serve "
            "this tenant: it runs outside the tenant's regions",
            param="model",
        )
    if revisions is not None and pin is not None:  # after the regions: it names the active
        active = revisions.active.revision if revisions.active is not None else None
        why = active_pin_refusal(revisions.alias, active, pin)
        if why is not None:
            seen = {"pin": pin[:PIN_CHARS], "active": active}
            ctx.record(Select.name, outcomes.Select.REJECT, why, t, seen)
            raise ModelNotFound(why, param="model")


def admit_pin(ctx: RequestContext, t: float) -> None:
    """A pin (`alias@revision`) of any model, a version alias's or an RL-managed one's,
    needs a key whose `may_pin_revisions` is on: else 403 `revision_pin_not_allowed`,
    recorded as a `select` decision. service.py asks it as soon as the pin is read,
    before any costly work (an RL-managed model's select is a static verdict: its work,
    and admit_model with it, never runs); admit_model asks it again for its callers."""
    p = ctx.principal
    pin = ctx.pin
    if pin is None or p is None or p.may_pin_revisions:
        return
    why = "this API key may not pin a revision (its may_pin_revisions is off)"
    ctx.record(Select.name, outcomes.Select.REJECT, why, t, {"pin": pin[:PIN_CHARS]})
    raise RevisionPinNotAllowed(why, param="model")


def active_pin_refusal(alias: str, active: str | None, pin: str) -> str | None:
    """Why a pin of an RL-managed model is refused (a 404 `model_not_found`): it answers
    with its active revision only (`active`; None: none is). The one rule for a request
    served (Residency, against the revision it leased) and one counted (admit_model,
    against the active one); None when the pin names it."""
    if pin == active:
        return None
    now = f"'{active}'" if active is not None else "none is active now"
    return (
        f"the model '{alias}' is RL-managed and answers with its active revision only: "
        f"{now}, not '{pin[:PIN_CHARS]}'"
    )


def region_refusal(p: Principal | None, deps: Sequence[Deployment]) -> str | None:
    """Why none of `deps` may take a request of `p`: each runs outside the tenant's
    regions (within the model's data boundary); None when one may, or `p` has none."""
    if p is None or p.regions is None or not deps:
        return None
    allowed = p.boundary(deps[0].model.data_boundary)
    if allowed is not None and any(d.model.region in allowed for d in deps):
        return None
    where = sorted({d.model.region for d in deps})
    return f"it runs in {', '.join(where)}, outside the tenant's regions {allowed}"


class Residency(Stage):
    """Whether the local model is loaded (`hot`) or is loaded for this request
    (`cold-load`: load time, what was evicted and why), and which adapter it applies
    (engines/pool.py). Holds the engine until the request is settled, so the pool never
    evicts an engine a request is using."""

    name = "residency"
    REMOTE = Verdict(outcomes.Residency.SKIP, "the deployment is not a local engine")

    def __init__(self, pool: EnginePool, revisions: Mapping[str, Any] | None = None) -> None:
        self._pool = pool
        # RL-managed aliases: their base requests go to the active revision's engine
        # (engines/revisions.py), under a lease that the activation barrier waits for.
        self._revisions = revisions if revisions is not None else {}

    def static(self, view: View) -> Verdict | None:
        dep = view.deployment
        if dep is None:
            return None  # select refused it
        return self.REMOTE if dep.engine is None else None

    def release(self, ctx: RequestContext) -> None:
        """The engine (and adapter) may be evicted again; the revision's lease ends."""
        adm = ctx.admission
        if adm.resident is not None:
            EnginePool.release(*adm.resident)
        if adm.lease is not None:
            adm.lease.release()

    def work(self, ctx: RequestContext) -> Awaitable[None] | None:
        dep = ctx.deployment
        assert dep is not None
        t = time.perf_counter()
        if dep.engine is None:  # a balanced deployment that is remote
            ctx.record(self.name, self.REMOTE.outcome, self.REMOTE.reason, t)
            return None
        if dep.adapter is None and self._revisions:
            manager = self._revisions.get(dep.alias)
            if manager is not None:
                self._revision(ctx, manager, t)
                return None
        now = self._pool.hot(dep.engine)
        if now is None:
            return self._load(ctx, dep, t)
        return self._held(ctx, dep, now, t)

    def _revision(self, ctx: RequestContext, manager: Any, t: float) -> None:
        """An RL-managed model: the request holds a lease on the active revision and is
        served by its engine; an activation lets it finish there."""
        try:
            lease = manager.lease()
        except SwitchyardError as exc:
            ctx.record(self.name, outcomes.Residency.REJECT, exc.message, t, {"active": None})
            raise
        rev = lease.rev
        pin = ctx.pin
        if pin is not None and (why := active_pin_refusal(manager.alias, rev.revision, pin)):
            lease.release()
            ctx.record(
                self.name,
                outcomes.Residency.REJECT,
                why,
                t,
                {"pin": pin[:PIN_CHARS], "active": rev.revision},
            )
            raise ModelNotFound(why, param="model")
        ctx.admission.lease = lease
        dep = manager.deployment(rev)
        ctx.deployment = dep
        ctx.model = dep.model
        ctx.record(
            self.name,
            outcomes.tagged(outcomes.Kind.REVISION, rev.revision),
            f"RL-managed model: served by its active revision {rev.revision} ({rev.kind}), "
            "held until the request ends (an activation lets it finish there)",
            t,
            {
                "revision": rev.revision,
                "kind": rev.kind,
                "sha256": rev.sha256,
                "in_flight": rev.in_flight,
            },
        )

    async def _load(self, ctx: RequestContext, dep: Deployment, t: float) -> None:
        assert dep.engine is not None
        try:
            r = await self._pool.acquire(dep.engine, ctx.remaining_s())
        except SwitchyardError as exc:
            ctx.record(
                self.name,
                outcomes.Residency.REJECT,
                exc.message,
                t,
                {"state": dep.engine.state.value},
            )
            raise
        pending = self._held(ctx, dep, r, t)
        if pending is not None:
            await pending

    def _held(
        self, ctx: RequestContext, dep: Deployment, r: EngineResidency, t: float
    ) -> Awaitable[None] | None:
        """The engine is held for this request (`r`: how it came to be). Then its
        adapter, or its turn beside adapter requests: at once, or waited for."""
        engine = dep.engine
        assert engine is not None
        ctx.admission.resident = (engine, None)
        if dep.adapter is None and not engine.isolate_base:
            ctx.record(self.name, r.outcome, r.reason, t, r.evidence)
            return None
        name = BASE if dep.adapter is None else dep.adapter.name
        got = self._pool.adapter_now(engine, name)
        if got is None:
            return self._adapter(ctx, dep, r, t)
        self._record(ctx, dep, r, got, t)
        return None

    async def _adapter(
        self, ctx: RequestContext, dep: Deployment, r: EngineResidency, t: float
    ) -> None:
        """Wait for the adapter to be active for this request (or, for a base request
        kept apart from adapter requests, for its turn)."""
        engine, adapter = dep.engine, dep.adapter
        assert engine is not None
        name = BASE if adapter is None else adapter.name
        try:
            got = await self._pool.adapter(engine, name, ctx.remaining_s())
        except SwitchyardError as exc:
            if adapter is None:
                ctx.record(self.name, outcomes.Residency.REJECT, exc.message, t, r.evidence)
                raise
            ev = {**r.evidence, "adapter": name, "adapter_state": engine.adapter_state(name)}
            ctx.record(
                self.name, outcomes.Residency.REJECT, f"adapter {name}: {exc.message}", t, ev
            )
            raise
        self._record(ctx, dep, r, got, t)

    def _record(
        self,
        ctx: RequestContext,
        dep: Deployment,
        r: EngineResidency,
        got: dict[str, Any],
        t: float,
    ) -> None:
        """The adapter is active for this request (the pool counted it in use)."""
        engine, adapter = dep.engine, dep.adapter
        assert engine is not None
        outcome: outcomes.Residency = r.outcome
        reason, evidence = r.reason, {**r.evidence, **got}
        if adapter is None:  # a base request kept apart from adapter requests
            ctx.admission.resident = (engine, BASE)
            reason = (
                f"{reason}; kept apart from adapter requests "
                f"(engine.base_beside_adapters is false): {evidence['base_apart']}"
            )
            if "adapter_waited_ms" in evidence:
                reason += f" after waiting {evidence['adapter_waited_ms']:g} ms for them"
            ctx.record(self.name, outcome, reason, t, evidence)
            return
        ctx.admission.resident = (engine, adapter.name)
        action = evidence.get("adapter_action")
        if action == "loaded":
            outcome = outcomes.Residency.ADAPTER_LOAD
            reason = f"{reason}; the adapter was cold: loaded ({evidence['adapter_load']})"
            evicted = evidence.get("adapter_evicted") or []
            if evicted:
                reason += f", evicting {evicted[0]['adapter']} ({evicted[0]['reason']})"
        elif action == "promoted":
            if outcome is outcomes.Residency.HOT:
                outcome = outcomes.Residency.PROMOTE
            reason = f"{reason}; the adapter was warm: promoted to active"
        else:
            reason = f"{reason}; the adapter is active: joined the requests using it"
        if "adapter_waited_ms" in evidence:
            reason += f" after waiting {evidence['adapter_waited_ms']:g} ms for a slot"
        evidence = {
            **evidence,
            "adapter": adapter.name,
            "adapter_revision": adapter.revision,
            "adapter_id": dep.adapter_id(),
            "base": adapter.base,
            "base_revision": adapter.base_revision,
        }
        ctx.record(self.name, outcome, reason, t, evidence)


class Place(Stage):
    """Local (a managed engine) or remote (an upstream)."""

    name = "place"

    def static(self, view: View) -> Verdict | None:
        dep = view.deployment
        if dep is None:
            return None
        where = outcomes.Place.LOCAL if dep.engine is not None else outcomes.Place.REMOTE
        return Verdict(where, f"the deployment runs {where}ly", {"region": dep.model.region})

    def work(self, ctx: RequestContext) -> None:
        """A balanced deployment (static decides the others; select set one or refused)."""
        if ctx.placement is not None:
            return  # placement decided it before balancing (Select._place), recorded there
        dep = ctx.deployment
        assert dep is not None, f"place without a deployment for {ctx.alias!r}"
        t = time.perf_counter()
        local = dep.engine is not None
        ctx.record(
            self.name,
            outcomes.Place.LOCAL if local else outcomes.Place.REMOTE,
            "the deployment runs locally" if local else "the deployment runs remotely",
            t,
            {"region": dep.model.region},
        )
