"""`advantage`: a step without learning signal."""

from __future__ import annotations

import torch

from grpod.engine import StepReport, TransportBatch
from grpod.guards.base import Guard
from grpod.guards.verdict import Action, Finding


class AdvantageGuard(Guard):
    """WARN when the zero-std group fraction exceeds its maximum, and when every advantage of
    the batch's trainable tokens is 0 (no learning signal at all)."""

    name = "advantage"

    def after(self, batch: TransportBatch, report: StepReport) -> list[Finding]:
        findings = []
        fraction = report.zero_std_group_fraction
        if fraction > self.config.zero_std_fraction_max:
            findings.append(
                self.finding(
                    f"{fraction:.0%} of groups have equal rewards "
                    f"(> {self.config.zero_std_fraction_max:.0%})",
                    kind="zero_std_groups",
                    zero_std_group_fraction=fraction,
                    threshold=self.config.zero_std_fraction_max,
                )
            )
        # elementwise, not a masked copy: is any trainable token's advantage non-zero?
        signal = torch.logical_and(batch.advantages != 0, batch.loss_mask).any()
        trainable = 0 if bool(signal) else int(batch.loss_mask.sum())
        if trainable:
            findings.append(
                self.finding(
                    "every advantage of the batch is 0: no learning signal",
                    Action[self.config.all_zero_action],
                    kind="all_zero",
                    trainable_tokens=float(trainable),
                )
            )
        return findings
