"""PII modes through a running gateway: what the upstream sees, and block."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from support.gateways import Gateway, start_gateway
from support.upstreams import Scripted


@pytest.fixture(scope="module")
def gw(scripted: Scripted) -> Iterator[Gateway]:
    url = scripted.url + "/v1"
    g = start_gateway(
        {
            "models": [
                {"alias": "observe", "engine": {"kind": "openai", "base_url": url}},
                {"alias": "masked", "engine": {"kind": "openai", "base_url": url}},
                {"alias": "strict", "engine": {"kind": "openai", "base_url": url}},
            ],
            "pii": {
                "mode": "observe_only",
                "models": {"masked": "mask_upstream", "strict": "block"},
            },
            "embeddings": {"enabled": False},
        }
    )
    yield g
    g.proc.stop()


def _ask(gw: Gateway, model: str, text: str) -> httpx.Response:
    return gw.post(
        "/v1/chat/completions",
        json={"model": model, "max_tokens": 4, "messages": [{"role": "user", "content": text}]},
    )


TEXT = "Email jane.doe@example.org about card 4111 1111 1111 1111"


def _seen(scripted: Scripted) -> str:
    return str(httpx.get(scripted.url + "/stats").json()["last_prompt"])


def test_observe_only_sends_raw_text_upstream(gw: Gateway, scripted: Scripted) -> None:
    assert _ask(gw, "observe", TEXT).status_code == 200
    assert _seen(scripted) == TEXT


def test_mask_upstream_sends_placeholders(gw: Gateway, scripted: Scripted) -> None:
    assert _ask(gw, "masked", TEXT).status_code == 200
    seen = _seen(scripted)
    assert "jane.doe@example.org" not in seen and "4111" not in seen
    assert "<EMAIL_1>" in seen and "<CARD_1>" in seen


def test_block_refuses_pii_naming_the_types(gw: Gateway, scripted: Scripted) -> None:
    before = httpx.get(scripted.url + "/stats").json()["requests"]
    r = _ask(gw, "strict", TEXT)
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["code"] == "pii_detected" and "EMAIL" in err["message"] and "CARD" in err["message"]
    assert "jane.doe" not in r.text
    assert httpx.get(scripted.url + "/stats").json()["requests"] == before
    assert _ask(gw, "strict", "no personal data here").status_code == 200
