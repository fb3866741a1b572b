"""`EpisodeTracker`: a finding that persists over consecutive steps is one incident.

The flight recorder's writer feeds it every step's verdict, in step order. A finding of one
(guard, kind) at or above the incident action opens an episode, or extends the open one of
that key (its last step, its count of steps, its worst step: highest action, then highest
`evidence["severity"]`); an episode closes once `gap_steps` steps in a row went by without
its finding, or when the run stops. Re-runs of steps already observed (after a resume)
change nothing; the episodes a crash left open continue.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from grpod.forensics.config import action_rank
from grpod.forensics.models import Checkpoint, Incident
from grpod.forensics.store import Store

Key = tuple[str, str]  # (guard, kind)


@dataclass
class Episode:
    """One open (or just closed) episode; ids are set by the writer when rows exist."""

    guard: str
    kind: str
    first_step: int
    last_step: int
    steps: int
    worst_step: int
    worst: tuple[int, float]  # (action rank, severity) of the worst finding so far
    first_finding: dict[str, Any]
    worst_finding: dict[str, Any]
    incident_id: int | None = None
    closed: bool = False
    # set per commit group by the writer: the steps rows of this episode's first/worst step
    first_step_id: int | None = None
    worst_step_id: int | None = None
    verdict_json: str = ""  # the first step's verdict

    @classmethod
    def from_row(cls, row: Any) -> Episode:
        """An open episode as its incident row (`models.Incident`) stored it."""
        findings = json.loads(row.findings_json)
        worst = findings[-1]
        return cls(
            guard=row.guard or "",
            kind=row.kind or "",
            first_step=row.step,
            last_step=row.last_step if row.last_step is not None else row.step,
            steps=row.steps_count,
            worst_step=row.worst_step if row.worst_step is not None else row.step,
            worst=(action_rank(worst["action"]), _severity(worst)),
            first_finding=findings[0],
            worst_finding=worst,
            incident_id=row.id,
            first_step_id=row.step_id,
            worst_step_id=row.worst_step_id,
            verdict_json=row.verdict_json,
        )

    @property
    def action(self) -> str:
        return str(self.worst_finding["action"])


@dataclass
class Observation:
    """What one step did to the episodes."""

    opened: list[Episode] = field(default_factory=list)
    worse: list[Episode] = field(default_factory=list)  # extended, with a new worst step
    touched: list[Episode] = field(default_factory=list)  # opened, extended or closed
    affected: bool = False  # the step has a finding of some episode

    @property
    def needs_step_id(self) -> bool:
        return bool(self.opened or self.worse)


class EpisodeTracker:
    """Open episodes by (guard, kind), fed one decided step at a time."""

    def __init__(self, incident_action: str, gap_steps: int) -> None:
        self.rank = action_rank(incident_action)
        self.gap_steps = gap_steps
        self.open: dict[Key, Episode] = {}
        self.last_step = -1  # the last step observed

    def restore(self, episodes: list[Episode], last_step: int) -> None:
        """A resumed run: the store's open episodes, and the last step it recorded."""
        self.open = {(e.guard, e.kind): e for e in episodes}
        self.last_step = last_step

    def close_all(self) -> list[Episode]:
        """Close every open episode (the run stops); returns them."""
        episodes = list(self.open.values())
        for episode in episodes:
            episode.closed = True
        self.open = {}
        return episodes

    def observe(self, step: int, findings: list[dict[str, Any]]) -> Observation:
        seen = Observation()
        if step <= self.last_step:
            return seen  # a re-run of a recorded step: its episodes already counted it
        self.last_step = step
        worst: dict[Key, tuple[tuple[int, float], dict[str, Any]]] = {}
        for finding in findings:
            rank = action_rank(finding["action"])
            if rank < self.rank:
                continue
            key = (str(finding["guard"]), str(finding.get("kind", "")))
            order = (rank, _severity(finding))
            if key not in worst or order > worst[key][0]:
                worst[key] = (order, finding)
        for key, (order, finding) in worst.items():
            episode = self.open.get(key)
            if episode is None:
                episode = Episode(*key, step, step, 1, step, order, finding, finding)
                self.open[key] = episode
                seen.opened.append(episode)
            else:
                episode.last_step, episode.steps = step, episode.steps + 1
                if order > episode.worst:
                    episode.worst, episode.worst_step, episode.worst_finding = order, step, finding
                    seen.worse.append(episode)
            seen.touched.append(episode)
        for key, episode in list(self.open.items()):
            if key not in worst and step - episode.last_step > self.gap_steps:
                episode.closed = True
                del self.open[key]
                seen.touched.append(episode)
        seen.affected = bool(worst)
        return seen


def write_episode(session: Any, store: Store, run_id: str, episode: Episode) -> None:
    """Insert or update an episode's incident row (the writer, in its commit's session); pin
    the checkpoints before its first and its worst step (replay of either needs it)."""
    findings = [episode.first_finding]
    if episode.worst_finding is not episode.first_finding:
        findings.append(episode.worst_finding)
    row = session.get(Incident, episode.incident_id) if episode.incident_id else None
    values = dict(
        action=episode.action,
        findings_json=json.dumps(findings, sort_keys=True),
        last_step=episode.last_step,
        steps_count=episode.steps,
        worst_step=episode.worst_step,
        worst_step_id=episode.worst_step_id,
        status="closed" if episode.closed else "open",
        closed_at=_now() if episode.closed else None,
    )
    if row is None or row.worst_step != episode.worst_step:
        worst = _pin(session, store, episode.worst_step)
        values["worst_checkpoint_id"] = None if worst is None else worst.id
        old = None if row is None else row.worst_checkpoint_id
        if old is not None and old != values["worst_checkpoint_id"]:
            # a new worst step: the previous one's checkpoint is free unless another pins it
            store.unpin_unless_referenced(session, old, row.id)
    if row is None:
        first = _pin(session, store, episode.first_step)
        row = Incident(
            run_id=run_id,
            step=episode.first_step,
            step_id=episode.first_step_id,
            verdict_json=episode.verdict_json,
            checkpoint_id=None if first is None else first.id,
            created_at=_now(),
            guard=episode.guard,
            kind=episode.kind,
            **values,
        )
        session.add(row)
        session.flush()  # the id, for the next group's update
        episode.incident_id = row.id
    else:
        for name, value in values.items():
            setattr(row, name, value)


def _pin(session: Any, store: Store, step: int) -> Checkpoint | None:
    checkpoint = store.checkpoint_at_or_before(session, step)
    if checkpoint is not None:
        checkpoint.pinned = True
    return checkpoint


def _now() -> datetime:
    return datetime.now(timezone.utc)


def _severity(finding: dict[str, Any]) -> float:
    try:
        return float(finding.get("evidence", {}).get("severity", 0.0))
    except (TypeError, ValueError):  # "nan"/"inf" strings of non-finite evidence
        return 0.0
