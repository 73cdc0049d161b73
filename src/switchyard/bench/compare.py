"""`switchyard bench compare A.json B.json`: every metric side by side, with B/A ratios.

A ratio is only meaningful when both runs used the same workload and load shape, so the
comparison says so loudly when they did not, instead of silently comparing apples with a
different tree.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import orjson
from rich.console import Console
from rich.table import Table

from switchyard.bench.report import flat_metrics

SAME = ("workload", "load", "goodput_slo", "sampling")


def load_result(path: str) -> dict[str, Any]:
    data = orjson.loads(Path(path).read_bytes())
    if not isinstance(data, dict) or "points" not in data or "metadata" not in data:
        raise ValueError(f"{path}: not a `bench run` result")
    return data


def differences(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    """Metadata sections that differ between the runs (same shape is the fair case)."""
    ma, mb = a["metadata"], b["metadata"]
    return [k for k in SAME if ma.get(k) != mb.get(k)]


def ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or a == 0:
        return None
    return b / a


def rows(a: dict[str, Any], b: dict[str, Any]) -> list[tuple[str, str, float | None, float | None]]:
    """(point label, metric, A, B) for every metric of every point pair, matched by
    position in the sweep."""
    out = []
    for pa, pb in zip(a["points"], b["points"], strict=False):
        label = pa["label"] if pa["label"] == pb["label"] else f"{pa['label']} vs {pb['label']}"
        fa, fb = flat_metrics(pa), flat_metrics(pb)
        for key in fa:
            out.append((label, key, fa.get(key), fb.get(key)))
    return out


def _fmt(v: float | None) -> str:
    if v is None:
        return "-"
    return f"{v:,.0f}" if float(v).is_integer() else f"{v:,.3f}"


def compare(path_a: str, path_b: str, console: Console) -> int:
    a, b = load_result(path_a), load_result(path_b)
    name_a = a["metadata"].get("label") or Path(path_a).parent.name or path_a
    name_b = b["metadata"].get("label") or Path(path_b).parent.name or path_b
    table = Table(title=f"A = {name_a}   B = {name_b}")
    for col, justify in (
        ("point", "left"),
        ("metric", "left"),
        ("A", "right"),
        ("B", "right"),
        ("B/A", "right"),
    ):
        table.add_column(col, justify=justify)  # type: ignore[arg-type]
    for label, key, va, vb in rows(a, b):
        r = ratio(va, vb)
        table.add_row(label, key, _fmt(va), _fmt(vb), "-" if r is None else f"{r:.2f}x")
    console.print(table)
    for side, meta in (("A", a["metadata"]), ("B", b["metadata"])):
        console.print(
            f"{side}: {meta['endpoint']} model={meta['model']} revisions={meta.get('revisions')}"
        )
    diff = differences(a, b)
    if diff:
        console.print(
            f"[yellow]warning[/]: the runs differ in {', '.join(diff)}; ratios compare different things"
        )
    if len(a["points"]) != len(b["points"]):
        console.print("[yellow]warning[/]: the runs have different numbers of points")
    return 0


def add_compare_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("a", help="baseline result.json")
    p.add_argument("b", help="candidate result.json")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    console = Console()
    try:
        return compare(args.a, args.b, console)
    except (OSError, ValueError) as exc:
        console.print(f"[red]bench compare:[/] {exc}")
        return 2
