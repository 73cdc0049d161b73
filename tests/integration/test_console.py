"""The operators' console at /console, in a real headless Chromium (Debian's `chromium`
driven through its matching `chromium-driver` by Selenium), against a real gateway.

Each page's screenshot is saved under build/console-screenshots/.
"""

from __future__ import annotations

import concurrent.futures
import re
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webdriver import WebDriver
from selenium.webdriver.support.ui import Select

from support.browser import WAIT_S, chromium, until
from support.gateways import ADMIN_KEY, Gateway, local_model, start_gateway
from support.paths import REPO
from support.upstreams import Scripted, start_scripted

SHOTS = REPO / "build" / "console-screenshots"
BODY: dict[str, Any] = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}


@pytest.fixture(scope="module")
def upstreams() -> Iterator[tuple[Scripted, Scripted]]:
    fast_proc, fast = start_scripted("--fault", "delay:50")
    slow_proc, slow = start_scripted("--fault", "delay:300")
    yield fast, slow
    fast_proc.stop()
    slow_proc.stop()


@pytest.fixture(scope="module")
def gw(upstreams: tuple[Scripted, Scripted]) -> Iterator[Gateway]:
    fast, slow = upstreams
    g = start_gateway(
        {
            "models": [
                {"alias": "fast", "engine": {"kind": "openai", "base_url": fast.url + "/v1"}},
                {"alias": "slow", "engine": {"kind": "openai", "base_url": slow.url + "/v1"}},
                local_model(),  # a resident engine for the live page (never called)
            ],
            "embeddings": {"enabled": False},
            # Exact cache for temperature-0 requests only: the other tests' calls (no
            # temperature, so 1.0) always reach their upstream.
            "cache": {"enabled": True, "semantic": False, "max_temperature": 0.0},
            "cost": {
                "instance_usd_per_hour": 0.4,
                "ops_usd_per_month": 50,
                "managed": {"input": 0.5, "output": 1.5},
            },
        }
    )
    yield g
    g.proc.stop()


@pytest.fixture(scope="module")
def browser() -> Iterator[WebDriver]:
    driver = chromium("--window-size=1400,1000")
    SHOTS.mkdir(parents=True, exist_ok=True)
    yield driver
    driver.quit()


_until = until


def _shot(driver: WebDriver, name: str) -> None:
    assert driver.save_screenshot(str(SHOTS / f"{name}.png"))


def _rendered(driver: WebDriver) -> None:
    """The page script has replaced the placeholder (or shown an error: fail on it)."""
    _until(driver, lambda d: d.find_element(By.ID, "content").text != "Loading…")
    errors = driver.find_elements(By.ID, "error")
    assert not errors, errors[0].text


def _login(driver: WebDriver, gw: Gateway, key: str = ADMIN_KEY) -> None:
    driver.get(gw.url + "/console/login")
    driver.find_element(By.ID, "admin-key").send_keys(key)
    driver.find_element(By.ID, "login").click()


def _logged_in(driver: WebDriver, gw: Gateway) -> None:
    driver.get(gw.url + "/console/requests")
    if "/console/login" in driver.current_url:
        _login(driver, gw)
        _until(driver, lambda d: d.current_url.endswith("/console/requests"))


def _chat(gw: Gateway, model: str, key: str | None = None, **headers: str) -> httpx.Response:
    h = {"Authorization": f"Bearer {key or gw.key}", **headers}
    return httpx.post(
        gw.url + "/v1/chat/completions", json={**BODY, "model": model}, headers=h, timeout=30
    )


def _cookie_session(gw: Gateway) -> tuple[httpx.Client, str]:
    """A client holding a console session (logged in through the form) and the CSRF
    token its pages carry."""
    client = httpx.Client(base_url=gw.url, timeout=30)
    r = client.post("/console/login", data={"admin_key": ADMIN_KEY})
    assert r.status_code == 303 and r.headers["location"] == "/console/requests"
    page = client.get("/console/requests")
    assert page.status_code == 200
    m = re.search(r'<meta name="csrf-token" content="([^"]+)">', page.text)
    assert m is not None
    return client, m.group(1)


# -- logging in --------------------------------------------------------------------------


def test_wrong_admin_key_cannot_log_in(browser: WebDriver, gw: Gateway) -> None:
    browser.delete_all_cookies()
    browser.get(gw.url + "/console/tenants")
    assert browser.current_url.endswith("/console/login")  # no session: the login form
    _login(browser, gw, key="not-the-admin-key")
    message = _until(browser, lambda d: d.find_element(By.ID, "login-error"))
    assert message.text == "wrong admin key"
    assert browser.get_cookie("sy_console") is None
    _shot(browser, "login-refused")
    browser.get(gw.url + "/console/tenants")
    assert browser.current_url.endswith("/console/login")


def test_session_cookie_attributes_and_no_key_in_pages(gw: Gateway) -> None:
    r = httpx.post(gw.url + "/console/login", data={"admin_key": ADMIN_KEY})
    assert r.status_code == 303
    cookie = r.headers["set-cookie"]
    assert cookie.startswith("sy_console=")
    for attr in ("HttpOnly", "SameSite=Strict", "Path=/", "Max-Age=28800"):
        assert attr in cookie
    assert "Secure" not in cookie  # plain HTTP here; over HTTPS the cookie is Secure
    assert ADMIN_KEY not in cookie and ADMIN_KEY not in r.headers.get("location", "")
    session = httpx.Client(base_url=gw.url, cookies=r.cookies)
    page = session.get("/console/requests")
    assert ADMIN_KEY not in page.text
    assert "default-src 'none'" in page.headers["content-security-policy"]
    assert page.headers["x-frame-options"] == "DENY"
    # A login body over its bound is refused before it is parsed.
    big = httpx.post(gw.url + "/console/login", content=b"admin_key=" + b"x" * 10_000)
    assert big.status_code == 413


# -- requests and their traces -------------------------------------------------------------


def test_request_appears_and_its_trace_shows_decisions(browser: WebDriver, gw: Gateway) -> None:
    r = _chat(gw, "fast", **{"x-client-request-id": "console-req-1"})
    assert r.status_code == 200
    rid = r.headers["x-request-id"]
    trace = gw.trace(rid)
    _logged_in(browser, gw)
    _rendered(browser)
    _until(browser, lambda d: rid in d.find_element(By.ID, "requests-table").text)
    _shot(browser, "requests")
    links = browser.find_elements(By.CSS_SELECTOR, "#requests-table a.request-link")
    target = next(a for a in links if a.text == rid)
    target.click()
    _until(browser, lambda d: d.find_elements(By.CSS_SELECTOR, "#decisions .decision"))
    _rendered(browser)
    stages = [
        e.get_attribute("data-stage")
        for e in browser.find_elements(By.CSS_SELECTOR, "#decisions .decision")
    ]
    assert stages == [d["stage"] for d in trace["decisions"]] and "route" in stages
    summary = browser.find_element(By.ID, "summary").text
    assert "fast" in summary and trace["upstream"] in summary
    assert browser.find_elements(By.CSS_SELECTOR, "#timings .bar-row")
    _shot(browser, "request")


def test_requests_filter_by_model(browser: WebDriver, gw: Gateway) -> None:
    slow_id = _chat(gw, "slow").headers["x-request-id"]
    fast_id = _chat(gw, "fast").headers["x-request-id"]
    gw.trace(slow_id)
    gw.trace(fast_id)
    _logged_in(browser, gw)
    browser.get(gw.url + "/console/requests?model=slow")
    _rendered(browser)
    table = _until(browser, lambda d: d.find_element(By.ID, "requests-table"))
    assert slow_id in table.text and fast_id not in table.text


def test_unknown_request_id_says_so(browser: WebDriver, gw: Gateway) -> None:
    _logged_in(browser, gw)
    browser.get(gw.url + "/console/requests/no-such-request")
    _until(browser, lambda d: d.find_element(By.ID, "no-trace"))


# -- tasks -------------------------------------------------------------------------------


def test_task_page_highlights_the_critical_path(browser: WebDriver, gw: Gateway) -> None:
    """A -> (B fast, C slow) -> D: the critical path is A, C, D."""
    task = "console-diamond"
    ids: dict[str, str] = {}

    def call(model: str, name: str, parents: list[str]) -> None:
        h = {"x-task-id": task, "x-task-planned-steps": "4"}
        if parents:
            h["x-parent-request-id"] = ",".join(ids[p] for p in parents)
        r = _chat(gw, model, **h)
        assert r.status_code == 200
        ids[name] = r.headers["x-request-id"]

    call("fast", "A", [])
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        list(pool.map(lambda a: call(*a), [("fast", "B", ["A"]), ("slow", "C", ["A"])]))
    call("fast", "D", ["B", "C"])
    for rid in ids.values():
        gw.trace(rid)
    _logged_in(browser, gw)
    browser.get(gw.url + "/console/tasks")
    _rendered(browser)
    link = _until(
        browser,
        lambda d: next(
            (
                a
                for a in d.find_elements(By.CSS_SELECTOR, "#tasks-table a.task-link")
                if a.text == task
            ),
            None,
        ),
    )
    _shot(browser, "tasks")
    link.click()
    _until(browser, lambda d: len(d.find_elements(By.CSS_SELECTOR, "#waterfall .bar-row")) == 4)
    _rendered(browser)
    critical = {
        e.get_attribute("data-id")
        for e in browser.find_elements(By.CSS_SELECTOR, "#waterfall .bar-row.critical")
    }
    assert critical == {ids["A"], ids["C"], ids["D"]}
    # Red, as the legend says, and the other step is not.
    rows = {
        e.get_attribute("data-id"): e
        for e in browser.find_elements(By.CSS_SELECTOR, "#waterfall .bar-row")
    }
    red = (
        rows[ids["C"]]
        .find_element(By.CSS_SELECTOR, ".bar")
        .value_of_css_property("background-color")
    )
    plain = (
        rows[ids["B"]]
        .find_element(By.CSS_SELECTOR, ".bar")
        .value_of_css_property("background-color")
    )
    assert red != plain
    assert "4 / 4" in browser.find_element(By.ID, "task-tiles").text
    _shot(browser, "task")


# -- tenants and keys ------------------------------------------------------------------


def test_key_created_in_console_works_and_revoked_gets_401(browser: WebDriver, gw: Gateway) -> None:
    tenant = "console-tenant"
    gw.create_tenant(tenant)
    _logged_in(browser, gw)
    browser.get(gw.url + "/console/tenants")
    _rendered(browser)
    # A key name is client text: it must show as text, never as markup.
    name = '<img src=x id=injected onerror="document.title=1">'
    Select(browser.find_element(By.ID, "f-key-tenant")).select_by_value(tenant)
    browser.find_element(By.ID, "f-name").send_keys(name)
    browser.find_element(By.ID, "create-key-btn").click()
    key = _until(browser, lambda d: d.find_element(By.ID, "new-key").text)
    assert key.startswith("sk-")
    assert browser.find_elements(By.ID, "injected") == []
    assert name in browser.find_element(By.ID, "keys-table").text
    _shot(browser, "tenants")

    assert _chat(gw, "fast", key=key).status_code == 200
    listed = httpx.get(gw.url + "/admin/keys", headers=gw.admin).json()["data"]
    key_id = next(k["id"] for k in listed if k["name"] == name)
    button = browser.find_element(By.CSS_SELECTOR, f'button.revoke[data-key-id="{key_id}"]')
    button.click()
    alert = _until(browser, lambda d: d.switch_to.alert)
    assert key_id in alert.text
    alert.accept()
    _until(
        browser,
        lambda d: not d.find_elements(By.CSS_SELECTOR, f'button.revoke[data-key-id="{key_id}"]'),
    )
    refused = _chat(gw, "fast", key=key)
    assert refused.status_code == 401
    assert refused.json()["error"]["code"] == "invalid_api_key"


def test_dismissed_revoke_changes_nothing(browser: WebDriver, gw: Gateway) -> None:
    made = gw.create_key(gw.create_tenant("console-keep")["id"], name="keep-me")
    _logged_in(browser, gw)
    browser.get(gw.url + "/console/tenants")
    _rendered(browser)
    button = _until(
        browser,
        lambda d: d.find_element(By.CSS_SELECTOR, f'button.revoke[data-key-id="{made["id"]}"]'),
    )
    button.click()
    _until(browser, lambda d: d.switch_to.alert).dismiss()
    assert _chat(gw, "fast", key=made["key"]).status_code == 200


# -- CSRF and sessions -----------------------------------------------------------------


def test_changes_without_the_csrf_token_are_refused(gw: Gateway) -> None:
    client, token = _cookie_session(gw)
    assert client.get("/admin/tenants").status_code == 200  # reads need only the session
    body = {"id": "csrf-probe"}
    for headers in ({}, {"x-csrf-token": "wrong"}, {"x-csrf-token": token + "x"}):
        r = client.post("/admin/tenants", json=body, headers=headers)
        assert r.status_code == 403, headers
        assert r.json()["error"]["code"] == "csrf_failed"
    foreign = client.post(
        "/admin/tenants",
        json=body,
        headers={"x-csrf-token": token, "origin": "https://evil.example"},
    )
    assert foreign.status_code == 403 and foreign.json()["error"]["code"] == "csrf_failed"
    assert client.get("/admin/tenants/csrf-probe").status_code == 404  # nothing was made
    ok = client.post("/admin/tenants", json=body, headers={"x-csrf-token": token})
    assert ok.status_code == 201
    # A logout form without the token does not end the session.
    assert client.post("/console/logout", data={"csrf": "wrong"}).status_code == 403
    assert client.get("/admin/tenants").status_code == 200


def test_a_forged_or_foreign_cookie_is_not_a_session(gw: Gateway) -> None:
    client, _ = _cookie_session(gw)
    value = client.cookies["sy_console"]
    expiry, nonce, sig = value.split(".")
    forged = [
        f"{int(expiry) + 3600}.{nonce}.{sig}",  # a later expiry, same signature
        f"{expiry}.{nonce}x.{sig}",
        f"{expiry}.{nonce}.{sig[:-2]}AA",
        "x" * 300,
        "",
    ]
    for v in forged:
        r = httpx.get(gw.url + "/admin/tenants", cookies={"sy_console": v})
        assert r.status_code == 401, v
        assert r.json()["error"]["code"] == "invalid_admin_key"


def test_logout_ends_the_session(browser: WebDriver, gw: Gateway) -> None:
    client, token = _cookie_session(gw)
    old = client.cookies["sy_console"]
    r = client.post("/console/logout", data={"csrf": token})
    assert r.status_code == 303 and r.headers["location"] == "/console/login"
    # The old cookie, replayed, no longer opens anything.
    again = httpx.get(gw.url + "/admin/tenants", cookies={"sy_console": old})
    assert again.status_code == 401
    page = httpx.get(gw.url + "/console/requests", cookies={"sy_console": old})
    assert page.status_code == 303 and page.headers["location"] == "/console/login"
    # And in the browser: the button logs out.
    _logged_in(browser, gw)
    browser.find_element(By.ID, "logout").click()
    _until(browser, lambda d: d.current_url.endswith("/console/login"))
    browser.get(gw.url + "/console/live")
    assert browser.current_url.endswith("/console/login")


# -- live, cache, cost -----------------------------------------------------------------


def test_live_page_refreshes_without_reloading(browser: WebDriver, gw: Gateway) -> None:
    _logged_in(browser, gw)
    browser.get(gw.url + "/console/live")
    _rendered(browser)
    before = int(
        _until(browser, lambda d: d.find_element(By.ID, "live-requests"))
        .text.split()[0]
        .replace(",", "")
    )
    browser.execute_script("window.__same_page = true")
    for _ in range(3):
        assert _chat(gw, "fast").status_code == 200

    def grew(d: WebDriver) -> bool:
        text = d.find_element(By.ID, "live-requests").text.split()[0].replace(",", "")
        return int(text) >= before + 3

    _until(browser, grew)
    assert browser.execute_script("return window.__same_page") is True  # no reload
    assert "fast" in browser.find_element(By.ID, "live-breakers").text
    engines = browser.find_element(By.ID, "live-engines").text
    assert "smollm2-135m" in engines and "ready" in engines

    def engine_read(d: WebDriver) -> bool:  # the resident engine's own load, read lately
        text = d.find_element(By.ID, "live-engine-load").text
        return "smollm2-135m" in text and "llamacpp" in text and "s ago" in text

    _until(browser, engine_read)
    _shot(browser, "live")


def test_cache_page_previews_before_invalidating(browser: WebDriver, gw: Gateway) -> None:
    cached = {"messages": [{"role": "user", "content": "cache me"}], "max_tokens": 8}
    body = {**cached, "model": "fast", "temperature": 0}

    def call() -> httpx.Response:
        r = httpx.post(gw.url + "/v1/chat/completions", json=body, headers=gw.auth, timeout=30)
        assert r.status_code == 200
        return r

    call()
    hit = call().headers["x-request-id"]
    assert gw.trace(hit)["cache"] == "hit-exact"
    _logged_in(browser, gw)
    browser.get(gw.url + "/console/cache")
    _rendered(browser)
    go = browser.find_element(By.ID, "invalidate")
    assert not go.is_enabled()  # nothing to confirm before a preview
    browser.find_element(By.ID, "f-model").send_keys("slow")
    browser.find_element(By.ID, "dry-run").click()
    count = _until(browser, lambda d: d.find_element(By.ID, "dry-run-count"))
    assert count.text == "would remove 0 entries"
    assert not go.is_enabled()
    model = browser.find_element(By.ID, "f-model")
    model.clear()
    model.send_keys("fast")
    assert not go.is_enabled()  # a changed filter needs a new preview
    browser.find_element(By.ID, "dry-run").click()
    _until(
        browser, lambda d: d.find_element(By.ID, "dry-run-count").text == "would remove 1 entries"
    )
    assert (
        gw.trace(call().headers["x-request-id"])["cache"] == "hit-exact"
    )  # a preview removes nothing
    _shot(browser, "cache")
    _until(browser, lambda d: d.find_element(By.ID, "invalidate").is_enabled())
    browser.find_element(By.ID, "invalidate").click()
    _until(browser, lambda d: d.find_element(By.ID, "removed-count").text == "removed 1 entries")
    assert gw.trace(call().headers["x-request-id"])["cache"] != "hit-exact"


def test_cost_page_plots_today(browser: WebDriver, gw: Gateway) -> None:
    _logged_in(browser, gw)
    browser.get(gw.url + "/console/cost?since=1d")
    _rendered(browser)
    _until(browser, lambda d: d.find_element(By.ID, "cost-plot"))
    report = httpx.get(gw.url + "/admin/cost?since=1d", headers=gw.admin).json()
    assert browser.find_element(By.ID, "verdict").text == report["verdict"]
    assert browser.find_elements(By.CSS_SELECTOR, "#cost-plot #today")
    assert browser.find_elements(By.CSS_SELECTOR, "#cost-plot #managed-line")
    # 0.4 USD/h x 730 h + 50 USD of operations, whatever the traffic.
    assert browser.find_element(By.ID, "self-month").text.startswith("$342.00")
    _shot(browser, "cost")


def test_console_paths_are_bounded(gw: Gateway) -> None:
    client, _ = _cookie_session(gw)
    assert client.get("/console/nope").status_code == 404
    assert client.get("/console/live/extra").status_code == 404
    assert client.get("/console/static/../app.py").status_code == 404
    assert (
        client.get("/console/static/console.js")
        .headers["content-type"]
        .startswith("text/javascript")
    )
    long = client.get("/console/requests/" + "a" * 5000)
    assert long.status_code == 200 and "a" * 300 not in long.text


def test_the_start_banner_names_the_console(gw: Gateway) -> None:
    deadline = time.monotonic() + WAIT_S
    while "Console:" not in gw.proc.output() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert f"Console: {gw.url}/console (log in with the admin key in $SWITCHYARD_ADMIN_KEY)" in (
        gw.proc.output()
    )
