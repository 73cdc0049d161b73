"""Edge or cloud, per request (models[].placement): among an alias's deployments on the
device and in the cloud, where this request runs, and why.

Order (decide/stages_select.py, Select): the balancer's eligibility filter (ready, breaker,
capacity, region) gives the candidates at each location; placement chooses the
location (or degrades the request on the device); balancing then picks within it.

The rules, first match wins:

1. **privacy**: PII found by the pii stage (`pii_stays_local`) or the request's
   `x-switchyard-data-boundary: device` keeps it on the device, degraded when the device
   is stressed; with no device deployment able to serve it, it is refused (503
   `placement_refused`), never sent to the cloud. Failover and fallbacks keep to the
   device too (execute/executor.py).
2. **available**: only one location has an eligible deployment.
3. **probe**: a location never measured gets this request; one whose measurements
   are older than `stale_s` gets a `probe` share of requests (so an estimate follows
   what a location can do now, not what it did when it was last chosen).
4. **thermal / battery / memory**: a device condition is active (hysteresis: it starts
   at `enter`, ends past `exit` after `min_dwell_s`): the cloud when its estimate
   meets the deadline, else the device, degraded (`degraded_deployment`,
   `degraded_max_tokens`).
5. **quality**: the router's route is one of `cloud_routes` and the cloud meets the
   deadline.
6. **deadline**: only one location's estimate meets the request's remaining time.
7. **network** (both meet it, or neither): the lower estimate; **cost** when the
   estimates tie (the device: no per-token price).

Estimates are end-to-end milliseconds for the request's expected output: per location,
the best eligible deployment's time to first token plus per-token time x tokens (the
balancer's EWMAs of measured requests, or the policy's priors before any), plus, for
the cloud when the client reports its network (`x-switchyard-network: rtt_ms=…,
uplink_kbps=…`), the round trip and the upload of the request's bytes.

Device state: `x-switchyard-device-state: temp_c=…, battery=…, charging=…,
memory_pct=…` from a key allowed to report it (`may_report_device_state`), else the
gateway's own sensors (psutil: CPU temperature, battery, memory use), each one that
is missing said to be missing. The conditions' state is per alias: the device is the
one the gateway runs on, or the one its reporting client runs on.
"""

from __future__ import annotations

import random
import re
import time
from dataclasses import dataclass
from typing import Any

from switchyard.config import Hysteresis, PlacementConfig
from switchyard.engines.registry import Deployment
from switchyard.errors import InvalidRequest
from switchyard.outcomes import Place

MAX_HEADER = 256
_FIELD = re.compile(r"^\s*([a-z_]{1,16})\s*=\s*([0-9A-Za-z.+-]{1,16})\s*$")
# (name in the header, attribute, lowest, highest)
_DEVICE_FIELDS = {
    "temp_c": (-50.0, 150.0),
    "battery": (0.0, 100.0),
    "memory_pct": (0.0, 100.0),
}
_NETWORK_FIELDS = {"rtt_ms": (0.0, 600_000.0), "uplink_kbps": (1.0, 100_000_000.0)}


@dataclass(frozen=True, slots=True)
class DeviceState:
    temp_c: float | None = None
    battery: float | None = None
    charging: bool | None = None
    memory_pct: float | None = None
    source: str = "none"  # header | sensors | none

    def evidence(self) -> dict[str, Any]:
        out: dict[str, Any] = {"source": self.source}
        missing = []
        for name in ("temp_c", "battery", "charging", "memory_pct"):
            value = getattr(self, name)
            if value is None:
                missing.append(name)
            else:
                out[name] = value
        if missing:
            out["missing"] = missing
        return out


@dataclass(frozen=True, slots=True)
class Network:
    rtt_ms: float
    uplink_kbps: float

    def cost_ms(self, nbytes: int) -> float:
        return self.rtt_ms + nbytes * 8.0 / self.uplink_kbps  # kbit/s = bit/ms


def _pairs(header: str, value: str, fields: set[str]) -> dict[str, str]:
    if len(value) > MAX_HEADER:
        raise InvalidRequest(f"header {header}: at most {MAX_HEADER} characters", param=header)
    out: dict[str, str] = {}
    for part in value.split(","):
        if not part.strip():
            continue
        m = _FIELD.match(part)
        if m is None or m.group(1) not in fields or m.group(1) in out:
            raise InvalidRequest(
                f"header {header}: expected comma-separated name=value of {sorted(fields)}",
                param=header,
            )
        out[m.group(1)] = m.group(2)
    return out


def _number(header: str, name: str, raw: str, lo: float, hi: float) -> float:
    try:
        v = float(raw)
    except ValueError:
        v = float("nan")
    if not lo <= v <= hi:  # NaN fails too
        raise InvalidRequest(f"header {header}: {name} must be in [{lo:g}, {hi:g}]", param=header)
    return v


def parse_device_state(value: str) -> DeviceState:
    """`x-switchyard-device-state`, validated and bounded (400 naming the header)."""
    h = "x-switchyard-device-state"
    got = _pairs(h, value, {*_DEVICE_FIELDS, "charging"})
    nums = {n: _number(h, n, got[n], *_DEVICE_FIELDS[n]) for n in _DEVICE_FIELDS if n in got}
    charging = None
    if "charging" in got:
        if got["charging"].lower() not in ("true", "false", "1", "0"):
            raise InvalidRequest(f"header {h}: charging must be true or false", param=h)
        charging = got["charging"].lower() in ("true", "1")
    return DeviceState(
        nums.get("temp_c"), nums.get("battery"), charging, nums.get("memory_pct"), "header"
    )


def parse_network(value: str) -> Network:
    """`x-switchyard-network: rtt_ms=…, uplink_kbps=…` (both), validated and bounded."""
    h = "x-switchyard-network"
    got = _pairs(h, value, set(_NETWORK_FIELDS))
    if set(got) != set(_NETWORK_FIELDS):
        raise InvalidRequest(f"header {h}: give both rtt_ms and uplink_kbps", param=h)
    return Network(*(_number(h, n, got[n], *_NETWORK_FIELDS[n]) for n in _NETWORK_FIELDS))


_SENSORS_S = 1.0  # the gateway's own sensors are read at most this often
_sensed: list[Any] = [0.0, DeviceState()]


def read_sensors(now: float | None = None) -> DeviceState:
    """The gateway's own device, from psutil (what the platform has; cached 1 s)."""
    now = time.monotonic() if now is None else now
    if now - _sensed[0] < _SENSORS_S:
        return _sensed[1]
    import psutil

    temp = battery = None
    charging = None
    try:
        temps = psutil.sensors_temperatures() if hasattr(psutil, "sensors_temperatures") else {}
        readings = [t.current for entries in temps.values() for t in entries if t.current]
        temp = max(readings) if readings else None
    except (OSError, AttributeError):
        temp = None
    try:
        b = psutil.sensors_battery() if hasattr(psutil, "sensors_battery") else None
        if b is not None:
            battery, charging = float(b.percent), bool(b.power_plugged)
    except (OSError, AttributeError):
        pass
    state = DeviceState(temp, battery, charging, float(psutil.virtual_memory().percent), "sensors")
    _sensed[:] = [now, state]
    return state


@dataclass(slots=True)
class _Condition:
    name: str  # thermal | battery | memory
    limits: Hysteresis
    low_is_bad: bool
    active: bool = False
    since: float = 0.0  # when it last changed
    past_exit_since: float | None = None  # when the reading went past `exit`

    def update(self, value: float | None, charging: bool | None, now: float, dwell: float) -> bool:
        """Feed a reading; True when the condition changed (entered or ended)."""
        if value is None:
            return False
        if self.low_is_bad and charging:
            value = 100.0  # a charging device has no battery problem
        enter = value <= self.limits.enter if self.low_is_bad else value >= self.limits.enter
        past_exit = value > self.limits.exit if self.low_is_bad else value < self.limits.exit
        if not self.active:
            if enter and now - self.since >= dwell:
                self.active, self.since, self.past_exit_since = True, now, None
                return True
            return False
        if not past_exit:
            self.past_exit_since = None
            return False
        if self.past_exit_since is None:
            self.past_exit_since = now
        if now - self.past_exit_since >= dwell and now - self.since >= dwell:
            self.active, self.since, self.past_exit_since = False, now, None
            return True
        return False


@dataclass(slots=True)
class Placement:
    mode: Place  # LOCAL | REMOTE | DEGRADED | REFUSED (the place decision's outcome)
    location: str  # device | cloud
    # privacy | available | probe | thermal | battery | memory | quality | deadline |
    # network | cost
    reason: str
    why: str
    evidence: dict[str, Any]
    only: str | None = None  # the degraded deployment, when configured
    max_tokens: int | None = None  # the degraded cap, when configured
    stay: bool = False  # privacy: failover and fallbacks keep to the device too
    estimate_ms: float | None = None  # the chosen location's, for the error metric


@dataclass(slots=True)
class Change:
    condition: str
    active: bool
    value: float | None


class Placer:
    """One alias's placement policy and its device conditions' state."""

    def __init__(self, alias: str, cfg: PlacementConfig, rng: random.Random | None = None) -> None:
        self.alias = alias
        self.cfg = cfg
        self.rng = rng or random.Random()
        self.conditions = [
            _Condition("thermal", cfg.thermal_c, False),
            _Condition("battery", cfg.battery_pct, True),
            _Condition("memory", cfg.memory_pct, False),
        ]

    def observe(self, state: DeviceState, now: float) -> list[Change]:
        """Feed the device state to the conditions; the changes it caused."""
        out = []
        values = {"thermal": state.temp_c, "battery": state.battery, "memory": state.memory_pct}
        for c in self.conditions:
            v = values[c.name]
            if c.update(v, state.charging, now, self.cfg.min_dwell_s):
                out.append(Change(c.name, c.active, v))
        return out

    def stressed(self) -> list[str]:
        return [c.name for c in self.conditions if c.active]

    def estimate_ms(self, deps: list[Deployment], tokens: int, net_ms: float = 0.0) -> float:
        """The best of `deps`: EWMA (or prior) TTFT + per-token time x tokens, + net."""
        best = None
        for d in deps:
            live = d.live
            ttft = live.ttft_s * 1000.0 if live.ttft_s is not None else self.cfg.prior_ttft_ms
            if live.tpot_s is not None:
                tpot = live.tpot_s * 1000.0
            elif live.ttft_s is not None:
                tpot = 0.0  # measured on whole (non-streamed) replies: TTFT is all of it
            else:
                tpot = self.cfg.prior_tpot_ms
            e = ttft + tpot * tokens
            best = e if best is None or e < best else best
        return (best if best is not None else 0.0) + net_ms

    def decide(
        self,
        *,
        device: list[Deployment],
        cloud: list[Deployment],
        private: str | None,
        state: DeviceState,
        network: Network | None,
        nbytes: int,
        tokens: int,
        remaining_ms: float,
        route: str | None,
        now: float | None = None,
    ) -> Placement | None:
        """Where the request runs; None when no deployment is eligible anywhere (the
        balancer's fallback rules apply, as without placement)."""
        cfg = self.cfg
        stressed = self.stressed()
        ev: dict[str, Any] = {
            "device": state.evidence(),
            "conditions": stressed,
            "candidates": {"device": [d.name for d in device], "cloud": [d.name for d in cloud]},
            "deadline_ms": round(remaining_ms, 1),
            "tokens": tokens,
        }
        net_ms = network.cost_ms(nbytes) if network is not None else 0.0
        if network is not None:
            ev["network"] = {
                "rtt_ms": network.rtt_ms,
                "uplink_kbps": network.uplink_kbps,
                "upload_ms": round(net_ms - network.rtt_ms, 2),
            }
        est_dev = self.estimate_ms(device, tokens) if device else None
        est_cloud = self.estimate_ms(cloud, tokens, net_ms) if cloud else None
        ev["estimate_ms"] = {
            "device": None if est_dev is None else round(est_dev, 1),
            "cloud": None if est_cloud is None else round(est_cloud, 1),
        }

        def local(reason: str, why: str, degrade: bool = False, stay: bool = False) -> Placement:
            if degrade:
                only = cfg.degraded_deployment
                if only is not None and not any(d.name.endswith("/" + only) for d in device):
                    only = None  # not eligible now: the others, with the token cap
                alias_only = f"{self.alias}/{only}" if only is not None else None
                return Placement(
                    Place.DEGRADED, "device", reason, why, ev, alias_only, cfg.degraded_max_tokens,
                    stay, est_dev,
                )  # fmt: skip
            return Placement(Place.LOCAL, "device", reason, why, ev, stay=stay, estimate_ms=est_dev)

        def remote(reason: str, why: str) -> Placement:
            return Placement(Place.REMOTE, "cloud", reason, why, ev, estimate_ms=est_cloud)

        if private is not None:
            ev["private"] = private
            if not device:
                return Placement(Place.REFUSED, "device", "privacy", private, ev, stay=True)
            if stressed:
                return local(
                    "privacy",
                    f"{private}: kept on the device, degraded ({', '.join(stressed)})",
                    degrade=True,
                    stay=True,
                )
            return local("privacy", f"{private}: kept on the device", stay=True)
        if not device and not cloud:
            return None
        if not device:
            return remote("available", "no device deployment can serve it now")
        if not cloud:
            if stressed:
                return local(stressed[0], f"only the device can serve it; {stressed[0]}", True)
            return local("available", "no cloud deployment can serve it now")
        assert est_dev is not None and est_cloud is not None
        now = time.monotonic() if now is None else now
        for loc, deps in (("cloud", cloud), ("device", device)):
            if all(d.live.ttft_s is None for d in deps):
                why = f"the {loc} has not been measured yet: this request measures it"
                return remote("probe", why) if loc == "cloud" else local("probe", why)
            stale = all(now - d.live.last_sample > cfg.stale_s for d in deps)
            if stale and self.rng.random() < cfg.probe:
                why = f"the {loc}'s estimate is older than {cfg.stale_s:g}s: a probe"
                return remote("probe", why) if loc == "cloud" else local("probe", why)
        cloud_fits = est_cloud <= remaining_ms
        dev_fits = est_dev <= remaining_ms
        if stressed:
            if cloud_fits:
                return remote(stressed[0], f"the device is under {stressed[0]} stress")
            return local(
                stressed[0],
                f"the device is under {stressed[0]} stress and the cloud misses the deadline",
                degrade=True,
            )
        if route is not None and route in cfg.cloud_routes and cloud_fits:
            return remote("quality", f"route {route!r} prefers the cloud")
        if dev_fits != cloud_fits:
            if dev_fits:
                return local("deadline", "only the device meets the deadline")
            return remote("deadline", "only the cloud meets the deadline")
        if est_dev == est_cloud:
            return local("cost", "the estimates tie; the device has no per-token price")
        if est_dev < est_cloud:
            return local("network", f"device {est_dev:.0f} ms < cloud {est_cloud:.0f} ms")
        return remote("network", f"cloud {est_cloud:.0f} ms < device {est_dev:.0f} ms")
