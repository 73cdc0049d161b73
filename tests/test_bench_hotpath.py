"""`switchyard bench hotpath`: drives both apps for real and refuses a broken path."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from switchyard.bench.hotpath import Driver


def test_hotpath_measures_both_apps_and_writes_a_result(tmp_path: Path) -> None:
    out = tmp_path / "hotpath.json"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "switchyard.bench.hotpath",
            "--requests",
            "400",
            "--blocks",
            "2",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "switchyard's own work" in done.stdout
    result = json.loads(out.read_text())
    for target in ("switchyard_us", "floor_us"):
        blocks = result["timed"][target]["blocks"]
        assert len(blocks) == 2 and all(b > 0 for b in blocks)
    assert result["workload"] == {"requests": 400, "blocks": 2, "tokens": 16}
    assert result["instructions"] is None  # not asked for


def test_driver_refuses_answers_that_are_not_200() -> None:
    """A path that fails fast must not be reported as a fast path."""

    async def broken(scope: dict[str, Any], receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 502, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    driver = Driver(b"{}")
    asyncio.run(driver.drive(broken, 3))
    with pytest.raises(RuntimeError, match="502"):
        driver.check()
