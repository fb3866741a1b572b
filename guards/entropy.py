"""`entropy`: the policy's mean per-token entropy collapsing (the most common death of GRPO)."""

from __future__ import annotations

from grpod.engine import StepReport, TransportBatch
from grpod.guards.base import TrendGuard, is_finite
from grpod.guards.verdict import Finding


class EntropyGuard(TrendGuard):
    """WARN when the rolling mean (over `window` steps) of the report's policy entropy is
    below `floor` nats, or has fallen by more than `max_drop` (a fraction) from its best. A
    step without an entropy (skipped, or an engine that does not report one) is not counted."""

    name = "entropy"

    def after(self, batch: TransportBatch, report: StepReport) -> list[Finding]:
        if report.skipped_compute or not is_finite(report.entropy):
            return []
        self.trend.append(report.entropy)
        if not self.trend.full:
            return []
        mean, drop = self.trend.mean, self.trend.drop()
        evidence = dict(entropy_nats=mean, best=float(self.trend.best or 0.0))
        if mean < self.config.floor:
            message = f"entropy {mean:.3g} nats (mean of {self.config.window} steps) is below "
            message += f"the floor {self.config.floor:g}"
            return [self.finding(message, kind="floor", **evidence)]
        if drop is not None and drop > self.config.max_drop:
            return [
                self.finding(
                    f"entropy {mean:.3g} nats (mean of {self.config.window} steps) is {drop:.0%} "
                    f"below its best {self.trend.best:.3g} (limit {self.config.max_drop:.0%})",
                    kind="drop",
                    drop=drop,
                    severity=drop,
                    **evidence,
                )
            ]
        return []
