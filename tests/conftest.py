"""Fixtures and hooks for the whole suite. The helpers the tests share live in the
`support` package beside this file (tests/support/); this file sits at tests/ so that
pytest puts tests/ on `sys.path` and `from support.X import ...` works from every folder.

Everything under tests/integration/ (tests that start real processes: gateways,
engines, upstreams, Redis, PostgreSQL, Chromium, command lines) is marked
`integration`, so `pytest -m "not integration"` runs the unit tests alone."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import settings as hypothesis_settings

from support.gateways import Gateway, cheap_config, start_gateway
from support.mcp_sessions import Tools
from support.redis_server import start_redis, stop_redis
from support.upstreams import Scripted, start_scripted, start_worker

# Property tests draw the same examples in every run (CI must be reproducible); set
# HYPOTHESIS_PROFILE=explore to draw new ones while developing.
hypothesis_settings.register_profile("ci", derandomize=True)
hypothesis_settings.register_profile("explore", derandomize=False)
hypothesis_settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

INTEGRATION = Path(__file__).resolve().parent / "integration"


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "integration: starts real processes on loopback (every test under tests/integration/)",
    )


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.path.resolve().is_relative_to(INTEGRATION):
            item.add_marker(pytest.mark.integration)


@pytest.fixture(scope="session")
def default_gateway() -> Iterator[Gateway]:
    """`switchyard serve` with the embedded default config, shared by read-only tests."""
    gw = start_gateway(None)
    yield gw
    gw.proc.stop()


@pytest.fixture(scope="session")
def second_worker() -> Iterator[int]:
    proc, port = start_worker()
    yield port
    proc.stop()


@pytest.fixture(scope="module")
def scripted() -> Iterator[Scripted]:
    proc, s = start_scripted()
    yield s
    proc.stop()


@pytest.fixture()
def content(scripted: Scripted) -> Iterator[Scripted]:
    """The module's scripted upstream, its reply's content set by the test (PII
    restoration tests), reset after it."""
    yield scripted
    scripted.content(None)


@pytest.fixture(scope="module")
def gw(scripted: Scripted) -> Iterator[Gateway]:
    """A module's gateway on `cheap_config` over its scripted upstream, stopped after
    it. A module that needs another configuration defines its own `gw`."""
    g = start_gateway(cheap_config(scripted))
    yield g
    g.proc.stop()


@pytest.fixture(scope="module")
def tools() -> Tools:
    """A module's MCP tool servers (support/mcp_sessions.py `Tools`)."""
    return Tools()


@pytest.fixture(scope="module")
def redis_url() -> Iterator[str]:
    """A throwaway redis-server for a module (a module that needs another scope or
    start defines its own `redis_url`, which takes precedence)."""
    proc, url = start_redis()
    yield url
    stop_redis(proc)


@pytest.fixture(scope="module")
def two() -> Iterator[tuple[Scripted, Scripted]]:
    """Two scripted upstreams for a module's gateways (two deployments of one alias)."""
    pa, a = start_scripted()
    pb, b = start_scripted()
    yield a, b
    pa.stop()
    pb.stop()


@pytest.fixture(scope="session")
def embed() -> Any:
    """all-MiniLM-L6-v2 from the installed wheel, loaded once for the whole run:
    unit-normalised float32 vectors, like the gateway's embedding service."""
    import numpy as np
    from sentence_transformers import SentenceTransformer

    from switchyard.engines.assets import minilm_model_path

    model = SentenceTransformer(minilm_model_path(), device="cpu")

    def fn(texts: list[str]) -> Any:
        vecs = model.encode(texts, normalize_embeddings=True, convert_to_numpy=True)
        return np.asarray(vecs, np.float32)

    return fn
