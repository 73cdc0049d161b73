"""Config validation: a bad config fails at load, naming the key and the fix."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from support.paths import REPO
from switchyard.config import ConfigError, load_settings, parse_settings


def _model(**over: Any) -> dict[str, Any]:
    m: dict[str, Any] = {
        "alias": "m",
        "engine": {"kind": "openai", "base_url": "http://127.0.0.1:9/v1"},
    }
    m.update(over)
    return m


def test_embedded_default_is_one_local_model() -> None:
    s = load_settings(None)
    assert [m.alias for m in s.models] == ["smollm2-135m"]
    assert s.models[0].engine.kind == "llamacpp"
    assert s.embeddings.enabled


_LOCAL = {"alias": "local", "revision": "r1", "engine": {"kind": "llamacpp"}}


def _adapter(**kw: Any) -> dict[str, Any]:
    return {
        "name": "ad",
        "base": "local",
        "base_revision": "r1",
        "path": "/x.gguf",
        "sha256": "0" * 64,
        **kw,
    }


@pytest.mark.parametrize(
    ("data", "needle"),
    [
        ({"models": []}, "models: List should have at least 1 item"),
        ({"models": [_model(engine={"kind": "tgi"})]}, "models[0].engine"),
        (
            {"models": [_model(engine={"kind": "openai"})]},
            "models[0].engine.base_url: Field required",
        ),
        (
            {"models": [_model(engine={"kind": "openai", "base_url": "ftp://x"})]},
            "base_url must start with http",
        ),
        (
            {
                "models": [
                    _model(engine={"kind": "openai", "base_url": "http://x", "api_key": "sk-123"})
                ]
            },
            "secrets are not allowed inline",
        ),
        ({"models": [_model(), _model()]}, "duplicate alias 'm'"),
        ({"models": [_model(price={"input": -1})]}, "models[0].price.input"),
        (
            {"models": [_model(capabilities={"context_window": "big"})]},
            "models[0].capabilities.context_window",
        ),
        (
            {"models": [_model(tempreature=1)]},
            "models[0].tempreature: Extra inputs are not permitted",
        ),
        ({"models": [_model()], "server": {"port": 99999}}, "server.port"),
        ({"models": [_model(alias="all-minilm-l6-v2")]}, "embeddings.alias"),
        (
            {"models": [_LOCAL], "adapters": [_adapter(base="nope")]},
            "adapters[0] (ad).base: unknown alias 'nope'",
        ),
        (
            {"models": [_LOCAL], "adapters": [_adapter(base_revision="r0")]},
            "trained on 'local' revision 'r0', but that model is revision 'r1'",
        ),
        (
            {"models": [_model(), _LOCAL], "adapters": [_adapter(base="m")]},
            "'m' is not a llamacpp model on the server runtime or a vllm model",
        ),
        (
            {"models": [_LOCAL], "adapters": [_adapter(name="local")]},
            "adapters[0] (local).name: 'local' is already a model alias",
        ),
        (
            {"models": [_LOCAL], "adapters": [_adapter(sha256="abc")]},
            "adapters[0].sha256",
        ),
        (
            {"models": [{**_LOCAL, "alias": "auto"}]},
            "models[0].alias: 'auto' is reserved for the router",
        ),
        (
            {"models": [_LOCAL], "adapters": [_adapter(name="auto")]},
            "adapters[0].name: 'auto' is reserved for the router",
        ),
        (
            {
                "models": [{**_LOCAL, "engine": {"kind": "llamacpp", "max_adapters": 0}}],
                "adapters": [_adapter(name="a1")],
            },
            "the engine of 'local' has max_adapters 0 and loads none",
        ),
        (
            {
                "models": [
                    {
                        **_LOCAL,
                        "engine": {"kind": "llamacpp", "max_adapters": 1, "max_active_adapters": 2},
                    }
                ],
            },
            "max_active_adapters (2) is more than max_adapters (1)",
        ),
    ],
)
def test_bad_configs_name_the_key(data: dict[str, Any], needle: str) -> None:
    with pytest.raises(ConfigError) as exc:
        parse_settings(data, "test.yaml")
    assert needle in str(exc.value)
    assert "sk-123" not in str(exc.value)


def test_api_key_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("UPSTREAM_KEY", "secret-value")
    s = parse_settings(
        {
            "models": [
                _model(
                    engine={
                        "kind": "openai",
                        "base_url": "http://h/v1/",
                        "api_key_env": "UPSTREAM_KEY",
                    }
                )
            ]
        }
    )
    engine = s.models[0].engine
    assert engine.kind == "openai"
    assert engine.api_key() == "secret-value"
    assert engine.base_url == "http://h/v1"


def test_serve_with_bad_config_exits_nonzero_naming_the_key(tmp_path: Path) -> None:
    cfg = tmp_path / "bad.yaml"
    cfg.write_text("models:\n  - alias: x\n    engine: {kind: openai}\n")
    r = subprocess.run(
        [sys.executable, "-m", "switchyard", "serve", "--config", str(cfg), "--port", "0"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2
    assert "models[0].engine.base_url: Field required" in r.stderr
    assert "Traceback" not in r.stderr


def test_yaml_syntax_error_is_reported(tmp_path: Path) -> None:
    cfg = tmp_path / "bad.yaml"
    cfg.write_text("models: [\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_settings(cfg)


def test_example_configs_load() -> None:
    examples = sorted(REPO.joinpath("examples").glob("*.yaml"))
    assert examples, "no example configs"
    for path in examples:
        load_settings(path)
