"""`spike`: a rolling z-score of loss, grad norm and KL against the recent steps, over a spread
with an absolute and a relative floor (a window whose spread is ~0 is not evidence)."""

from __future__ import annotations

from typing import Any

from grpod.engine import StepReport, TransportBatch
from grpod.guards.base import Guard, Window, is_finite, load_floats
from grpod.guards.errors import GuardsError
from grpod.guards.verdict import Finding

MAD_TO_STD = 1.4826  # MAD x this estimates a normal distribution's std


class SpikeGuard(Guard):
    """Flag a metric more than `threshold_sigma` spreads from its window's center, once the
    window holds `min_steps` values. The center and spread are the mean and population std
    (`spread = "std"`) or the median and 1.4826 x MAD (`"mad"`, robust to the window's own
    outliers); the spread is at least `min_std` and `relative_floor` x |center|, so a flat
    window (a collapsed campaign's loss of exactly 0) cannot turn a tiny move into a spike.
    A flagged value stays out of the baseline (one spike must not hide the next) until
    `level_shift_after` consecutive flags, when the new level is accepted. Non-finite values
    are the `finite` guard's; None (KL off) is skipped."""

    name = "spike"
    METRICS = ("loss", "grad_norm", "kl")

    def __init__(self, config) -> None:
        self.windows = {m: Window(config.window) for m in self.METRICS}
        self.consecutive = dict.fromkeys(self.METRICS, 0)
        super().__init__(config)

    def configure(self, config) -> None:
        super().configure(config)
        for window in self.windows.values():
            window.resize(config.window)

    def center_spread(self, metric: str) -> tuple[float, float]:
        """The window's center and its floored spread (see the class docstring)."""
        window = self.windows[metric]
        if self.config.spread == "mad":
            center, spread = window.median_mad()
            spread *= MAD_TO_STD
        else:
            center, spread = window.mean_std()
        floor = max(self.config.min_std, self.config.relative_floor * abs(center), 1e-300)
        return center, max(spread, floor)

    def zscore(self, metric: str, value: float) -> float | None:
        """|value - center| / floored spread over the metric's window; None before min_steps."""
        if len(self.windows[metric]) < self.config.min_steps:
            return None
        center, spread = self.center_spread(metric)
        return abs(value - center) / spread

    def after(self, batch: TransportBatch, report: StepReport) -> list[Finding]:
        findings = []
        for metric in self.config.metrics:
            value = getattr(report, metric)
            if not is_finite(value):
                continue
            z = self.zscore(metric, value)
            flagged = z is not None and z > self.config.threshold_sigma
            if flagged:
                center, spread = self.center_spread(metric)
                findings.append(
                    self.finding(
                        f"{metric} {value:.4g} is {z:.1f} spreads from its center {center:.4g} "
                        f"(spread {spread:.3g}, {len(self.windows[metric])} steps)",
                        kind=metric,
                        value=value,
                        zscore=z,
                        severity=z,
                        center=center,
                        spread=spread,
                    )
                )
                self.consecutive[metric] += 1
            else:
                self.consecutive[metric] = 0
            if not flagged or self.consecutive[metric] >= self.config.level_shift_after:
                self.windows[metric].append(value)
        return findings

    def state_dict(self) -> dict[str, Any]:
        return {
            "windows": {m: list(w.values) for m, w in self.windows.items()},
            "consecutive": dict(self.consecutive),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        windows = state.get("windows", {})
        if not isinstance(windows, dict):
            raise GuardsError(f"guard {self.name}: saved windows are not a mapping")
        for metric in self.METRICS:
            self.windows[metric] = Window(
                self.config.window, load_floats(windows, metric, self.name)
            )
        try:
            self.consecutive = {
                m: int(state.get("consecutive", {}).get(m, 0)) for m in self.METRICS
            }
        except (TypeError, ValueError, AttributeError):
            raise GuardsError(f"guard {self.name}: saved counters are not integers") from None
