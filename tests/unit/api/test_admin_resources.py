"""The admin API split by resource (api/admin/): the same routes in the same order as
the one route builder it replaced, handlers reachable outside any closure, and the
live view's breakers of models and MCP tool servers alike; the composition root hands
the metrics to the engine pool and the revision managers at construction."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
from starlette.applications import Starlette
from starlette.testclient import TestClient

from switchyard.api.admin import build_admin_routes
from switchyard.config import parse_settings
from switchyard.gateway import Gateway

ADMIN_KEY = "admin-test-key"

# (path, methods) of every admin route, in matching order, as the single
# build_admin_routes function of closures (api/admin.py) served them before the split.
ROUTES_BEFORE = [
    ("/admin/cache/invalidate", ("POST",)),
    ("/admin/cache/stats", ("GET", "HEAD")),
    ("/admin/engines", ("GET", "HEAD")),
    ("/admin/models/{alias:path}/weights", ("GET", "HEAD", "POST")),
    ("/admin/models/{alias:path}/revisions", ("GET", "HEAD", "POST")),
    ("/admin/models/{alias:path}/revisions/rollback", ("POST",)),
    ("/admin/models/{alias:path}/revisions/{revision}", ("GET", "HEAD")),
    ("/admin/models/{alias:path}/revisions/{revision}/activate", ("POST",)),
    ("/admin/models/{alias:path}/{action:str}", ("POST",)),
    ("/admin/requests", ("GET", "HEAD")),
    ("/admin/requests/{request_id}", ("GET", "HEAD")),
    ("/admin/tasks", ("GET", "HEAD")),
    ("/admin/live", ("GET", "HEAD")),
    ("/admin/cost", ("GET", "HEAD")),
    ("/admin/tasks/{task_id}", ("DELETE", "GET", "HEAD")),
    ("/admin/approvals", ("POST",)),
    ("/admin/tool-calls", ("GET", "HEAD", "POST")),
    ("/admin/tenants", ("GET", "HEAD", "POST")),
    ("/admin/tenants/{tenant_id}", ("GET", "HEAD", "PATCH")),
    ("/admin/keys", ("GET", "HEAD", "POST")),
    ("/admin/keys/{key_id}", ("DELETE", "GET", "HEAD", "PATCH")),
    ("/admin/keys/{key_id}/revoke", ("POST",)),
    ("/admin/usage", ("GET", "HEAD")),
]


def _settings(**more: Any) -> Any:
    raw: dict[str, Any] = {
        "models": [
            {"alias": "m", "engine": {"kind": "openai", "base_url": "http://127.0.0.1:9/v1"}}
        ],
        "embeddings": {"enabled": False},
        "auth": {"mode": "disabled", "bootstrap_dev_key": False},
        "storage": {"backend": "memory"},
        **more,
    }
    return parse_settings(raw, "test")


@pytest.fixture
def gw() -> Iterator[Gateway]:
    """A gateway (not started: nothing is called) with one model and one MCP server."""
    yield Gateway(
        _settings(
            mcp={
                "servers": [
                    {"name": "tools", "url": "http://127.0.0.1:9/mcp", "breaker": {"failures": 2}}
                ]
            }
        )
    )


def test_every_admin_route_is_served_in_the_order_it_was() -> None:
    from types import SimpleNamespace

    from switchyard.config import AuthConfig

    described = SimpleNamespace(settings=SimpleNamespace(auth=AuthConfig()))
    routes = build_admin_routes(described)  # type: ignore[arg-type]
    assert [(r.path, tuple(sorted(r.methods or ()))) for r in routes] == ROUTES_BEFORE


def test_admin_handlers_are_reachable_methods_with_a_summary(gw: Gateway) -> None:
    for route in build_admin_routes(gw):
        endpoint = route.endpoint
        assert "<locals>" not in endpoint.__qualname__, endpoint.__qualname__
        assert endpoint.__module__.startswith("switchyard.api.admin."), endpoint.__module__
        assert (endpoint.__doc__ or "").strip(), f"{route.path} has no summary for OpenAPI"


def test_live_view_shows_the_tool_servers_breakers_beside_the_models(
    gw: Gateway, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(gw.settings.auth.admin_key_env, ADMIN_KEY)
    client = TestClient(Starlette(routes=build_admin_routes(gw)))
    auth = {"authorization": f"Bearer {ADMIN_KEY}"}

    breakers = client.get("/admin/live", headers=auth).json()["breakers"]
    assert breakers == {"m": "closed", "mcp:tools": "closed"}

    server = gw.mcp.servers.servers["tools"]
    for _ in range(2):  # breaker.failures: 2
        server.breaker.record(False, time.monotonic())
    breakers = client.get("/admin/live", headers=auth).json()["breakers"]
    assert breakers == {"m": "closed", "mcp:tools": "open"}


def test_live_view_without_tool_servers_shows_the_models_only(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    plain = Gateway(_settings())
    monkeypatch.setenv(plain.settings.auth.admin_key_env, ADMIN_KEY)
    client = TestClient(Starlette(routes=build_admin_routes(plain)))
    got = client.get("/admin/live", headers={"authorization": f"Bearer {ADMIN_KEY}"})
    assert got.status_code == 200
    assert got.json()["breakers"] == {"m": "closed"}


def test_metrics_hear_the_engine_pool_and_know_the_aliases_from_construction() -> None:
    gw = Gateway(_settings(observe={"metrics": True}))
    metrics = gw.metrics
    assert metrics is not None
    assert metrics.known_models == frozenset({"m", gw.settings.embeddings.alias})
    pool = gw.registry.pool
    assert pool.on_event is not None and pool.on_memory is not None
    assert pool.on_adapter is not None
    pool.on_event("load", "m", 1.5)  # what the pool says when an engine has loaded
    text = metrics.exposition().decode()
    assert 'switchyard_engine_loads_total{model="m"} 1.0' in text


def test_without_metrics_the_pool_has_no_listeners() -> None:
    gw = Gateway(_settings(observe={"metrics": False}))
    assert gw.metrics is None
    pool = gw.registry.pool
    assert (pool.on_event, pool.on_memory, pool.on_adapter) == (None, None, None)
