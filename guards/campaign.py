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
from grpod.guards.base import Guard, RollingBest, Window, is_finite, load_floats
from grpod.guards.errors import GuardsError
from grpod.guards.verdict import Finding


class DeadCampaignGuard(Guard):
    """HALT when the last `steps` steps carried no learning signal: their mean zero-std group
    fraction is at least `zero_std_fraction_min` (1.0 = every advantage 0 on every step), or
    their largest pre-clip grad norm is at most `grad_norm_max`. A mean over the window, not a
    strict run of steps: a collapsed policy still samples an odd varied group now and then,
    which must not restart the count. Skipped and non-finite steps are not counted."""

    name = "dead_campaign"

    def __init__(self, config) -> None:
        self.zero_std = Window(config.steps)
        self.grad_norm = Window(config.steps)
        super().__init__(config)

    def configure(self, config) -> None:
        super().configure(config)
        self.zero_std.resize(config.steps)
        self.grad_norm.resize(config.steps)

    def after(self, batch: TransportBatch, report: StepReport) -> list[Finding]:
        if report.skipped_compute or not is_finite(report.grad_norm):
            return []
        self.zero_std.append(report.zero_std_group_fraction)
        self.grad_norm.append(report.grad_norm)
        steps = self.config.steps
        if len(self.zero_std) < steps:
            return []
        fraction = self.zero_std.mean_std()[0]
        largest = max(self.grad_norm.values)
        if fraction >= self.config.zero_std_fraction_min:
            reason = (
                f"no learning signal for {steps} steps: {fraction:.1%} of groups had equal "
                f"rewards (>= {self.config.zero_std_fraction_min:.0%}); the policy has "
                "collapsed, every further step is paid for and learns nothing"
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
            )
        ]

    def state_dict(self) -> dict[str, Any]:
        return {"zero_std": list(self.zero_std.values), "grad_norm": list(self.grad_norm.values)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.zero_std = Window(self.config.steps, load_floats(state, "zero_std", self.name))
        self.grad_norm = Window(self.config.steps, load_floats(state, "grad_norm", self.name))


class RewardTrendGuard(Guard):
    """WARN when the rolling mean reward over `window` steps has fallen by more than
    `max_drop` (a fraction) from the best it reached (the soak: 0.67 -> 0.199)."""

    name = "reward_trend"

    def __init__(self, config) -> None:
        self.trend = RollingBest(config.window)
        super().__init__(config)

    def configure(self, config) -> None:
        super().configure(config)
        self.trend.resize(config.window)

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

    def state_dict(self) -> dict[str, Any]:
        return self.trend.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not isinstance(state, dict):
            raise GuardsError(f"guard {self.name}: saved state is not a mapping")
        self.trend.load_state_dict(state, self.name)
