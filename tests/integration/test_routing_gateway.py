"""Routing and tool shortlisting through a running gateway (router from examples/router.yaml)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import yaml

from support.gateways import Gateway, start_gateway
from support.paths import REPO
from support.upstreams import Scripted

EXAMPLE = REPO / "examples" / "router.yaml"


@pytest.fixture(scope="module")
def gw(scripted: Scripted) -> Iterator[Gateway]:
    example = yaml.safe_load(EXAMPLE.read_text())
    url = scripted.url + "/v1"
    models = [
        {
            "alias": m["alias"],
            "revision": m.get("revision", "r"),
            "engine": {"kind": "openai", "base_url": url},
            "capabilities": {"supports_tools": True},
        }
        for m in example["models"]
    ]
    g = start_gateway(
        {
            "models": models,
            "router": example["router"],
            "tools": {"shortlist_k": 2, "deny": ["delete_account"]},
        }
    )
    yield g
    g.proc.stop()


def _chat(
    gw: Gateway, model: str, text: str, key: str | None = None, **extra: Any
) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key or gw.key}", **extra.pop("headers", {})}
    body = {
        "model": model,
        "messages": [{"role": "user", "content": text}],
        "max_tokens": 8,
        **extra,
    }
    return httpx.post(gw.url + "/v1/chat/completions", json=body, headers=headers, timeout=60)


@pytest.mark.parametrize(
    ("text", "route", "model"),
    [
        (
            "My Python script raises a KeyError when I read the config dict, how do I fix it?",
            "domain:code",
            "coder",
        ),
        ("Why was I charged twice on my last invoice?", "domain:finance", "support"),
    ],
)
def test_auto_is_routed_and_explained(gw: Gateway, text: str, route: str, model: str) -> None:
    r = _chat(gw, "auto", text)
    assert r.status_code == 200, r.text
    assert r.headers["x-switchyard-route"] == route
    assert r.headers["x-switchyard-model"] == model
    assert 0 < float(r.headers["x-switchyard-route-score"]) <= 1
    rid = r.headers["x-request-id"]
    rec = httpx.get(gw.url + f"/admin/requests/{rid}", headers=gw.admin).json()
    stages = [d["stage"] for d in rec["decisions"]]
    assert stages.index("route") < stages.index("select")
    decision = next(d for d in rec["decisions"] if d["stage"] == "route")
    assert decision["outcome"] == f"route:{route}" and decision["evidence"]["policy_version"]


def test_explicit_alias_bypasses_routing_and_is_still_authorized(gw: Gateway) -> None:
    r = _chat(gw, "coder", "Why was I charged twice on my last invoice?")
    assert r.status_code == 200 and "x-switchyard-route" not in r.headers
    assert r.headers["x-switchyard-model"] == "coder"
    gw.create_tenant("route-limited", allowed_models=["smollm2-135m", "auto"])
    key = gw.create_key("route-limited")["key"]
    assert _chat(gw, "coder", "hello", key=key).status_code == 403
    routed = _chat(gw, "auto", "My Python script raises a KeyError, how do I fix it?", key=key)
    assert routed.status_code == 403 and routed.json()["error"]["code"] == "model_not_allowed"


def test_denied_tool_never_survives_the_shortlist(gw: Gateway) -> None:
    tools = [
        {
            "type": "function",
            "function": {"name": "delete_account", "description": "Delete the user's account"},
        },
        {
            "type": "function",
            "function": {"name": "get_weather", "description": "Current weather for a city"},
        },
        {
            "type": "function",
            "function": {"name": "get_invoice", "description": "Fetch an invoice by number"},
        },
        {"type": "function", "function": {"name": "send_email", "description": "Send an e-mail"}},
    ]
    r = _chat(
        gw, "coder", "Please delete my account", tools=tools, headers={"x-request-id": "tools-1"}
    )
    assert r.status_code == 200
    rec = httpx.get(gw.url + "/admin/requests/tools-1", headers=gw.admin).json()
    d = next(x for x in rec["decisions"] if x["stage"] == "tools")
    ev = d["evidence"]
    kept = set(ev["kept"])
    assert "delete_account" not in kept and len(kept) == 2
    assert any(x["name"] == "delete_account" for x in ev["removed"])
