"""The error hierarchy as `errors.py` draws it, and raise sites that name a class.

The module docstring of `switchyard.errors` draws every client-visible error class with
its status and code; these tests hold the drawing to the real classes, so it cannot go
stale, and hold every raise site to naming a class instead of passing `code="..."`.
"""

from __future__ import annotations

import ast
import inspect

import switchyard.errors as errors
from support.paths import REPO
from switchyard.errors import SwitchyardError
from switchyard.reference import raise_site_codes

SOURCE = REPO / "src" / "switchyard"

Row = tuple[str | None, str, str]  # (parent, status, code)


def _status(cls: type[SwitchyardError]) -> str:
    """The status a class answers with; "4xx" where its constructor takes one (the
    upstream's own, for `UpstreamStatusError`)."""
    if "status" in inspect.signature(cls.__init__).parameters:
        return "4xx"
    return str(cls.status)


def drawn_tree(doc: str) -> dict[str, Row]:
    """The tree the docstring draws: one class a line, two spaces per level under
    `SwitchyardError`, then its status and code."""
    lines = doc.splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip().startswith("SwitchyardError "))
    margin = len(lines[start]) - len(lines[start].lstrip())
    tree: dict[str, Row] = {}
    stack: list[str] = []
    for line in lines[start:]:
        if not line.strip():
            break
        depth, rest = divmod(len(line) - len(line.lstrip()) - margin, 2)
        assert rest == 0 and depth <= len(stack), f"misindented: {line!r}"
        name, status, code = line.split()
        assert name not in tree, f"drawn twice: {name}"
        del stack[depth:]
        tree[name] = (stack[-1] if stack else None, status, code)
        stack.append(name)
    return tree


def real_tree() -> dict[str, Row]:
    import switchyard.gateway  # noqa: F401  (every module that raises an error is loaded)

    tree: dict[str, Row] = {}
    todo: list[tuple[type[SwitchyardError], str | None]] = [(SwitchyardError, None)]
    while todo:
        cls, parent = todo.pop()
        assert cls.__name__ not in tree, f"two error classes named {cls.__name__}"
        tree[cls.__name__] = (parent, _status(cls), cls.code)
        todo.extend((sub, cls.__name__) for sub in cls.__subclasses__())
    return tree


def test_the_docstring_draws_the_real_class_tree() -> None:
    assert errors.__doc__ is not None
    drawn, real = drawn_tree(errors.__doc__), real_tree()
    missing = {n: real[n] for n in real.keys() - drawn.keys()}
    stale = {n: drawn[n] for n in drawn.keys() - real.keys()}
    assert missing == {}, "classes the docstring does not draw (name: parent, status, code)"
    assert stale == {}, "classes the docstring draws that do not exist"
    wrong = {n: (drawn[n], real[n]) for n in real if drawn[n] != real[n]}
    assert wrong == {}, "drawn (parent, status, code) vs the class's"


def test_the_tree_reader_sees_a_misplaced_class() -> None:
    doc = "x\n\n    SwitchyardError  500  internal_error\n      A  400  a\n        B  400  b\n"
    assert drawn_tree(doc)["B"] == ("A", "400", "b")
    moved = doc.replace("        B", "      B")
    assert drawn_tree(moved)["B"] == ("SwitchyardError", "400", "b")


def literal_codes(source: str, error_names: set[str]) -> list[tuple[str, str]]:
    """(class, code) of each call of an error class in `source` that passes a literal
    `code="..."` (the error reference's own scan; a computed code is left alone)."""
    found = raise_site_codes([("source", ast.parse(source))], error_names)
    return [(cls, code) for _, cls, code in found if "*" not in code]


def _error_names() -> set[str]:
    return set(real_tree())


def test_no_raise_site_passes_its_own_code_string() -> None:
    names = _error_names()
    found = []
    for path in sorted(SOURCE.rglob("*.py")):
        if path == SOURCE / "errors.py":
            continue
        for cls, code in literal_codes(path.read_text("utf-8"), names):
            found.append(f"{path.relative_to(SOURCE)}: {cls}(code={code!r})")
    assert found == [], "name a class in errors.py for each code instead"


def test_the_scan_finds_a_literal_code_and_leaves_a_computed_one() -> None:
    source = (
        "raise InvalidRequest('bad', param='x', code='made_up')\n"
        "err = errors.RateLimited('slow', code='also_made_up')\n"
        "raise UpstreamError(what, code=exc.code)\n"
        "raise RateLimited('slow', code=f'rate_limit_{scope}')\n"
        "raise Other('not an error class', code='fine')\n"
    )
    assert sorted(literal_codes(source, _error_names())) == [
        ("InvalidRequest", "made_up"),
        ("RateLimited", "also_made_up"),
    ]
