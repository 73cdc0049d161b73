"""The example Grafana dashboard only queries metrics and labels Switchyard really exports.

The set of real sample names and their labels comes from `Metrics()` itself: every
labelled metric is touched once, then its registry is collected. A dashboard that names a
metric (or filters or groups on a label) that does not exist fails here, instead of
showing an empty panel in Grafana.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import pytest
from prometheus_client.metrics import MetricWrapperBase

from support.paths import REPO

DASHBOARD = REPO / "examples" / "grafana-dashboard.json"
DATASOURCE_UID = "${DS_PROMETHEUS}"

# PromQL words that look like identifiers but are not metric names. Function names are
# recognised by the "(" that follows them, so only these need listing.
KEYWORDS = {
    "and",
    "or",
    "unless",
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
    "bool",
    "offset",
    "atan2",
    "inf",
    "nan",
    # aggregations written as `sum by (x) (...)`: followed by a keyword, not "("
    "sum",
    "min",
    "max",
    "avg",
    "group",
    "stddev",
    "stdvar",
    "count",
    "count_values",
    "bottomk",
    "topk",
    "quantile",
    "limitk",
    "limit_ratio",
}
IDENT = re.compile(r"(?<![\w.:])([a-zA-Z_:][\w:]*)")
STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)")
SELECTOR = re.compile(r"(?<![\w.:])([a-zA-Z_:][\w:]*)\s*\{([^}]*)\}")
MATCHER = re.compile(r"([a-zA-Z_]\w*)\s*(?:=~|!~|!=|=)")
LABEL_VALUES = re.compile(r"^\s*label_values\(\s*([a-zA-Z_:][\w:]*)\s*,\s*(\w+)\s*\)\s*$")


# --- what Switchyard exports ------------------------------------------------------------


@pytest.fixture(scope="module")
def exported() -> dict[str, set[str]]:
    """Every sample name `Metrics()` exposes, with the label names it carries."""
    with pytest.MonkeyPatch.context() as mp:
        # Multiprocess mode keeps values in files, not in `.registry`: make sure it is off.
        mp.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)
        mp.delenv("prometheus_multiproc_dir", raising=False)
        from switchyard.observe.metrics import Metrics

        metrics = Metrics()
    assert not metrics.multiprocess
    touched = 0
    for value in vars(metrics).values():
        if isinstance(value, MetricWrapperBase):
            names = value._labelnames  # a labelled metric has no samples until touched
            if names:
                value.labels(*("x" for _ in names))
            touched += 1
    assert touched >= 10, "Metrics() no longer holds its metrics as attributes?"
    out: dict[str, set[str]] = {}
    for family in metrics.registry.collect():
        for sample in family.samples:
            out.setdefault(sample.name, set()).update(sample.labels)
    return out


# --- reading PromQL ---------------------------------------------------------------------


def _blank_strings(expr: str) -> str:
    """Grafana variables out, string literals emptied: what is left is PromQL structure."""
    expr = re.sub(r"\$\{[^}]*\}|\$\w+|\[\[[^\]]*\]\]", "1", expr)
    return STRING.sub('""', expr)


def metric_names(expr: str) -> set[str]:
    """The metric names an expression selects."""
    assert "__name__" not in expr, f"select metrics by name, not by __name__: {expr}"
    s = _blank_strings(expr)
    s = re.sub(r"\{[^}]*\}", " ", s)  # label matchers
    s = re.sub(r"\[[^\]]*\]", " ", s)  # ranges and subqueries
    s = GROUPING.sub(" ", s)  # by (...), on (...), group_left (...)
    names = set()
    for m in IDENT.finditer(s):
        word = m.group(1)
        if word.lower() in KEYWORDS or s[m.end() :].lstrip().startswith("("):
            continue  # a keyword, an aggregation or a function call
        names.add(word)
    return names


def matched_labels(expr: str) -> list[tuple[str, str]]:
    """(metric, label) for every label matcher in a selector."""
    out = []
    for m in SELECTOR.finditer(_blank_strings(expr)):
        out.extend((m.group(1), label) for label in MATCHER.findall(m.group(2)))
    return out


def grouping_labels(expr: str) -> set[str]:
    """Labels named in by (...), without (...), on (...), ignoring (...), group_x (...)."""
    s = _blank_strings(expr)
    return {label.strip() for g in GROUPING.findall(s) for label in g.split(",") if label.strip()}


# --- reading the dashboard --------------------------------------------------------------


@pytest.fixture(scope="module")
def dashboard() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    return data


def all_panels(dash: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Every panel, including those inside (collapsed) rows."""
    for panel in dash.get("panels", []):
        yield panel
        yield from panel.get("panels", [])


def data_panels(dash: dict[str, Any]) -> list[dict[str, Any]]:
    return [p for p in all_panels(dash) if p.get("type") != "row"]


def exprs(dash: dict[str, Any]) -> list[tuple[str, str]]:
    """(panel title, expr) for every query target."""
    return [
        (p.get("title", "?"), t["expr"])
        for p in data_panels(dash)
        for t in p.get("targets", [])
        if "expr" in t
    ]


# --- the checks -------------------------------------------------------------------------


def test_the_checker_sees_metric_names() -> None:
    """The parser itself: names found, keywords, functions, labels and durations not."""
    expr = (
        'histogram_quantile(0.95, sum by (le, model) (rate(switchyard_ttft_seconds_bucket{model=~"$model"}'
        "[$__rate_interval]))) / on (model) group_left sum without (tenant) "
        '(switchyard_requests_total{status!="ok",tenant=~"a|b"} offset 5m) * 1e3 > bool 0'
        " or vector(0) unless up"
    )
    assert metric_names(expr) == {
        "switchyard_ttft_seconds_bucket",
        "switchyard_requests_total",
        "up",
    }
    assert set(matched_labels(expr)) == {
        ("switchyard_ttft_seconds_bucket", "model"),
        ("switchyard_requests_total", "status"),
        ("switchyard_requests_total", "tenant"),
    }
    assert grouping_labels(expr) == {"le", "model", "tenant"}


def test_the_checker_rejects_a_misspelt_metric(exported: dict[str, set[str]]) -> None:
    bad = "sum(rate(switchyard_request_total[5m]))"  # "requests", not "request"
    assert metric_names(bad) - set(exported) == {"switchyard_request_total"}
    # Counters have the _total suffix; the bare name is not a sample.
    assert "switchyard_requests" not in exported
    assert {"switchyard_requests_total", "switchyard_ttft_seconds_bucket"} <= set(exported)
    assert "le" in exported["switchyard_request_duration_seconds_bucket"]


def test_dashboard_is_valid_grafana_json(dashboard: dict[str, Any]) -> None:
    assert isinstance(dashboard.get("title"), str) and dashboard["title"]
    assert isinstance(dashboard.get("uid"), str) and dashboard["uid"]
    assert 36 <= int(dashboard["schemaVersion"]) <= 41
    panels = list(all_panels(dashboard))
    assert panels, "no panels"
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    for p in panels:
        grid = p["gridPos"]
        assert {"h", "w", "x", "y"} <= set(grid), p.get("title")
        assert grid["x"] >= 0 and grid["x"] + grid["w"] <= 24, p.get("title")
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["DS_PROMETHEUS"]["type"] == "datasource"
    assert variables["DS_PROMETHEUS"]["query"] == "prometheus"
    for name in ("model", "tenant"):
        assert variables[name]["type"] == "query"
        assert LABEL_VALUES.match(variables[name]["definition"]), name


def test_every_panel_has_a_title_and_a_datasource(dashboard: dict[str, Any]) -> None:
    for p in all_panels(dashboard):
        assert isinstance(p.get("title"), str) and p["title"].strip(), f"panel {p['id']}"
    for p in data_panels(dashboard):
        ds = p.get("datasource")
        assert isinstance(ds, dict), f"{p['title']}: no datasource"
        assert ds.get("type") == "prometheus" and ds.get("uid") == DATASOURCE_UID, p["title"]
        assert p.get("targets"), f"{p['title']}: no queries"
        for t in p["targets"]:
            assert t.get("datasource", ds) == ds, p["title"]
            assert t.get("expr", "").strip(), f"{p['title']}: empty expr"


def test_every_expr_names_only_exported_metrics(
    dashboard: dict[str, Any], exported: dict[str, set[str]]
) -> None:
    found: set[str] = set()
    for title, expr in exprs(dashboard):
        names = metric_names(expr)
        assert names, f"{title}: no metric in {expr!r}"
        unknown = names - set(exported)
        assert not unknown, f"{title}: {sorted(unknown)} not exported by Switchyard in {expr!r}"
        found |= names
    for var in dashboard["templating"]["list"]:
        m = LABEL_VALUES.match(var.get("definition", ""))
        if m:
            assert m.group(1) in exported, f"${var['name']}: no metric {m.group(1)}"
            assert m.group(2) in exported[m.group(1)], f"${var['name']}: no label {m.group(2)}"
    assert len(found) >= 10  # the dashboard covers the metrics, not one or two of them


def test_every_label_used_exists(dashboard: dict[str, Any], exported: dict[str, set[str]]) -> None:
    """A matcher on a label the metric lacks (say tenant on a histogram) silently selects
    nothing when the variable is set; grouping on a missing label merges every series."""
    for title, expr in exprs(dashboard):
        for metric, label in matched_labels(expr):
            assert label in exported.get(metric, set()), f"{title}: {metric} has no {label!r}"
        labels = set().union(*(exported[n] for n in metric_names(expr)))
        missing = grouping_labels(expr) - labels
        assert not missing, f"{title}: groups by {sorted(missing)}, not a label of {expr!r}"
