"""The bench modules' imports run one way: `harness` at the bottom, no cycles, and no
module reaching into a sibling's private names.

Imports are read with `ast` from the source files, function bodies included, so an
import moved into a function to dodge a cycle still counts as an edge.
"""

from __future__ import annotations

import ast
from pathlib import Path

from support.paths import REPO

BENCH_DIR = REPO / "src" / "switchyard" / "bench"
PACKAGE = "switchyard.bench"
BOTTOM = "harness"


def _imports(path: Path, package: str, siblings: set[str]) -> list[tuple[str, str | None]]:
    """(sibling module, imported name or None for the module itself), for every import
    of a sibling anywhere in `path`."""
    out: list[tuple[str, str | None]] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith(package + "."):
                    out.append((alias.name[len(package) + 1 :].split(".")[0], None))
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: one dot is this package
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                module = f"{base}.{node.module}" if node.module else base
            else:
                module = node.module or ""
            if module == package:  # from switchyard.bench import x, y
                out += [(a.name, None) for a in node.names if a.name in siblings]
            elif module.startswith(package + "."):
                sibling = module[len(package) + 1 :].split(".")[0]
                out += [(sibling, a.name) for a in node.names]
    return out


def import_graph(bench_dir: Path, package: str = PACKAGE) -> dict[str, dict[str, set[str]]]:
    """module -> {sibling it imports -> names it takes from it ("" for the module)}."""
    files = {p.stem: p for p in sorted(bench_dir.glob("*.py")) if p.stem != "__init__"}
    graph: dict[str, dict[str, set[str]]] = {m: {} for m in files}
    for module, path in files.items():
        for sibling, name in _imports(path, package, set(files)):
            if sibling != module:
                graph[module].setdefault(sibling, set()).add(name or "")
    return graph


def _cycle(graph: dict[str, dict[str, set[str]]]) -> list[str] | None:
    """One import cycle as a path that starts and ends at the same module, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        path.append(m)
        for n in sorted(graph.get(m, {})):
            if state.get(n) == 1:
                return [*path[path.index(n) :], n]
            if n not in state and (found := visit(n)) is not None:
                return found
        path.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (found := visit(m)) is not None:
            return found
    return None


def problems(bench_dir: Path, package: str = PACKAGE) -> list[str]:
    """Every way the bench import graph fails to run one way, in words."""
    graph = import_graph(bench_dir, package)
    # The bottom and its own parts (`harness_*`, which it re-exports) import no other
    # bench module.
    bottom = [m for m in graph if m == BOTTOM or m.startswith(BOTTOM + "_")]
    out = [
        f"{m} imports {sibling}"
        for m in bottom
        for sibling in sorted(graph.get(m, {}))
        if sibling not in bottom
    ]
    cycle = _cycle(graph)
    if cycle is not None:
        out.append("import cycle: " + " -> ".join(cycle))
    for module, deps in sorted(graph.items()):
        for sibling, names in sorted(deps.items()):
            out += [
                f"{module} imports private {name} from {sibling}"
                for name in sorted(names)
                if name.startswith("_") and not name.startswith("__")
            ]
    return out


def test_the_bench_import_graph_runs_one_way() -> None:
    assert (BENCH_DIR / f"{BOTTOM}.py").is_file()
    assert problems(BENCH_DIR) == []
    graph = import_graph(BENCH_DIR)
    # The shared helpers are where the process benches get them from.
    for module in ("overhead", "policy", "observe", "realistic", "soak", "hotpath"):
        assert BOTTOM in graph[module], module


def _package(tmp_path: Path, files: dict[str, str]) -> Path:
    d = tmp_path / "switchyard" / "bench"
    d.mkdir(parents=True)
    (d / "__init__.py").write_text("")
    for name, text in files.items():
        (d / f"{name}.py").write_text(text)
    return d


def test_a_late_import_that_closes_a_cycle_is_found(tmp_path: Path) -> None:
    d = _package(
        tmp_path,
        {
            "harness": "import json\n",
            "overhead": "from switchyard.bench.harness import x\n"
            "def run():\n    from switchyard.bench import policy\n",
            "policy": "from switchyard.bench.overhead import run\n",
        },
    )
    assert problems(d) == ["import cycle: overhead -> policy -> overhead"]


def test_a_relative_import_cycle_is_found(tmp_path: Path) -> None:
    d = _package(
        tmp_path,
        {
            "harness": "",
            "a": "from . import b\n",
            "b": "from .c import y\n",
            "c": "import switchyard.bench.a\n",
        },
    )
    assert problems(d) == ["import cycle: a -> b -> c -> a"]


def test_harness_importing_a_sibling_and_private_names_are_found(tmp_path: Path) -> None:
    d = _package(
        tmp_path,
        {
            "harness": "from switchyard.bench import tokens\n",
            "tokens": "",
            "soak": "from switchyard.bench.harness import _child_env, __version__, spawn\n",
        },
    )
    assert problems(d) == [
        "harness imports tokens",
        "soak imports private _child_env from harness",
    ]


def test_harness_may_import_its_own_parts_but_they_stay_at_the_bottom(tmp_path: Path) -> None:
    d = _package(
        tmp_path,
        {
            "harness": "from switchyard.bench.harness_machine import cpu_sample\n",
            "harness_machine": "from switchyard.bench import tokens\n",
            "tokens": "",
        },
    )
    assert problems(d) == ["harness_machine imports tokens"]
