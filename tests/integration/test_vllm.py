"""The `vllm` engine kind with a real vLLM (the CPU build, from .venv-vllm that make
builds): Switchyard starts it, it serves SmolLM2-135M (de-quantized from the shipped
GGUF) and the project's two LoRA adapters (as PEFT folders), one loaded at a time (the
other is loaded at run time in its place), and it stops cleanly.

One vLLM for the module: it takes about a minute to start on two cores.
"""

from __future__ import annotations

import concurrent.futures
import os
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from support.gateways import Gateway, start_gateway
from switchyard.engines.lora_train import MARKERS, train

PROMPT = "Where should I go on holiday next summer?"


@pytest.fixture(scope="module")
def vllm() -> Iterator[Gateway]:
    trained = train()["adapters"]
    gw = start_gateway(
        {
            "auth": {"mode": "disabled"},
            "models": [
                {
                    "alias": "smol-vllm",
                    "revision": "smol-hf",
                    "engine": {
                        "kind": "vllm",
                        "max_model_len": 1024,
                        "max_num_seqs": 4,
                        "max_adapters": 1,
                        "scheduling_policy": "priority",
                    },
                }
            ],
            "adapters": [
                {
                    "name": f"vllm-{style}",
                    "base": "smol-vllm",
                    "base_revision": "smol-hf",
                    "path": trained[style]["peft_path"],
                    "sha256": trained[style]["peft_sha256"],
                    "revision": f"{style}-peft-v1",
                    "allowed_tenants": ["*"],
                }
                for style in ("pirate", "robot")
            ],
            "engines": {"min_residency_s": 0},
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


def _stream(gw: Gateway, **extra: Any) -> list[str]:
    """A streamed chat's `data:` lines (the status checked)."""
    with httpx.stream(
        "POST",
        gw.url + "/v1/chat/completions",
        json={
            "model": "smol-vllm",
            "messages": [{"role": "user", "content": "Hi"}],
            "stream": True,
            **extra,
        },
        timeout=300,
    ) as r:
        assert r.status_code == 200
        return [line for line in r.iter_lines() if line.startswith("data: ")]


def test_vllm_serves_the_base_and_an_adapter(vllm: Gateway) -> None:
    info = httpx.get(vllm.url + "/readyz").json()["models"]["smol-vllm"]
    assert info["kind"] == "vllm" and info["state"] == "ready", info
    assert info["adapters"]["vllm-pirate"]["state"] == "warm"
    base = _ask(vllm, "smol-vllm")
    assert base.status_code == 200, base.text
    text = base.json()["choices"][0]["message"]["content"]
    assert base.json()["usage"]["completion_tokens"] >= 2 and MARKERS["pirate"] not in text
    assert base.headers["x-switchyard-upstream"] == "smol-vllm"  # its name, not its URL
    pirate = _ask(vllm, "vllm-pirate")
    assert pirate.status_code == 200, pirate.text
    assert pirate.json()["choices"][0]["message"]["content"].startswith("Arrr")
    assert pirate.headers["x-switchyard-adapter"] == "vllm-pirate"
    # Streaming through the gateway, with usage accounted.
    lines = _stream(vllm, max_tokens=6)
    assert lines[-1] == "data: [DONE]" and len(lines) >= 3


def test_vllm_returns_token_ids_through_the_gateway(vllm: Gateway) -> None:
    """`return_token_ids` is vLLM's own option: it passes through, and the reply has
    vLLM's shape (the same the gateway gives for llama.cpp)."""
    from transformers import AutoTokenizer

    from switchyard.engines.hf_base import hf_base_dir

    tok = AutoTokenizer.from_pretrained(str(hf_base_dir()))
    r = _ask(vllm, "smol-vllm", return_token_ids=True)
    assert r.status_code == 200, r.text
    out = r.json()
    choice, usage = out["choices"][0], out["usage"]
    assert len(choice["token_ids"]) == usage["completion_tokens"]
    assert len(out["prompt_token_ids"]) == usage["prompt_tokens"]
    text = choice["message"]["content"]
    assert tok.decode(choice["token_ids"], skip_special_tokens=True).strip() == text.strip()
    assert PROMPT in tok.decode(out["prompt_token_ids"])
    # Streaming keeps them too (vLLM puts them on the chunks): not refused here.
    assert any(
        line.startswith("data: {") for line in _stream(vllm, max_tokens=4, return_token_ids=True)
    )


def test_a_cold_adapter_is_loaded_at_run_time_and_each_request_gets_its_own(
    vllm: Gateway,
) -> None:
    """vLLM loads the second adapter at run time in place of the first; then mixed
    concurrent requests swap them back and forth, and none is served with the other
    (vLLM once served an in-flight request with another adapter after a runtime load)."""
    info = httpx.get(vllm.url + "/readyz").json()["models"]["smol-vllm"]
    assert info["adapters"]["vllm-robot"]["state"] == "cold", info["adapters"]
    robot = _ask(vllm, "vllm-robot")
    assert robot.status_code == 200, robot.text
    assert robot.json()["choices"][0]["message"]["content"].startswith("BEEP"), robot.text
    trace = vllm.trace(robot.headers["x-request-id"])
    d = next(d for d in trace["decisions"] if d["stage"] == "residency")
    assert d["outcome"] == "adapter-load" and d["evidence"]["adapter_load"] == "at run time", d
    assert d["evidence"]["adapter_evicted"][0]["adapter"] == "vllm-pirate"
    alone = _ask(vllm, "smol-vllm", max_tokens=6).json()["choices"][0]["message"]["content"]
    asked = ["vllm-pirate", "vllm-robot", "smol-vllm", "vllm-robot", "vllm-pirate"] * 2
    with concurrent.futures.ThreadPoolExecutor(5) as ex:
        replies = list(ex.map(lambda m: _ask(vllm, m, max_tokens=6), asked))
    for model, r in zip(asked, replies, strict=True):
        assert r.status_code == 200, r.text
        text = r.json()["choices"][0]["message"]["content"]
        assert r.headers.get("x-switchyard-adapter") == (None if model == "smol-vllm" else model)
        if model == "smol-vllm":
            # Decoded in one batch with adapter requests, vLLM's CPU LoRA ops gave the
            # base the last LoRA slot's adapter: the gateway keeps them apart.
            assert "Arrr" not in text and "BEEP" not in text, text
            assert text.split()[0] == alone.split()[0], (text, alone)
            trace = vllm.trace(r.headers["x-request-id"])
            d = next(d for d in trace["decisions"] if d["stage"] == "residency")
            assert "base_apart" in d["evidence"], d
        else:
            assert text.startswith("Arrr" if model == "vllm-pirate" else "BEEP"), (model, text)


def test_vllm_schedules_by_the_requests_class_and_reports_its_load(vllm: Gateway) -> None:
    """vLLM runs its priority policy: each class is accepted (vLLM refuses a `priority`
    field when the policy is off, and requires one when it is on), a client's own value is
    replaced by the gateway's; the gateway reads vLLM's own /metrics."""
    for cls in ("interactive", "standard", "batch"):
        r = httpx.post(
            vllm.url + "/v1/chat/completions",
            json={
                "model": "smol-vllm",
                "messages": [{"role": "user", "content": "Hi"}],
                "max_tokens": 4,
                "priority": -1000,
            },
            headers={"x-switchyard-priority": cls},
            timeout=300,
        )
        assert r.status_code == 200, r.text
    deadline = time.monotonic() + 10
    while True:
        load = httpx.get(vllm.url + "/admin/engines", headers=vllm.admin, timeout=10).json()[
            "load"
        ]["smol-vllm"]
        idle = load["running"] == 0 and load["waiting"] == 0  # its gauges lag its replies
        if (load["fresh"] and idle) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert load["kind"] == "vllm" and load["fresh"] and idle, load
    assert 0.0 <= load["kv_cache_usage"] <= 1.0


def test_stopping_the_gateway_stops_vllm(vllm: Gateway) -> None:
    ready = httpx.get(vllm.url + "/readyz", headers=vllm.admin)  # pid: the admin's part
    pid = ready.json()["models"]["smol-vllm"]["pid"]
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
