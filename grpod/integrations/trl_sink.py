"""Where a guarded TRL run meets the run directory, the flight recorder and the metrics.

The one module of the integration that calls `FlightRecorder`, `Metrics` and `RunDir`, so a
change of their APIs is followed here alone. Rank 0 owns the run directory (the same layout
as `grpod run`'s: `run.json`, `config.toml`, `status.json`, `grpod.sqlite`, `blobs/`) and
the store; every rank calls `publish` (the step's batches are gathered to rank 0).
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry

from grpod.base.fileio import private_umask
from grpod.daemon import distributed
from grpod.daemon.config import GrpodConfig
from grpod.daemon.health import Health, HealthServer
from grpod.daemon.loop import STATUS_INTERVAL_SECONDS, _verdict_text
from grpod.daemon.metrics import Metrics, RankMetrics
from grpod.daemon.rundir import RunDir, new_run_id
from grpod.engine.grpo.step import StepResult
from grpod.engine.verdict import Action
from grpod.forensics.config import ForensicsConfig
from grpod.forensics.recorder import FlightRecorder
from grpod.guards.config import GuardsConfig

TOKENIZER_DIR = "tokenizer"  # the run's tokenizer, for `grpod incidents show --samples`


class RunSink:
    """The run directory, store and metrics of one guarded TRL run (rank 0's; a no-op on
    other ranks except for the gather every rank joins)."""

    def __init__(
        self,
        run_dir: str | os.PathLike,
        guards: GuardsConfig,
        forensics: ForensicsConfig,
        *,
        log_samples: int,
        metrics_host: str,
        metrics_port: int | None,
    ) -> None:
        self.run_dir = RunDir(run_dir)
        self.guards, self.forensics = guards, forensics
        self.log_samples = log_samples
        self.rank = distributed.rank()
        self.registry = CollectorRegistry()
        self.metrics: Metrics | None = None
        self.rank_metrics: RankMetrics | None = None
        self.recorder: FlightRecorder | None = None
        self.server: HealthServer | None = None
        self.health = Health(3600.0)
        self.metrics_address = (metrics_host, metrics_port)
        self.run_id = ""
        self.last_recorded = -1  # the highest step recorded before this start (re-runs)
        self.checkpoint_step = -1
        self.last_verdict = "none"
        self.last_step: int | None = None
        self._status_written = -math.inf

    @property
    def metrics_url(self) -> str | None:
        if self.server is None:
            return None
        host, port = self.server.address
        return f"http://{host}:{port}/metrics"

    def start(
        self, tokenizer: Any, trl_config: dict[str, Any], versions: dict[str, str], device: str
    ) -> None:
        """Rank 0: create (or resume) the run directory, register the run (`device`: what
        it trains on, as `grpod run` records it), serve metrics. Every rank: this process's
        umask at least 027 (`private_umask`), for TRL's checkpoints in the run directory too."""
        private_umask()
        if self.rank != 0:
            return
        config = GrpodConfig.model_validate(
            {
                "engine": {"model": str(self.run_dir.path.resolve() / TOKENIZER_DIR)},
                "guards": self.guards.model_dump(),
                "forensics": self.forensics.model_dump(),
                "daemon": {"run_dir": str(self.run_dir.path), "log_samples": self.log_samples},
            },
            strict=False,
        )
        if self.run_dir.is_run():
            self.run_dir.lock()
            self.run_id = self.run_dir.run_id()
        else:
            self.run_id = new_run_id()
            self.run_dir.create(self.run_id, config, trainer="trl")
        if tokenizer is not None and not (self.run_dir.path / TOKENIZER_DIR).is_dir():
            tokenizer.save_pretrained(str(self.run_dir.path / TOKENIZER_DIR))
        self.recorder = FlightRecorder(self.run_dir.path, self.forensics)
        self.recorder.store.lock_run_dir()
        last = self.recorder.store.last_recorded_step()
        self.last_recorded = -1 if last is None else last
        self.recorder.start_run(
            self.run_id, {**config.to_json(), "trl": trl_config}, versions, device
        )
        self.metrics = Metrics(self.registry, versions)
        self.rank_metrics = RankMetrics(self.registry, self.rank)
        host, port = self.metrics_address
        if port is not None:
            self.server = HealthServer(host, port, self.registry, self.health)
            self.server.start()
        self.write_status("running")

    def publish(self, result: StepResult, correlation: float | None) -> None:
        """Every rank: record the step (gathered to rank 0), publish its metrics and status."""
        self.last_step = result.step
        if self.rank_metrics is not None:  # this rank's own numbers, before the gather
            self.rank_metrics.observe(result)
        started = time.perf_counter()
        recorded = distributed.gather_step(result)
        if recorded is None or self.recorder is None:
            return
        self.recorder.record(recorded, rerun=result.step <= self.last_recorded)
        seconds = time.perf_counter() - started
        result = replace(result, phase_seconds={**result.phase_seconds, "record": seconds})
        assert self.metrics is not None
        self.metrics.observe_step(result, correlation)
        self.metrics.observe_recorder(
            self.recorder.queue_depth,
            self.recorder.blocked_total,
            self.recorder.incidents_total,
            self.recorder.uncommitted_steps,
            incident_steps_total=self.recorder.incident_steps_total,
            incidents_open=self.recorder.open_incidents,
        )
        self.last_verdict = _verdict_text(result.verdict)
        self.health.beat()
        if time.monotonic() - self._status_written >= STATUS_INTERVAL_SECONDS:
            self.write_status("running")

    def incident_ids(self, step: int) -> dict[str, int]:
        """Rank 0: {guard: incident id} of the incidents that hold `step` (committed first;
        called on a step with findings only). Other ranks: {}."""
        if self.recorder is None:
            return {}
        self.recorder.drain()
        return {
            mark.guard: mark.id
            for mark in self.recorder.store.incident_marks()
            if mark.step <= step <= (mark.step if mark.last_step is None else mark.last_step)
        }

    def note_checkpoint(self, step: int, path: str | os.PathLike) -> None:
        """A TRL checkpoint holding the state before step `step` (its global_step)."""
        self.checkpoint_step = step
        if self.recorder is not None:
            self.recorder.note_checkpoint(step, Path(path))
            self.recorder.drain()  # the checkpoint's row is durable before TRL goes on

    def close(self, state: str, halted: bool, reason: str = "") -> None:
        if self.recorder is None:
            return
        if self.metrics is not None:
            self.metrics.halted.set(int(halted))
        try:
            self.recorder.close()
        finally:
            self.write_status(state, reason=reason)
            if self.server is not None:
                self.server.close()
                self.server = None
            if self.run_dir.held is not None:
                self.run_dir.held.release()
                self.run_dir.held = None

    def write_status(self, state: str, **extra: Any) -> None:
        """status.json (a live view; while running at most once a second, as the daemon's)."""
        self._status_written = time.monotonic()
        status = {
            "run_id": self.run_id,
            "pid": os.getpid(),
            "state": state,
            "trainer": "trl",
            "step": self.last_step,
            "next_step": None if self.last_step is None else self.last_step + 1,
            "checkpoint_step": self.checkpoint_step,
            "last_verdict": self.last_verdict,
            "metrics": self.metrics_url,
            "updated_at": time.time(),
            **extra,
        }
        self.run_dir.write_status(status)


def is_halt(result: StepResult) -> bool:
    return result.verdict.action >= Action.HALT
