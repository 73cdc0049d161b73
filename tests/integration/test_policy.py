"""Tenants and policy over real HTTP: keys, authorization, limits, budgets, admission."""

from __future__ import annotations

import concurrent.futures
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from support.gateways import ADMIN_KEY, Gateway, start_gateway
from support.redis_server import start_redis, stop_redis
from support.upstreams import Scripted

CHEAP = {"model": "cheap", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 10}


def _models(scripted: Scripted) -> list[dict[str, Any]]:
    return [
        {
            "alias": "cheap",
            "revision": "c1",
            "engine": {"kind": "openai", "base_url": scripted.url + "/v1"},
            # $1000 per million output tokens: 10 tokens cost exactly $0.01.
            "price": {"input": 0.0, "output": 1000.0},
        },
        {"alias": "other", "engine": {"kind": "openai", "base_url": scripted.url + "/v1"}},
        {
            # $1000 per million input tokens: the prompt is what costs.
            "alias": "prompty",
            "engine": {"kind": "openai", "base_url": scripted.url + "/v1"},
            "price": {"input": 1000.0, "output": 0.0},
        },
        {
            "alias": "slow",
            "engine": {"kind": "openai", "base_url": scripted.url + "/v1"},
            "limits": {"max_concurrency": 1, "queue": 1},
        },
    ]


@pytest.fixture(scope="module")
def gw(scripted: Scripted) -> Iterator[Gateway]:
    g = start_gateway({"models": _models(scripted), "embeddings": {"enabled": False}})
    yield g
    g.proc.stop()


def _tenant_key(gw: Gateway, tenant: dict[str, Any] | None = None, **key: Any) -> str:
    tid = "t" + str(time.monotonic_ns())[-9:]
    gw.create_tenant(tid, **(tenant or {}))
    return str(gw.create_key(tid, **key)["key"])


def _chat(
    gw: Gateway, key: str | None, body: dict[str, Any] | None = None, **headers: str
) -> httpx.Response:
    h = dict(headers)
    if key is not None:
        h["Authorization"] = f"Bearer {key}"
    return httpx.post(gw.url + "/v1/chat/completions", json=body or CHEAP, headers=h, timeout=30)


# -- authentication and authorization -------------------------------------------------


def test_auth_matrix(gw: Gateway) -> None:
    r = _chat(gw, None)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    r = _chat(gw, "sk-sy-not-a-real-key")
    assert r.status_code == 401 and "not valid" in r.json()["error"]["message"]

    tid = "auth" + str(time.monotonic_ns())[-6:]
    gw.create_tenant(tid)
    only_cheap = gw.create_key(tid, allowed_models=["cheap"])
    wildcard = gw.create_key(tid, allowed_models=["o*"])
    assert _chat(gw, only_cheap["key"]).status_code == 200
    r = _chat(gw, only_cheap["key"], {**CHEAP, "model": "other"})
    assert r.status_code == 403 and r.json()["error"]["code"] == "model_not_allowed"
    assert _chat(gw, wildcard["key"], {**CHEAP, "model": "other"}).status_code == 200
    assert _chat(gw, wildcard["key"]).status_code == 403
    # An unknown model stays a 404 whatever the key.
    assert _chat(gw, wildcard["key"], {**CHEAP, "model": "nope"}).status_code == 404
    # /v1/models lists only what the key may use.
    ids = {m.id for m in gw.openai(only_cheap["key"]).models.list()}
    assert ids == {"cheap"}

    r = httpx.post(gw.url + f"/admin/keys/{only_cheap['id']}/revoke", headers=gw.admin)
    assert r.status_code == 200 and r.json()["revoked"] is True
    r = _chat(gw, only_cheap["key"])
    assert r.status_code == 401 and "revoked" in r.json()["error"]["message"]

    expiring = gw.create_key(tid, expires_in_s=0.5)
    time.sleep(2.6)  # past expiry and past the key cache
    r = _chat(gw, expiring["key"])
    assert r.status_code == 401 and "expired" in r.json()["error"]["message"]


def test_tenant_allow_list_also_applies(gw: Gateway) -> None:
    key = _tenant_key(gw, {"allowed_models": ["other"]})
    assert _chat(gw, key).status_code == 403
    assert _chat(gw, key, {**CHEAP, "model": "other"}).status_code == 200


def test_admin_api_requires_admin_key(gw: Gateway) -> None:
    assert httpx.get(gw.url + "/admin/tenants").status_code == 401
    assert (
        httpx.get(gw.url + "/admin/tenants", headers={"Authorization": "Bearer wrong"}).status_code
        == 401
    )
    assert httpx.get(gw.url + "/admin/tenants", headers=gw.auth).status_code == 401
    r = httpx.post(gw.url + "/admin/tenants", json={"id": "Bad Id!"}, headers=gw.admin)
    assert r.status_code == 400 and r.json()["error"]["param"] == "id"
    r = httpx.post(gw.url + "/admin/keys", json={"tenant_id": "no-such-tenant"}, headers=gw.admin)
    assert r.status_code == 404
    listed = httpx.get(gw.url + "/admin/keys", headers=gw.admin).json()["data"]
    assert listed and all("key" not in k and "hash" not in k for k in listed)


def test_admin_lists_answer_pages(gw: Gateway) -> None:
    """`GET /admin/tenants` and `/admin/keys` answer a page (`limit`, 100 by default,
    at most 1,000) and the cursor of the next (`after` the page's `last_id`), so a
    gateway with many tenants never builds one reply of all of them."""
    prefix = "page-" + os.urandom(3).hex()
    made = sorted(f"{prefix}-{i}" for i in range(5))
    for tenant in made:
        gw.create_tenant(tenant)
    key_ids = [gw.create_key(made[0], name=f"k{i}")["id"] for i in range(5)]

    def get(path: str) -> dict[str, Any]:
        r = httpx.get(gw.url + path, headers=gw.admin, timeout=10)
        assert r.status_code == 200, r.text
        return dict(r.json())

    seen: list[str] = []
    after = made[0][:-1]  # sorts just before the first of ours
    while True:
        page = get(f"/admin/tenants?limit=2&after={after}")
        assert len(page["data"]) <= 2
        seen += [t["id"] for t in page["data"] if t["id"].startswith(prefix)]
        if not page["has_more"] or not page["data"][-1]["id"].startswith(prefix):
            break
        assert page["last_id"] == page["data"][-1]["id"]
        after = page["last_id"]
    assert seen == made  # every one once, in order
    first = get(f"/admin/keys?tenant={made[0]}&limit=3")
    assert [k["id"] for k in first["data"]] == key_ids[:3] and first["has_more"] is True
    rest = get(f"/admin/keys?tenant={made[0]}&limit=3&after={first['last_id']}")
    assert [k["id"] for k in rest["data"]] == key_ids[3:] and rest["has_more"] is False
    assert len(get("/admin/tenants?limit=0")["data"]) == 1  # held to at least one
    r = httpx.get(gw.url + "/admin/keys?after=no-such-key", headers=gw.admin, timeout=10)
    assert r.status_code == 400 and r.json()["error"]["param"] == "after"


# -- rate limits ----------------------------------------------------------------------


def test_rpm_limit_429_with_headers(gw: Gateway) -> None:
    key = _tenant_key(gw, {"rpm": 3})
    ok = [_chat(gw, key) for _ in range(3)]
    assert [r.status_code for r in ok] == [200, 200, 200]
    assert ok[0].headers["x-ratelimit-limit-requests"] == "3"
    assert ok[2].headers["x-ratelimit-remaining-requests"] == "0"
    r = _chat(gw, key)
    assert r.status_code == 429
    assert r.json()["error"]["code"] == "rate_limit_rpm"
    assert 1 <= int(r.headers["retry-after"]) <= 60
    assert r.headers["x-ratelimit-remaining-requests"] == "0"


def test_tpm_reservation_limits_concurrent_long_requests(gw: Gateway, scripted: Scripted) -> None:
    key = _tenant_key(gw, {"tpm": 1000})
    body = {**CHEAP, "max_tokens": 300}  # reserves 300 + prompt; the upstream answers 16
    scripted.fault("delay:1500", count=5)
    with concurrent.futures.ThreadPoolExecutor(5) as pool:
        rs = list(pool.map(lambda _: _chat(gw, key, body), range(5)))
    codes = sorted(r.status_code for r in rs)
    # Two fit whole; a third fits with its cap shrunk to what the minute has left
    # (policy/cost.py); then not even a minimal answer fits.
    assert codes == [200, 200, 200, 429, 429], codes
    assert {r.json()["error"]["code"] for r in rs if r.status_code == 429} == {"rate_limit_tpm"}
    shrunk = [r.headers.get("x-switchyard-max-tokens", "") for r in rs if r.status_code == 200]
    assert sum(h.endswith("reason=tpm") for h in shrunk) == 1, shrunk
    # The finished requests were corrected to their real usage (~30 tokens each),
    # which releases the unused reservation: another long request fits at once.
    scripted.fault("delay:0", count=0)
    assert _chat(gw, key, body).status_code == 200


def test_budget_race_admits_at_most_what_fits_and_ledger_sums(gw: Gateway) -> None:
    tid = "budget" + str(time.monotonic_ns())[-6:]
    gw.create_tenant(tid, budget_usd=0.2, budget_period="day")  # fits 20 requests of $0.01
    key = gw.create_key(tid)["key"]
    with concurrent.futures.ThreadPoolExecutor(32) as pool:
        rs = list(pool.map(lambda _: _chat(gw, key), range(100)))
    ok = [r for r in rs if r.status_code == 200]
    refused = [r for r in rs if r.status_code == 429]
    assert len(ok) + len(refused) == 100
    assert len(ok) <= 20
    assert len(ok) == 20  # real cost equals the reservation, so exactly 20 fit
    assert {r.json()["error"]["code"] for r in refused} == {"insufficient_quota"}
    rows = gw.usage(tenant=tid, limit=1000)
    charged = [r for r in rows if r["status"] == "ok"]
    assert len(charged) == 20
    assert sum(r["cost_usd"] for r in rows) == pytest.approx(0.2)
    assert all(r["output_tokens"] == 10 and r["model"] == "cheap" for r in charged)
    assert len(rows) == 100  # refused requests are recorded too, at zero cost


def test_a_budget_holds_when_prompts_cost_more_than_their_text(
    gw: Gateway, scripted: Scripted
) -> None:
    """The upstream counts more prompt tokens than the text's estimate (a template;
    here the scripted upstream's count of the whole body). Once one reply has shown
    it, reservations include that overhead: 100 concurrent requests spend no more than
    the budget."""
    body = {**CHEAP, "model": "prompty"}
    warm = _chat(gw, _tenant_key(gw), body)  # any tenant: the overhead is the model's
    assert warm.status_code == 200
    per_request = warm.json()["usage"]["prompt_tokens"] * 1000.0 / 1_000_000
    tid = "prompty" + str(time.monotonic_ns())[-6:]
    budget = round(per_request * 8.5, 6)  # 8 fit
    gw.create_tenant(tid, budget_usd=budget, budget_period="day")
    key = gw.create_key(tid)["key"]
    scripted.fault("delay:500", count=100)  # every admission happens before any settle
    with concurrent.futures.ThreadPoolExecutor(32) as pool:
        rs = list(pool.map(lambda _: _chat(gw, key, body), range(100)))
    scripted.fault("delay:0", count=0)
    # Reservations lean high (policy/cost.py: the body's bytes at 3 a token, where
    # this upstream bills 4): fewer than 8 may fit at once, never more.
    ok = sum(r.status_code == 200 for r in rs)
    assert 1 <= ok <= 8
    spent = sum(r["cost_usd"] for r in gw.usage(tenant=tid, limit=1000))
    assert spent == pytest.approx(per_request * ok) and spent <= budget


def test_usage_row_fields(gw: Gateway) -> None:
    key = _tenant_key(gw)
    r = _chat(gw, key, **{"x-task-id": "task-42", "x-request-id": "req-usage-1"})
    assert r.status_code == 200
    rows = [x for x in gw.usage(task="task-42") if x["client_request_id"] == "req-usage-1"]
    assert len(rows) == 1
    row = rows[0]
    assert row["status"] == "ok" and row["revision"] == "c1"
    assert row["input_tokens"] > 0 and row["output_tokens"] == 10
    assert row["cost_usd"] == pytest.approx(0.01)
    assert row["upstream"].endswith("/v1") and row["duration_ms"] > 0


# -- admission control ----------------------------------------------------------------


def test_queue_full_is_immediate_429_and_expired_waiter_never_reaches_upstream(
    gw: Gateway, scripted: Scripted
) -> None:
    key = _tenant_key(gw)
    body = {**CHEAP, "model": "slow"}
    scripted.fault("delay:2000", count=1)
    before = scripted.requests()
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        running = pool.submit(_chat, gw, key, body)
        time.sleep(0.5)
        queued = pool.submit(_chat, gw, key, body, **{"x-request-timeout": "0.7"})
        time.sleep(0.2)
        started = time.monotonic()
        full = _chat(gw, key, body)
        took = time.monotonic() - started
        assert full.status_code == 429 and full.json()["error"]["code"] == "queue_full"
        assert full.headers["retry-after"]
        assert took < 1.0  # refused at once, not after waiting (generous bound)
        expired = queued.result()
        assert expired.status_code == 504
        assert expired.json()["error"]["code"] == "deadline_exceeded"
        assert running.result().status_code == 200
    assert scripted.requests() - before == 1  # only the running request reached upstream


# -- shared limits through Redis ----------------------------------------------------------


def test_two_gateways_share_one_rpm_limit_through_redis(scripted: Scripted) -> None:
    redis_proc, url = start_redis()
    db = tempfile.mkdtemp(prefix="switchyard-db-") + "/shared.db"
    base = {
        "models": _models(scripted),
        "embeddings": {"enabled": False},
        "storage": {"redis_url": url, "redis_timeout_s": 3},
    }
    a = start_gateway(base, db=db)
    b = start_gateway({**base, "policy": {"on_limiter_failure": "fail_open"}}, db=db)
    try:
        tid = "shared" + str(time.monotonic_ns())[-6:]
        a.create_tenant(tid, rpm=6)
        key = a.create_key(tid)["key"]
        codes = [_chat(g, key).status_code for g in (a, b) * 3]
        assert codes == [200] * 6
        assert _chat(a, key).status_code == 429
        assert _chat(b, key).status_code == 429  # the other process sees the same window
        a.create_tenant(tid + "b", rpm=6)
        other = a.create_key(tid + "b")["key"]
        stop_redis(redis_proc)
        # A window each process found full stays full (nothing gives a request back):
        # refused without asking the limiter (policy/admit.py FullWindows).
        assert _chat(a, key).status_code == 429 and _chat(b, key).status_code == 429
        r = _chat(a, other)
        assert r.status_code == 503 and r.json()["error"]["code"] == "limiter_unavailable"
        assert _chat(b, other).status_code == 200  # fail_open admits (and logs)
    finally:
        a.proc.stop()
        b.proc.stop()
        stop_redis(redis_proc)


# -- CLI and first run ------------------------------------------------------------------


def test_cli_keys_work_with_a_running_gateway(gw: Gateway) -> None:
    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "switchyard", *args, "--db", gw.db],
            capture_output=True,
            text=True,
            timeout=60,
        )

    assert cli("tenants", "create", "clitenant", "--rpm", "100").returncode == 0
    created = cli("keys", "create", "--tenant", "clitenant", "--models", "cheap")
    assert created.returncode == 0, created.stderr
    info = json.loads(created.stdout)
    assert info["key"].startswith("sk-sy-")
    assert "shown only once" in created.stderr
    assert _chat(gw, info["key"]).status_code == 200
    shown = json.loads(cli("keys", "show", info["id"]).stdout)
    assert "key" not in shown and shown["prefix"] == info["key"][:10]
    assert cli("keys", "revoke", info["id"]).returncode == 0
    time.sleep(2.5)  # the gateway's key cache (auth.key_cache_s) expires
    assert _chat(gw, info["key"]).status_code == 401
    missing = cli("keys", "show", "key_nope")
    assert missing.returncode == 1 and "does not exist" in missing.stderr


def test_limits_and_class_change_through_the_admin_api_and_the_cli(gw: Gateway) -> None:
    """PATCH changes what it names, at once (the next request is held to it); a field
    an update cannot change is refused by name; the CLI's update writes the same rows."""
    admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
    tid = "t" + str(time.monotonic_ns())[-9:]
    gw.create_tenant(tid, rpm=1000)
    made = gw.create_key(tid)
    assert _chat(gw, made["key"]).status_code == 200
    url = f"{gw.url}/admin/tenants/{tid}"
    r = httpx.patch(url, json={"rpm": 1, "priority": "batch"}, headers=admin, timeout=10)
    assert r.status_code == 200, r.text
    assert r.json()["limits"]["rpm"] == 1 and r.json()["priority"] == "batch"
    codes = [_chat(gw, made["key"]).status_code for _ in range(3)]
    assert 429 in codes  # rpm 1 holds at once: the key cache was cleared
    bad = httpx.patch(url, json={"allowed_models": ["x"]}, headers=admin, timeout=10)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "allowed_models"
    key_url = f"{gw.url}/admin/keys/{made['id']}"
    r = httpx.patch(key_url, json={"priority": "interactive"}, headers=admin, timeout=10)
    assert r.status_code == 200 and r.json()["priority"] == "interactive"
    assert httpx.patch(url, json={"rpm": 5}, timeout=10).status_code == 401  # admin only
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "switchyard",
            "tenants",
            "update",
            tid,
            "--priority",
            "interactive",
            "--db",
            gw.db,
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    shown = httpx.get(url, headers=admin, timeout=10).json()
    assert shown["priority"] == "interactive" and shown["limits"]["rpm"] == 1


def test_first_run_creates_and_prints_a_dev_key(scripted: Scripted) -> None:
    g = start_gateway({"models": _models(scripted), "embeddings": {"enabled": False}})
    try:
        out = g.proc.output()
        deadline = time.monotonic() + 30
        while "sk-sy-" not in out and time.monotonic() < deadline:
            time.sleep(0.2)
            out = g.proc.output()
        key = next(w for w in out.split() if w.startswith("sk-sy-"))
        assert _chat(g, key).status_code == 200
        assert "shown once" in out
        tenants = httpx.get(
            g.url + "/admin/tenants", headers={"Authorization": f"Bearer {ADMIN_KEY}"}
        ).json()
        assert "dev" in {t["id"] for t in tenants["data"]}
    finally:
        g.proc.stop()


def test_auth_disabled_warns_and_serves(scripted: Scripted) -> None:
    g = start_gateway(
        {
            "models": _models(scripted),
            "embeddings": {"enabled": False},
            "auth": {"mode": "disabled"},
        }
    )
    try:
        assert _chat(g, None).status_code == 200
        assert "AUTH IS DISABLED" in g.proc.output()
    finally:
        g.proc.stop()
