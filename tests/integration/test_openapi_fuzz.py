"""The served routes fuzzed from their OpenAPI description (`schemathesis`): whatever
a client sends within or outside the described shapes, no server error, every error
in its protocol's shape (OpenAI's, or Anthropic's on /v1/messages), and the gateway
keeps serving. Against the scripted instant upstream, with a capped number of examples
per route."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings

from support.gateways import Gateway, start_gateway
from support.upstreams import Scripted


@pytest.fixture(scope="module")
def fuzzed(scripted: Scripted) -> Iterator[Gateway]:
    g = start_gateway(
        {
            "models": [
                {"alias": "chat", "engine": {"kind": "openai", "base_url": scripted.url + "/v1"}},
                {
                    "alias": "eyes",  # image parts go through the media stage
                    "engine": {"kind": "openai", "base_url": scripted.url + "/v1"},
                    "capabilities": {"supports_vision": True},
                },
            ],
            "embeddings": {"enabled": True, "max_inputs": 4},
        }
    )
    yield g
    g.proc.stop()


def test_the_description_names_the_model_routes_and_models(fuzzed: Gateway) -> None:
    doc = httpx.get(fuzzed.url + "/openapi.json").json()
    assert {
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/embeddings",
        "/v1/models",
        "/v1/tasks/{task_id}",
        "/v1/messages",
        "/v1/messages/count_tokens",
        "/v1/responses",
        "/v1/responses/{response_id}",
    } <= set(doc["paths"])
    # the admin API is described too, behind the admin key
    assert doc["paths"]["/admin/usage"]["get"]["security"] == [{"admin": []}]
    assert "/admin/models/{alias}/revisions/{revision}" in doc["paths"]
    chat = doc["paths"]["/v1/chat/completions"]["post"]["requestBody"]["content"]
    assert chat["application/json"]["schema"]["properties"]["model"] == {"enum": ["chat", "eyes"]}


def _check(fuzzed: Gateway, case: Any, seen: Counter[tuple[str, int]]) -> None:
    response = case.call(base_url=fuzzed.url, headers=fuzzed.auth, timeout=30)
    seen[(f"{case.method} {case.path}", response.status_code)] += 1
    assert response.status_code < 500, (case.path, response.status_code, response.text[:500])
    if response.status_code >= 400:
        body = response.json()
        error = body["error"]
        if case.path.startswith("/v1/messages"):  # Anthropic's error shape there
            assert body["type"] == "error" and "param" not in error, body
        assert isinstance(error["message"], str) and isinstance(error["type"], str)
        assert "Traceback" not in response.text and 'File "' not in response.text


def test_model_routes_never_answer_a_server_error(fuzzed: Gateway) -> None:
    described = schemathesis.openapi.from_url(fuzzed.url + "/openapi.json")
    operations = [r.ok() for r in described.include(path_regex="^/v1/").get_all_operations()]
    # chat, completions, embeddings, models, task get/delete, messages, count_tokens,
    # responses create/get/delete/cancel/input_items, rollouts (404 here: no RL model)
    assert len(operations) == 14
    seen: Counter[tuple[str, int]] = Counter()
    for operation in operations:

        @given(case=operation.as_strategy())
        @settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
        def fuzz(case: Any) -> None:
            _check(fuzzed, case, seen)

        fuzz()
    by_route: dict[str, set[int]] = {}
    for (route, status), _ in seen.items():
        by_route.setdefault(route, set()).add(status)
    # the generated requests reached the model, not only the validator
    assert 200 in by_route["POST /v1/chat/completions"], by_route
    assert 200 in by_route["POST /v1/embeddings"], by_route
    assert 200 in by_route["POST /v1/messages"], by_route
    assert 200 in by_route["POST /v1/responses"], by_route
    # every authenticated model request has its usage row, embeddings, messages,
    # responses and counting tokens included (a count is a request of the key's:
    # service.counted), and so has every call to a stored response: read, deleted,
    # cancelled, its items listed (a call of the key's: service.called)
    stored = sum(n for (route, _), n in seen.items() if "{response_id}" in route)
    posted = sum(
        n
        for (route, _), n in seen.items()
        if route.startswith("POST") and "{response_id}" not in route
    )
    tenant = httpx.get(fuzzed.url + "/v1/models", headers=fuzzed.auth).status_code
    assert tenant == 200
    rows = httpx.get(
        fuzzed.url + "/admin/usage", params={"limit": 10_000}, headers=fuzzed.admin
    ).json()["data"]
    calls = [r for r in rows if r["endpoint"].startswith("responses.")]
    assert (len(rows) - len(calls), len(calls)) == (posted, stored), (len(rows), posted, stored)
    # and it still serves a plain request afterwards
    ok = fuzzed.post(
        "/v1/chat/completions",
        json={"model": "chat", "messages": [{"role": "user", "content": "hi"}]},
    )
    assert ok.status_code == 200, ok.text
