"""Edge or cloud per request (models[].placement): the policy on its own (decide/placement.py,
with real Deployments from a real Registry), then through a real gateway in front of two
scripted upstreams, one labelled as on the device and one in the cloud."""

from __future__ import annotations

import random
from typing import Any

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from support.gateways import Gateway, start_gateway
from support.upstreams import Scripted
from switchyard.config import ConfigError, PlacementConfig, Settings, parse_settings
from switchyard.decide.placement import (
    DeviceState,
    Network,
    Placer,
    parse_device_state,
    parse_network,
)
from switchyard.engines.registry import Deployment, Registry
from switchyard.errors import InvalidRequest


def _deps(**placement: Any) -> tuple[list[Deployment], PlacementConfig]:
    s = Settings.model_validate(
        {
            "models": [
                {
                    "alias": "a",
                    "deployments": [
                        {"name": "dev", "location": "device", "engine": _remote("dev")},
                        {"name": "small", "location": "device", "engine": _remote("small")},
                        {"name": "cloud", "engine": _remote("cloud")},
                    ],
                    "placement": placement,
                }
            ]
        }
    )
    assert s.models[0].placement is not None
    return Registry(s).replicas["a"], s.models[0].placement


def _remote(name: str) -> dict[str, Any]:
    return {"kind": "openai", "base_url": f"http://{name}.invalid/v1"}


def _measured(d: Deployment, ttft_ms: float, tpot_ms: float) -> None:
    d.live.ttft_s, d.live.tpot_s = ttft_ms / 1000, tpot_ms / 1000
    d.live.last_sample = 1.0  # measured at t=1; _decide decides at t=2 (fresh)


def _decide(placer: Placer, deps: list[Deployment], **kw: Any) -> Any:
    args: dict[str, Any] = {
        "device": [d for d in deps if d.location == "device"],
        "cloud": [d for d in deps if d.location == "cloud"],
        "private": None,
        "state": DeviceState(),
        "network": None,
        "nbytes": 0,
        "tokens": 10,
        "remaining_ms": 10_000.0,
        "route": None,
        "now": 2.0,
    }
    args.update(kw)
    return placer.decide(**args)


def test_locations_default_from_the_engine_and_configs_are_checked() -> None:
    deps, _ = _deps()
    assert {d.name: d.location for d in deps} == {
        "a/dev": "device",
        "a/small": "device",
        "a/cloud": "cloud",
    }
    bad = [
        ({"thermal_c": {"enter": 70, "exit": 80}}, "thermal_c: exit must be below enter"),
        ({"battery_pct": {"enter": 30, "exit": 20}}, "battery_pct: exit must be above enter"),
        ({"degraded_deployment": "cloud"}, "is not a device deployment"),
    ]
    for placement, needle in bad:
        with pytest.raises(ConfigError, match=needle):
            parse_settings(
                {
                    "models": [
                        {
                            "alias": "a",
                            "deployments": [{"name": "cloud", "engine": _remote("c")}],
                            "placement": placement,
                        }
                    ]
                },
                "t",
            )


def test_the_seeds_example_local_then_cloud_when_the_network_improves() -> None:
    """Local 42 ms vs cloud 18 ms of compute + 11 ms round trip + 24 ms upload = 53 ms:
    local. The upload drops to 4 ms and the round trip to 8: 30 ms, the cloud."""
    deps, cfg = _deps()
    placer = Placer("a", cfg)
    dev, small, cloud = deps
    _measured(dev, 42, 0)
    _measured(small, 60, 0)
    _measured(cloud, 18, 0)
    nbytes = 3000  # 24 ms at 1,000 kbit/s
    p = _decide(placer, deps, network=Network(11, 1000), nbytes=nbytes)
    assert (p.mode, p.reason) == ("local", "network")
    assert p.evidence["estimate_ms"] == {"device": 42.0, "cloud": 53.0}
    p = _decide(placer, deps, network=Network(8, 6000), nbytes=nbytes)
    assert (p.mode, p.reason) == ("remote", "network")
    assert p.evidence["estimate_ms"]["cloud"] == 30.0


def test_privacy_forces_the_device_even_when_the_cloud_is_faster() -> None:
    deps, cfg = _deps()
    placer = Placer("a", cfg)
    _measured(deps[0], 900, 50)
    _measured(deps[2], 5, 1)
    p = _decide(placer, deps, private="PII found (email)")
    assert (p.mode, p.location, p.reason, p.stay) == ("local", "device", "privacy", True)
    # No device deployment eligible: refused, never the cloud.
    p = _decide(placer, deps, private="PII found (email)", device=[])
    assert p.mode == "refused" and p.location == "device"


def test_deadline_too_short_for_the_cloud_picks_the_device() -> None:
    deps, cfg = _deps()
    placer = Placer("a", cfg)
    _measured(deps[0], 50, 5)  # 100 ms for 10 tokens
    _measured(deps[1], 80, 5)
    _measured(deps[2], 20, 1)  # 30 ms, but +400 ms of network
    p = _decide(placer, deps, network=Network(400, 100_000), remaining_ms=200)
    assert (p.mode, p.reason) == ("local", "deadline")
    p = _decide(placer, deps, remaining_ms=200)  # a good network: both fit, cloud faster
    assert (p.mode, p.reason) == ("remote", "network")


def test_the_estimates_follow_measured_latency() -> None:
    deps, cfg = _deps()
    placer = Placer("a", cfg)
    _measured(deps[0], 100, 5)
    _measured(deps[1], 100, 5)
    _measured(deps[2], 40, 2)
    assert _decide(placer, deps).location == "cloud"
    _measured(deps[2], 900, 20)  # the cloud slowed down
    assert _decide(placer, deps).location == "device"


def test_a_reasoning_route_prefers_the_cloud_when_the_deadline_allows() -> None:
    deps, cfg = _deps(cloud_routes=["reasoning"])
    placer = Placer("a", cfg)
    _measured(deps[0], 30, 1)
    _measured(deps[1], 30, 1)
    _measured(deps[2], 90, 3)  # slower than the device
    assert _decide(placer, deps, route="chitchat").location == "device"
    p = _decide(placer, deps, route="reasoning")
    assert (p.mode, p.reason) == ("remote", "quality")
    p = _decide(placer, deps, route="reasoning", remaining_ms=50)  # the cloud cannot make it
    assert (p.location, p.reason) == ("device", "deadline")


def test_missing_sensors_still_decide_and_say_so() -> None:
    deps, cfg = _deps()
    p = _decide(Placer("a", cfg), deps, state=DeviceState(memory_pct=40.0, source="sensors"))
    assert p is not None and p.mode in ("local", "remote")
    assert p.evidence["device"]["missing"] == ["temp_c", "battery", "charging"]
    assert p.reason == "probe"  # neither measured yet: this request measures one
    for d in deps:
        _measured(d, 100, 5)
    p = _decide(Placer("a", cfg), deps, state=DeviceState(source="none"))
    assert p.reason == "cost"  # the estimates tie: the device has no per-token price


def test_a_hot_device_sends_work_to_the_cloud_or_degrades_it() -> None:
    deps, cfg = _deps(min_dwell_s=0, degraded_deployment="small", degraded_max_tokens=16)
    for d in deps:
        _measured(d, 100, 5)
    placer = Placer("a", cfg)
    changes = placer.observe(DeviceState(temp_c=90.0), 100.0)
    assert [(c.condition, c.active) for c in changes] == [("thermal", True)]
    p = _decide(placer, deps)
    assert (p.mode, p.reason) == ("remote", "thermal")
    p = _decide(placer, deps, remaining_ms=1.0)  # the cloud cannot make it: degraded
    assert (p.mode, p.location, p.only, p.max_tokens) == ("degraded", "device", "a/small", 16)
    p = _decide(placer, deps, private="PII found (phone)")  # private and hot: degraded
    assert (p.mode, p.reason) == ("degraded", "privacy")


def test_hysteresis_holds_between_the_thresholds_and_for_the_dwell_time() -> None:
    _, cfg = _deps(min_dwell_s=10)
    placer = Placer("a", cfg)
    t = 1000.0
    assert placer.observe(DeviceState(temp_c=86), t)  # entered
    for dt, temp in ((1, 80), (2, 84), (3, 76), (4, 79)):  # between exit 75 and enter 85
        assert not placer.observe(DeviceState(temp_c=temp), t + dt)
    assert placer.stressed() == ["thermal"]
    assert not placer.observe(DeviceState(temp_c=74), t + 20)  # below exit: held first
    assert not placer.observe(DeviceState(temp_c=73), t + 25)
    changes = placer.observe(DeviceState(temp_c=73), t + 31)  # held 11 s below exit
    assert [(c.condition, c.active) for c in changes] == [("thermal", False)]
    assert not placer.observe(DeviceState(temp_c=90), t + 35)  # dwell in the normal mode
    assert placer.observe(DeviceState(temp_c=90), t + 42)


@settings(max_examples=50, deadline=None)
@given(st.lists(st.floats(80.0, 90.0), min_size=20, max_size=200), st.integers(0, 2**32))
def test_a_noisy_temperature_near_the_threshold_flaps_less_with_hysteresis(
    noise: list[float], seed: int
) -> None:
    """Readings around 85 °C, one a second: with enter 85 / exit 75 and a 30 s dwell
    the mode changes at most once per 30 s; with no band and no dwell it follows
    every crossing (the same readings)."""
    rng = random.Random(seed)
    readings = [rng.choice(noise) for _ in range(len(noise))]
    _, banded = _deps(min_dwell_s=30)
    _, bare = _deps(min_dwell_s=0, thermal_c={"enter": 85.0, "exit": 84.999})
    with_band, without = Placer("a", banded), Placer("a", bare)
    n_band = sum(
        len(with_band.observe(DeviceState(temp_c=r), float(i))) for i, r in enumerate(readings)
    )
    n_bare = sum(
        len(without.observe(DeviceState(temp_c=r), float(i))) for i, r in enumerate(readings)
    )
    assert n_band <= 1 + len(readings) // 30
    # The bare condition is a plain threshold: it changes at every crossing.
    active, changes = False, 0
    for r in readings:
        if (not active and r >= 85.0) or (active and r < 84.999):
            active, changes = not active, changes + 1
    assert n_bare == changes


def test_device_and_network_headers_are_bounded_and_validated() -> None:
    s = parse_device_state("temp_c=87.5, battery=40, charging=false, memory_pct=60")
    assert (s.temp_c, s.battery, s.charging, s.memory_pct, s.source) == (
        87.5,
        40.0,
        False,
        60.0,
        "header",
    )
    assert parse_network("rtt_ms=8, uplink_kbps=6000") == Network(8.0, 6000.0)
    for bad in (
        "temp_c=nan",
        "temp_c=900",
        "battery=-1",
        "temp_c=1, temp_c=2",
        "volts=3",
        "x" * 300,
        "charging=maybe",
    ):
        with pytest.raises(InvalidRequest) as e:
            parse_device_state(bad)
        assert e.value.param == "x-switchyard-device-state"
    for bad in ("rtt_ms=8", "rtt_ms=8, uplink_kbps=0", "rtt_ms=-1, uplink_kbps=5"):
        with pytest.raises(InvalidRequest):
            parse_network(bad)


# -- through the gateway ---------------------------------------------------------------------


def _gateway(two: tuple[Scripted, Scripted], **placement: Any) -> Gateway:
    dev, cloud = two
    for s in two:
        httpx.put(s.url + "/control/fault", json={"fault": None})
    gw = start_gateway(
        {
            "models": [
                {
                    "alias": "assist",
                    "deployments": [
                        {
                            "name": "dev",
                            "location": "device",
                            "engine": {"kind": "openai", "base_url": dev.url + "/v1"},
                        },
                        {
                            "name": "cloud",
                            "location": "cloud",
                            "engine": {"kind": "openai", "base_url": cloud.url + "/v1"},
                        },
                    ],
                    "balance": {"affinity": False, "prefix_affinity": False},
                    "placement": {"min_dwell_s": 0, **placement},
                    "resilience": {"retries": 0},
                }
            ],
            "embeddings": {"enabled": False},
        }
    )
    for want in ("remote; reason=probe", "local; reason=probe"):  # first: each measured
        assert _ask(gw, gw.key).headers["x-switchyard-placement"] == want
    return gw


def _ask(gw: Gateway, key: str, text: str = "hi", **headers: str) -> httpx.Response:
    return httpx.post(
        gw.url + "/v1/chat/completions",
        json={"model": "assist", "messages": [{"role": "user", "content": text}], "max_tokens": 4},
        headers={"Authorization": f"Bearer {key}", **headers},
        timeout=30,
    )


def _place(gw: Gateway, r: httpx.Response) -> dict[str, Any]:
    return next(
        d for d in gw.trace(r.headers["x-request-id"])["decisions"] if d["stage"] == "place"
    )


def test_private_requests_never_reach_the_cloud(two: tuple[Scripted, Scripted]) -> None:
    dev, cloud = two
    gw = _gateway(two)
    try:
        dev.fault("delay:300", count=1000)  # the device is slower: the cloud would win
        for _ in range(3):  # the cloud is measured faster first
            _ask(gw, gw.key)
        before = cloud.requests()
        pii = _ask(gw, gw.key, "mail jane.doe@example.com the report")
        assert pii.status_code == 200, pii.text
        assert pii.headers["x-switchyard-placement"] == "local; reason=privacy"
        assert pii.headers["x-switchyard-upstream"] == "assist/dev"
        d = _place(gw, pii)
        assert d["outcome"] == "local" and "PII found (EMAIL)" in d["reason"]
        rows = {
            r["request_id"]: r for r in gw.usage(limit=50)
        }  # the trace is stored: so is the row
        assert rows[pii.headers["x-request-id"]]["placement"] == "local; reason=privacy"
        bound = _ask(gw, gw.key, "hi", **{"x-switchyard-data-boundary": "device"})
        assert bound.headers["x-switchyard-upstream"] == "assist/dev"
        # The device fails: the private request fails too, and still nothing reached the cloud.
        dev.fault("status:500", count=1000)
        failed = _ask(gw, gw.key, "mail jane.doe@example.com the report")
        assert failed.status_code >= 500
        assert cloud.requests() == before
        bad = _ask(gw, gw.key, "hi", **{"x-switchyard-data-boundary": "cloud"})
        assert (
            bad.status_code == 400 and bad.json()["error"]["param"] == "x-switchyard-data-boundary"
        )
    finally:
        gw.proc.stop()


def test_reported_device_state_and_network_move_work(two: tuple[Scripted, Scripted]) -> None:
    gw = _gateway(two, degraded_max_tokens=2)
    try:
        tenant = "t-dev"
        gw.create_tenant(tenant)
        reporter = gw.create_key(tenant, may_report_device_state=True)["key"]
        hot = {"x-switchyard-device-state": "temp_c=91, battery=80, charging=true"}
        # A key that may not report: its header is ignored (and said to be).
        r = _ask(gw, gw.key, **hot)
        assert _place(gw, r)["evidence"]["ignored_headers"] == ["device-state"]
        r = _ask(gw, reporter, **hot)
        assert r.headers["x-switchyard-placement"] == "remote; reason=thermal", r.headers
        assert r.headers["x-switchyard-upstream"] == "assist/cloud"
        d = next(
            d
            for d in gw.trace(r.headers["x-request-id"])["decisions"]
            if d["outcome"] == "enter:thermal"
        )
        assert d["evidence"]["value"] == 91.0
        # Hot and private: degraded on the device, its output capped.
        r = _ask(gw, reporter, "call +1 415 555 0100", **hot)
        assert r.headers["x-switchyard-placement"] == "degraded; reason=privacy"
        assert _place(gw, r)["evidence"]["max_tokens"] == 2
        # Cooler, but a terrible network: the device.
        cool = {"x-switchyard-device-state": "temp_c=60, battery=80, charging=true"}
        _ask(gw, reporter, **cool)  # the thermal condition ends (dwell 0)
        r = _ask(gw, reporter, **cool, **{"x-switchyard-network": "rtt_ms=5000, uplink_kbps=10"})
        assert r.headers["x-switchyard-upstream"] == "assist/dev", _place(gw, r)
        assert _place(gw, r)["evidence"]["reason"] in ("network", "deadline")
        metrics = httpx.get(gw.url + "/metrics", headers=gw.admin).text
        assert (
            'switchyard_placements_total{mode="remote",model="assist",reason="thermal"}' in metrics
        )
        assert (
            'switchyard_placement_mode_changes_total{condition="thermal",model="assist",to="active"}'
            in metrics
        )
    finally:
        gw.proc.stop()
