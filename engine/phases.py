"""`PhaseClock`: the wall-clock seconds of a step's phases, nested phases taken out."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

# the engine's phases, in step order: the weight push into a separate sampler (or the
# sharded run's rollout copy) and its check are their own phases, never part of "rollout"
PHASES = ("sync", "sync_check", "rollout", "score", "grad", "optim")


class PhaseClock:
    """Seconds per phase since the last `take()`; a phase timed inside another is taken out
    of the outer one's seconds (the weight sync inside a rollout), so the phases add up."""

    def __init__(self) -> None:
        self._seconds: dict[str, float] = {}  # this step's phase seconds so far
        self._inner: list[float] = []  # seconds of phases timed inside the open ones

    @contextmanager
    def timed(self, phase: str) -> Iterator[None]:
        started = time.perf_counter()
        self._inner.append(0.0)
        try:
            yield
        finally:
            spent = time.perf_counter() - started
            inner = self._inner.pop()
            self._seconds[phase] = self._seconds.get(phase, 0.0) + spent - inner
            if self._inner:
                self._inner[-1] += spent

    def take(self) -> dict[str, float]:
        """Every phase's seconds (0 for one that did not run); the clock starts from zero."""
        seconds = {name: self._seconds.get(name, 0.0) for name in PHASES}
        self._seconds = {}
        return seconds
