"""`clip`: gradient clipping that suppresses real updates, step after step."""

from __future__ import annotations

from collections import deque
from typing import Any

from grpod.engine import StepReport, TransportBatch
from grpod.guards.base import Guard, is_finite
from grpod.guards.errors import GuardsError
from grpod.guards.verdict import Finding


class ClipGuard(Guard):
    """WARN when the clip coefficient was below `clip_coef_min` on more than `fraction_max` of
    the last `window` steps (counted against the full window: clipping that suppresses real
    updates). Steps with a non-finite grad norm are the `finite` guard's and are not counted."""

    name = "clip"

    def __init__(self, config) -> None:
        self.history: deque[bool] = deque(maxlen=config.window)
        super().__init__(config)

    def configure(self, config) -> None:
        super().configure(config)
        if self.history.maxlen != config.window:
            self.history = deque(self.history, maxlen=config.window)

    def after(self, batch: TransportBatch, report: StepReport) -> list[Finding]:
        if not is_finite(report.grad_norm):
            return []
        self.history.append(report.clip_coef < self.config.clip_coef_min)
        clipped = sum(self.history)
        limit = self.config.fraction_max * self.config.window
        if clipped <= limit:
            return []
        return [
            self.finding(
                f"clip coefficient < {self.config.clip_coef_min:g} on {clipped} of the last "
                f"{len(self.history)} steps (limit {limit:g} of {self.config.window})",
                clipped_steps=float(clipped),
                window=float(self.config.window),
                clip_coef=report.clip_coef,
            )
        ]

    def state_dict(self) -> dict[str, Any]:
        return {"clipped": [bool(x) for x in self.history]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        values = state.get("clipped", [])
        if not isinstance(values, list) or not all(isinstance(v, bool) for v in values):
            raise GuardsError(f"guard {self.name}: saved 'clipped' is not a list of booleans")
        self.history = deque(values, maxlen=self.config.window)
