"""The Grafana dashboard: a valid, self-contained model whose queries parse and read only
the daemon's metrics; the provisioning files point at it."""

from __future__ import annotations

import json
import re
import subprocess
from itertools import combinations
from pathlib import Path

import yaml

from tests.dashboards.helpers import (
    CONTRACT,
    DASHBOARD_JSON,
    DASHBOARDS,
    GRAFANA_BUILTINS,
    SYNTHETIC,
    family,
    load_dashboard,
    metric_names,
    metric_uses,
    panel_exprs,
    panels,
    promtool,
    shown_families,
    substitute,
)

DS_REF = {"type": "prometheus", "uid": "${datasource}"}
ROWS = [
    "Health",
    "Learning",
    "Accounting instrument",
    "Rollout / trainer agreement",
    "Throughput",
    "Per rank (by instance)",
]


def test_dashboard_model_basics() -> None:
    dash = load_dashboard()
    assert dash["uid"] == "grpod-campaign"  # stable: links and provisioning rely on it
    assert isinstance(dash["schemaVersion"], int) and dash["schemaVersion"] >= 36
    assert dash["title"] and dash["panels"]
    assert "__inputs" not in dash and "__requires" not in dash  # not an import-only export
    ids = [p["id"] for p in panels(dash)]
    assert len(ids) == len(set(ids)), "panel ids must be unique"


def test_rows_in_order() -> None:
    rows = [p["title"] for p in load_dashboard()["panels"] if p["type"] == "row"]
    assert rows == ROWS


def test_panels_have_valid_non_overlapping_grid_positions() -> None:
    boxes = []
    for panel in panels(load_dashboard()):
        grid = panel["gridPos"]
        assert all(isinstance(grid[k], int) for k in ("h", "w", "x", "y")), panel["title"]
        assert grid["w"] > 0 and grid["h"] > 0 and grid["x"] >= 0 and grid["y"] >= 0
        assert grid["x"] + grid["w"] <= 24, panel["title"]
        boxes.append((panel["title"], grid))
    for (a, ga), (b, gb) in combinations(boxes, 2):
        overlap = (
            ga["x"] < gb["x"] + gb["w"]
            and gb["x"] < ga["x"] + ga["w"]
            and ga["y"] < gb["y"] + gb["h"]
            and gb["y"] < ga["y"] + ga["h"]
        )
        assert not overlap, f"panels {a!r} and {b!r} overlap"


def test_no_unresolved_inputs_and_every_variable_is_defined() -> None:
    text = DASHBOARD_JSON.read_text()
    assert "${DS_" not in text, "file provisioning leaves ${DS_...} inputs unresolved"
    dash = json.loads(text)
    defined = {v["name"] for v in dash["templating"]["list"]}
    assert {"datasource", "job", "instance"} <= defined
    used = set(re.findall(r"\$\{(\w+)(?::\w+)?\}", text))
    used |= set(re.findall(r"\$(\w+)", text))
    used |= set(re.findall(r"\[\[(\w+)\]\]", text))
    unresolved = used - defined - GRAFANA_BUILTINS
    assert not unresolved, f"undefined variables: {sorted(unresolved)}"


def test_datasource_is_a_template_variable_everywhere() -> None:
    dash = load_dashboard()
    var = next(v for v in dash["templating"]["list"] if v["name"] == "datasource")
    assert var["type"] == "datasource" and var["query"] == "prometheus"
    for panel in panels(dash):
        if panel["type"] == "row":
            continue
        assert panel["datasource"] == DS_REF, panel["title"]
        for target in panel["targets"]:
            assert target["datasource"] == DS_REF, panel["title"]
    for v in dash["templating"]["list"]:
        if v["type"] == "query":
            assert v["datasource"] == DS_REF, v["name"]


def test_queries_filter_by_job_and_instance_and_use_rate_interval() -> None:
    for title, expr in panel_exprs(load_dashboard()):
        for selector in re.findall(r"\{([^}]*)\}", expr):
            assert 'job=~"$job"' in selector and 'instance=~"$instance"' in selector, title
        for window in re.findall(r"\[([^\]]*)\]", expr):
            assert window == "$__rate_interval", f"{title}: range [{window}]"


def test_incident_annotations() -> None:
    annotations = {a["name"]: a for a in load_dashboard()["annotations"]["list"]}
    incidents = annotations["Incidents"]
    assert incidents["enable"] and incidents["datasource"] == DS_REF
    assert "increase(grpod_incidents_total" in incidents["expr"]
    assert incidents["expr"].rstrip().endswith("> 0")
    attributed = annotations["Incident attribution"]  # at the time its attribution was stored
    assert attributed["enable"] and attributed["datasource"] == DS_REF
    assert "grpod_incident_attribution_timestamp_seconds" in attributed["expr"]
    assert attributed["useValueForTime"] and attributed["expr"].startswith("1000 * ")
    assert "top sample {{sample}}" in attributed["textFormat"]
    assert "grpod incidents show {{incident}}" in attributed["textFormat"]


def test_every_query_parses_as_promql(tmp_path: Path) -> None:
    """promtool parses each query (variables substituted) as a recording rule."""
    rules = [
        {"record": f"grpod_dashboard:query_{i}", "expr": substitute(expr)}
        for i, (_, expr) in enumerate(panel_exprs(load_dashboard()))
    ]
    path = tmp_path / "dashboard_queries.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    result = subprocess.run(
        [promtool(), "check", "rules", str(path)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_panels_and_alerts_use_only_contract_metrics() -> None:
    unknown = sorted(
        (where, n) for where, n in metric_uses() if family(n) not in CONTRACT and n not in SYNTHETIC
    )
    assert not unknown, f"metrics not exported by the daemon: {unknown}"


def test_every_contract_metric_has_a_panel() -> None:
    assert set(CONTRACT) - shown_families() == set()


def test_metric_scanner() -> None:
    expr = (
        "histogram_quantile(0.9, sum by (le, phase) (rate(grpod_phase_duration_seconds_bucket"
        '{job=~"$job", phase="grad"}[5m]))) / on (instance) group_left (version) grpod_build_info'
        " and time() - grpod_last_step_timestamp_seconds > 15 * 60 or up == 0"
    )
    assert metric_names(expr) == {
        "grpod_phase_duration_seconds_bucket",
        "grpod_build_info",
        "grpod_last_step_timestamp_seconds",
        "up",
    }
    assert family("grpod_phase_duration_seconds_bucket") == "grpod_phase_duration_seconds"
    assert family("grpod_loss_bucket") == "grpod_loss_bucket"  # a gauge has no buckets


def test_provisioning_points_at_the_dashboard() -> None:
    grafana = DASHBOARDS / "grafana" / "provisioning"
    (datasource_file,) = sorted((grafana / "datasources").glob("*.yaml"))
    datasources = yaml.safe_load(datasource_file.read_text())["datasources"]
    assert any(ds["type"] == "prometheus" for ds in datasources)
    (provider_file,) = sorted((grafana / "dashboards").glob("*.yaml"))
    providers = yaml.safe_load(provider_file.read_text())["providers"]
    assert providers and all(p["type"] == "file" for p in providers)
    assert yaml.safe_load(provider_file.read_text())["apiVersion"] == 1
