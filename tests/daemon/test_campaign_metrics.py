"""The campaign-health gauges: audit rewards, degeneration and each reward_hacking rule."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from grpod.daemon.metrics import Metrics
from grpod.engine.verdict import Action, Finding, Verdict
from tests.reports import make_report


def test_audit_degeneration_and_rule_gauges() -> None:
    registry = CollectorRegistry()
    metrics = Metrics(registry)
    report = make_report(
        audit_rewards={"m:exact": {"mean": 0.25, "std": 0.1}},
        completion_stats={"repeated_ngram_fraction": 0.1, "identical_completion_fraction": 0.5},
    )
    finding = Finding("reward_hacking", Action.WARN, "diverges", {}, "divergence")
    metrics.campaign.observe(report, Verdict.of([finding]))
    value = registry.get_sample_value
    assert value("grpod_audit_reward_mean", {"reward": "m:exact"}) == 0.25
    assert value("grpod_completion_degeneration_ratio", {"signal": "identical_completion"}) == 0.5
    assert value("grpod_reward_hacking_rule_action", {"rule": "divergence"}) == 1
    assert value("grpod_reward_hacking_rule_action", {"rule": "length"}) == 0
    metrics.campaign.observe(make_report(), Verdict.of([]))  # the episode ends: back to 0
    assert value("grpod_reward_hacking_rule_action", {"rule": "divergence"}) == 0
    assert value("grpod_audit_reward_mean", {"reward": "m:exact"}) == 0.25  # not audited: kept
