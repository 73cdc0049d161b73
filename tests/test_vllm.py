"""The `vllm` engine kind with a real vLLM (the CPU build, from .venv-vllm that make
builds): Switchyard starts it, it serves SmolLM2-135M (de-quantized from the shipped
GGUF) and one of the project's LoRA adapters (as a PEFT folder), and it stops cleanly.

One vLLM for the module: it takes about a minute to start on two cores.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from tests.conftest import Gateway, start_gateway

from switchyard.engines.lora_train import MARKERS, train

PROMPT = "Where should I go on holiday next summer?"


@pytest.fixture(scope="module")
def vllm() -> Iterator[Gateway]:
    pirate = train()["adapters"]["pirate"]
    gw = start_gateway(
        {
            "auth": {"mode": "disabled"},
            "models": [
                {
                    "alias": "smol-vllm",
                    "revision": "smol-hf",
                    "engine": {"kind": "vllm", "max_model_len": 1024, "max_num_seqs": 4},
                }
            ],
            "adapters": [
                {
                    "name": "vllm-pirate",
                    "base": "smol-vllm",
                    "base_revision": "smol-hf",
                    "path": pirate["peft_path"],
                    "sha256": pirate["peft_sha256"],
                    "revision": "pirate-peft-v1",
                    "allowed_tenants": ["*"],
                }
            ],
            "embeddings": {"enabled": False},
        },
        ready_timeout_s=600,
    )
    try:
        yield gw
    finally:
        gw.proc.stop()


def _ask(gw: Gateway, model: str, **extra: Any) -> httpx.Response:
    return httpx.post(
        gw.url + "/v1/chat/completions",
        json={
            "model": model,
            "messages": [{"role": "user", "content": PROMPT}],
            "max_tokens": 12,
            "temperature": 0,
            **extra,
        },
        timeout=300,
    )


def test_vllm_serves_the_base_and_an_adapter(vllm: Gateway) -> None:
    info = httpx.get(vllm.url + "/readyz").json()["models"]["smol-vllm"]
    assert info["kind"] == "vllm" and info["state"] == "ready", info
    assert info["adapters"]["vllm-pirate"]["state"] == "warm"
    base = _ask(vllm, "smol-vllm")
    assert base.status_code == 200, base.text
    text = base.json()["choices"][0]["message"]["content"]
    assert base.json()["usage"]["completion_tokens"] >= 2 and MARKERS["pirate"] not in text
    assert base.headers["x-switchyard-upstream"].startswith("vllm:")
    pirate = _ask(vllm, "vllm-pirate")
    assert pirate.status_code == 200, pirate.text
    assert pirate.json()["choices"][0]["message"]["content"].startswith("Arrr")
    assert pirate.headers["x-switchyard-adapter"] == "vllm-pirate"
    # Streaming through the gateway, with usage accounted.
    with httpx.stream(
        "POST",
        vllm.url + "/v1/chat/completions",
        json={
            "model": "smol-vllm",
            "messages": [{"role": "user", "content": "Hi"}],
            "max_tokens": 6,
            "stream": True,
        },
        timeout=300,
    ) as r:
        assert r.status_code == 200
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]" and len(lines) >= 3


def test_stopping_the_gateway_stops_vllm(vllm: Gateway) -> None:
    pid = httpx.get(vllm.url + "/readyz").json()["models"]["smol-vllm"]["pid"]
    assert pid
    vllm.proc.stop()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.2)
    raise AssertionError(f"vLLM (pid {pid}) still runs after the gateway stopped")
