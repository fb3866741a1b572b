"""The daemon's own retention: after every checkpoint, prune to `[forensics] keep_checkpoints`
and `retention_bytes` (forensics/prune.py), say what went in a metric and a log line, and
store a checkpoint file that did not change since the previous checkpoint as a hard link."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from grpod.forensics.config import ForensicsConfig
from grpod.forensics.prune import link_unchanged, prune
from grpod.forensics.recorder import FlightRecorder


class Retention:
    """Bounded disk for one run directory while the daemon runs."""

    def __init__(self, config: ForensicsConfig) -> None:
        self.config = config
        self.over_budget = False  # warned once per crossing, not every checkpoint

    def link_unchanged(self, path: Path) -> int:
        """Hard-link the files of checkpoint `path` equal to the previous checkpoint's."""
        siblings = sorted(p for p in path.parent.glob("step-*") if p.is_dir() and p != path)
        older = [p for p in siblings if p.name < path.name]
        return link_unchanged(path, older[-1]) if older else 0

    def apply(self, recorder: FlightRecorder, metrics: Any, log: Any) -> None:
        """Prune after a checkpoint (its row and the steps before it committed first)."""
        if not self.config.keep_checkpoints:
            return
        recorder.drain()  # incidents and their pins are in the store before anything goes
        report = prune(
            recorder.store,
            self.config.retention_bytes,
            keep_checkpoints=self.config.keep_checkpoints,
            headroom=True,
        )
        metrics.observe_retention(report)
        if report.checkpoints_deleted or report.blobs_deleted:
            log.info(
                "pruned",
                checkpoints=report.checkpoints_deleted,
                batches=report.blobs_deleted,
                freed_bytes=report.freed_bytes,
                kept_bytes=report.kept_bytes,
                budget_bytes=report.budget_bytes,
            )
        over = report.kept_bytes > report.budget_bytes
        if over and not self.over_budget:
            log.warning(
                "over retention budget",
                kept_bytes=report.kept_bytes,
                budget_bytes=report.budget_bytes,
                reason="what is left is the newest checkpoint and incident pins",
            )
        self.over_budget = over
