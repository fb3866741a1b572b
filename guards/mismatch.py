"""`sampler_mismatch`: the sampler and the trainer disagree about the same tokens."""

from __future__ import annotations

from grpod.engine import StepReport, TransportBatch
from grpod.guards.base import Guard, is_finite
from grpod.guards.verdict import Finding


class SamplerMismatchGuard(Guard):
    """WARN when p99 |sampler - trainer logprob| or the fraction of tokens above 0.1 nats
    exceeds its maximum. Silent without sampler logprobs."""

    name = "sampler_mismatch"

    def after(self, batch: TransportBatch, report: StepReport) -> list[Finding]:
        findings = []
        p99, fraction = report.mismatch_p99, report.mismatch_frac_above_0_1
        if is_finite(p99) and p99 > self.config.p99_max_nats:
            findings.append(
                self.finding(
                    f"p99 sampler/trainer logprob mismatch {p99:.3g} nats > "
                    f"{self.config.p99_max_nats:g}",
                    p99_nats=p99,
                    threshold=self.config.p99_max_nats,
                )
            )
        if is_finite(fraction) and fraction > self.config.fraction_above_0_1_max:
            findings.append(
                self.finding(
                    f"{fraction:.1%} of tokens mismatch by more than 0.1 nats "
                    f"(> {self.config.fraction_above_0_1_max:.1%})",
                    fraction_above_0_1=fraction,
                    threshold=self.config.fraction_above_0_1_max,
                )
            )
        return findings
