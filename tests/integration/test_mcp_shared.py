"""At most once across gateway processes: two gateways sharing one PostgreSQL database
front the same MCP tool server (Streamable HTTP, written with the official SDK); the
same side-effecting call id sent three times at once, through both, runs once, and all
three callers get its result."""

from __future__ import annotations

import asyncio
import base64
import os
from collections.abc import Iterator
from typing import Any

import pytest
from mcp import ClientSession

from support.gateways import cheap_config, start_gateway
from support.mcp_sessions import Tools, http_tool_server, session, text, wait_tools_ready
from support.postgres_server import Postgres, fresh
from support.upstreams import Scripted

TOOL = "web__send_email"


@pytest.fixture(scope="module")
def postgres() -> Iterator[Postgres]:
    server = Postgres()
    yield server
    server.stop()


def test_one_call_id_through_two_gateways_runs_once(postgres: Postgres, scripted: Scripted) -> None:
    tools = Tools()
    db = fresh(postgres.url)
    # One sealing key for both: each must open the result the other stored.
    env = {"SY_TEST_SEAL": base64.b64encode(os.urandom(32)).decode()}
    gateways: list[Any] = []
    with http_tool_server(tools) as url:
        config = cheap_config(
            scripted,
            mcp={"servers": [{"name": "web", "url": url}]},
            tools={"registry": [{"name": TOOL, "class": "side_effect"}]},
            responses={"encryption_key_env": "SY_TEST_SEAL"},
        )
        try:
            gateways = [start_gateway(config, db=db, env=env) for _ in range(2)]
            for g in gateways:
                g.key = gateways[0].key  # one tenant and key, in the shared database
            for g in gateways:
                wait_tools_ready(g, ("web",))
            call_id = "call_sy_" + os.urandom(6).hex()
            to = f"{call_id}@example.com"

            async def one(g: Any) -> str:
                async with session(g) as s:
                    assert isinstance(s, ClientSession)
                    r = await s.call_tool(TOOL, {"to": to, "body": "hi"}, meta={"call_id": call_id})
                    return text(r)

            async def three() -> list[str]:
                return list(await asyncio.gather(*(one(g) for g in [*gateways, gateways[0]])))

            assert asyncio.run(three()) == [f"sent to {to}"] * 3
            assert Tools.runs(tools.http_log, "send_email", to=to) == 1
        finally:
            for g in gateways:
                g.proc.stop()
