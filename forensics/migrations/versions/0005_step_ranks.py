"""Distributed steps: one `step_ranks` row per rank of a step recorded with `rank_reports`.

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-08

Steps recorded before it keep their ranks only in `steps.report_json`, which readers fall
back to (forensics/ranks.py).
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from grpod.forensics.migrations.columns import row_id

revision = "0005"
down_revision = "0004"


def upgrade() -> None:
    op.create_table(
        "step_ranks",
        row_id(),
        sa.Column(
            "step_id", sa.Integer, sa.ForeignKey("steps.id", ondelete="CASCADE"), nullable=False
        ),
        sa.Column("run_id", sa.String(128), nullable=False),
        sa.Column("step", sa.Integer, nullable=False),
        sa.Column("rank", sa.Integer, nullable=False),
        sa.Column("batch_digest", sa.String(64), nullable=True),
        sa.Column("first_micro", sa.Integer, nullable=False),
        sa.Column("num_micros", sa.Integer, nullable=False),
        sa.Column("first_sample", sa.Integer, nullable=False),
        sa.Column("num_samples", sa.Integer, nullable=False),
        sa.Column("valid_tokens", sa.Integer, nullable=False),
        sa.Column("expected_valid_tokens", sa.Integer, nullable=False),
        sa.Column("local_loss", sa.Float, nullable=True),
        sa.Column("report_json", sa.Text, nullable=False),
    )
    op.create_index("ux_step_ranks_step_rank", "step_ranks", ["step_id", "rank"], unique=True)
    op.create_index("ix_step_ranks_run_step_rank", "step_ranks", ["run_id", "step", "rank"])


def downgrade() -> None:
    # every rank's numbers are also in its step's report_json: nothing is lost
    op.drop_index("ix_step_ranks_run_step_rank", table_name="step_ranks")
    op.drop_index("ux_step_ranks_step_rank", table_name="step_ranks")
    op.drop_table("step_ranks")
