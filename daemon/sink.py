"""`StepSink`: what happens to a decided step after the engine, for `grpod run`
(daemon/loop.py) and the TRL trainer (grpod/integrations/trl_sink.py) alike.

    sink = StepSink(recorder, metrics=metrics, rank_metrics=rank_metrics, status=view)
    result = sink.publish(decide_step(engine, policy, batch), policy.gradnorm_vtc_correlation)

In order: this rank's gauges (`RankMetrics`, before the gather, so a scrape never sees a rank
a step behind rank 0's `grpod_step`), every rank's batch and report gathered to rank 0 and
recorded by its flight recorder (a re-run when the store already held the step), rank 0's
step metrics and recorder gauges, the run's own line about the step (`announce`: the
daemon's `step` log event), the health beat, and the status view (at most once a second).
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from grpod.daemon import distributed
from grpod.daemon.health import Health
from grpod.daemon.metrics import Metrics, RankMetrics
from grpod.daemon.status_view import StatusView

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


class StepSink:
    """Publishes decided steps: `publish(result, correlation)` on every rank, each step.

    `recorder`: rank 0's flight recorder (`NoRecorder` elsewhere); `metrics`: rank 0's step
    metrics (None elsewhere); `rank_metrics`: this rank's own (None: not published);
    `status`: the run's live view (its `run_dir` None off rank 0); `announce(result, rerun)`:
    the run's own line about the step; `rerun_through`: the highest step the store held at
    start (steps up to it are recorded as re-runs)."""

    def __init__(
        self,
        recorder: Recorder,
        *,
        metrics: Metrics | None = None,
        rank_metrics: RankMetrics | None = None,
        status: StatusView | None = None,
        health: Health | None = None,
        announce: Callable[[StepResult, bool], None] | None = None,
        rerun_through: int = -1,
    ) -> None:
        self.recorder = recorder
        self.metrics, self.rank_metrics = metrics, rank_metrics
        self.status, self.health = status, health
        self.announce = announce
        self.rerun_through = rerun_through

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
        started = time.perf_counter()
        recorded = distributed.gather_step(result)  # rank 0: every rank's batch and report
        if recorded is not None:
            self.recorder.record(recorded, rerun=self.is_rerun(result.step))
        seconds = time.perf_counter() - started
        result = dataclasses.replace(
            result, phase_seconds={**result.phase_seconds, "record": seconds}
        )
        if self.metrics is not None:
            self.metrics.observe_step(result, correlation)
        self.observe_recorder()
        if self.status is not None:
            self.status.note_step(result)
        if self.announce is not None:
            self.announce(result, self.is_rerun(result.step))
        if self.health is not None:
            self.health.beat()
        if self.status is not None and self.status.due():
            self.status.write("running")
        return result

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
        self.recorder.note_checkpoint(step, path)
        if durable:
            self.recorder.drain()
        if self.status is not None:
            self.status.checkpoint_step = step
