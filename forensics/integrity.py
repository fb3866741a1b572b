"""`fsck` (every referenced blob exists and verifies; the rank rows of every step that has
them add up; every kept checkpoint is complete, and which one resume would choose; the prompt
ledger accounts for every prompt exactly once, forensics/ledger.py) and `gc`
(prune within a size budget).

What retention keeps and how it prunes is forensics/retention.py (the daemon runs it after every
checkpoint; `gc` runs it on demand).
"""

from __future__ import annotations

import json
import os
import stat
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm.exc import ObjectDeletedError

from grpod.engine.state.distcp import problems
from grpod.forensics.blobs import BlobStore
from grpod.forensics.errors import ForensicsError
from grpod.forensics.ledger import check_ledger
from grpod.forensics.models import Blob, Checkpoint, Step, StepRank
from grpod.forensics.resume import choose_checkpoint
from grpod.forensics.retention import GcReport, leftovers, pins, prune, retention_start
from grpod.forensics.store import Store

__all__ = ["FsckReport", "GcReport", "fsck", "gc"]


@dataclass
class FsckReport:
    blobs_checked: int = 0
    checkpoints_checked: int = 0
    resume_step: int | None = None  # the checkpoint `grpod run` would resume from
    resume: str = ""  # that, in words ("" without checkpoints)
    problems: list[str] = field(default_factory=list)  # each one line; empty = healthy
    notes: list[str] = field(default_factory=list)  # harmless leftovers gc will remove
    warnings: list[str] = field(default_factory=list)  # e.g. a run dir others can read
    # the prompt ledger: {checked, note, last_step, missing, duplicated, epochs, ...}
    ledger: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "ok": self.ok}


def exposure(run_dir: Path) -> list[str]:
    """A warning for the run dir, and each file at its top, that users other than its owner
    and group can read or write (docs/SECURITY.md: grpod creates them 0750 / 0640)."""
    found = []
    for path in [run_dir, *sorted(run_dir.iterdir())]:
        mode = path.lstat().st_mode
        can = [w for bit, w in ((stat.S_IROTH, "read"), (stat.S_IWOTH, "write")) if mode & bit]
        if can and not stat.S_ISLNK(mode):
            what = "run dir" if path == run_dir else "file"
            found.append(
                f"{what} {path}: mode {stat.S_IMODE(mode):04o}: other users can "
                f"{' and '.join(can)} it (chmod -R o-rwx {run_dir})"
            )
    return found


def fsck(run_dir: str | os.PathLike, store_url: str = "") -> FsckReport:
    """Check every blob (its file or inline bytes: there, size, digest), every distributed
    step's rank rows (forensics/ranks.py) and every incident's pins."""
    store = Store(run_dir, store_url, create=False)
    blobs = BlobStore(store.run_dir)
    report = FsckReport(warnings=exposure(store.run_dir))
    try:
        report.problems += store.integrity_problems()  # the database's own pages first
        if report.problems:
            return report  # rows read from a malformed file prove nothing
        store.check_schema()
        with store.session() as session:
            report.problems += _unbacked_steps(store, session)
            ledger = check_ledger(session, store.run_ids(session))
            report.ledger = ledger.to_dict()
            report.problems += ledger.problems()  # (why nothing was checked: its `note`)
            rows = {b.sha256: b for b in session.scalars(select(Blob).order_by(Blob.sha256))}
            counts: dict[str, tuple[int, int]] = {}  # digest -> (micros, samples), verified
            for digest, row in rows.items():
                report.blobs_checked += 1
                if not row.path:  # inline: the row holds the bytes (a deferred column)
                    try:
                        data = row.data
                    except ObjectDeletedError:  # a live run's retention pruned it meanwhile
                        continue
                    if data is None:
                        report.problems.append(f"blob {digest}: neither a file nor inline bytes")
                    elif len(data) != row.size:
                        report.problems.append(
                            f"blob {digest}: its row holds {len(data)} bytes, says {row.size}"
                        )
                    else:
                        try:
                            counts[digest] = _counts(blobs, digest, data)
                        except ForensicsError as exc:
                            report.problems.append(str(exc))
                    continue
                path = store.run_dir / row.path
                if not path.is_file():
                    if _still_stored(store, digest):  # else pruned by a live run meanwhile
                        report.problems.append(f"blob {digest}: missing file {path}")
                    continue
                if path.stat().st_size != row.size:
                    report.problems.append(
                        f"blob {digest}: file {path} has {path.stat().st_size} bytes, "
                        f"row says {row.size}"
                    )
                    continue
                try:
                    counts[digest] = _counts(blobs, digest)
                except ForensicsError as exc:
                    report.problems.append(str(exc))
            report.problems += _rank_problems(store, session, counts)
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
        _check_checkpoints(store, report)
    finally:
        store.close()
    if unreferenced:
        report.notes.append(
            f"{len(unreferenced)} unreferenced blob files (interrupted writes); "
            "`grpod gc` removes them"
        )
    return report


def _still_stored(store: Store, digest: str) -> bool:
    """Whether blob `digest` still has its row (read anew, past the checking session)."""
    with store.session() as session:
        return session.get(Blob, digest) is not None


def _check_checkpoints(store: Store, report: FsckReport) -> None:
    """Every checkpoint retention kept, as resume reads it (forensics/resume.py), and which
    one `grpod run` would resume from."""
    noted = store.noted_checkpoints()
    report.checkpoints_checked = len(noted)
    choice = choose_checkpoint(noted)
    passed = {c.step for c, _ in choice.skipped}
    for checkpoint in noted:  # older than the chosen one: checked too (replay needs them)
        if checkpoint.step in passed or checkpoint is choice.checkpoint:
            continue
        found = problems(checkpoint.path)
        if found:
            choice.skipped.append((checkpoint, "; ".join(found)))
    # a live run's retention may have pruned one while it was checked: only those still kept
    kept = {c.step for c in store.noted_checkpoints()}
    for checkpoint, why in sorted(choice.skipped, key=lambda item: item[0].step):
        if checkpoint.step in kept:
            report.problems.append(f"checkpoint step {checkpoint.step} ({checkpoint.path}): {why}")
    if choice.checkpoint is not None:
        report.resume_step = choice.checkpoint.step
        newest, step = noted[-1].step, choice.checkpoint.step
        passing = "" if newest == step else f", passing over step {newest}"
        report.resume = f"resume would restore checkpoint step {step}{passing}"
    elif noted:
        report.resume = "no complete checkpoint: resume would refuse (exit 2)"
        report.problems.append(report.resume)


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
    (forensics/retention.py, which the daemon also runs after every checkpoint)."""
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
    """Steps from the retention start on whose batch has no blob row (gc never deletes those).
    Found ones are read again in a session of their own: a live run's retention may have
    committed a new checkpoint's start, and pruned the batches before it, between the
    checkpoints read and the steps (each statement sees the latest commit)."""
    start, orphans = _orphans(store, session)
    if orphans:
        with store.session() as fresh:
            start, orphans = _orphans(store, fresh)
    if not orphans:
        return []
    return [f"{len(orphans)} steps from step {start} on name a missing batch (first: {orphans[0]})"]


def _orphans(store: Store, session: Any) -> tuple[int, list[int]]:
    """The retention start and the steps from it on whose batch has no blob row."""
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
    return start, list(orphans)


def _counts(blobs: BlobStore, digest: str, data: bytes | None = None) -> tuple[int, int]:
    """`(micros, samples)` of a blob that verifies (ForensicsError when it does not)."""
    tensors, _ = blobs.read(digest, data)
    missing = sorted({"input_ids", "rewards"} - set(tensors))
    if missing:
        raise ForensicsError(f"blob {digest}: not a batch (no {', '.join(missing)})")
    return int(tensors["input_ids"].shape[0]), int(tensors["rewards"].shape[0])


def _rank_problems(store: Store, session: Any, counts: dict[str, tuple[int, int]]) -> list[str]:
    """Distributed steps whose rank rows do not add up to the step (see `_rank_mismatches`)."""
    rows = session.scalars(
        select(StepRank)
        .where(StepRank.run_id.in_(store.run_ids(session)))
        .order_by(StepRank.step_id, StepRank.rank)
    ).all()
    by_step: dict[int, list[StepRank]] = {}
    for row in rows:
        by_step.setdefault(row.step_id, []).append(row)
    steps = {
        step.id: step
        for step in session.scalars(select(Step).where(Step.id.in_(list(by_step)))).all()
    }
    problems = []
    for step_id, ranks in by_step.items():
        step = steps[step_id]
        problems += _rank_mismatches(step, ranks, counts.get(step.batch_digest or ""))
    return problems


def _rank_mismatches(
    step: Step, ranks: list[StepRank], counts: tuple[int, int] | None
) -> list[str]:
    """A step's rank rows must be ranks 0..N-1 of its world size, name its blob, sum to its
    global valid tokens, and their micro and sample ranges tile its blob (`counts`, the
    blob's micros and samples; None when it is pruned or damaged: then only in order)."""
    report = json.loads(step.report_json)
    where = f"step {step.step} (record {step.id})"
    out = []
    world = int(report.get("world_size", 1))
    if [r.rank for r in ranks] != list(range(world)):
        out.append(f"{where}: rank rows {[r.rank for r in ranks]}, world size {world}")
    other = sorted({r.batch_digest or "" for r in ranks} - {step.batch_digest or ""})
    if other:
        out.append(f"{where}: rank rows name blob {other[0]}, the step {step.batch_digest}")
    valid, total = sum(r.valid_tokens for r in ranks), report.get("global_valid_tokens")
    if total is None:  # a skipped step gathers no global count: its own (0) stands for it
        total = report.get("valid_tokens")
    if valid != total:
        out.append(f"{where}: rank rows sum to {valid} valid tokens, global_valid_tokens {total}")
    for index, what in enumerate(("micro", "sample")):
        spans = [(getattr(r, f"first_{what}"), getattr(r, f"num_{what}s")) for r in ranks]
        starts = [sum(n for _, n in spans[:i]) for i in range(len(spans))]
        size = None if counts is None else counts[index]
        if [s for s, _ in spans] == starts and size in (None, sum(n for _, n in spans)):
            continue
        ranges = ", ".join(f"[{s}, {s + n})" for s, n in spans)
        of = "its blob" if size is None else f"the blob's {size} {what}s"
        out.append(f"{where}: rank {what} ranges {ranges} do not tile {of}")
    return out
