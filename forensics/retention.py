"""`fsck` (every referenced blob exists and verifies) and `gc` (prune within a size budget).

Retention: batches are kept from the oldest retained unpinned checkpoint on, and for ever
for the steps an incident pins ([its checkpoint's step, its step]); the rest may go. When
blobs plus checkpoints exceed the budget, the oldest unpinned checkpoints (never the
newest) are dropped too, which moves the retention start forward. Rows are deleted and
committed before their files, so a row never names a missing file.
"""

from __future__ import annotations

import os
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from sqlalchemy import delete, select

from grpod.forensics.blobs import TEMP_PREFIX, BlobStore
from grpod.forensics.errors import ForensicsError
from grpod.forensics.models import Blob, Checkpoint, Incident, Step
from grpod.forensics.store import Store


@dataclass
class FsckReport:
    blobs_checked: int = 0
    problems: list[str] = field(default_factory=list)  # each one line; empty = healthy
    notes: list[str] = field(default_factory=list)  # harmless leftovers gc will remove

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "ok": self.ok}


@dataclass
class GcReport:
    budget_bytes: int
    kept_bytes: int = 0
    freed_bytes: int = 0
    blobs_deleted: int = 0
    checkpoints_deleted: list[int] = field(default_factory=list)  # their steps
    leftovers_deleted: int = 0  # temp files of interrupted writes, files without a row
    dry_run: bool = False

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "within_budget": self.kept_bytes <= self.budget_bytes}


def fsck(run_dir: str | os.PathLike, store_url: str = "") -> FsckReport:
    """Check every blob (its file or inline bytes: there, size, digest) and every incident's
    pins."""
    store = Store(run_dir, store_url, create=False)
    blobs = BlobStore(store.run_dir)
    report = FsckReport()
    try:
        store.check_schema()
        with store.session() as session:
            rows = {b.sha256: b for b in session.scalars(select(Blob).order_by(Blob.sha256))}
            for digest, row in rows.items():
                report.blobs_checked += 1
                if not row.path:  # inline: the row holds the bytes
                    data = row.data
                    if data is None:
                        report.problems.append(f"blob {digest}: neither a file nor inline bytes")
                    elif len(data) != row.size:
                        report.problems.append(
                            f"blob {digest}: its row holds {len(data)} bytes, says {row.size}"
                        )
                    else:
                        try:
                            blobs.verify(digest, data)
                        except ForensicsError as exc:
                            report.problems.append(str(exc))
                    continue
                path = store.run_dir / row.path
                if not path.is_file():
                    report.problems.append(f"blob {digest}: missing file {path}")
                    continue
                if path.stat().st_size != row.size:
                    report.problems.append(
                        f"blob {digest}: file {path} has {path.stat().st_size} bytes, "
                        f"row says {row.size}"
                    )
                    continue
                try:
                    blobs.verify(digest)
                except ForensicsError as exc:
                    report.problems.append(str(exc))
            for incident, pinned in _pins(store, session):
                for step in pinned:
                    if step.batch_digest not in rows:
                        report.problems.append(
                            f"incident {incident.id}: batch of step {step.step} is missing"
                        )
                if incident.checkpoint_id is not None:
                    checkpoint = session.get(Checkpoint, incident.checkpoint_id)
                    if not store.checkpoint_path(checkpoint).is_dir():
                        report.problems.append(
                            f"incident {incident.id}: checkpoint step {checkpoint.step} missing "
                            f"at {store.checkpoint_path(checkpoint)}"
                        )
            leftovers = _leftovers(blobs, set(rows), grace_seconds=0)
    finally:
        store.close()
    if leftovers:
        report.notes.append(
            f"{len(leftovers)} unreferenced blob files (interrupted writes); "
            "`grpod gc` removes them"
        )
    return report


def gc(
    run_dir: str | os.PathLike,
    budget_bytes: int,
    *,
    store_url: str = "",
    dry_run: bool = False,
    grace_seconds: float = 3600.0,
) -> GcReport:
    """Prune batches outside retention, then old checkpoints while over `budget_bytes`."""
    store = Store(run_dir, store_url, create=False)
    blobs = BlobStore(store.run_dir)
    report = GcReport(budget_bytes=budget_bytes, dry_run=dry_run)
    try:
        store.check_schema()
        with store.session() as session:
            runs = store.run_ids(session)
            retained = [c for c in store.checkpoints(session) if store.checkpoint_path(c).is_dir()]
            pinned_steps: set[int] = set()
            for incident, steps in _pins(store, session):
                pinned_steps |= {s.id for s in steps} | {incident.step_id}
            steps = session.execute(  # (id, step, digest) only: reports can be large
                select(Step.id, Step.step, Step.batch_digest).where(Step.run_id.in_(runs))
            ).all()
            other_runs = set(
                session.scalars(select(Step.batch_digest).where(Step.run_id.not_in(runs)))
            )
            sizes = dict(session.execute(select(Blob.sha256, Blob.size)).all())
            ckpt_bytes = {c.id: _dir_bytes(store.checkpoint_path(c)) for c in retained}

            def keep(start: int) -> set[str | None]:
                return other_runs | {
                    s.batch_digest for s in steps if s.step >= start or s.id in pinned_steps
                }

            def total(start: int, checkpoints: list[Checkpoint]) -> int:
                blob_bytes = sum(sizes.get(d, 0) for d in keep(start) if d is not None)
                return blob_bytes + sum(ckpt_bytes[c.id] for c in checkpoints)

            start = _retention_start(retained)
            dropped: list[Checkpoint] = []
            while total(start, retained) > budget_bytes:
                unpinned = [c for c in retained[:-1] if not c.pinned]  # the newest always stays
                if not unpinned:
                    break
                dropped.append(unpinned[0])
                retained.remove(unpinned[0])
                start = _retention_start(retained)
            doomed = sorted(set(sizes) - keep(start))
            report.kept_bytes = total(start, retained)
            report.blobs_deleted = len(doomed)
            report.freed_bytes = sum(sizes[d] for d in doomed) + sum(
                ckpt_bytes[c.id] for c in dropped
            )
            report.checkpoints_deleted = [c.step for c in dropped]
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
            for path in _leftovers(blobs, known, grace_seconds):
                path.unlink(missing_ok=True)
                report.leftovers_deleted += 1
    finally:
        store.close()
    return report


def _retention_start(retained: list[Checkpoint]) -> int:
    """The step from which every batch is kept: the oldest retained unpinned checkpoint."""
    unpinned = [c.step for c in retained if not c.pinned]
    if unpinned:
        return min(unpinned)
    return min((c.step for c in retained), default=0)


def _pins(store: Store, session: Any) -> list[tuple[Incident, list[Step]]]:
    """Each incident with the step rows it pins (from its checkpoint's step to its step)."""
    out = []
    for incident in store.incidents(session):
        first = incident.step
        if incident.checkpoint_id is not None:
            first = session.get(Checkpoint, incident.checkpoint_id).step
        out.append(
            (incident, store.decided_steps(session, first, session.get(Step, incident.step_id)))
        )
    return out


def _leftovers(blobs: BlobStore, known: set[str], grace_seconds: float) -> list[Path]:
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


def _dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
