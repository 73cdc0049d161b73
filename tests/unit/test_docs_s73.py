"""What a newcomer copies from the README, the guides and examples/ works as shown.

tests/integration/test_docs.py builds the site and checks the YAML blocks and the fenced
`switchyard` command lines; these checks cover what it leaves out: every file in
examples/ (sub-folders too) read by the loader that reads it, the command lines in the
examples' comments, every `--flag` named anywhere next to a `switchyard` command (prose
included), every gateway path the pages name against the routes the real app serves,
the port of the curl examples, the README's links and anchors (the README is outside
the MkDocs site, so `--strict` never sees it), and that the HTTP API reference names
every route the app serves."""

from __future__ import annotations

import argparse
import re
import shlex
from pathlib import Path
from typing import Any

import markdown
import pytest
import yaml

from support.paths import REPO
from switchyard import reference
from switchyard.api.app import create_app
from switchyard.api.mcp import PATH as MCP_PATH
from switchyard.bench.agent import load_graphs
from switchyard.bench.scheduling_workload import load_workload
from switchyard.bench.workloads import load_jsonl
from switchyard.cli import build_parser
from switchyard.config import Settings, load_settings

EXAMPLES = REPO / "examples"
# The pages a user reads for what to type. The dated benchmark pages are records of a
# past run (their commands are that day's), so they are left out.
PAGES = [
    REPO / "README.md",
    *sorted(
        p
        for p in (REPO / "docs").rglob("*.md")
        if not re.match(r"\d{4}-\d\d-\d\d-|overhead-history", p.name)
    ),
]
EXAMPLE_FILES = sorted(EXAMPLES.rglob("*.yaml"))
# vLLM's own routes, which the engine guides name as the engine's (engines/vllm.py).
ENGINE_PATHS = {"/v1/load_lora_adapter", "/v1/unload_lora_adapter"}
DEFAULT_PORT = Settings.model_fields["server"].default.port


def _rel(path: Path) -> str:
    return str(path.relative_to(REPO))


# --- examples/: every file loads with its own loader ---------------------------------


def _kind(data: Any) -> str:
    if isinstance(data, dict) and isinstance(data.get("scheduling"), dict):
        return "scheduling"  # `bench run --agent-tasks F --schedulers ...`
    if isinstance(data, dict) and isinstance(data.get("tasks"), list):
        return "agent-tasks"  # `bench run --agent-tasks F`
    return "config"


def test_every_example_file_loads_with_the_loader_that_reads_it() -> None:
    kinds: dict[str, list[str]] = {}
    for path in EXAMPLE_FILES:
        docs = list(yaml.safe_load_all(path.read_text("utf-8")))
        if len(docs) > 1 or (docs and isinstance(docs[0], dict) and "apiVersion" in docs[0]):
            # Kubernetes manifests (tests/integration/test_ray.py checks their contents)
            assert all(d["apiVersion"] and d["kind"] for d in docs if d), _rel(path)
            kinds.setdefault("manifest", []).append(_rel(path))
            continue
        kind = _kind(docs[0])
        if kind == "scheduling":
            workload = load_workload(str(path))
            assert workload.graph.steps and workload.loads, _rel(path)
        elif kind == "agent-tasks":
            graphs = load_graphs(str(path))
            assert graphs and all(g.steps for g in graphs), _rel(path)
        else:
            settings = load_settings(path)  # the gateway's own loader, checks included
            assert settings.models, _rel(path)
        kinds.setdefault(kind, []).append(_rel(path))
    # each kind is really there (a loader that is never reached checks nothing)
    assert "examples/kuberay/switchyard.yaml" in kinds["config"]
    assert len(kinds["config"]) >= 10
    assert kinds["scheduling"] and kinds["agent-tasks"] and kinds["manifest"]
    dataset = load_jsonl(str(EXAMPLES / "bench" / "prompts.jsonl"), 64, 0)
    assert dataset


# --- command lines ----------------------------------------------------------------


def _example_comment_commands() -> list[tuple[str, str]]:
    out = []
    for path in EXAMPLE_FILES:
        lines = [line.partition("#")[2].strip() for line in path.read_text("utf-8").splitlines()]
        for comment in "\n".join(lines).replace("\\\n", " ").splitlines():
            m = re.match(r"(?:[A-Z_]+=\S+ )*(?:\.venv/bin/)?switchyard (.*)", comment)
            if m:
                out.append((_rel(path), m.group(1).split(" # ")[0].strip()))
    return out


def test_the_commands_in_the_examples_comments_parse() -> None:
    parser = build_parser()
    commands = _example_comment_commands()
    assert len(commands) >= 8
    bad = []
    for where, args in commands:
        if "..." in args:  # arguments left out on purpose
            continue
        argv = re.split(r"\s(?:2?>|&)", f" {args}")[0].split()  # the command, not its redirects
        argv = shlex.split(" ".join(argv))
        try:
            parser.parse_args(argv)
        except SystemExit as exc:
            if exc.code != 0:
                bad.append(f"{where}: switchyard {args}")
    assert bad == []


def _subparser(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser | None:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction) and name in action.choices:
            sub: argparse.ArgumentParser = action.choices[name]
            return sub
    return None


def _options(parser: argparse.ArgumentParser) -> set[str]:
    return {o for a in parser._actions for o in a.option_strings}


def test_every_flag_named_with_a_switchyard_command_exists() -> None:
    """Prose and comments too: `switchyard cost --since 30d [--config FILE]` is not a
    full command line, but each flag it names must be one the command takes."""
    top = build_parser()
    checked, bad = 0, []
    for path in [*PAGES, *EXAMPLE_FILES]:
        text = path.read_text("utf-8").replace("\\\n", " ")
        for m in re.finditer(r"\bswitchyard ((?:[a-z][a-z-]* ?){1,3})([^\n`]*)", text):
            words, rest = m.group(1).split(), m.group(2)
            parser, used = top, 0
            for word in words:
                sub = _subparser(parser, word)
                if sub is None:
                    break
                parser, used = sub, used + 1
            if used == 0:
                continue
            tail = " ".join(words[used:]) + " " + rest.split(" | ")[0].split(" # ")[0]
            for flag in re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", tail):
                checked += 1
                if flag not in _options(parser):
                    bad.append(f"{_rel(path)}: {parser.prog} has no {flag}: {m.group(0)[:100]}")
    assert bad == []
    assert checked >= 50


def test_every_make_target_named_in_prose_or_comments_exists() -> None:
    """`make serve CONFIG=...` in a sentence or a YAML comment, not only in a code block."""
    targets = set(re.findall(r"^([a-z][a-z-]*):", (REPO / "Makefile").read_text(), re.M))
    named = []
    for path in [*PAGES, *EXAMPLE_FILES]:
        text = path.read_text("utf-8")
        found = re.findall(r"`make ([a-z][a-z-]*)", text)
        if path.suffix == ".yaml":
            found += re.findall(r"#\s*make ([a-z][a-z-]*)", text)
        named += [(_rel(path), t) for t in found]
    assert [f"{where}: make {t}" for where, t in named if t not in targets] == []
    assert len(named) >= 15


# --- HTTP paths and ports -----------------------------------------------------------


@pytest.fixture(scope="module")
def served() -> set[str]:
    """The paths the real app serves, with MCP on (it is mounted only with servers)."""
    settings = Settings(
        models=[{"alias": "m", "engine": {"kind": "openai", "base_url": "http://127.0.0.1:9/v1"}}],
        mcp={"servers": [{"name": "s", "url": "http://127.0.0.1:9/mcp"}]},
        storage={"backend": "memory"},
    )
    app = create_app(settings)
    paths = {p for r in app.router.routes if (p := getattr(r, "path", None))}
    assert app.mcp is not None
    return paths | {MCP_PATH}


def _matcher(paths: set[str]) -> re.Pattern[str]:
    def one(path: str) -> str:
        out = ""
        for part in re.split(r"(\{[^}]*\})", path):
            if part.startswith("{"):
                out += ".+" if part.endswith(":path}") else "[^/]+"
            else:
                out += re.escape(part)
        return out

    return re.compile("|".join(f"(?:{one(p)})" for p in sorted(paths)))


def test_every_gateway_path_the_pages_name_is_served(served: set[str]) -> None:
    match = _matcher(served | ENGINE_PATHS)
    checked, bad = 0, []
    for path in [*PAGES, *EXAMPLE_FILES]:
        for m in re.finditer(
            r"(?<![\w.])(/(?:v1|admin)/[A-Za-z0-9_{}.:/<>$-]*[A-Za-z0-9_}>])", path.read_text()
        ):
            # placeholders as the pages write them: {id}, <alias>, $FIRST
            name = re.sub(r"<[^>]*>|\$\w+", "x", m.group(1))
            checked += 1
            if not match.fullmatch(name):
                bad.append(f"{_rel(path)}: {m.group(1)}")
    assert bad == []
    assert checked >= 100


def _curl_lines() -> list[tuple[str, str]]:
    out = []
    for path in [*PAGES, *EXAMPLE_FILES]:
        lines = path.read_text("utf-8").splitlines()
        if path.suffix == ".yaml":  # the comments' commands
            lines = [line.partition("#")[2].strip() for line in lines]
        for line in "\n".join(lines).replace("\\\n", " ").splitlines():
            line = line.strip().removeprefix("$ ")
            if re.match(r"curl\s", line):
                out.append((_rel(path), line))
    return out


def test_the_curl_examples_call_the_gateway_where_it_listens() -> None:
    """The gateway listens on server.port (8000) unless a page says otherwise; a curl to
    one of its paths on another port answers "connection refused"."""
    checked, bad = 0, []
    for where, line in _curl_lines():
        for host, port, route in re.findall(
            r"(localhost|127\.0\.0\.1)(?::(\d+))?(/(?:v1|admin|metrics|mcp)\S*)", line
        ):
            checked += 1
            if port != str(DEFAULT_PORT):
                bad.append(f"{where}: {host}:{port}{route}")
    assert bad == []
    assert checked >= 8


def test_the_api_reference_names_every_route_the_app_serves(served: set[str]) -> None:
    page = reference.api() + (REPO / "docs" / "reference" / "api.md").read_text("utf-8")
    missing = []
    for path in sorted(served):
        if not path.startswith(("/v1/", "/admin/", "/mcp")):
            continue  # /healthz, /readyz, /metrics, /console: named in the page's opening
        shown = re.sub(r"\{(\w+)(?::\w+)?\}", r"{\1}", path)
        if f"`{shown}`" not in page and f"{shown}`" not in page:
            missing.append(path)
    assert missing == []
    for other in ("/healthz", "/readyz", "/metrics", "/console"):
        assert other in page


# --- the README's links -------------------------------------------------------------


def _anchors(page: Path) -> set[str]:
    """The heading ids MkDocs gives a page (the same `toc` extension and slugify)."""
    md = markdown.Markdown(extensions=["toc", "tables", "pymdownx.superfences"])
    md.convert(page.read_text("utf-8"))
    ids: set[str] = set()
    stack: list[dict[str, Any]] = list(md.toc_tokens)  # type: ignore[attr-defined]
    while stack:
        token = stack.pop()
        ids.add(token["id"])
        stack.extend(token["children"])
    return ids


def test_the_readme_links_and_anchors_resolve() -> None:
    text = re.sub(r"```.*?```", "", (REPO / "README.md").read_text("utf-8"), flags=re.S)
    checked, bad = 0, []
    for link in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", link):
            continue
        target, _, anchor = link.partition("#")
        path = (REPO / target).resolve()
        checked += 1
        if not path.exists():
            bad.append(f"no such file: {link}")
        elif anchor and anchor not in _anchors(path):
            bad.append(f"no such anchor: {link}")
    assert bad == []
    assert checked >= 30


def test_anchors_are_computed_as_the_site_computes_them() -> None:
    """The check above is only as good as its ids: known headings give known ids."""
    ids = _anchors(REPO / "docs" / "guides" / "tasks-and-tools.md")
    assert "metrics-opentelemetry-server-timing" in ids
    assert "nothing-here" not in ids
