"""Semantic router: held-out prompts with the real embedding model, and the decision
rules (thresholds, default route, bands, tenants, ties, signals) with hand-set vectors."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from support.paths import REPO
from switchyard.config import ConfigError, RouterConfig, load_settings
from switchyard.decide.router import NoEligibleRoute, Router

ROOT = REPO
Embed = Callable[[list[str]], np.ndarray]


@pytest.fixture(scope="module")
def real_router(embed: Embed) -> Router:
    return Router(load_settings(ROOT / "examples" / "router.yaml").router, embed)


def _route(router: Router, embed: Embed, text: str, **kw: Any) -> Any:
    args = {"context_tokens": len(text) // 4, "tenant": None, **kw}
    return router.route(embed([text])[0], text, **args)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("What's the capital city of Norway?", "simple"),
        ("Who composed the Four Seasons?", "simple"),
        ("My Python script crashes with a KeyError when reading the config dict", "domain:code"),
        ("Write a function in JavaScript that deep-clones an object", "domain:code"),
        ("How do I remove a file from git history?", "domain:code"),
        ("Why is there an extra charge on this month's invoice?", "domain:finance"),
        ("I'd like to update the card used for automatic payments", "domain:finance"),
        ("Prove that the sum of two even numbers is even.", "reasoning"),
        ("How many different ways can 4 people stand in a line? Explain.", "reasoning"),
    ],
)
def test_held_out_prompts_route_as_expected(
    real_router: Router, embed: Embed, text: str, expected: str
) -> None:
    res = _route(real_router, embed, text)
    assert res.route == expected, res.reason
    assert res.model == real_router.cfg.routes[real_router.names.index(expected)].model
    assert not res.used_default
    assert res.reason.startswith(f"{expected} scored")
    assert res.policy_version == "2026-11-29.1"


def test_off_topic_prompt_goes_to_default_with_reason(real_router: Router, embed: Embed) -> None:
    res = _route(real_router, embed, "asdf qwerty zxcv")
    assert res.route == "simple" and res.used_default
    assert "min_score" in res.reason or "min_margin" in res.reason
    assert res.reason.endswith("default route simple")


def test_keyword_signal_fires_and_is_listed(real_router: Router, embed: Embed) -> None:
    res = _route(real_router, embed, "Please resend the INVOICE for order 7")
    assert res.signals["domain:finance"] == ["keyword:invoice"]
    assert res.signals["simple"] == []
    boost = real_router.cfg.routes[real_router.names.index("domain:finance")].signal_boost
    plain = real_router.similarities(embed(["Please resend the INVOICE for order 7"])[0])
    assert res.scores["domain:finance"] == pytest.approx(float(plain[2]) + boost, abs=1e-6)
    assert res.evidence()["signals"] == {"domain:finance": ["keyword:invoice"]}


def test_context_band_excludes_small_model(real_router: Router, embed: Embed) -> None:
    res = _route(real_router, embed, "asdf qwerty zxcv", context_tokens=5000)
    assert "simple" in res.ineligible and "outside band [0, 3500]" in res.ineligible["simple"]
    assert "simple" in res.scores  # still shown
    assert res.route != "simple" and not res.used_default
    assert "default route simple is ineligible" in res.reason
    assert "low confidence" in res.reason


# ---- decision rules with hand-set vectors ----------------------------------------

AXES = {"a": [1, 0, 0, 0], "b": [0, 1, 0, 0], "c": [0, 0, 1, 0], "d": [0, 0, 0, 1]}


def fake_embed(texts: list[str]) -> np.ndarray:
    """Example text "a"/"b"/... embeds to that axis; anything else must not be embedded."""
    return np.array([AXES[t] for t in texts], dtype=np.float32)


def vec(*xs: float) -> np.ndarray:
    v = np.array(xs, dtype=np.float32)
    return np.asarray(v / np.linalg.norm(v), dtype=np.float32)


def cfg(**kw: Any) -> RouterConfig:
    base: dict[str, Any] = {
        "enabled": True,
        "policy_version": "t1",
        "default_route": "small",
        "min_score": 0.5,
        "min_margin": 0.1,
        "routes": [
            {"name": "small", "model": "m-small", "examples": ["a"]},
            {"name": "code", "model": "m-code", "examples": ["b", "c"]},
            {"name": "hard", "model": "m-hard", "examples": ["d"]},
        ],
    }
    base.update(kw)
    return RouterConfig.model_validate(base)


def test_score_is_max_over_examples_not_centroid() -> None:
    r = Router(cfg(), fake_embed)
    res = r.route(vec(0, 0, 1, 0), "", 10, None)
    # The centroid of b and c would give 0.71; the nearest example gives 1.0.
    assert res.scores["code"] == pytest.approx(1.0)
    assert res.route == "code" and res.margin == pytest.approx(1.0)
    assert res.reason == "code scored 1.00, 1.00 over small"


def test_below_min_margin_goes_to_default() -> None:
    r = Router(cfg(), fake_embed)
    res = r.route(vec(0, 1, 0, 0.95), "", 10, None)
    assert res.route == "small" and res.used_default
    assert res.margin is not None and res.margin < 0.1
    assert "< min_margin 0.100: default route small" in res.reason
    assert res.runner_up == "hard"


def test_no_default_route_picks_best_and_says_low_confidence() -> None:
    r = Router(cfg(default_route=None), fake_embed)
    res = r.route(vec(1, 1, 1, 1.1), "", 10, None)
    assert res.route == "hard" and not res.used_default
    assert "no default route: hard chosen with low confidence" in res.reason


def test_ties_break_by_config_order() -> None:
    r = Router(cfg(min_margin=0.0), fake_embed)
    results = {r.route(vec(0, 1, 0, 1), "", 10, None).route for _ in range(5)}
    assert results == {"code"}  # code and hard tie at 0.71; code comes first in config
    res = r.route(vec(0, 1, 0, 1), "", 10, None)
    assert res.margin == pytest.approx(0.0) and res.runner_up == "hard"


def test_tenant_allow_list_excludes_route() -> None:
    routes = cfg().model_dump()["routes"]
    routes[2]["tenants"] = ["research"]
    r = Router(cfg(routes=routes), fake_embed)
    v = vec(0, 0, 0, 1)
    assert r.route(v, "", 10, "research").route == "hard"
    res = r.route(v, "", 10, "acme")
    assert res.route != "hard"
    assert res.ineligible == {"hard": "tenant 'acme' not in the route's allow list"}
    assert res.scores["hard"] == pytest.approx(1.0)  # score shown, but excluded
    assert r.route(v, "", 10, None).ineligible.keys() == {"hard"}


def test_no_eligible_route_raises_with_reasons() -> None:
    routes = cfg().model_dump()["routes"]
    for route in routes:
        route["max_context_tokens"] = 100
    r = Router(cfg(routes=routes), fake_embed)
    with pytest.raises(NoEligibleRoute) as info:
        r.route(vec(1, 0, 0, 0), "", 500, None)
    assert info.value.status == 403 and info.value.code == "no_eligible_route"
    assert set(info.value.evidence["ineligible"]) == {"small", "code", "hard"}


def test_regex_signal_boosts_and_can_win() -> None:
    routes = cfg().model_dump()["routes"]
    routes[1]["regex"] = [r"```"]
    routes[1]["signal_boost"] = 0.6
    r = Router(cfg(routes=routes), fake_embed)
    v = vec(1, 0.5, 0, 0)  # small 0.894, code 0.447 before the boost
    assert r.route(v, "no fence here", 10, None).route == "small"
    res = r.route(v, "look: ```x = 1```", 10, None)
    assert res.signals["code"] == ["regex:```"]
    assert res.route == "code"
    assert res.scores["code"] == pytest.approx(0.447 + 0.6, abs=1e-3)


def test_keywords_match_whole_words_case_insensitively() -> None:
    routes = cfg().model_dump()["routes"]
    routes[1]["keywords"] = ["git", "c++", "stack trace"]
    r = Router(cfg(routes=routes), fake_embed)
    fired = r.route(vec(1, 0, 0, 0), "My C++ STACK TRACE, not digital", 10, None).signals
    assert fired["code"] == ["keyword:c++", "keyword:stack trace"]


def test_evidence_is_json_and_complete() -> None:
    res = Router(cfg(), fake_embed).route(vec(0, 0, 0, 1), "", 10, None)
    ev = json.loads(json.dumps(res.evidence()))
    assert ev["route"] == "hard" and ev["model"] == "m-hard" and ev["policy_version"] == "t1"
    assert ev["scores"] == {"small": 0.0, "code": 0.0, "hard": 1.0}
    assert ev["thresholds"] == {"min_score": 0.5, "min_margin": 0.1}
    assert res.outcome == "route:hard"


def test_route_without_examples_scores_zero_plus_boost() -> None:
    routes = cfg().model_dump()["routes"]
    routes.append({"name": "kw", "model": "m-kw", "keywords": ["urgent"], "signal_boost": 1.0})
    r = Router(cfg(routes=routes), fake_embed)
    assert r.route(vec(1, 0, 0, 0), "hello", 10, None).scores["kw"] == 0.0
    assert r.route(vec(0.6, 0.8, 0, 0), "URGENT please", 10, None).route == "kw"


def test_bad_config_fails_at_construction() -> None:
    routes = cfg().model_dump()["routes"]
    routes[0]["regex"] = ["(unclosed"]
    with pytest.raises(ConfigError, match=r"router.routes\[0\].regex\[0\]"):
        Router(cfg(routes=routes), fake_embed)
    routes = cfg().model_dump()["routes"]
    routes[0].update(min_context_tokens=10, max_context_tokens=5)
    with pytest.raises(ConfigError, match="min_context_tokens 10 > max_context_tokens 5"):
        Router(cfg(routes=routes), fake_embed)


def test_without_a_vector_only_signals_count() -> None:
    routes = cfg().model_dump()["routes"]
    routes[2].update(keywords=["prove"], signal_boost=0.6)
    r = Router(cfg(routes=routes), fake_embed)
    res = r.route(None, "hello", 10, None)
    assert res.route == "small" and res.used_default
    assert res.reason.startswith("no vector, signals only; best score 0.000")
    assert r.route(None, "prove it", 10, None).route == "hard"


def test_wrong_vector_dimension_is_refused() -> None:
    with pytest.raises(ValueError, match="3 dimensions"):
        Router(cfg(), fake_embed).route(np.ones(3, np.float32), "", 10, None)
