"""The governed `tools/call`'s hot path (issue #47's added latency): the client's answer
goes out before the call's records are written, the excerpts in those records are
PII-masked when they are written (never kept unmasked), and the call runs in its
request's own task, where a task cancel and a stopped request are still told apart.

The tool server is the bench's echo server (the official SDK over Streamable HTTP) on
loopback; the tool service, its servers, breaker, task store and masker are the real
ones. Only the ledger stands in, to show what it was handed and when.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import httpx
import pytest

from switchyard.config import Settings
from switchyard.engines.mcp_servers import McpServers
from switchyard.errors import TaskCancelled, UnknownTool
from switchyard.identity import ANONYMOUS
from switchyard.mcp_service import MAX_EXCERPT, Caller, McpToolService, Unmasked
from switchyard.mcp_service.calls import WITHHELD
from switchyard.policy.pii import MaskingError, PiiMasker
from switchyard.policy.tasks import Running
from switchyard.state.tasks_memory import MemoryTaskStore

EMAIL = "jane.doe@example.com"
MASK = PiiMasker().mask


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def echo_url() -> Iterator[str]:
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "switchyard.bench.mcp_echo_server", "--port", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}/mcp"
    try:
        deadline = time.monotonic() + 30
        while True:
            assert proc.poll() is None, "the echo server exited"
            try:
                httpx.get(url, timeout=1)
                break
            except httpx.HTTPError:
                assert time.monotonic() < deadline, "the echo server never answered"
                time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        proc.wait(10)


class Ledger:
    """Stands for the usage ledger: what it was handed."""

    def __init__(self) -> None:
        self.rows: list[Any] = []

    def record(self, finished: Any) -> None:
        self.rows.append(finished)


Body = Callable[[McpToolService, Ledger, Running], Awaitable[None]]


def with_service(url: str, body: Body) -> None:
    settings = Settings.model_validate(
        {
            "models": [{"alias": "m", "engine": {"kind": "llamacpp", "gguf": "auto"}}],
            "mcp": {"servers": [{"name": "bench", "url": url}]},
            "tools": {
                "registry": [
                    {"name": "bench__echo", "class": "read_only"},
                    {"name": "bench__pause", "class": "read_only"},
                ]
            },
        }
    )

    async def go() -> None:
        servers = McpServers(settings.mcp.servers)
        servers.start()
        try:
            assert await servers.servers["bench"].wait_ready(30), "the server never got ready"
            ledger, running = Ledger(), Running()
            service = McpToolService(
                settings,
                servers,
                None,  # type: ignore[arg-type]  # read-only calls claim nothing
                None,  # type: ignore[arg-type]  # nor consume approvals
                MemoryTaskStore(),
                running,
                ledger,
                MASK,
            )
            await body(service, ledger, running)
        finally:
            await servers.stop()

    asyncio.run(go())


def evidence_of(finished: Any) -> str:
    return json.dumps([d.evidence for d in finished.ctx.decisions if d.evidence])


def test_an_excerpt_is_masked_and_cut_where_it_is_written() -> None:
    for at in (0, 10, MAX_EXCERPT - 8, MAX_EXCERPT + 400, MAX_EXCERPT + 505):
        text = "x" * at + EMAIL + " tail " * 600
        got = Unmasked(text).masked(MASK)
        assert EMAIL not in got and len(got) <= MAX_EXCERPT
        assert got == MASK(text[: MAX_EXCERPT + 512])[:MAX_EXCERPT]
    assert Unmasked("plain words").masked(MASK) == "plain words"

    def broken(text: str) -> str:
        raise MaskingError("PII masking failed (ValueError)")

    assert Unmasked("mail " + EMAIL).masked(broken) == WITHHELD  # fail closed


def test_the_answer_goes_out_before_the_records_which_hold_only_masked_excerpts(
    echo_url: str,
) -> None:
    async def body(service: McpToolService, ledger: Ledger, running: Running) -> None:
        answered: list[tuple[dict[str, Any], int]] = []

        async def answer(result: dict[str, Any]) -> None:
            answered.append((result, len(ledger.rows)))

        who = Caller(ANONYMOUS, answer=answer)
        result = await service.call(who, "bench__echo", {"text": "mail " + EMAIL}, None)
        assert answered == [(result, 0)]  # answered while nothing was recorded yet
        assert EMAIL in json.dumps(result)  # the client gets the tool's own words
        assert len(ledger.rows) == 1 and ledger.rows[0].status == "ok"
        stored = evidence_of(ledger.rows[0])
        assert EMAIL not in stored
        assert '"arguments"' in stored and '"result"' in stored and "mail " in stored

        # Without an answer to hand it to, the call is recorded before it returns.
        plain = Caller(ANONYMOUS)
        result = await service.call(plain, "bench__echo", {"text": "to " + EMAIL}, None)
        assert EMAIL in json.dumps(result) and len(ledger.rows) == 2
        assert EMAIL not in evidence_of(ledger.rows[1])

        # A refusal answers nothing here: its caller sends the error; it is recorded.
        with pytest.raises(UnknownTool):
            await service.call(who, "bench__nope", {"text": EMAIL}, None)
        assert len(answered) == 1 and len(ledger.rows) == 3
        assert ledger.rows[2].status == "error"

    with_service(echo_url, body)


def test_a_task_cancel_ends_the_call_and_leaves_its_request_running(echo_url: str) -> None:
    async def body(service: McpToolService, ledger: Ledger, running: Running) -> None:
        who = Caller(ANONYMOUS, task_id="t-cancel")
        key = (ANONYMOUS.tenant_id, "t-cancel")

        async def request() -> str:
            try:
                await service.call(who, "bench__pause", {"ms": 5000}, None)
            except TaskCancelled:
                me = asyncio.current_task()
                assert me is not None and me.cancelling() == 0  # the request goes on
                await asyncio.sleep(0)
                return "task cancelled"
            return "ran"

        job = asyncio.ensure_future(request())
        deadline = time.monotonic() + 10
        while not running.running(key):
            assert time.monotonic() < deadline, "the call never started"
            await asyncio.sleep(0.01)
        assert len(running.stop(key)) == 1
        assert await asyncio.wait_for(job, 5) == "task cancelled"
        assert not job.cancelled()
        reasons = [d.reason for d in ledger.rows[0].ctx.decisions if d.stage == "tool_exec"]
        assert reasons == ["the task was cancelled"]
        assert not running.running(key)

    with_service(echo_url, body)


def test_a_stopped_request_stays_stopped(echo_url: str) -> None:
    async def body(service: McpToolService, ledger: Ledger, running: Running) -> None:
        job = asyncio.ensure_future(
            service.call(Caller(ANONYMOUS), "bench__pause", {"ms": 5000}, None)
        )
        deadline = time.monotonic() + 10
        while not service.servers.servers["bench"].in_flight:
            assert time.monotonic() < deadline, "the call never started"
            await asyncio.sleep(0.01)
        job.cancel()
        with pytest.raises(asyncio.CancelledError):
            await job
        assert ledger.rows[0].ctx.error_code == "cancelled"
        reasons = [d.reason for d in ledger.rows[0].ctx.decisions if d.stage == "tool_exec"]
        assert reasons == ["the request was stopped"]

    with_service(echo_url, body)
