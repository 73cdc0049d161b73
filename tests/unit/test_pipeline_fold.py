"""The folded pipeline decides exactly what the stages decide one by one.

Over generated configurations x principals x deployment states x requests, two
identical sets of components serve the same requests: one through `Pipeline.decide`
(static verdicts folded into cached blocks), one through `Pipeline.decide_stepwise`
(every stage's static part asked for every request). They must record the same
decisions (ignoring times), refuse the same way, leave the request in the same state
and the limiter and gates in the same state. A stage rule that the folding got wrong,
or a static part that disagrees with its stage's work, fails here.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, replace
from typing import Any

from hypothesis import example, given, settings
from hypothesis import strategies as st

from switchyard.config import Settings, parse_settings
from switchyard.decide.cache import ResponseCache
from switchyard.engines.llamacpp import EngineState
from switchyard.engines.pool import EnginePool
from switchyard.engines.registry import Registry
from switchyard.errors import SwitchyardError
from switchyard.gateway import build_pipelines
from switchyard.identity import Limits, Principal
from switchyard.media.process import MediaProcessor
from switchyard.pipeline import Pipeline, RequestContext, RequestInput, Timings
from switchyard.policy.admission import DeploymentGate
from switchyard.policy.pii import PiiMasker
from switchyard.policy.stages import Reserver
from switchyard.request import Generation, from_object, to_json
from switchyard.state.limits_memory import MemoryLimiter

PII_MODES = ["observe_only", "mask_upstream", "block"]


@dataclass
class _EngineState:
    """A managed engine's state as the deployment and the engine pool see it
    (generated input). Not ready means loading (neither cold nor failed): the pool's
    residency stage refuses it within the request's deadline, starting nothing."""

    ready: bool
    base_url: str
    failed: bool = False
    cold: bool = False
    kind: str = "llamacpp"
    adapters: tuple[Any, ...] = ()
    # What the engine pool reads and counts (engines/pool.py).
    alias: str = "engine"
    draining: Any = None
    in_flight: int = 0
    last_used: float = 0.0
    busy_since: float | None = None
    busy_s: float = 0.0
    memory_mb: float | None = 300.0
    cold_start_s: float | None = None
    isolate_base: bool = False
    state: EngineState = EngineState.STARTING


limits = st.builds(
    Limits,
    rpm=st.sampled_from([None, 1, 2, 100]),
    tpm=st.sampled_from([None, 30, 100_000]),
    max_concurrency=st.sampled_from([None, 1, 5]),
    budget_usd=st.sampled_from([None, 0.0, 5.0]),
)
patterns = st.sampled_from([("*",), ("m",), ("n",), ("m", "n"), ("?",), ()])
principals = st.builds(
    Principal,
    tenant_id=st.sampled_from(["t1", "t2"]),
    key_id=st.sampled_from(["k1", "k2"]),
    key_models=patterns,
    tenant_models=patterns,
    key_limits=limits,
    tenant_limits=limits,
)
model_limits = st.fixed_dictionaries(
    {},
    optional={
        "rpm": st.sampled_from([1, 3]),
        "tpm": st.sampled_from([40, 100_000]),
        "max_concurrency": st.sampled_from([1, 4]),
    },
)
configs = st.fixed_dictionaries(
    {
        "pii": st.fixed_dictionaries(
            {"mode": st.sampled_from(PII_MODES)},
            optional={
                "models": st.dictionaries(st.sampled_from(["m", "n"]), st.sampled_from(PII_MODES))
            },
        ),
        "cache": st.fixed_dictionaries({"enabled": st.booleans(), "semantic": st.just(False)}),
        "tools": st.one_of(
            st.just({}),
            st.fixed_dictionaries({"deny": st.just(["rm"])}),
            st.fixed_dictionaries({"allow": st.just(["search"])}),
            st.just({"registry": [{"name": "rm", "requires_approval": True}]}),
        ),
        "m_limits": model_limits,
        "n_limits": model_limits,
        "price": st.sampled_from([0.0, 2.0]),
        "n_vision": st.booleans(),  # a vision model brings the media stage
    }
)
engine_states = st.one_of(
    st.none(),
    st.builds(
        _EngineState,
        ready=st.booleans(),
        base_url=st.sampled_from(["http://127.0.0.1:7001/v1", "http://127.0.0.1:7002/v1"]),
    ),
)
requests = st.fixed_dictionaries(
    {
        "ready": st.booleans(),  # the managed engines' readiness when it arrives
        "alias": st.sampled_from(["m", "n", "nope"]),
        "endpoint": st.sampled_from(["chat.completions", "completions"]),
        "text": st.sampled_from(["hi", "mail me at ann@example.com", "x" * 120]),
        "tools": st.booleans(),
        "max_tokens": st.sampled_from([None, 5, 400]),
        "task": st.sampled_from([None, "a", "b"]),  # x-task-id, with a budget of 2 calls
    }
)


def _settings(c: dict[str, Any], tmp: str) -> Settings:
    def model(alias: str, lim: dict[str, Any]) -> dict[str, Any]:
        return {
            "alias": alias,
            "engine": {"kind": "openai", "base_url": "http://127.0.0.1:9/v1"},
            "limits": lim,
            "price": {"input": c["price"], "output": c["price"]},
            "capabilities": {"supports_vision": alias == "n" and c.get("n_vision", False)},
        }

    return parse_settings(
        {
            "models": [model("m", c["m_limits"]), model("n", c["n_limits"])],
            "embeddings": {"enabled": False},
            "storage": {"sqlite_path": f"{tmp}/never-opened.db"},
            "pii": c["pii"],
            "cache": c["cache"],
            "tools": c["tools"],
        }
    )


class _World:
    """One set of components (limiter, gates, cache, registry) and its pipeline."""

    def __init__(
        self, s: Settings, engines: dict[str, _EngineState | None], residency: bool = False
    ) -> None:
        self.registry = Registry(s)
        # The engine pool's residency stage: it holds a local engine for the request
        # (released on the unwind) or refuses one still loading.
        self.pool = EnginePool({}, s.engines) if residency else None
        for alias, state in engines.items():
            if state is not None:
                dep = self.registry.deployments[alias]
                dep.engine = replace(state)  # type: ignore[assignment]  # its own copy
                dep.fixed_label = None
        self.limiter = MemoryLimiter()
        self.gates = {
            m.alias: DeploymentGate(m.alias, m.limits.max_concurrency, m.limits.queue)
            for m in s.models
        }
        self.templates: dict[str, Any] = {}

        async def spent(column: str, ident: str, since: float) -> float:
            return 0.25  # what the ledger says the scope has spent this period

        def register(template: list[Any]) -> str:
            bid = f"b{len(self.templates) + 1}"
            self.templates[bid] = template
            return bid

        cache = ResponseCache(100, 1 << 20) if s.cache.enabled else None
        self.pipeline: Pipeline = build_pipelines(
            s,
            self.registry.deployments,
            Reserver(self.limiter, s, spent, {"limiter_fail_open": 0, "limiter_fail_closed": 0}),
            self.gates,
            PiiMasker(),
            cache,
            None,
            lambda: None,
            register,
            MediaProcessor(s.media)
            if any(m.capabilities.supports_vision for m in s.models)
            else None,
            pool=self.pool,
        ).generation


def _ctx(principal: Principal, r: dict[str, Any]) -> RequestContext:
    now = time.perf_counter()
    if r["endpoint"] == "chat.completions":
        body: dict[str, Any] = {
            "model": r["alias"],
            "messages": [{"role": "user", "content": r["text"]}],
        }
    else:
        body = {"model": r["alias"], "prompt": r["text"]}
    if r["tools"]:
        body["tools"] = [
            {"type": "function", "function": {"name": name, "parameters": {}}}
            for name in ("search", "rm")
        ]
    if r["max_tokens"] is not None:
        body["max_tokens"] = r["max_tokens"]
    task = r.get("task")
    hdrs = {"x-task-id": task, "x-task-budget": "calls=2"} if task else {}
    ctx = RequestContext(
        RequestInput("req_1", r["endpoint"], time.time(), hdrs, task),
        from_object(Generation, body)[0],
        Timings(now),
        now + 0.05,
    )
    ctx.principal = principal
    ctx.alias = r["alias"]
    return ctx


def _normal(evidence: Any) -> Any:
    """Evidence without what depends on when it was decided (limiter reset times, a
    task's age)."""
    if isinstance(evidence, dict):
        return {
            k: _normal(v)
            for k, v in evidence.items()
            if not k.startswith("reset") and k not in ("age_s", "deadline_in_s")
        }
    if isinstance(evidence, list):
        return [_normal(v) for v in evidence]
    return evidence


def _outcome(world: _World, ctx: RequestContext, error: BaseException | None) -> Any:
    return (
        None if error is None else (type(error).__name__, getattr(error, "code", None)),
        [(s, o, r, _normal(e or {})) for s, o, r, e, _, _ in ctx.decisions],
        ctx.alias,
        ctx.model.alias if ctx.model is not None else None,
        ctx.deployment.alias if ctx.deployment is not None else None,
        ctx.admission.gate is not None,
        [
            (sorted(s.scope for s in scopes), ask.tokens, ask.cost_usd, stage)
            for scopes, ask, stage in ctx.admission.reservations
        ],
        ctx.prompt_estimate,
        ctx.max_tokens,
        ctx.cache,
        ctx.request,
        ctx.pii.masked if ctx.pii is not None else None,
        ctx.pii.restore if ctx.pii is not None else False,
        _normal(dict(ctx.admission.rate_headers))
        if not any("reset" in k for k in ctx.admission.rate_headers)
        else sorted(ctx.admission.rate_headers),
        ctx.response is not None,
        {a: (g.in_flight, g.queued) for a, g in world.gates.items()},
        _held_engines(world),
    )


def _held_engines(world: _World) -> dict[str, int]:
    """The local engines a request holds (the residency stage's `hold`)."""
    return {
        a: dep.engine.in_flight
        for a, dep in world.registry.deployments.items()
        if dep.engine is not None and dep.engine.in_flight
    }


async def _serve(world: _World, ctx: RequestContext, stepwise: bool, ready: bool) -> Any:
    for dep in world.registry.deployments.values():
        if dep.engine is not None:
            dep.engine.ready = ready  # type: ignore[misc]
    error: BaseException | None = None
    try:
        if stepwise:
            await world.pipeline.decide_stepwise(ctx)
        else:
            pending = world.pipeline.decide(ctx)
            if pending is not None:
                await pending
    except SwitchyardError as exc:
        error = exc
    out = _outcome(world, ctx, error)
    # The way out: the same reply parts whichever way the stages ran, and the unwind
    # gives back every slot taken (the stages' releases, last first).
    side = world.pipeline.reply_side(ctx)
    parts = [type(p).__name__ for p in side.parts] if side is not None else []
    for pending in world.pipeline.unwind(ctx) or []:
        await pending
    held = {a: (g.in_flight, g.queued) for a, g in world.gates.items() if g.in_flight}
    assert not held, f"slots still held after the unwind: {held}"
    assert not _held_engines(world), "an engine still held after the unwind"
    return (out, parts), ctx, error


def _check_rules(
    s: Settings, principal: Principal, r: dict[str, Any], ctx: RequestContext, error: Any
) -> None:
    """What the configuration asks for, checked on the outcome itself (not through any
    stage's static part): a rule a static part forgets fails here."""
    alias = ctx.generation.model
    stages = [d[0] for d in ctx.decisions]
    if alias == "nope":  # refused: by selection, or by a limit before it
        assert error is not None
        assert error.code == "model_not_found" or "select" not in stages
        return
    if not principal.may_use(alias):
        assert error is not None and error.code == "model_not_allowed"
        return
    text = "ann@example.com"
    mode = s.pii.models.get(alias, s.pii.mode)
    has_pii = text in r["text"]
    if "tools" in stages and error is None:
        names = [t["function"]["name"] for t in ctx.generation.tools or []]
        if s.tools.deny:
            assert not set(names) & set(s.tools.deny), names
        if s.tools.allow is not None:
            assert set(names) <= set(s.tools.allow), names
    if "pii" in stages and has_pii and mode == "block":
        assert error is not None and error.code == "pii_detected"
    if mode == "mask_upstream" and "select" in stages:
        assert text not in to_json(ctx.request).decode(), "mask_upstream sent raw PII upstream"
    verdicts = {d[0]: d[1] for d in ctx.decisions}
    lims = (principal.key_limits, principal.tenant_limits)
    limited = any(
        v is not None
        for lim in lims
        for v in (lim.rpm, lim.tpm, lim.max_concurrency, lim.budget_usd)
    )
    if "admit" in verdicts:
        assert (verdicts["admit"] != "skip") == limited, verdicts["admit"]
    model = s.model(alias)
    if "deployment_limits" in verdicts and model is not None:
        deployment_limited = model.limits.rpm is not None or model.limits.tpm is not None
        assert (verdicts["deployment_limits"] != "skip") == deployment_limited
    if error is None and "queue" in stages:
        assert ctx.admission.gate is not None and ctx.deployment is not None
        assert ctx.deployment.alias == alias


_PLAIN = {
    "pii": {"mode": "observe_only"},
    "cache": {"enabled": False, "semantic": False},
    "tools": {},
    "m_limits": {},
    "n_limits": {},
    "price": 0.0,
}
_ANYONE = Principal("t1", "k1", ("*",), ("*",), Limits(), Limits())
_HI = {
    "alias": "m",
    "endpoint": "chat.completions",
    "text": "hi",
    "tools": False,
    "max_tokens": None,
    "task": None,
}


@settings(max_examples=400, deadline=None)
@example(  # the engine becomes ready between two requests: a new plan, not the old one
    config=_PLAIN,
    principal=_ANYONE,
    engines={"m": _EngineState(False, "http://127.0.0.1:7001/v1"), "n": None},
    reqs=[{**_HI, "ready": False}, {**_HI, "ready": True}],
)
@given(
    config=configs,
    principal=principals,
    engines=st.fixed_dictionaries({"m": engine_states, "n": engine_states}),
    reqs=st.lists(requests, min_size=1, max_size=4),
)
def test_folded_run_equals_stage_by_stage_run(
    tmp_path_factory: Any, config: dict[str, Any], principal: Principal, engines: Any, reqs: Any
) -> None:
    s = _settings(config, str(tmp_path_factory.getbasetemp()))
    folded, stepwise = _World(s, engines, True), _World(s, engines, True)

    async def run() -> None:
        for r in reqs:
            got, ctx, error = await _serve(folded, _ctx(principal, r), False, r["ready"])
            want, _, _ = await _serve(stepwise, _ctx(principal, r), True, r["ready"])
            assert got == want, r
            _check_rules(s, principal, r, ctx, error)

    asyncio.run(run())


def test_a_static_stage_run_is_recorded_as_one_block(tmp_path: Any) -> None:
    """Nothing of the request matters to most stages in the default configuration:
    authorize..deployment_limits (tool_results, task and tools among them: no task, no
    approvals, no tool policy configured; the chat codec refuses legacy `functions`)
    are one cached block, then the queue works, then place is a block of its own; the
    second request reuses the plans."""
    s = _settings(
        {
            "pii": {"mode": "observe_only"},
            "cache": {"enabled": False},
            "tools": {},
            "m_limits": {},
            "n_limits": {},
            "price": 0.0,
        },
        str(tmp_path),
    )
    world = _World(s, {"m": None, "n": None})
    p = Principal("t", "k", ("*",), ("*",), Limits(), Limits())
    r = dict(_HI)
    for _ in range(2):
        ctx = _ctx(p, r)
        assert world.pipeline.decide(ctx) is None  # decided without waiting
        assert [n for _, _, n in ctx.blocks] == [11, 1]
        assert [d[0] for d in ctx.decisions] == world.pipeline.names
        assert ctx.admission.gate is not None
        ctx.admission.gate.release()
    assert len(world.templates) == 2  # one template per block, registered once
    # A limit on the key turns admit into work: the block splits around it.
    limited = Principal("t", "k", ("*",), ("*",), Limits(rpm=5), Limits())
    ctx = _ctx(limited, r)
    pending = world.pipeline.decide(ctx)
    assert pending is not None
    asyncio.run(pending)  # type: ignore[arg-type]
    assert [d[1] for d in ctx.decisions][:5] == ["ok", "allowed", "skip", "skip", "admitted"]
    assert [n for _, _, n in ctx.blocks] == [3, 7, 1]


def test_plans_are_cached_per_view() -> None:
    """A cached plan serves only requests of its View: another model gets its own."""
    from switchyard.pipeline import Stage, Verdict, View

    class ReadsBody(Stage):
        name = "reads_body"

        def static(self, view: View) -> Verdict | None:
            return Verdict("ok", f"model {view.alias}")

    p = Pipeline([ReadsBody()])
    principal = Principal("t", "k", ("*",), ("*",), Limits(), Limits())
    r = dict(_HI)
    a, b = _ctx(principal, r), _ctx(principal, r)
    assert p.decide(a) is None
    asyncio.run(p.decide_stepwise(b))
    assert (
        [d[:4] for d in a.decisions]
        == [d[:4] for d in b.decisions]
        == [("reads_body", "ok", "model m", None)]
    )
    # The View changed (another model): a new plan, not the cached one.
    c = _ctx(principal, {**r, "alias": "n"})
    assert p.decide(c) is None
    assert c.decisions[0][2] == "model n"
