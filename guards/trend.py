"""Trend statistics over a window of steps: least-squares slope with its t-statistic.

The campaign-health rules (`reward_hacking`) decide "rises", "falls" and "stays flat" with
one test, not with a single step: the slope of a series against its index and the slope's
t-statistic (slope / its standard error, n - 2 degrees of freedom). Pure Python over a few
dozen floats (no tensors: a guard's per-step cost stays in microseconds). A finding carries a
curve as `curve_evidence` writes it; `evidence_lines` draws it for `grpod incidents show`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache
from itertools import pairwise
from operator import mul
from typing import Any


@dataclass(frozen=True)
class Trend:
    """A series' linear trend: `rise` is slope x (n - 1) (the fitted change over the window),
    `t` the slope's t-statistic (±inf for an exact line, 0 for a constant), `first` and `last`
    the means of its first and last quarter (at least one value each)."""

    n: int
    slope: float
    t: float
    first: float
    last: float

    @property
    def rise(self) -> float:
        return self.slope * (self.n - 1)

    def rising(self, t_min: float) -> bool:
        return self.t >= t_min


def trend(values: Sequence[float]) -> Trend:
    """The least-squares trend of `values` (at least 3) against 0..n-1."""
    n = len(values)
    if n < 3:
        raise ValueError(f"a trend needs 3 values, not {n}")
    mean_y = math.fsum(values) / n
    sxx = n * (n * n - 1) / 12
    xs = _centered(n)
    ys = [v - mean_y for v in values]
    slope = math.fsum(map(mul, xs, ys)) / sxx
    residuals = [y - slope * x for x, y in zip(xs, ys)]
    ssr = math.fsum(map(mul, residuals, residuals))
    se = math.sqrt(max(ssr, 0.0) / (n - 2) / sxx)
    if se > 1e-12 * max(1.0, abs(mean_y)):
        t = slope / se
    else:  # an exact line: the sign of its slope is certain
        t = 0.0 if slope == 0 else math.copysign(math.inf, slope)
    return Trend(n, slope, t, *ends(values))


def ends(values: Sequence[float]) -> tuple[float, float]:
    """The means of the first and the last quarter of `values` (at least one value each):
    `trend`'s `first` and `last`, without its passes over the whole series."""
    quarter = max(1, len(values) // 4)
    return math.fsum(values[:quarter]) / quarter, math.fsum(values[-quarter:]) / quarter


@cache
def _centered(n: int) -> tuple[float, ...]:
    """0..n-1 less their mean."""
    return tuple(i - (n - 1) / 2 for i in range(n))


def quarter_means(values: Sequence[float]) -> list[float]:
    """The means of the four quarters of `values` (the curve over a window, in 4 points)."""
    n = len(values)
    cuts = [round(k * n / 4) for k in range(5)]
    return [math.fsum(values[a:b]) / (b - a) if b > a else math.nan for a, b in pairwise(cuts)]


def curve_evidence(name: str, values: Sequence[float], fit: Trend) -> dict[str, float]:
    """A series over a window as a finding's evidence: `NAME_q1..q4` (its quarter means) and
    `NAME_t` (its trend's t); `evidence_lines` draws it back as one line."""
    quarters = quarter_means(values)
    return {**{f"{name}_q{k + 1}": v for k, v in enumerate(quarters)}, f"{name}_t": fit.t}


def evidence_lines(evidence: dict[str, Any]) -> list[str]:
    """A finding's evidence, one line per number; a curve (`NAME_q1`..`NAME_q4`, quarter means
    of a window, and `NAME_t`, its trend's t) on one line."""
    lines, curves = [], {}
    for key, value in evidence.items():
        name, _, part = key.rpartition("_")
        if name and (part in ("q1", "q2", "q3", "q4", "t")):
            curves.setdefault(name, {})[part] = value
        else:
            lines.append(f"{key} = {value}")
    drawn = []
    for name, parts in curves.items():
        points = " -> ".join(_short(parts[q]) for q in ("q1", "q2", "q3", "q4") if q in parts)
        fit = f" (trend t {_short(parts['t'])})" if "t" in parts else ""
        drawn.append(f"{name} over the window (quarter means): {points}{fit}")
    return drawn + lines


def _short(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)
