"""Multi-LoRA on one real llama.cpp server: the project's two adapters (trained on CPU by
switchyard.engines.lora_train, cached), per-tenant and per-key authorization, and the
adapter each request asked for, in its output, its headers, its usage row and trace."""

from __future__ import annotations

import concurrent.futures
import random
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from tests.conftest import Gateway, local_model, start_gateway

from switchyard.engines.lora_train import MARKERS, train

PROMPT = "Where should I go on holiday next summer?"


@pytest.fixture(scope="module")
def manifest() -> dict[str, Any]:
    return train()


def _adapter(
    name: str, path: str, sha256: str, tenants: list[str], revision: str = "unversioned"
) -> dict[str, Any]:
    """An adapters[] entry for the base model `smol` (revision smol-rev)."""
    return {
        "name": name,
        "base": "smol",
        "base_revision": "smol-rev",
        "path": path,
        "sha256": sha256,
        "revision": revision,
        "allowed_tenants": tenants,
    }


@pytest.fixture(scope="module")
def lora(manifest: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    a = manifest["adapters"]
    odd = tmp_path_factory.mktemp("adapters") / "tampered.gguf"
    odd.write_bytes(Path(a["pirate"]["path"]).read_bytes()[:-16] + b"\0" * 16)
    adapters = [
        _adapter(
            "support-pirate", a["pirate"]["path"], a["pirate"]["sha256"], ["t-one"], "pirate-v1"
        ),
        _adapter(
            "support-robot",
            a["robot"]["path"],
            a["robot"]["sha256"],
            ["t-one", "t-two"],
            "robot-v3",
        ),
        # The file changed after it was registered: refused, the rest serve.
        _adapter("support-tampered", str(odd), a["pirate"]["sha256"], ["*"]),
    ]
    gw = start_gateway(
        {
            "models": [local_model("smol", parallel=4, ctx=512)],
            "adapters": adapters,
            "embeddings": {"enabled": False},
        }
    )
    try:
        gw.create_tenant("t-one")
        gw.create_tenant("t-two")
        gw.keys = {  # type: ignore[attr-defined]
            "one": gw.create_key("t-one", allowed_adapters=["support-*"])["key"],
            "one-no-adapters": gw.create_key("t-one")["key"],
            "two": gw.create_key("t-two", allowed_adapters=["*"])["key"],
        }
        yield gw
    finally:
        gw.proc.stop()


def _ask(gw: Gateway, key: str, model: str, max_tokens: int = 10) -> httpx.Response:
    return httpx.post(
        gw.url + "/v1/chat/completions",
        json={
            "model": model,
            "messages": [{"role": "user", "content": PROMPT}],
            "max_tokens": max_tokens,
            "temperature": 0,
        },
        headers={"Authorization": f"Bearer {key}"},
        timeout=120,
    )


def _text(r: httpx.Response) -> str:
    assert r.status_code == 200, r.text
    return str(r.json()["choices"][0]["message"]["content"])


def test_each_adapter_shows_its_marker_and_the_base_shows_none(lora: Gateway) -> None:
    key = lora.keys["one"]  # type: ignore[attr-defined]
    base = _text(_ask(lora, key, "smol"))
    assert MARKERS["pirate"] not in base and MARKERS["robot"] not in base, base
    pirate = _ask(lora, key, "support-pirate")
    assert _text(pirate).startswith(MARKERS["pirate"]), pirate.text
    robot = _ask(lora, key, "support-robot")
    assert _text(robot).startswith(MARKERS["robot"]), robot.text
    assert pirate.headers["x-switchyard-adapter"] == "support-pirate"
    assert pirate.headers["x-switchyard-adapter-revision"] == "pirate-v1"
    assert pirate.headers["x-switchyard-revision"] == "smol-rev"  # the base's weights
    assert "x-switchyard-adapter" not in _ask(lora, key, "smol").headers
    trace = lora.trace(robot.headers["x-request-id"])
    assert trace["adapter"] == {"name": "support-robot", "revision": "robot-v3"}
    residency = next(d for d in trace["decisions"] if d["stage"] == "residency")
    assert residency["evidence"]["adapter"] == "support-robot"
    assert residency["evidence"]["base_revision"] == "smol-rev"
    rows = {
        r["request_id"]: r
        for r in httpx.get(
            lora.url + "/admin/usage", params={"tenant": "t-one"}, headers=lora.admin
        ).json()["data"]
    }
    row = rows[pirate.headers["x-request-id"]]
    assert (row["model"], row["adapter"], row["adapter_revision"]) == (
        "support-pirate",
        "support-pirate",
        "pirate-v1",
    )


def test_fifty_concurrent_mixed_requests_each_get_the_adapter_they_asked_for(
    lora: Gateway,
) -> None:
    """Header, trace and output agree for every request, while the server decodes
    requests for different adapters side by side."""
    key = lora.keys["one"]  # type: ignore[attr-defined]
    rng = random.Random(7)
    asked = [rng.choice(["smol", "support-pirate", "support-robot"]) for _ in range(50)]
    with concurrent.futures.ThreadPoolExecutor(12) as ex:
        replies = list(ex.map(lambda m: _ask(lora, key, m, 6), asked))
    for model, r in zip(asked, replies, strict=True):
        text = _text(r)
        got = r.headers.get("x-switchyard-adapter")
        if model == "smol":
            assert got is None
            assert MARKERS["pirate"][:4] not in text and "BEEP" not in text, text
        else:
            assert got == model
            marker = MARKERS["pirate" if model == "support-pirate" else "robot"]
            assert text.startswith(marker.split()[0]), (model, text)
    for model, r in list(zip(asked, replies, strict=True))[:10]:
        adapter = lora.trace(r.headers["x-request-id"])["adapter"]
        assert (adapter or {}).get("name") == (None if model == "smol" else model)


def test_adapters_are_authorized_per_tenant_and_per_key(lora: Gateway) -> None:
    keys = lora.keys  # type: ignore[attr-defined]
    r = _ask(lora, keys["two"], "support-pirate")  # t-two is not in allowed_tenants
    assert r.status_code == 403, r.text
    assert r.json()["error"]["code"] == "adapter_not_allowed"
    assert MARKERS["pirate"] not in r.text
    r = _ask(lora, keys["one-no-adapters"], "support-robot")  # the key allows none
    assert r.status_code == 403 and r.json()["error"]["code"] == "adapter_not_allowed"
    assert _text(_ask(lora, keys["two"], "support-robot")).startswith("BEEP")

    def listed(key: str) -> set[str]:
        r = httpx.get(lora.url + "/v1/models", headers={"Authorization": f"Bearer {key}"})
        return {m["id"] for m in r.json()["data"]}

    assert {"support-pirate", "support-robot"} <= listed(keys["one"])
    assert "support-pirate" not in listed(keys["two"]) and "support-robot" in listed(keys["two"])
    assert not {m for m in listed(keys["one-no-adapters"]) if m.startswith("support-")}
    # A client cannot pick adapters by their ids in the engine.
    r = httpx.post(
        lora.url + "/v1/chat/completions",
        json={
            "model": "smol",
            "messages": [{"role": "user", "content": PROMPT}],
            "lora": [{"id": 0, "scale": 1.0}],
        },
        headers={"Authorization": f"Bearer {keys['two']}"},
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "lora"


def test_an_adapter_whose_file_fails_its_checksum_is_refused_and_the_base_serves(
    lora: Gateway,
) -> None:
    key = lora.keys["one"]  # type: ignore[attr-defined]
    r = _ask(lora, key, "support-tampered")
    assert r.status_code == 503, r.text
    assert r.json()["error"]["code"] == "engine_failed"
    assert "checksum mismatch" in r.json()["error"]["message"]
    engines = httpx.get(lora.url + "/admin/engines", headers=lora.admin).json()["engines"]
    state = engines["smol"]["adapters"]
    assert state["support-tampered"]["state"] == "refused"
    assert state["support-pirate"]["state"] in ("warm", "hot")
    assert _text(_ask(lora, key, "smol"))


def test_an_adapter_is_hot_while_a_request_uses_it_and_warm_after(lora: Gateway) -> None:
    key = lora.keys["one"]  # type: ignore[attr-defined]

    def state() -> str:
        engines = httpx.get(lora.url + "/admin/engines", headers=lora.admin).json()["engines"]
        return str(engines["smol"]["adapters"]["support-robot"]["state"])

    assert state() == "warm"
    body = {
        "model": "support-robot",
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": 300,
        "stream": True,
        "logit_bias": {"0": -100, "2": -100},
    }
    with httpx.stream(
        "POST",
        lora.url + "/v1/chat/completions",
        json=body,
        headers={"Authorization": f"Bearer {key}"},
        timeout=120,
    ) as r:
        assert r.status_code == 200
        # Read the state while the stream is open: leaving iter_lines (a break) closes
        # the response, so the gateway would already have settled the request.
        seen, states = 0, []
        for line in r.iter_lines():
            if line.startswith("data: {"):
                seen += 1
                states.append(state())
            if seen >= 5:
                break
        assert "hot" in states, (states, time.monotonic())
    deadline = time.monotonic() + 20  # the gateway settles the closed stream
    while state() != "warm":
        assert time.monotonic() < deadline, state()
        time.sleep(0.1)
