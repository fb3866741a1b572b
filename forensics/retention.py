"""`fsck` (every referenced blob exists and verifies) and `gc` (prune within a size budget).

What retention keeps and how it prunes is forensics/prune.py (the daemon runs it after every
checkpoint; `gc` runs it on demand).
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from typing import Any

from sqlalchemy import select

from grpod.forensics.blobs import BlobStore
from grpod.forensics.errors import ForensicsError
from grpod.forensics.models import Blob, Checkpoint, Step
from grpod.forensics.prune import GcReport, leftovers, pins, prune, retention_start
from grpod.forensics.store import Store

__all__ = ["FsckReport", "GcReport", "fsck", "gc"]


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


def fsck(run_dir: str | os.PathLike, store_url: str = "") -> FsckReport:
    """Check every blob (its file or inline bytes: there, size, digest) and every incident's
    pins."""
    store = Store(run_dir, store_url, create=False)
    blobs = BlobStore(store.run_dir)
    report = FsckReport()
    try:
        report.problems += store.integrity_problems()  # the database's own pages first
        if report.problems:
            return report  # rows read from a malformed file prove nothing
        store.check_schema()
        with store.session() as session:
            report.problems += _unbacked_steps(store, session)
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
            for incident, pinned in pins(store, session):
                for step in pinned:
                    # a live writer may have committed this blob after `rows` was read
                    if step.batch_digest not in rows and not session.get(Blob, step.batch_digest):
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
            unreferenced = leftovers(blobs, set(rows), grace_seconds=0)
    finally:
        store.close()
    if unreferenced:
        report.notes.append(
            f"{len(unreferenced)} unreferenced blob files (interrupted writes); "
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
    keep_checkpoints: int = 0,
) -> GcReport:
    """Prune batches outside retention, then old checkpoints while over `budget_bytes`
    (forensics/prune.py, which the daemon also runs after every checkpoint)."""
    store = Store(run_dir, store_url, create=False)
    try:
        store.check_schema()
        return prune(
            store,
            budget_bytes,
            keep_checkpoints=keep_checkpoints,
            dry_run=dry_run,
            grace_seconds=grace_seconds,
        )
    finally:
        store.close()


def _unbacked_steps(store: Store, session: Any) -> list[str]:
    """Steps from the retention start on whose batch has no blob row (gc never deletes those)."""
    start = retention_start(store.checkpoints(session))
    orphans = session.scalars(
        select(Step.step)
        .where(
            Step.run_id.in_(store.run_ids(session)),
            Step.step >= start,
            Step.batch_digest.not_in(select(Blob.sha256)),
        )
        .order_by(Step.step)
    ).all()
    if not orphans:
        return []
    return [f"{len(orphans)} steps from step {start} on name a missing batch (first: {orphans[0]})"]
