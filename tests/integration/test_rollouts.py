"""RL serving (capability 12) on a real gateway and real llama-servers: rollout records
with token ids, logprobs and provenance; revisions registered from rl.weights_dirs that
load, validate and activate behind a barrier; rollback; restart; export; refusals.

The two distinguishable revisions are the base model and the project's robot adapter
(switchyard.engines.lora_train, trained on CPU and cached): under greedy decoding the
robot answers "BEEP BOOP." and the base never does. The pirate adapter answers "Arrr
matey!", which the model's validation forbids, so it must be rejected."""

from __future__ import annotations

import concurrent.futures
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from support.gateways import Gateway, local_model, start_gateway
from switchyard.engines.lora_train import train

PROMPT = "Where should I go on holiday next summer?"
CHAT = {"messages": [{"role": "user", "content": PROMPT}]}
ROBOT, PIRATE = "BEEP", "matey"


@pytest.fixture(scope="module")
def manifest() -> dict[str, Any]:
    return train()


def _config(weights_dir: str) -> dict[str, Any]:
    # One thread per engine: during an activation the old and the new revision's
    # engines run together, and two llama.cpp thread pools spinning on these 2 cores
    # slow each other by 10-100x (a 10-token answer took over 25 s).
    return {
        "models": [local_model("smol", parallel=4, ctx=1024, threads=1)],
        "embeddings": {"enabled": False},
        "rl": {
            "weights_dirs": [weights_dir],
            "max_n": 8,
            "models": {
                "smol": {
                    "validation": [{**CHAT, "max_tokens": 12, "forbid": [PIRATE]}],
                    "drain_timeout_s": 60,
                }
            },
        },
    }


@pytest.fixture(scope="module")
def rl(manifest: dict[str, Any]) -> Iterator[Gateway]:
    weights = os.path.dirname(manifest["adapters"]["robot"]["path"])
    gw = start_gateway(_config(weights))
    try:
        yield gw
    finally:
        gw.proc.stop()


def rollout(gw: Gateway, body: dict[str, Any], key: str | None = None) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key or gw.key}"}
    return httpx.post(gw.url + "/v1/rollouts", json=body, headers=headers, timeout=120)


def lines(r: httpx.Response) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """(sample records, summary) of an NDJSON rollout reply."""
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("application/x-ndjson")
    out = [json.loads(line) for line in r.text.splitlines() if line.strip()]
    assert out and out[-1]["object"] == "rollout.summary", out[-1:]
    return out[:-1], out[-1]


def admin(gw: Gateway, method: str, path: str, **kw: Any) -> httpx.Response:
    return httpx.request(method, gw.url + path, headers=gw.admin, timeout=120, **kw)


def register(gw: Gateway, manifest: dict[str, Any], name: str, rev: str, **kw: Any) -> Any:
    a = manifest["adapters"][name]
    body = {"revision": rev, "kind": "adapter", "path": a["path"], "sha256": a["sha256"], **kw}
    return admin(gw, "POST", "/admin/models/smol/revisions", json=body)


def state(gw: Gateway, rev: str) -> dict[str, Any]:
    r = admin(gw, "GET", f"/admin/models/smol/revisions/{rev}")
    assert r.status_code == 200, r.text
    return dict(r.json())


def test_records_are_complete_and_their_token_ids_decode_to_the_text(rl: Gateway) -> None:
    from transformers import AutoTokenizer

    from switchyard.engines.hf_base import hf_base_dir

    body = {
        "model": "smol",
        "prompts": [
            {"id": "text-1", "prompt": "The capital of France is"},
            {"id": "chat-1", **CHAT},
        ],
        "n": 2,
        "max_tokens": 16,
        "temperature": 0.8,
        "seed": 7,
        "top_logprobs": 2,
        "dataset_revision": "ds-2026.12",
    }
    r = rollout(rl, body)
    records, summary = lines(r)
    assert r.headers["x-switchyard-revision"] == "smol-rev"
    assert len(records) == 4 and summary["samples"] == 4 and summary["completed"] == 4
    assert sorted((x["prompt_id"], x["sample_index"]) for x in records) == [
        ("chat-1", 0),
        ("chat-1", 1),
        ("text-1", 0),
        ("text-1", 1),
    ]
    tok = AutoTokenizer.from_pretrained(str(hf_base_dir()))
    for rec in records:
        assert rec["object"] == "rollout.sample" and rec["error"] is None
        assert rec["finish_reason"] in ("stop", "length")
        ids, lps = rec["token_ids"], rec["logprobs"]
        assert ids and len(ids) == len(lps) == rec["usage"]["completion_tokens"]
        assert all(isinstance(i, int) for i in ids)
        # A logprob for every token, <= 0, except where llama-server reports none (a
        # token ending inside a UTF-8 character): those are None and listed.
        assert [i for i, lp in enumerate(lps) if lp is None] == rec["logprobs_missing"]
        assert len(rec["logprobs_missing"]) <= len(ids) // 4
        assert all(lp <= 0 for lp in lps if lp is not None), lps
        # The end-of-turn token the sample stopped on is in the ids (a trainer needs
        # it) but not in the text.
        if rec["finish_reason"] == "stop" and ids[-1] in tok.all_special_ids:
            assert tok.decode(ids[:-1]) == rec["text"]
        else:
            assert tok.decode(ids) == rec["text"]
        assert len(rec["top_logprobs"]) == len(ids)
        assert all(len(t) == 2 for t in rec["top_logprobs"])
        assert rec["usage"]["prompt_tokens"] == len(rec["prompt_token_ids"])
        p = rec["provenance"]
        assert p["model"] == "smol" and p["revision"] == "smol-rev" and p["revision_kind"] == "base"
        assert len(p["weights_sha256"]) == 64 and len(p["tokenizer_sha256"]) == 64
        assert len(p["chat_template_sha256"]) == 64
        assert p["engine"]["kind"] == "llamacpp" and p["engine"]["version"]
        assert p["engine"]["slots"] == 4
        assert p["hardware"]["cores"] >= 1 and p["hardware"]["cpu"] != "unknown"
        assert p["sampling"]["temperature"] == 0.8 and p["sampling"]["max_tokens"] == 16
        assert p["sampling"]["seed"] == 7 + rec["sample_index"]
        assert p["dataset_revision"] == "ds-2026.12"
        assert p["batch"] is None or 0 <= p["batch"]["slots_busy"] <= p["batch"]["slots_total"] == 4
        assert rec["started_at"] <= rec["finished_at"]
    text = next(x for x in records if x["prompt_id"] == "text-1")
    assert tok.decode(text["prompt_token_ids"]) == "The capital of France is"
    chat = next(x for x in records if x["prompt_id"] == "chat-1")
    assert PROMPT in tok.decode(chat["prompt_token_ids"])  # rendered by the chat template
    assert "<|im_start|>" in tok.decode(chat["prompt_token_ids"])

    # The usage row and trace name the revision and count every sample's tokens.
    rid = r.headers["x-request-id"]
    row = next(u for u in rl.usage(limit=50) if u["request_id"] == rid)
    assert row["endpoint"] == "rollouts" and row["revision"] == "smol-rev"
    assert row["output_tokens"] == summary["usage"]["completion_tokens"] > 0
    stages = {s["stage"]: s for s in rl.trace(rid)["decisions"]}
    assert stages["revision"]["outcome"] == "lease:smol-rev"


def test_the_same_seed_repeats_and_different_seeds_differ(rl: Gateway) -> None:
    """With `deterministic` (no prompt cache) the same seed repeats exactly, batched
    as usual and while other rollouts run beside them. With the prompt cache it does
    not: a sample whose prompt prefix is reused from the cache evaluates the rest in
    another split, and the changed numbers move a draw at temperature 1 (checked by
    turning the cache on here: this test then fails every time)."""
    body = {
        "model": "smol",
        "prompts": [CHAT],
        "n": 4,
        "max_tokens": 24,
        "temperature": 1.0,
        "seeds": [11, 11, 12, 13],
        "deterministic": True,
    }
    noise = {**body, "deterministic": False, "n": 4, "seeds": [1, 2, 3, 4]}
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        runs = [pool.submit(rollout, rl, b) for b in (noise, body, noise)]
        first, _ = lines(runs[1].result())
        for f in runs:
            lines(f.result())
    again, _ = lines(rollout(rl, body))
    # A sample the engine failed has no token ids: say so, rather than as unequal ids.
    assert [x["error"] for x in first + again if x["error"]] == []
    by = {x["sample_index"]: x["token_ids"] for x in first}
    by_again = {x["sample_index"]: x["token_ids"] for x in again}
    assert by[0] == by[1]  # the same seed in one request
    assert by == by_again  # and in another
    assert len({tuple(by[i]) for i in (1, 2, 3)}) >= 2  # three seeds, not one sample
    assert all(x["provenance"]["sampling"]["deterministic"] for x in first)


def test_chat_and_completions_return_every_token_id_in_vllms_shape(rl: Gateway) -> None:
    from transformers import AutoTokenizer

    from switchyard.engines.hf_base import hf_base_dir

    tok = AutoTokenizer.from_pretrained(str(hf_base_dir()))

    def post(path: str, body: dict[str, Any]) -> httpx.Response:
        headers = {"Authorization": f"Bearer {rl.key}"}
        return httpx.post(rl.url + path, json=body, headers=headers, timeout=120)

    # Emoji: llama-server's logprobs lose the tokens that end inside a character, so
    # ids read from logprobs would be short; every id must be there.
    for content in (PROMPT, "Write three emoji: \U0001f600\U0001f389\U0001f680"):
        body = {"model": "smol", "messages": [{"role": "user", "content": content}]}
        r = post(
            "/v1/chat/completions",
            {**body, "max_tokens": 24, "temperature": 0, "return_token_ids": True},
        )
        assert r.status_code == 200, r.text
        out = r.json()
        assert "__verbose" not in out
        choice, usage = out["choices"][0], out["usage"]
        ids = choice["token_ids"]
        assert len(ids) == usage["completion_tokens"] and all(isinstance(i, int) for i in ids)
        text = choice["message"]["content"]
        assert tok.decode(ids, skip_special_tokens=True).strip() == text.strip()
        prompt_ids = out["prompt_token_ids"]
        assert len(prompt_ids) == usage["prompt_tokens"]
        templated = tok.decode(prompt_ids)
        assert content in templated and "<|im_start|>assistant" in templated
        plain = post("/v1/chat/completions", {**body, "max_tokens": 24, "temperature": 0})
        assert plain.status_code == 200
        assert "token_ids" not in plain.json()["choices"][0]
        assert "prompt_token_ids" not in plain.json()
        assert plain.json()["choices"][0]["message"]["content"] == text  # same answer
    r = post(
        "/v1/completions",
        {
            "model": "smol",
            "prompt": "The capital of France is",
            "max_tokens": 8,
            "temperature": 0,
            "return_token_ids": True,
        },
    )
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert tok.decode(choice["token_ids"]) == choice["text"]
    assert tok.decode(choice["prompt_token_ids"]) == "The capital of France is"
    # What llama-server cannot give is refused, naming the option; its own switches
    # (which add its native result to the reply) are the gateway's.
    for extra in ({"stream": True}, {"n": 2}, {"verbose": True}, {"return_tokens": True}):
        r = post(
            "/v1/chat/completions",
            {**CHAT, "model": "smol", "max_tokens": 4, "return_token_ids": True, **extra},
        )
        assert r.status_code == 400, (extra, r.text)
        assert r.json()["error"]["param"] == "return_token_ids", r.text
    r = post("/v1/chat/completions", {**CHAT, "model": "smol", "return_token_ids": "yes"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "return_token_ids"


def test_refusals_are_openai_shaped_and_come_before_any_work(
    rl: Gateway, manifest: dict[str, Any], tmp_path: Path
) -> None:
    def err(r: httpx.Response, status: int) -> dict[str, Any]:
        assert r.status_code == status, r.text
        assert "Traceback" not in r.text
        return dict(r.json()["error"])

    ok = {"model": "smol", "prompts": ["hi"], "max_tokens": 4}
    assert err(rollout(rl, {**ok, "logit_bias": {}}), 400)["param"] == "logit_bias"
    assert err(rollout(rl, {**ok, "n": 9}), 400)["param"] == "n"  # rl.max_n 8
    assert err(rollout(rl, {**ok, "prompts": []}), 400)["param"] == "prompts"
    assert err(rollout(rl, {**ok, "prompts": [{"id": "a b", "prompt": "x"}]}), 400)
    assert err(rollout(rl, {**ok, "seeds": [1, 2]}), 400)["param"] == "seeds"
    assert err(rollout(rl, {**ok, "max_tokens": 10**6}), 400)["param"] == "max_tokens"
    bad_chat = {"messages": [{"role": "wizard", "content": "x"}]}
    assert err(rollout(rl, {**ok, "prompts": [bad_chat]}), 400)
    assert err(rollout(rl, {**ok, "model": "nope"}), 404)["code"] == "model_not_found"
    assert err(rollout(rl, ok, key="sk-not-a-key"), 401)

    tenant = "t-rpm-" + os.urandom(3).hex()
    rl.create_tenant(tenant, rpm=1)
    key = rl.create_key(tenant)["key"]
    lines(rollout(rl, ok, key=key))
    assert err(rollout(rl, ok, key=key), 429)["code"] == "rate_limit_rpm"

    a = manifest["adapters"]["robot"]
    outside = tmp_path / "robot.gguf"
    outside.write_bytes(Path(a["path"]).read_bytes())
    reg = {"revision": "x-1", "kind": "adapter", "sha256": a["sha256"]}
    r = admin(rl, "POST", "/admin/models/smol/revisions", json={**reg, "path": str(outside)})
    assert err(r, 403)["code"] == "path_not_allowed"
    sneaky = os.path.dirname(a["path"]) + "/../../../" + str(outside)
    r = admin(rl, "POST", "/admin/models/smol/revisions", json={**reg, "path": sneaky})
    assert err(r, 403)["code"] == "path_not_allowed"
    r = admin(
        rl,
        "POST",
        "/admin/models/smol/revisions",
        json={**reg, "path": a["path"], "sha256": "0" * 64},
    )
    assert err(r, 400)["code"] == "checksum_mismatch"
    r = admin(
        rl, "POST", "/admin/models/smol/revisions", json={**reg, "path": a["path"], "extra": 1}
    )
    assert err(r, 400)
    r = admin(
        rl,
        "POST",
        "/admin/models/smol/revisions",
        json={**reg, "revision": "smol-rev", "path": a["path"]},
    )
    assert err(r, 409)["code"] == "revision_conflict"
    r = httpx.post(
        rl.url + "/admin/models/smol/revisions", json={**reg, "path": a["path"]}, headers=rl.auth
    )
    assert r.status_code in (401, 403)
    assert err(admin(rl, "GET", "/admin/models/nope/revisions"), 404)
    # None of these registered anything.
    revs = admin(rl, "GET", "/admin/models/smol/revisions").json()["revisions"]
    assert [x["revision"] for x in revs] == ["smol-rev"]


def test_a_client_that_leaves_lets_go_of_its_revision_at_once(rl: Gateway) -> None:
    """Samples one at a time (deterministic) would hold the revision for many seconds;
    the client leaves after the headers: the lease is released and the request settled
    as cancelled, long before it would have finished (or drain_timeout_s, 60 s)."""
    active = admin(rl, "GET", "/admin/models/smol/revisions").json()["active"]
    body = {"model": "smol", "prompts": [CHAT], "n": 8, "max_tokens": 64, "deterministic": True}
    with httpx.stream(
        "POST", rl.url + "/v1/rollouts", json=body, headers=rl.auth, timeout=120
    ) as r:
        assert r.status_code == 200
        rid = r.headers["x-request-id"]
        assert state(rl, active)["in_flight"] == 1
    deadline = time.monotonic() + 20  # hang guard
    while state(rl, active)["in_flight"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert state(rl, active)["in_flight"] == 0
    trace = rl.trace(rid)
    assert trace["status"] == "cancelled", trace["status"]


def test_a_gateway_without_rl_models_has_no_rollouts(default_gateway: Gateway) -> None:
    r = rollout(default_gateway, {"model": "smollm2-135m", "prompts": ["hi"]})
    assert r.status_code == 404 and "rl.models" in r.json()["error"]["message"]


def test_activation_is_a_barrier_under_load_and_rejection_and_rollback_hold(
    rl: Gateway, manifest: dict[str, Any]
) -> None:
    """Rollouts run continuously while the robot adapter is registered and activated.
    Every rollout's samples share one revision (the one its header named at
    admission), every record's output matches its revision, those admitted after the
    activation answered use the robot, and the base drains and retires."""
    body = {"model": "smol", "prompts": [CHAT], "n": 2, "max_tokens": 10, "temperature": 0.0}
    results: list[tuple[float, float, str, list[dict[str, Any]]]] = []
    stop = threading.Event()

    def client() -> None:
        while not stop.is_set():
            sent = time.time()
            with httpx.stream(
                "POST", rl.url + "/v1/rollouts", json=body, headers=rl.auth, timeout=120
            ) as r:
                admitted = time.time()
                assert r.status_code == 200
                header = r.headers["x-switchyard-revision"]
                recs = [json.loads(x) for x in r.iter_lines() if x.strip()]
            results.append((sent, admitted, header, recs[:-1]))

    # Chat on the same alias (plain and streamed) runs beside them: it is served by
    # the active revision too, under the same barrier.
    chats: list[tuple[float, str, str, str]] = []
    chat = {"model": "smol", **CHAT, "max_tokens": 10, "temperature": 0.0}

    def chatter(streamed: bool) -> None:
        while not stop.is_set():
            sent = time.time()
            if streamed:
                with httpx.stream(
                    "POST",
                    rl.url + "/v1/chat/completions",
                    json={**chat, "stream": True},
                    headers=rl.auth,
                    timeout=120,
                ) as r:
                    assert r.status_code == 200
                    header, rid = r.headers["x-switchyard-revision"], r.headers["x-request-id"]
                    text = "".join(
                        (json.loads(x[6:])["choices"] or [{}])[0].get("delta", {}).get("content")
                        or ""
                        for x in r.iter_lines()
                        if x.startswith("data: {")
                    )
            else:
                r = httpx.post(
                    rl.url + "/v1/chat/completions", json=chat, headers=rl.auth, timeout=120
                )
                assert r.status_code == 200, r.text
                header, rid = r.headers["x-switchyard-revision"], r.headers["x-request-id"]
                text = r.json()["choices"][0]["message"]["content"]
            chats.append((sent, header, rid, text))

    with concurrent.futures.ThreadPoolExecutor(5) as pool:
        futures = [pool.submit(client) for _ in range(3)]
        futures += [pool.submit(chatter, streamed) for streamed in (False, True)]
        time.sleep(1.5)
        r = register(rl, manifest, "robot", "robot-1", activate=True, wait_s=120)
        activated = time.time()
        assert r.status_code == 201, r.text
        assert r.json()["state"] == "active", r.json()
        deadline = time.monotonic() + 60  # until each kind finished one sent after it
        while time.monotonic() < deadline and not (
            any(sent > activated for sent, *_ in results)
            and sum(sent > activated for sent, *_ in chats) >= 2
        ):
            time.sleep(0.1)
        stop.set()
        for f in futures:
            f.result()

    assert {h for _, _, h, _ in results} == {"smol-rev", "robot-1"}
    for sent, _admitted, header, recs in results:
        assert len(recs) == 2
        assert {x["provenance"]["revision"] for x in recs} == {header}  # nothing straddles
        for x in recs:
            assert (ROBOT in x["text"]) == (header == "robot-1"), (header, x["text"])
            assert x["provenance"]["adapter_revision"] == (
                "robot-1" if header == "robot-1" else None
            )
        if sent > activated:
            assert header == "robot-1"
    assert {h for _, h, _, _ in chats} == {"smol-rev", "robot-1"}
    for sent, header, _rid, text in chats:
        assert (ROBOT in text) == (header == "robot-1"), (header, text)
        if sent > activated:
            assert header == "robot-1"
    for header in ("smol-rev", "robot-1"):  # the usage row and trace name it
        rid = next(rid for _, h, rid, _ in chats if h == header)
        trace = rl.trace(rid)
        assert trace["revision"] == header
        assert any(
            d["stage"] == "residency" and d["outcome"] == f"revision:{header}"
            for d in trace["decisions"]
        ), trace["decisions"]
    robot = state(rl, "robot-1")
    assert [h["state"] for h in robot["history"]] == ["prepared", "loaded", "validated", "active"]
    assert robot["validation"] and robot["validation"][0]["mean_logprob"] <= 0
    deadline = time.monotonic() + 60
    while state(rl, "smol-rev")["state"] != "retired" and time.monotonic() < deadline:
        time.sleep(0.2)
    base = state(rl, "smol-rev")
    assert base["state"] == "retired" and base["in_flight"] == 0
    assert [h["state"] for h in base["history"]][-2:] == ["draining", "retired"]

    # The pirate adapter loads but fails validation: rejected with the reason, never active.
    r = register(rl, manifest, "pirate", "pirate-1", activate=True, wait_s=120)
    assert r.status_code == 201 and r.json()["state"] == "rejected", r.json()
    assert "matey" in r.json()["reason"]
    r = admin(rl, "POST", "/admin/models/smol/revisions/pirate-1/activate")
    assert r.status_code == 409 and r.json()["error"]["code"] == "revision_conflict"
    listing = admin(rl, "GET", "/admin/models/smol/revisions").json()
    assert listing["active"] == "robot-1"
    # A pinned chat gets exactly the revision it names, or a 404 saying which is active
    # (from a key that may pin: any other is refused a pin, tests/integration/test_pins_s72.py).
    pinner = rl.create_key(rl.create_tenant("t-pin")["id"], may_pin_revisions=True)["key"]
    for pin, status in (("robot-1", 200), ("smol-rev", 404), ("pirate-1", 404)):
        r = httpx.post(
            rl.url + "/v1/chat/completions",
            json={"model": f"smol@{pin}", **CHAT, "max_tokens": 4, "temperature": 0},
            headers={"Authorization": f"Bearer {pinner}"},
            timeout=120,
        )
        assert r.status_code == status, (pin, r.text)
        if status == 200:
            assert r.headers["x-switchyard-revision"] == pin
        else:
            assert r.json()["error"]["param"] == "model" and "robot-1" in r.text
    assert state(rl, "robot-1")["in_flight"] == 0  # the refused ones let go of their lease
    assert ROBOT in lines(rollout(rl, body))[0][0]["text"]

    # Rollback re-activates the base (loaded and validated again), the robot drains.
    r = admin(rl, "POST", "/admin/models/smol/revisions/rollback")
    assert r.status_code == 200, r.text
    assert r.json()["active"] == "smol-rev"
    recs, _ = lines(rollout(rl, body))
    assert {x["provenance"]["revision"] for x in recs} == {"smol-rev"}
    assert all(ROBOT not in x["text"] for x in recs)
    # And forward again to the robot, so the restart test finds it active.
    r = admin(rl, "POST", "/admin/models/smol/revisions/robot-1/activate")
    assert r.status_code == 200 and r.json()["active"] == "robot-1", r.text
    metrics = httpx.get(rl.url + "/metrics", headers=rl.admin).text
    assert 'switchyard_revision_events_total{model="smol",state="rejected"} 1.0' in metrics


def test_revisions_and_records_survive_a_restart_and_export(
    rl: Gateway, manifest: dict[str, Any]
) -> None:
    pii = {"id": "pii", "prompt": "Write to jane.doe@example.com about the invoice."}
    r = rollout(rl, {"model": "smol", "prompts": [pii], "max_tokens": 6, "temperature": 0.0})
    lines(r)
    rid = r.headers["x-request-id"]
    rl.trace(rid)  # settled
    rl.proc.stop()
    weights = os.path.dirname(manifest["adapters"]["robot"]["path"])
    gw = start_gateway(_config(weights), db=rl.db)
    try:
        listing = admin(gw, "GET", "/admin/models/smol/revisions").json()
        states = {x["revision"]: x["state"] for x in listing["revisions"]}
        assert listing["active"] == "robot-1"
        assert states == {"smol-rev": "retired", "robot-1": "active", "pirate-1": "rejected"}
        robot = state(gw, "robot-1")
        assert robot["history"][-1]["reason"] == "restored at start"
        recs, _ = lines(
            rollout(gw, {"model": "smol", "prompts": [CHAT], "max_tokens": 8, "temperature": 0.0})
        )
        assert ROBOT in recs[0]["text"] and recs[0]["provenance"]["revision"] == "robot-1"
    finally:
        gw.proc.stop()

    env = {**os.environ, "SWITCHYARD_SQLITE_PATH": rl.db}
    out = subprocess.run(
        [sys.executable, "-m", "switchyard", "rollouts", "export", "--since", "1h"],
        capture_output=True,
        text=True,
        env=env,
        check=True,
    )
    exported = [json.loads(line) for line in out.stdout.splitlines()]
    assert exported and all(x["object"] == "rollout.sample" for x in exported)
    assert {x["provenance"]["revision"] for x in exported} == {"smol-rev", "robot-1"}
    assert [x["finished_at"] for x in exported] == sorted(x["finished_at"] for x in exported)
    masked = [x for x in exported if x["request_id"] == rid]
    assert len(masked) == 1 and masked[0]["pii_masked"] is True
    assert masked[0]["token_ids"] is None and masked[0]["prompt_token_ids"] is None
    assert "jane.doe@example.com" not in out.stdout
    only = subprocess.run(
        [
            sys.executable,
            "-m",
            "switchyard",
            "rollouts",
            "export",
            "--since",
            "1h",
            "--revision",
            "robot-1",
        ],
        capture_output=True,
        text=True,
        env=env,
        check=True,
    )
    robot_rows = [json.loads(line) for line in only.stdout.splitlines()]
    assert robot_rows and {x["provenance"]["revision"] for x in robot_rows} == {"robot-1"}
    assert len(robot_rows) < len(exported)
