"""The alert rules: promtool checks and unit tests, and what every alert must carry."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.dashboards.helpers import (
    ALERTS,
    ALERTS_TEST,
    PROMETHEUS_YML,
    load_alert_rules,
    promtool,
)

pytestmark = pytest.mark.slow  # `make test-fast` leaves it out

REQUIRED_ALERTS = {
    "GrpodMetricsDown",
    "GrpodStalled",
    "GrpodHalted",
    "GrpodFlushing",
    "GrpodTokenAccountingMismatch",
    "GrpodZeroValidTokens",
    "GrpodGradNormTracksInverseTokens",
    "GrpodSamplerMismatch",
    "GrpodIncidentOpen",
    "GrpodEntropyCollapse",
    "GrpodRetentionOverBudget",
    "GrpodRewardHacking",
}


def _promtool(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([promtool(), *args], capture_output=True, text=True, timeout=60, cwd=cwd)


def test_promtool_check_rules() -> None:
    result = _promtool("check", "rules", str(ALERTS))
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(load_alert_rules())} rules found" in result.stdout


def test_promtool_unit_tests_pass() -> None:
    result = _promtool("test", "rules", ALERTS_TEST.name, cwd=ALERTS_TEST.parent)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


def test_promtool_check_config_with_rule_file() -> None:
    result = _promtool("check", "config", str(PROMETHEUS_YML))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "alerts.yml" in result.stdout  # the rule file is found and checked too


def test_every_failure_mode_has_an_alert() -> None:
    assert {rule["alert"] for rule in load_alert_rules()} == REQUIRED_ALERTS


def test_every_alert_has_severity_summary_description_runbook() -> None:
    for rule in load_alert_rules():
        name = rule["alert"]
        assert rule["labels"]["severity"] in {"critical", "warning"}, name
        annotations = rule["annotations"]
        for key in ("summary", "description", "runbook"):
            assert annotations.get(key, "").strip(), f"{name}: no {key}"
        runbook = annotations["runbook"]
        assert "grpod replay" in runbook or "grpod incidents" in runbook, name


def test_every_alert_is_unit_tested_firing_and_not_firing() -> None:
    tests = yaml.safe_load(ALERTS_TEST.read_text())["tests"]
    firing: set[str] = set()
    silent: set[str] = set()
    for case in tests:
        for check in case.get("alert_rule_test", []):
            (firing if check.get("exp_alerts") else silent).add(check["alertname"])
    assert firing == REQUIRED_ALERTS
    assert silent == REQUIRED_ALERTS


def test_a_wrong_expectation_fails_promtool(tmp_path: Path) -> None:
    """The unit tests can fail: flip one expectation and promtool must say so."""
    broken = yaml.safe_load(ALERTS_TEST.read_text())
    broken["rule_files"] = [str(ALERTS)]
    check = next(c for c in broken["tests"][0]["alert_rule_test"] if not c["exp_alerts"])
    check["exp_alerts"] = [{"exp_labels": {"severity": "critical", "instance": "a:9400"}}]
    path = tmp_path / "broken_test.yml"
    path.write_text(yaml.safe_dump(broken))
    result = _promtool("test", "rules", str(path))
    assert result.returncode != 0
    assert "FAILED" in result.stdout + result.stderr


def test_install_promtool_is_idempotent(tmp_path: Path) -> None:
    """An existing working promtool is kept: no apt-get, exit 0."""
    (tmp_path / "promtool").symlink_to(promtool())
    script = Path(__file__).resolve().parents[2] / "scripts" / "install_promtool.sh"
    result = subprocess.run(
        ["bash", str(script), str(tmp_path)], capture_output=True, text=True, timeout=30
    )
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "promtool").is_symlink()


def test_install_promtool_fails_loudly_without_apt(tmp_path: Path) -> None:
    script = Path(__file__).resolve().parents[2] / "scripts" / "install_promtool.sh"
    result = subprocess.run(
        ["/bin/bash", str(script), str(tmp_path / "tools")],
        capture_output=True,
        text=True,
        timeout=30,
        env={"PATH": str(tmp_path)},  # no apt-get, no dpkg-deb
    )
    assert result.returncode != 0
    assert "install_promtool: error: apt-get not found" in result.stderr
    assert not (tmp_path / "tools" / "promtool").exists()


def test_runbook_commands_parse_with_the_real_cli() -> None:
    """Every `grpod ...` command a runbook names is accepted by the grpod parser."""
    import shlex

    from grpod.daemon.cli import build_parser

    parser = build_parser()
    placeholders = {"RUN_DIR": "/tmp/run", "ID": "1", "N": "3"}
    commands = [
        cmd
        for rule in load_alert_rules()
        for cmd in re.findall(r"`grpod ([^`]+)`", rule["annotations"]["runbook"])
    ]
    assert commands
    for command in commands:
        argv = [placeholders.get(word, word) for word in shlex.split(command)]
        try:
            args = parser.parse_args(argv)
        except SystemExit:
            raise AssertionError(f"runbook command does not parse: grpod {command}") from None
        assert callable(args.handler), command


def test_missing_promtool_fails_under_ci_and_skips_elsewhere(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tests.dashboards import helpers

    monkeypatch.setattr(helpers, "ROOT", tmp_path)  # no .tools/promtool here
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="promtool not found"):
        helpers.promtool()
    monkeypatch.delenv("CI")
    with pytest.raises(pytest.skip.Exception):
        helpers.promtool()
