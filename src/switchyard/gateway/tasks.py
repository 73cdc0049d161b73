"""The MCP tool gateway (mcp.servers), whose governed tool calls count against the
agent tasks' store (budgets, deadlines, cancels; chosen by state/choose.py).
"""

from __future__ import annotations

from typing import Any

from switchyard.config import Settings
from switchyard.observe.metrics import Metrics
from switchyard.observe.otel import Tracing
from switchyard.policy.pii import PiiMasker
from switchyard.policy.stages import Reserver
from switchyard.policy.tasks import Running
from switchyard.state.store import Store
from switchyard.state.tasks import TaskStore


def build_mcp(
    settings: Settings,
    store: Store,
    tasks: TaskStore,
    running: Running,
    pii: PiiMasker,
    metrics: Metrics | None,
    tracing: Tracing | None,
    reserver: Reserver,
) -> Any:
    """The MCP tool gateway (mcp.servers): the servers and the governed tool calls."""
    if not settings.mcp.servers:
        return None
    from switchyard.engines.mcp_servers import McpServers
    from switchyard.mcp_service import McpToolService

    return McpToolService(
        settings,
        McpServers(settings.mcp.servers),
        store.tool_calls,
        store.consume_approval,
        tasks,
        running,
        store.ledger,
        pii.mask,
        metrics,
        tracing,
        reserver,
    )


__all__ = ["build_mcp"]
