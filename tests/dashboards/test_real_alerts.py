"""The dashboard's queries and the alert rules evaluated by promtool over real scrapes.

A scrape of a real `grpod run` becomes promtool input series (held for 10 minutes, with the
`job`/`instance` labels Prometheus adds); each dashboard query must return data, and each
alert's expression (a copy without annotations: alerts_test.yml checks those) must fire or
stay silent as the run warrants.
"""

from __future__ import annotations

import json
import math
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.dashboards.conftest import DaemonRun
from tests.dashboards.helpers import (
    load_alert_rules,
    load_dashboard,
    panel_exprs,
    promtool,
    substitute,
)

pytestmark = pytest.mark.slow  # `make test-fast` leaves it out

TARGET = {"job": "grpod", "instance": "daemon:9464"}
POINTS = 41  # 10 minutes at 15 s


def _input_series(scrape: str) -> list[dict[str, str]]:
    from prometheus_client.parser import text_string_to_metric_families

    up = 'up{job="grpod", instance="daemon:9464"}'
    series = [{"series": up, "values": " ".join(["1"] * POINTS)}]
    for metric in text_string_to_metric_families(scrape):
        for sample in metric.samples:
            if sample.name.endswith("_created"):
                continue
            labels = {**sample.labels, **TARGET}
            selector = ", ".join(f"{k}={json.dumps(v)}" for k, v in sorted(labels.items()))
            value = "NaN" if math.isnan(sample.value) else repr(float(sample.value))
            series.append(
                {"series": f"{sample.name}{{{selector}}}", "values": " ".join([value] * POINTS)}
            )
    return series


def _alert_copies() -> list[dict[str, Any]]:
    return [
        {
            "alert": rule["alert"],
            "expr": rule["expr"],
            "for": rule.get("for", "0m"),
            "labels": rule["labels"],
        }
        for rule in load_alert_rules()
    ]


def _evaluate(
    tmp_path: Path, scrape: str, rules: list[dict[str, Any]], checks: list[dict[str, Any]]
) -> subprocess.CompletedProcess[str]:
    rule_file = tmp_path / "rules.yml"
    rule_file.write_text(yaml.safe_dump({"groups": [{"name": "real", "rules": rules}]}))
    test_file = tmp_path / "rules_test.yml"
    case = {"interval": "15s", "input_series": _input_series(scrape), "alert_rule_test": checks}
    test_file.write_text(
        yaml.safe_dump(
            {"rule_files": [str(rule_file)], "evaluation_interval": "15s", "tests": [case]}
        )
    )
    return subprocess.run(
        [promtool(), "test", "rules", str(test_file)], capture_output=True, text=True, timeout=120
    )


def _fires(name: str, severity: str, at: str = "5m") -> dict[str, Any]:
    labels = {"severity": severity, **TARGET}
    return {"eval_time": at, "alertname": name, "exp_alerts": [{"exp_labels": labels}]}


def _silent(name: str, at: str = "5m") -> dict[str, Any]:
    return {"eval_time": at, "alertname": name, "exp_alerts": []}


def test_every_panel_query_returns_data_and_no_alert_fires_on_a_healthy_run(
    daemon_run: DaemonRun, tmp_path: Path
) -> None:
    """Label matchers, joins and label values of every query match what the daemon exports;
    a run whose only fault was flushed raises no alert."""
    queries = [
        (title, expr)
        for title, expr in panel_exprs(load_dashboard())
        if not title.startswith("annotation ")  # they select increases: empty on a flat scrape
    ]
    rules = [
        {"alert": f"GrpodDashboardQuery{i}", "expr": f"count(({substitute(expr)})) > 0"}
        for i, (_, expr) in enumerate(queries)
    ]
    checks = [
        {"eval_time": "5m", "alertname": rule["alert"], "exp_alerts": [{"exp_labels": {}}]}
        for rule in rules
    ]
    alerts = _alert_copies()
    checks += [_silent(rule["alert"], at) for rule in alerts for at in ("5m", "10m")]
    result = _evaluate(tmp_path, daemon_run.scrape, rules + alerts, checks)
    titles = "\n".join(f"GrpodDashboardQuery{i}: {t}" for i, (t, _) in enumerate(queries))
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr + "\n" + titles


def test_a_real_accounting_fault_halts_the_run(halted_run: DaemonRun) -> None:
    assert halted_run.exit_code == 3, halted_run.log[-3000:]
    scrape = halted_run.scrape
    assert "grpod_verdict_action 3.0" in scrape.splitlines()
    assert 'grpod_findings_total{action="HALT",guard="policy"}' in scrape
    assert 'guard="accounting"' in scrape or 'guard="reorder"' in scrape


def test_token_accounting_alert_fires_on_a_real_faulty_run(
    halted_run: DaemonRun, tmp_path: Path
) -> None:
    checks = [
        _fires("GrpodTokenAccountingMismatch", "critical"),
        _silent("GrpodMetricsDown"),
        _silent("GrpodStalled"),
        _silent("GrpodSamplerMismatch"),
    ]
    result = _evaluate(tmp_path, halted_run.scrape, _alert_copies(), checks)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr


def test_halted_alert_fires_on_a_real_halted_run(halted_run: DaemonRun, tmp_path: Path) -> None:
    result = _evaluate(
        tmp_path, halted_run.scrape, _alert_copies(), [_fires("GrpodHalted", "critical")]
    )
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr
