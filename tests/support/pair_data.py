"""Labelled question pairs, written as the files a cross-encoder build reads."""

from __future__ import annotations

import json
from pathlib import Path

from switchyard.decide import pair_encoder


def tiny_pair_data(d: Path) -> None:
    """A tiny training and validation set for a whole cross-encoder build."""
    d.mkdir()
    same = [("How do I reset my password?", "how can i reset my password")] * 4
    traps = [("How do I enable 2FA?", "How do I disable 2FA?")] * 4
    rows = [{"a": a, "b": b, "same_answer": True} for a, b in same]
    rows += [{"a": a, "b": b, "same_answer": False} for a, b in traps]
    for name in pair_encoder.TRAINING_SETS:
        (d / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    val = [
        {"a": "What is a VPN?", "b": "Explain what a VPN is", "same_answer": True},
        {"a": "How do I open a port?", "b": "How do I close a port?", "same_answer": False},
    ]
    (d / pair_encoder.VALIDATION_SET).write_text("".join(json.dumps(r) + "\n" for r in val))
