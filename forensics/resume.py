"""Which checkpoint `grpod run` resumes from, and which it passes over (fsck says the same).

The newest checkpoint the store noted that is complete (engine/state/distcp.py `problems`: every
file there and whole, headers valid, state.json parsed, DCP metadata matching its shards).
A newer one that is missing or damaged is passed over with its reason; resume then re-runs
the steps after the one chosen (recorded as re-runs), so nothing is trained on a damaged part.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from grpod.engine.state.distcp import problems
from grpod.forensics.store import NotedCheckpoint


@dataclass(frozen=True)
class ResumeChoice:
    checkpoint: NotedCheckpoint | None  # None: none is complete
    skipped: list[tuple[NotedCheckpoint, str]] = field(default_factory=list)  # newest first

    @property
    def damaged(self) -> list[tuple[NotedCheckpoint, str]]:
        """The passed-over checkpoints that exist but are not complete."""
        return [(c, why) for c, why in self.skipped if why != "missing"]


def choose_checkpoint(noted: list[NotedCheckpoint]) -> ResumeChoice:
    """The newest complete checkpoint of `noted` (oldest first, as the store lists them)."""
    skipped = []
    for checkpoint in reversed(noted):
        found = problems(checkpoint.path)
        if not found:
            return ResumeChoice(checkpoint, skipped)
        skipped.append((checkpoint, "; ".join(found)))
    return ResumeChoice(None, skipped)
