"""A run's live view: `status.json` in the run directory and its one-line text (systemd's
STATUS=), written by rank 0 only; `grpod status` reads it."""

from __future__ import annotations

import math
import os
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from grpod.daemon.rundir import RunDir
from grpod.engine.verdict import Verdict

if TYPE_CHECKING:  # engine.step imports the Engine (torch): a type here, not an import
    from grpod.engine.grpo.step import StepResult

STATUS_INTERVAL_SECONDS = 1.0  # status.json and STATUS= at most this often while running


class StatusView:
    """What `status.json` says of a run: the last finished step and its verdict, the next
    step, the last checkpoint. `run_dir` None (a rank other than 0): nothing is written.

    `next_step()`: the step the run trains next (None: unknown); `fields`: constant keys the
    view adds (`{"trainer": "trl"}`); `notify(text)`: the one-line status (systemd STATUS=);
    `on_error(exc)`: an OSError while writing (default: raised)."""

    def __init__(
        self,
        run_dir: RunDir | None,
        run_id: str = "",
        *,
        next_step: Callable[[], int | None],
        fields: dict[str, Any] | None = None,
        notify: Callable[[str], None] | None = None,
        on_error: Callable[[OSError], None] | None = None,
    ) -> None:
        self.run_dir, self.run_id = run_dir, run_id
        self.next_step = next_step
        self.fields = dict(fields or {})
        self.notify, self.on_error = notify, on_error
        self.metrics_url: str | None = None
        # the last step this process finished and its verdict: one tuple, replaced whole (the
        # trainer notes a step while the publish thread may be writing the view)
        self.last: tuple[int | None, str] = (None, "none")
        self.checkpoint_step = -1
        self._written = -math.inf
        self._writing = threading.Lock()  # the trainer's writes and the publish thread's

    def note_step(self, result: StepResult) -> None:
        self.last = (result.step, verdict_text(result.verdict))

    @property
    def last_step(self) -> int | None:
        return self.last[0]

    @property
    def last_verdict(self) -> str:
        return self.last[1]

    def line(self) -> str:
        """`step 4 done, last verdict PASS; next 5` (`ready; next step 0` before a step)."""
        (step, verdict), next_step = self.last, self.next_step()
        if step is None:
            return f"ready; next step {next_step or 0}"
        return f"step {step} done, last verdict {verdict}; next {next_step}"

    def due(self) -> bool:
        """While running: at most once per STATUS_INTERVAL_SECONDS."""
        return time.monotonic() - self._written >= STATUS_INTERVAL_SECONDS

    def write(self, state: str, **extra: Any) -> None:
        """The view in `state` (`running`, `stopped`, ...; `extra`: `reason`, `exit_code`).
        Any thread: the trainer's (start, stop) and the step sink's publish thread (while
        running) each replace the file whole, one at a time."""
        if self.run_dir is None:
            return
        with self._writing:
            failed = self._write(state, extra)
        if failed is not None:  # reported outside the lock: a log line may send a burst
            if self.on_error is None:
                raise failed
            self.on_error(failed)

    def _write(self, state: str, extra: dict[str, Any]) -> OSError | None:
        self._written = time.monotonic()
        if self.notify is not None:
            self.notify(
                self.line() if state == "running" else f"{state}: {extra.get('reason', '')}"
            )
        step, verdict = self.last
        status = {
            "run_id": self.run_id,
            "pid": os.getpid(),
            "state": state,
            **self.fields,
            "step": step,
            "next_step": self.next_step(),
            "checkpoint_step": self.checkpoint_step,
            "last_verdict": verdict,
            "metrics": self.metrics_url,
            "updated_at": time.time(),
            **extra,
        }
        try:
            self.run_dir.write_status(status)
        except OSError as exc:
            return exc
        return None


def verdict_text(verdict: Verdict) -> str:
    """`PASS`, or the action with its worst finding: `FLUSH (finite: loss is nan)`."""
    if not verdict.findings:
        return verdict.action.name
    worst = max(verdict.findings, key=lambda f: f.action)
    return f"{verdict.action.name} ({worst.guard}: {worst.message})"
