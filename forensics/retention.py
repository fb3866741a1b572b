"""Retention on an open store: keep the newest checkpoints and what they need, within a budget.

`prune(store, budget)` is both `grpod gc` and the daemon's own retention after every
checkpoint. Kept: the newest `keep_checkpoints` checkpoints (0 = all) and every checkpoint an
incident pins; the batches from the oldest of the newest `keep_checkpoints` kept checkpoints on
(pinned or not: a pinned one replays the steps after it like any other, so a run's recent steps
stay replayable when an incident pinned its only earlier checkpoint), and for ever those an
incident pins ([its checkpoint's step, its first step], and the same before its worst step).
While blobs, checkpoints and the store's own file exceed the budget, that window of checkpoints
shrinks (never below the newest) and the unpinned checkpoints before it go, which moves the
retention start forward. Rows are
deleted and committed before their files, so a row never names a missing file. Checkpoint
files that share an inode (see `link_unchanged`) count once.
"""

from __future__ import annotations

import os
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from sqlalchemy import delete, select

from grpod.base.fileio import atomic_file, file_sha256
from grpod.forensics.blobs import TEMP_PREFIX, BlobStore
from grpod.forensics.models import Blob, Checkpoint, Incident, Step
from grpod.forensics.store import Store


@dataclass
class GcReport:
    budget_bytes: int
    kept_bytes: int = 0
    freed_bytes: int = 0
    blobs_deleted: int = 0
    checkpoints_deleted: list[int] = field(default_factory=list)  # their steps
    leftovers_deleted: int = 0  # temp files of interrupted writes, files without a row
    dry_run: bool = False
    before_bytes: int = 0  # before this pass (the daemon's peak: right after a checkpoint)
    newest_checkpoint: int | None = None  # its step: retention never deletes it
    pinned_checkpoints: list[int] = field(default_factory=list)  # kept for incidents, steps
    incidents: int = 0  # incidents pinning checkpoints and batches

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "within_budget": self.kept_bytes <= self.budget_bytes}


def prune(
    store: Store,
    budget_bytes: int,
    *,
    keep_checkpoints: int = 0,
    dry_run: bool = False,
    grace_seconds: float = 3600.0,
    headroom: bool = False,
) -> GcReport:
    """Delete what retention does not keep (see the module docstring). `headroom`: prune to
    leave room for one more checkpoint interval (a daemon prunes after each checkpoint and
    must stay within the budget until the next one)."""
    blobs = BlobStore(store.run_dir)
    report = GcReport(budget_bytes=budget_bytes, dry_run=dry_run)
    if not dry_run:
        store.truncate_wal()  # the WAL is disk too, up to ~4 MB between SQLite's checkpoints
    with store.session() as session:
        runs = store.run_ids(session)
        retained = [c for c in store.checkpoints(session) if store.checkpoint_path(c).is_dir()]
        pinned_steps: set[int] = set()
        incident_pins = pins(store, session)
        report.incidents = len(incident_pins)
        for incident, steps in incident_pins:
            pinned_steps |= {s.id for s in steps} | {incident.step_id}
            if incident.worst_step_id is not None:
                pinned_steps.add(incident.worst_step_id)
        steps = session.execute(  # (id, step, digest) only: reports can be large
            select(Step.id, Step.step, Step.batch_digest).where(Step.run_id.in_(runs))
        ).all()
        other_runs = set(session.scalars(select(Step.batch_digest).where(Step.run_id.not_in(runs))))
        rows = session.execute(select(Blob.sha256, Blob.size, Blob.path)).all()
        sizes = {digest: size for digest, size, _ in rows}
        inline = sum(size for _, size, path in rows if not path)
        files = {c.id: inode_sizes(store.checkpoint_path(c)) for c in retained}
        fixed = max(0, store.file_bytes() - inline)  # the store's rows, free pages and WAL

        def keep(start: int) -> set[str | None]:
            return other_runs | {
                s.batch_digest for s in steps if s.step >= start or s.id in pinned_steps
            }

        def total(start: int, checkpoints: list[Checkpoint]) -> int:
            blob_bytes = sum(sizes.get(d, 0) for d in keep(start) if d is not None)
            held: dict[tuple[int, int], int] = {}
            for c in checkpoints:
                held.update(files[c.id])
            return fixed + blob_bytes + sum(held.values())

        target = budget_bytes - (_interval_bytes(retained, steps, sizes, files) if headroom else 0)
        dropped: list[Checkpoint] = []

        def drop_oldest_unpinned() -> bool:
            unpinned = [c for c in retained[:-1] if not c.pinned]  # the newest always stays
            if not unpinned:
                return False
            dropped.append(unpinned[0])
            retained.remove(unpinned[0])
            return True

        while keep_checkpoints and sum(not c.pinned for c in retained) > keep_checkpoints:
            if not drop_oldest_unpinned():
                break
        window = keep_checkpoints or len(retained)  # the checkpoints whose steps replay

        def start_of() -> int:
            return min(retention_start(retained), window_start(retained, window))

        while total(start_of(), retained) > target and window > 1:
            window -= 1
            edge = window_start(retained, window)
            old = [c for c in retained[:-1] if not c.pinned and c.step < edge]
            for checkpoint in old:
                dropped.append(checkpoint)
                retained.remove(checkpoint)
        start = start_of()
        doomed = sorted(set(sizes) - keep(start))
        report.kept_bytes = total(start, retained)
        report.blobs_deleted = len(doomed)
        held = {k: v for c in retained + dropped for k, v in files[c.id].items()}
        before = fixed + sum(sizes.values()) + sum(held.values())
        report.before_bytes = before
        report.freed_bytes = max(0, before - report.kept_bytes)
        report.checkpoints_deleted = sorted(c.step for c in dropped)
        report.newest_checkpoint = retained[-1].step if retained else None
        report.pinned_checkpoints = [c.step for c in retained if c.pinned]
        if not dry_run:
            for checkpoint in dropped:
                checkpoint.deleted = True
            if doomed:
                session.execute(delete(Blob).where(Blob.sha256.in_(doomed)))
    if not dry_run:  # rows are committed: now the files may go
        for digest in doomed:
            blobs.path(digest).unlink(missing_ok=True)
        for checkpoint in dropped:
            shutil.rmtree(store.checkpoint_path(checkpoint), ignore_errors=True)
        with store.session() as session:
            known = set(session.scalars(select(Blob.sha256)))
        for path in leftovers(blobs, known, grace_seconds):
            path.unlink(missing_ok=True)
            report.leftovers_deleted += 1
    return report


def _interval_bytes(
    retained: list[Checkpoint],
    steps: list[Any],
    sizes: dict[str, int],
    files: dict[int, dict[tuple[int, int], int]],
) -> int:
    """What the next checkpoint interval will add, judged by the last one: the newest
    checkpoint's own bytes and the batches recorded since the one before it."""
    if not retained:
        return 0
    newest = retained[-1]
    since = retained[-2].step if len(retained) > 1 else 0
    batches = {s.batch_digest for s in steps if since <= s.step < newest.step}
    return sum(files[newest.id].values()) + sum(sizes.get(d, 0) for d in batches if d)


def retention_start(retained: list[Checkpoint]) -> int:
    """The step from which every batch is kept: the oldest retained unpinned checkpoint."""
    unpinned = [c.step for c in retained if not c.pinned]
    if unpinned:
        return min(unpinned)
    return min((c.step for c in retained), default=0)


def window_start(retained: list[Checkpoint], window: int) -> int:
    """The oldest step of the newest `window` retained checkpoints, pinned or not."""
    newest = retained[-window:] if window else retained
    return min((c.step for c in newest), default=0)


def pins(store: Store, session: Any) -> list[tuple[Incident, list[Step]]]:
    """Each incident with the step rows it pins: from its checkpoint's step to its first step,
    and from its worst step's checkpoint to its worst step (an episode's, schema 0003)."""
    out = []
    for incident in store.incidents(session):
        ends = [(incident.checkpoint_id, incident.step, incident.step_id)]
        if incident.worst_step_id is not None and incident.worst_step_id != incident.step_id:
            ends.append((incident.worst_checkpoint_id, incident.worst_step, incident.worst_step_id))
        steps: list[Step] = []
        for checkpoint_id, step, step_id in ends:
            first = step if checkpoint_id is None else session.get(Checkpoint, checkpoint_id).step
            steps += store.decided_steps(session, first, session.get(Step, step_id))
        out.append((incident, steps))
    return out


def leftovers(blobs: BlobStore, known: set[str], grace_seconds: float) -> list[Path]:
    """Temp files and files without a row, older than `grace_seconds` (a live writer's are
    newer: its file is renamed into place just before its row commits)."""
    if not blobs.root.is_dir():
        return []
    cutoff = time.time() - grace_seconds
    return [
        path
        for path in sorted(blobs.root.iterdir())
        if (path.name.startswith(TEMP_PREFIX) or path.name not in known)
        and path.stat().st_mtime <= cutoff
    ]


def inode_sizes(path: Path) -> dict[tuple[int, int], int]:
    """{(device, inode): bytes} of the files under `path` (a hard link counts once)."""
    out = {}
    for file in path.rglob("*"):
        if file.is_file():
            st = file.stat()
            out[(st.st_dev, st.st_ino)] = st.st_size
    return out


def link_unchanged(new: Path, previous: Path) -> int:
    """Replace each file of checkpoint `new` that is byte-identical to the same file of
    checkpoint `previous` by a hard link to it (unchanged weights are not stored twice);
    returns the bytes saved. Each replacement is one rename: a crash leaves either file."""
    saved = 0
    for file in sorted(new.iterdir()):
        old = previous / file.name
        if not file.is_file() or not old.is_file():
            continue
        if os.path.samefile(file, old) or file.stat().st_size != old.stat().st_size:
            continue
        if file_sha256(file) != file_sha256(old):
            continue
        with atomic_file(file, durable=False) as tmp:  # the link built beside, renamed over
            tmp.unlink(missing_ok=True)
            os.link(old, tmp)
        saved += file.stat().st_size
    return saved
