"""The daemon's own retention: after every checkpoint, prune to `[forensics] keep_checkpoints`
and `retention_bytes` (forensics/retention.py), say what went in a metric and a log line, and
store a checkpoint file that did not change since the previous checkpoint as a hard link.

Over budget is judged at the run dir's peak, right after a checkpoint is written and before
its prune: what is left then is what retention may not delete (the newest checkpoint, the
batches since it, incident pins), so that is said once per crossing in a warning naming the
bytes over and what is pinned, and at every checkpoint in `grpod_retention_over_budget_bytes`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from grpod.forensics.config import ForensicsConfig
from grpod.forensics.recorder import FlightRecorder
from grpod.forensics.retention import GcReport, link_unchanged, prune


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
        over_bytes = max(0, report.before_bytes - report.budget_bytes)
        if metrics is not None:
            metrics.observe_retention(report, over_bytes)
        if report.checkpoints_deleted or report.blobs_deleted:
            log.info(
                "pruned",
                checkpoints=report.checkpoints_deleted,
                batches=report.blobs_deleted,
                freed_bytes=report.freed_bytes,
                kept_bytes=report.kept_bytes,
                budget_bytes=report.budget_bytes,
            )
        over = over_bytes > 0
        if over and not self.over_budget:
            log.warning(
                "over retention budget",
                over_budget_bytes=over_bytes,
                peak_bytes=report.before_bytes,
                kept_bytes=report.kept_bytes,
                budget_bytes=report.budget_bytes,
                newest_checkpoint=report.newest_checkpoint,
                pinned_checkpoints=report.pinned_checkpoints,
                incidents=report.incidents,
                reason=_reason(report),
            )
        self.over_budget = over


def _reason(report: GcReport) -> str:
    """What retention could not delete, in words."""
    kept = [f"the newest checkpoint (step {report.newest_checkpoint}) and the batches since it"]
    if report.incidents:
        steps = ", ".join(map(str, report.pinned_checkpoints)) or "none"
        kept.append(
            f"{report.incidents} incidents' pins (checkpoints at steps {steps} and their batches)"
        )
    return "retention may not delete " + " or ".join(kept)
