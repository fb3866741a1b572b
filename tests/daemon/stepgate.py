"""A reward that holds `grpod run` inside one step's compute, so a test signals it there.

`rewards = [SPEC]` scores like the copy task's own reward. With `StepGate(...).env` in the
daemon's environment, the first completion of the gate's step (completions counted while
the daemon's stop handler is installed: preflight's one call is not a step's) wraps that
handler, writes `held` in the gate directory and waits in the daemon's main thread, inside
the step's compute. Every stop signal the daemon's handler has taken is counted in
`handled`; after `release` of them the step goes on; a handler that raises (a second
SIGTERM: the step is abandoned) ends the wait with its exception. The test waits on those
files, never on how fast the daemon is; HOLD_SECONDS only bounds a hold nobody ends.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from types import FrameType

from grpod.engine.data.tasks import first_token_reward
from tests.daemon.helpers import wait_until

SPEC = "tests.daemon.stepgate:reward"
ROOT = Path(__file__).resolve().parents[2]
# the daemon imports SPEC from the checkout (before any path it was given)
ENV = {"PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
HOLD_SECONDS = 300.0  # failure bounds only: a held daemon is released by its signals
_calls = 0  # completions scored by the daemon's loop in this process


def reward(prompt: str, completion: str, answer: str) -> float:
    global _calls
    if callable(signal.getsignal(signal.SIGTERM)):  # the daemon's loop, not preflight
        gate = os.environ.get("GRPOD_TEST_GATE")
        if gate and _calls == int(os.environ["GRPOD_TEST_GATE_AT"]):
            _hold(Path(gate), int(os.environ["GRPOD_TEST_GATE_RELEASE"]))
        _calls += 1
    return first_token_reward(prompt, completion, answer)


def _hold(where: Path, release: int) -> None:
    daemon_handler = signal.getsignal(signal.SIGTERM)
    handled = 0

    def counting(signum: int, frame: FrameType | None) -> None:
        nonlocal handled
        daemon_handler(signum, frame)  # a second stop signal raises here: the step is dropped
        handled += 1
        (where / "handled").write_text(str(handled))

    signal.signal(signal.SIGTERM, counting)
    try:
        (where / "held").write_text(str(os.getpid()))  # after the wrap: no signal is missed
        deadline = time.monotonic() + HOLD_SECONDS
        while handled < release and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        signal.signal(signal.SIGTERM, daemon_handler)


class StepGate:
    """The test's side of the gate: the daemon's environment, and waits on what it writes."""

    def __init__(self, where: Path, step: int, completions: int, release: int = 1) -> None:
        """Hold step `step` (of `completions` completions a step) until the daemon has
        handled `release` stop signals."""
        where.mkdir(parents=True, exist_ok=True)
        self.where = where
        self.env = {
            **ENV,
            "GRPOD_TEST_GATE": str(where),
            "GRPOD_TEST_GATE_AT": str(step * completions),
            "GRPOD_TEST_GATE_RELEASE": str(release),
        }

    def wait_held(self, alive: Callable[[], bool]) -> None:
        """Until the daemon is held inside the gate's step."""
        wait_until(lambda: (self.where / "held").is_file(), "the gate held", alive, HOLD_SECONDS)

    def wait_handled(self, count: int, alive: Callable[[], bool]) -> None:
        """Until the daemon's own handler has taken `count` stop signals in the gate."""
        path = self.where / "handled"

        def done() -> bool:
            return path.is_file() and path.read_text() == str(count)

        wait_until(done, f"{count} stop signals handled", alive, HOLD_SECONDS)
