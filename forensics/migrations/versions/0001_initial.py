"""The initial forensic store: runs, blobs, steps, checkpoints, incidents.

Revision ID: 0001
Revises:
Create Date: 2026-11-29
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from grpod.forensics.migrations.columns import run_step_columns

revision = "0001"
down_revision = None

TS = sa.DateTime(timezone=True)


def upgrade() -> None:
    op.create_table(
        "runs",
        sa.Column("id", sa.String(128), primary_key=True),
        sa.Column("run_dir", sa.Text, nullable=False),
        sa.Column("config_json", sa.Text, nullable=False),
        sa.Column("config_digest", sa.String(64), nullable=False),
        sa.Column("versions_json", sa.Text, nullable=False),
        sa.Column("device", sa.String(256), nullable=False),
        sa.Column("started_at", TS, nullable=False),
        sa.Column("ended_at", TS, nullable=True),
    )
    op.create_table(
        "blobs",
        sa.Column("sha256", sa.String(64), primary_key=True),
        sa.Column("size", sa.BigInteger, nullable=False),
        sa.Column("kind", sa.String(32), nullable=False),
        sa.Column("path", sa.Text, nullable=False),
        sa.Column("created_at", TS, nullable=False),
    )
    op.create_table(
        "steps",
        *run_step_columns(),
        sa.Column("outcome", sa.String(16), nullable=False),
        sa.Column("rerun", sa.Boolean, nullable=False),
        sa.Column("verdict_action", sa.String(8), nullable=False),
        sa.Column("verdict_json", sa.Text, nullable=False),
        sa.Column("batch_digest", sa.String(64), nullable=True),
        sa.Column("report_json", sa.Text, nullable=False),
        sa.Column("recorded_at", TS, nullable=False),
        sa.Column("valid_tokens", sa.Integer, nullable=False),
        sa.Column("expected_valid_tokens", sa.Integer, nullable=False),
        *(
            sa.Column(name, sa.Float, nullable=True)
            for name in (
                "loss",
                "grad_norm",
                "clip_coef",
                "lr",
                "reward_mean",
                "reward_std",
                "zero_std_group_fraction",
                "advantage_abs_max",
                "kl",
                "clip_fraction_low",
                "clip_fraction_high",
                "mismatch_mean",
                "mismatch_p90",
                "mismatch_p99",
                "mismatch_max",
                "mismatch_frac_above_0_1",
                "completion_length_mean",
            )
        ),
        sa.Column("completion_length_max", sa.Integer, nullable=False),
        sa.Column("num_micros", sa.Integer, nullable=False),
        sa.Column("num_samples", sa.Integer, nullable=False),
    )
    op.create_index("ix_steps_run_step", "steps", ["run_id", "step"])
    op.create_table(
        "checkpoints",
        *run_step_columns(),
        sa.Column("path", sa.Text, nullable=False),
        sa.Column("pinned", sa.Boolean, nullable=False),
        sa.Column("deleted", sa.Boolean, nullable=False),
        sa.Column("created_at", TS, nullable=False),
    )
    op.create_index("ix_checkpoints_run_step", "checkpoints", ["run_id", "step"])
    op.create_table(
        "incidents",
        *run_step_columns(),
        sa.Column("step_id", sa.Integer, sa.ForeignKey("steps.id"), nullable=False),
        sa.Column("action", sa.String(8), nullable=False),
        sa.Column("verdict_json", sa.Text, nullable=False),
        sa.Column("findings_json", sa.Text, nullable=False),
        sa.Column("checkpoint_id", sa.Integer, sa.ForeignKey("checkpoints.id"), nullable=True),
        sa.Column("created_at", TS, nullable=False),
    )


def downgrade() -> None:
    op.drop_table("incidents")
    op.drop_index("ix_checkpoints_run_step", "checkpoints")
    op.drop_table("checkpoints")
    op.drop_index("ix_steps_run_step", "steps")
    op.drop_table("steps")
    op.drop_table("blobs")
    op.drop_table("runs")
