"""`StepSink`: what happens to a decided step after the engine, for `grpod run`
(daemon/loop.py) and the TRL trainer (grpod/integrations/trl_sink.py) alike.

    sink = StepSink(recorder, metrics=metrics, rank_metrics=rank_metrics, status=view)
    result = sink.publish(decide_step(engine, policy, batch), policy.gradnorm_vtc_correlation)

In order: this rank's gauges (`RankMetrics`, before the gather, so a scrape never sees a rank
a step behind rank 0's `grpod_step`), every rank's batch and report gathered to rank 0 and
recorded by its flight recorder (a re-run when the store already held the step), rank 0's
step metrics and recorder gauges, the run's own line about the step (`announce`: the
daemon's `step` log event), the status view (at most once a second), and the health beat.

`hold_seconds` (the daemon's `publish_hold_seconds`): a healthy step's metrics and line may
wait that long, to go out with the steps after it in one burst. On two CPU cores a W1 step's
torch kernels leave the caches cold for the Python that follows: the same `step` line costs
~0.3 ms right after a step and ~0.05 ms in a burst. The status view is rewritten with a
burst, when a second has passed since the last (a file replaced: ~1.3 ms in a W1 step on
this host's ext4, most of it system calls, ~0.3 ms a step on the trainer before it moved).
What never waits: the recording, this rank's gauges, the health beat, and any step with a
finding, an outcome other than APPLIED, a re-run or a dropped rollout (it goes out at once,
after the held ones, with the status view when it is due).
Steps slower than the hold go out one by one, as without it. For faster steps a thread
(`grpod-publish`) sends each burst once the hold is over, beside the trainer (on two CPU cores,
in the time torch's second thread would spin); any other line the run logs sends it first
(`line_turn`, around each line of the daemon's logger), so the log keeps the steps' order. A
held line carries the time and the context (run id, step, rank) of its step, not of its burst.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import os
import threading
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, Protocol

from grpod.daemon import distributed
from grpod.daemon.health import Health
from grpod.daemon.metrics import Metrics, RankMetrics
from grpod.daemon.status_view import StatusView
from grpod.engine.verdict import Outcome

if TYPE_CHECKING:  # engine.step imports the Engine (torch): a type here, not an import
    from prometheus_client import CollectorRegistry

    from grpod.engine.grpo.step import StepResult


class Recorder(Protocol):
    """What the sink asks of a flight recorder (forensics' `FlightRecorder`, `NoRecorder`)."""

    queue_depth: int
    blocked_total: int
    incidents_total: int
    uncommitted_steps: int
    incident_steps_total: int
    open_incidents: int

    def record(self, result: Any, *, rerun: bool = False) -> Any: ...

    def note_checkpoint(self, step: int, path: Any) -> None: ...

    def drain(self) -> None: ...

    def close(self) -> None: ...


class NoRecorder:
    """A rank other than 0 under torchrun: rank 0 records its steps (daemon/distributed.py)."""

    queue_depth = blocked_total = incidents_total = uncommitted_steps = 0
    incident_steps_total = open_incidents = 0

    def note_eval(self, result: dict[str, Any]) -> None:
        pass

    def start_run(self, *args: Any, **kwargs: Any) -> None:
        pass

    def record(self, *args: Any, **kwargs: Any) -> None:
        pass

    def note_checkpoint(self, step: int, path: Any) -> None:
        pass

    def drain(self) -> None:
        pass

    def close(self) -> None:
        pass


MAX_HELD = 256  # held steps beyond which a publish sends the burst itself (memory)


@dataclasses.dataclass
class _Held:
    """A published step whose metrics and line wait for their burst."""

    result: StepResult
    correlation: float | None
    rerun: bool
    at: float  # time.time() of its publish: its metrics' and line's timestamp
    context: contextvars.Context  # the step's log context (run id, step, rank)


class StepSink:
    """Publishes decided steps: `publish(result, correlation)` on every rank, each step.

    `recorder`: rank 0's flight recorder (`NoRecorder` elsewhere); `metrics`: rank 0's step
    metrics (None elsewhere); `rank_metrics`: this rank's own (None: not published);
    `status`: the run's live view (its `run_dir` None off rank 0); `announce(result, rerun,
    at)`: the run's own line about the step (`at`: a held step's publish time.time(), else
    None); `rerun_through`: the highest step the store held at start (steps up to it are
    recorded as re-runs); `hold_seconds`: how long a healthy step's
    metrics and line may wait for a burst (the module doc; 0: none wait)."""

    def __init__(
        self,
        recorder: Recorder,
        *,
        metrics: Metrics | None = None,
        rank_metrics: RankMetrics | None = None,
        status: StatusView | None = None,
        health: Health | None = None,
        announce: Callable[[StepResult, bool, float | None], None] | None = None,
        rerun_through: int = -1,
        hold_seconds: float = 0.0,
    ) -> None:
        self.recorder = recorder
        self.metrics, self.rank_metrics = metrics, rank_metrics
        self.status, self.health = status, health
        self.announce = announce
        self.rerun_through = rerun_through
        self.hold_seconds = hold_seconds
        self._held: list[_Held] = []  # under _waiting, which the publish thread waits on
        self._waiting = threading.Condition()
        self._closed = False
        self._sending_lock = threading.RLock()  # one burst at a time, in order
        self._sending = False  # a burst is being sent (a line it logs must not recurse)
        self._sent_at = time.monotonic()  # the last burst's
        self._timer: threading.Thread | None = None
        self.background_cpu_seconds = 0.0  # the CPU time of the bursts the thread sent
        self._failure: Exception | None = None  # what ended the publish thread
        self._failure_raised = False  # a publish has raised it
        self._distributed = distributed.world_size() > 1  # read once: a launch's, not a step's

    @classmethod
    def publishing(
        cls,
        recorder: Recorder,
        registry: CollectorRegistry,
        versions: dict[str, str],
        rank: int,
        **options: Any,
    ) -> StepSink:
        """A sink that publishes on `registry`: rank 0 the step's metrics (`versions`: the
        software they name), every rank its own; `options`: the rest of the sink's."""
        metrics = Metrics(registry, versions) if rank == 0 else None
        return cls(recorder, metrics=metrics, rank_metrics=RankMetrics(registry, rank), **options)

    def publish(self, result: StepResult, correlation: float | None = None) -> StepResult:
        """Record and publish one decided step; returns it with its `record` phase seconds."""
        if self.rank_metrics is not None:
            self.rank_metrics.observe(result)
        rerun = self.is_rerun(result.step)
        started = time.perf_counter()
        # rank 0: every rank's batch and report (one process: the step itself)
        recorded = distributed.gather_step(result) if self._distributed else result
        if recorded is not None:
            self.recorder.record(recorded, rerun=rerun)
        seconds = time.perf_counter() - started
        result = dataclasses.replace(
            result, phase_seconds={**result.phase_seconds, "record": seconds}
        )
        if self.status is not None:
            self.status.note_step(result)
        if self._failure is not None:  # the publish thread's burst failed: this step fails
            self._failure_raised = True
            raise self._failure
        held = _Held(result, correlation, rerun, time.time(), contextvars.copy_context())
        with self._waiting:  # never waits for a burst being sent
            self._held.append(held)
            count = len(self._held)
        waited = time.monotonic() - self._sent_at
        due = waited >= self.hold_seconds or count >= MAX_HELD or self._closed
        if self._urgent(result, rerun) or due:
            self._flush(held)
        elif count == 1:
            self._arm()
        if self.health is not None:
            self.health.beat()
        return result

    def flush(self) -> None:
        """Send the held steps' metrics and lines now, oldest first (any thread; a call made
        while this sink sends, from a line it logs, returns at once)."""
        self._flush(None)

    @contextlib.contextmanager
    def line_turn(self) -> Iterator[None]:
        """Around a line the run logs, from any thread (the daemon's logger): the held steps'
        lines go out first, and no burst goes out until that line is written (a burst
        redraws the progress bar). A burst's own lines pass: the lock is reentrant."""
        with self._sending_lock:
            self._flush(None)
            yield

    def _flush(self, current: _Held | None) -> None:
        """`flush`; `current`: the step being published, whose line is stamped as written."""
        with self._sending_lock:
            if self._sending:
                return
            with self._waiting:
                held, self._held = self._held, []
            if not held:
                return
            self._sending = True
            try:
                for step in held:
                    step.context.run(self._send, step, None if step is current else step.at)
                self.observe_recorder()
                if self.status is not None and self.status.due():
                    self.status.write("running")
                self._sent_at = time.monotonic()
            finally:
                self._sending = False

    def close(self) -> None:
        """Send what is held and stop the timer thread. A burst that failed on the publish
        thread after the last publish raises here: its steps' lines and metrics are lost."""
        try:
            self.flush()
        finally:
            with self._waiting:
                self._closed = True
                self._waiting.notify_all()
            if self._timer is not None:
                self._timer.join()
        if self._failure is not None and not self._failure_raised:
            self._failure_raised = True
            raise self._failure

    def _send(self, step: _Held, at: float | None) -> None:
        if self.metrics is not None:
            self.metrics.observe_step(step.result, step.correlation, now=step.at)
        if self.announce is not None:
            self.announce(step.result, step.rerun, at)

    @staticmethod
    def _urgent(result: StepResult, rerun: bool) -> bool:
        """A step that never waits for a burst."""
        ahead = result.ahead
        return bool(
            result.verdict.findings
            or result.outcome is not Outcome.APPLIED
            or rerun
            or (ahead is not None and ahead.dropped)
        )

    def _arm(self) -> None:
        """The first held step of a burst: the timer sends it by the end of the hold."""
        with self._waiting:
            if self._timer is None and not self._closed:
                self._timer = threading.Thread(
                    target=contextvars.copy_context().run,
                    args=(self._wait_and_send,),
                    name="grpod-publish",
                    daemon=True,
                )
                self._timer.start()
            self._waiting.notify_all()

    def _wait_and_send(self) -> None:
        while True:
            with self._waiting:
                while not self._closed:
                    due = self._sent_at + self.hold_seconds - time.monotonic()
                    if self._held and due <= 0:
                        break
                    self._waiting.wait(due if self._held else None)
                if self._closed:
                    return
            cpu = time.thread_time()
            try:
                self.flush()
            except Exception as exc:  # the trainer's next publish raises it (a failed step)
                self._failure = exc
                return
            self.background_cpu_seconds += time.thread_time() - cpu

    def is_rerun(self, step: int) -> bool:
        """The store held `step` before this start: it is recorded again as a re-run."""
        return step <= self.rerun_through

    def observe_recorder(self, queue_depth: int | None = None) -> None:
        """Rank 0: the flight recorder's gauges and running totals (`queue_depth`: default
        the recorder's own)."""
        if self.metrics is None:
            return
        recorder = self.recorder
        self.metrics.observe_recorder(
            recorder.queue_depth if queue_depth is None else queue_depth,
            recorder.blocked_total,
            recorder.incidents_total,
            recorder.uncommitted_steps,
            incident_steps_total=recorder.incident_steps_total,
            incidents_open=recorder.open_incidents,
        )

    def note_checkpoint(self, step: int, path: str | os.PathLike, *, durable: bool = False) -> None:
        """A checkpoint holding the state before `step`: its row queued after the steps
        before it (`durable`: committed before this returns); the status view's too."""
        self.flush()  # the steps before it are published first
        self.recorder.note_checkpoint(step, path)
        if durable:
            self.recorder.drain()
        if self.status is not None:
            self.status.checkpoint_step = step
