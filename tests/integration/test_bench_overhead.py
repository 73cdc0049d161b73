"""`switchyard bench overhead`: the verdict and the per-round spread from wrk runs."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import pytest

from switchyard.bench import realistic
from switchyard.bench.overhead import CHECKED_TARGETS, TARGETS, render, summarize, target_names


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

    from support.procs import Proc, free_port, wait_http

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


def test_the_realistic_target_is_judged_against_the_floor_like_switchyard() -> None:
    runs = _runs(
        {
            (1, "direct"): (6000, 0.2),
            (1, "floor"): (1200, 0.9),
            (1, "switchyard"): (960, 1.2),
            (1, "sy-realistic"): (600, 1.6),
            (2, "direct"): (6000, 0.2),
            (2, "floor"): (1200, 0.9),
            (2, "switchyard"): (960, 1.2),
            (2, "sy-realistic"): (900, 1.1),
        }
    )
    targets = ("direct", "floor", "switchyard", "sy-realistic")
    by_name = {s["scenario"]: s for s in summarize(runs, targets)}
    c1, c32 = by_name["stream c=1"], by_name["stream c=32"]
    real1, real32 = c1["checks"]["sy-realistic"], c32["checks"]["sy-realistic"]
    # Medians: realistic p50 (1.6+1.1)/2 = 1.35 -> (1.35-0.2)/0.7; req/s 750/1200.
    assert real1["added_p50_ratio"] == pytest.approx(1.15 / 0.7)
    assert real1["verdict"] == "MISS"
    assert real32["rps_ratio"] == pytest.approx(750 / 1200) and real32["verdict"] == "MISS"
    assert real1["per_round"]["added_p50_ratio"] == pytest.approx([1.4 / 0.7, 0.9 / 0.7])
    assert real32["per_round"]["rps_ratio"] == pytest.approx([0.5, 0.75])
    # switchyard's own verdict is unchanged by the extra target, at the top level too.
    assert c1["checks"]["switchyard"]["verdict"] == c1["verdict"] == "PASS"
    assert c32["rps_ratio"] == pytest.approx(0.8)

    text = render(summarize(runs, targets), argparse.Namespace(duration=1, rounds=2))
    assert "added p50 sy-realistic/floor 1.64, req/s sy-realistic/floor 0.62" in text
    assert "[req/s ratio >= 0.7: MISS]" in text and "[added p50 ratio <= 1.5: PASS]" in text


def test_the_realistic_scenario_runs_by_default_next_to_the_others() -> None:
    from switchyard.cli import build_parser

    def targets(*argv: str) -> tuple[str, ...]:
        return target_names(build_parser().parse_args(["bench", "overhead", *argv]))

    python = ("direct", "floor", "switchyard", "sy-realistic")
    assert targets("--no-native") == python
    # The native floors run beside the Python ones unless asked not to.
    assert targets() == ("direct", "nginx-direct", "nginx-proxy", *python[1:])
    # The proxies on the nginx instant upstream: direct is that upstream.
    assert targets("--native-upstream") == ("direct", "nginx-proxy", *python[1:])
    assert targets("--policy", "--no-native") == (*python, "sy-policy", "sy-policy-redis")
    assert targets("--scenario", "realistic", "--no-native") == ("direct", "floor", "sy-realistic")
    assert targets("--scenario", "core", "--no-native") == TARGETS
    assert targets("--scenario", "realistic", "core") == targets()
    assert realistic.TARGET in CHECKED_TARGETS


def test_the_realistic_key_and_tenant_carry_their_limits(tmp_path: Path) -> None:
    """The tenant and key the realistic target creates (through the CLI), read back
    from the key store its gateway uses, and its config as the gateway loads it."""
    from switchyard.config import ObserveConfig, load_settings
    from switchyard.identity import Limits
    from switchyard.state.keys import KeyStore
    from switchyard.state.sql import connect

    gw = realistic.prepare(tmp_path, upstream_port=9, timeout_s=120)
    store = KeyStore(connect(str(gw.db)))
    tenant = store.get_tenant("realistic")
    assert tenant["limits"] == {
        "rpm": 1_000_000,
        "tpm": 1_000_000_000,
        "max_concurrency": 1_000,
        "budget_usd": 1_000_000,
        "budget_period": "day",
    }
    [key] = store.list_keys("realistic")
    assert key["limits"]["rpm"] == 1_000_000
    principal = store.verify(gw.key)
    assert not isinstance(principal, str), principal
    assert principal.key_limits == Limits(rpm=1_000_000)
    assert principal.tenant_limits == Limits(1_000_000, 1_000_000_000, 1_000, 1_000_000, "day")

    settings = load_settings(str(gw.config))
    assert settings.auth.mode == "keys" and not settings.auth.bootstrap_dev_key
    assert settings.observe == ObserveConfig()  # the default trace policy
    assert settings.observe.traces and settings.observe.traces_sample_ok == 1.0
    assert Path(settings.storage.sqlite_path) == gw.db
    assert [m.alias for m in settings.models] == ["scripted"]


def test_the_realistic_target_serves_its_key_and_stores_traces(
    tmp_path: Path, scripted: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Started for real: refused without its key, served with it, traced; the admin API
    of the running gateway shows the limits; wrk with its script gets no refusal."""
    import json
    import shutil

    from switchyard.bench.harness import CHAT_PATH, Scenario, count_rows, http, run_wrk, stop_all

    monkeypatch.setenv("SWITCHYARD_ADMIN_KEY", "admin-test")
    children: list[Any] = []
    args = argparse.Namespace(startup_timeout=120.0, tokens=4)
    try:
        target = realistic.start_realistic_target(
            tmp_path, {"direct": scripted.url + CHAT_PATH}, args, children
        )
        # Its smoke requests (one plain, one streamed) left usage rows and traces.
        assert count_rows(target.db, "usage") >= 2 and count_rows(target.db, "traces") >= 2
        base = target.url.removesuffix(CHAT_PATH)
        admin = {"Authorization": "Bearer admin-test"}
        status, body = http("GET", base + "/admin/tenants/realistic", headers=admin)
        assert status == 200, body
        assert json.loads(body)["limits"]["max_concurrency"] == 1_000
        status, body = http("GET", base + "/admin/keys?tenant=realistic", headers=admin)
        assert status == 200 and json.loads(body)["data"][0]["limits"]["rpm"] == 1_000_000
        if shutil.which("wrk") is not None:
            res = run_wrk("wrk", target.url, target.scripts[True], Scenario(True, 1), 1)
            assert res.requests > 0 and res.non_2xx == 0 and res.socket_errors == 0
    finally:
        stop_all(children)


def test_the_governed_scenario_reports_on_vs_off_beside_the_floor_verdict() -> None:
    """`--scenario governed`: sy-governed is judged against the floor; sy-gov-off, its
    baseline, is measured in the same rounds and the on/off ratios are exact."""
    from switchyard.bench import governed
    from switchyard.cli import build_parser

    argv = ["bench", "overhead", "--scenario", "governed"]
    assert target_names(build_parser().parse_args(argv)) == (
        "direct",
        "nginx-direct",
        "nginx-proxy",
        "floor",
        "sy-gov-off",
        "sy-governed",
    )
    runs = _runs(
        {
            (1, "direct"): (6000, 0.2),
            (1, "floor"): (1200, 0.9),
            (1, "sy-gov-off"): (1000, 1.0),
            (1, "sy-governed"): (800, 1.4),
        }
    )
    summary = summarize(runs, ("direct", "floor", "sy-gov-off", "sy-governed"))
    c1 = {s["scenario"]: s for s in summary}["non-stream c=1"]
    assert set(c1["checks"]) == {"sy-governed"}  # the baseline is not judged
    ratio = {r["scenario"]: r for r in governed.ratios(summary)}["non-stream c=1"]
    assert ratio["added_p50_ms_on"] == pytest.approx(1.2)
    assert ratio["added_p50_ms_off"] == pytest.approx(0.8)
    assert ratio["added_p50_ratio_on_off"] == pytest.approx(1.5)
    assert ratio["rps_ratio_on_off"] == pytest.approx(0.8)
    text = render(summary, argparse.Namespace(duration=1, rounds=1))
    assert "governance on (sy-governed) vs off (sy-gov-off):" in text
    assert "added p50 1.200 vs 0.800 ms (1.50x), req/s 0.80x" in text


def test_the_protocols_scenario_compares_each_protocol_with_the_chat_request() -> None:
    """`--scenario realistic protocols`: sy-messages and sy-responses run on the realistic
    gateway; each one's added p50 is judged against sy-realistic's (<= 1.2x)."""
    from switchyard.bench import protocols
    from switchyard.cli import build_parser

    argv = ["bench", "overhead", "--scenario", "realistic", "protocols", "governed", "--no-native"]
    names = target_names(build_parser().parse_args(argv))
    assert names == (
        "direct",
        "floor",
        "sy-realistic",
        "sy-messages",
        "sy-responses",
        "sy-gov-off",
        "sy-governed",
    )
    targets = ("direct", "floor", "sy-realistic", "sy-messages", "sy-responses")
    runs = _runs(
        {
            (1, "direct"): (6000, 0.2),
            (1, "floor"): (1200, 0.6),
            (1, "sy-realistic"): (1000, 1.2),
            (1, "sy-messages"): (950, 1.3),  # +1.1 ms against chat's +1.0: 1.10
            (1, "sy-responses"): (900, 1.5),  # +1.3 ms: 1.30, a miss
        }
    )
    summary = summarize(runs, targets)
    got = {r["target"]: r for r in protocols.ratios(summary) if r["scenario"] == "non-stream c=1"}
    assert got["sy-messages"]["ratio"] == pytest.approx(1.1)
    assert got["sy-messages"]["verdict"] == "PASS"
    assert got["sy-responses"]["ratio"] == pytest.approx(1.3)
    assert got["sy-responses"]["verdict"] == "MISS"
    text = render(summary, argparse.Namespace(duration=1, rounds=1))
    assert "Protocols vs chat (added p50 target/sy-realistic <= 1.2):" in text
    assert "sy-responses  chat +1.000 ms, this +1.300 ms, ratio 1.30  [MISS]" in text


def test_the_native_hop_is_reported_beside_the_python_floor() -> None:
    """nginx-proxy's added p50 is over its own upstream (nginx-direct); the floor's
    added p50 and CPU per request are given as multiples of the native hop's, and the
    Switchyard verdicts against the floor do not change."""
    table = {
        (1, "direct"): (6000, 0.2),
        (1, "nginx-direct"): (40000, 0.05),
        (1, "nginx-proxy"): (20000, 0.1),
        (1, "floor"): (1200, 0.9),
        (1, "switchyard"): (960, 1.2),
    }
    cpu = {"direct": 50.0, "nginx-direct": 8.0, "nginx-proxy": 20.0, "floor": 200.0}
    runs = _runs(table)
    for r in runs:
        r["cpu_us_per_req"] = cpu.get(r["target"], 500.0)
    targets = ("direct", "nginx-direct", "nginx-proxy", "floor", "switchyard")
    without = {s["scenario"]: s for s in summarize(runs, TARGETS)}
    summary = summarize(runs, targets)
    c1 = {s["scenario"]: s for s in summary}["non-stream c=1"]
    assert c1["native"]["upstream"] == "nginx-direct"
    assert c1["native"]["proxy_added_p50_ms"] == pytest.approx(0.05)
    assert c1["native"]["floor_added_p50_over_proxy"] == pytest.approx(0.7 / 0.05)
    assert c1["native"]["floor_cpu_over_proxy"] == pytest.approx(10.0)
    assert c1["checks"] == without["non-stream c=1"]["checks"]
    text = render(summary, argparse.Namespace(duration=1, rounds=1))
    assert "native hop: nginx-proxy adds 0.050 ms p50 over nginx-direct, CPU/req 20 us" in text
    assert "the floor's added p50 14.0x, CPU/req 10.0x" in text
    # With --native-upstream, direct is the nginx instant upstream the proxy calls.
    table[(1, "direct")] = table.pop((1, "nginx-direct"))
    native_up = summarize(_runs(table), ("direct", "nginx-proxy", "floor", "switchyard"))
    assert native_up[0]["native"]["upstream"] == "direct"
    assert native_up[0]["native"]["proxy_added_p50_ms"] == pytest.approx(0.05)
    assert native_up[0]["native"]["floor_added_p50_over_proxy"] == pytest.approx(0.85 / 0.05)
    assert native_up[0]["native"]["floor_cpu_over_proxy"] is None  # no CPU in these runs
