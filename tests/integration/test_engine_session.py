"""A managed engine and the terminal's Ctrl-C: the engine runs in a session of its own
(engines/llamacpp_process.py), so SIGINT to the gateway's process group, which is
what a terminal sends its foreground job, reaches the gateway only. The gateway
drains its requests on the engine, then stops it; a gateway killed outright takes
its engine along (the kernel's parent-death signal), although the engine is no
longer in its session."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import orjson
import pytest

from support.gateways import Gateway, local_model, start_gateway

NO_EOS = {"0": -100, "2": -100}  # SmolLM2's end tokens banned: a stream runs its length
MAX_TOKENS = 24  # well inside uvicorn's 5 s of graceful shutdown, even on a busy machine


@pytest.fixture
def gw() -> Iterator[Gateway]:
    config = {
        "models": [local_model("smol", parallel=1, ctx=512)],
        "embeddings": {"enabled": False},
    }
    g = start_gateway(config)
    try:
        yield g
    finally:
        g.proc.stop()


def _engine_pid(gw: Gateway) -> int:
    info = httpx.get(gw.url + "/readyz", headers=gw.admin, timeout=10).json()["models"]["smol"]
    pid = int(info["pid"])
    assert b"llama-server" in Path(f"/proc/{pid}/cmdline").read_bytes()
    return pid


def _gone(pid: int, timeout_s: float) -> bool:
    """Whether `pid` has exited (a zombie not yet reaped counts) within `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            return True
        if state == "Z":
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)


def test_ctrl_c_leaves_the_engine_serving_until_the_gateway_has_drained(gw: Gateway) -> None:
    gateway = gw.proc.popen.pid
    assert os.getpgid(gateway) == gateway  # a foreground job's leader, as a shell starts it
    engine = _engine_pid(gw)
    assert os.getsid(engine) == os.getpgid(engine) == engine != os.getsid(gateway)
    body = {
        "model": "smol",
        "messages": [{"role": "user", "content": "Count upwards from one."}],
        "max_tokens": MAX_TOKENS,
        "logit_bias": NO_EOS,
        "stream": True,
    }
    events: list[dict[str, object]] = []
    with gw.stream(body) as r:
        assert r.status_code == 200, r.read()
        lines = (line.removeprefix("data: ") for line in r.iter_lines() if line)
        for data in lines:
            events.append(orjson.loads(data))
            break
        os.killpg(gateway, signal.SIGINT)  # the terminal's Ctrl-C, mid-stream
        tail = list(lines)
    # The engine kept generating while the gateway drained: the stream ran its length.
    assert tail[-1] == "[DONE]", tail[-3:]
    events += [orjson.loads(d) for d in tail[:-1]]
    assert not any("error" in e for e in events), events[-3:]
    finish = [c["finish_reason"] for e in events for c in e["choices"] if c.get("finish_reason")]
    assert finish == ["length"], events[-3:]
    # Then the gateway stopped it, and exited.
    assert gw.proc.popen.wait(60) == 0, gw.proc.output()[-3000:]
    assert _gone(engine, 5), f"the engine {engine} outlived its gateway"
    out = gw.proc.output()
    assert "Traceback" not in out and "engine smol down" not in out, out[-3000:]


def test_a_gateway_killed_outright_takes_its_engine_along(gw: Gateway) -> None:
    engine = _engine_pid(gw)
    gw.proc.popen.kill()  # no shutdown runs: the kernel's parent-death signal does it
    gw.proc.popen.wait(10)
    assert _gone(engine, 20), f"the engine {engine} outlived its gateway"
