"""Semantic routing: the routes a routed alias (`auto`) chooses among, and when the default
route wins."""

from __future__ import annotations

from pydantic import Field, model_validator

from switchyard.config.base import Strict


class RouteConfig(Strict):
    """One route: where requests that look like `examples` should go."""

    name: str = Field(pattern=r"^[a-z0-9][a-z0-9_:.-]{0,63}$")
    """The route's name (lowercase), reported in `x-switchyard-route` and traces and named by
    `router.default_route` and `placement.cloud_routes`; unique."""
    model: str
    """The model alias this route's requests are sent to (a `models[].alias` that is not itself
    routed)."""
    examples: list[str] = []
    """Example utterances; a request's score for the route is its highest cosine similarity to them
    (embedded once at start)."""
    keywords: list[str] = []
    """Case-insensitive words or phrases that signal this route: one present adds `signal_boost` to
    its score."""
    regex: list[str] = []
    """Regular expressions that signal this route: one matching adds `signal_boost` to its score."""
    signal_boost: float = Field(0.1, ge=0, le=1)
    """Added to the route's score when one of its keywords or regexes fires."""
    min_context_tokens: int | None = Field(None, ge=0)
    """Requests with fewer context tokens may not take this route; null = no lower bound."""
    max_context_tokens: int | None = Field(None, ge=0)
    """Requests with more context tokens may not take this route; null = no upper bound."""
    tenants: list[str] | None = None
    """Tenant ids that may take this route; null = every tenant."""


class RouterConfig(Strict):
    enabled: bool = False
    """Route requests for a routed alias (`routed_aliases`) to a route's model by semantic
    similarity; needs at least one route."""
    policy_version: str = "unversioned"
    """Free-text version of the routing policy, recorded in every routing decision and in
    `switchyard route eval` reports."""
    default_route: str | None = None
    """The route (a `routes[].name`) taken when the best score is below `min_score` or its margin
    below `min_margin`; null = the best-scoring route anyway, marked low confidence."""
    routed_aliases: list[str] = ["auto"]
    """Model names that trigger routing; they may not be model or adapter aliases."""
    min_score: float = Field(0.2, ge=-1, le=1)
    """Below this best score the default route wins. MiniLM scores in-domain prompts against short
    examples at ~0.2-0.35, so higher values send most traffic to the default."""
    min_margin: float = Field(0.03, ge=0, le=2)
    """Lead over the runner-up below which the default route wins."""
    routes: list[RouteConfig] = []
    """The routes, scored in config order (ties go to the earlier one)."""

    @model_validator(mode="after")
    def _default_exists(self) -> RouterConfig:
        names = [r.name for r in self.routes]
        if len(set(names)) != len(names):
            raise ValueError("router.routes: route names must be unique")
        if self.enabled and not self.routes:
            raise ValueError(
                "router.routes: at least one route is needed when the router is enabled"
            )
        if self.default_route is not None and self.default_route not in names:
            raise ValueError(f"router.default_route: {self.default_route!r} is not a route name")
        return self
