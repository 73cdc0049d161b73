"""Offline evaluation of the semantic router on a labelled JSONL file.

A router has quality and cost like a model does: this reports accuracy, per-route
precision and recall, the confusion matrix, the share of requests per route, how many
mistakes went to a costlier vs a cheaper model, the expected cost against sending
everything to the largest model, and router latency.

Latency is the `route()` call alone: the request's vector is computed once per request
and shared with the cache, so it is not the router's cost. Vectors are computed in one
batch beforehand and the embedding time per request is reported separately.

Costs are estimates from config prices (USD per million tokens): len(text)/4 input
tokens and a fixed `output_tokens` per request, the same for every model, so the ratio
compares routing decisions, not answer lengths.

CLI: `switchyard route eval --labeled FILE.jsonl [--config FILE]` (see `add_arguments`).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from switchyard.config import (
    ConfigError,
    EmbeddingsConfig,
    RouterConfig,
    Settings,
    load_settings,
)
from switchyard.decide.labeled import read_jsonl
from switchyard.decide.router import Embed, NoEligibleRoute, Router

NO_ROUTE = "(no route)"  # the prediction when every route was ineligible
WARMUP_CALLS = 10  # untimed route() calls first (allocator, caches)


def estimate_tokens(text: str) -> float:
    """The usual rough estimate: about four characters per token."""
    return len(text) / 4


def request_cost(text: str, price: tuple[float, float], output_tokens: int) -> float:
    """USD for one request at `price` (input, output USD per million tokens)."""
    return (estimate_tokens(text) * price[0] + output_tokens * price[1]) / 1e6


def read_labeled(path: str | Path) -> list[dict[str, Any]]:
    """Rows of a JSONL file: {"text": ..., "route": ...} (optional "tenant",
    "context_tokens"). A bad line fails with its line number, never silently."""
    return read_jsonl(path, {"text": str, "route": str}, "labelled rows")


def _percentile(values: Sequence[float], q: float) -> float:
    return float(np.percentile(np.asarray(values, dtype=np.float64), q))


def _check_rows(rows: list[dict[str, Any]], router: Router) -> None:
    known = set(router.names)
    for i, row in enumerate(rows):
        if row["route"] not in known:
            raise ValueError(
                f"row {i}: route {row['route']!r} is not a configured route ({sorted(known)})"
            )


def _predict(
    rows: list[dict[str, Any]], router: Router, vecs: np.ndarray
) -> tuple[list[str], list[str], int, list[float]]:
    """Predicted route and model per row, default-rule count, and route() latency (ms)."""

    def call(i: int) -> tuple[str, str, bool]:
        row = rows[i]
        tokens = int(row.get("context_tokens", math.ceil(estimate_tokens(row["text"]))))
        try:
            res = router.route(vecs[i], row["text"], tokens, row.get("tenant"))
        except NoEligibleRoute:
            return NO_ROUTE, "", False
        return res.route, res.model, res.used_default

    for i in range(min(WARMUP_CALLS, len(rows))):
        call(i)
    routes, models, latencies, defaults = [], [], [], 0
    for i in range(len(rows)):
        t0 = time.perf_counter()
        route, model, used_default = call(i)
        latencies.append((time.perf_counter() - t0) * 1000.0)
        routes.append(route)
        models.append(model)
        defaults += used_default
    return routes, models, defaults, latencies


def _quality(expected: list[str], predicted: list[str], labels: list[str]) -> dict[str, Any]:
    n = len(expected)
    columns = labels + ([NO_ROUTE] if NO_ROUTE in predicted else [])
    confusion = {e: dict.fromkeys(columns, 0) for e in labels}
    for e, p in zip(expected, predicted, strict=True):
        confusion[e][p] += 1
    per_route = {}
    for r in labels:
        tp = confusion[r][r]
        n_pred = sum(confusion[e][r] for e in labels)
        n_true = sum(confusion[r].values())
        per_route[r] = {
            "precision": tp / n_pred if n_pred else None,
            "recall": tp / n_true if n_true else None,
            "support": n_true,
            "predicted": n_pred,
            "share": n_pred / n,
        }
    correct = sum(confusion[r][r] for r in labels)
    return {
        "accuracy": correct / n,
        "correct": correct,
        "per_route": per_route,
        "confusion": confusion,
        "share": {c: sum(confusion[e][c] for e in labels) / n for c in columns},
    }


def _costs(
    rows: list[dict[str, Any]],
    predicted_models: list[str],
    expected_models: list[str],
    prices: Mapping[str, tuple[float, float]],
    largest_model: str,
    output_tokens: int,
) -> tuple[dict[str, Any], dict[str, int]]:
    def cost(text: str, model: str) -> float:
        return request_cost(text, prices[model], output_tokens) if model else 0.0

    routed = baseline = 0.0
    misroutes = {"to_costlier": 0, "to_cheaper": 0, "same_cost": 0}
    for row, pm, em in zip(rows, predicted_models, expected_models, strict=True):
        got, want = cost(row["text"], pm), cost(row["text"], em)
        routed += got
        baseline += cost(row["text"], largest_model)
        if pm != em:
            key = "to_costlier" if got > want else "to_cheaper" if got < want else "same_cost"
            misroutes[key] += 1
    ratio = routed / baseline if baseline > 0 else None
    return {
        "routed_usd": routed,
        "baseline_usd": baseline,
        "baseline_model": largest_model,
        "ratio": ratio,
        "saving": None if ratio is None else 1.0 - ratio,
        "output_tokens": output_tokens,
        "token_estimate": "len(text)/4 input + output_tokens output",
    }, misroutes


def evaluate(
    rows: list[dict[str, Any]],
    router: Router,
    embed: Embed,
    prices: Mapping[str, tuple[float, float]],
    largest_model: str,
    output_tokens: int = 256,
) -> dict[str, Any]:
    """Route every row and compare with its label; returns a JSON-able report."""
    _check_rows(rows, router)
    targets = {r.name: r.model for r in router.cfg.routes}
    for alias in [*targets.values(), largest_model]:
        if alias not in prices:
            raise ValueError(f"no price for model {alias!r}")
    t0 = time.perf_counter()
    vecs = np.asarray(embed([r["text"] for r in rows]), dtype=np.float32)
    embed_ms = (time.perf_counter() - t0) * 1000.0
    predicted, models, defaults, latencies = _predict(rows, router, vecs)
    expected = [r["route"] for r in rows]
    cost, misroutes = _costs(
        rows, models, [targets[e] for e in expected], prices, largest_model, output_tokens
    )
    return {
        "n": len(rows),
        "policy_version": router.policy_version,
        "routes": list(router.names),
        "models": targets,
        **_quality(expected, predicted, list(router.names)),
        "used_default": defaults,
        "misroutes": misroutes,
        "cost": cost,
        "latency_ms": {
            "route_p50": _percentile(latencies, 50),
            "route_p95": _percentile(latencies, 95),
            "route_p99": _percentile(latencies, 99),
            "route_samples": len(latencies),
            "embed_per_request": embed_ms / len(rows),
            "embed_batch_total": embed_ms,
        },
    }


def _fmt(value: float | None, spec: str = ".3f") -> str:
    return "-" if value is None else format(value, spec)


def _confusion_lines(result: dict[str, Any]) -> list[str]:
    columns = list(result["share"])
    width = max(len(c) for c in [*columns, "expected \\ predicted"]) + 2
    lines = ["expected \\ predicted".ljust(width) + "".join(c.rjust(width) for c in columns)]
    for e, row in result["confusion"].items():
        lines.append(e.ljust(width) + "".join(str(row[c]).rjust(width) for c in columns))
    return lines


def format_eval(result: dict[str, Any]) -> str:
    """A plain-text report of `evaluate()`'s result."""
    c, lat = result["cost"], result["latency_ms"]
    lines = [
        f"policy {result['policy_version']}: {result['n']} labelled requests",
        f"accuracy {result['accuracy']:.3f} ({result['correct']}/{result['n']}); "
        f"default route by low confidence: {result['used_default']}",
        "",
        f"{'route':<20}{'model':<20}{'precision':>10}{'recall':>10}{'support':>9}{'share':>8}",
    ]
    for r, m in result["per_route"].items():
        lines.append(
            f"{r:<20}{result['models'][r]:<20}{_fmt(m['precision']):>10}"
            f"{_fmt(m['recall']):>10}{m['support']:>9}{m['share']:>8.1%}"
        )
    lines += ["", *_confusion_lines(result), ""]
    mis = result["misroutes"]
    lines += [
        f"misroutes: {mis['to_costlier']} to a costlier model, {mis['to_cheaper']} to a "
        f"cheaper one, {mis['same_cost']} at the same cost",
        f"expected cost ${c['routed_usd']:.6f} vs ${c['baseline_usd']:.6f} all to "
        f"{c['baseline_model']}: ratio {_fmt(c['ratio'])} ({c['token_estimate']}, "
        f"output_tokens={c['output_tokens']})",
        f"router latency (route() only, n={lat['route_samples']}): "
        f"p50 {lat['route_p50']:.3f} ms, p95 {lat['route_p95']:.3f} ms, "
        f"p99 {lat['route_p99']:.3f} ms",
        f"embedding (shared with the cache, batched): {lat['embed_per_request']:.3f} ms "
        "per request",
    ]
    return "\n".join(lines)


def load_embed(cfg: EmbeddingsConfig) -> Embed:
    """A synchronous embed function over the configured sentence-transformers model."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never download: the model is installed
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    from sentence_transformers import SentenceTransformer

    from switchyard.engines.assets import minilm_model_path

    path = minilm_model_path() if cfg.path == "auto" else cfg.path
    model = SentenceTransformer(path, device="cpu")

    def embed(texts: list[str]) -> np.ndarray:
        vecs = model.encode(texts, normalize_embeddings=True, convert_to_numpy=True)
        return np.asarray(vecs, dtype=np.float32)

    return embed


def _priciest(
    prices: Mapping[str, tuple[float, float]], rows: list[dict[str, Any]], output_tokens: int
) -> str:
    """The model that would cost most serving every row (ties: first in order)."""
    totals = {
        a: sum(request_cost(r["text"], p, output_tokens) for r in rows) for a, p in prices.items()
    }
    return max(totals, key=lambda a: totals[a])


def run_eval(
    labeled: str | Path,
    config: str | Path | Settings | RouterConfig | None = None,
    *,
    embed: Embed | None = None,
    prices: Mapping[str, tuple[float, float]] | None = None,
    largest_model: str | None = None,
    output_tokens: int = 256,
) -> dict[str, Any]:
    """Evaluate the router of `config` (a YAML path, Settings or RouterConfig) on the
    JSONL file `labeled`.

    Prices come from the config's models unless given (required with a bare
    RouterConfig); the baseline is `largest_model`, by default the model that would
    cost most serving every row. The router need not be enabled: evaluate it first.
    """
    settings = config if isinstance(config, Settings | RouterConfig) else load_settings(config)
    router_cfg = settings if isinstance(settings, RouterConfig) else settings.router
    if not router_cfg.routes:
        raise ConfigError("the config has no router.routes to evaluate; pass --config FILE")
    if prices is None:
        if not isinstance(settings, Settings):
            raise ValueError("prices are needed when evaluating a bare RouterConfig")
        prices = {m.alias: (m.price.input, m.price.output) for m in settings.models}
    rows = read_labeled(labeled)
    if embed is None:
        emb_cfg = settings.embeddings if isinstance(settings, Settings) else EmbeddingsConfig()
        embed = load_embed(emb_cfg)
    router = Router(router_cfg, embed)
    baseline = largest_model or _priciest(prices, rows, output_tokens)
    return evaluate(rows, router, embed, prices, baseline, output_tokens)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of `switchyard route eval`."""
    parser.add_argument("--labeled", required=True, help="JSONL rows {text, route}")
    parser.add_argument("--config", default=None, help="YAML config with router.routes")
    parser.add_argument("--output-tokens", type=int, default=256, help="per request, for cost")
    parser.add_argument(
        "--baseline",
        default=None,
        help="model alias of the all-to-one baseline (default: priciest)",
    )
    parser.add_argument("--json", action="store_true", help="the result as JSON")
    parser.set_defaults(func=cli)


def cli(args: argparse.Namespace) -> int:
    """Entry point of `switchyard route eval`: 0 on success, 2 on bad input."""
    try:
        result = run_eval(
            args.labeled,
            args.config,
            largest_model=args.baseline,
            output_tokens=args.output_tokens,
        )
    except (ConfigError, ValueError, OSError) as exc:
        print(f"switchyard route eval: {exc}")
        return 2
    print(json.dumps(result, indent=2) if args.json else format_eval(result))
    return 0
