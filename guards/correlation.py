"""`gradnorm_vtc_correlation`: the grad norm tracking the counter's scale error betrays it.

The loss is divided by the engine's valid-token count. With a counter that reads one chunk
instead of the step total, the gradient is scaled by expected / valid (the loss mask's sum over
the counter's reading) and the pre-clip grad norm follows that factor: corr 0.83 with 1 / vtc
over 76 steps in the campaign this guard comes from. The guard correlates the grad norm with
expected / valid rather than with 1 / valid: on a healthy run whose completions lengthen (a
converging policy at full length) the grad norm of a token-mean loss shrinks as 1 / valid does,
although the counter is exact (corr 0.95 over 16 steps on the converged toy run); with an exact
counter expected / valid is 1 on every step and there is nothing to correlate.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from grpod.guards.base import Guard, PairedWindow, Window, load_floats
from grpod.guards.verdict import Finding

if TYPE_CHECKING:  # annotations only: `grpod plot` uses the correlation without torch
    from grpod.engine import StepReport, TransportBatch


def pearson(xs: list[float], ys: list[float]) -> float | None:
    """Pearson correlation, exact and rounded once (`PairedWindow.pearson`); None with fewer
    than 2 points, unequal lengths or a constant series."""
    if len(xs) != len(ys):
        return None
    return PairedWindow(max(len(xs), 1), xs, ys).pearson()


def is_evidence(grad_norm: float, valid_tokens: float) -> bool:
    """Whether a step says anything about the token scale of its gradient: it has valid
    tokens and a finite, non-zero grad norm (0 means every advantage was 0)."""
    return valid_tokens > 0 and math.isfinite(grad_norm) and grad_norm > 0.0


class GradNormVTCCorrelationGuard(Guard):
    """WARN when the rolling Pearson correlation of grad norm and expected_valid_tokens /
    valid_tokens exceeds the threshold (a constant ratio, an exact counter, reads None). Steps
    with no gradient (grad norm 0: every advantage 0), no valid tokens or a non-finite grad norm
    carry no evidence of the token scale and are not recorded."""

    name = "gradnorm_vtc_correlation"

    def __init__(self, config) -> None:
        self.pairs = PairedWindow(config.window)  # (grad norm, expected / valid tokens)
        self.value: float | None = None
        super().__init__(config)

    @property
    def grad_norms(self) -> Window:
        return self.pairs.x

    @property
    def scale_errors(self) -> Window:
        """Expected / valid tokens, step by step."""
        return self.pairs.y

    def configure(self, config) -> None:
        super().configure(config)
        self.pairs.resize(config.window)
        self.value = self._compute()

    def after(self, batch: TransportBatch, report: StepReport) -> list[Finding]:
        self.observe(report.grad_norm, report.valid_tokens, report.expected_valid_tokens)
        if self.value is None or self.value <= self.config.threshold:
            return []
        return [
            self.finding(
                f"grad norm tracks expected/valid tokens: corr {self.value:.3f} > "
                f"{self.config.threshold} over {len(self.grad_norms)} steps",
                correlation=self.value,
                steps=float(len(self.grad_norms)),
                threshold=self.config.threshold,
            )
        ]

    def observe(self, grad_norm: float, valid_tokens: float, expected_valid_tokens: float) -> None:
        """Take one step's reading into the window (`grpod plot` replays a run through this)."""
        if is_evidence(grad_norm, valid_tokens) and math.isfinite(expected_valid_tokens):
            self.pairs.append(grad_norm, expected_valid_tokens / valid_tokens)
            self.value = self._compute()

    def _compute(self) -> float | None:
        if len(self.grad_norms) < self.config.min_steps:
            return None
        return self.pairs.pearson()

    def state_dict(self) -> dict[str, Any]:
        return {
            "grad_norms": list(self.grad_norms.values),
            "token_scale_errors": list(self.scale_errors.values),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        # an older grpod saved 1 / valid_tokens ("inverse_valid_tokens"): not this series, so
        # its window starts again
        grads = load_floats(state, "grad_norms", self.name)
        errors = load_floats(state, "token_scale_errors", self.name)
        n = min(len(grads), len(errors))
        self.pairs = PairedWindow(
            self.config.window, grads[len(grads) - n :], errors[len(errors) - n :]
        )
        self.value = self._compute()
