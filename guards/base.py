"""The guard interface and the small statistics every guard shares.

A guard is built from its config section, holds its own bounded history, and has two hooks:
`before(batch) -> (batch | None, findings)` (a returned `None` asks to skip the compute) and
`after(batch, report) -> findings`. It reads only `TransportBatch` and `StepReport`.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Iterable
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
    """A bounded history of finite floats (a deque with a resizable `maxlen`)."""

    def __init__(self, size: int, values: Iterable[float] = ()) -> None:
        self.values: deque[float] = deque(values, maxlen=size)

    def resize(self, size: int) -> None:
        if size != self.values.maxlen:
            self.values = deque(self.values, maxlen=size)

    def append(self, value: float) -> None:
        self.values.append(float(value))

    def __len__(self) -> int:
        return len(self.values)

    def mean_std(self) -> tuple[float, float]:
        """Mean and population std (FP64); (nan, nan) when empty."""
        n = len(self.values)
        if n == 0:
            return math.nan, math.nan
        mean = math.fsum(self.values) / n
        var = math.fsum((v - mean) ** 2 for v in self.values) / n
        return mean, math.sqrt(var)

    def median_mad(self) -> tuple[float, float]:
        """Median and median absolute deviation from it; (nan, nan) when empty."""
        if not self.values:
            return math.nan, math.nan
        median = statistics.median(self.values)
        return median, statistics.median(abs(v - median) for v in self.values)


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
        return self.window.mean_std()[0]

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
