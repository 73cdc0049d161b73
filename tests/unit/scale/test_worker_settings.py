"""What a worker of `serve --workers N` runs with (scale/workers.py): its share of the
connections, the shared state, the control plane's engines; and what refuses workers."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from switchyard.config import OpenAIEngine, parse_settings
from switchyard.scale.workers import refusal, usable_workers, worker_settings

LOCAL = {"alias": "smol", "engine": {"kind": "llamacpp", "gguf": "auto"}}
REMOTE = {"alias": "up", "engine": {"kind": "openai", "base_url": "http://10.0.0.1:9/v1"}}


@given(st.integers(1, 100_000), st.integers(1, 256))
def test_the_workers_share_the_connection_cap(cap: int, n: int) -> None:
    base = parse_settings({"models": [REMOTE], "server": {"max_connections": cap}})
    share = worker_settings(base, "http://127.0.0.1:1", "unix:///r.sock", n)
    got = share.server.max_connections
    assert got >= 1
    assert got * n >= cap  # together they take at least the configured cap
    assert cap == 0 or (got - 1) * n < cap  # and not a whole connection more each


def test_a_workers_local_models_are_the_control_planes_and_its_state_is_shared() -> None:
    base = parse_settings({"models": [LOCAL, REMOTE]})
    s = worker_settings(base, "http://127.0.0.1:4321", "unix:///run/redis.sock", 2)
    assert s.storage.redis_url == "unix:///run/redis.sock"
    local, remote = s.models
    assert isinstance(local.engine, OpenAIEngine)
    assert local.engine.base_url == "http://127.0.0.1:4321/engines/smol/v1"
    assert remote.engine == base.models[1].engine  # a remote model is left as it was


def test_what_refuses_several_workers() -> None:
    assert refusal(parse_settings({"models": [REMOTE]})) is None
    memory = parse_settings({"models": [REMOTE], "storage": {"backend": "memory"}})
    assert "memory" in (refusal(memory) or "")


def test_workers_count() -> None:
    assert usable_workers(3) == 3
    assert usable_workers("auto") >= 1
    for bad in (0, 257, "many"):
        try:
            usable_workers(bad)
        except ValueError as exc:
            assert "--workers" in str(exc)
        else:
            raise AssertionError(f"{bad!r} was accepted")
