"""`dead_campaign` and `reward_trend`: a campaign that can no longer learn, or is unlearning.

A collapsed GRPO policy samples the same completion for every prompt of a group: every
group's rewards are equal, every advantage is 0, the gradient is ~0, and each step still costs
a full rollout and pass while nothing moves. `dead_campaign` turns that, held over a window
of steps, into one HALT (checkpointed, exit 3); `reward_trend` warns when the reward's
rolling mean falls well below its best.
"""

from __future__ import annotations

from typing import Any

from grpod.engine import StepReport, TransportBatch
from grpod.guards.base import Guard, TrendGuard, Window, is_finite, load_floats
from grpod.guards.verdict import Finding


class DeadCampaignGuard(Guard):
    """HALT when the last `steps` steps carried no learning signal: their mean zero-std group
    fraction is at least `zero_std_fraction_min` (1.0 = every advantage 0 on every step), or
    their largest pre-clip grad norm is at most `grad_norm_max`. A mean over the window, not a
    strict run of steps: a collapsed policy still samples an odd varied group now and then,
    which must not restart the count. A campaign that solved its prompts (every group all
    correct) has no signal either: the reason names the mean reward. Skipped and non-finite
    steps are not counted."""

    name = "dead_campaign"

    def __init__(self, config) -> None:
        self.zero_std = Window(config.steps)
        self.grad_norm = Window(config.steps)
        self.reward = Window(config.steps)
        super().__init__(config)

    def configure(self, config) -> None:
        super().configure(config)
        for window in (self.zero_std, self.grad_norm, self.reward):
            window.resize(config.steps)

    def after(self, batch: TransportBatch, report: StepReport) -> list[Finding]:
        if report.skipped_compute or not is_finite(report.grad_norm):
            return []
        self.zero_std.append(report.zero_std_group_fraction)
        self.grad_norm.append(report.grad_norm)
        self.reward.append(report.reward_mean if is_finite(report.reward_mean) else 0.0)
        steps = self.config.steps
        if len(self.zero_std) < steps:
            return []
        fraction = self.zero_std.mean()
        largest = max(self.grad_norm.values)
        reward = self.reward.mean()
        if fraction >= self.config.zero_std_fraction_min:
            reason = (
                f"no learning signal for {steps} steps: {fraction:.1%} of groups had equal "
                f"rewards (>= {self.config.zero_std_fraction_min:.0%}, mean reward "
                f"{reward:.3f}); the policy samples one answer per prompt, every further "
                "step is paid for and learns nothing"
            )
        elif largest <= self.config.grad_norm_max:
            reason = (
                f"no learning signal for {steps} steps: the grad norm stayed <= {largest:.3g} "
                f"(limit {self.config.grad_norm_max:g})"
            )
        else:
            return []
        return [
            self.finding(
                reason,
                steps=float(steps),
                zero_std_group_fraction=fraction,
                grad_norm_max=largest,
                reward_mean=reward,
            )
        ]

    def state_dict(self) -> dict[str, Any]:
        return {
            name: list(getattr(self, name).values) for name in ("zero_std", "grad_norm", "reward")
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for name in ("zero_std", "grad_norm", "reward"):
            setattr(self, name, Window(self.config.steps, load_floats(state, name, self.name)))


class RewardTrendGuard(TrendGuard):
    """WARN when the rolling mean reward over `window` steps has fallen by more than
    `max_drop` (a fraction) from the best it reached (the soak: 0.67 -> 0.199)."""

    name = "reward_trend"

    def after(self, batch: TransportBatch, report: StepReport) -> list[Finding]:
        if report.skipped_compute or not is_finite(report.reward_mean):
            return []
        self.trend.append(report.reward_mean)
        drop = self.trend.drop()
        if drop is None or drop <= self.config.max_drop:
            return []
        return [
            self.finding(
                f"reward mean over {self.config.window} steps {self.trend.mean:.3f} is "
                f"{drop:.0%} below its best {self.trend.best:.3f} "
                f"(limit {self.config.max_drop:.0%})",
                reward_mean=self.trend.mean,
                best=float(self.trend.best),
                drop=drop,
                severity=drop,
            )
        ]
