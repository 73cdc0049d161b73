"""Router evaluation: exact numbers on a tiny hand-made set, the shipped labelled set's
honesty (held out from the route examples), and the real router's accuracy on it."""

from __future__ import annotations

import argparse
import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from support.paths import REPO
from switchyard.config import ConfigError, RouterConfig, load_settings, parse_settings
from switchyard.decide.route_eval import (
    add_arguments,
    cli,
    evaluate,
    format_eval,
    read_labeled,
    run_eval,
)
from switchyard.decide.router import Router

ROOT = REPO
LABELED = ROOT / "data" / "routes_labeled.jsonl"
EXAMPLE_CONFIG = ROOT / "examples" / "router.yaml"
Embed = Callable[[list[str]], np.ndarray]

# ---- exact numbers on a tiny known set ----------------------------------------------

E = np.eye(4, dtype=np.float32)
ROUTES: dict[str, Any] = {
    "enabled": True,
    "policy_version": "tiny-1",
    "default_route": "a",
    "min_score": 0.5,
    "min_margin": 0.1,
    "routes": [
        {"name": "a", "model": "ma", "examples": ["ex-a"]},
        {"name": "b", "model": "mb", "examples": ["ex-b"]},
        {"name": "c", "model": "mc", "examples": ["ex-c"]},
    ],
}
# (expected route, vector): rows 1 and 5 are wrong; row 5 scores 0 everywhere -> default a.
ROWS = [("a", 0), ("a", 1), ("b", 1), ("b", 1), ("c", 2), ("c", 3)]
TEXTS = [f"row {i} ".ljust(40, "x") for i in range(len(ROWS))]  # 40 chars = 10 tokens
PRICES = {"ma": (0.0, 0.0), "mb": (1.0, 2.0), "mc": (10.0, 20.0)}


class FakeEmbed:
    def __init__(self) -> None:
        self.vectors = {"ex-a": E[0], "ex-b": E[1], "ex-c": E[2]}
        self.vectors.update({t: E[axis] for t, (_, axis) in zip(TEXTS, ROWS, strict=True)})
        self.calls = 0

    def __call__(self, texts: list[str]) -> np.ndarray:
        self.calls += 1
        return np.stack([self.vectors[t] for t in texts])


def tiny_rows() -> list[dict[str, Any]]:
    return [{"text": t, "route": r} for t, (r, _) in zip(TEXTS, ROWS, strict=True)]


def test_evaluate_numbers_are_exact() -> None:
    emb = FakeEmbed()
    router = Router(RouterConfig.model_validate(ROUTES), emb)
    res = evaluate(tiny_rows(), router, emb, PRICES, "mc", output_tokens=100)
    assert emb.calls == 2  # examples once, then every row in one batch
    assert res["n"] == 6 and res["correct"] == 4 and res["accuracy"] == pytest.approx(4 / 6)
    assert res["confusion"] == {
        "a": {"a": 1, "b": 1, "c": 0},
        "b": {"a": 0, "b": 2, "c": 0},
        "c": {"a": 1, "b": 0, "c": 1},
    }
    pr = {r: (m["precision"], m["recall"]) for r, m in res["per_route"].items()}
    assert pr == {"a": (0.5, 0.5), "b": (pytest.approx(2 / 3), 1.0), "c": (1.0, 0.5)}
    assert res["share"] == {"a": pytest.approx(2 / 6), "b": 0.5, "c": pytest.approx(1 / 6)}
    assert res["used_default"] == 1
    assert res["misroutes"] == {"to_costlier": 1, "to_cheaper": 1, "same_cost": 0}
    # per request: 10 input + 100 output tokens; mb = 210e-6 USD, mc = 2100e-6 USD
    cost = res["cost"]
    assert cost["routed_usd"] == pytest.approx(3 * 210e-6 + 2100e-6)
    assert cost["baseline_usd"] == pytest.approx(6 * 2100e-6)
    assert cost["ratio"] == pytest.approx(2730 / 12600)
    assert cost["baseline_model"] == "mc"
    lat = res["latency_ms"]
    assert lat["route_samples"] == 6 and 0 <= lat["route_p50"] <= lat["route_p95"]
    assert json.loads(json.dumps(res)) == res
    text = format_eval(res)
    assert "accuracy 0.667 (4/6)" in text and "ratio 0.217" in text
    assert "1 to a costlier model, 1 to a cheaper one" in text


def test_ineligible_everywhere_counts_as_no_route() -> None:
    emb = FakeEmbed()
    cfg = RouterConfig.model_validate(
        {**ROUTES, "routes": [{**r, "tenants": ["t"]} for r in ROUTES["routes"]]}
    )
    rows = tiny_rows()
    rows[0]["tenant"] = "t"
    res = evaluate(rows, Router(cfg, emb), emb, PRICES, "mc", output_tokens=100)
    assert res["correct"] == 1 and res["confusion"]["b"]["(no route)"] == 2
    assert res["share"]["(no route)"] == pytest.approx(5 / 6)


def settings_dict() -> dict[str, Any]:
    models = [
        {
            "alias": alias,
            "engine": {"kind": "openai", "base_url": "http://127.0.0.1:9/v1"},
            "price": {"input": p[0], "output": p[1]},
        }
        for alias, p in PRICES.items()
    ]
    return {"models": models, "router": ROUTES}


def test_run_eval_takes_prices_and_baseline_from_settings(tmp_path: Path) -> None:
    path = tmp_path / "rows.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in tiny_rows()) + "\n\n")
    settings = parse_settings(settings_dict(), "test")
    res = run_eval(path, settings, embed=FakeEmbed(), output_tokens=100)
    assert res["cost"]["baseline_model"] == "mc" and res["correct"] == 4
    res = run_eval(path, settings, embed=FakeEmbed(), output_tokens=100, largest_model="mb")
    assert res["cost"]["baseline_usd"] == pytest.approx(6 * 210e-6)
    with pytest.raises(ValueError, match="prices are needed"):
        run_eval(path, settings.router, embed=FakeEmbed())
    with pytest.raises(ConfigError, match=r"no router\.routes"):
        run_eval(path, None, embed=FakeEmbed())


def test_bad_rows_fail_with_their_line(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "hi", "route": "a"}\n{"text": "no route"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: expected"):
        read_labeled(bad)
    bad.write_text('{"text": "hi", "route": "a"}\nnot json\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: not valid JSON"):
        read_labeled(bad)
    emb = FakeEmbed()
    router = Router(RouterConfig.model_validate(ROUTES), emb)
    with pytest.raises(ValueError, match="route 'z' is not a configured route"):
        evaluate([{"text": TEXTS[0], "route": "z"}], router, emb, PRICES, "mc")


def test_cli_reports_bad_input_with_status_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(
        ["--labeled", str(tmp_path / "missing.jsonl"), "--config", str(EXAMPLE_CONFIG)]
    )
    assert args.func(args) == 2 and args.func is cli
    assert "switchyard route eval:" in capsys.readouterr().out


# ---- the shipped labelled set and the example config --------------------------------


def _norm(text: str) -> str:
    return re.sub(r"[^a-z0-9 ]", "", text.casefold()).strip()


def test_labeled_set_is_balanced_and_held_out_from_examples() -> None:
    rows = read_labeled(LABELED)
    routes = load_settings(EXAMPLE_CONFIG).router.routes
    counts = {r.name: sum(row["route"] == r.name for row in rows) for r in routes}
    assert len(rows) >= 160 and all(35 <= n <= 55 for n in counts.values()), counts
    assert all(8 <= len(r.examples) <= 15 for r in routes)
    examples = {_norm(e) for r in routes for e in r.examples}
    texts = [_norm(row["text"]) for row in rows]
    assert len(set(texts)) == len(texts)
    assert not examples & set(texts)


def test_no_labeled_prompt_paraphrases_a_route_example(embed: Embed) -> None:
    """Held out means more than not identical: no near-duplicate either."""
    rows = read_labeled(LABELED)
    examples = [e for r in load_settings(EXAMPLE_CONFIG).router.routes for e in r.examples]
    sims = embed([r["text"] for r in rows]) @ embed(examples).T
    assert float(sims.max()) < 0.9


def test_real_router_on_the_labeled_set(embed: Embed) -> None:
    res = run_eval(LABELED, EXAMPLE_CONFIG, embed=embed)
    print("\n" + format_eval(res))
    assert res["n"] >= 160
    assert res["accuracy"] >= 0.7
    assert res["cost"]["ratio"] < 1.0
