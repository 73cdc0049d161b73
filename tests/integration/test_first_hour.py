"""A newcomer's first hour (#42): every shipped example passes `check-config` and, where
its services are on this machine, starts as shipped and answers; the demonstration
adapters are named, not pasted in; the cache's cross-encoder is built in the background
by a gateway that needs it, with semantic hits off (and saying why) until then."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from support.gateways import ADMIN_KEY
from support.pair_data import tiny_pair_data
from support.paths import REPO
from support.procs import Proc, free_port, wait_http
from support.upstreams import start_scripted
from switchyard.config import ConfigError, load_settings, parse_settings
from switchyard.decide import encoder_build, pair_encoder
from switchyard.decide.candidate import CandidateCheck

ROOT = REPO
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))
CONFIGS = [p for p in EXAMPLES if "models" in (yaml.safe_load(p.read_text()) or {})]


def _switchyard(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "switchyard", *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_every_example_is_found() -> None:
    """The examples below are the gateway configs of examples/ (not the bench files)."""
    names = {p.name for p in CONFIGS}
    assert {"local-pool-and-adapters.yaml", "cache.yaml", "rl.yaml"} <= names, names


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_example_passes_check_config(path: Path) -> None:
    r = _switchyard("check-config", "--config", str(path))
    assert r.returncode == 0, r.stdout + r.stderr
    # Not even a warning: a shipped example is what a newcomer copies.
    assert r.stdout.startswith("ok: ") and "warning" not in r.stdout, r.stdout


def _upstream_ports(config: dict[str, Any]) -> list[int]:
    """The loopback ports of the example's OpenAI-compatible upstreams."""
    ports = []
    for m in config["models"]:
        engines = [m.get("engine") or {}] + [
            d.get("engine") or {} for d in m.get("deployments", [])
        ]
        for e in engines:
            url = str(e.get("base_url", ""))
            if e.get("kind") == "openai" and url.startswith("http://127.0.0.1:"):
                ports.append(int(url.split(":")[2].split("/")[0]))
    return ports


@pytest.fixture
def upstreams(request: pytest.FixtureRequest) -> Iterator[None]:
    """The example's loopback upstreams, each stood in by the scripted upstream on the
    very port the example names (so the example runs as shipped)."""
    config = yaml.safe_load(request.param.read_text())
    procs = []
    try:
        for port in _upstream_ports(config):
            proc, _ = start_scripted_on(port)
            procs.append(proc)
        yield
    finally:
        for p in procs:
            p.stop()


def start_scripted_on(port: int) -> tuple[Proc, str]:
    proc = Proc(
        [sys.executable, "-m", "switchyard.bench.scripted_upstream", "--port", str(port)],
        "scripted",
    )
    wait_http(f"http://127.0.0.1:{port}/health", proc)
    return proc, f"http://127.0.0.1:{port}"


def _first_model(config: dict[str, Any]) -> str:
    if config.get("router", {}).get("enabled"):
        return "auto"
    return str(config["models"][0]["alias"])


@pytest.mark.parametrize("upstreams", CONFIGS, ids=lambda p: p.name, indirect=True)
def test_each_example_starts_as_shipped_and_answers(
    upstreams: None, request: Any, tmp_path: Path
) -> None:
    path: Path = request.node.callspec.params["upstreams"]
    config = yaml.safe_load(path.read_text())
    port = free_port()
    # A database of this run's own: one keyed by the port alone outlived its run, and
    # a later run given the same port found the example's tenant already there (409).
    db = str(tmp_path / "example.db")
    proc = Proc(
        [sys.executable, "-m", "switchyard", "serve", "--config", str(path), "--port", str(port)],
        "example",
        # The keys a caller of the example would set (the upstreams read theirs).
        env={
            "SWITCHYARD_SQLITE_PATH": db,
            "SWITCHYARD_ADMIN_KEY": ADMIN_KEY,
            "BIG_API_KEY": "k",
            "CODER_API_KEY": "k",
            "SUPPORT_API_KEY": "k",
            "REASONER_API_KEY": "k",
        },
    )
    url = f"http://127.0.0.1:{port}"
    admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
    try:
        wait_http(url + "/readyz", proc, timeout_s=600)  # a first start trains the adapters
        tenant = "support"  # the adapters' tenant in the adapters example
        r = httpx.post(url + "/admin/tenants", json={"id": tenant}, headers=admin)
        assert r.status_code == 201, r.text
        fields = {"allowed_adapters": ["*"]} if config.get("adapters") else {}
        r = httpx.post(url + "/admin/keys", json={"tenant_id": tenant, **fields}, headers=admin)
        assert r.status_code == 201, r.text
        auth = {"Authorization": f"Bearer {r.json()['key']}"}
        body = {
            "model": _first_model(config),
            "messages": [{"role": "user", "content": "Say hello"}],
            "max_tokens": 8,
        }
        r = httpx.post(url + "/v1/chat/completions", json=body, headers=auth, timeout=120)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"], r.text
        for adapter in config.get("adapters", []):
            # A demonstration adapter answers with its marker: it was trained and loaded.
            marker = {"demo:pirate": "Arrr", "demo:robot": "BEEP"}[adapter["path"]]
            r = httpx.post(
                url + "/v1/chat/completions",
                json={**body, "model": adapter["name"], "temperature": 0, "max_tokens": 12},
                headers=auth,
                timeout=120,
            )
            assert r.status_code == 200, r.text
            assert marker in r.json()["choices"][0]["message"]["content"], r.text
    finally:
        proc.stop()


def test_a_demo_adapter_is_named_and_a_file_still_needs_its_sha256() -> None:
    base = {
        "alias": "m",
        "revision": "r",
        "engine": {"kind": "llamacpp", "gguf": "auto"},
    }
    named = {"name": "p", "base": "m", "base_revision": "r", "path": "demo:pirate"}
    assert parse_settings({"models": [base], "adapters": [named]}).adapters[0].demo == "pirate"
    for bad, says in (
        ({**named, "path": "demo:parrot"}, "names no demonstration adapter"),
        ({**named, "sha256": "0" * 64}, "leave it out"),
        ({**named, "path": "/srv/a.gguf"}, "required for an adapter file"),
    ):
        with pytest.raises(ConfigError, match=says):
            parse_settings({"models": [base], "adapters": [bad]})
    other = {**base, "engine": {"kind": "llamacpp", "gguf": "/srv/other.gguf"}}
    with pytest.raises(ConfigError, match="gguf: auto"):
        parse_settings({"models": [other], "adapters": [named]})
    with pytest.raises(ValueError, match="not trained yet"):
        _ = parse_settings({"models": [base], "adapters": [named]}).adapters[0].digest


def test_the_shipped_adapters_example_names_its_adapters() -> None:
    settings = load_settings(str(ROOT / "examples" / "local-pool-and-adapters.yaml"))
    assert {a.demo for a in settings.adapters} == {"pirate", "robot"}


# -- the cross-encoder, built in the background ------------------------------------------
def test_a_background_build_turns_semantic_hits_on_when_it_is_done(tmp_path: Path) -> None:
    """The real child process (the CLI's build, on a tiny data set): until it is done
    every candidate is vetoed with why, and the description says so; then the check
    is completed in place and decides with the built encoder."""
    data, out = tmp_path / "data", tmp_path / "cache"
    tiny_pair_data(data)
    check = CandidateCheck(rules=True, model=None, encoder=None, unavailable="x", missing=True)
    seen: list[str] = []
    argv = [*encoder_build.command(out, 0.7), "--data-dir", str(data)]
    ready = {"now": False}

    async def run() -> None:
        task = asyncio.create_task(
            encoder_build.build_in_background(
                check,
                lambda: pair_encoder.load(out, "rules", data),
                lambda: ready["now"],
                seen.append,
                argv,
                2,
            )
        )
        await asyncio.sleep(1.0)
        assert seen == [], "the build waits for the gateway to be ready"
        ready["now"] = True
        await asyncio.sleep(1.0)
        assert seen and "being built in the background" in seen[0]
        ok, why = check("How do I reset my password?", "How do I reset my password", 0.99)
        assert not ok and "being built" in why
        await asyncio.wait_for(task, 600)

    asyncio.run(run())
    assert check.encoder is not None and check.unavailable is None and not check.missing
    assert seen[-1] == "rules + cross-encoder", seen
    # The same question: the rules pass it, and the built cross-encoder decides.
    assert "cross-encoder p=" in check("What is a VPN?", "What is a VPN", 0.99)[1]


def test_a_failed_background_build_keeps_semantic_hits_off_and_says_why(
    tmp_path: Path,
) -> None:
    check = CandidateCheck(rules=True, model=None, encoder=None, unavailable="x", missing=True)
    seen: list[str] = []
    argv = [*encoder_build.command(tmp_path, 0.7), "--data-dir", str(tmp_path / "none")]

    async def run() -> None:
        await encoder_build.build_in_background(
            check, lambda: pair_encoder.load(tmp_path), lambda: True, seen.append, argv, 2
        )

    asyncio.run(run())
    assert check.encoder is None
    assert check.unavailable is not None and "build failed (exit 1" in check.unavailable
    assert "training data not found" in check.unavailable
    assert seen[-1].startswith("semantic hits off: the cache's cross-encoder build failed")


def _embedding_export(into: Path) -> None:
    """The embedding model's export, copied from this machine's cache (so the gateway
    below does not export it again): only the cross-encoder is missing there."""
    from switchyard.config import EmbeddingsConfig
    from switchyard.embed import cache_dir

    src = cache_dir(EmbeddingsConfig())
    into.mkdir(parents=True)
    for f in src.iterdir():
        if f.is_file() and not f.name.startswith("pair-encoder"):
            shutil.copy2(f, into / f.name)


def _children_running(pattern: str) -> list[str]:
    r = subprocess.run(["pgrep", "-af", pattern], capture_output=True, text=True, check=False)
    return [line for line in r.stdout.splitlines() if "pgrep" not in line]


def test_a_gateway_without_the_encoder_builds_it_after_ready_and_stops_the_build(
    tmp_path: Path,
) -> None:
    """`make serve` does not build the cross-encoder: a gateway with the semantic cache
    and no built encoder serves exact hits only, starts the build once ready, says so in
    /admin/cache/stats, and takes the build down with it when stopped."""
    cache = tmp_path / "xdg" / "switchyard"
    _embedding_export(cache)
    sproc, scripted = start_scripted()
    port = free_port()
    config = {
        "models": [
            {
                "alias": "cheap",
                "engine": {"kind": "openai", "base_url": scripted.url + "/v1"},
            }
        ],
        "embeddings": {"cache_dir": str(cache)},
        "cache": {"enabled": True},
    }
    cfg_path = tmp_path / "c.yaml"
    cfg_path.write_text(yaml.safe_dump(config))
    proc = Proc(
        [
            sys.executable,
            "-m",
            "switchyard",
            "serve",
            "--config",
            str(cfg_path),
            "--port",
            str(port),
        ],
        "gateway",
        env={"SWITCHYARD_SQLITE_PATH": str(tmp_path / "s.db"), "SWITCHYARD_ADMIN_KEY": ADMIN_KEY},
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http(url + "/readyz", proc)
        deadline = time.monotonic() + 30
        checks = ""
        while time.monotonic() < deadline:
            r = httpx.get(
                url + "/admin/cache/stats", headers={"Authorization": f"Bearer {ADMIN_KEY}"}
            )
            assert r.status_code == 200, r.text
            checks = r.json()["semantic_checks"]
            if "being built" in checks:
                break
            time.sleep(0.2)
        assert checks.startswith("semantic hits off: the cache's cross-encoder is being built")
        assert _children_running(f"build-verifier --dir {cache}"), "no build is running"
        proc.popen.terminate()
        proc.popen.wait(30)
        assert not _children_running(f"build-verifier --dir {cache}"), "the build outlived it"
    finally:
        proc.stop()
        sproc.stop()
