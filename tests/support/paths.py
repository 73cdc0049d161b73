"""Paths the tests read from: the repository (examples, data, docs, sources) and the MCP
tool server script, wherever the test file itself sits under tests/."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
MCP_TOOL_SERVER = str(Path(__file__).with_name("mcp_tool_server.py"))
