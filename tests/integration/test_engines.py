"""Engine lifecycle over real processes: a second upstream, readiness, restart, cancel."""

from __future__ import annotations

import concurrent.futures
import os
import re
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from support.gateways import Gateway, local_model, start_gateway
from support.paths import REPO
from support.procs import Proc, free_port
from support.upstreams import Scripted

# SmolLM2's end tokens (<|endoftext|>, <|im_end|>): banning them forces long generations.
NO_EOS = {"0": -100, "2": -100}


def chat(model: str, content: str = "Hi", max_tokens: int = 1, **extra: Any) -> dict[str, Any]:
    """A one-message chat body; `long=True` bans EOS so it runs for `max_tokens`."""
    if extra.pop("long", False):
        extra["logit_bias"] = NO_EOS
    body = {"model": model, "messages": [{"role": "user", "content": content}]}
    return {**body, "max_tokens": max_tokens, **extra}


@pytest.fixture(scope="module")
def two_upstreams(second_worker: int) -> Iterator[Gateway]:
    config = {
        "models": [
            local_model("local-smol"),
            {
                "alias": "remote-smol",
                "revision": "remote-rev-7",
                "engine": {"kind": "openai", "base_url": f"http://127.0.0.1:{second_worker}/v1"},
                "region": "eu",
            },
        ],
        "embeddings": {"enabled": False},
    }
    gw = start_gateway(config)
    yield gw
    gw.proc.stop()


def test_openai_upstream_serves_its_alias(two_upstreams: Gateway, second_worker: int) -> None:
    client = two_upstreams.openai()
    raw = client.chat.completions.with_raw_response.create(
        model="remote-smol", messages=[{"role": "user", "content": "Hi"}], max_tokens=4
    )
    assert raw.headers["x-switchyard-upstream"] == "remote-smol"  # its name, not its URL
    trace = two_upstreams.trace(raw.headers["x-request-id"])  # the URL is the operator's
    assert trace["upstream"] == f"http://127.0.0.1:{second_worker}/v1"
    assert raw.headers["x-switchyard-revision"] == "remote-rev-7"
    assert raw.parse().choices[0].message.content is not None
    local = client.chat.completions.with_raw_response.create(
        model="local-smol", messages=[{"role": "user", "content": "Hi"}], max_tokens=4
    )
    assert local.headers["x-switchyard-upstream"] == "local-smol"
    # Streaming goes through the same upstream path.
    chunks = list(
        client.chat.completions.create(
            model="remote-smol",
            messages=[{"role": "user", "content": "Hi"}],
            max_tokens=4,
            stream=True,
        )
    )
    assert any(c.choices and c.choices[0].delta.content for c in chunks)


def test_closing_a_stream_early_frees_the_engine(two_upstreams: Gateway) -> None:
    body = chat("local-smol", "Count upwards from one, forever.", 1800, long=True, stream=True)
    # Uncancelled, this generation would take far longer than the bound below.
    with two_upstreams.stream(body) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        got = [next(lines) for _ in range(6)]
        assert any(line.startswith("data: ") for line in got)
    started = time.monotonic()
    r2 = two_upstreams.post(
        "/v1/chat/completions",
        json=chat("local-smol", max_tokens=2),
        timeout=60,
    )
    assert r2.status_code == 200
    waited = time.monotonic() - started
    assert waited < 8, f"the engine kept generating for the departed client ({waited:.1f}s)"


def test_long_generation_is_really_long(two_upstreams: Gateway) -> None:
    """Guards the cancellation test: banning EOS does force a long generation."""
    r = two_upstreams.post(
        "/v1/chat/completions",
        json=chat("local-smol", max_tokens=40, long=True),
        timeout=60,
    )
    assert r.status_code == 200
    assert r.json()["usage"]["completion_tokens"] == 40


def test_readyz_503_until_ready_then_kill_and_recover() -> None:
    gw = start_gateway(
        {"models": [local_model("smol", restart_backoff_s=0.2)], "embeddings": {"enabled": False}},
        wait_ready=False,
    )
    try:
        first = httpx.get(gw.url + "/readyz")
        assert first.status_code == 503, "ready before the model could have loaded"
        assert first.json()["models"]["smol"]["ready"] is False
        assert first.headers["retry-after"]
        early = gw.post(
            "/v1/chat/completions",
            json=chat("smol"),
            timeout=30,
        )
        if early.status_code != 200:  # loading: 503 with Retry-After, not a hang or a 500
            assert early.status_code == 503
            assert early.json()["error"]["code"] == "engine_not_ready"
            assert early.headers["retry-after"]
        _wait_ready(gw)
        # A worker that dies under a request: 502 engine_crashed, not retried there.
        # pid, upstream and errors are the admin's part of /readyz.
        crashed_pid = httpx.get(gw.url + "/readyz", headers=gw.admin).json()["models"]["smol"][
            "pid"
        ]
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            long = pool.submit(
                gw.post,
                "/v1/chat/completions",
                json=chat("smol", "Count upwards, forever.", 1500, long=True),
            )
            time.sleep(1.5)
            os.kill(crashed_pid, signal.SIGSEGV)
            crashed = long.result(60)
        assert crashed.status_code == 502, crashed.text
        assert crashed.json()["error"]["code"] == "engine_crashed"
        assert crashed.headers["x-switchyard-attempts"] == "1"
        assert "SIGSEGV" not in crashed.text  # the reason is for the log and the trace
        _wait_ready(gw)
        info = httpx.get(gw.url + "/readyz", headers=gw.admin).json()["models"]["smol"]
        assert "killed by SIGSEGV while serving" in info["last_error"]
        assert info["state"] == "ready" and info["restarts"] == 1
        pid = info["pid"]
        assert info["live"] and pid and pid != crashed_pid
        killed_at = info["upstream"].removesuffix("/v1")
        os.kill(pid, signal.SIGKILL)
        # The dead engine is reported and requests fail cleanly (502/503), never hang;
        # one that arrives once the restart is under way waits for it (the pool's one
        # load) and is served by the new process.
        r = gw.post(
            "/v1/chat/completions",
            json=chat("smol"),
            timeout=30,
        )
        if r.status_code == 200:
            served = gw.trace(r.headers["x-request-id"])["upstream"]  # the header has no URL
            assert served != f"llamacpp:{killed_at}", served
        else:
            assert r.status_code in (502, 503), r.text
            assert r.json()["error"]["code"] in (
                "engine_not_ready",
                "engine_crashed",
                "upstream_unreachable",
                "upstream_error",
            )
        _wait_ready(gw)
        after = httpx.get(gw.url + "/readyz", headers=gw.admin).json()["models"]["smol"]
        assert after["restarts"] >= 2 and after["pid"] != pid
        ok = gw.post(
            "/v1/chat/completions",
            json=chat("smol"),
            timeout=30,
        )
        assert ok.status_code == 200
    finally:
        gw.proc.stop()


def _wait_ready(gw: Gateway, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if httpx.get(gw.url + "/readyz").status_code == 200:
            return
        time.sleep(0.1)
    raise AssertionError(f"not ready after {timeout_s}s:\n{gw.proc.output()[-3000:]}")


def test_local_model_answers_a_multi_token_chat_on_a_portable_build(
    default_gateway: Gateway,
) -> None:
    """The embedded engine generates many tokens for a real prompt (issue #16: on AMX
    Xeons a native build answered one-token prompts and crashed on every longer one),
    and it was compiled to the portable baseline, without AVX-512 or AMX."""
    r = default_gateway.post(
        "/v1/chat/completions",
        json={
            "model": "smollm2-135m",
            "messages": [
                {"role": "system", "content": "You are a helpful assistant for engineers."},
                {"role": "user", "content": "List three reasons to test software on old CPUs."},
            ],
            "max_tokens": 24,
            "logit_bias": NO_EOS,
        },
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["usage"]["prompt_tokens"] > 20
    assert body["usage"]["completion_tokens"] == 24
    assert body["choices"][0]["message"]["content"].strip()
    ready = httpx.get(default_gateway.url + "/readyz", headers=default_gateway.admin)
    info = ready.json()["models"]["smollm2-135m"]
    system = info["system_info"]
    assert "AVX2 = 1" in system and "FMA = 1" in system, system
    assert "AMX" not in system and "AVX512 = 1" not in system, system
    assert info["extra_buffer_types"] is False
    assert info["failed_starts"] == 0 and info["reason"] is None


def _broken_model_config(tmp: Path, scripted: Scripted, **model: Any) -> dict[str, Any]:
    bad = tmp / "broken.gguf"
    bad.write_bytes(b"GGUF" + os.urandom(4096))  # right magic, garbage after it
    return {
        "models": [
            {**local_model("broken", gguf=str(bad), restart_backoff_s=0.1), **model},
            {
                "alias": "remote",
                "engine": {"kind": "openai", "base_url": scripted.url + "/v1"},
                "region": "eu",
            },
        ],
        "engines": {"max_crash_restarts": 2},
        "embeddings": {"enabled": False},
    }


def _wait_failed(gw: Gateway, alias: str, timeout_s: float = 120) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        info = httpx.get(gw.url + "/readyz", headers=gw.admin).json()["models"][alias]
        if info["state"] == "failed":
            return dict(info)
        time.sleep(0.1)
    raise AssertionError(f"{alias} not failed after {timeout_s}s:\n{gw.proc.output()[-3000:]}")


def test_a_model_that_cannot_load_fails_with_its_reason_while_others_serve(
    tmp_path: Path, scripted: Scripted
) -> None:
    gw = start_gateway(_broken_model_config(tmp_path, scripted), wait_ready=False)
    try:
        info = _wait_failed(gw, "broken")
        assert info["failed_starts"] == 2 and info["restarts"] == 1
        assert "exited with code 1 while loading the model" in info["reason"]
        assert "2 failed starts in a row" in info["reason"]
        assert any("failed to load model" in line.lower() for line in info["stderr_tail"])
        ready = httpx.get(gw.url + "/readyz")
        assert ready.status_code == 503  # a required model failed
        assert ready.json()["models"]["remote"]["ready"] is True
        ok = gw.post(
            "/v1/chat/completions",
            json={"model": "remote", "messages": [{"role": "user", "content": "Hi"}]},
        )
        assert ok.status_code == 200, ok.text
        r = gw.post(
            "/v1/chat/completions",
            json={"model": "broken", "messages": [{"role": "user", "content": "Hi"}]},
        )
        assert r.status_code == 503
        err = r.json()["error"]
        assert err["code"] == "engine_failed"
        assert "failed to start" in err["message"] and "exited with code 1" in err["message"]
        assert "retry-after" not in r.headers  # it will not come back by itself
        # The log says which model, and why, in plain words.
        out = gw.proc.output()
        assert "engine broken FAILED and will not be restarted" in out
        time.sleep(0.5)  # and it is not restarted again
        assert httpx.get(gw.url + "/readyz").json()["models"]["broken"]["restarts"] == 1
    finally:
        gw.proc.stop()


def test_a_model_marked_not_required_does_not_hold_readiness(
    tmp_path: Path, scripted: Scripted
) -> None:
    config = _broken_model_config(tmp_path, scripted, required=False)
    gw = start_gateway(config, wait_ready=False)
    try:
        _wait_failed(gw, "broken")
        ready = httpx.get(gw.url + "/readyz")
        assert ready.status_code == 200, ready.text
        assert ready.json()["models"]["broken"]["required"] is False
    finally:
        gw.proc.stop()


def test_make_serve_prints_the_first_run_key_when_the_local_model_fails(
    tmp_path: Path, scripted: Scripted
) -> None:
    """What a new user sees on a machine where the local engine cannot start: which
    model failed, why and what to try, and still the key to call everything else."""
    port = free_port()
    config = {**_broken_model_config(tmp_path, scripted), "server": {"port": port}}
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    repo = REPO
    proc = Proc(
        ["make", "-s", "-C", str(repo), "serve", f"CONFIG={path}"],
        "make-serve",
        env={"SWITCHYARD_SQLITE_PATH": str(tmp_path / "first-run.db")},
    )
    try:
        deadline = time.monotonic() + 180
        while "Readiness:" not in proc.output():
            assert proc.popen.poll() is None, proc.output()[-3000:]
            assert time.monotonic() < deadline, proc.output()[-3000:]
            time.sleep(0.2)
        out = proc.output()
        assert "Model 'broken' FAILED to start" in out
        assert "exited with code 1 while loading the model" in out
        assert "What to try:" in out
        match = re.search(r"sk-sy-[A-Za-z0-9_-]+", out)
        assert match, out
        r = httpx.post(
            f"http://127.0.0.1:{port}/v1/chat/completions",
            json={"model": "remote", "messages": [{"role": "user", "content": "Hi"}]},
            headers={"Authorization": f"Bearer {match.group(0)}"},
            timeout=30,
        )
        assert r.status_code == 200, r.text
    finally:
        proc.stop()
