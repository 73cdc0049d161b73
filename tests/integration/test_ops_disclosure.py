"""What the operator's surfaces tell someone without the admin key (issue #41, finding 9).

A real gateway over real sockets with a scripted upstream: /metrics answers the admin
key only (unless observe.metrics_public), its tenant label can be a keyed hash or off,
/readyz shows states to everyone and addresses to the admin, `x-switchyard-upstream`
names the deployment and never its URL, and console logins are throttled per address.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import re
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from support.gateways import ADMIN_KEY, Gateway, cheap_config, start_gateway
from support.upstreams import Scripted
from switchyard.api.console import LoginThrottle
from switchyard.config import ConfigError, parse_settings
from switchyard.observe.metrics import hashed_tenant, tenant_key

SECRET_TENANT = "acme-secret-customer"
CHAT = {"model": "cheap", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}


def _config(scripted: Scripted, **observe: Any) -> dict[str, Any]:
    pair = {
        "alias": "pair",
        "deployments": [
            {"name": name, "engine": {"kind": "openai", "base_url": scripted.url + "/v1"}}
            for name in ("east", "west")
        ],
    }
    return cheap_config(scripted, pair, observe=observe)


@contextlib.contextmanager
def _gateway(scripted: Scripted, **observe: Any) -> Iterator[Gateway]:
    """A gateway of its own for one test (its observe settings, or a fresh throttle)."""
    g = start_gateway(_config(scripted, **observe))
    try:
        yield g
    finally:
        g.proc.stop()


def _spend(gw: Gateway, tenant: str, model: str = "cheap") -> httpx.Response:
    """One paid request as `tenant` (created here), so /metrics has its series."""
    gw.create_tenant(tenant)
    key = gw.create_key(tenant)["key"]
    r = gw.post("/v1/chat/completions", key=key, json={**CHAT, "model": model})
    assert r.status_code == 200, r.text
    return r


def _metrics(gw: Gateway) -> str:
    r = httpx.get(gw.url + "/metrics", headers=gw.admin)
    assert r.status_code == 200, r.text
    return r.text


@pytest.fixture(scope="module")
def gw(scripted: Scripted) -> Iterator[Gateway]:
    g = start_gateway(_config(scripted))
    yield g
    g.proc.stop()


# -- /metrics ----------------------------------------------------------------------------


def test_metrics_refuse_a_missing_or_wrong_key_with_an_openai_error(gw: Gateway) -> None:
    _spend(gw, SECRET_TENANT)
    for headers in ({}, {"Authorization": "Bearer not-the-admin-key"}, {"Authorization": "x"}):
        r = httpx.get(gw.url + "/metrics", headers=headers)
        assert r.status_code == 401, (headers, r.text)
        assert r.json()["error"]["type"] == "authentication_error"
        assert SECRET_TENANT not in r.text and "switchyard_" not in r.text
    # A tenant's own API key is not the admin key either.
    r = httpx.get(gw.url + "/metrics", headers=gw.auth)
    assert r.status_code == 401


def test_metrics_answer_the_admin_key_with_tenant_ids_by_default(gw: Gateway) -> None:
    _spend(gw, SECRET_TENANT + "-2")
    text = _metrics(gw)
    assert f'tenant="{SECRET_TENANT}-2"' in text
    assert re.search(rf'switchyard_cost_usd_total{{.*tenant="{SECRET_TENANT}-2"', text)


def test_metrics_public_serves_everyone(scripted: Scripted) -> None:
    with _gateway(scripted, metrics_public=True) as g:
        _spend(g, SECRET_TENANT)
        r = httpx.get(g.url + "/metrics")
        assert r.status_code == 200 and f'tenant="{SECRET_TENANT}"' in r.text


def test_hashed_tenant_label_hides_the_id_and_the_admin_can_map_it(scripted: Scripted) -> None:
    with _gateway(scripted, metrics_tenant_label="hashed") as g:
        _spend(g, SECRET_TENANT)
        _spend(g, "other-customer")
        text = _metrics(g)
        assert SECRET_TENANT not in text and "other-customer" not in text
        label = hashed_tenant(ADMIN_KEY.encode(), SECRET_TENANT)  # keyed by the admin key
        assert re.fullmatch(r"t_[0-9a-f]{12}", label)
        assert re.search(
            rf'switchyard_requests_total{{model="cheap",status="ok",tenant="{label}"}} 1\.0', text
        ), text
        assert re.search(rf'switchyard_cost_usd_total{{model="cheap",tenant="{label}"}}', text)
        # A plain hash of the guessed id is not the label: guessing needs the key.
        import hashlib

        assert hashlib.sha256(SECRET_TENANT.encode()).hexdigest()[:12] not in text
        # The admin finds the series from the tenant list.
        tenants = httpx.get(g.url + "/admin/tenants", headers=g.admin).json()["data"]
        mine = next(t for t in tenants if t["id"] == SECRET_TENANT)
        assert mine["metrics_label"] == label
        other = next(t for t in tenants if t["id"] == "other-customer")
        assert other["metrics_label"] != label


def test_tenant_label_off_aggregates_every_tenant(scripted: Scripted) -> None:
    with _gateway(scripted, metrics_tenant_label="off") as g:
        _spend(g, SECRET_TENANT)
        _spend(g, "other-customer")
        text = _metrics(g)
        assert "tenant=" not in text and SECRET_TENANT not in text
        assert re.search(r'^switchyard_requests_total{model="cheap",status="ok"} 2\.0$', text, re.M)
        assert re.search(r'^switchyard_cost_usd_total{model="cheap"} ', text, re.M)


def test_hashed_label_without_any_key_refuses_to_start(monkeypatch: pytest.MonkeyPatch) -> None:
    model = {"alias": "m", "engine": {"kind": "openai", "base_url": "http://x/v1"}}
    settings = parse_settings(
        {"models": [model], "observe": {"metrics_tenant_label": "hashed"}}, "test"
    )
    monkeypatch.delenv(settings.auth.admin_key_env, raising=False)
    monkeypatch.delenv(settings.observe.metrics_tenant_key_env, raising=False)
    with pytest.raises(ConfigError, match="metrics_tenant_label"):
        tenant_key(settings)
    monkeypatch.setenv(settings.observe.metrics_tenant_key_env, "k1")
    assert tenant_key(settings) == b"k1"  # its own key wins over the admin key
    monkeypatch.setenv(settings.auth.admin_key_env, "admin")
    assert tenant_key(settings) == b"k1"


# -- /readyz and the upstream header -----------------------------------------------------


def test_readyz_shows_states_to_everyone_and_addresses_to_the_admin(
    gw: Gateway, scripted: Scripted
) -> None:
    anon = httpx.get(gw.url + "/readyz")
    assert anon.status_code == 200
    assert scripted.url not in anon.text and "127.0.0.1" not in anon.text
    models = anon.json()["models"]
    assert models["cheap"]["ready"] is True and models["cheap"]["state"] == "external"
    assert "upstream" not in models["cheap"]
    assert models["pair"]["deployments"]["east"]["ready"] is True
    assert "upstream" not in models["pair"]["deployments"]["east"]
    wrong = httpx.get(gw.url + "/readyz", headers={"Authorization": "Bearer nope"})
    assert wrong.status_code == 200 and scripted.url not in wrong.text
    admin = httpx.get(gw.url + "/readyz", headers=gw.admin).json()["models"]
    assert admin["cheap"]["upstream"] == scripted.url + "/v1"
    assert admin["pair"]["deployments"]["east"]["upstream"] == scripted.url + "/v1"


def test_upstream_header_names_the_deployment_not_its_url(gw: Gateway, scripted: Scripted) -> None:
    one = _spend(gw, "hdr-" + os.urandom(3).hex())
    assert one.headers["x-switchyard-upstream"] == "cheap"
    two = _spend(gw, "hdr-" + os.urandom(3).hex(), model="pair")
    assert two.headers["x-switchyard-upstream"] in ("pair/east", "pair/west")
    for r in (one, two):
        assert scripted.url not in str(r.headers) and "://" not in str(r.headers)
    # The operator still sees the address, in the trace.
    trace = gw.trace(one.headers["x-request-id"])
    assert trace["upstream"] == scripted.url + "/v1"


# -- console login throttling ------------------------------------------------------------


def _login(gw: Gateway, key: str, source: str = "127.0.0.1") -> httpx.Response:
    transport = httpx.HTTPTransport(local_address=source)
    with httpx.Client(transport=transport) as c:
        return c.post(gw.url + "/console/login", data={"admin_key": key})


def test_the_eleventh_wrong_login_in_a_minute_is_429(scripted: Scripted) -> None:
    with _gateway(scripted) as g:
        codes = [_login(g, f"guess-{i}").status_code for i in range(10)]
        assert codes == [401] * 10
        eleventh = _login(g, "guess-10")
        assert eleventh.status_code == 429
        assert 1 <= int(eleventh.headers["retry-after"]) <= 60
        # The same address waits out the window even with the right key: while it is
        # throttled nothing it sends is checked (no oracle for a lucky guess).
        assert _login(g, ADMIN_KEY).status_code == 429
        # Another address (the operator's) logs in meanwhile.
        ok = _login(g, ADMIN_KEY, source="127.0.0.2")
        assert ok.status_code == 303 and "sy_console=" in ok.headers["set-cookie"]
        # Each failure is logged at WARNING with the address, never the key.
        log = g.proc.output()
        assert log.count("WARNING switchyard.console: console login with a wrong admin key") == 10
        assert "from 127.0.0.1" in log and "guess-" not in log


def test_concurrent_wrong_logins_cannot_pass_the_limit(scripted: Scripted) -> None:
    with _gateway(scripted) as g:
        with concurrent.futures.ThreadPoolExecutor(16) as ex:
            codes = list(ex.map(lambda i: _login(g, f"burst-{i}").status_code, range(40)))
        assert codes.count(401) == 10 and codes.count(429) == 30, codes


def test_throttle_frees_as_the_window_slides() -> None:
    t = LoginThrottle(limit=3, window_s=60.0)
    for now in (0.0, 10.0, 20.0):
        assert t.retry_after("a", now) is None
        t.failed("a", now)
    assert t.retry_after("a", 20.5) == 40  # until the failure at 0 s is a minute old
    assert t.retry_after("b", 20.5) is None  # per address
    assert t.retry_after("a", 60.0) is None  # one slot free again: one more try
    t.failed("a", 60.0)
    assert t.retry_after("a", 60.0) == 10  # the failure at 10 s leaves at 70 s
    t.succeeded("a")
    assert t.retry_after("a", 60.0) is None


def test_throttle_table_stays_bounded_under_many_addresses() -> None:
    t = LoginThrottle(limit=2, window_s=60.0, max_addresses=100)
    for i in range(1000):
        t.failed(f"10.0.{i // 256}.{i % 256}", float(i) / 100)
    assert len(t._failures) <= 100
    t.failed("victim", 20.0)
    t.failed("victim", 20.0)
    assert t.retry_after("victim", 20.0) == 60
