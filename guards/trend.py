"""Trend statistics over a window of steps: least-squares slope with its t-statistic.

The campaign-health rules (`reward_hacking`) decide "rises", "falls" and "stays flat" with
one test, not with a single step: the slope of a series against its index and the slope's
t-statistic (slope / its standard error, n - 2 degrees of freedom). Pure Python over a few
dozen floats (no tensors: a guard's per-step cost stays in microseconds).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise


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
    mean_x = (n - 1) / 2
    mean_y = math.fsum(values) / n
    sxx = n * (n * n - 1) / 12
    sxy = math.fsum((i - mean_x) * (v - mean_y) for i, v in enumerate(values))
    slope = sxy / sxx
    ssr = math.fsum((v - mean_y - slope * (i - mean_x)) ** 2 for i, v in enumerate(values))
    se = math.sqrt(max(ssr, 0.0) / (n - 2) / sxx)
    if se > 1e-12 * max(1.0, abs(mean_y)):
        t = slope / se
    else:  # an exact line: the sign of its slope is certain
        t = 0.0 if slope == 0 else math.copysign(math.inf, slope)
    quarter = max(1, n // 4)
    return Trend(
        n, slope, t, math.fsum(values[:quarter]) / quarter, math.fsum(values[-quarter:]) / quarter
    )


def quarter_means(values: Sequence[float]) -> list[float]:
    """The means of the four quarters of `values` (the curve over a window, in 4 points)."""
    n = len(values)
    cuts = [round(k * n / 4) for k in range(5)]
    return [math.fsum(values[a:b]) / (b - a) if b > a else math.nan for a, b in pairwise(cuts)]
