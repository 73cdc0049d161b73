"""Hostile input against the admin API (/admin/...) and the operators' console
(/console/...): a client with no credential, a stolen or forged console cookie, and the
admin key sending malformed input. Over sockets against one real gateway in front of
the module's scripted upstream: `cheap`, `chat` (a version alias of two deployments,
`one` and `two`, whose weights the admin API sets) and `vault`, an upstream configured
with credentials in its URL (`user:password@` and a `?key=` query).

Defects these tests find (each failed before this round's fixes):
- a console cookie whose expiry is written in superscript digits (`²`, a Latin-1 byte
  any client can send) failed every route that reads the session with a 500, /readyz
  (the load balancers' probe) and /metrics included, without any credential:
  api/console.py `Sessions._parts` took `str.isdigit`, which holds for `²`, and `int`
  refused it;
- `budget_usd` given as an integer past 2^63 - 1 (SQLite's largest) was a 500
  (OverflowError in the write) on creating and changing tenants and keys: api/admin/
  params.py `read_fields` now refuses such an integer by name;
- a tenant id with a trailing newline (`"nl-x\\n"`) was created: state/keys.py checks
  `TENANT_ID.match`, whose `$` also matches before a final newline;
- a tenant's, key's or request's id in the path came back whole in the 404 (20,000
  characters of it), where the admin API names a hostile value within a bound;
- the credentials in an upstream's URL came back in every admin answer that shows
  where a request went: /admin/usage, /admin/requests (a trace's `upstream`, its
  select and attempt evidence) and /admin/tasks/{id} (the console shows them too);
- a weights change's `reason` was taken with newlines and control characters, then
  logged and kept in the weights' history (forged log lines); and deployment names of
  any length were echoed back whole when unknown;
- a created key (its secret, shown once) and every other admin answer came without
  `Cache-Control: no-store` (a cache between the operator and the gateway may keep the
  secret) and without `X-Content-Type-Options: nosniff`.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from support.gateways import Gateway, cheap_config, start_gateway, version_alias
from support.upstreams import Scripted

SECRETS = ("VAULTUSER", "UPSECRET1", "UPSECRET2")


@pytest.fixture(scope="module")
def gw(scripted: Scripted) -> Iterator[Gateway]:
    host = scripted.url.split("://", 1)[1]
    vault = {
        "alias": "vault",
        "engine": {
            "kind": "openai",
            "base_url": f"http://VAULTUSER:UPSECRET1@{host}/v1?key=UPSECRET2",
        },
        "resilience": {"retries": 0},
    }
    g = start_gateway(cheap_config(scripted, vault, version_alias(scripted.url, scripted.url)))
    yield g
    g.proc.stop()


def _error(r: httpx.Response) -> dict[str, object]:
    return dict(r.json()["error"])


# -- the console's session cookie ---------------------------------------------------------


def test_a_cookie_with_superscript_digits_is_no_session_and_no_500(gw: Gateway) -> None:
    for expiry in (b"\xb2", b"\xb9\xb2\xb3"):  # '²', '¹²³': isdigit() holds, int() refuses
        cookie = {"cookie": b"sy_console=" + expiry + b".bm9uY2U.c2ln"}
        ready = httpx.get(gw.url + "/readyz", headers=cookie)
        assert ready.status_code == 200 and "upstream" not in ready.text  # the public view
        admin = httpx.get(gw.url + "/admin/tenants", headers=cookie)
        assert admin.status_code == 401 and _error(admin)["code"] == "invalid_admin_key"
        page = httpx.get(gw.url + "/console/requests", headers=cookie)
        assert page.status_code == 303 and page.headers["location"] == "/console/login"
        metrics = httpx.get(gw.url + "/metrics", headers=cookie)
        assert metrics.status_code == 401


# -- malformed admin input ------------------------------------------------------------------


def test_a_budget_past_what_sqlite_stores_is_refused_by_name(gw: Gateway) -> None:
    tenant = gw.create_tenant(f"big-{os.urandom(3).hex()}")["id"]
    key = gw.create_key(tenant)["id"]
    huge = 2**63  # JSON allows it; SQLite stores at most 2^63 - 1
    calls = [
        ("POST", "/admin/tenants", {"id": f"big-{os.urandom(3).hex()}", "budget_usd": huge}),
        ("PATCH", f"/admin/tenants/{tenant}", {"budget_usd": huge}),
        ("POST", "/admin/keys", {"tenant_id": tenant, "budget_usd": huge}),
        ("PATCH", f"/admin/keys/{key}", {"budget_usd": huge}),
    ]
    for method, path, body in calls:
        r = httpx.request(method, gw.url + path, json=body, headers=gw.admin)
        assert r.status_code == 400, (method, path, r.text)
        assert _error(r)["param"] == "budget_usd"
    stored = httpx.get(f"{gw.url}/admin/tenants/{tenant}", headers=gw.admin).json()
    assert stored["limits"]["budget_usd"] is None  # nothing was written
    # The largest integer SQLite stores is still taken (kept as a REAL).
    ok = httpx.patch(
        f"{gw.url}/admin/tenants/{tenant}", json={"budget_usd": 2**63 - 1}, headers=gw.admin
    )
    assert ok.status_code == 200 and ok.json()["limits"]["budget_usd"] == float(2**63 - 1)


def test_a_tenant_id_with_a_trailing_newline_is_refused(gw: Gateway) -> None:
    name = f"nl-{os.urandom(3).hex()}"
    r = httpx.post(gw.url + "/admin/tenants", json={"id": name + "\n"}, headers=gw.admin)
    assert r.status_code == 400 and _error(r)["param"] == "id"
    assert httpx.get(f"{gw.url}/admin/tenants/{name}%0A", headers=gw.admin).status_code == 404
    assert httpx.get(f"{gw.url}/admin/tenants/{name}", headers=gw.admin).status_code == 404


def test_ids_in_the_path_are_never_echoed_whole(gw: Gateway) -> None:
    long = "y" * 20_000
    calls = [
        ("GET", f"/admin/tenants/{long}", None),
        ("PATCH", f"/admin/tenants/{long}", {"rpm": 5}),
        ("GET", f"/admin/keys/{long}", None),
        ("PATCH", f"/admin/keys/{long}", {"rpm": 5}),
        ("DELETE", f"/admin/keys/{long}", None),
        ("POST", f"/admin/keys/{long}/revoke", None),
        ("GET", f"/admin/requests/{long}", None),
    ]
    for method, path, body in calls:
        r = httpx.request(method, gw.url + path, json=body, headers=gw.admin)
        assert r.status_code == 404, (method, path[:40], r.status_code)
        assert _error(r)["code"] == "not_found"
        assert len(r.content) < 600 and "y" * 200 not in r.text, (method, path[:40])


# -- secrets in answers ---------------------------------------------------------------------


def test_upstream_credentials_are_not_in_admin_answers(gw: Gateway) -> None:
    tenant, key = gw.new_tenant("vault")
    task = f"vault-task-{os.urandom(3).hex()}"
    r = gw.post(
        "/v1/chat/completions",
        key=key,
        json={"model": "vault", "messages": [{"role": "user", "content": "hi"}]},
        headers={"x-task-id": task},
    )
    rid = r.headers["x-request-id"]
    trace = gw.trace(rid)  # waits for the record
    assert trace["upstream"].startswith("http://***@") and trace["upstream"].endswith("?key=***")
    answers = [httpx.get(f"{gw.url}/admin/requests/{rid}", headers=gw.admin)]
    for path in ("/admin/usage", "/admin/requests", f"/admin/tasks/{task}"):
        answers.append(httpx.get(gw.url + path, params={"tenant": tenant}, headers=gw.admin))
    for a in answers:
        assert a.status_code == 200, (a.url, a.text[:200])
        assert "***@" in a.text, a.url  # the row or trace is there, its secrets are not
        assert not [s for s in SECRETS if s in a.text], a.url


def test_upstream_credentials_are_not_kept_at_rest_nor_shown_by_readyz(gw: Gateway) -> None:
    """A deployment's label (its upstream's URL) is what usage rows, traces and spans
    record and /readyz shows the admin: its userinfo and query values are replaced where
    the label is made (engines/urls.py), so the database never holds them."""
    _, key = gw.new_tenant("vault-rest")
    r = gw.post(
        "/v1/chat/completions",
        key=key,
        json={"model": "vault", "messages": [{"role": "user", "content": "hi"}]},
    )
    assert gw.trace(r.headers["x-request-id"])["upstream"].startswith("http://***@")
    ready = httpx.get(gw.url + "/readyz", headers=gw.admin)
    assert "***@" in ready.text and not [s for s in SECRETS if s in ready.text], ready.text
    files = [p for p in Path(gw.db).parent.glob(Path(gw.db).name + "*") if p.is_file()]
    assert files and any(p.stat().st_size for p in files)
    for f in files:
        held = f.read_bytes()
        assert not [s for s in SECRETS if s.encode() in held], f


def test_admin_answers_are_never_cached(gw: Gateway) -> None:
    made = httpx.post(
        gw.url + "/admin/keys", json={"tenant_id": gw.create_tenant(
            f"nc-{os.urandom(3).hex()}")["id"]}, headers=gw.admin
    )  # fmt: skip
    assert made.status_code == 201 and made.json()["key"].startswith("sk-sy-")
    assert made.headers["cache-control"] == "no-store"
    assert made.headers["x-content-type-options"] == "nosniff"
    listed = httpx.get(gw.url + "/admin/keys", headers=gw.admin)
    assert listed.headers["cache-control"] == "no-store"
    assert made.json()["key"] not in listed.text  # shown once


# -- the weights of a version alias ---------------------------------------------------------


def test_a_weights_reason_must_be_printable_and_names_bounded(gw: Gateway) -> None:
    url = gw.url + "/admin/models/chat/weights"
    before = httpx.get(url, headers=gw.admin).json()["weights"]
    forged = "ok\n2026-12-07 00:00:00,000 CRITICAL switchyard: admin key rotated"
    for reason in (forged, "ok\x1b[2K", 5):
        r = httpx.post(
            url, json={"weights": {"one": 7, "two": 1}, "reason": reason}, headers=gw.admin
        )
        assert r.status_code == 400 and _error(r)["param"] == "reason", repr(reason)
    assert httpx.get(url, headers=gw.admin).json()["weights"] == before  # nothing changed
    assert "admin key rotated" not in gw.proc.output()
    long = httpx.post(url, json={"weights": {"z" * 20_000: 1}}, headers=gw.admin)
    assert long.status_code == 400 and _error(long)["param"] == "weights"
    assert "z" * 200 not in long.text
    ok = httpx.post(
        url, json={"weights": {"one": 1, "two": 1}, "reason": "even split"}, headers=gw.admin
    )
    assert ok.status_code == 200 and ok.json()["weights"] == {"one": 1.0, "two": 1.0}


def test_an_unknown_route_is_named_within_a_bound_and_on_one_line(gw: Gateway) -> None:
    """The 404 for a route there is none of repeated the whole decoded path: 20 kB of
    it, and a `%0A` as a real line break (a forged line wherever it is logged)."""
    r = httpx.get(gw.url + "/nope%0AERROR%20forged/" + "x" * 20_000, headers=gw.admin)
    assert r.status_code == 404, r.text[:200]
    message = r.json()["error"]["message"]
    assert len(r.content) < 600 and "\n" not in message, message[:300]
    assert message.startswith("no route GET /nope") and message.endswith("...")
