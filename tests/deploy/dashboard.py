"""The Grafana dashboard in configs/grafana/, read the way the tests need it."""

from __future__ import annotations

import json
import re

import yaml

from tests.tools import REPO

GRAFANA = REPO / "configs" / "grafana"
DASHBOARD = GRAFANA / "dashboards" / "aerie.json"
DATASOURCES = GRAFANA / "provisioning" / "datasources" / "prometheus.yml"
PROVIDERS = GRAFANA / "provisioning" / "dashboards" / "aerie.yml"

# Grafana's own variables and the dashboard's template variable, as plain PromQL. `$__range`
# is the dashboard's time range (30 minutes by default).
_VARIABLES = {
    "$__rate_interval": "1m",
    "$__interval": "15s",
    "$__range": "30m",
    "$model_name": ".*",
}
_METRIC = re.compile(r"\baerie_[a-zA-Z0-9_]+")


def load_dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def all_panels(dashboard: dict) -> list[dict]:
    """Every panel, rows and the panels nested in collapsed rows included."""
    panels = []
    for panel in dashboard["panels"]:
        panels.append(panel)
        panels.extend(panel.get("panels", []))
    return panels


def targets(dashboard: dict) -> list[tuple[dict, dict]]:
    """(panel, target) for every query of every panel."""
    return [(p, t) for p in all_panels(dashboard) for t in p.get("targets", [])]


def as_promql(expr: str, rate_interval: str | None = None) -> str:
    """A panel's expression with Grafana's variables replaced by PromQL values."""
    values = {**_VARIABLES, **({"$__rate_interval": rate_interval} if rate_interval else {})}
    for name in sorted(values, key=len, reverse=True):  # $__rate_interval before $__range
        expr = expr.replace(name, values[name])
    assert "$" not in expr, f"an unknown variable is left in {expr!r}"
    return expr


def metric_names(expr: str) -> set[str]:
    """The aerie_ sample names an expression reads (e.g. `..._seconds_bucket`)."""
    return set(_METRIC.findall(expr))


def queried_metrics(dashboard: dict) -> set[str]:
    return {name for _, t in targets(dashboard) for name in metric_names(t["expr"])}


def as_recording_rules(dashboard: dict) -> str:
    """Every expression as a Prometheus recording rule, for `promtool check rules`."""
    rules = [
        {"record": f"aerie:panel_{p['id']}:{t['refId']}", "expr": as_promql(t["expr"])}
        for p, t in targets(dashboard)
    ]
    return yaml.safe_dump({"groups": [{"name": "aerie-dashboard", "rules": rules}]})


def datasource_uid() -> str:
    (source,) = yaml.safe_load(DATASOURCES.read_text())["datasources"]
    return source["uid"]
