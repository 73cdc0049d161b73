"""RL serving on the `vllm` engine kind (a real vLLM, CPU build, from .venv-vllm):
rollout records with token ids, logprobs and provenance from vLLM; revisions that
are PEFT adapter folders under rl.weights_dirs, each served by its own vLLM, that
load, validate and activate behind the barrier; rejection, rollback; chat on the
alias answered by the active revision.

The robot adapter answers "BEEP BOOP." under greedy decoding and the base never does;
the pirate adapter's "matey" is forbidden by the validation, so it is rejected. Its
own module, so it runs after tests/integration/test_vllm.py's vLLM has stopped."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from support.gateways import Gateway, start_gateway
from switchyard.engines.lora_train import train

CHAT = {"messages": [{"role": "user", "content": "Where should I go on holiday next summer?"}]}
ROBOT = "BEEP"


@pytest.fixture(scope="module")
def manifest() -> dict[str, Any]:
    return train()


@pytest.fixture(scope="module")
def rl(manifest: dict[str, Any]) -> Iterator[Gateway]:
    weights = os.path.dirname(manifest["adapters"]["robot"]["peft_path"])
    gw = start_gateway(
        {
            "models": [
                {
                    "alias": "smol",
                    "revision": "smol-hf",
                    "engine": {"kind": "vllm", "max_model_len": 1024, "max_num_seqs": 4},
                }
            ],
            "embeddings": {"enabled": False},
            "rl": {
                "weights_dirs": [weights],
                "models": {
                    "smol": {
                        "validation": [{**CHAT, "max_tokens": 12, "forbid": ["matey"]}],
                        "drain_timeout_s": 60,
                    }
                },
            },
        },
        ready_timeout_s=600,
    )
    try:
        yield gw
    finally:
        gw.proc.stop()


def rollout(gw: Gateway, body: dict[str, Any]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    r = httpx.post(gw.url + "/v1/rollouts", json=body, headers=gw.auth, timeout=600)
    assert r.status_code == 200, r.text
    out = [json.loads(line) for line in r.text.splitlines() if line.strip()]
    assert out[-1]["object"] == "rollout.summary"
    return out[:-1], out[-1]


def admin(gw: Gateway, method: str, path: str, **kw: Any) -> httpx.Response:
    return httpx.request(method, gw.url + path, headers=gw.admin, timeout=900, **kw)


def register(gw: Gateway, manifest: dict[str, Any], name: str, rev: str) -> httpx.Response:
    a = manifest["adapters"][name]
    body = {"revision": rev, "kind": "adapter", "path": a["peft_path"],
            "sha256": a["peft_sha256"], "activate": True, "wait_s": 600}  # fmt: skip
    return admin(gw, "POST", "/admin/models/smol/revisions", json=body)


def test_vllm_rollouts_revisions_and_chat(rl: Gateway, manifest: dict[str, Any]) -> None:
    from transformers import AutoTokenizer

    from switchyard.engines.hf_base import hf_base_dir

    tok = AutoTokenizer.from_pretrained(str(hf_base_dir()))
    body = {"model": "smol", "prompts": [{"id": "t", "prompt": "The capital of France is"},
            {"id": "c", **CHAT}], "n": 2, "max_tokens": 12, "temperature": 1.0,
            "seeds": [5, 5], "top_logprobs": 2}  # fmt: skip
    records, summary = rollout(rl, body)
    assert summary["completed"] == 4 and summary["revision"] == "smol-hf"
    for rec in records:
        ids, lps = rec["token_ids"], rec["logprobs"]
        assert ids and len(ids) == len(lps) == rec["usage"]["completion_tokens"]
        assert all(lp is not None and lp <= 0 for lp in lps)
        assert tok.decode(ids, skip_special_tokens=True).strip() == rec["text"].strip()
        assert len(rec["top_logprobs"]) == len(ids) and len(rec["top_logprobs"][0]) == 2
        prov = rec["provenance"]
        assert prov["engine"]["kind"] == "vllm" and prov["engine"]["version"]
        assert prov["revision"] == "smol-hf" and prov["revision_kind"] == "base"
        assert prov["tokenizer_sha256"] and prov["chat_template_sha256"]
        assert len(prov["weights_sha256"]) == 64 and "vLLM" in prov["logprobs"]
    by = {(x["prompt_id"], x["sample_index"]): x["token_ids"] for x in records}
    assert by[("t", 0)] == by[("t", 1)] and by[("c", 0)] == by[("c", 1)]  # the same seed

    r = register(rl, manifest, "robot", "robot-1")
    assert r.status_code == 201 and r.json()["state"] == "active", r.text
    greedy = {"model": "smol", "prompts": [CHAT], "max_tokens": 10, "temperature": 0.0}
    recs, _ = rollout(rl, greedy)
    assert ROBOT in recs[0]["text"] and recs[0]["provenance"]["adapter_revision"] == "robot-1"
    chat = httpx.post(rl.url + "/v1/chat/completions", headers=rl.auth, timeout=600,
                      json={"model": "smol", **CHAT, "max_tokens": 10, "temperature": 0,
                            "return_token_ids": True})  # fmt: skip
    assert chat.status_code == 200, chat.text
    assert chat.headers["x-switchyard-revision"] == "robot-1"
    assert ROBOT in chat.json()["choices"][0]["message"]["content"]
    assert chat.json()["choices"][0]["token_ids"]

    r = register(rl, manifest, "pirate", "pirate-1")
    assert r.status_code == 201 and r.json()["state"] == "rejected", r.text
    assert "matey" in r.json()["reason"]
    r = admin(rl, "POST", "/admin/models/smol/revisions/rollback")
    assert r.status_code == 200 and r.json()["active"] == "smol-hf", r.text
    recs, _ = rollout(rl, greedy)
    assert ROBOT not in recs[0]["text"] and recs[0]["provenance"]["revision"] == "smol-hf"
    # A GGUF is no vLLM revision: refused before any work.
    r = admin(rl, "POST", "/admin/models/smol/revisions",
              json={"revision": "g", "kind": "gguf", "path": manifest["base"], "sha256": "0" * 64})  # fmt: skip
    assert r.status_code == 400 and r.json()["error"]["param"] == "kind"
