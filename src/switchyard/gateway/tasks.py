"""Agent tasks and their tools: the task store (budgets, deadlines, cancels) and the
MCP tool gateway (mcp.servers) whose governed tool calls count against the same tasks.
"""

from __future__ import annotations

from typing import Any

from switchyard.config import Settings
from switchyard.observe.metrics import Metrics
from switchyard.observe.otel import Tracing
from switchyard.observe.store import Store
from switchyard.policy.pii import PiiMasker
from switchyard.policy.stages import Reserver
from switchyard.policy.tasks import MemoryTaskStore, Running, TaskStore


def build_tasks(settings: Settings) -> TaskStore:
    """The agent tasks' state: in Redis when shared, else in this process."""
    t = settings.tasks
    if settings.storage.redis_url:  # one task state for every gateway process
        from switchyard.policy.redis_tasks import RedisTaskStore

        return RedisTaskStore(
            settings.storage.redis_url,
            timeout_s=settings.storage.redis_timeout_s,
            idle_ttl_s=t.idle_ttl_s,
            max_calls=t.max_tool_calls,
            max_tasks=t.max_tasks,
        )
    return MemoryTaskStore(t.max_tasks, t.idle_ttl_s, t.max_tool_calls)


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
