"""`switchyard determinism` run as a user runs it, and the checks its report must pass
on any engine kind (tests/integration/test_determinism.py on llama-server,
test_vllm_determinism.py on vLLM)."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import yaml


def run_determinism(model: dict[str, Any], timeout_s: float) -> tuple[int, dict[str, Any]]:
    """(exit status, JSON report) of the command over two prompts (a text, a chat)."""
    work = Path(tempfile.mkdtemp(prefix="determinism-"))
    (work / "config.yaml").write_text(
        yaml.safe_dump({"models": [model], "embeddings": {"enabled": False}})
    )
    chat = {"messages": [{"role": "user", "content": "Name a colour."}]}
    (work / "prompts.jsonl").write_text(
        "The capital of France is\n" + json.dumps(chat) + "\n", encoding="utf-8"
    )
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "switchyard",
            "determinism",
            "--model",
            model["alias"],
            "--config",
            str(work / "config.yaml"),
            "--prompts",
            str(work / "prompts.jsonl"),
            "--batches",
            "1,2",
            "--max-tokens",
            "8",
            "--json",
            "--out",
            str(work / "r.json"),
        ],
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
    assert out.returncode in (0, 1), out.stderr[-2000:]
    report = json.loads(out.stdout)
    assert json.loads((work / "r.json").read_text()) == report
    return out.returncode, report


def check_report(code: int, report: dict[str, Any], kind: str) -> None:
    assert report["engine"]["kind"] == kind and report["engine"]["version"]
    assert kind in report["guarantee"].lower() or kind == "llamacpp"
    assert report["hardware"]["cores"] and report["hardware"]["cpu"]
    cases = report["cases"]
    modes = {"greedy", "seeded", "seeded, full vocabulary"}
    assert {c["mode"] for c in cases} == modes
    kinds = {c["case"] for c in cases}
    assert kinds == {
        "alone, again",
        "batch of 2, first",
        "batch of 2, last",
        "batch of 2, joins mid-decode",
        "after restart",
    }
    # 3 modes x 2 prompts x (again + first + last + joins + restart)
    assert len(cases) == 3 * 2 * 5
    for c in cases:
        assert c["equal"] == (c["first_divergence"] is None)
        assert c["max_logprob_diff"] >= 0
    greedy_alone = [c for c in cases if c["mode"] == "greedy" and c["case"] == "alone, again"]
    assert all(c["equal"] for c in greedy_alone), greedy_alone
    assert (code == 0) == report["equal_all"] == all(c["equal"] for c in cases)
    assert sum(r["cases"] for r in report["summary"].values()) == len(cases)
