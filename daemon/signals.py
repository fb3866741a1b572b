"""Signals: SIGTERM/SIGINT stop after the step in flight; a second one abandons it; SIGHUP reloads.

Handlers only set flags, except a second stop signal while the loop is inside the step's
compute (`abortable`): that raises `AbandonStep` so the step is dropped (never applied, never
recorded) and the process exits at once without a checkpoint. Outside compute (recording,
checkpointing) the loop finishes what it is writing and then exits, so nothing is left
half-written.
"""

from __future__ import annotations

import signal
from types import FrameType

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class AbandonStep(BaseException):
    """Raised into the step's compute by a second stop signal (BaseException: not an error)."""


class Signals:
    """Flags the loop polls between steps; install() in the main thread."""

    def __init__(self) -> None:
        self.stop_signal: int | None = None  # the first SIGTERM/SIGINT
        self.abandon_signal: int | None = None  # the second one
        self.reload_requested = False  # SIGHUP
        self.stop_count = 0  # stop signals received so far
        self.abortable = False  # True while the loop is in rollout / decide_step
        self._previous: dict[int, object] = {}

    @property
    def stop_requested(self) -> bool:
        return self.stop_signal is not None

    def install(self) -> None:
        for signum in (*STOP_SIGNALS, signal.SIGHUP):
            self._previous[signum] = signal.signal(signum, self._handle)

    def restore(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)  # type: ignore[arg-type]
        self._previous.clear()

    def take_reload(self) -> bool:
        requested, self.reload_requested = self.reload_requested, False
        return requested

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if signum == signal.SIGHUP:
            self.reload_requested = True
            return
        self.stop_count += 1
        if self.stop_signal is None:
            self.stop_signal = signum
            return
        self.abandon_signal = signum
        if self.abortable:
            self.abortable = False
            raise AbandonStep(signal.Signals(signum).name)
