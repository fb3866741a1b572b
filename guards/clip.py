"""`clip`: gradient clipping that suppresses real updates, step after step.

A pretrained model clips on every healthy step at max_grad_norm 1.0 (pre-clip grad norms 3-11
on W4, a clip coefficient of 0.09-0.32): that is the run's level, not a fault. What the seed's
failure showed is clipping driven by something else (a token counter that read one chunk made
the grad norm ~5x its level on low-count steps, and the clip cut those updates ~5x). So a step
counts as suppressed only when its clip coefficient is small *and* its pre-clip grad norm is far
above the run's own baseline: the median of its first `baseline_steps` finite, non-zero norms.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from typing import Any

from grpod.engine import StepReport, TransportBatch
from grpod.guards.base import Guard, is_finite, load_floats
from grpod.guards.errors import GuardsError
from grpod.guards.verdict import Finding


class ClipGuard(Guard):
    """WARN when more than `fraction_max` of the last `window` steps were clipped below
    `clip_coef_min` with a pre-clip grad norm above `norm_ratio_max` x the baseline (counted
    against the full window). Until the baseline has `baseline_steps` readings no step counts.
    Steps with a non-finite grad norm are the `finite` guard's and are not counted; a zero
    grad norm (every advantage 0) says nothing of the level and is not part of the baseline."""

    name = "clip"

    def __init__(self, config) -> None:
        self.history: deque[bool] = deque(maxlen=config.window)
        self.baseline_norms: list[float] = []
        super().__init__(config)

    def configure(self, config) -> None:
        super().configure(config)
        if self.history.maxlen != config.window:
            self.history = deque(self.history, maxlen=config.window)

    @property
    def baseline(self) -> float | None:
        """The median pre-clip grad norm of the run's first `baseline_steps` readings."""
        if len(self.baseline_norms) < self.config.baseline_steps:
            return None
        return statistics.median(self.baseline_norms[: self.config.baseline_steps])

    def after(self, batch: TransportBatch, report: StepReport) -> list[Finding]:
        grad_norm = report.grad_norm
        if not is_finite(grad_norm):
            return []
        baseline = self.baseline
        if baseline is None:
            if grad_norm > 0.0:
                self.baseline_norms.append(float(grad_norm))
            return []
        ratio = grad_norm / baseline if baseline > 0.0 else math.inf
        self.history.append(
            report.clip_coef < self.config.clip_coef_min and ratio > self.config.norm_ratio_max
        )
        suppressed = sum(self.history)
        limit = self.config.fraction_max * self.config.window
        if suppressed <= limit:
            return []
        return [
            self.finding(
                f"clip coefficient < {self.config.clip_coef_min:g} with the grad norm > "
                f"{self.config.norm_ratio_max:g}x its baseline {baseline:.3g} on {suppressed} of "
                f"the last {len(self.history)} steps (limit {limit:g} of {self.config.window})",
                clipped_steps=float(suppressed),
                window=float(self.config.window),
                clip_coef=report.clip_coef,
                grad_norm_ratio=ratio,
                baseline_grad_norm=baseline,
            )
        ]

    def state_dict(self) -> dict[str, Any]:
        return {"clipped": [bool(x) for x in self.history], "baseline_norms": self.baseline_norms}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        values = state.get("clipped", [])
        if not isinstance(values, list) or not all(isinstance(v, bool) for v in values):
            raise GuardsError(f"guard {self.name}: saved 'clipped' is not a list of booleans")
        self.baseline_norms = load_floats(state, "baseline_norms", self.name)
        # an older grpod's checkpoint has no baseline, and its flags used the absolute rule:
        # both are taken again from here on
        kept = values if "baseline_norms" in state else []
        self.history = deque(kept, maxlen=self.config.window)
