"""Deterministic replay of a recorded step.

Restore the checkpoint at or before the step, re-apply the recorded steps in between exactly
as they were decided (applied, flushed, or skipped without compute), run the target step,
and compare with the record: `reproduced` when loss, valid tokens and grad norm are
bit-equal at every step, else `diverged at step k` naming the first differing field.
Nothing in the store or the run directory is written.

Bit-exact is the verdict in the topology the step was recorded in. In another one (a 2-rank
step replayed in one process, or `--rank R` past other steps) the sums run in another order,
so the floats are compared within REPLAY_RTOL (integer counts exactly) and the verdict says
so: `"within 1e-6 (recorded on 2 ranks, replayed in 1 process: reduction order differs)"`.

A distributed step (recorded as its global batch, `TransportBatch.part(rank)` each rank's):
under `torchrun --nproc-per-node N grpod replay` every rank runs its own part and the global
loss, global valid tokens and grad norm are compared; `grpod replay --rank R` (one process)
runs rank R's part of the target divided by the recorded global count and compares that
rank's local valid tokens and local loss, as its `step_ranks` row recorded them (the steps
before it run as one process on the global batch: bit-exact when the checkpoint is the
target's own, else to FP32 rounding).
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import torch
from pydantic import ValidationError

from grpod.base.jsonsafe import from_json, to_json
from grpod.engine import (
    ChunkTrace,
    Engine,
    EngineConfig,
    EngineError,
    StepReport,
    TransportBatch,
)
from grpod.engine.context import ExecutionContext
from grpod.engine.data.inputs import without_reward_code
from grpod.engine.grpo.step import decide_step
from grpod.engine.state import distcp
from grpod.engine.verdict import Action, Finding, Outcome, Verdict
from grpod.forensics.blobs import BlobStore
from grpod.forensics.compare import REPLAY_RTOL, bit_equal, close, topology
from grpod.forensics.context import ContextRestore, recorded_context
from grpod.forensics.errors import ForensicsError
from grpod.forensics.models import Blob, Checkpoint, Step
from grpod.forensics.ranks import RankRecord
from grpod.forensics.store import Store

COMPARED = ("valid_tokens", "loss", "grad_norm")

Progress = Callable[[int, int, int], None]  # (done, total, step)


@dataclass
class ReplayResult:
    # True: bit-exact; a str: within REPLAY_RTOL in another topology, saying which; False
    reproduced: bool | str
    step: int
    recorded: dict[str, Any]  # COMPARED fields of the record (JSON-safe)
    replayed: dict[str, Any]  # the same fields from the replay
    # persistent | transient | healthy | inconclusive (diverged beyond REPLAY_RTOL where the
    # execution context differs: no verdict on the fault, see `context`)
    classification: str
    diverged_at: int | None  # first step whose compared fields differ
    field: str | None  # the first differing field at that step
    outcome: str  # the target step's recorded outcome
    verdict_action: str
    checkpoint_step: int
    steps_replayed: int
    incident_id: int | None = None
    note: str = ""  # e.g. why the target itself was not compared
    trace: list[dict[str, Any]] | None = field(default=None)  # per micro, per chunk
    # the recorded execution context (forensics/context.py): {"notes": [lines], "recorded":
    # every step had one, "restored": {field: {recorded, shell}}, "differs": [{field,
    # recorded, replayed, decides}]}
    context: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class PlannedStep:
    """One recorded step of a replay's plan (`replay_plan`), loaded and verified."""

    row: Step
    report: StepReport
    batch: TransportBatch
    context: ExecutionContext | None = None  # what it was computed under (None: unrecorded)
    ranks: list[RankRecord] = field(default_factory=list)  # the target's only


def classify(target: PlannedStep, reproduced: bool | str) -> str:
    """What a replay says of its target step: persistent (reproduced, and recorded as bad:
    not PASS, or not applied), healthy (reproduced, recorded as good) or transient."""
    bad = target.row.verdict_action != Action.PASS.name or target.row.outcome != Outcome.APPLIED
    return ("persistent" if bad else "healthy") if reproduced else "transient"


def plan_fields(
    plan: list[PlannedStep], checkpoint: Checkpoint, incident_id: int | None
) -> dict[str, Any]:
    """The `ReplayResult` fields a replay's plan decides: its target step (the last) as
    recorded, the checkpoint it started from and how many steps it ran."""
    target = plan[-1]
    return {
        "step": target.report.step,
        "outcome": target.row.outcome,
        "verdict_action": target.row.verdict_action,
        "checkpoint_step": checkpoint.step,
        "steps_replayed": len(plan),
        "incident_id": incident_id,
    }


def replay(
    run_dir: str | os.PathLike,
    step: int | None = None,
    incident_id: int | None = None,
    trace: bool = False,
    *,
    store_url: str = "",
    progress: Progress | None = None,
    rank: int | None = None,
) -> ReplayResult:
    """Replay `step` (or the step of `incident_id`) of the run in `run_dir`; `rank`: only that
    rank's part of a distributed target step, in this one process."""
    with opened_plan(run_dir, store_url, step, incident_id) as (store, planned):
        config, versions, checkpoint, plan = planned
        recorded_rank = None if rank is None else _rank_of(plan[-1], rank)
        process = ExecutionContext.capture()  # set again when the replay ends
        engine = restore_engine(store, config, checkpoint)
    part = engine.parallel.rank if engine.parallel.world_size > 1 else None
    if rank is not None and part is not None:
        raise ForensicsError("replay: --rank R runs in one process, not under torchrun")
    world = engine.parallel.world_size if part is not None else 1
    diverged_at = diverged_field = None
    differs: list[str] = []  # why numbers were within the tolerance, not equal (topology, context)
    replayed: StepReport | None = None
    contexts = ContextRestore(engine)
    try:
        for done, item in enumerate(plan):
            is_target = done == len(plan) - 1
            mine = rank if is_target and rank is not None else part
            if part is not None and item.report.world_size not in (1, world):
                raise ForensicsError(
                    f"step {item.report.step}: recorded on {item.report.world_size} ranks; "
                    f"replay it under torchrun with --nproc-per-node {item.report.world_size}, "
                    f"or in one process (not on {world} ranks)"
                )
            context_differs = contexts.before(item.context)
            alone = mine is not None and part is None
            replayed = rerun_step(engine, item, is_target, mine, alone=alone)
            compared = is_target or rank is None  # --rank: the steps before only get there
            if compared and item.row.outcome != Outcome.SKIPPED and diverged_at is None:
                own = recorded_rank if is_target else None
                why = topology(item.report.world_size, world, rank, len(plan))
                why = "; ".join(filter(None, [why, context_differs]))
                diverged_field, equal = _first_difference(item.report, replayed, own, why)
                if diverged_field is not None:
                    diverged_at = item.report.step
                    differs = [why] if why else []
                elif not equal:
                    differs.append(why)
            if progress is not None:
                progress(done + 1, len(plan), item.report.step)
    finally:
        engine.context = contexts.shell
        process.apply()
    target = plan[-1]
    reproduced: bool | str = diverged_at is None
    if reproduced and differs:
        reproduced = f"within {_rtol()} ({differs[-1]})"
    note = _note(target, versions, rank, len(plan))
    if diverged_at is not None:
        how = f"beyond {_rtol()} ({differs[0]})" if differs else "not bit-exact"
        note = "; ".join(filter(None, [f"diverged in {diverged_field}: {how}", note]))
    classification = classify(target, reproduced)
    if not reproduced and contexts.decisive:  # another machine's numbers: no word on the fault
        classification = "inconclusive"
    return ReplayResult(
        reproduced=reproduced,
        recorded=_fields(target.report, recorded_rank),
        replayed=_fields(replayed, None, local=rank is not None) if replayed is not None else {},
        classification=classification,
        diverged_at=diverged_at,
        field=diverged_field,
        note=note,
        trace=(
            _trace(target.report, replayed, recorded_rank)
            if trace and replayed is not None
            else None
        ),
        context=contexts.summary(),
        **plan_fields(plan, checkpoint, incident_id),
    )


@contextmanager
def opened_plan(
    run_dir: str | os.PathLike,
    store_url: str,
    step: int | None,
    incident_id: int | None,
    command: str = "replay",
) -> Iterator[tuple[Store, tuple[dict[str, Any], dict[str, str], Checkpoint, list[PlannedStep]]]]:
    """The run's store (schema checked; closed after) and the `replay_plan` of `step` or of
    `incident_id`'s step: exactly one of them (else `command`'s error says so)."""
    if (step is None) == (incident_id is None):
        raise ForensicsError(f"{command}: give exactly one of an incident id or --step")
    store = Store(run_dir, store_url, create=False)
    try:
        store.check_schema()
        yield store, replay_plan(store, step, incident_id)
    finally:
        store.close()


def replay_plan(
    store: Store, step: int | None, incident_id: int | None
) -> tuple[dict[str, Any], dict[str, str], Checkpoint, list[PlannedStep]]:
    """The run's config and software versions, the checkpoint, and every step from it to
    the target, verified."""
    blobs = BlobStore(store.run_dir)
    with store.session() as session:
        if incident_id is not None:
            incident = store.incident(session, incident_id)
            target = session.get(Step, incident.step_id)
            if incident.checkpoint_id is None:
                raise ForensicsError(
                    f"incident {incident_id}: no checkpoint was taken before step {incident.step}"
                )
            checkpoint = session.get(Checkpoint, incident.checkpoint_id)
        else:
            target = store.latest_step(session, step)
            checkpoint = store.checkpoint_at_or_before(session, target.step, on_disk=True)
            if checkpoint is None:
                raise ForensicsError(f"step {target.step}: no checkpoint at or before it")
        asked = f"step {target.step}"
        if incident_id is not None:
            asked = f"incident {incident_id} (step {target.step})"
        if checkpoint.deleted or not store.checkpoint_path(checkpoint).is_dir():
            raise ForensicsError(
                f"{asked}: cannot be rebuilt: checkpoint step {checkpoint.step}: missing "
                f"directory {store.checkpoint_path(checkpoint)}"
            )
        ordered = store.decided_steps(session, checkpoint.step, target)
        missing = sorted(set(range(checkpoint.step, target.step)) - {r.step for r in ordered})
        if missing:
            raise ForensicsError(
                f"{asked}: cannot be rebuilt: step {missing[0]} is not recorded, and replay "
                f"re-runs every step from checkpoint step {checkpoint.step} to step {target.step}"
            )
        found = [(row, _blob(session, row)) for row in ordered]
        gone = [row for row, blob in found if blob is None]
        if gone:
            raise ForensicsError(_pruned(store, session, asked, target, checkpoint, gone[0]))
        plan = [_load(blobs, row, blob) for row, blob in found]
        plan[-1] = replace(plan[-1], ranks=store.step_ranks(session, target))
        run = store.run(session, target.run_id)
        config, versions = json.loads(run.config_json), json.loads(run.versions_json)
        session.expunge_all()
    return config, versions, checkpoint, plan


def _blob(session: Any, row: Step) -> Blob | None:
    return None if row.batch_digest is None else session.get(Blob, row.batch_digest)


def _pruned(
    store: Store, session: Any, asked: str, target: Step, checkpoint: Checkpoint, row: Step
) -> str:
    """Why `asked` cannot be rebuilt: the batch of step `row` is gone (and, when the target's
    nearer checkpoints were pruned, which: replay starts from an older one)."""
    if row.step == target.step:
        return f"{asked}: cannot be rebuilt: its batch blob was pruned or never recorded"
    deleted = [
        c.step
        for c in store.checkpoints(session, include_deleted=True)
        if checkpoint.step < c.step <= target.step
        and (c.deleted or not store.checkpoint_path(c).is_dir())
    ]
    nearer = (
        f"checkpoint step {', '.join(map(str, deleted))} was pruned or removed, so replay "
        "starts from "
        if deleted
        else "replay starts from "
    )
    return (
        f"{asked}: cannot be rebuilt: {nearer}checkpoint step {checkpoint.step} and re-runs "
        f"steps {checkpoint.step}-{target.step - 1}, but the batch blob of step {row.step} was "
        "pruned or never recorded"
    )


def _load(blobs: BlobStore, row: Step, blob: Blob) -> PlannedStep:
    tensors, metadata = blobs.read(row.batch_digest, blob.data)
    try:
        batch = TransportBatch.from_tensors(tensors, metadata, source=f"blob {row.batch_digest}")
    except EngineError as exc:
        raise ForensicsError(str(exc)) from None
    report = StepReport.from_dict(json.loads(row.report_json))
    return PlannedStep(row, report, batch, recorded_context(row.context_json))


def _note(target: PlannedStep, versions: dict[str, str], rank: int | None, steps: int) -> str:
    """Why the comparison may say less than usual: a skipped target, other software where
    the steps have no recorded execution context (`ReplayResult.context` says the rest)."""
    notes = []
    if rank is not None and steps > 1:
        notes.append(
            f"--rank {rank}: the {steps - 1} steps before the target ran as one process on "
            "their global batches (equal to the distributed steps up to FP32 rounding)"
        )
    if target.row.outcome == Outcome.SKIPPED:
        notes.append(
            "the target was skipped without compute when recorded: computed now, compared "
            "only the steps before it"
        )
    for name in ("torch", "transformers") if target.context is None else ():
        recorded = versions.get(name)
        try:
            now = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            now = "unknown"
        if recorded not in (None, "unknown", now):
            notes.append(f"recorded with {name} {recorded}, replayed with {now}")
    return "; ".join(notes)


def restore_engine(store: Store, config: dict[str, Any], checkpoint: Checkpoint) -> Engine:
    try:
        engine_config = EngineConfig.model_validate(config["engine"])
    except (KeyError, TypeError, ValidationError) as exc:
        first = str(exc).splitlines()[0]
        raise ForensicsError(f"run config: no valid [engine] section ({first})") from None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a drill run's fault-injection warning
        engine = Engine(without_reward_code(engine_config))  # the run dir's code: never run
    path = store.checkpoint_path(checkpoint)
    try:
        # decisions come from the record, not guards; a DCP checkpoint loads unsharded too
        distcp.load(path, {"engine": engine}, engine.parallel)
    except EngineError as exc:
        raise ForensicsError(str(exc)) from None
    if engine.step != checkpoint.step:
        raise ForensicsError(
            f"checkpoint {path}: holds step {engine.step}, the store says {checkpoint.step}"
        )
    return engine


def rerun_step(
    engine: Engine, item: PlannedStep, compute_skipped: bool, part: int | None, alone: bool
) -> StepReport | None:
    """Run one recorded step as it was decided; a skipped step computes nothing (None) unless
    it is the target, which is computed and flushed to show what it would have done. `part`:
    run only that rank's part of a distributed step; `alone`: in one process, divided by the
    recorded global count."""
    batch, order = item.batch, item.report.micro_order
    if part is not None:
        try:
            batch = item.batch.part(part)
        except EngineError as exc:
            raise ForensicsError(str(exc)) from None
        first = sum(item.batch.rank_micros[:part])
        order = [m - first for m in order if first <= m < first + batch.num_micros]
    outcome = Outcome(item.row.outcome)
    policy = _AsRecorded(order, outcome, compute_skipped)
    divisor = _global_valid(item.report) if alone else None
    result = decide_step(engine, policy, batch, global_valid_tokens=divisor)
    return None if result.outcome is Outcome.SKIPPED else result.report


class _AsRecorded:
    """The `StepPolicy` of a recorded step: its micro order, and the update as it was
    decided (a skipped target is computed, then flushed)."""

    def __init__(self, micro_order: list[int], outcome: Outcome, compute_skipped: bool) -> None:
        self.micro_order, self.outcome, self.compute_skipped = micro_order, outcome, compute_skipped

    def before(
        self, batch: TransportBatch, *, per_micro_accounting: bool
    ) -> tuple[TransportBatch, list[Finding], bool]:
        skip = self.outcome is Outcome.SKIPPED and not self.compute_skipped
        return as_run(batch, self.micro_order), [], skip

    def after(self, batch: TransportBatch, report: StepReport) -> list[Finding]:
        return []

    def decide(self, findings: list[Finding]) -> Verdict:
        return Verdict(Action.PASS if self.outcome is Outcome.APPLIED else Action.FLUSH)

    def after_apply(self, model: torch.nn.Module) -> list[Finding]:
        return []


def as_run(batch: TransportBatch, micro_order: list[int]) -> TransportBatch:
    """The batch with its micros in `micro_order` (relative to the batch as rolled out),
    whether the recorded batch is the one rolled out or one already reordered."""
    identity = list(range(batch.num_micros))
    previous = batch.micro_order
    order = list(micro_order) or identity
    if previous is not None and list(previous) == order:
        return batch
    if previous is not None and list(previous) != identity:
        inverse = sorted(range(len(previous)), key=previous.__getitem__)
        batch = batch.reorder(inverse)
    return batch if order == identity else batch.reorder(order)


def _rank_of(target: PlannedStep, rank: int) -> RankRecord:
    """Rank `rank`'s record of the target step (its `step_ranks` row)."""
    for record in target.ranks:
        if record.rank == rank:
            return record
    step = target.report.step
    if not target.ranks:
        raise ForensicsError(
            f"step {step}: --rank {rank}: the step ran in one process (not a distributed "
            "step): replay it without --rank"
        )
    valid = ", ".join(str(r.rank) for r in sorted(target.ranks, key=lambda r: r.rank))
    raise ForensicsError(
        f"step {step}: no rank {rank}: it ran on {len(target.ranks)} ranks (valid: --rank {valid})"
    )


def _first_difference(
    recorded: StepReport,
    replayed: StepReport,
    rank: RankRecord | None = None,
    other_topology: str = "",
) -> tuple[str | None, bool]:
    """(the first compared field that differs, whether every field was bit-equal); `rank`:
    that rank's local fields; `other_topology`: why the replay's reduction order is not the
    record's, so floats may differ by REPLAY_RTOL (counts never)."""
    mine, theirs = _fields(recorded, rank), _fields(replayed, None, local=rank is not None)
    equal = True
    for name in mine:
        a, b = from_json(mine[name]), from_json(theirs[name])
        if bit_equal(a, b):
            continue
        equal = False
        exact = not other_topology or (isinstance(a, int) and isinstance(b, int))
        if exact or not close(a, b):
            return name, False
    return None, equal


def _rtol() -> str:
    return f"{REPLAY_RTOL:.0e}".replace("e-0", "e-")  # 1e-6


def _global_valid(report: StepReport) -> int:
    """The step's loss divisor: the global count of a distributed step, else the count."""
    if report.world_size == 1 or report.global_valid_tokens is None:
        return report.valid_tokens
    return report.global_valid_tokens


def _fields(report: StepReport, rank: RankRecord | None, local: bool = False) -> dict[str, Any]:
    """The compared numbers: global valid tokens, loss, grad norm; `rank` (recorded) or
    `local` (replayed): one rank's local valid tokens and local loss."""
    if rank is not None:
        return {"valid_tokens": rank.valid_tokens, "local_loss": to_json(rank.local_loss)}
    if local:
        return {"valid_tokens": report.valid_tokens, "local_loss": to_json(report.local_loss)}
    values = (_global_valid(report), report.loss, report.grad_norm)
    return {name: to_json(v) for name, v in zip(COMPARED, values)}


def _trace(
    recorded: StepReport, replayed: StepReport, rank: RankRecord | None
) -> list[dict[str, Any]]:
    if rank is not None:  # that rank's own recorded trace
        chunks = [ChunkTrace(**c) for c in rank.report["chunk_trace"]]
        recorded = replace(recorded, chunk_trace=chunks)
    rows = []
    for index in range(max(len(recorded.chunk_trace), len(replayed.chunk_trace))):
        rec = recorded.chunk_trace[index] if index < len(recorded.chunk_trace) else None
        new = replayed.chunk_trace[index] if index < len(replayed.chunk_trace) else None
        first = rec or new
        rows.append(
            {
                "micro": first.micro,
                "chunk": first.chunk,
                "recorded_valid_tokens": None if rec is None else rec.valid_tokens,
                "replayed_valid_tokens": None if new is None else new.valid_tokens,
                "recorded_loss_sum": None if rec is None else to_json(rec.loss_sum),
                "replayed_loss_sum": None if new is None else to_json(new.loss_sum),
                "recorded_counter_after": None if rec is None else rec.counter_after,
                "replayed_counter_after": None if new is None else new.counter_after,
                "equal": rec is not None
                and new is not None
                and rec.valid_tokens == new.valid_tokens
                and bit_equal(rec.loss_sum, new.loss_sum),
            }
        )
    return rows
