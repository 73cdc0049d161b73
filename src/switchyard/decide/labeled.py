"""Reading the labelled JSONL files that the cache and router evaluations use.

One reader for both, so a malformed line is always reported the same way: the file,
the line number and what was expected — never skipped silently.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any


def read_jsonl(path: str | Path, fields: Mapping[str, type], what: str) -> list[dict[str, Any]]:
    """Objects of a JSONL file, each required to carry `fields` with those types."""
    shape = "{" + ", ".join(f'"{k}": {t.__name__}' for k, t in fields.items()) + "}"
    rows: list[dict[str, Any]] = []
    for n, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}:{n}: not valid JSON: {exc}") from None
        if not isinstance(row, dict) or not all(
            isinstance(row.get(k), t) for k, t in fields.items()
        ):
            raise ValueError(f"{path}:{n}: expected {shape}")
        rows.append(row)
    if not rows:
        raise ValueError(f"{path}: no {what}")
    return rows
