"""Rules that hold one part of the settings against another, each a named function.

A section checks its own keys where it is defined; what needs more than one section (a
route's model, a fallback's region, an adapter's base engine, a retry plan against the
server's deadline) is checked here. `Settings` runs every rule at load through
`check_settings`, in the order below, so the first broken rule is the one reported; each
raises ValueError with a message that names its keys.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from switchyard.config.engines import LlamaCppEngine, ManagedEngine, VllmEngine

if TYPE_CHECKING:
    from switchyard.config.adapters import AdapterConfig
    from switchyard.config.models import ModelConfig
    from switchyard.config.settings import Settings


def check_settings(s: Settings) -> None:
    """Every rule below, in the order a broken one is reported."""
    model_aliases_unique(s)
    embeddings_alias_free(s)
    routed_aliases_reserved(s)
    by_alias = {m.alias: m for m in s.models}
    routes_name_models(s, by_alias)
    for i, m in enumerate(s.models):
        where = f"models[{i}] ({m.alias})"
        fallbacks_can_serve(where, m, by_alias)
        region_inside_data_boundary(where, m)
        deployment_regions_inside_data_boundary(where, m)
        retry_plan_fits_deadline(where, m, s.server.default_deadline_s)
    for i, a in enumerate(s.adapters):
        where = f"adapters[{i}] ({a.name})"
        adapter_name_free(where, s, i)
        base = adapter_base(where, a, by_alias)
        adapter_base_has_one_engine(where, a, base)
        adapter_base_loads_adapters(where, a, base)
        adapter_base_revision_matches(where, a, base)
        adapter_base_has_adapter_slots(where, a, base)
        demo_adapter_on_shipped_model(where, a, base)
    for alias in s.rl.models:
        where = f"rl.models.{alias}"
        rl_model = rl_model_known(where, alias, by_alias)
        rl_model_engine_has_revisions(where, rl_model)
        rl_model_has_one_deployment(where, rl_model)


def model_aliases_unique(s: Settings) -> None:
    """No two models share an alias."""
    seen: set[str] = set()
    for i, m in enumerate(s.models):
        if m.alias in seen:
            raise ValueError(f"models[{i}].alias: duplicate alias {m.alias!r}")
        seen.add(m.alias)


def embeddings_alias_free(s: Settings) -> None:
    """The embedding model, when enabled, has an alias no chat model has."""
    if s.embeddings.enabled and s.embeddings.alias in {m.alias for m in s.models}:
        raise ValueError(f"embeddings.alias: {s.embeddings.alias!r} is also a chat model alias")


def routed_aliases_reserved(s: Settings) -> None:
    """The router's routed aliases (`auto`) name no model and no adapter: one namespace."""
    reserved = set(s.router.routed_aliases)
    for i, m in enumerate(s.models):
        if m.alias in reserved:
            raise ValueError(
                f"models[{i}].alias: {m.alias!r} is reserved for the router (router.routed_aliases)"
            )
    for i, a in enumerate(s.adapters):
        if a.name in reserved:
            raise ValueError(
                f"adapters[{i}].name: {a.name!r} is reserved for the router (router.routed_aliases)"
            )


def routes_name_models(s: Settings, by_alias: dict[str, ModelConfig]) -> None:
    """Every route sends its requests to a known model that is not itself routed."""
    for i, route in enumerate(s.router.routes):
        if route.model not in by_alias:
            raise ValueError(f"router.routes[{i}].model: unknown alias {route.model!r}")
        if route.model in s.router.routed_aliases:
            raise ValueError(f"router.routes[{i}].model: {route.model!r} is itself routed")


def fallbacks_can_serve(where: str, m: ModelConfig, by_alias: dict[str, ModelConfig]) -> None:
    """Every fallback is another known model whose region is inside this one's data boundary."""
    for j, fb in enumerate(m.fallbacks):
        target = by_alias.get(fb)
        if target is None:
            raise ValueError(f"{where}.fallbacks[{j}]: unknown alias {fb!r}")
        if fb == m.alias:
            raise ValueError(f"{where}.fallbacks[{j}]: a model cannot fall back to itself")
        if m.data_boundary is not None and target.region not in m.data_boundary:
            raise ValueError(
                f"{where}.fallbacks[{j}]: {fb!r} runs in region {target.region!r}, "
                f"outside this model's data_boundary {m.data_boundary}; it could never "
                "serve these requests"
            )


def region_inside_data_boundary(where: str, m: ModelConfig) -> None:
    """A model's own region is inside its data boundary."""
    if m.data_boundary is not None and m.region not in m.data_boundary:
        raise ValueError(
            f"{where}.region: {m.region!r} is outside its own data_boundary {m.data_boundary}"
        )


def deployment_regions_inside_data_boundary(where: str, m: ModelConfig) -> None:
    """Every deployment's region (its own or the model's) is inside the model's data boundary."""
    for j, d in enumerate(m.deployments):
        region = d.region or m.region
        if m.data_boundary is not None and region not in m.data_boundary:
            raise ValueError(
                f"{where}.deployments[{j}] ({d.name}).region: {region!r} is outside "
                f"the model's data_boundary {m.data_boundary}"
            )


def retry_plan_fits_deadline(where: str, m: ModelConfig, deadline: float) -> None:
    """A model's attempts, backoffs and fallback reserve fit in `server.default_deadline_s`."""
    r, t = m.resilience, m.timeouts
    need = (r.retries + 1) * t.first_byte_s + r.retries * r.backoff_max_s + r.fallback_reserve_s
    if need > deadline:
        raise ValueError(
            f"{where}: the retry plan cannot fit the deadline: (resilience.retries "
            f"{r.retries} + 1) x timeouts.first_byte_s {t.first_byte_s} + retries x "
            f"resilience.backoff_max_s {r.backoff_max_s} + resilience.fallback_reserve_s "
            f"{r.fallback_reserve_s} = {need:g}s > server.default_deadline_s {deadline:g}s; "
            "lower retries or timeouts, or raise the deadline"
        )


def adapter_name_free(where: str, s: Settings, i: int) -> None:
    """An adapter's name is no model's, embedding model's or earlier adapter's alias."""
    a = s.adapters[i]
    taken = {m.alias for m in s.models} | {b.name for b in s.adapters[:i]}
    if a.name in taken or (s.embeddings.enabled and a.name == s.embeddings.alias):
        raise ValueError(f"{where}.name: {a.name!r} is already a model alias")


def adapter_base(where: str, a: AdapterConfig, by_alias: dict[str, ModelConfig]) -> ModelConfig:
    """An adapter's base is a known model (returned)."""
    base = by_alias.get(a.base)
    if base is None:
        raise ValueError(f"{where}.base: unknown alias {a.base!r}")
    return base


def adapter_base_has_one_engine(where: str, a: AdapterConfig, base: ModelConfig) -> None:
    """An adapter's base has one engine, not several deployments."""
    if base.deployments:
        raise ValueError(
            f"{where}.base: {a.base!r} has several deployments; adapters load on a "
            "model with one engine"
        )


def adapter_base_loads_adapters(where: str, a: AdapterConfig, base: ModelConfig) -> None:
    """An adapter's base runs on llama.cpp's server runtime or on vLLM."""
    spec = base.engine
    if not (
        isinstance(spec, VllmEngine)
        or (isinstance(spec, LlamaCppEngine) and spec.runtime == "server")
    ):
        raise ValueError(
            f"{where}.base: {a.base!r} is not a llamacpp model on the server runtime "
            "or a vllm model; only those load adapters"
        )


def adapter_base_revision_matches(where: str, a: AdapterConfig, base: ModelConfig) -> None:
    """An adapter's `base_revision` is its base model's `revision`."""
    if a.base_revision != base.revision:
        raise ValueError(
            f"{where}.base_revision: the adapter was trained on {a.base!r} revision "
            f"{a.base_revision!r}, but that model is revision {base.revision!r}"
        )


def adapter_base_has_adapter_slots(where: str, a: AdapterConfig, base: ModelConfig) -> None:
    """An adapter's base engine may load adapters (`max_adapters` above 0)."""
    spec = base.engine
    if isinstance(spec, ManagedEngine) and spec.max_adapters == 0:
        raise ValueError(
            f"{where}.base: the engine of {a.base!r} has max_adapters 0 and loads none"
        )


def demo_adapter_on_shipped_model(where: str, a: AdapterConfig, base: ModelConfig) -> None:
    """A demonstration adapter's base is a llamacpp model on the shipped SmolLM2 (`gguf: auto`)."""
    spec = base.engine
    if a.demo is not None and not (isinstance(spec, LlamaCppEngine) and spec.gguf == "auto"):
        raise ValueError(
            f"{where}.path: demonstration adapters are trained on the shipped SmolLM2 "
            f"for llama.cpp; {a.base!r} must be a llamacpp model with gguf: auto"
        )


def rl_model_known(where: str, alias: str, by_alias: dict[str, ModelConfig]) -> ModelConfig:
    """Every model of `rl.models` is a known model alias (returned)."""
    rl_model = by_alias.get(alias)
    if rl_model is None:
        raise ValueError(f"{where}: unknown model alias {alias!r}")
    return rl_model


def rl_model_engine_has_revisions(where: str, m: ModelConfig) -> None:
    """An RL-managed model runs on llama.cpp's server runtime or on vLLM."""
    engine = m.engine
    if not (
        (isinstance(engine, LlamaCppEngine) and engine.runtime == "server")
        or isinstance(engine, VllmEngine)
    ):
        raise ValueError(
            f"{where}: revisions are managed for llamacpp models on the server "
            "runtime and vllm models (token ids, logprobs and seeds come from the "
            "engine)"
        )


def rl_model_has_one_deployment(where: str, m: ModelConfig) -> None:
    """An RL-managed model has one engine, not several deployments: one revision at a time."""
    if m.deployments:
        raise ValueError(f"{where}: a model with several deployments has no one revision")
