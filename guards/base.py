"""The guard interface and the small statistics every guard shares.

A guard is built from its config section, holds its own bounded history, and has two hooks:
`before(batch) -> (batch | None, findings)` (a returned `None` asks to skip the compute) and
`after(batch, report) -> findings`. It reads only `TransportBatch` and `StepReport`.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, ClassVar

from pydantic import BaseModel

from grpod.guards.errors import GuardsError
from grpod.guards.verdict import Action, Finding

if TYPE_CHECKING:  # annotations only: `grpod plot` uses the correlation without torch
    from grpod.engine import StepReport, TransportBatch


class Guard:
    """Base class: subclasses set `name`, and override the hooks and the state they keep."""

    name: ClassVar[str]

    def __init__(self, config: BaseModel) -> None:
        self.configure(config)

    def configure(self, config: BaseModel) -> None:
        """Take a (new) config section; history is kept (SIGHUP reload)."""
        self.config = config

    @property
    def enabled(self) -> bool:
        return bool(self.config.enabled)

    @property
    def action(self) -> Action:
        return Action[self.config.action]

    def finding(
        self, message: str, action: Action | None = None, kind: str = "", **evidence: float
    ) -> Finding:
        """A finding of this guard (its configured action unless `action`); `kind` names
        which of its conditions it is when it has several (one incident per episode of each)."""
        action = self.action if action is None else action
        return Finding(self.name, action, message, evidence, kind)

    def before(self, batch: TransportBatch) -> tuple[TransportBatch | None, list[Finding]]:
        return batch, []

    def after(self, batch: TransportBatch, report: StepReport) -> list[Finding]:
        return []

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state:
            raise GuardsError(f"guard {self.name}: unexpected saved state keys {sorted(state)}")


class Window:
    """A bounded history of floats (a deque with a resizable `maxlen`) whose sum and sum of
    squares are kept exactly as values come and go: integers in units of 2**-scale, the
    finest binary fraction a value in it has had (`exact`). Its mean and std cost the same at
    any size and are the exact values, rounded once. A non-finite value makes both nan while
    it is in the window."""

    def __init__(self, size: int, values: Iterable[float] = ()) -> None:
        self._refill(size, values)

    def _refill(self, size: int, values: Iterable[float]) -> None:
        kept = list(values)  # `values` may be this window's own deque
        self._values: deque[float] = deque(maxlen=size)
        self._sum = self._squares = self._nonfinite = self.scale = 0
        for value in kept:
            self.append(value)

    @property
    def values(self) -> deque[float]:
        """The values, oldest first (read them; `append`, `resize` and `keep` change them)."""
        return self._values

    def resize(self, size: int) -> None:
        if size != self._values.maxlen:
            self._refill(size, self._values)

    def keep(self, predicate: Callable[[float], bool]) -> None:
        """Drop the values `predicate` rejects, keeping the others in order."""
        self._refill(self._values.maxlen or 1, filter(predicate, self._values))

    def append(self, value: float) -> None:
        value = float(value)
        if self._values.maxlen == 0:  # holds nothing: the value is dropped, as a deque does
            return
        if len(self._values) == self._values.maxlen:
            self._count(self._values[0], -1)
        self._values.append(value)
        self._count(value, 1)

    def exact(self, value: float) -> int:
        """A finite `value` as an integer number of 2**-scale; a value finer than the scale
        first refines it (the sums are shifted, never rounded)."""
        numerator, denominator = value.as_integer_ratio()  # the denominator is a power of 2
        shift = denominator.bit_length() - 1
        if shift > self.scale:
            self._sum <<= shift - self.scale
            self._squares <<= 2 * (shift - self.scale)
            self.scale = shift
        return numerator << (self.scale - shift)

    def _count(self, value: float, sign: int) -> None:
        if not math.isfinite(value):
            self._nonfinite += sign
            return
        exact = self.exact(value)
        self._sum += sign * exact
        self._squares += sign * exact * exact

    def __len__(self) -> int:
        return len(self._values)

    @property
    def finite(self) -> bool:
        return not self._nonfinite

    def mean(self) -> float:
        """The mean; nan when empty or while a value is non-finite."""
        n = len(self._values)
        if n == 0 or self._nonfinite:
            return math.nan
        return self._sum / (n << self.scale)  # int / int: correctly rounded

    def moments(self) -> tuple[int, int, int]:
        """(n, the sum, n^2 x the variance): exact, in units of 2**-scale and of its square;
        see `PairedWindow.pearson`."""
        n = len(self._values)
        return n, self._sum, n * self._squares - self._sum * self._sum

    def mean_std(self) -> tuple[float, float]:
        """Mean and population std; (nan, nan) when empty or while a value is non-finite."""
        n, _, spread = self.moments()
        if n == 0 or self._nonfinite:
            return math.nan, math.nan
        try:
            variance = spread / ((n * n) << (2 * self.scale))
        except OverflowError:  # a spread beyond the largest float (values near 1e154 and up)
            variance = math.inf
        return self.mean(), math.sqrt(variance)

    def median_mad(self) -> tuple[float, float]:
        """Median and median absolute deviation from it; (nan, nan) when empty."""
        if not self._values:
            return math.nan, math.nan
        median = statistics.median(self._values)
        return median, statistics.median(abs(v - median) for v in self._values)


class PairedWindow:
    """Two windows filled in step, `x` and `y`, with the exact sum of their products (in
    units of 2**-(x.scale + y.scale)), so that their Pearson correlation costs the same at any
    size and is exact, rounded once."""

    def __init__(self, size: int, xs: Iterable[float] = (), ys: Iterable[float] = ()) -> None:
        self._refill(size, list(zip(xs, ys)))

    def _refill(self, size: int, pairs: list[tuple[float, float]]) -> None:
        self.x, self.y = Window(size), Window(size)
        self._cross = 0
        for x, y in pairs:
            self.append(x, y)

    def resize(self, size: int) -> None:
        if size != self.x.values.maxlen:
            self._refill(size, list(zip(self.x.values, self.y.values)))

    def append(self, x: float, y: float) -> None:
        if len(self.x) == self.x.values.maxlen:
            self._cross -= self._product(self.x.values[0], self.y.values[0])
        scale = self.x.scale + self.y.scale
        self.x.append(x)
        self.y.append(y)
        self._cross <<= self.x.scale + self.y.scale - scale
        self._cross += self._product(self.x.values[-1], self.y.values[-1])

    def _product(self, x: float, y: float) -> int:
        if not (math.isfinite(x) and math.isfinite(y)):
            return 0
        return self.x.exact(x) * self.y.exact(y)  # within both scales: neither moves

    def __len__(self) -> int:
        return len(self.x)

    def pearson(self) -> float | None:
        """The correlation of x and y, in [-1, 1]; None with fewer than 2 pairs, a constant
        series or a non-finite value."""
        n, sum_x, sxx = self.x.moments()
        _, sum_y, syy = self.y.moments()
        if n < 2 or not (self.x.finite and self.y.finite) or sxx <= 0 or syy <= 0:
            return None
        sxy = n * self._cross - sum_x * sum_y  # n^2 x the covariance
        return max(-1.0, min(1.0, math.copysign(math.sqrt(sxy * sxy / (sxx * syy)), sxy)))


class RollingBest:
    """A rolling mean over the last `size` values and the best (highest) it has been since it
    first filled: `drop()` is how far the current mean has fallen from that best, as a
    fraction of it (0 while it holds, None until the window is full or when the best is <= 0)."""

    def __init__(self, size: int) -> None:
        self.window = Window(size)
        self.best: float | None = None

    def resize(self, size: int) -> None:
        self.window.resize(size)

    def append(self, value: float) -> None:
        self.window.append(value)
        if len(self.window) == self.window.values.maxlen:
            mean = self.mean
            self.best = mean if self.best is None else max(self.best, mean)

    @property
    def full(self) -> bool:
        return len(self.window) == self.window.values.maxlen

    @property
    def mean(self) -> float:
        return self.window.mean()

    def drop(self) -> float | None:
        if not self.full or self.best is None or self.best <= 0.0:
            return None
        return max(0.0, (self.best - self.mean) / self.best)

    def state_dict(self) -> dict[str, Any]:
        return {"values": list(self.window.values), "best": self.best}

    def load_state_dict(self, state: dict[str, Any], guard: str) -> None:
        self.window = Window(self.window.values.maxlen or 1, load_floats(state, "values", guard))
        best = state.get("best")
        if best is not None and (not isinstance(best, (int, float)) or isinstance(best, bool)):
            raise GuardsError(f"guard {guard}: saved 'best' is not a number")
        self.best = None if best is None else float(best)


class TrendGuard(Guard):
    """A guard over one `RollingBest` of `config.window` steps, saved with its checkpoint."""

    def __init__(self, config: BaseModel) -> None:
        self.trend = RollingBest(config.window)
        super().__init__(config)

    def configure(self, config: BaseModel) -> None:
        super().configure(config)
        self.trend.resize(config.window)

    def state_dict(self) -> dict[str, Any]:
        return self.trend.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not isinstance(state, dict):
            raise GuardsError(f"guard {self.name}: saved state is not a mapping")
        self.trend.load_state_dict(state, self.name)


def is_finite(value: float | None) -> bool:
    return value is not None and math.isfinite(value)


def load_floats(state: dict[str, Any], key: str, guard: str) -> list[float]:
    """A saved list of numbers, or a GuardsError naming the guard and the key."""
    values = state.get(key, [])
    if not isinstance(values, list) or not all(
        isinstance(v, (int, float)) and not isinstance(v, bool) for v in values
    ):
        raise GuardsError(f"guard {guard}: saved state {key!r} is not a list of numbers")
    return [float(v) for v in values]
