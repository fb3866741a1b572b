"""Where a guarded TRL run meets the run directory, the flight recorder and the metrics.

The one module of the integration that calls `FlightRecorder`, `StepSink.publishing` (the
metrics) and `RunDir`, so a change of their APIs is followed here alone. Rank 0 owns the
run directory (the same layout as `grpod run`'s: `run.json`, `config.toml`, `status.json`,
`grpod.sqlite`, `blobs/`) and the store; every rank calls `publish` (the step's batches are
gathered to rank 0), which is the daemon's own `StepSink` (daemon/sink.py): a TRL step is
recorded and published exactly as a `grpod run` step.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry

from grpod.base.fileio import private_umask
from grpod.daemon import distributed
from grpod.daemon.config import GrpodConfig
from grpod.daemon.health import Health, HealthServer
from grpod.daemon.metrics import Metrics, RankMetrics
from grpod.daemon.rundir import RunDir, new_run_id
from grpod.daemon.sink import NoRecorder, StepSink
from grpod.daemon.status_view import StatusView
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
        self.status = StatusView(
            self.run_dir if self.rank == 0 else None,
            next_step=self._next_step,
            fields={"trainer": "trl"},
        )
        self.steps = StepSink(NoRecorder(), status=self.status, health=self.health)

    @property
    def run_id(self) -> str:
        return self.status.run_id

    @property
    def checkpoint_step(self) -> int:
        return self.status.checkpoint_step

    @property
    def last_step(self) -> int | None:
        return self.status.last_step

    def _next_step(self) -> int | None:
        return None if self.status.last_step is None else self.status.last_step + 1

    @property
    def metrics_url(self) -> str | None:
        return None if self.server is None else self.server.metrics_url

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
        host, port = self.metrics_address
        if port is not None:  # a port it cannot bind: one line, before the run dir is made
            self.server = HealthServer.bind(
                host, port, self.registry, self.health, setting="grpod.metrics_port"
            )
        try:
            self._open_run(config, tokenizer, trl_config, versions, device)
        except BaseException:
            if self.server is not None:  # the port is the next attempt's again
                self.server.close()
                self.server = None
            raise
        if self.server is not None:
            self.server.start()
        self.status.metrics_url = self.metrics_url
        self.write_status("running")

    def _open_run(
        self,
        config: GrpodConfig,
        tokenizer: Any,
        trl_config: dict[str, Any],
        versions: dict[str, str],
        device: str,
    ) -> None:
        """Rank 0: the run directory created or resumed, its store opened, the run recorded,
        the step sink publishing."""
        if self.run_dir.is_run():
            self.run_dir.lock()
            self.status.run_id = self.run_dir.run_id()
        else:
            self.status.run_id = new_run_id()
            self.run_dir.create(self.run_id, config, trainer="trl")
        if tokenizer is not None and not (self.run_dir.path / TOKENIZER_DIR).is_dir():
            tokenizer.save_pretrained(str(self.run_dir.path / TOKENIZER_DIR))
        self.recorder = FlightRecorder(self.run_dir.path, self.forensics)
        self.recorder.store.lock_run_dir()
        last = self.recorder.store.last_recorded_step()
        self.recorder.start_run(
            self.run_id, {**config.to_json(), "trl": trl_config}, versions, device
        )
        self.steps = StepSink.publishing(
            self.recorder,
            self.registry,
            versions,
            self.rank,
            status=self.status,
            health=self.health,
            rerun_through=-1 if last is None else last,
        )
        self.metrics, self.rank_metrics = self.steps.metrics, self.steps.rank_metrics

    def publish(self, result: StepResult, correlation: float | None) -> None:
        """Every rank: record the step (gathered to rank 0), publish its metrics and status."""
        self.steps.publish(result, correlation)

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
        # the checkpoint's row is durable before TRL goes on
        self.steps.note_checkpoint(step, Path(path), durable=True)

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
        self.status.write(state, **extra)


def is_halt(result: StepResult) -> bool:
    return result.verdict.action >= Action.HALT
