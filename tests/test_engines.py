"""Engine lifecycle over real processes: a second upstream, readiness, restart, cancel."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator

import httpx
import pytest

from conftest import Gateway, local_model, start_gateway

# SmolLM2's end tokens (<|endoftext|>, <|im_end|>): banning them forces long generations.
NO_EOS = {"0": -100, "2": -100}


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
    assert raw.headers["x-switchyard-upstream"] == f"http://127.0.0.1:{second_worker}/v1"
    assert raw.headers["x-switchyard-revision"] == "remote-rev-7"
    assert raw.parse().choices[0].message.content is not None
    local = client.chat.completions.with_raw_response.create(
        model="local-smol", messages=[{"role": "user", "content": "Hi"}], max_tokens=4
    )
    assert str(second_worker) not in local.headers["x-switchyard-upstream"]
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
    body = {
        "model": "local-smol",
        "messages": [{"role": "user", "content": "Count upwards from one, forever."}],
        "max_tokens": 1800,
        "logit_bias": NO_EOS,
        "stream": True,
    }
    # Uncancelled, this generation would take far longer than the bound below.
    with two_upstreams.stream(body) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        got = [next(lines) for _ in range(6)]
        assert any(line.startswith("data: ") for line in got)
    started = time.monotonic()
    r2 = two_upstreams.post(
        "/v1/chat/completions",
        json={
            "model": "local-smol",
            "messages": [{"role": "user", "content": "Hi"}],
            "max_tokens": 2,
        },
        timeout=60,
    )
    assert r2.status_code == 200
    waited = time.monotonic() - started
    assert waited < 8, f"the engine kept generating for the departed client ({waited:.1f}s)"


def test_long_generation_is_really_long(two_upstreams: Gateway) -> None:
    """Guards the cancellation test: banning EOS does force a long generation."""
    r = two_upstreams.post(
        "/v1/chat/completions",
        json={
            "model": "local-smol",
            "messages": [{"role": "user", "content": "Hi"}],
            "max_tokens": 40,
            "logit_bias": NO_EOS,
        },
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
            json={
                "model": "smol",
                "messages": [{"role": "user", "content": "Hi"}],
                "max_tokens": 1,
            },
            timeout=30,
        )
        if early.status_code != 200:  # loading: 503 with Retry-After, not a hang or a 500
            assert early.status_code == 503
            assert early.json()["error"]["code"] == "engine_not_ready"
            assert early.headers["retry-after"]
        _wait_ready(gw)
        info = httpx.get(gw.url + "/readyz").json()["models"]["smol"]
        pid = info["pid"]
        assert info["live"] and pid
        os.kill(pid, signal.SIGKILL)
        # The dead engine is reported and requests fail cleanly (502/503), never hang.
        r = gw.post(
            "/v1/chat/completions",
            json={
                "model": "smol",
                "messages": [{"role": "user", "content": "Hi"}],
                "max_tokens": 1,
            },
            timeout=30,
        )
        assert r.status_code in (502, 503), r.text
        assert r.json()["error"]["code"] in (
            "engine_not_ready",
            "upstream_unreachable",
            "upstream_error",
        )
        _wait_ready(gw)
        after = httpx.get(gw.url + "/readyz").json()["models"]["smol"]
        assert after["restarts"] >= 1 and after["pid"] != pid
        ok = gw.post(
            "/v1/chat/completions",
            json={
                "model": "smol",
                "messages": [{"role": "user", "content": "Hi"}],
                "max_tokens": 1,
            },
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
