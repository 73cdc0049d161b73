"""The documentation site's reference pages, generated from the code at build time.

`docs/hooks.py` (MkDocs) replaces a marker line `<!-- reference: NAME -->` in a page
with `PAGES[NAME]()`: the configuration from the settings schema (`config.Settings`,
each key's type, default and description), the errors from their classes and raise
sites (read from the source, so nothing is imported that a build does not need), the
CLI from its argument parser, the routes from the OpenAPI description the gateway
serves, and the headers from `reference_headers.yaml`, which tests/integration/test_docs.py checks
against every header name the code reads or writes. Nothing here runs on a request.
"""

from __future__ import annotations

import argparse
import ast
import json
import types
import typing
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel
from pydantic_core import PydanticUndefined

SOURCE = Path(__file__).resolve().parent


def _cell(text: Any) -> str:
    """A markdown table cell: one line, pipes escaped."""
    return " ".join(str(text).split()).replace("|", "\\|")


# -- configuration ---------------------------------------------------------------------


def _models_in(annotation: Any) -> list[type[BaseModel]]:
    """The settings models an annotation holds (in a list, a mapping, a union)."""
    out: list[type[BaseModel]] = []
    stack = [annotation]
    while stack:
        t = stack.pop(0)
        if isinstance(t, type) and issubclass(t, BaseModel):
            out.append(t)
        else:
            stack.extend(typing.get_args(t))
    return out


def type_name(annotation: Any) -> str:
    """A reader's name for a field's type."""
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if annotation is type(None):
        return "null"
    if origin is Literal:
        return " \\| ".join(json.dumps(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(type_name(a) for a in args)
    if origin is typing.Annotated:
        return type_name(args[0])
    if origin in (list, tuple, set, frozenset) or annotation in (list, tuple):
        inner = type_name(args[0]) if args else "any"
        return f"list of {inner}"
    if origin is dict or annotation is dict:
        return f"map of {type_name(args[1])}" if len(args) == 2 else "map"
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return "object"
    names = {str: "string", int: "integer", float: "number", bool: "boolean"}
    if annotation in names:
        return names[annotation]
    if annotation is Any:
        return "any"
    return getattr(annotation, "__name__", str(annotation))


def _default(field: Any) -> str:
    if field.is_required():
        return "required"
    value = field.default
    if value is PydanticUndefined and field.default_factory is not None:
        value = field.default_factory()
    if isinstance(value, BaseModel):
        return "(see below)"
    text = json.dumps(value, default=str)
    return f"`{text}`" if len(text) <= 48 else f"`{text[:45]}...`"


@dataclass(frozen=True)
class Setting:
    key: str  # dotted, `[]` for list items, `{name}` for map values
    type: str
    default: str
    description: str


def _list_like(annotation: Any) -> str:
    """The key suffix for the items a field holds: `[]`, `{name}` or nothing."""
    stack = [annotation]
    while stack:
        t = stack.pop()
        origin = typing.get_origin(t)
        if origin in (list, tuple, set):
            return "[]"
        if origin is dict:
            return "{name}"
        stack.extend(typing.get_args(t))
    return ""


def settings_rows(model: type[BaseModel], prefix: str = "") -> Iterator[Setting]:
    """Every key of `model`, depth first, in declaration order."""
    for name, field in model.model_fields.items():
        key = prefix + (field.alias or name)
        annotation = field.annotation
        yield Setting(
            key,
            type_name(annotation),
            _default(field),
            (field.description or "").strip(),
        )
        inner = _models_in(annotation)
        suffix = _list_like(annotation)
        for sub in inner:
            label = key + suffix
            kind = sub.model_fields.get("kind")
            if len(inner) > 1 and kind is not None and typing.get_args(kind.annotation):
                label += f" (kind: {typing.get_args(kind.annotation)[0]})"
            yield from settings_rows(sub, label + ".")


def configuration() -> str:
    from switchyard.config import Settings

    out = [
        "Every key of the YAML configuration, generated from the settings schema "
        "(`src/switchyard/config/`). `[]` marks the items of a list, `{name}` the "
        "values of a map; a key's parent must be present for it to apply. Unknown "
        "keys are refused by `switchyard check-config` and at start.",
        "",
    ]
    for name, field in Settings.model_fields.items():
        rows = list(settings_rows(Settings, ""))
        rows = [r for r in rows if r.key == name or r.key.startswith((f"{name}.", f"{name}["))]
        out += [f"## `{name}`", "", (field.description or "").strip(), ""]
        sub = [r for r in rows if r.key != name]
        if not sub:
            out += [f"Type: {rows[0].type}; default: {rows[0].default}.", ""]
            continue
        out += ["| key | type | default | description |", "|---|---|---|---|"]
        out += [
            f"| `{_cell(r.key)}` | {_cell(r.type)} | {_cell(r.default)} | {_cell(r.description)} |"
            for r in sub
        ]
        out.append("")
    return "\n".join(out)


# -- errors ----------------------------------------------------------------------------


@dataclass
class ErrorClass:
    name: str
    module: str
    bases: list[str]
    attrs: dict[str, Any]
    doc: str
    codes: dict[str, set[str]]  # code passed at a raise site -> the modules raising it


def _sources() -> Iterator[tuple[str, ast.Module]]:
    for path in sorted(SOURCE.rglob("*.py")):
        module = ".".join(path.relative_to(SOURCE.parent).with_suffix("").parts)
        yield module, ast.parse(path.read_text(encoding="utf-8"))


def error_classes() -> list[ErrorClass]:
    """Every class a client may see an error of (SwitchyardError and its subclasses,
    wherever they are defined), with the codes its raise sites pass."""
    found: dict[str, ErrorClass] = {}
    trees = list(_sources())
    for module, tree in trees:
        for node in ast.walk(tree):
            if not isinstance(node, ast.ClassDef):
                continue
            attrs = {}
            for item in node.body:
                if isinstance(item, ast.Assign):
                    target: ast.expr = item.targets[0]
                elif isinstance(item, ast.AnnAssign):
                    target = item.target
                else:
                    continue
                if isinstance(target, ast.Name) and isinstance(item.value, ast.Constant):
                    attrs[target.id] = item.value.value
            bases = [
                b.id if isinstance(b, ast.Name) else getattr(b, "attr", "") for b in node.bases
            ]
            found[node.name] = ErrorClass(
                node.name, module, bases, attrs, ast.get_docstring(node) or "", {}
            )

    def is_error(name: str, depth: int = 0) -> bool:
        if name == "SwitchyardError":
            return True
        cls = found.get(name)
        return cls is not None and depth < 20 and any(is_error(b, depth + 1) for b in cls.bases)

    errors = {n: c for n, c in found.items() if is_error(n)}
    for module, name, code in raise_site_codes(trees, set(errors)):
        errors[name].codes.setdefault(code, set()).add(module)
    return sorted(errors.values(), key=lambda c: (c.name != "SwitchyardError", c.name))


def raise_site_codes(
    trees: Iterable[tuple[str, ast.Module]], error_names: set[str]
) -> Iterator[tuple[str, str, str]]:
    """(module, class, code) of each call of an error class that passes its own `code`:
    a string as written, or an f-string with `*` for each part filled in at run time."""
    for module, tree in trees:
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call):
                continue
            fn = node.func
            name = fn.id if isinstance(fn, ast.Name) else getattr(fn, "attr", None)
            if name not in error_names:
                continue
            for kw in node.keywords:
                if kw.arg != "code":
                    continue
                if isinstance(kw.value, ast.Constant) and isinstance(kw.value.value, str):
                    yield module, name, kw.value.value
                elif isinstance(kw.value, ast.JoinedStr):
                    yield (
                        module,
                        name,
                        "".join(
                            str(v.value) if isinstance(v, ast.Constant) else "*"
                            for v in kw.value.values
                        ),
                    )


def http_layer_errors() -> list[tuple[int, str, str, str]]:
    """(status, type, code, module) of each error the HTTP layer writes itself, before
    a request exists (`error_bytes(status, message, type, code[, url])` in
    api/server.py; the url picks the route's shape, not the code)."""
    out = []
    for module, tree in _sources():
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id == "error_bytes"
                and len(node.args) in (4, 5)
            ):
                status, _, kind, code = node.args[:4]
                if all(isinstance(a, ast.Constant) for a in (status, kind, code)):
                    out.append((status.value, kind.value, code.value, module))  # type: ignore[attr-defined]
    return sorted(set(out))


def _inherited(cls: ErrorClass, attr: str, by_name: dict[str, ErrorClass]) -> Any:
    seen = 0
    while cls is not None and seen < 20:
        if attr in cls.attrs:
            return cls.attrs[attr]
        cls = next((by_name[b] for b in cls.bases if b in by_name), None)  # type: ignore[assignment]
        seen += 1
    return None


def errors() -> str:
    classes = error_classes()
    by_name = {c.name: c for c in classes}
    rows = []
    for c in classes:
        status, kind = _inherited(c, "status", by_name), _inherited(c, "type", by_name)
        own = _inherited(c, "code", by_name)
        first = c.doc.split("\n\n")[0] if c.doc else ""
        rows.append((status, kind, own, c, first, "class default"))
        for code, modules in sorted(c.codes.items()):
            if code != own:
                where = ", ".join(f"`{m.removeprefix('switchyard.')}`" for m in sorted(modules))
                rows.append((status, kind, code, c, "", f"raised in {where}"))
    rows.sort(key=lambda r: (r[0] or 0, r[2] or ""))
    out = [
        "Every error a client can receive is a JSON body "
        '`{"error": {"message", "type", "param", "code"}}` with the status below; '
        "`message` is stable text with no exception details, `param` names the field or "
        "header at fault. Generated from the error classes in `src/switchyard/errors.py` "
        "and from the raise sites that build a code at run time (`*` stands for the "
        "part filled in then).",
        "",
        "| status | type | code | class | meaning / where |",
        "|---|---|---|---|---|",
    ]
    for status, kind, code, c, first, where in rows:
        meaning = first if where == "class default" else where
        out.append(f"| {status} | `{kind}` | `{_cell(code)}` | `{c.name}` | {_cell(meaning)} |")
    out += [
        "",
        "## Written by the HTTP layer",
        "",
        "Before a request exists (too many connections, headers too large or too late, "
        "broken framing) the connection's protocol answers itself and closes the "
        "connection; these have no usage row.",
        "",
        "| status | type | code | written in |",
        "|---|---|---|---|",
    ]
    for status, kind, code, module in http_layer_errors():
        out.append(f"| {status} | `{kind}` | `{code}` | `{module.removeprefix('switchyard.')}` |")
    return "\n".join(out) + "\n"


# -- headers ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Header:
    name: str
    direction: Literal["request", "response", "both"]
    meaning: str


def _headers() -> tuple[Header, ...]:
    """The header table (reference_headers.yaml: direction -> name -> meaning)."""
    table = yaml.safe_load((SOURCE / "reference_headers.yaml").read_text(encoding="utf-8"))
    return tuple(
        Header(name, direction, meaning)
        for direction in ("request", "both", "response")
        for name, meaning in table[direction].items()
    )


HEADERS: tuple[Header, ...] = _headers()


def headers() -> str:
    out = [
        "Every header the gateway reads or writes. Each request header is bounded and "
        "validated where it is read (`src/switchyard/policy/headers.py`): a value out of "
        "its bounds is refused with 400 `invalid_header` naming it; request line and "
        "headers together are limited by `server.max_header_bytes` (431).",
        "",
    ]
    for direction, title in (
        ("request", "Request headers"),
        ("both", "Both ways"),
        ("response", "Response headers"),
    ):
        rows = [h for h in HEADERS if h.direction == direction]
        out += [f"## {title}", "", "| header | meaning |", "|---|---|"]
        out += [f"| `{h.name}` | {_cell(h.meaning)} |" for h in rows]
        out.append("")
    return "\n".join(out)


# -- CLI -------------------------------------------------------------------------------


def _commands(
    parser: argparse.ArgumentParser, path: str
) -> Iterator[tuple[str, argparse.ArgumentParser, str]]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {a.dest: a.help or "" for a in action._choices_actions}
            for name, sub in action.choices.items():
                yield f"{path} {name}", sub, helps.get(name, "")
                yield from _commands(sub, f"{path} {name}")


def cli() -> str:
    from switchyard.cli import build_parser

    out = [
        "Every command of `switchyard`, generated from its argument parser "
        "(`src/switchyard/cli/`). `switchyard COMMAND --help` prints the same.",
        "",
    ]
    for path, parser, help_ in _commands(build_parser(), "switchyard"):
        options = [
            a
            for a in parser._actions
            if not isinstance(a, argparse._SubParsersAction | argparse._HelpAction)
        ]
        has_sub = any(isinstance(a, argparse._SubParsersAction) for a in parser._actions)
        if has_sub and not options:
            out += [f"## `{path}`", "", _cell(help_ or parser.description or ""), ""]
            continue
        out += [f"## `{path}`", "", _cell(help_ or parser.description or ""), ""]
        if not options:
            continue
        out += ["| argument | default | meaning |", "|---|---|---|"]
        for a in options:
            name = ", ".join(a.option_strings) if a.option_strings else a.dest
            if a.option_strings and a.choices:
                name += " {" + ",".join(str(c) for c in a.choices) + "}"
            default = (
                ""
                if a.default in (None, argparse.SUPPRESS) or a.option_strings == []
                else f"`{a.default}`"
            )
            if a.required:
                default = "required"
            out.append(f"| `{_cell(name)}` | {_cell(default)} | {_cell(a.help or '')} |")
        out.append("")
    return "\n".join(out)


# -- routes ----------------------------------------------------------------------------


def openapi_paths() -> dict[str, Any]:
    """The paths of the served OpenAPI description: the model routes and the admin
    API (as `/openapi.json` has them, for a gateway with no models configured)."""
    from switchyard.api.admin import build_admin_routes
    from switchyard.api.openapi import admin_routes, model_routes
    from switchyard.config import AuthConfig

    class _Described:  # all build_admin_routes reads when it builds the table
        settings = types.SimpleNamespace(auth=AuthConfig())
        metrics = None

    return {
        **model_routes([], []),
        **admin_routes(build_admin_routes(_Described())),  # type: ignore[arg-type]
    }


def api() -> str:
    out = [
        "The routes the gateway serves, generated from the OpenAPI description it serves "
        "at `GET /openapi.json` (`src/switchyard/api/openapi.py`). Model routes take an "
        "API key (`Authorization: Bearer sk-...`); admin routes the admin key (the "
        "environment variable `auth.admin_key_env` names) or the console's session. "
        "Besides these: `GET /healthz` (liveness), `GET /readyz` (readiness: states; "
        "upstream addresses only with the admin key), `GET /metrics` (Prometheus; the "
        "admin key unless `observe.metrics_public`) and `/console`.",
        "",
    ]
    for title, prefix in (("Model routes", "/v1/"), ("MCP", "/mcp"), ("Admin API", "/admin/")):
        out += [f"## {title}", "", "| method | path | what |", "|---|---|---|"]
        for path, item in openapi_paths().items():
            if not path.startswith(prefix):
                continue
            for method, op in item.items():
                if method == "parameters":
                    continue
                out.append(
                    f"| {method.upper()} | `{_cell(path)}` | {_cell(op.get('summary', ''))} |"
                )
        out.append("")
    return "\n".join(out)


PAGES: dict[str, Callable[[], str]] = {
    "configuration": configuration,
    "errors": errors,
    "headers": headers,
    "cli": cli,
    "api": api,
}
