"""The bounded stdio transport (engines/mcp_stdio.py): its line reading over any chunking,
an oversized line's attribution to the request it answers, and, against real stdio tool
servers (the SDK's, and a raw one that writes its ids last, as the TypeScript SDK does),
a reply over the bound that ends its own call `too_large` and leaves the connection
serving."""

from __future__ import annotations

import asyncio
import json
import random
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest
from mcp import ClientSession, MCPError
from mcp.client.stdio import StdioServerParameters
from mcp.shared.message import SessionMessage
from mcp_types import (
    CallToolResult,
    JSONRPCError,
    JSONRPCNotification,
    JSONRPCRequest,
    JSONRPCResponse,
    TextContent,
)

from support.paths import MCP_TOOL_SERVER
from switchyard.config import McpServerConfig
from switchyard.engines.mcp_servers import McpServer
from switchyard.engines.mcp_stdio import (
    HEAD,
    TAIL,
    BoundedLines,
    OversizedLine,
    OversizedReply,
    PendingRequests,
    bounded_stdio_client,
    head_members,
    tail_members,
)

SDK_SERVER = MCP_TOOL_SERVER


def _feed(reader: BoundedLines, data: bytes, sizes: list[int]) -> list[bytes | OversizedLine]:
    out: list[bytes | OversizedLine] = []
    i = 0
    for n in sizes:
        out += reader.feed(data[i : i + n])
        i += n
    return out + reader.feed(data[i:])


@pytest.mark.parametrize("seed", range(6))
def test_lines_split_anywhere_across_chunks_come_out_whole(seed: int) -> None:
    rnd = random.Random(seed)
    lines = [bytes(rnd.choice(b'ab{}":, ') for _ in range(rnd.randint(0, 90))) for _ in range(40)]
    data = b"\n".join(lines) + b"\n"
    sizes = [rnd.randint(1, 17) for _ in range(len(data))]
    assert _feed(BoundedLines(90), data, sizes) == lines


def test_a_huge_line_is_cut_to_its_ends_and_the_next_line_is_whole() -> None:
    big = b'{"jsonrpc":"2.0","id":7,"result":"' + b"x" * 50_000 + b'"}'
    data = big + b"\n" + b'{"jsonrpc":"2.0","id":8,"result":{}}\n'
    for sizes in ([len(data)], [1000] * 60, [len(big), 1, 3]):
        got = _feed(BoundedLines(1000), data, sizes)
        assert got == [
            OversizedLine(len(big), big[:HEAD], big[-TAIL:]),
            b'{"jsonrpc":"2.0","id":8,"result":{}}',
        ], sizes


def test_a_line_exactly_at_the_bound_is_delivered_and_one_byte_more_is_not() -> None:
    at = b"y" * 5000
    over = b"z" * 5001
    for sizes in ([10_003], [5000, 1, 5001, 1], [4999, 2, 5000, 2]):
        got = _feed(BoundedLines(5000), at + b"\n" + over + b"\n", sizes)
        assert got == [at, OversizedLine(5001, over[:HEAD], over[-TAIL:])], sizes


def test_an_unterminated_last_line_is_not_delivered() -> None:
    reader = BoundedLines(100)
    assert reader.feed(b'{"a":1}\n{"b"') == [b'{"a":1}']
    assert reader.feed(b":2}") == []


def test_the_ends_show_only_top_level_members() -> None:
    nested = b'{"result":{"id":99,"content":"' + b"x" * 10_000
    assert head_members(nested) == {}  # "id" of the result, not of the message
    assert head_members(b'{"jsonrpc":"2.0", "id" : 12,"result":{"id":99,"t":"xx') == {
        "jsonrpc": "2.0",
        "id": 12,
    }
    assert head_members(b'{"jsonrpc":"2.0","id":12') == {"jsonrpc": "2.0"}  # 12 may go on
    tail = b'xxxx"},"structuredContent":{"id":99}},"jsonrpc":"2.0","id":"r-5"}'
    assert tail_members(tail) == {"jsonrpc": "2.0", "id": "r-5"}
    assert tail_members(b'xxx","id":4}}') == {}  # the end of a nested object


def _request(rid: int, method: str = "tools/call") -> JSONRPCRequest:
    return JSONRPCRequest(jsonrpc="2.0", id=rid, method=method, params={})


def _oversized(line: bytes) -> OversizedLine:
    return OversizedLine(len(line), line[:HEAD], line[-TAIL:])


def _answered(item: SessionMessage | Exception) -> tuple[Any, OversizedReply]:
    assert isinstance(item, SessionMessage) and isinstance(item.message, JSONRPCError), item
    assert isinstance(item.message.error.data, OversizedReply)
    return item.message.id, item.message.error.data


def test_an_oversized_reply_answers_the_id_it_shows_or_the_oldest_call() -> None:
    pending = PendingRequests(1000)
    for rid, method in ((1, "ping"), (2, "tools/call"), (3, "tools/call"), (4, "tools/call")):
        pending.sent(_request(rid, method))
    body = b'"result":{"content":"' + b"x" * 20_000 + b'"}'
    # The SDK's order: the id first; the TypeScript SDK's: the id last.
    first = b'{"id":3,' + body + b"}"
    assert _answered(pending.answer_oversized(_oversized(first))) == (
        3,
        OversizedReply(len(first), 1000),
    )
    assert _answered(pending.answer_oversized(_oversized(b"{" + body + b',"id":"4"}')))[0] == 4
    # The id out of sight: the oldest call still waiting (a ping's reply is never large).
    hidden = b"{" + body + b',"id":2,' + body + b"}"
    assert _answered(pending.answer_oversized(_oversized(hidden)))[0] == 2
    assert len(pending) == 1  # only the ping waits on
    assert isinstance(pending.answer_oversized(_oversized(hidden)), ValueError)  # nothing left


def test_an_oversized_server_message_and_cancelled_calls_fail_no_call() -> None:
    pending = PendingRequests(1000)
    pending.sent(_request(1))
    pending.sent(_request(2))
    cancel = {"requestId": 1, "reason": "timed out"}
    pending.sent(
        JSONRPCNotification(jsonrpc="2.0", method="notifications/cancelled", params=cancel)
    )
    log = b'{"method":"notifications/message","params":{"data":"' + b"x" * 9000 + b'"}}'
    assert isinstance(pending.answer_oversized(_oversized(log)), ValueError)
    assert len(pending) == 1
    # A reply within the bound is the SDK's own message, and answers its call.
    item = pending.received(b'{"jsonrpc":"2.0","id":2,"result":{}}', "utf-8", "strict")
    assert isinstance(item, SessionMessage) and isinstance(item.message, JSONRPCResponse)
    assert len(pending) == 0
    assert isinstance(pending.received(b"not json", "utf-8", "strict"), ValueError)


def _text(result: CallToolResult) -> str:
    assert isinstance(result.content[0], TextContent), result
    return result.content[0].text


async def _call_big_then_lookup(params: StdioServerParameters, bound: int) -> None:
    with tempfile.TemporaryFile("w+") as errlog:
        async with (
            bounded_stdio_client(params, errlog, bound) as (read, write),
            ClientSession(read, write) as session,
        ):
            await asyncio.wait_for(session.initialize(), 30)
            with pytest.raises(MCPError) as caught:
                await session.call_tool("big", {"n": 3_000_000}, read_timeout_seconds=30)
            assert caught.value.data == OversizedReply(caught.value.data.size, bound)
            assert caught.value.data.size > 3_000_000
            small = await session.call_tool("big", {"n": bound // 4}, read_timeout_seconds=30)
            assert _text(small) == "x" * (bound // 4)
            found = await session.call_tool("lookup", {"q": "after"}, read_timeout_seconds=30)
            assert _text(found) == "found: after"


def test_a_real_sdk_servers_huge_reply_fails_its_call_and_the_session_serves_on(
    tmp_path: Path,
) -> None:
    params = StdioServerParameters(
        command=sys.executable, args=[SDK_SERVER, "stdio", str(tmp_path / "log")]
    )
    asyncio.run(_call_big_then_lookup(params, 64 * 1024))


# A stdio server that writes its replies' members result-first, as the TypeScript SDK
# does, so the id of a huge reply is at the end of its line.
ID_LAST_SERVER = r"""
import json, sys
tool = {"name": "big", "inputSchema": {"type": "object"}}
for line in sys.stdin:
    msg = json.loads(line)
    if "id" not in msg:
        continue
    method, args = msg["method"], msg.get("params", {}).get("arguments", {})
    if method == "initialize":
        result = {"protocolVersion": msg["params"]["protocolVersion"], "capabilities": {"tools": {}},
                  "serverInfo": {"name": "id-last", "version": "1"}}
    elif method == "tools/list":
        result = {"tools": [tool, {**tool, "name": "lookup"}]}
    elif method == "tools/call" and msg["params"]["name"] == "big":
        result = {"content": [{"type": "text", "text": "x" * args["n"]}]}
    elif method == "tools/call":
        result = {"content": [{"type": "text", "text": "found: " + args["q"]}]}
    else:
        result = {}
    sys.stdout.write(json.dumps({"result": result, "jsonrpc": "2.0", "id": msg["id"]}) + "\n")
    sys.stdout.flush()
"""


def test_a_huge_reply_whose_id_comes_last_fails_its_own_call(tmp_path: Path) -> None:
    script = tmp_path / "id_last.py"
    script.write_text(ID_LAST_SERVER)
    params = StdioServerParameters(command=sys.executable, args=[str(script)])
    asyncio.run(_call_big_then_lookup(params, 64 * 1024))


def test_a_servers_huge_reply_is_too_large_not_a_failure_and_it_stays_up(tmp_path: Path) -> None:
    cfg = McpServerConfig(
        name="crm", command=[sys.executable, SDK_SERVER, "stdio", str(tmp_path / "log")]
    )

    async def go() -> None:
        server = McpServer(cfg)
        server.max_reply_bytes = 16 * 1024
        server.start()
        try:
            assert await server.wait_ready(30), server.describe()
            out = await server.call("big", {"n": 1_000_000}, None, 30)
            assert out.too_large and out.sent and not out.failed and out.result is None, out
            out = await server.call("lookup", {"q": "still here"}, None, 30)
            assert out.result is not None and "still here" in json.dumps(out.result), out
            assert server.describe()["restarts"] == 0 and server.state == "ready"
        finally:
            await server.stop()

    asyncio.run(go())
