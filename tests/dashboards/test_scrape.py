"""A real scrape of a running `grpod run`: promtool accepts it, it holds every metric the
dashboard and the alerts read, and every metric it exports has a panel."""

from __future__ import annotations

import json
import re
import subprocess

import pytest

from tests.dashboards.conftest import AUDIT, EVAL_EVERY, FAULT_STEP, MAX_STEPS, REWARDS, DaemonRun
from tests.dashboards.helpers import (
    CONTRACT,
    SYNTHETIC,
    family,
    metric_uses,
    promtool,
    shown_families,
)

pytestmark = pytest.mark.slow  # `make test-fast` leaves it out


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


@pytest.mark.parametrize("run", ["daemon_run", "halted_run"])
def test_promtool_check_metrics_on_the_real_scrape(
    run: str, request: pytest.FixtureRequest
) -> None:
    scrape = request.getfixturevalue(run).scrape
    result = subprocess.run(
        [promtool(), "check", "metrics"],
        input=scrape,
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
    used = {name for _, name in metric_uses()}
    missing = sorted(n for n in used - SYNTHETIC if n not in samples)
    assert not missing, f"read by panels/alerts, absent from a real scrape: {missing}"


def test_every_exported_metric_has_a_panel(daemon_run: DaemonRun) -> None:
    exported = {
        family(n)
        for n in _declared(daemon_run.scrape)
        if n.startswith("grpod_") and not n.endswith("_created")
    }
    assert exported - shown_families() == set(), "exported metrics without a panel"


def test_reward_functions_and_eval_match_the_store(daemon_run: DaemonRun) -> None:
    """Each configured reward's gauges are the last step's report; the eval gauges are the
    store's last evaluation (steps EVAL_EVERY, 2 * EVAL_EVERY, ...)."""
    from grpod.forensics import Store

    store = Store(daemon_run.run_dir, create=False)
    try:
        with store.session() as session:
            report = json.loads(store.latest_step(session, MAX_STEPS - 1).report_json)
            evals = [(e.step, json.loads(e.rewards_json)) for e in store.evals(session)]
    finally:
        store.close()
    assert sorted(report["reward_functions"]) == sorted(REWARDS)
    for name in REWARDS:
        for stat in ("mean", "std"):
            sample = f'grpod_reward_function_{stat}{{reward="{name}"}}'
            assert _value(daemon_run.scrape, sample) == report["reward_functions"][name][stat]
    copy = report["reward_functions"][REWARDS[0]]["mean"]  # weights [1, 0]: the total is copy's
    assert report["reward_mean"] == pytest.approx(copy, abs=1e-6)
    assert [step for step, _ in evals] == list(range(EVAL_EVERY, MAX_STEPS + 1, EVAL_EVERY))
    last_step, last = evals[-1]
    assert _value(daemon_run.scrape, "grpod_eval_step") == last_step
    assert set(last) == {"total", *REWARDS, f"audit:{AUDIT}"}  # the audit, scored on the eval too
    sample = f'grpod_audit_reward_mean{{reward="{AUDIT}"}}'
    assert _value(daemon_run.scrape, sample) == report["audit_rewards"][AUDIT]["mean"]
    for name, value in last.items():
        assert _value(daemon_run.scrape, f'grpod_eval_reward{{reward="{name}"}}') == value
    assert last["total"] == last[REWARDS[0]]
