"""Deployments to build upstream payloads against, without a server: `a` (the upstream
knows it by the same name) and `b` (the upstream calls it `up-b`)."""

from __future__ import annotations

from switchyard.config import parse_settings
from switchyard.engines.registry import Registry

SETTINGS = parse_settings(
    {
        "models": [
            {"alias": "a", "engine": {"kind": "openai", "base_url": "http://127.0.0.1:9/v1"}},
            {
                "alias": "b",
                "engine": {"kind": "openai", "base_url": "http://127.0.0.1:9/v1", "model": "up-b"},
            },
        ],
        "embeddings": {"enabled": False},
    }
)
REGISTRY = Registry(SETTINGS)
