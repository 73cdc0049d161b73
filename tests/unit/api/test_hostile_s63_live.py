"""Hostile replies from the control plane to a worker's live view (/admin/live of
`serve --workers N`): the gate counts of `GET /gates` (policy/admission_remote.py
`host_gates`) from a real HTTP server answering what a broken control plane could, and
the engines report it forwards (api/admin/live.py `engine_rows`). The worker trusts its
control plane, but a broken one must neither fail the page nor make the worker hold an
unbounded reply. And the control plane's internal server answers a route or method it
does not have in the same error shape as its routes."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from aiohttp import web
from starlette.testclient import TestClient

from support.aiohttp_server import serving
from switchyard.api.admin.live import engine_rows
from switchyard.api.internal import GateRoutes, internal_app
from switchyard.policy.admission import DeploymentGate
from switchyard.policy.admission_remote import MAX_VIEW, Leases, host_gates

TOKEN = "t0ken"
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


async def _serve(handler: Handler, body: Callable[[str], Awaitable[Any]]) -> Any:
    """`body(url)` against a control plane whose `/gates` is `handler`."""
    app = web.Application()
    app.router.add_get("/gates", handler)
    async with serving(app) as url:
        return await body(url)


def _gates(handler: Handler) -> dict[str, dict[str, int]] | None:
    return asyncio.run(_serve(handler, lambda url: host_gates(url, TOKEN, timeout_s=10)))


def _many_gates(n: int) -> bytes:
    return b"{" + b",".join(b'"g%d":{"in_flight":1,"queued":1}' % i for i in range(n)) + b"}"


def test_a_declared_reply_over_the_bound_is_not_read() -> None:
    big = _many_gates(MAX_VIEW // 30)
    assert len(big) > MAX_VIEW

    async def handler(_: web.Request) -> web.Response:
        return web.Response(body=big, content_type="application/json")

    assert _gates(handler) is None


def test_a_streamed_reply_over_the_bound_is_cut_off() -> None:
    """No declared length: the worker stops reading at the bound."""

    async def handler(request: web.Request) -> web.StreamResponse:
        r = web.StreamResponse(headers={"content-type": "application/json"})
        r.enable_chunked_encoding()
        await r.prepare(request)
        await r.write(b'{"m":{"in_flight":1,"queued":0},"pad":"')
        chunk = b"x" * 65536
        try:
            for _ in range(4 * MAX_VIEW // len(chunk)):
                await r.write(chunk)
            await r.write(b'"}')
        except (ConnectionResetError, OSError):
            pass  # the worker hung up: what this test wants
        return r

    assert _gates(handler) is None


def test_counts_that_are_not_counts_are_left_out() -> None:
    async def handler(_: web.Request) -> web.Response:
        return web.json_response(
            {
                "ok": {"in_flight": 2, "queued": 1},
                "booleans": {"in_flight": True, "queued": False},
                "negative": {"in_flight": -1, "queued": 0},
                "floats": {"in_flight": 1.5, "queued": 0},
                "strings": {"in_flight": "2", "queued": "1"},
                "missing": {"in_flight": 2},
                "list": [1, 2],
            }
        )

    assert _gates(handler) == {"ok": {"in_flight": 2, "queued": 1}}


@pytest.mark.parametrize(
    "body", [b"[1, 2]", b"not json", b"[" * 5000 + b"]" * 5000, b'"\xff\xfe"', b""]
)
def test_a_reply_that_is_no_json_object_gives_no_counts(body: bytes) -> None:
    async def handler(_: web.Request) -> web.Response:
        return web.Response(body=body, content_type="application/json")

    assert _gates(handler) is None


@pytest.mark.parametrize(
    "report",
    [
        {},
        {"engines": None},
        {"engines": [1, 2]},
        {"engines": {"smol": "loaded"}},
        {"engines": {"smol": {"state": "loaded", "adapters": ["pirate"]}}},
        {"engines": {"smol": {"state": "loaded", "adapters": {"pirate": "active"}}}},
    ],
)
def test_an_engines_report_of_any_shape_gives_the_rows_it_can(report: dict[str, Any]) -> None:
    rows = engine_rows(report)
    engines = report.get("engines")
    if isinstance(engines, dict) and isinstance(engines.get("smol"), dict):
        assert rows == {
            "smol": {"state": "loaded", "in_flight": None, "memory_mb": None, "adapters": {}}
        }
    else:
        assert rows == {}


def test_an_engines_report_gives_each_engine_and_adapter_state() -> None:
    report = {
        "pool": {},
        "engines": {
            "smol": {
                "state": "loaded",
                "in_flight": 2,
                "memory_mb": 120.5,
                "adapters": {"pirate": {"state": "active"}, "robot": {"state": "loaded"}},
            }
        },
    }
    assert engine_rows(report) == {
        "smol": {
            "state": "loaded",
            "in_flight": 2,
            "memory_mb": 120.5,
            "adapters": {"pirate": "active", "robot": "loaded"},
        }
    }


@pytest.mark.parametrize(
    ("method", "path", "status", "code"),
    [
        ("POST", "/gates", 405, "method_not_allowed"),
        ("DELETE", "/gates", 405, "method_not_allowed"),
        ("GET", "/gates/m/acquire", 405, "method_not_allowed"),
        ("GET", "/nope", 404, "not_found"),
        ("GET", "/engines/m/v1/models", 404, "not_found"),
    ],
)
def test_the_internal_server_answers_what_it_has_not_in_the_error_shape(
    method: str, path: str, status: int, code: str
) -> None:
    gate = DeploymentGate("m", 2, 0, "fcfs")
    app = internal_app(GateRoutes(Leases({"m": gate}), TOKEN), None)
    with TestClient(app) as client:
        r = client.request(method, path, headers={"authorization": f"Bearer {TOKEN}"})
    assert r.status_code == status
    assert r.headers["content-type"] == "application/json"
    assert r.json()["error"]["code"] == code
    assert TOKEN not in r.text
