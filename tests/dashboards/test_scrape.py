"""A real scrape of a running `grpod run`: promtool accepts it, it holds every metric the
dashboard and the alerts read, and every metric it exports has a panel."""

from __future__ import annotations

import json
import math
import re
import subprocess
from pathlib import Path

import yaml

from tests.dashboards.conftest import FAULT_STEP, MAX_STEPS, DaemonRun
from tests.dashboards.helpers import (
    ALERTS,
    CONTRACT,
    SYNTHETIC,
    family,
    load_alert_rules,
    load_dashboard,
    metric_names,
    panel_exprs,
    promtool,
    substitute,
)


def _declared(scrape: str) -> dict[str, str]:
    """family name -> type, from the scrape's `# TYPE` lines."""
    return dict(re.findall(r"^# TYPE (\S+) (\S+)$", scrape, flags=re.M))


def _sample_names(scrape: str) -> set[str]:
    return {
        re.split(r"[{ ]", line, maxsplit=1)[0]
        for line in scrape.splitlines()
        if line and not line.startswith("#")
    }


def _value(scrape: str, sample: str) -> float:
    """The value of one exact sample line (`name` or `name{labels}`)."""
    for line in scrape.splitlines():
        if line.startswith(sample + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no sample {sample} in the scrape")


def test_daemon_ran_to_the_end(daemon_run: DaemonRun) -> None:
    assert daemon_run.exit_code == 0, daemon_run.log[-3000:]
    assert _value(daemon_run.scrape, "grpod_step") == MAX_STEPS - 1
    outcomes = {
        o: _value(daemon_run.scrape, f'grpod_steps_total{{outcome="{o}"}}')
        for o in ("applied", "flushed", "skipped")
    }
    assert sum(outcomes.values()) == MAX_STEPS
    assert outcomes["flushed"] >= 1  # the NaN-loss step at FAULT_STEP
    assert _value(daemon_run.scrape, "grpod_incidents_total") >= 1, f"fault at {FAULT_STEP}"


def test_promtool_check_metrics_on_the_real_scrape(daemon_run: DaemonRun) -> None:
    result = subprocess.run(
        [promtool(), "check", "metrics"],
        input=daemon_run.scrape,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.strip() == "" and result.stderr.strip() == ""  # no lint findings


def test_scrape_exports_the_contract(daemon_run: DaemonRun) -> None:
    declared = _declared(daemon_run.scrape)
    for name, kind in CONTRACT.items():
        assert declared.get(name) == kind, f"{name}: {declared.get(name)} (want {kind})"
    extra = {n for n in declared if n.startswith("grpod_") and not n.endswith("_created")} - set(
        CONTRACT
    )
    assert not extra, f"exported but not in the contract: {sorted(extra)}"


def test_every_metric_used_by_panels_and_alerts_is_in_the_scrape(daemon_run: DaemonRun) -> None:
    samples = _sample_names(daemon_run.scrape)
    used = {n for _, expr in panel_exprs(load_dashboard()) for n in metric_names(expr)}
    used |= {n for rule in load_alert_rules() for n in metric_names(rule["expr"])}
    missing = sorted(n for n in used - SYNTHETIC if n not in samples)
    assert not missing, f"read by panels/alerts, absent from a real scrape: {missing}"


def test_every_exported_metric_has_a_panel(daemon_run: DaemonRun) -> None:
    shown = {family(n) for _, expr in panel_exprs(load_dashboard()) for n in metric_names(expr)}
    exported = {
        family(n)
        for n in _declared(daemon_run.scrape)
        if n.startswith("grpod_") and not n.endswith("_created")
    }
    assert exported - shown == set(), "exported metrics without a panel"


def _input_series(scrape: str, points: int) -> list[dict[str, str]]:
    """The scrape as promtool input series, held constant, with the labels Prometheus adds."""
    from prometheus_client.parser import text_string_to_metric_families

    target = {"job": "grpod", "instance": "daemon:9464"}
    series = [
        {"series": 'up{job="grpod", instance="daemon:9464"}', "values": " ".join(["1"] * points)}
    ]
    for metric in text_string_to_metric_families(scrape):
        for sample in metric.samples:
            if sample.name.endswith("_created"):
                continue
            labels = {**sample.labels, **target}
            selector = ", ".join(f"{k}={json.dumps(v)}" for k, v in sorted(labels.items()))
            value = "NaN" if math.isnan(sample.value) else repr(float(sample.value))
            series.append(
                {"series": f"{sample.name}{{{selector}}}", "values": " ".join([value] * points)}
            )
    return series


def test_every_panel_query_returns_data_and_no_alert_fires_on_the_real_scrape(
    daemon_run: DaemonRun, tmp_path: Path
) -> None:
    """Evaluate every dashboard query and every alert in promtool over the real scrape
    (held for 10 minutes): each query returns at least one series (label matchers, joins
    and label values match what the daemon exports), and a healthy run fires no alert."""
    queries = [
        (title, expr)
        for title, expr in panel_exprs(load_dashboard())
        if not title.startswith("annotation ")  # they select increases: empty on a flat scrape
    ]
    rules = [
        {"alert": f"GrpodDashboardQuery{i}", "expr": f"count(({substitute(expr)})) > 0"}
        for i, (_, expr) in enumerate(queries)
    ]
    rule_file = tmp_path / "queries.yml"
    rule_file.write_text(yaml.safe_dump({"groups": [{"name": "queries", "rules": rules}]}))
    checks = [
        {"eval_time": "5m", "alertname": rule["alert"], "exp_alerts": [{"exp_labels": {}}]}
        for rule in rules
    ]
    checks += [
        {"eval_time": t, "alertname": rule["alert"], "exp_alerts": []}
        for rule in load_alert_rules()
        for t in ("5m", "10m")
    ]
    test_file = tmp_path / "queries_test.yml"
    test_file.write_text(
        yaml.safe_dump(
            {
                "rule_files": [str(rule_file), str(ALERTS)],
                "evaluation_interval": "15s",
                "tests": [
                    {
                        "interval": "15s",
                        "input_series": _input_series(daemon_run.scrape, points=41),
                        "alert_rule_test": checks,
                    }
                ],
            }
        )
    )
    result = subprocess.run(
        [promtool(), "test", "rules", str(test_file)], capture_output=True, text=True, timeout=120
    )
    titles = "\n".join(f"GrpodDashboardQuery{i}: {t}" for i, (t, _) in enumerate(queries))
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr + "\n" + titles
