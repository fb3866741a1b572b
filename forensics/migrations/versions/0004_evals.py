"""Held-out evaluations: one `evals` row per evaluation of the policy.

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from grpod.forensics.migrations.columns import run_step_columns

revision = "0004"
down_revision = "0003"


def upgrade() -> None:
    op.create_table(
        "evals",
        *run_step_columns(),
        sa.Column("samples", sa.Integer, nullable=False),
        sa.Column("temperature", sa.Float, nullable=False),
        sa.Column("rewards_json", sa.Text, nullable=False),
        sa.Column("completion_length_mean", sa.Float, nullable=False),
        sa.Column("seconds", sa.Float, nullable=False),
        sa.Column("recorded_at", sa.DateTime(timezone=True), nullable=False),
    )
    op.create_index("ix_evals_run_step", "evals", ["run_id", "step"])


def downgrade() -> None:
    op.drop_index("ix_evals_run_step", table_name="evals")
    op.drop_table("evals")
