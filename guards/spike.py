"""`spike`: a rolling z-score of loss, grad norm and KL against the recent steps."""

from __future__ import annotations

from typing import Any

from grpod.engine import StepReport, TransportBatch
from grpod.guards.base import Guard, Window, is_finite, load_floats
from grpod.guards.errors import GuardsError
from grpod.guards.verdict import Finding


class SpikeGuard(Guard):
    """Flag a metric more than `threshold_sigma` population stds from its window mean, once the
    window holds `min_steps` values. A flagged value stays out of the baseline (one spike must
    not hide the next) until `level_shift_after` consecutive flags, when the new level is
    accepted. Non-finite values are the `finite` guard's; None (KL off) is skipped."""

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

    def zscore(self, metric: str, value: float) -> float | None:
        """|value - mean| / max(std, min_std) over the metric's window; None before min_steps."""
        window = self.windows[metric]
        if len(window) < self.config.min_steps:
            return None
        mean, std = window.mean_std()
        return abs(value - mean) / max(std, self.config.min_std, 1e-300)

    def after(self, batch: TransportBatch, report: StepReport) -> list[Finding]:
        findings = []
        for metric in self.config.metrics:
            value = getattr(report, metric)
            if not is_finite(value):
                continue
            z = self.zscore(metric, value)
            flagged = z is not None and z > self.config.threshold_sigma
            if flagged:
                mean, std = self.windows[metric].mean_std()
                findings.append(
                    self.finding(
                        f"{metric} {value:.4g} is {z:.1f} sigma from its mean {mean:.4g} "
                        f"(std {std:.3g}, {len(self.windows[metric])} steps)",
                        value=value,
                        zscore=z,
                        mean=mean,
                        std=std,
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
