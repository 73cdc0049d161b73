"""Semantic router: which route (and so which model alias) a request should go to.

Each route is described by example utterances; a request's score for a route is the
highest cosine similarity between the request's vector and any of the route's examples,
plus the route's `signal_boost` when one of its keywords or regular expressions fires.

Why the maximum and not the centroid: a route such as `domain:code` covers very
different requests ("fix this traceback", "write a SQL query", "center a div"). Their
centroid lies between them, close to none, and mostly keeps the direction every sentence
shares, which shrinks the gap between routes. The maximum is nearest-neighbour matching:
each example covers its own neighbourhood, so adding an example to fix a misroute works
without diluting the others. The price is that one careless example captures traffic;
`min_margin` (the best route must beat the runner-up) and `evaluate()` keep that visible.

Pure and fast: the request's vector is the one already computed for the cache (the
router never embeds at request time), and scoring is one matrix-vector product and one
segmented maximum over all examples, with no Python loop over examples.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from switchyard.config import ConfigError, RouteConfig, RouterConfig
from switchyard.errors import NoEligibleRoute
from switchyard.outcomes import Kind, Tagged, tagged

Embed = Callable[[list[str]], np.ndarray]
"""Texts in, one unit-normalised float32 row per text out."""


@dataclass(frozen=True, slots=True)
class RouteResult:
    """One routing decision, with everything needed to explain it.

    `score` is the chosen route's score. `margin` is the best eligible route's lead over
    the runner-up, the number compared with `min_margin`; None when only one route was
    eligible. `used_default` is True only when the default route won because confidence
    was too low, not when it simply scored best.
    """

    route: str
    model: str
    score: float
    margin: float | None
    scores: dict[str, float]
    signals: dict[str, list[str]]
    used_default: bool
    reason: str
    policy_version: str
    ineligible: dict[str, str]
    runner_up: str | None = None
    min_score: float = 0.0
    min_margin: float = 0.0
    default_route: str | None = None

    @property
    def outcome(self) -> Tagged:
        """The Decision outcome, e.g. `route:reasoning`."""
        return tagged(Kind.ROUTE, self.route)

    def evidence(self) -> dict[str, Any]:
        """JSON-able evidence for the trace (plain floats, rounded to 4 places)."""
        return {
            "route": self.route,
            "model": self.model,
            "score": round(self.score, 4),
            "margin": None if self.margin is None else round(self.margin, 4),
            "runner_up": self.runner_up,
            "scores": {name: round(s, 4) for name, s in self.scores.items()},
            "signals": {name: list(fired) for name, fired in self.signals.items() if fired},
            "used_default": self.used_default,
            "ineligible": dict(self.ineligible),
            "policy_version": self.policy_version,
            "thresholds": {"min_score": self.min_score, "min_margin": self.min_margin},
            "default_route": self.default_route,
        }


@dataclass(frozen=True, slots=True)
class _Signals:
    """A route's compiled keywords and regular expressions."""

    keywords: tuple[tuple[str, re.Pattern[str]], ...]
    regex: tuple[tuple[str, re.Pattern[str]], ...]

    def fired(self, text: str) -> list[str]:
        out = [f"keyword:{kw}" for kw, pat in self.keywords if pat.search(text)]
        out += [f"regex:{src}" for src, pat in self.regex if pat.search(text)]
        return out


def _compile_signals(i: int, route: RouteConfig) -> _Signals:
    """Keywords match case-insensitively as whole words/phrases; regexes as written."""
    keywords = tuple(
        (kw, re.compile(r"(?<!\w)" + re.escape(kw) + r"(?!\w)", re.IGNORECASE))
        for kw in route.keywords
    )
    regex = []
    for j, src in enumerate(route.regex):
        try:
            regex.append((src, re.compile(src)))
        except re.error as exc:
            raise ConfigError(
                f"router.routes[{i}].regex[{j}]: invalid regular expression {src!r}: {exc}"
            ) from None
    return _Signals(keywords, tuple(regex))


def _check_band(i: int, route: RouteConfig) -> None:
    lo, hi = route.min_context_tokens, route.max_context_tokens
    if lo is not None and hi is not None and lo > hi:
        raise ConfigError(
            f"router.routes[{i}]: min_context_tokens {lo} > max_context_tokens {hi}; "
            "no request could ever use this route"
        )


def _unit_rows(matrix: np.ndarray) -> np.ndarray:
    """Rows scaled to unit length, so a dot product is a cosine even if `embed` is lax."""
    norms = np.linalg.norm(matrix, axis=1, keepdims=True)
    return (matrix / np.where(norms > 0, norms, 1.0)).astype(np.float32)


class Router:
    """Scores every route for one request vector and picks one, with the reason."""

    def __init__(self, cfg: RouterConfig, embed: Embed) -> None:
        self.cfg = cfg
        self.names = [r.name for r in cfg.routes]
        for i, route in enumerate(cfg.routes):
            _check_band(i, route)
        self._signals = [_compile_signals(i, r) for i, r in enumerate(cfg.routes)]
        self._boost = np.array([r.signal_boost for r in cfg.routes], dtype=np.float32)
        self._default = None if cfg.default_route is None else self.names.index(cfg.default_route)
        self._embed_examples(embed)

    @property
    def policy_version(self) -> str:
        return self.cfg.policy_version

    def _embed_examples(self, embed: Embed) -> None:
        """Embed every example in one call; rows are grouped by route, in config order.

        `_starts` holds the first row of each route that has examples, so
        `np.maximum.reduceat` gives each such route's maximum in one pass.
        """
        texts = [ex for r in self.cfg.routes for ex in r.examples]
        counts = np.array([len(r.examples) for r in self.cfg.routes], dtype=np.int64)
        self._has_examples = counts > 0
        self._starts = (np.cumsum(counts) - counts)[self._has_examples]
        if not texts:
            self._matrix = np.zeros((0, 0), dtype=np.float32)
            return
        vecs = np.asarray(embed(texts), dtype=np.float32)
        if vecs.ndim != 2 or vecs.shape[0] != len(texts):
            raise ValueError(f"embed returned shape {vecs.shape} for {len(texts)} examples")
        self._matrix = _unit_rows(vecs)

    def similarities(self, vector: np.ndarray) -> np.ndarray:
        """Per route, the best cosine over its examples (0.0 for a route without any)."""
        out = np.zeros(len(self.names), dtype=np.float32)
        if self._matrix.size == 0:
            return out
        v = np.asarray(vector, dtype=np.float32).reshape(-1)
        if v.shape[0] != self._matrix.shape[1]:
            raise ValueError(
                f"vector has {v.shape[0]} dimensions, examples have {self._matrix.shape[1]}"
            )
        norm = float(np.linalg.norm(v))
        sims = self._matrix @ (v / norm if norm > 0 else v)
        out[self._has_examples] = np.maximum.reduceat(sims, self._starts)
        return out

    def route(
        self, vector: np.ndarray | None, text: str, context_tokens: int, tenant: str | None
    ) -> RouteResult:
        """Choose a route for a request whose last user message is `text` (`vector`).

        `vector=None` (no user message, embeddings off or not ready) scores on signals
        alone, which usually means the default route; the reason says so.
        Raises `NoEligibleRoute` when no route may serve this tenant and context length.
        """
        fired = [s.fired(text) for s in self._signals]
        boosted = np.array([bool(f) for f in fired]) * self._boost
        if vector is None:
            base = np.zeros(len(self.names), dtype=np.float32)
        else:
            base = self.similarities(vector)
        scores = [float(s) for s in base + boosted]
        ineligible = self._ineligible(context_tokens, tenant)
        eligible = [i for i, name in enumerate(self.names) if name not in ineligible]
        if not eligible:
            raise NoEligibleRoute(
                "no route may serve this request: "
                + "; ".join(f"{name}: {why}" for name, why in ineligible.items()),
                {"ineligible": ineligible, "policy_version": self.policy_version},
            )
        # Highest score first; equal scores keep config order, so ties are deterministic.
        ranked = sorted(eligible, key=lambda i: (-scores[i], i))
        chosen, used_default, reason = self._choose(ranked, scores, ineligible)
        if vector is None:
            reason = f"no vector, signals only; {reason}"
        top, runner = ranked[0], (ranked[1] if len(ranked) > 1 else None)
        return RouteResult(
            route=self.names[chosen],
            model=self.cfg.routes[chosen].model,
            score=scores[chosen],
            margin=None if runner is None else scores[top] - scores[runner],
            scores=dict(zip(self.names, scores, strict=True)),
            signals=dict(zip(self.names, fired, strict=True)),
            used_default=used_default,
            reason=reason,
            policy_version=self.policy_version,
            ineligible=ineligible,
            runner_up=None if runner is None else self.names[runner],
            min_score=self.cfg.min_score,
            min_margin=self.cfg.min_margin,
            default_route=self.cfg.default_route,
        )

    def _ineligible(self, context_tokens: int, tenant: str | None) -> dict[str, str]:
        """Routes this request may not use, each with the reason (scores still shown)."""
        out: dict[str, str] = {}
        for r in self.cfg.routes:
            lo, hi = r.min_context_tokens, r.max_context_tokens
            if (lo is not None and context_tokens < lo) or (hi is not None and context_tokens > hi):
                band = f"[{lo if lo is not None else 0}, {hi if hi is not None else 'inf'}]"
                out[r.name] = f"context {context_tokens} tokens outside band {band}"
            elif r.tenants is not None and tenant not in r.tenants:
                out[r.name] = f"tenant {tenant!r} not in the route's allow list"
        return out

    def _choose(
        self, ranked: list[int], scores: list[float], ineligible: dict[str, str]
    ) -> tuple[int, bool, str]:
        """The winner, whether the default rule decided, and the reason in words."""
        top = ranked[0]
        name, score = self.names[top], scores[top]
        runner = ranked[1] if len(ranked) > 1 else None
        low = self._low_confidence(ranked, scores)
        if low is None:
            if runner is None:
                return top, False, f"{name} scored {score:.2f}, the only eligible route"
            lead = score - scores[runner]
            return top, False, f"{name} scored {score:.2f}, {lead:.2f} over {self.names[runner]}"
        default = self._default
        if default is None:
            return top, False, f"{low}; no default route: {name} chosen with low confidence"
        default_name = self.names[default]
        if default_name in ineligible:
            reason = (
                f"{low}; default route {default_name} is ineligible "
                f"({ineligible[default_name]}): {name} chosen with low confidence"
            )
            return top, False, reason
        return default, True, f"{low}: default route {default_name}"

    def _low_confidence(self, ranked: list[int], scores: list[float]) -> str | None:
        """Why the best route is not trusted (below min_score or min_margin), or None.

        Three decimals here, so a margin of 0.029 never reads "0.03 < min_margin 0.03".
        """
        top = ranked[0]
        best = scores[top]
        if best < self.cfg.min_score:
            return f"best score {best:.3f} ({self.names[top]}) < min_score {self.cfg.min_score:.3f}"
        if len(ranked) > 1:
            runner = ranked[1]
            lead = best - scores[runner]
            if lead < self.cfg.min_margin:
                return (
                    f"{self.names[top]} leads {self.names[runner]} by {lead:.3f} "
                    f"< min_margin {self.cfg.min_margin:.3f}"
                )
        return None
