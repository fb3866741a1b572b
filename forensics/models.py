"""The store's tables (SQLAlchemy 2 declarative). Migrations in `migrations/` create them.

Scalar columns are for querying; `steps.report_json` is the authoritative record of a step
and `step_ranks.report_json` of one rank's part of it (SQLite stores a NaN REAL as NULL, the
JSON keeps it as "nan").
"""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import (
    BigInteger,
    Boolean,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    String,
    Text,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column


class Base(DeclarativeBase):
    pass


class RunStepRow:
    """The id, run and step a per-run table opens with (migrations/columns.py
    `run_step_columns`): an incident's `step` is its episode's first, an eval's the engine
    cursor (steps taken before it), a checkpoint's the cursor when saved."""

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    run_id: Mapped[str] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"))
    step: Mapped[int] = mapped_column(Integer)


class Run(Base):
    __tablename__ = "runs"

    id: Mapped[str] = mapped_column(String(128), primary_key=True)
    run_dir: Mapped[str] = mapped_column(Text)  # absolute path when the run started
    config_json: Mapped[str] = mapped_column(Text)  # {engine, guards, forensics, daemon}
    config_digest: Mapped[str] = mapped_column(String(64))  # sha256 of the canonical JSON
    versions_json: Mapped[str] = mapped_column(Text)  # {"grpod": .., "torch": .., ...}
    device: Mapped[str] = mapped_column(String(256))
    started_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    ended_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))


class Blob(Base):
    __tablename__ = "blobs"

    sha256: Mapped[str] = mapped_column(String(64), primary_key=True)  # canonical content digest
    size: Mapped[int] = mapped_column(BigInteger)  # safetensors bytes (file or `data`)
    kind: Mapped[str] = mapped_column(String(32))  # "batch"
    path: Mapped[str] = mapped_column(Text)  # relative to the run directory; "" when inline
    # the safetensors bytes of a small blob (`[forensics] inline_blob_bytes`), committed with
    # its row instead of a file; loaded only when read
    data: Mapped[bytes | None] = mapped_column(LargeBinary, nullable=True, deferred=True)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))


class Step(RunStepRow, Base):
    """One recorded step: its outcome, every StepReport scalar, the verdict, the batch digest."""

    __tablename__ = "steps"
    __table_args__ = (Index("ix_steps_run_step", "run_id", "step"),)

    outcome: Mapped[str] = mapped_column(String(16))  # applied | flushed | skipped
    rerun: Mapped[bool] = mapped_column(Boolean, default=False)
    verdict_action: Mapped[str] = mapped_column(String(8))  # PASS | WARN | FLUSH | HALT
    verdict_json: Mapped[str] = mapped_column(Text)  # {"action", "findings": [...]}
    batch_digest: Mapped[str | None] = mapped_column(String(64))  # blobs.sha256 (may be pruned)
    report_json: Mapped[str] = mapped_column(Text)  # StepReport.to_dict()
    # the ExecutionContext it was computed under (engine/context.py; schema 0006; NULL before)
    context_json: Mapped[str | None] = mapped_column(Text, nullable=True)
    recorded_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    # every StepReport scalar (StepReport.SCALARS)
    valid_tokens: Mapped[int] = mapped_column(Integer)
    expected_valid_tokens: Mapped[int] = mapped_column(Integer)
    loss: Mapped[float | None] = mapped_column(Float)
    grad_norm: Mapped[float | None] = mapped_column(Float)
    clip_coef: Mapped[float | None] = mapped_column(Float)
    lr: Mapped[float | None] = mapped_column(Float)
    reward_mean: Mapped[float | None] = mapped_column(Float)
    reward_std: Mapped[float | None] = mapped_column(Float)
    zero_std_group_fraction: Mapped[float | None] = mapped_column(Float)
    advantage_abs_max: Mapped[float | None] = mapped_column(Float)
    kl: Mapped[float | None] = mapped_column(Float)
    entropy: Mapped[float | None] = mapped_column(Float)  # policy entropy, nats (0003)
    clip_fraction_low: Mapped[float | None] = mapped_column(Float)
    clip_fraction_high: Mapped[float | None] = mapped_column(Float)
    mismatch_mean: Mapped[float | None] = mapped_column(Float)
    mismatch_p90: Mapped[float | None] = mapped_column(Float)
    mismatch_p99: Mapped[float | None] = mapped_column(Float)
    mismatch_max: Mapped[float | None] = mapped_column(Float)
    mismatch_frac_above_0_1: Mapped[float | None] = mapped_column(Float)
    completion_length_mean: Mapped[float | None] = mapped_column(Float)
    completion_length_max: Mapped[int] = mapped_column(Integer)
    num_micros: Mapped[int] = mapped_column(Integer)
    num_samples: Mapped[int] = mapped_column(Integer)


class StepRank(Base):
    """One rank's part of a recorded distributed step (schema 0005): its micros and samples
    in the step's global batch blob (`TransportBatch.part(rank)`), its counts and local loss.

    Rows exist only for a step recorded with `rank_reports`; a re-run step's record has its
    own. `batch_digest` is the step's: a rank's batch is a slice of the one global blob, so
    whatever keeps the step's blob (an incident's pin) keeps every rank's batch.
    """

    __tablename__ = "step_ranks"
    __table_args__ = (
        Index("ux_step_ranks_step_rank", "step_id", "rank", unique=True),
        Index("ix_step_ranks_run_step_rank", "run_id", "step", "rank"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    step_id: Mapped[int] = mapped_column(ForeignKey("steps.id", ondelete="CASCADE"))
    run_id: Mapped[str] = mapped_column(String(128))
    step: Mapped[int] = mapped_column(Integer)
    rank: Mapped[int] = mapped_column(Integer)
    batch_digest: Mapped[str | None] = mapped_column(String(64))  # the step's blobs.sha256
    first_micro: Mapped[int] = mapped_column(Integer)  # [first_micro, +num_micros) of the blob
    num_micros: Mapped[int] = mapped_column(Integer)
    first_sample: Mapped[int] = mapped_column(Integer)  # [first_sample, +num_samples)
    num_samples: Mapped[int] = mapped_column(Integer)
    valid_tokens: Mapped[int] = mapped_column(Integer)  # the rank's local count
    expected_valid_tokens: Mapped[int] = mapped_column(Integer)
    local_loss: Mapped[float | None] = mapped_column(Float)  # loss sum / global valid tokens
    report_json: Mapped[str] = mapped_column(Text)  # the rank's `rank_reports` dict


class Checkpoint(RunStepRow, Base):
    """A checkpoint directory noted by the daemon; `step` = the engine cursor when saved."""

    __tablename__ = "checkpoints"
    __table_args__ = (Index("ix_checkpoints_run_step", "run_id", "step"),)

    path: Mapped[str] = mapped_column(Text)  # relative to the run directory when inside it
    pinned: Mapped[bool] = mapped_column(Boolean, default=False)  # an incident needs it
    deleted: Mapped[bool] = mapped_column(Boolean, default=False)  # removed by retention
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))


class Incident(RunStepRow, Base):
    """An episode: one guard's finding of one kind over consecutive steps (schema 0003).

    It opens at the first step with the finding at or above the incident action, grows
    (`last_step`, `steps_count`, the worst step so far) while the finding persists, and
    closes after `[forensics] episode_gap_steps` steps without it. It pins its first and its
    worst step, each with the checkpoint before it and the batches in between. Incidents of
    stores before 0003 were one per step: `guard` NULL, a closed episode of one step.
    """

    __tablename__ = "incidents"

    step_id: Mapped[int] = mapped_column(ForeignKey("steps.id"))
    action: Mapped[str] = mapped_column(String(8))  # the highest action of the episode
    verdict_json: Mapped[str] = mapped_column(Text)  # the first step's verdict
    findings_json: Mapped[str] = mapped_column(Text)  # the first (and the worst) finding
    checkpoint_id: Mapped[int | None] = mapped_column(ForeignKey("checkpoints.id"))
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    guard: Mapped[str | None] = mapped_column(String(64))
    kind: Mapped[str | None] = mapped_column(String(64))
    last_step: Mapped[int | None] = mapped_column(Integer)
    steps_count: Mapped[int] = mapped_column(Integer, server_default="1")  # steps with it
    worst_step: Mapped[int | None] = mapped_column(Integer)
    worst_step_id: Mapped[int | None] = mapped_column(Integer)  # steps.id
    worst_checkpoint_id: Mapped[int | None] = mapped_column(Integer)  # checkpoints.id, pinned
    status: Mapped[str] = mapped_column(String(8), server_default="closed")  # open | closed
    closed_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))


class IncidentAttribution(Base):
    """The per-sample attribution of an incident's first step (schema 0008), computed off
    the training path (forensics/incident_attribution.py), or why there is none.

    `status`: done (`attribution_json` is `StepAttribution.to_dict()`), skipped (too large,
    too many pending, attribution off), failed (timed out, over its memory, an error) or
    stopped (the daemon exited first); `note` says which, in one line.
    """

    __tablename__ = "incident_attributions"
    __table_args__ = (Index("ux_incident_attributions_incident", "incident_id", unique=True),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    incident_id: Mapped[int] = mapped_column(ForeignKey("incidents.id", ondelete="CASCADE"))
    step: Mapped[int] = mapped_column(Integer)
    status: Mapped[str] = mapped_column(String(16))
    note: Mapped[str] = mapped_column(Text)
    seconds: Mapped[float | None] = mapped_column(Float)
    attribution_json: Mapped[str | None] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))


class Eval(RunStepRow, Base):
    """One held-out evaluation (`[engine] eval_task`) of the policy after `step` steps."""

    __tablename__ = "evals"
    __table_args__ = (Index("ix_evals_run_step", "run_id", "step"),)

    samples: Mapped[int] = mapped_column(Integer)
    temperature: Mapped[float] = mapped_column(Float)  # 0 = greedy
    rewards_json: Mapped[str] = mapped_column(Text)  # {"total": mean, "mod:f": mean, ...}
    completion_length_mean: Mapped[float] = mapped_column(Float)
    seconds: Mapped[float] = mapped_column(Float)
    recorded_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))


class PromptFate(RunStepRow, Base):
    """A prompt's fate in the ledger (schema 0007_prompt_ledger; forensics/ledger.py): trained,
    flushed or skipped at `step`, or evaluated. Rows are keyed by (epoch, prompt_id) and carry
    their step; a resumed run supersedes the rows of the steps it re-runs."""

    __tablename__ = "prompt_ledger"
    __table_args__ = (
        Index("ix_prompt_ledger_run_prompt", "run_id", "prompt_id"),
        Index("ix_prompt_ledger_run_step", "run_id", "step"),
    )

    # `step` (RunStepRow): the step that decided it (eval: the cursor)
    fate: Mapped[str] = mapped_column(String(16))  # trained | flushed | skipped | eval
    prompt_id: Mapped[int] = mapped_column(BigInteger)  # its data stream position (eval: index)
    epoch: Mapped[int | None] = mapped_column(Integer)  # prompt_id // epoch_size (eval: NULL)
    epoch_size: Mapped[int | None] = mapped_column(Integer)  # the task's prompts (NULL: generated)
    task_row: Mapped[int | None] = mapped_column(Integer)  # its row of the task (NULL: generated)
    generation_pass: Mapped[int] = mapped_column(Integer)  # step % epochs
    rank: Mapped[int] = mapped_column(Integer)  # the torchrun rank that trained it
    stale_drops: Mapped[int] = mapped_column(Integer)  # its step's rollouts dropped as too stale
    reason: Mapped[str] = mapped_column(Text)  # the guards behind a flush or skip ("" trained)
    superseded: Mapped[bool] = mapped_column(Boolean, default=False)  # re-run after a resume
    recorded_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
