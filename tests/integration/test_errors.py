"""The error contract over real HTTP: OpenAI error bodies with the right status."""

from __future__ import annotations

from typing import Any

import httpx
import openai
import pytest

from support.gateways import Gateway

MODEL = "smollm2-135m"


def _post(gw: Gateway, path: str, **kw: Any) -> httpx.Response:
    return gw.post(path, **kw)


def _error(r: httpx.Response) -> dict[str, Any]:
    body = r.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert "Traceback" not in r.text
    assert r.headers["x-request-id"]
    return dict(body["error"])


def test_bad_json_is_400(default_gateway: Gateway) -> None:
    r = _post(
        default_gateway,
        "/v1/chat/completions",
        content=b"{not json",
        headers={"content-type": "application/json"},
    )
    assert r.status_code == 400
    err = _error(r)
    assert err["type"] == "invalid_request_error"
    assert "not valid JSON" in err["message"]


def test_missing_messages_names_the_field(default_gateway: Gateway) -> None:
    r = _post(default_gateway, "/v1/chat/completions", json={"model": MODEL})
    assert r.status_code == 400
    err = _error(r)
    assert err["param"] == "messages"
    assert "messages" in err["message"]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"messages": [{"role": "user", "content": "x"}]}, "model"),
        ({"model": MODEL, "messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
        (
            {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 0},
            "max_tokens",
        ),
        (
            {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "temperature": 9},
            "temperature",
        ),
        ({"model": MODEL, "messages": []}, "messages"),
    ],
)
def test_schema_violations_name_the_field(
    default_gateway: Gateway, body: dict[str, Any], param: str
) -> None:
    r = _post(default_gateway, "/v1/chat/completions", json=body)
    assert r.status_code == 400
    assert _error(r)["param"] == param


def test_unknown_model_is_404(default_gateway: Gateway) -> None:
    with pytest.raises(openai.NotFoundError) as exc:
        default_gateway.openai().chat.completions.create(
            model="no-such-model", messages=[{"role": "user", "content": "hi"}]
        )
    assert exc.value.status_code == 404
    assert exc.value.code == "model_not_found"


def test_oversize_body_is_413_before_parsing(default_gateway: Gateway) -> None:
    # 9 MB of invalid JSON: a 413 (not a 400) proves the size is checked before parsing.
    r = _post(
        default_gateway,
        "/v1/chat/completions",
        content=b"x" * 9_000_000,
        headers={"content-type": "application/json"},
    )
    assert r.status_code == 413
    assert _error(r)["code"] == "request_too_large"


def test_oversize_chunked_body_is_413(default_gateway: Gateway) -> None:
    def chunks() -> Any:
        for _ in range(100):
            yield b"y" * 100_000

    r = _post(
        default_gateway,
        "/v1/chat/completions",
        content=chunks(),
        headers={"content-type": "application/json"},
    )
    assert r.status_code == 413


def test_unknown_route_and_method_use_error_body(default_gateway: Gateway) -> None:
    r = httpx.get(default_gateway.url + "/v1/nothing-here")
    assert r.status_code == 404
    assert _error(r)["code"] == "not_found"
    r = httpx.get(default_gateway.url + "/v1/chat/completions")
    assert r.status_code == 405


def test_embeddings_errors(default_gateway: Gateway) -> None:
    r = _post(default_gateway, "/v1/embeddings", json={"model": "all-minilm-l6-v2"})
    assert r.status_code == 400 and _error(r)["param"] == "input"
    r = _post(default_gateway, "/v1/embeddings", json={"model": "nope", "input": "x"})
    assert r.status_code == 404
    r = _post(default_gateway, "/v1/embeddings", json={"model": MODEL, "input": "x"})
    assert r.status_code == 400 and "does not serve embeddings" in _error(r)["message"]


def test_bad_request_timeout_header_is_400(default_gateway: Gateway) -> None:
    r = _post(
        default_gateway,
        "/v1/chat/completions",
        json={"model": MODEL, "messages": [{"role": "user", "content": "x"}]},
        headers={"x-request-timeout": "soon", "x-request-id": "bad-timeout-1"},
    )
    assert r.status_code == 400
    assert _error(r)["param"] == "x-request-timeout"
    # Refused like any bad input: settled, with its usage row and trace.
    rec = httpx.get(
        default_gateway.url + "/admin/requests/bad-timeout-1", headers=default_gateway.admin
    )
    assert rec.status_code == 200, rec.text
    got = rec.json()
    assert got["status"] == "error" and got["error_code"] == "invalid_header"
    assert [d["stage"] for d in got["decisions"]] == ["authenticate"]


def test_fast_routes_map_their_own_errors(caplog: pytest.LogCaptureFixture) -> None:
    """The model routes skip FastAPI's stack (GatewayApp), so they map errors themselves:
    a SwitchyardError keeps its status and body; anything else is a 500 with the
    OpenAI error body, no trace for the client and the traceback in the log."""
    import asyncio

    from starlette.requests import Request

    from switchyard.api.app import GatewayApp
    from switchyard.errors import InvalidRequest

    async def boom(request: Request) -> Any:
        raise RuntimeError("secret internals")

    async def bad(request: Request) -> Any:
        raise InvalidRequest("no good", param="x")

    app = GatewayApp()
    app.fast = {"/boom": boom, "/bad": bad}

    async def main() -> list[httpx.Response]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            return [
                await client.post("/boom", headers={"x-request-id": "r-1"}),
                await client.post("/bad"),
                await client.get("/bad"),  # not a fast route for GET: FastAPI's 404
            ]

    with caplog.at_level("ERROR", logger="switchyard.api"):
        boom_r, bad_r, get_r = asyncio.run(main())
    assert boom_r.status_code == 500 and _error(boom_r)["type"] == "server_error"
    assert "secret internals" not in boom_r.text
    assert boom_r.headers["x-request-id"].startswith("req_")  # the gateway's, not the client's
    assert any("secret internals" in (r.exc_text or "") for r in caplog.records)
    assert bad_r.status_code == 400 and _error(bad_r)["param"] == "x"
    assert get_r.status_code == 404
