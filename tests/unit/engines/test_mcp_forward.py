"""engines/mcp_forward.py against a hostile tool server: an aiohttp server on loopback
that answers a `tools/call` however the test says (oversized, malformed, wrong id, odd
error fields, SSE with a server request first, 404, 5xx, silence). Every ending is an
outcome the tool service understands, with bounded words, and a timeout or a cancel
tells the server `notifications/cancelled`."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any

import orjson
import pytest
from aiohttp import web

from support.aiohttp_server import serving
from switchyard.engines.mcp_forward import ConnectFailed, HttpForwarder, SessionLost

Answer = Callable[[dict[str, Any]], Awaitable[web.StreamResponse]]


def ok(rid: Any, text: str = "hi") -> dict[str, Any]:
    return {"jsonrpc": "2.0", "id": rid, "result": {"content": [{"type": "text", "text": text}]}}


async def with_server(
    answer: Answer, go: Callable[[HttpForwarder, list[Any]], Awaitable[None]]
) -> None:
    seen: list[Any] = []  # every message the server got, and its headers

    async def handle(request: web.Request) -> web.StreamResponse:
        body = orjson.loads(await request.read())
        seen.append((body, request.headers.copy()))
        if "id" not in body or body.get("method") != "tools/call":
            return web.Response(status=202)
        return await answer(body)

    app = web.Application()
    app.router.add_post("/mcp", handle)
    async with serving(app) as url:
        fwd = HttpForwarder(
            url + "/mcp", {"authorization": "Bearer s3cret"}, "sid-1", "2025-11-25", 4096
        )
        try:
            await go(fwd, seen)
        finally:
            await fwd.close()


def json_reply(obj: Any, status: int = 200) -> web.Response:
    return web.Response(body=json.dumps(obj), status=status, content_type="application/json")


def run(answer: Answer, check: Callable[[Any, list[Any]], None], timeout_s: float = 5.0) -> None:
    async def go(fwd: HttpForwarder, seen: list[Any]) -> None:
        got = await fwd.call("echo", {"text": "x"}, {"switchyard/request_id": "req_1"}, timeout_s)
        await asyncio.sleep(0.05)  # a cancel notification, if any, lands
        check(got, seen)

    asyncio.run(with_server(answer, go))


def test_a_result_comes_back_validated_with_the_session_headers_sent() -> None:
    async def answer(body: dict[str, Any]) -> web.StreamResponse:
        return json_reply(ok(body["id"]))

    def check(got: Any, seen: list[Any]) -> None:
        result, error, how = got
        assert how == "ok" and error is None and result["content"][0]["text"] == "hi"
        body, headers = seen[0]
        assert body["params"] == {
            "name": "echo",
            "arguments": {"text": "x"},
            "_meta": {"switchyard/request_id": "req_1"},
        }
        assert isinstance(body["id"], str) and body["id"].startswith("sy-")
        assert headers["mcp-session-id"] == "sid-1"
        assert headers["mcp-protocol-version"] == "2025-11-25"
        assert headers["authorization"] == "Bearer s3cret"

    run(answer, check)


@pytest.mark.parametrize(
    ("reply", "how"),
    [
        (
            lambda rid: web.Response(body=b"x" * 10_000, content_type="application/json"),
            "too_large",
        ),
        (lambda rid: web.Response(body=b"{not json", content_type="application/json"), "malformed"),
        (lambda rid: json_reply(ok("someone-else")), "malformed"),
        (lambda rid: json_reply([ok(rid)]), "malformed"),
        (
            lambda rid: json_reply({"jsonrpc": "2.0", "id": rid, "result": {"content": 7}}),
            "malformed",
        ),
        (lambda rid: json_reply({"jsonrpc": "2.0", "id": rid, "result": "done"}), "malformed"),
        (lambda rid: web.Response(status=500, text="boom"), "server_error"),
        (lambda rid: web.Response(status=400, text="no"), "refused"),
    ],
)
def test_a_hostile_reply_is_an_outcome_never_an_exception(reply: Any, how: str) -> None:
    async def answer(body: dict[str, Any]) -> web.StreamResponse:
        return reply(body["id"])  # type: ignore[no-any-return]

    def check(got: Any, seen: list[Any]) -> None:
        result, error, got_how = got
        assert got_how == how and result is None
        assert isinstance(error[0], int) and len(error[1]) <= 500

    run(answer, check)


def test_an_error_is_bounded_and_only_an_internal_one_may_have_run() -> None:
    def error_reply(error: Any) -> Answer:
        async def answer(body: dict[str, Any]) -> web.StreamResponse:
            return json_reply({"jsonrpc": "2.0", "id": body["id"], "error": error})

        return answer

    cases = [
        ({"code": -32602, "message": "m" * 3000}, (-32602, "m" * 500), "refused"),
        ({"code": -32603, "message": "it broke"}, (-32603, "it broke"), "server_error"),
        ({"code": 10**30, "message": ["x"]}, (-32603, ""), "server_error"),
        ({"code": True, "message": "bool"}, (-32603, "bool"), "server_error"),
        ("nonsense", (-32603, "malformed error"), "server_error"),
    ]
    for error, want, how in cases:

        def check(got: Any, seen: list[Any], want: Any = want, how: str = how) -> None:
            assert got == (None, want, how)

        run(error_reply(error), check)


def test_an_sse_reply_skips_notifications_and_answers_the_servers_ping() -> None:
    async def answer(body: dict[str, Any]) -> web.StreamResponse:
        events = [
            {"jsonrpc": "2.0", "method": "notifications/progress", "params": {"progress": 1}},
            {"jsonrpc": "2.0", "id": 99, "method": "ping"},
            {"jsonrpc": "2.0", "id": 100, "method": "sampling/createMessage", "params": {}},
            ok(body["id"], "streamed"),
        ]
        text = "".join(
            f"event: message\r\ndata: {orjson.dumps(e).decode()}\r\n\r\n" for e in events
        )
        return web.Response(text=text, content_type="text/event-stream")

    def check(got: Any, seen: list[Any]) -> None:
        assert got[2] == "ok" and got[0]["content"][0]["text"] == "streamed"
        answers = {m["id"]: m for m, _ in seen if "method" not in m}
        assert answers[99]["result"] == {}
        assert answers[100]["error"]["code"] == -32601

    run(answer, check)


def test_a_lost_session_and_a_dead_server_send_nothing() -> None:
    async def gone(body: dict[str, Any]) -> web.StreamResponse:
        return json_reply(
            {"jsonrpc": "2.0", "id": None, "error": {"code": -32600, "message": "?"}}, 404
        )

    async def go(fwd: HttpForwarder, seen: list[Any]) -> None:
        with pytest.raises(SessionLost):
            await fwd.call("echo", {}, None, 5)
        assert fwd.lost

    asyncio.run(with_server(gone, go))

    async def dead() -> None:
        fwd = HttpForwarder("http://127.0.0.1:9/mcp", {}, None, "2025-11-25", 4096)
        try:
            with pytest.raises(ConnectFailed):
                await fwd.call("echo", {}, None, 5)
        finally:
            await fwd.close()

    asyncio.run(dead())


def test_a_timeout_and_a_cancel_tell_the_server() -> None:
    async def slow(body: dict[str, Any]) -> web.StreamResponse:
        await asyncio.sleep(3)
        return json_reply(ok(body["id"]))

    def cancels(seen: list[Any]) -> list[Any]:
        return [m for m, _ in seen if m.get("method") == "notifications/cancelled"]

    def check(got: Any, seen: list[Any]) -> None:
        assert got == (None, (-32001, "timed out"), "timeout")
        calls = [m for m, _ in seen if m.get("method") == "tools/call"]
        assert cancels(seen)[0]["params"]["requestId"] == calls[0]["id"]

    run(slow, check, timeout_s=0.2)

    async def go(fwd: HttpForwarder, seen: list[Any]) -> None:
        job = asyncio.ensure_future(fwd.call("echo", {}, None, 5))
        await asyncio.sleep(0.2)
        job.cancel()
        with pytest.raises(asyncio.CancelledError):
            await job
        await asyncio.sleep(0.1)
        assert cancels(seen) and cancels(seen)[0]["params"]["reason"] == "cancelled"

    asyncio.run(with_server(slow, go))
