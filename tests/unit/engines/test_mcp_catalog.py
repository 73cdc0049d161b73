"""What a tool server's tools/list may put in the catalog every /mcp client is handed."""

from __future__ import annotations

import logging
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from switchyard.engines.mcp_servers import MAX_CATALOG_BYTES, MAX_TOOLS, bounded_catalog


def _tool(name: str, description: str = "") -> tuple[str, dict[str, Any]]:
    return name, {"name": name, "description": description, "inputSchema": {"type": "object"}}


def test_tools_past_the_count_or_size_bound_are_left_out_and_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    many = [_tool(f"t{i}") for i in range(MAX_TOOLS + 5)]
    with caplog.at_level(logging.WARNING, "switchyard.mcp"):
        kept = bounded_catalog("s", many)
    assert list(kept) == [f"t{i}" for i in range(MAX_TOOLS)]  # the first, in order
    assert "5 listed tools left out" in caplog.text
    big = [_tool(f"b{i}", "d" * 100_000) for i in range(50)]
    kept = bounded_catalog("s", big)
    assert 0 < len(kept) < 50 and len(kept) * 100_000 <= MAX_CATALOG_BYTES


@settings(max_examples=200, deadline=None)
@given(st.lists(st.text(max_size=140), max_size=30))
def test_only_names_the_specification_allows_are_kept_once(names: list[str]) -> None:
    kept = bounded_catalog("s", [_tool(n) for n in names])
    valid = [
        n
        for n in dict.fromkeys(names)
        if 0 < len(n) <= 128 and all(c.isascii() and (c.isalnum() or c in "_.-") for c in n)
    ]
    assert list(kept) == valid
    assert all(kept[n]["name"] == n for n in kept)
