"""`advantage`: a step that lost its learning signal, or whose advantages were lost.

Equal rewards in a group give that group advantages of exactly 0. A campaign that has learned
its prompts sees more and more such groups, until a whole batch is solved (W4: 26 of 100
healthy steps had every group alike, none before step 29): that is progress, not a fault, and
a batch that stays without signal is `dead_campaign`'s to halt. What this guard warns of is the
sudden loss of signal — a reward that went constant (a reward server answering 0, a checker
that crashed into its default) — and advantages that are all 0 although rewards varied.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from grpod.engine import StepReport, TransportBatch
from grpod.guards.base import Guard, Window, is_finite, load_floats
from grpod.guards.verdict import Action, Finding


class AdvantageGuard(Guard):
    """WARN when the zero-std group fraction exceeds `zero_std_fraction_max` while the
    previous `history_steps` steps' mean stayed at most `history_fraction_max` (a sudden loss,
    not a solved or dying campaign) and that many groups alike is at most
    `tail_probability_max` likely by chance (each group alike with the history's mean: with
    16 groups, 15 alike after a mean of 0.64 is a healthy step's noise, 16 after 0.54 is not);
    and when every advantage of the batch's trainable tokens is 0 although some group's
    rewards varied (`all_zero_action`)."""

    name = "advantage"

    def __init__(self, config) -> None:
        self.history = Window(config.history_steps)
        super().__init__(config)

    def configure(self, config) -> None:
        super().configure(config)
        self.history.resize(config.history_steps)

    def after(self, batch: TransportBatch, report: StepReport) -> list[Finding]:
        fraction = report.zero_std_group_fraction
        if not is_finite(fraction):
            return []
        before = self.history.mean() if len(self.history) else 0.0
        self.history.append(fraction)
        findings = []
        limit = self.config.zero_std_fraction_max
        if fraction > limit and before <= self.config.history_fraction_max:
            groups = batch.num_groups  # only on a candidate step
            alike = round(fraction * groups)
            chance = binomial_tail(groups, alike, before)
            if chance <= self.config.tail_probability_max:
                findings.append(
                    self.finding(
                        f"{alike} of {groups} groups ({fraction:.0%}, > {limit:.0%}) have equal "
                        f"rewards after {before:.0%} over the previous steps (a chance of "
                        f"{chance:.2g}): the reward lost its signal",
                        kind="zero_std_groups",
                        zero_std_group_fraction=fraction,
                        threshold=limit,
                        history_mean=before,
                        groups=float(groups),
                        chance=chance,
                    )
                )
        # elementwise, not a masked copy: is any trainable token's advantage non-zero?
        signal = torch.logical_and(batch.advantages != 0, batch.loss_mask).any()
        trainable = 0 if bool(signal) else int(batch.loss_mask.sum())
        if trainable and fraction < 1.0:
            findings.append(
                self.finding(
                    f"every advantage of the batch is 0 although {1.0 - fraction:.0%} of "
                    "groups had varied rewards: the advantages were lost",
                    Action[self.config.all_zero_action],
                    kind="all_zero",
                    trainable_tokens=float(trainable),
                    zero_std_group_fraction=fraction,
                )
            )
        return findings

    def state_dict(self) -> dict[str, Any]:
        return {"zero_std": list(self.history.values)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        # an older grpod's checkpoint kept no history: the guard starts a new one
        values = load_floats(state, "zero_std", self.name)
        self.history = Window(self.config.history_steps, values)


def binomial_tail(n: int, k: int, p: float) -> float:
    """P(X >= k) for X ~ Binomial(n, p): the chance of at least `k` of `n` groups alike when
    each is alike with probability `p` (clamped to [0, 1])."""
    p = min(1.0, max(0.0, p))
    if k <= 0:
        return 1.0
    return math.fsum(math.comb(n, i) * p**i * (1.0 - p) ** (n - i) for i in range(k, n + 1))
