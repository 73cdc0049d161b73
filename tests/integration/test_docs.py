"""The documentation cannot rot: the site builds with --strict (a broken link fails),
its reference is generated from the code and complete (every setting described,
every header the code names documented, every error class listed, every admin route
in the OpenAPI description), and the configs and commands the guides show are
validated against the real schema and the real argument parser."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import ValidationError

from support.paths import REPO
from switchyard import reference
from switchyard.cli import build_parser
from switchyard.config import Settings

ROOT = REPO
DOCS = ROOT / "docs"
PAGES = [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("site")
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return out


def _page(site: Path, name: str) -> str:
    return (site / "reference" / name / "index.html").read_text(encoding="utf-8")


def test_the_site_builds_strict_with_the_generated_reference(site: Path) -> None:
    config = _page(site, "configuration")
    assert "server.max_header_bytes" in config and "cache.build_encoder" in config
    assert "reference:" not in config  # every marker was filled in
    assert "duplicate_key" in _page(site, "errors")
    assert "x-switchyard-max-tokens" in _page(site, "headers")
    assert "switchyard check-config" in _page(site, "cli")
    api = _page(site, "api")
    assert "/admin/usage" in api and "/v1/chat/completions" in api


def test_every_setting_has_a_description() -> None:
    rows = list(reference.settings_rows(Settings))
    assert len(rows) > 300
    missing = [r.key for r in rows if not r.description]
    assert missing == []


# Header names the code uses that are not HTTP headers of the gateway's own API: the
# scripted upstream's fault switch (a test fixture) and the common prefix.
_NOT_API = {"x-scripted-fault", "x-switchyard"}


def test_every_header_the_code_names_is_documented_and_nothing_else() -> None:
    named: set[str] = set()
    for path in (ROOT / "src" / "switchyard").rglob("*.py"):
        if path.name == "reference.py":
            continue
        named |= set(re.findall(r"""["'](x-[a-z0-9-]+)["']""", path.read_text("utf-8")))
    named -= _NOT_API
    documented = {h.name for h in reference.HEADERS}
    assert named - documented == set(), "headers the code uses but the reference lacks"
    stale = {h for h in documented if h.startswith("x-")} - named
    assert stale == set(), "headers the reference lists but the code never names"


def test_every_error_class_is_listed_with_its_status() -> None:
    import switchyard.gateway  # noqa: F401  (imports every module that defines an error)
    from switchyard.errors import SwitchyardError

    live: set[type] = set()
    stack: list[type] = [SwitchyardError]
    while stack:
        cls = stack.pop()
        live.add(cls)
        stack.extend(cls.__subclasses__())
    listed = {c.name for c in reference.error_classes()}
    assert {c.__name__ for c in live} - listed == set()
    # one place for every error a client may see (the reference's source, too)
    assert {c.__name__ for c in live if c.__module__ != "switchyard.errors"} == set()
    text = reference.errors()
    for code in ("rate_limit_*", "request_header_fields_too_large", "too_many_connections"):
        assert f"`{code}`" in text, code
    for cls in live:  # the status each class really answers with is on its row
        assert re.search(
            rf"\| {cls.status} \| `{cls.type}` \| `{cls.code}` \| `{cls.__name__}`", text
        )


def test_every_admin_route_is_in_the_openapi_description() -> None:
    from types import SimpleNamespace

    from switchyard.api.admin import build_admin_routes
    from switchyard.config import AuthConfig

    routes = build_admin_routes(SimpleNamespace(settings=SimpleNamespace(auth=AuthConfig())))  # type: ignore[arg-type]
    paths = reference.openapi_paths()
    for route in routes:
        path = re.sub(r"\{(\w+)(?::\w+)?\}", r"{\1}", route.path)
        assert path in paths, path
        assert set(paths[path]) - {"parameters"} == {m.lower() for m in route.methods - {"HEAD"}}


def _blocks(lang: str) -> list[tuple[Path, str]]:
    fence = re.compile(rf"^```{lang}\n(.*?)^```", re.M | re.S)
    return [(p, m.group(1)) for p in PAGES for m in fence.finditer(p.read_text("utf-8"))]


_MINIMAL_MODEL = {"alias": "m", "engine": {"kind": "openai", "base_url": "http://127.0.0.1:9/v1"}}


def _as_config(snippet: Any) -> dict[str, Any] | None:
    """A YAML block as a whole config to validate, or None when it is not one (a
    Kubernetes manifest, a Ray Serve config, a JSON body written as YAML)."""
    if not isinstance(snippet, dict) or not snippet:
        return None
    if not set(snippet) <= set(Settings.model_fields):
        return None
    if isinstance(snippet.get("tasks"), list):  # a `bench run` workload file
        return None
    return snippet if "models" in snippet else {**snippet, "models": [_MINIMAL_MODEL]}


def test_the_configs_the_docs_show_are_valid() -> None:
    checked, bad = 0, []
    for path, text in _blocks("yaml"):
        try:
            snippet = yaml.safe_load(text)
        except yaml.YAMLError:
            bad.append(f"{path.relative_to(ROOT)}: not YAML: {text[:200]}")
            continue
        config = _as_config(snippet)
        if config is None:
            continue
        try:
            Settings(**config)
        except ValidationError as exc:
            bad.append(f"{path.relative_to(ROOT)}: {exc}\n{text[:300]}")
        checked += 1
    assert bad == []
    assert checked >= 5


def _commands() -> list[tuple[Path, str]]:
    out = []
    for path, text in _blocks("(?:bash|sh|console)"):
        for line in text.replace("\\\n", " ").splitlines():
            line = line.strip().removeprefix("$ ")
            for prefix in ("switchyard ", ".venv/bin/switchyard ", "python -m switchyard "):
                if line.startswith(prefix):
                    out.append((path, line[len(prefix) :].split(" #")[0].split(" | ")[0]))
    return out


def test_the_commands_the_docs_show_parse() -> None:
    parser = build_parser()
    commands = _commands()
    assert len(commands) >= 10
    bad = []
    for path, args in commands:
        if "..." in args:  # arguments left out on purpose
            continue
        argv = [a for a in shlex.split(args) if not a.startswith((">", "2>", "&"))]
        try:
            parser.parse_args(argv)
        except SystemExit as exc:
            if exc.code != 0:  # `--help` exits 0
                bad.append(f"{path.relative_to(ROOT)}: switchyard {args}")
    assert bad == []


def test_the_make_targets_the_docs_show_exist() -> None:
    targets = set(re.findall(r"^([a-z][a-z-]*):", (ROOT / "Makefile").read_text(), re.M))
    for path, text in _blocks("(?:bash|sh|console)"):
        for target in re.findall(r"^\s*(?:\$ )?make ([a-z][a-z-]*)", text, re.M):
            assert target in targets, f"{path.relative_to(ROOT)}: make {target}"
