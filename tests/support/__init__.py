"""Helpers shared by the tests, one module per concern: processes and ports
(`procs`), gateways (`gateways`), upstreams (`upstreams`), Redis and PostgreSQL servers
(`redis_server`, `postgres_server`), store contents (`stores`), the determinism command
(`determinism`), deployments and data built in process (`deployments`, `pair_data`),
the repository's paths (`paths`), protocol helpers (`chat_replies`, `mcp_http`,
`mcp_sessions`) and the MCP tool server the tests start (`mcp_tool_server`, run as a
script).

Import them as `from support.procs import free_port`: tests/ is on `sys.path` because
tests/conftest.py sits there (pytest's default "prepend" import mode). Fixtures and hooks
stay in tests/conftest.py."""
