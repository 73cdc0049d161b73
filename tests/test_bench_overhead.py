"""`switchyard bench overhead`: the verdict and the per-round spread from wrk runs."""

from __future__ import annotations

from typing import Any

import pytest

from switchyard.bench.overhead import summarize


def _runs(table: dict[tuple[int, str], tuple[float, float]]) -> list[dict[str, Any]]:
    """(round, target) -> (req/s, p50 ms), the same for every scenario."""
    runs = []
    for (rnd, target), (rps, p50) in table.items():
        for stream in (False, True):
            for c in (1, 32):
                name = f"{'stream' if stream else 'non-stream'} c={c}"
                runs.append(
                    {
                        "round": rnd,
                        "scenario": name,
                        "target": target,
                        "rps": rps,
                        "p50_ms": p50,
                        "p99_ms": p50 * 3,
                        "non_2xx": 0,
                        "socket_errors": 0,
                    }
                )
    return runs


def test_medians_decide_and_each_round_reports_its_own_ratio() -> None:
    # Round 2 runs on a machine twice as slow: every target's latency doubles.
    runs = _runs(
        {
            (1, "direct"): (6000, 0.2),
            (1, "floor"): (1200, 0.9),
            (1, "switchyard"): (960, 1.2),
            (2, "direct"): (3000, 0.4),
            (2, "floor"): (600, 1.8),
            (2, "switchyard"): (480, 2.4),
            (3, "direct"): (6000, 0.2),
            (3, "floor"): (1200, 0.9),
            (3, "switchyard"): (840, 1.6),
        }
    )
    by_name = {s["scenario"]: s for s in summarize(runs)}
    c1, c32 = by_name["non-stream c=1"], by_name["non-stream c=32"]
    # Medians: direct 0.2, floor 0.9, switchyard 1.6 -> (1.6-0.2)/(0.9-0.2) = 2.0.
    assert c1["added_p50_ratio"] == pytest.approx(2.0)
    assert c1["verdict"] == "MISS"
    assert c32["rps_ratio"] == pytest.approx(840 / 1200) and c32["verdict"] == "PASS"
    lat = c1["per_round"]["added_p50_ratio"]
    assert lat == pytest.approx([1.0 / 0.7, 2.0 / 1.4, 1.4 / 0.7])
    assert c32["per_round"]["rps_ratio"] == pytest.approx([0.8, 0.8, 0.7])


@pytest.mark.parametrize("bare", [False, True])
def test_the_floor_relays_bytes_as_they_are(scripted: Any, bare: bool) -> None:
    """Both floors (through FastAPI's stack, and served from the ASGI call) forward
    the body and return the upstream's reply unchanged, streamed or not; other
    routes are still FastAPI's (404)."""
    import sys

    import httpx

    from conftest import Proc, free_port, wait_http

    port = free_port()
    argv = [sys.executable, "-m", "switchyard.bench.passthrough_proxy", "--port", str(port)]
    argv += ["--upstream", scripted.url + "/v1", *(["--bare"] if bare else [])]
    proc = Proc(argv, "floor")
    try:
        wait_http(f"http://127.0.0.1:{port}/nothing", proc, status=404)
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        for stream in (False, True):
            sent = {**body, "stream": stream}
            direct = httpx.post(scripted.url + "/v1/chat/completions", json=sent)
            floor = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=sent)
            assert floor.status_code == direct.status_code == 200
            assert floor.headers["content-type"] == direct.headers["content-type"]
            norm = [ln for ln in floor.text.splitlines() if '"created"' not in ln]
            want = [ln for ln in direct.text.splitlines() if '"created"' not in ln]
            assert norm == want and (stream is False or "data: [DONE]" in floor.text)
        assert ("server" in floor.headers) is not bare
    finally:
        proc.stop()
