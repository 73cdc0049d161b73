"""Hostile review of what the gateway shows back to someone other than the sender: the
console, the admin API's traces and usage rows, `/metrics` and the gateway's log. Over
sockets against one real gateway in front of the scripted upstream, with a stdio tool
server that writes hostile text to its stderr and exits; the console in a real headless
Chromium driven as tests/integration/test_console.py drives it.

Defects these tests found (each failed on the code before its fix, this stop):
- a tool server's stderr reaches the gateway's log as it wrote it: its newlines start
  log lines of their own (a forged `CRITICAL switchyard: ...` record, with the
  gateway's timestamp format) and its ANSI escapes reach an operator's terminal
  (engines/mcp_servers.py `McpServer._supervise` logs `_reason`, which appended the raw
  stderr tail; it is escaped into one line now);
- an unknown model name is recorded whole: a 1 MB `model` makes a 1 MB usage row and
  trace (the error message cuts it at 128 characters), every later `/admin/usage` or
  console page carrying it (service.py `generate` sets `ctx.alias` to the unchecked
  name, which state/traces.py `ledger_entry` records, as did the route decision's
  evidence); a model there is none of is now recorded as `(unknown model)`, the way a
  tool there is none of already was (`settle.mark_failed`, `Route.UNKNOWN`);
- a credential a client sends as `model` (a key pasted in the wrong field) is kept raw
  in the gateway's SQLite files (its usage row and trace), where the same text in a
  message never reaches them (same places);
- `/v1/embeddings` quotes an unknown model name whole in its error (a 1 MB name, a
  1 MB error body), where every other model route cuts it at 128 characters
  (execute/embeddings.py `EmbeddingService.validate`).

Gaps guarded (pass today; no other test covers them):
- a model name of HTML and script, refused as unknown, shows on the console's requests
  list and trace page as `(unknown model)` and runs nothing (test_console.py covers a
  key name on the tenants page only);
- unknown model names with quotes, backslashes and newlines leave `/metrics` valid and
  forge no sample: they are all labelled `unknown`;
- the console's pages and assets carry `X-Content-Type-Options: nosniff` (and its pages
  a CSP), and admin routes that quote hostile path text answer JSON, never HTML.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webdriver import WebDriver

from support.browser import WAIT_S, chromium, until
from support.gateways import ADMIN_KEY, Gateway, cheap_config, start_gateway
from support.upstreams import Scripted

MESSAGES = [{"role": "user", "content": "hi"}]
# What a hostile tool server writes to its stderr: a line in the gateway's own log
# format, then escapes that erase the line before it on a terminal.
FORGED = "2026-01-01 00:00:00,000 CRITICAL switchyard: FORGED the admin key was rotated"
STDERR = f"boom\n{FORGED}\n\x1b[2K\x1b[1A"
# Markup that runs script if any page inserts it as HTML.
XSS = '<img src=x id=injected onerror="window.__pwned=1"></script><script>window.__pwned=2</script>'
# A key of the shape the PII detector masks in message text (test_pii_dataflow.py).
SECRET = "sk-proj-Hq3vN8mB2xC7tR1uY5eW9pL6sK0fD4gJ"


@pytest.fixture(scope="module")
def gw(scripted: Scripted) -> Iterator[Gateway]:
    liar = [sys.executable, "-c", f"import sys; sys.stderr.write({STDERR!r}); sys.exit(3)"]
    g = start_gateway(cheap_config(scripted, mcp={"servers": [{"name": "liar", "command": liar}]}))
    yield g
    g.proc.stop()


@pytest.fixture(scope="module")
def browser() -> Iterator[WebDriver]:
    driver = chromium()
    yield driver
    driver.quit()


_until = until


def _chat(gw: Gateway, model: str) -> httpx.Response:
    return gw.post("/v1/chat/completions", json={"model": model, "messages": MESSAGES})


# -- the log -------------------------------------------------------------------------


def test_tool_server_stderr_cannot_forge_gateway_log_lines(gw: Gateway) -> None:
    """The failed server's stderr tail may be logged, but inside its own record: no
    line of the log may begin with the forged one, and no escape may reach it."""
    deadline = time.monotonic() + WAIT_S
    while "MCP server liar failed" not in gw.proc.output():
        assert time.monotonic() < deadline, "the tool server's failure was never logged"
        time.sleep(0.1)
    log = gw.proc.output()
    forged = [line for line in log.splitlines() if line.startswith(FORGED)]
    assert not forged, f"{len(forged)} forged log lines: {forged[0]!r}"
    assert "\x1b" not in log


# -- what is recorded of an unknown model ---------------------------------------------


def test_unknown_model_name_is_bounded_at_rest(gw: Gateway) -> None:
    r = _chat(gw, "M" * 1_000_000)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    trace = gw.trace(r.headers["x-request-id"])
    row = next(u for u in gw.usage(limit=5) if u["request_id"] == trace["request_id"])
    recorded = {
        "trace.model": trace["model"],
        "trace.requested_model": trace["requested_model"],
        "usage.model": row["model"],
    }
    too_long = {k: len(v) for k, v in recorded.items() if v is not None and len(v) > 256}
    assert not too_long, f"characters recorded of the model name: {too_long}"


def test_credential_sent_as_model_is_not_kept_raw(gw: Gateway) -> None:
    r = _chat(gw, SECRET)
    assert r.status_code == 404
    gw.trace(r.headers["x-request-id"])  # written
    files = [Path(gw.db + suffix) for suffix in ("", "-wal", "-shm")]
    holding = [f.name for f in files if f.exists() and SECRET.encode() in f.read_bytes()]
    assert not holding, f"the raw key is in {holding}"


def test_embeddings_unknown_model_error_is_bounded(gw: Gateway) -> None:
    r = gw.post("/v1/embeddings", json={"model": "E" * 1_000_000, "input": "hi"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    assert len(r.content) < 2048, f"a {len(r.content)}-byte error body"


# -- /metrics --------------------------------------------------------------------------


def test_unknown_model_names_forge_no_metrics_sample(gw: Gateway) -> None:
    hostile = [
        'x"} 1\nswitchyard_forged_total{tenant="victim"} 1e9\n#',
        'back\\slash"quote',
        "new\nline\r\nreturn",
    ]
    for name in hostile:
        assert _chat(gw, name).status_code == 404
    text = httpx.get(gw.url + "/metrics", headers=gw.admin, timeout=30).text
    families = list(text_string_to_metric_families(text))  # raises if not valid
    assert not [f.name for f in families if "forged" in f.name]
    models = {
        s.labels["model"]
        for f in families
        for s in f.samples
        if f.name == "switchyard_requests" and "model" in s.labels
    }
    assert "unknown" in models
    assert models <= {"cheap", "unknown"}, models


# -- the console -----------------------------------------------------------------------


def test_console_shows_a_hostile_model_name_as_text(browser: WebDriver, gw: Gateway) -> None:
    r = _chat(gw, XSS)
    assert r.status_code == 404
    rid = r.headers["x-request-id"]
    gw.trace(rid)
    browser.get(gw.url + "/console/login")
    browser.find_element(By.ID, "admin-key").send_keys(ADMIN_KEY)
    browser.find_element(By.ID, "login").click()
    _until(browser, lambda d: d.current_url.endswith("/console/requests"))
    _until(browser, lambda d: rid in d.find_element(By.ID, "requests-table").text)
    # The name is the client's free text: not recorded, so not shown (a model there is
    # none of is "(unknown model)" in every record), and nothing of it runs.
    table = browser.find_element(By.ID, "requests-table").text
    assert "(unknown model)" in table and "onerror" not in table
    assert browser.find_elements(By.ID, "injected") == []
    assert browser.execute_script("return window.__pwned") is None
    browser.get(f"{gw.url}/console/requests/{rid}")
    _until(browser, lambda d: d.find_elements(By.CSS_SELECTOR, "#decisions .decision"))
    assert "onerror" not in browser.find_element(By.ID, "content").text
    assert browser.find_elements(By.ID, "injected") == []
    assert browser.execute_script("return window.__pwned") is None


def test_console_and_admin_content_types(gw: Gateway) -> None:
    client = httpx.Client(base_url=gw.url, timeout=30)
    assert client.post("/console/login", data={"admin_key": ADMIN_KEY}).status_code == 303
    for path in ("/console/login", "/console/requests", f"/console/requests/{XSS}"):
        page = client.get(path, follow_redirects=True)
        assert page.status_code == 200, path
        assert page.headers["content-type"].startswith("text/html"), path
        assert page.headers["x-content-type-options"] == "nosniff", path
        assert "script-src 'self'" in page.headers["content-security-policy"], path
        assert XSS not in page.text, path  # the path's text is escaped into the shell
    for name in ("console.js", "console.css"):
        asset = client.get(f"/console/static/{name}")
        assert asset.headers["x-content-type-options"] == "nosniff", name
    for path in (f"/admin/requests/{XSS}", f"/admin/{XSS}", f"/console/{XSS}"):
        r = client.get(path)
        assert r.status_code == 404, path
        assert r.headers["content-type"].startswith("application/json"), path
