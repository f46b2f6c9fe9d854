"""The Grafana dashboard and its provisioning (configs/grafana/), checked without Grafana: the JSON
loads, is self-contained, lays out cleanly, queries only the provisioned datasource and only
series the server exports, and every PromQL expression parses (`promtool check rules`)."""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from server.metrics import Metrics
from tests.deploy.dashboard import (
    DASHBOARD,
    PROVIDERS,
    all_panels,
    as_promql,
    as_recording_rules,
    datasource_uid,
    load_dashboard,
    queried_metrics,
    targets,
)
from tests.tools import run_tool


@pytest.fixture(scope="module")
def dashboard() -> dict:
    return load_dashboard()


def test_the_json_loads_and_needs_no_import_step(dashboard) -> None:
    text = DASHBOARD.read_text()
    assert "${DS_" not in text and "__inputs" not in dashboard, (
        "a provisioned dashboard must name its datasource by uid, not by an import placeholder"
    )
    assert dashboard["uid"] and dashboard["title"] == "Aerie"
    assert dashboard.get("id") is None, "an exported database id would clash on provisioning"
    assert isinstance(dashboard["schemaVersion"], int)


def test_panel_ids_are_unique(dashboard) -> None:
    ids = [panel["id"] for panel in all_panels(dashboard)]
    assert all(isinstance(i, int) for i in ids)
    assert len(ids) == len(set(ids)), sorted(ids)


def test_panels_fit_the_grid_and_do_not_overlap(dashboard) -> None:
    cells: dict[tuple[int, int], str] = {}
    for panel in all_panels(dashboard):
        pos = panel["gridPos"]
        assert pos["x"] >= 0 and pos["w"] > 0 and pos["x"] + pos["w"] <= 24, panel["title"]
        for x in range(pos["x"], pos["x"] + pos["w"]):
            for y in range(pos["y"], pos["y"] + pos["h"]):
                assert (x, y) not in cells, f"{panel['title']!r} overlaps {cells[(x, y)]!r}"
                cells[(x, y)] = panel["title"]


def test_every_query_uses_the_provisioned_datasource(dashboard) -> None:
    uid = datasource_uid()
    for panel in all_panels(dashboard):
        if panel["type"] == "row":
            continue
        assert panel["targets"], f"{panel['title']!r} queries nothing"
        assert panel["datasource"] == {"type": "prometheus", "uid": uid}, panel["title"]
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == uid, panel["title"]
            assert target["expr"].strip(), panel["title"]
    for variable in dashboard["templating"]["list"]:
        assert variable["datasource"]["uid"] == uid


def test_every_expression_parses(tmp_path) -> None:
    """promtool parses each expression as the expression of a recording rule."""
    dashboard = load_dashboard()
    rules = tmp_path / "dashboard-rules.yml"
    rules.write_text(as_recording_rules(dashboard))
    result = run_tool("promtool", "check", "rules", str(rules))
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(targets(dashboard))} rules found" in result.stdout + result.stderr


def test_promtool_rejects_a_broken_expression(tmp_path) -> None:
    """The check above can fail: promtool reports a PromQL syntax error."""
    rules = tmp_path / "broken-rules.yml"
    rules.write_text(
        yaml.safe_dump(
            {"groups": [{"name": "g", "rules": [{"record": "r", "expr": "sum(rate(x[1m])"}]}]}
        )
    )
    result = run_tool("promtool", "check", "rules", str(rules))
    assert result.returncode != 0


def test_the_issue_panels_are_there(dashboard) -> None:
    titles = {panel["title"] for panel in all_panels(dashboard)}
    for title in (
        "Requests / s",
        "Output tokens / s",
        "Acceptance rate",
        "Mean acceptance length",
        "Request rate by finish reason",
        "Time to first token",
        "Inter-token latency",
        "End-to-end latency",
        "Running and waiting",
        "KV cache usage",
        "Prefix cache hit rate",
        "Acceptance by position",
        "Draft vs accepted tokens",
        "Preemptions",
        "Finish reasons",
    ):
        assert title in titles
    by_title = {panel["title"]: panel for panel in all_panels(dashboard)}
    for title in ("Time to first token", "Inter-token latency", "End-to-end latency"):
        quantiles = [
            re.match(r"histogram_quantile\(([0-9.]+),", t["expr"]).group(1)
            for t in by_title[title]["targets"]
        ]
        assert quantiles == ["0.5", "0.9", "0.99"], title


def fake_engine(draft: str | None, depth: int = 4) -> SimpleNamespace:
    config = SimpleNamespace(draft=draft, draft_depth=depth)
    return SimpleNamespace(config=config, max_model_len=512, stats_listeners=[])


def test_every_queried_series_is_exported(dashboard) -> None:
    """Offline half of tests/server/test_metrics.py's live check: every series a panel reads is
    one that server.metrics exports for a speculating engine."""
    metrics = Metrics("m")
    metrics.attach(fake_engine("head"))
    body, _ = metrics.render()
    samples = {
        sample.name
        for family in text_string_to_metric_families(body.decode())
        for sample in family.samples
    }
    missing = queried_metrics(dashboard) - samples
    assert not missing, f"the dashboard queries series the server never exports: {missing}"


def test_the_template_variable_filters_every_query(dashboard) -> None:
    (variable,) = dashboard["templating"]["list"]
    assert variable["name"] == "model_name"
    for panel, target in targets(dashboard):
        for selector in re.findall(r"aerie_[a-zA-Z0-9_]+(\{[^}]*\})?", target["expr"]):
            assert selector == '{model_name=~"$model_name"}', (panel["title"], target["expr"])
        assert as_promql(target["expr"]).count("$") == 0


def test_provisioning_points_at_the_compose_services() -> None:
    (source,) = yaml.safe_load(
        (DASHBOARD.parents[1] / "provisioning" / "datasources" / "prometheus.yml").read_text()
    )["datasources"]
    assert source["type"] == "prometheus" and source["url"] == "http://prometheus:9090"
    assert source["isDefault"] is True
    (provider,) = yaml.safe_load(PROVIDERS.read_text())["providers"]
    assert provider["type"] == "file"
    # docker-compose.yml mounts configs/grafana/dashboards at the provider's path; see
    # tests/deploy/test_container.py, which reads the mounts from `docker compose config`.
    assert provider["options"]["path"] == "/etc/grafana/dashboards"
