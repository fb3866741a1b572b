"""`spike`: a rolling z-score of loss, grad norm and KL against the recent steps, over a spread
with an absolute and a relative floor (a window whose spread is ~0 is not evidence); the grad
norm on a log scale, since it moves by factors."""

from __future__ import annotations

import math
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
    `level_shift_after` consecutive flags, when the new level is accepted. A metric in
    `log_metrics` is judged by its logarithm (its windows keep the values themselves): the
    center is then the geometric mean, the spread is in log units, floored at
    log(1 + relative_floor), and a value <= 0 is skipped. Non-finite values are the `finite`
    guard's; None (KL off) is skipped."""

    name = "spike"
    METRICS = ("loss", "grad_norm", "kl")

    def __init__(self, config) -> None:
        self.windows = {m: Window(config.window) for m in self.METRICS}
        self.consecutive = dict.fromkeys(self.METRICS, 0)
        self._logs: dict[str, Window] = {}  # a log metric's window of logarithms
        super().__init__(config)

    def configure(self, config) -> None:
        super().configure(config)
        for window in self.windows.values():
            window.resize(config.window)
        self._align_logs()

    def _align_logs(self) -> None:
        """Keep each log metric's logarithms beside its window, value for value: its window
        drops what that scale never judges (values <= 0, which a linear scale kept), and
        from here on both take the same appends (`after`)."""
        self._logs = {}
        for metric in self.config.log_metrics:
            window = self.windows[metric]
            window.keep(lambda v: v > 0)
            self._logs[metric] = Window(self.config.window, map(math.log, window.values))

    def _scale(self, metric: str) -> Window:
        """The window as judged: its values, or their logarithms for a log metric."""
        return self._logs[metric] if metric in self._logs else self.windows[metric]

    def center_spread(self, metric: str) -> tuple[float, float]:
        """The window's center and its floored spread, on the metric's scale (log units for
        a log metric; see the class docstring)."""
        window = self._scale(metric)
        if self.config.spread == "mad":
            center, spread = window.median_mad()
            spread *= MAD_TO_STD
        else:
            center, spread = window.mean_std()
        if metric in self.config.log_metrics:
            floor = max(math.log1p(self.config.relative_floor), 1e-300)
        else:
            floor = max(self.config.min_std, self.config.relative_floor * abs(center), 1e-300)
        return center, max(spread, floor)

    def zscore(self, metric: str, value: float) -> float | None:
        """|value - center| / floored spread over the metric's window, on its scale; None
        before min_steps (or for a log metric's value <= 0)."""
        log = metric in self.config.log_metrics
        if log and value <= 0:
            return None
        if len(self._scale(metric)) < self.config.min_steps:
            return None
        center, spread = self.center_spread(metric)
        return abs((math.log(value) if log else value) - center) / spread

    def after(self, batch: TransportBatch, report: StepReport) -> list[Finding]:
        findings = []
        for metric in self.config.metrics:
            value = getattr(report, metric)
            if not is_finite(value) or (metric in self.config.log_metrics and value <= 0):
                continue
            z = self.zscore(metric, value)
            flagged = z is not None and z > self.config.threshold_sigma
            if flagged:
                findings.append(self._finding(metric, value, z))
                self.consecutive[metric] += 1
            else:
                self.consecutive[metric] = 0
            if not flagged or self.consecutive[metric] >= self.config.level_shift_after:
                self.windows[metric].append(value)
                if metric in self._logs:
                    self._logs[metric].append(math.log(value))
        return findings

    def _finding(self, metric: str, value: float, z: float) -> Finding:
        center, spread = self.center_spread(metric)
        steps = len(self.windows[metric])
        if metric in self.config.log_metrics:  # the center as a value: the geometric mean
            center = math.exp(center)
            message = f"{value / center:.3g}x its geometric mean {center:.4g}, {z:.1f} log spreads"
        else:
            message = f"{z:.1f} spreads from its center {center:.4g}"
        return self.finding(
            f"{metric} {value:.4g} is {message} (spread {spread:.3g}, {steps} steps)",
            kind=metric,
            value=value,
            zscore=z,
            severity=z,
            center=center,
            spread=spread,
        )

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
        self._align_logs()
        try:
            self.consecutive = {
                m: int(state.get("consecutive", {}).get(m, 0)) for m in self.METRICS
            }
        except (TypeError, ValueError, AttributeError):
            raise GuardsError(f"guard {self.name}: saved counters are not integers") from None
