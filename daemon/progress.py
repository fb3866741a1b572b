"""A one-line progress bar on a TTY: step, reward, verdict counts. Off when not a terminal."""

from __future__ import annotations

import sys
import time
from collections import Counter
from typing import TextIO

WIDTH = 24


class Progress:
    """Redraws one line of `stream` (stderr); `clear()` before any other line is written."""

    def __init__(self, total: int, start: int = 0, stream: TextIO | None = None) -> None:
        self.total = total  # 0 = unbounded
        self.stream = sys.stderr if stream is None else stream
        self.start = start
        self.verdicts: Counter[str] = Counter()
        self._line = ""
        self._started = time.monotonic()

    def update(self, step: int, reward_mean: float, verdict: str) -> None:
        """`step` just finished with this mean reward and verdict action name."""
        self.verdicts[verdict] += 1
        done = step + 1
        if self.total:
            filled = int(WIDTH * min(done, self.total) / self.total)
            bar = f"[{'#' * filled}{'.' * (WIDTH - filled)}] {done}/{self.total}"
        else:
            bar = f"step {done}"
        rate = (done - self.start) / max(time.monotonic() - self._started, 1e-9)
        counts = " ".join(f"{k}:{v}" for k, v in sorted(self.verdicts.items()))
        self._line = f"{bar}  reward {reward_mean:.3f}  {counts}  {rate:.1f} steps/s"
        self._write("\r\x1b[K" + self._line)

    def clear(self) -> None:
        if self._line:
            self._write("\r\x1b[K")

    def finish(self) -> None:
        if self._line:
            self._write("\n")
            self._line = ""

    def _write(self, text: str) -> None:
        try:
            self.stream.write(text)
            self.stream.flush()
        except (OSError, ValueError):
            pass


def wanted(mode: str, stream: TextIO | None = None) -> bool:
    """progress = "on" | "off" | "auto" (only when `stream`, stderr by default, is a TTY)."""
    if mode != "auto":
        return mode == "on"
    out = sys.stderr if stream is None else stream
    try:
        return out.isatty()
    except (AttributeError, ValueError):
        return False
