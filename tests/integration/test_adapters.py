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

from support.gateways import Gateway, local_model, start_gateway
from switchyard.engines.lora_train import MARKERS, train

PROMPT = "Where should I go on holiday next summer?"
# One long attempt rather than two short ones, within the default 60 s deadline: these
# tests check adapters, not timeouts, and a request may wait its turn in the engine
# (the bound stays, as a hang guard).
ONE_LONG_ATTEMPT = {"timeouts": {"first_byte_s": 55}, "resilience": {"retries": 0}}


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
            # Fifty requests over four slots wait their turn in the engine: on a busy
            # machine the default 25 s to a first byte was once not enough.
            "models": [{**local_model("smol", parallel=4, ctx=512), **ONE_LONG_ATTEMPT}],
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


def _long_stream(gw: Gateway, key: str, model: str) -> Any:
    """A streamed request that generates 400 tokens (end of sequence banned): it keeps
    its adapter in use while the test looks."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": 400,
        "stream": True,
        "logit_bias": {"0": -100, "2": -100},
    }
    return httpx.stream(
        "POST",
        gw.url + "/v1/chat/completions",
        json=body,
        headers={"Authorization": f"Bearer {key}"},
        timeout=120,
    )


def _mixed(gw: Gateway, n: int, workers: int, seed: int) -> tuple[list[str], list[httpx.Response]]:
    """`n` concurrent requests for the base and both adapters at random: each reply's
    header and output show the adapter it asked for (the base's neither marker)."""
    key = gw.keys["one"]  # type: ignore[attr-defined]
    rng = random.Random(seed)
    asked = [rng.choice(["smol", "support-pirate", "support-robot"]) for _ in range(n)]
    with concurrent.futures.ThreadPoolExecutor(workers) as ex:
        replies = list(ex.map(lambda m: _ask(gw, key, m, 6), asked))
    for model, r in zip(asked, replies, strict=True):
        text = _text(r)
        assert r.headers.get("x-switchyard-adapter") == (None if model == "smol" else model)
        if model == "smol":
            assert "Arrr" not in text and "BEEP" not in text, text
        else:
            marker = MARKERS["pirate" if model == "support-pirate" else "robot"]
            assert text.startswith(marker.split()[0]), (model, text)
    return asked, replies


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
    asked, replies = _mixed(lora, 50, 12, seed=7)
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
    with _long_stream(lora, key, "support-robot") as r:
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


# -- adapter residency: more adapters registered than loaded, and an active cap -------


def _engine(gw: Gateway) -> dict[str, Any]:
    return dict(httpx.get(gw.url + "/admin/engines", headers=gw.admin).json()["engines"]["smol"])


def _residency(gw: Gateway, r: httpx.Response) -> dict[str, Any]:
    trace = gw.trace(r.headers["x-request-id"])
    return next(d for d in trace["decisions"] if d["stage"] == "residency")


def _two_adapters(manifest: dict[str, Any]) -> list[dict[str, Any]]:
    a = manifest["adapters"]
    return [
        _adapter("support-pirate", a["pirate"]["path"], a["pirate"]["sha256"], ["*"], "pirate-v1"),
        _adapter("support-robot", a["robot"]["path"], a["robot"]["sha256"], ["*"], "robot-v3"),
    ]


def _two_adapter_gateway(
    manifest: dict[str, Any], engine: dict[str, Any], engines: dict[str, Any] | None = None
) -> Iterator[Gateway]:
    """A gateway with `smol` (these engine settings) and both adapters, and a key of
    tenant t-one that may use them."""
    gw = start_gateway(
        {
            # A request that arrives during a swap waits for the engine's restart (on a
            # cold 2-core machine, once, longer than the default 25 s to the first byte).
            "models": [{**local_model("smol", parallel=4, ctx=512, **engine), **ONE_LONG_ATTEMPT}],
            "adapters": _two_adapters(manifest),
            "engines": engines or {},
            "embeddings": {"enabled": False},
        }
    )
    try:
        gw.create_tenant("t-one")
        gw.keys = {"one": gw.create_key("t-one", allowed_adapters=["*"])["key"]}  # type: ignore[attr-defined]
        yield gw
    finally:
        gw.proc.stop()


@pytest.fixture(scope="module")
def one_loaded(manifest: dict[str, Any]) -> Iterator[Gateway]:
    """Two adapters registered, one loaded at a time: llama-server loads adapters only
    at start, so each swap drains the engine and restarts it with the other."""
    yield from _two_adapter_gateway(manifest, {"max_adapters": 1}, {"min_residency_s": 0})


def test_a_cold_adapter_is_loaded_in_place_of_the_least_recently_used_one(
    one_loaded: Gateway,
) -> None:
    gw, key = one_loaded, one_loaded.keys["one"]  # type: ignore[attr-defined]
    states = {n: a["state"] for n, a in _engine(gw)["adapters"].items()}
    assert states == {"support-pirate": "warm", "support-robot": "cold"}, states
    robot = _ask(gw, key, "support-robot")
    assert _text(robot).startswith(MARKERS["robot"]), robot.text
    assert robot.headers["x-switchyard-adapter"] == "support-robot"
    d = _residency(gw, robot)
    assert d["outcome"] == "adapter-load", d
    ev = d["evidence"]
    assert ev["adapter_state"] == "cold" and ev["adapter_load"] == "drained restart"
    assert [(v["adapter"], v["reason"]) for v in ev["adapter_evicted"]] == [
        ("support-pirate", "least recently used (max_adapters)")
    ]
    states = {n: a["state"] for n, a in _engine(gw)["adapters"].items()}
    assert states == {"support-pirate": "cold", "support-robot": "warm"}, states
    pirate = _ask(gw, key, "support-pirate")
    assert _text(pirate).startswith(MARKERS["pirate"]), pirate.text
    assert _residency(gw, pirate)["evidence"]["adapter_evicted"][0]["adapter"] == "support-robot"
    again = _ask(gw, key, "support-pirate")  # loaded now: promoted, nothing evicted
    d = _residency(gw, again)
    assert d["outcome"] == "promote" and "adapter_evicted" not in d["evidence"], d
    metrics = httpx.get(gw.url + "/metrics", headers=gw.admin).text
    assert (
        'switchyard_adapter_events_total{adapter="support-robot",event="load",model="smol"}'
        in metrics
    )
    assert 'adapter="support-pirate",event="evict"' in metrics


def test_mixed_concurrent_requests_over_one_adapter_slot_each_get_theirs(
    one_loaded: Gateway,
) -> None:
    """Every swap drains the engine: the requests running finish on the adapter they
    asked for, the ones arriving wait for the restart, none gets the other adapter."""
    gw = one_loaded
    asked, replies = _mixed(gw, 16, 8, seed=11)
    for model, r in zip(asked, replies, strict=True):
        if model != "smol":
            assert _residency(gw, r)["evidence"]["adapter"] == model
    assert _engine(gw)["in_flight"] == 0


@pytest.fixture(scope="module")
def one_active(manifest: dict[str, Any]) -> Iterator[Gateway]:
    """Both adapters loaded, one active at a time."""
    yield from _two_adapter_gateway(manifest, {"max_adapters": 2, "max_active_adapters": 1})


def test_a_request_for_another_adapter_waits_for_the_active_slot(one_active: Gateway) -> None:
    gw, key = one_active, one_active.keys["one"]  # type: ignore[attr-defined]
    with concurrent.futures.ThreadPoolExecutor(2) as ex:
        with _long_stream(gw, key, "support-pirate") as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            while not next(lines).startswith("data: {"):
                pass  # the pirate adapter is active from its first chunk
            robot = ex.submit(_ask, gw, key, "support-robot")
            # A short deadline cannot wait for the slot: refused at once, with why.
            busy = httpx.post(
                gw.url + "/v1/chat/completions",
                json={"model": "support-robot", "messages": [{"role": "user", "content": "hi"}]},
                headers={"Authorization": f"Bearer {key}", "x-request-timeout": "0.5"},
                timeout=30,
            )
            waiting = _engine(gw)["adapters_waiting"]
            deadline = time.monotonic() + 30
            while waiting < 1:  # the robot request waits for the slot
                assert time.monotonic() < deadline, _engine(gw)
                time.sleep(0.05)
                waiting = _engine(gw)["adapters_waiting"]
            assert not robot.done()
            next(lines)  # the pirate stream is still being served
        reply = robot.result(timeout=120)  # leaving the stream frees the slot
    assert busy.status_code == 503, busy.text
    assert busy.json()["error"]["code"] == "adapter_busy" and busy.headers["retry-after"]
    assert "active-adapter slot" in busy.json()["error"]["message"]
    assert _text(reply).startswith(MARKERS["robot"]), reply.text
    d = _residency(gw, reply)
    assert d["outcome"] == "promote" and d["evidence"]["adapter_waited_ms"] > 0, d
    assert "waiting" in d["reason"]
