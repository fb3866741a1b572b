"""The campaign-health metrics: audit rewards, degeneration, and the `reward_hacking` rules.

`Metrics` builds one `CampaignMetrics` on its registry and calls `observe` with
each published step's report and verdict (two lines in daemon/metrics.py). Labels are bounded:
`reward` takes the config's `audit_rewards` names, `rule` the five rules, `signal` two names.
"""

from __future__ import annotations

import math

from prometheus_client import CollectorRegistry, Gauge

from grpod.daemon.metric_families import Family
from grpod.engine.report import StepReport
from grpod.engine.verdict import Action, Verdict
from grpod.guards.config import REWARD_HACKING_RULES

RULES = REWARD_HACKING_RULES
SIGNALS = {  # `signal` label -> StepReport.completion_stats key (engine/data/audit.py)
    "repeated_ngram": "repeated_ngram_fraction",
    "identical_completion": "identical_completion_fraction",
}


class CampaignMetrics:
    """`grpod_audit_reward_mean{reward}`, `grpod_completion_degeneration_ratio{signal}`,
    `grpod_reward_hacking_rule_action{rule}` (0 quiet, 1 WARN, 3 HALT: the rule's finding on
    the last step)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        def gauge(name: str, doc: str, labels: tuple[str, ...]) -> Gauge:
            return Family(name, Gauge, name, doc, labels).make(registry)

        self.audit = gauge(
            "audit_reward_mean",
            "Mean audit reward of the step's completions (scored, never trained on)",
            ("reward",),
        )
        self.degeneration = gauge(
            "completion_degeneration_ratio",
            "repeated_ngram: share of completion 3-grams repeating an earlier one of the same "
            "completion; identical_completion: share of identical completions within a group",
            ("signal",),
        )
        self.rule = gauge(
            "reward_hacking_rule_action",
            "The reward_hacking rule's action on the last step: 0 quiet, 1 WARN, 3 HALT",
            ("rule",),
        )
        self._rules = {rule: self.rule.labels(rule) for rule in RULES}
        self._signals = {name: self.degeneration.labels(name) for name in SIGNALS}
        for child in self._rules.values():
            child.set(0)

    def observe(self, report: StepReport, verdict: Verdict) -> None:
        for name, stats in report.audit_rewards.items():  # steps not audited keep the last
            self.audit.labels(name).set(stats["mean"])
        for name, key in SIGNALS.items():
            self._signals[name].set(report.completion_stats.get(key, math.nan))
        actions = dict.fromkeys(RULES, Action.PASS)
        for finding in verdict.by("reward_hacking"):
            actions[finding.kind] = max(actions.get(finding.kind, Action.PASS), finding.action)
        for rule, child in self._rules.items():
            child.set(int(actions[rule]))
