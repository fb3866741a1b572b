"""The daemon's checkpoints: what one holds (`states`), taking one (collective under torchrun,
every rank its shards; rank 0 links unchanged files, notes it in the store and applies
retention) and restoring the newest complete one the store noted at start."""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from grpod.daemon import distributed
from grpod.daemon.errors import ConfigError
from grpod.daemon.notify import Notifier
from grpod.daemon.retention import Retention
from grpod.daemon.rundir import RunDir
from grpod.daemon.sink import StepSink
from grpod.engine import Engine
from grpod.engine.state import distcp
from grpod.forensics.resume import choose_checkpoint
from grpod.guards import GuardPolicy

if TYPE_CHECKING:  # an annotation only: torch.distributed.checkpoint takes ~0.5 s to import
    from torch.distributed.checkpoint.stateful import Stateful


class Checkpoints:
    """Checkpoints of one run: `save(reason)`, `restore()`; `step`: the last one's (-1: none)."""

    def __init__(
        self,
        engine: Engine,
        policy: GuardPolicy,
        run_dir: RunDir,
        run_id: str,
        sink: StepSink,
        *,
        retention: Retention | None,
        notifier: Notifier,
        log: Any,
        timeout_seconds: float,
    ) -> None:
        self.engine, self.policy = engine, policy
        self.run_dir, self.run_id = run_dir, run_id
        self.sink, self.retention = sink, retention  # retention: rank 0's (it owns the run dir)
        self.notifier, self.log = notifier, log
        self.timeout_seconds = timeout_seconds
        self.step = -1

    def states(self) -> dict[str, Stateful]:
        """What a checkpoint holds: the engine (weights, optimizer, schedule, data cursor)
        and the guards' windows and counters."""
        return {"engine": self.engine, "guards": self.policy}

    def save(self, reason: str) -> None:
        """A checkpoint of the state before the engine's next step (none if it has one)."""
        step = self.engine.step
        if step == self.step:
            return
        self.notifier.extend_timeout(self.timeout_seconds)
        self.notifier.status(f"checkpointing step {step}")
        started = time.perf_counter()
        path = distcp.save(  # under torchrun: collective, every rank its shards
            self.run_dir.checkpoint_path(step),
            self.states(),
            self.engine.parallel,
            extra={"run_id": self.run_id},
        )
        linked = 0
        if self.retention is not None:
            linked = self.retention.link_unchanged(path)  # before its row: a complete dir
        self.sink.note_checkpoint(step, path)  # queued after the steps before it
        seconds = time.perf_counter() - started
        self.step = step
        metrics = self.sink.metrics
        if metrics is not None:
            metrics.phase_seconds.labels("checkpoint").observe(seconds)
        self.log.info(
            "checkpoint", reason=reason, path=str(path), seconds=round(seconds, 6), linked=linked
        )
        if self.retention is not None:
            self.retention.apply(self.sink.recorder, metrics, self.log)
        self.notifier.watchdog()
        if self.sink.status is not None:
            self.notifier.status(self.sink.status.line())

    def restore(self) -> tuple[int | None, int]:
        """Restore the latest checkpoint the store noted: (its step, None: fresh; the highest
        step the store recorded, -1: none). Every rank agrees on rank 0's choice."""
        path, last_recorded = distributed.agree(self._to_restore)
        if path is None:
            return None, last_recorded
        extra = distcp.load(path, self.states(), self.engine.parallel)
        if "restored" in extra:
            self.log.info(
                "restored", kept=extra["restored"], saved_world=extra.get("saved_world_size")
            )
        self.step = self.engine.step
        if self.sink.status is not None:
            self.sink.status.checkpoint_step = self.step
        return self.engine.step, last_recorded

    def _to_restore(self) -> tuple[Path | None, int]:
        """(the newest complete checkpoint the store noted, the highest recorded step). A
        newer missing or damaged one is passed over with a warning naming it and why (its
        steps are re-run); when checkpoints exist and none is complete: exit 2."""
        store = self.sink.recorder.store
        last = store.last_recorded_step()
        recorded = -1 if last is None else last
        choice = choose_checkpoint(store.noted_checkpoints())
        chosen = choice.checkpoint
        for checkpoint, why in choice.skipped:
            self.log.warning(
                "checkpoint missing" if why == "missing" else "skipped a damaged checkpoint",
                step=checkpoint.step,
                path=str(checkpoint.path),
                problem=why,
                resume_from=None if chosen is None else chosen.step,
            )
        if chosen is None and choice.damaged:
            checkpoint, why = choice.damaged[0]
            raise ConfigError(
                f"run dir {self.run_dir.path}: no complete checkpoint to resume from "
                f"(checkpoint step {checkpoint.step}: {why})"
            )
        return (None if chosen is None else chosen.path), recorded
