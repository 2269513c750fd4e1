"""The chart's Grafana dashboard as queries a test can send to a real Prometheus: every panel's
expression with Grafana's variables substituted, and the labels each promises in its result."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

DASHBOARD = Path(__file__).resolve().parents[2] / "helm" / "loraplex" / "dashboards" / "loraplex.json"
RATE_WINDOW = "30s"  # what $__rate_interval stands for (Grafana: at least 4 scrape intervals)


def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def queries() -> list[tuple[str, str]]:
    """(panel title / refId, expr) of every target of every panel."""
    return [(f"{p['title']} / {t.get('refId', '?')}", t["expr"]) for p in dashboard()["panels"]
            for t in p.get("targets", [])]


def substitute(expr: str, variables: dict[str, str]) -> str:
    expr = expr.replace("$__rate_interval", RATE_WINDOW).replace("$__interval", "5s")
    for name, value in variables.items():
        expr = expr.replace(f"${{{name}}}", value).replace(f"${name}", value)
    assert "$" not in expr, f"unknown template variable in {expr}"
    return expr


def grouping_labels(expr: str) -> set[str]:
    """Labels the expression promises in its result: those of every `by (...)` clause but `le`."""
    return {label.strip() for clause in re.findall(r"\bby\s*\(([^)]*)\)", expr)
            for label in clause.split(",") if label.strip() and label.strip() != "le"}


def check_panel(prometheus, title: str, expr: str, pool: str) -> None:
    """The panel's query answers at least one finite series carrying the labels it groups by."""
    result = prometheus.query(substitute(expr, {"pool": pool, "adapter": ".*"}))
    assert result, f"{title}: no series for {expr}"
    values = [float(series["value"][1]) for series in result]
    assert any(math.isfinite(v) for v in values), f"{title}: only {values}"
    for series in result:
        missing = {label for label in grouping_labels(expr) if not series["metric"].get(label)}
        assert not missing, f"{title}: series {series['metric']} lacks {missing} (grouped by in {expr})"
