"""`sampler_mismatch`: the sampler and the trainer disagree about the same tokens.

Two readings of one statistic. At the same weight version (an on-policy step) the sampler
and the trainer run the same weights, and any gap beyond kernel noise (1e-5 nats on W4, 0.075
p90 for BF16) is a disagreement: stale weights, another dtype or kernel. A rollout sampled k
versions ago (`max_staleness` > 0) differs from the current policy by design, by k updates of
drift that importance correction (tis_cap) accounts for: on W4 with the vLLM server, at
staleness 1 16-31% of tokens move by more than 0.1 nats with a p99 of 0.37-1.0 nats, at
staleness 2 38-46% with a p99 of 1.12-1.21 nats. That reading gets its own bounds,
p99 per version behind, so a healthy async run raises nothing while a sampler whose weights
drifted far more than its staleness explains still does. (Whether the sampler holds the
weights it was pushed is the weight-sync check's, at every push.)
"""

from __future__ import annotations

from grpod.engine import StepReport, TransportBatch
from grpod.guards.base import Guard, is_finite
from grpod.guards.verdict import Finding


class SamplerMismatchGuard(Guard):
    """WARN when p99 |sampler - trainer logprob| or the fraction of tokens above 0.1 nats
    exceeds its maximum: the disagreement bounds on an on-policy step, the drift bounds
    (`drift_p99_max_nats` x the versions behind) on a stale one. Silent without sampler
    logprobs."""

    name = "sampler_mismatch"

    def after(self, batch: TransportBatch, report: StepReport) -> list[Finding]:
        staleness = report.staleness or 0
        if staleness > 0:
            p99_max = self.config.drift_p99_max_nats * staleness
            fraction_max = self.config.drift_fraction_above_0_1_max
            what = f"policy drift over {staleness} version{'s' if staleness > 1 else ''}"
        else:
            p99_max = self.config.p99_max_nats
            fraction_max = self.config.fraction_above_0_1_max
            what = "sampler/trainer logprob mismatch"
        findings = []
        p99, fraction = report.mismatch_p99, report.mismatch_frac_above_0_1
        if is_finite(p99) and p99 > p99_max:
            findings.append(
                self.finding(
                    f"p99 {what} {p99:.3g} nats > {p99_max:g}",
                    p99_nats=p99,
                    threshold=p99_max,
                    staleness=float(staleness),
                )
            )
        if is_finite(fraction) and fraction > fraction_max:
            findings.append(
                self.finding(
                    f"{what}: {fraction:.1%} of tokens differ by more than 0.1 nats "
                    f"(> {fraction_max:.1%})",
                    fraction_above_0_1=fraction,
                    threshold=fraction_max,
                    staleness=float(staleness),
                )
            )
        return findings
