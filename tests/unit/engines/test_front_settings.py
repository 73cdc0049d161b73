"""The engine front's settings and refusals, without an engine: what a worker's
settings name for each local engine (`remote_engines`), and what the front answers
before any engine is involved (engines/front.py). Its answers from a real engine are
tests/integration/test_engine_front.py's."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.routing import Mount
from starlette.testclient import TestClient

from switchyard.config import OpenAIEngine, Settings, parse_settings
from switchyard.engines.front import EngineFront, read_body, remote_engines, split_path
from switchyard.engines.registry import Registry
from switchyard.errors import PayloadTooLarge

TOKEN = "t0ken"


def _settings() -> Settings:
    return parse_settings(
        {
            "models": [
                {"alias": "smol", "revision": "r", "engine": {"kind": "llamacpp"}},
                {
                    "alias": "pair",
                    "engine": {"kind": "llamacpp"},
                    "deployments": [
                        {"name": "edge", "engine": {"kind": "llamacpp"}},
                        {"name": "cloud", "engine": {"kind": "openai", "base_url": "http://x/v1"}},
                    ],
                },
                {"alias": "far", "engine": {"kind": "openai", "base_url": "http://far/v1"}},
            ],
            "adapters": [
                {
                    "name": "tone",
                    "base": "smol",
                    "base_revision": "r",
                    "path": "/nowhere/tone.gguf",
                    "sha256": "0" * 64,
                }
            ],
            "embeddings": {"enabled": False},
        },
        "test",
    )


def _engine(s: Settings, alias: str) -> Any:
    return next(m for m in s.models if m.alias == alias)


def test_remote_engines_name_each_local_engine_at_its_front() -> None:
    s = remote_engines(_settings(), "http://127.0.0.1:7001/engines/", "TOKEN_ENV")
    smol = _engine(s, "smol").engine
    assert isinstance(smol, OpenAIEngine)
    assert smol.base_url == "http://127.0.0.1:7001/engines/smol/v1"
    assert smol.model == "smol" and smol.api_key_env == "TOKEN_ENV"
    pair = _engine(s, "pair")
    edge, cloud = pair.deployments
    # A deployment's engine is its name in the owner's pool; it stays on the device.
    assert edge.engine.base_url == "http://127.0.0.1:7001/engines/pair/edge/v1"
    assert edge.engine.model == "pair/edge" and edge.where == "device"
    assert pair.engine == edge.engine
    assert cloud.engine.base_url == "http://x/v1" and cloud.where == "cloud"
    assert _engine(s, "far").engine.base_url == "http://far/v1"
    assert [a.name for a in s.adapters] == ["tone"]  # an alias over its base, still


def test_remote_engines_for_ray_leave_deployments_alone() -> None:
    s = remote_engines(_settings(), "http://127.0.0.1:8000/engines", "E", deployments=False)
    assert _engine(s, "smol").engine.base_url == "http://127.0.0.1:8000/engines/smol/v1"
    assert _engine(s, "pair").deployments[0].engine.kind == "llamacpp"


def test_split_path_finds_the_engine_route() -> None:
    assert split_path("/engines/a/b/v1/chat/completions") == (
        "/engines/a/b",
        "/v1/chat/completions",
    )
    assert split_path("/v1/models") == ("", "/v1/models")
    assert split_path("/engines/a") == ("/engines/a", "")


@pytest.fixture
def front() -> Iterator[EngineFront]:
    """The front of the engines of `_settings()`, none of them started."""
    app = EngineFront(Registry(_settings()), TOKEN)
    yield app
    asyncio.run(app.close())


def _post(client: TestClient, path: str, token: str = TOKEN, **kw: Any) -> Any:
    return client.post(path, headers={"Authorization": f"Bearer {token}"}, **kw)


def _error(r: Any) -> tuple[int, str]:
    return r.status_code, r.json()["error"]["code"]


def test_the_front_serves_each_managed_engine_by_its_name_in_the_pool(front: EngineFront) -> None:
    assert sorted(front.targets) == ["pair/edge", "smol"]
    assert front.targets["smol"].adapters == {"tone"}
    client = TestClient(front)
    auth = {"Authorization": f"Bearer {TOKEN}"}
    # Found, and answered without starting it: its engine is not running.
    r = client.get("/pair/edge/v1/models", headers=auth)
    assert _error(r) == (503, "engine_not_ready") and r.headers["retry-after"]
    # Mounted as the control plane mounts it: the same routes below the mount.
    mounted = TestClient(Starlette(routes=[Mount("/engines", app=front)]))
    assert _error(mounted.get("/engines/smol/v1/models", headers=auth)) == (503, "engine_not_ready")
    assert _error(mounted.get("/engines/nowhere/v1/models", headers=auth)) == (
        404,
        "model_not_found",
    )


def test_refusals_come_in_the_openai_error_shape_in_their_order(front: EngineFront) -> None:
    client = TestClient(front)
    # The token first: nothing else is told to a caller without it.
    r = _post(client, "/nowhere/v1/embeddings", token="wrong", json={})
    assert r.status_code == 401
    assert r.json()["error"] == {
        "message": "the engines answer the gateway only",
        "type": "authentication_error",
        "param": None,
        "code": "invalid_api_key",
    }
    long = "Bearer " + TOKEN + "x" * 10_000
    assert client.post("/smol/v1/models", headers={"Authorization": long}).status_code == 401
    assert _error(_post(client, "/smol/v1/embeddings", json={})) == (404, "not_found")
    r = _post(client, "/nowhere/v1/completions", json={})
    assert _error(r) == (404, "model_not_found")
    assert "nowhere" not in r.json()["error"]["message"]  # the caller's input is not echoed
    r = client.post(
        "/smol/v1/completions",
        json={"prompt": "Hi"},
        headers={"Authorization": f"Bearer {TOKEN}", "serve_multiplexed_model_id": "nope"},
    )
    assert r.status_code == 404
    assert r.json()["error"]["message"] == "no adapter 'nope' on this engine"


def _request(headers: list[tuple[bytes, bytes]], chunks: list[bytes]) -> Request:
    scope = {"type": "http", "method": "POST", "headers": headers}
    left = list(chunks)

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": left.pop(0), "more_body": bool(left)}

    return Request(scope, receive)


def test_a_body_past_the_bound_is_refused_413_as_it_arrives_or_as_declared() -> None:
    body = asyncio.run(read_body(_request([], [b"12345", b"678"]), 8))
    assert body == b"12345678"
    with pytest.raises(PayloadTooLarge):
        asyncio.run(read_body(_request([], [b"12345", b"6789"]), 8))
    # Declared too long: refused before a byte is read (this body would fit).
    with pytest.raises(PayloadTooLarge):
        asyncio.run(read_body(_request([(b"content-length", b"9")], [b"1"]), 8))
